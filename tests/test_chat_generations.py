"""Chat-template semantics per GLM generation when a checkpoint ships no template: glm4_moe gets GLM-4.5/4.6's
format, glm4_moe_lite / glm_moe_dsa GLM-4.7/5's. The expected texts are what the released templates give
(zai-org GLM-4.5 and GLM-4.7 `chat_template.jinja`, rendered with jinja2 as transformers does, on these
messages): GLM-4.5 writes "\\n<think></think>" for a turn without (or with cleared) reasoning, newlines after
the roles and in tool calls, and /nothink on user turns when thinking is off; GLM-4.7/5 a bare "</think>"."""

import json

import numpy as np
import pytest

from glm5.data.chat_template import default_chat_template, render
from glm5.data.sft import ChatExample, encode_example
from glm5.data.tokenizer import load_tokenizer
from glm5.serve.parsers import select_tool_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_RUN = [
    {"role": "system", "content": "Use tools"}, {"role": "user", "content": "Weather in Beijing?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "北京", "days": 2}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp_c\": 3}"},
    {"role": "tool", "tool_call_id": "c1", "content": "second result"},
    {"role": "assistant", "content": "It is 3°C.", "reasoning_content": "Read the result."},
    {"role": "user", "content": "Thanks"}]
LOOP = [{"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need tool.", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Oslo", "opts": {"u": "c"}}}}]},
        {"role": "tool", "content": "12"}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "greet"}, {"role": "user", "content": "and?"}]
INLINE = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"}]
TOOLS_HEAD = ("[gMASK]<sop><|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
              + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>\n\nFor each function call, output the "
              "function name and arguments within the following XML format:\n")

EXPECTED = {  # (generation, case): released template's text
    ("glm45", "tools"): TOOLS_HEAD + (
        "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
        "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
        "<|system|>\nUse tools<|user|>\nWeather in Beijing?<|assistant|>\n<think></think>\n<tool_call>get_weather\n"
        "<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n"
        "</tool_call><|observation|>\n<tool_response>\n{\"temp_c\": 3}\n</tool_response>\n<tool_response>\n"
        "second result\n</tool_response><|assistant|>\n<think></think>\nIt is 3°C.<|user|>\nThanks<|assistant|>"),
    ("glm45", "loop"): (
        "[gMASK]<sop><|user|>\nWeather?/nothink<|assistant|>\n<think>Need tool.</think>\nLet me check.\n"
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>opts</arg_key>\n"
        "<arg_value>{\"u\": \"c\"}</arg_value>\n</tool_call><|observation|>\n<tool_response>\n12\n</tool_response>"
        "<|assistant|>\n<think></think>"),
    ("glm45", "chat"): ("[gMASK]<sop><|system|>\nBe brief.<|user|>\nhi/nothink<|assistant|>\n<think></think>\nhello"
                        "<|user|>\nand?/nothink<|assistant|>\n<think></think>"),
    ("glm45", "inline"): "[gMASK]<sop><|user|>\nq<|assistant|>\n<think>hmm</think>\nanswer",
    ("glm47", "tools"): TOOLS_HEAD + (
        "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>"
        "{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call><|system|>Use tools<|user|>"
        "Weather in Beijing?<|assistant|></think><tool_call>get_weather<arg_key>city</arg_key><arg_value>北京"
        "</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call><|observation|><tool_response>"
        "{\"temp_c\": 3}</tool_response><tool_response>second result</tool_response><|assistant|></think>"
        "It is 3°C.<|user|>Thanks<|assistant|><think>"),
    ("glm47", "loop"): (
        "[gMASK]<sop><|user|>Weather?<|assistant|><think>Need tool.</think>Let me check.<tool_call>get_weather"
        "<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>opts</arg_key><arg_value>{\"u\": \"c\"}"
        "</arg_value></tool_call><|observation|><tool_response>12</tool_response><|assistant|></think>"),
    ("glm47", "chat"): "[gMASK]<sop><|system|>Be brief.<|user|>hi<|assistant|></think>hello<|user|>and?<|assistant|></think>",
    ("glm47", "inline"): "[gMASK]<sop><|user|>q<|assistant|><think>hmm</think>answer",
}
CASES = {"tools": (TOOL_RUN, dict(tools=TOOLS, add_generation_prompt=True, enable_thinking=True)),
         "loop": (LOOP, dict(add_generation_prompt=True, enable_thinking=False)),
         "chat": (CHAT, dict(add_generation_prompt=True, enable_thinking=False)),
         "inline": (INLINE, dict(add_generation_prompt=False))}
MODEL_TYPES = {"glm45": ["glm4_moe"], "glm47": ["glm4_moe_lite", "glm_moe_dsa"]}


@pytest.mark.parametrize("generation,case", sorted(EXPECTED))
def test_default_template_renders_as_the_released_one(generation, case):
    msgs, kw = CASES[case]
    for model_type in MODEL_TYPES[generation]:
        assert render(default_chat_template(model_type), msgs, **kw) == EXPECTED[generation, case], model_type


def test_preserved_thinking_only_where_the_generation_has_it():
    """GLM-4.7/5 keep earlier reasoning with clear_thinking=false; GLM-4.5's template has no such switch."""
    kept = render(default_chat_template("glm4_moe_lite"), CHAT, clear_thinking=False)
    assert "<|assistant|><think>greet</think>hello" in kept
    assert "<think>greet</think>" not in render(default_chat_template("glm4_moe"), CHAT, clear_thinking=False)


def test_checkpoint_without_a_template_gets_its_generations(tmp_path):
    bundled = load_tokenizer("bundled:tokenizer-8k")
    for model_type, generation in (("glm4_moe", "glm45"), ("glm4_moe_lite", "glm47"), ("glm_moe_dsa", "glm47")):
        ckpt = tmp_path / model_type
        bundled.save(ckpt)
        (ckpt / "chat_template.jinja").unlink()  # a checkpoint that ships no template
        (ckpt / "config.json").write_text(json.dumps({"model_type": model_type}))
        tok = load_tokenizer(ckpt)
        assert tok.apply_chat_template(CHAT, tokenize=False, enable_thinking=False) == EXPECTED[generation, "chat"]
        parser = select_tool_parser("auto", tok.chat_template, model_type)
        assert parser == generation  # the tool-call layout it prompts is the one parsed
    assert load_tokenizer(tmp_path / "glm4_moe", model_type="glm4_moe_lite").chat_template == \
        default_chat_template("glm4_moe_lite")  # an explicit model_type wins
    (tmp_path / "glm4_moe" / "config.json").unlink()
    assert load_tokenizer(tmp_path / "glm4_moe").chat_template == default_chat_template()  # glm5's own


def test_sft_gives_no_loss_to_a_cleared_turns_bare_think_end(tmp_path):
    load_tokenizer("bundled:tokenizer-8k").save(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    tok = load_tokenizer(tmp_path, model_type="glm4_moe_lite")
    msgs = [*CHAT, {"role": "assistant", "content": "fine", "reasoning_content": "ok"}]
    ids, mask = encode_example(tok, ChatExample(msgs), keep_reasoning=False)
    trained = tok.decode(ids[mask])
    assert trained.startswith("hello<|user|>") and "<think>ok</think>fine" in trained
    end = tok.token_to_id("</think>")
    first = int(np.flatnonzero(ids == end)[0])  # the cleared turn's bare </think>: prompt, not target
    assert not mask[first] and mask[first + 1]
