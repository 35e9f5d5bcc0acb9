"""Chat template: glm5's own renderer vs `transformers.AutoTokenizer.apply_chat_template` (same ids),
the GLM-5 prompt format, SFT loss masks, and a tokenizer directory in the real GLM file format."""

import json
from pathlib import Path

import pytest

from glm5.core.resources import bundled
from glm5.data.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

ASSET = bundled("tokenizer-8k")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather (天气) for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "北京", "days": 2}}}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hello! 你好"}],
    "system": [{"role": "system", "content": "You are GLM."}, {"role": "user", "content": "2+2?"}],
    "multi_turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Write code"},
        {"role": "assistant", "content": "```py\ndef f():\n    return 1\n```"},
        {"role": "user", "content": "Thanks"}],
    "tool_results": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Beijing?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 3}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "second result"},
        {"role": "assistant", "content": "It is 3°C.", "reasoning_content": "Read the result."},
        {"role": "user", "content": "And tomorrow?"}],
    "content_parts": [{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                                   {"type": "text", "text": "part two"}]}],
}


@pytest.fixture(scope="module")
def both():
    return load_tokenizer(ASSET), transformers.AutoTokenizer.from_pretrained(str(ASSET))


def hf_ids(hf, messages, **kw):
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_parity_with_transformers(both, name, thinking, tools):
    ours, hf = both
    msgs = CONVERSATIONS[name]
    for gen in (True, False):
        kw = dict(tools=tools, add_generation_prompt=gen, enable_thinking=thinking)
        assert ours.apply_chat_template(msgs, **kw) == hf_ids(hf, msgs, **kw)
        assert ours.apply_chat_template(msgs, tokenize=False, **kw) == hf.apply_chat_template(msgs, tokenize=False, **kw)
    kw = dict(tools=tools, add_generation_prompt=True, enable_thinking=thinking, clear_thinking=False)
    assert ours.apply_chat_template(msgs, **kw) == hf_ids(hf, msgs, **kw)


def test_prompt_format(both):
    ours, _ = both
    render = lambda msgs, **kw: ours.apply_chat_template(msgs, tokenize=False, **kw)  # noqa: E731
    assert render(CONVERSATIONS["single"]) == "[gMASK]<sop><|user|>Hello! 你好<|assistant|><think>"
    assert render(CONVERSATIONS["single"], enable_thinking=False).endswith("<|assistant|><think></think>")
    text = render(CONVERSATIONS["tool_results"], tools=TOOLS)
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools\n")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text
    # Reasoning before the last user message is cleared; tool results share one <|observation|>.
    assert ("<|assistant|><think></think><tool_call>get_weather<arg_key>city</arg_key><arg_value>北京"
            "</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>") in text
    assert ("<|observation|><tool_response>{\"temp_c\": 3}</tool_response>"
            "<tool_response>second result</tool_response><|assistant|>") in text
    # Preserved thinking: clear_thinking=False keeps earlier reasoning_content.
    kept = render(CONVERSATIONS["tool_results"], tools=TOOLS, clear_thinking=False)
    assert "<think>Call the tool.</think><tool_call>" in kept and "<think>Read the result.</think>It is 3°C." in kept
    # During a tool loop (no user message after the call) the reasoning stays.
    loop = render(CONVERSATIONS["tool_results"][:4])
    assert "<|assistant|><think>Call the tool.</think><tool_call>" in loop


def test_openai_string_arguments_render_like_dicts(both):
    ours, _ = both
    as_string = json.loads(json.dumps(CONVERSATIONS["tool_results"]))
    as_string[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "北京", "days": 2})
    assert ours.apply_chat_template(as_string) == ours.apply_chat_template(CONVERSATIONS["tool_results"])


def test_sft_loss_mask(both):
    ours, _ = both
    msgs = CONVERSATIONS["tool_results"][:6]
    ids, mask = ours.encode_chat(msgs)
    assert len(ids) == len(mask) and ids[-1] == ours.eos_token_id and mask[-1] == 1
    trained = ours.decode([i for i, m in zip(ids, mask) if m])
    # No user message after the tool loop, so both turns keep their reasoning.
    assert trained == ("<think>Call the tool.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value>"
                       "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call><|observation|>"
                       "<think>Read the result.</think>It is 3°C.<|endoftext|>")
    prompt = ours.decode([i for i, m in zip(ids, mask) if not m])
    assert prompt.startswith("[gMASK]<sop><|system|>Use tools") and "Weather in Beijing?" in prompt


GLM_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>",
                "<|begin_of_video|>", "<|end_of_video|>", "<|begin_of_audio|>", "<|end_of_audio|>",
                "<|begin_of_transcription|>", "<|end_of_transcription|>", "<|code_prefix|>",
                "<|code_middle|>", "<|code_suffix|>", "/nothink", "<think>", "</think>", "<tool_call>",
                "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>",
                "<arg_value>", "</arg_value>"]


def write_glm_format_dir(path: Path):
    """A tokenizer directory laid out like zai-org/GLM-5's: BPE + GLM split regex + ByteLevel, GLM's
    special tokens (multimodal ones included) after the BPE ids, no post-processor, a
    TokenizersBackend tokenizer_config.json, and the template in chat_template.jinja."""
    from glm5.data.tokenizer_cli import build_empty_tokenizer
    from tokenizers import AddedToken, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    tok = build_empty_tokenizer()
    texts = ["Hello world, this is GLM.", "你好，世界。", "def f(x):\n    return x"] * 20
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                       initial_alphabet=ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in GLM_SPECIALS])
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"backend": "tokenizers", "clean_up_tokenization_spaces": False, "do_lower_case": False,
              "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "extra_special_tokens": GLM_SPECIALS,
              "model_max_length": 202752, "padding_side": "left", "remove_space": False,
              "tokenizer_class": "TokenizersBackend"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text((ASSET / "chat_template.jinja").read_text())
    return tok


def test_glm_format_directory_loads_like_transformers(tmp_path):
    raw = write_glm_format_dir(tmp_path / "glm")
    ours = load_tokenizer(tmp_path / "glm")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "glm"))
    assert ours.special_tokens["<|endoftext|>"] == raw.token_to_id("<|endoftext|>") == ours.eos_token_id
    assert "<|begin_of_image|>" in ours.all_special_ids
    text = "Hello 你好 <|begin_of_image|>/nothink<think>x</think>\n    return 😀"
    assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"] == raw.encode(text).ids
    assert ours.decode(ours.encode(text)) == text
    assert ours.decode(ours.encode(text), skip_special_tokens=True) == hf.decode(
        hf(text, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
    for msgs in CONVERSATIONS.values():
        for thinking in (True, False):
            assert ours.apply_chat_template(msgs, tools=TOOLS, enable_thinking=thinking) == hf_ids(
                hf, msgs, tools=TOOLS, add_generation_prompt=True, enable_thinking=thinking)
