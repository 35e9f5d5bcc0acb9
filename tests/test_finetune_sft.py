"""SFT data: assistant-only masks (vs transformers' `return_assistant_tokens_mask` and hand-built
expectations), cleared-reasoning handling, packing with per-document attention, bad lines, the
bundled set."""

import gzip
import json

import numpy as np
import pytest

from glm5.core.resources import bundled
from glm5.data import sft
from glm5.data.infilling import IGNORE
from glm5.data.tokenizer import load_tokenizer

ASSET = bundled("tokenizer-8k")
TOOLS = [{"type": "function", "function": {"name": "man", "parameters": {"type": "object", "properties": {
    "page": {"type": "string"}}}}}]
CALL = {"id": "c0", "type": "function", "function": {"name": "man", "arguments": '{"page": "ls"}'}}
TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is ls?"},
    {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c0", "content": "ls - list directory contents"},
    {"role": "assistant", "content": "It lists a directory.", "reasoning_content": "Read it."},
    {"role": "user", "content": "Thanks! 谢谢"},
    {"role": "assistant", "content": "不客气。"},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ASSET)


def trained_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])


def test_mask_matches_transformers_generation_spans(tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(ASSET))
    ex = sft.ChatExample(messages=TOOL_CHAT, tools=TOOLS)
    ids, mask = sft.encode_example(tok, ex, keep_reasoning=True)
    hf_chat = json.loads(json.dumps(TOOL_CHAT))  # transformers wants tool-call arguments as objects
    hf_chat[2]["tool_calls"][0]["function"]["arguments"] = {"page": "ls"}
    out = hf.apply_chat_template(hf_chat, tools=TOOLS, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True, clear_thinking=False)
    n = len(out["input_ids"])
    assert list(ids[:n]) == list(out["input_ids"])
    # ours = HF's generation spans + the token that ends each assistant turn (+ a final EOS)
    assert all(mask[i] for i in range(n) if out["assistant_masks"][i])
    enders = [i for i in range(len(ids)) if mask[i] and (i >= n or not out["assistant_masks"][i])]
    assert [tok.id_to_token(ids[i]) for i in enders] == ["<|observation|>", "<|user|>", "<|endoftext|>"]


def test_hand_built_masks_and_cleared_reasoning(tok):
    ex = sft.ChatExample(messages=TOOL_CHAT, tools=TOOLS)
    ids, mask = sft.encode_example(tok, ex, keep_reasoning=True)
    call = "<tool_call>man<arg_key>page</arg_key><arg_value>ls</arg_value></tool_call>"
    assert trained_text(tok, ids, mask) == (
        f"<think>Look it up.</think>{call}<|observation|>"
        "<think>Read it.</think>It lists a directory.<|user|>"
        "<think></think>不客气。<|endoftext|>")
    # As at inference: reasoning before the last user message is cleared, and the emptied
    # <think></think> of those turns is not trained (the model never produced it)
    ids, mask = sft.encode_example(tok, ex, keep_reasoning=False)
    text = tok.decode(ids)
    assert "Look it up." not in text and text.count("<think></think>") == 3
    assert trained_text(tok, ids, mask) == (
        f"{call}<|observation|>It lists a directory.<|user|><think></think>不客气。<|endoftext|>")
    prompt = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "ls - list directory contents" in prompt and "What is ls?" in prompt


def test_text_lines_train_every_token(tok):
    ids, mask = sft.encode_example(tok, sft.parse_example({"text": "hello world"}))
    assert mask.all() and ids[-1] == tok.eos_token_id and tok.decode(ids[:-1]) == "hello world"


def test_pack_keeps_documents_apart():
    a = (np.array([10, 11, 12]), np.array([False, True, True]))
    b = (np.array([20, 21]), np.array([False, True]))
    c = (np.array([30, 31, 32, 33, 34, 35]), np.array([False, False, True, True, False, True]))
    rows = sft.pack([a, b, c], seq_len=5, pad_id=0)
    assert rows["input_ids"].tolist() == [[10, 11, 12, 20, 21], [30, 31, 32, 33, 34]]
    assert rows["labels"].tolist() == [[11, 12, IGNORE, 21, IGNORE], [IGNORE, 32, 33, IGNORE, IGNORE]]
    assert rows["segment_ids"].tolist() == [[1, 1, 1, 2, 2], [1, 1, 1, 1, 1]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    rows = sft.pack([b, a], seq_len=8, pad_id=0)
    assert rows["segment_ids"].tolist() == [[1, 1, 2, 2, 2, 0, 0, 0]]
    assert rows["labels"][0, 4:].tolist() == [IGNORE] * 4


@pytest.mark.parametrize("bad, why", [
    ("{not json", "Expecting property name"),
    ('{"messages": []}', "non-empty"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "role is 'wizard'"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
    ('{"messages": [{"role": "assistant", "content": 3}]}', "content must be"),
    ('{"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}', "no function name"),
])
def test_malformed_line_is_named(tmp_path, bad, why):
    good = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    path = tmp_path / "chat.jsonl"
    path.write_text(f"{good}\n\n{good}\n{bad}\n")
    with pytest.raises(sft.SFTDataError, match=rf"chat.jsonl:4: .*{why}"):
        sft.read_chat_jsonl(path)


def test_unrenderable_tool_arguments_are_named(tok, tmp_path):
    path = tmp_path / "chat.jsonl"
    call = {"function": {"name": "f", "arguments": "{broken"}}
    path.write_text(json.dumps({"id": "x7", "messages": [{"role": "user", "content": "a"},
                                                         {"role": "assistant", "tool_calls": [call]}]}) + "\n")
    with pytest.raises(sft.SFTDataError, match=r"example 1 \(id x7\).*not valid JSON"):
        sft.encode_file(tok, path)


def test_bundled_set_is_licensed_bilingual_and_split_by_document(tok):
    splits = {}
    for split in ("train", "heldout"):
        with gzip.open(bundled(f"sft/{split}.jsonl.gz"), "rt", encoding="utf-8") as f:
            splits[split] = [json.loads(line) for line in f]
        assert all(c["license"] and c["source"] and c["id"] for c in splits[split])
        assert {c["lang"] for c in splits[split]} >= {"en", "zh"}
    assert not {c["source"] for c in splits["train"]} & {c["source"] for c in splits["heldout"]}
    assert len(splits["heldout"]) >= 50 and len(splits["train"]) >= 1000
    assert any(c.get("tools") for c in splits["train"]) and any(
        m.get("reasoning_content") for c in splits["train"] for m in c["messages"])
    for path in (bundled("sft/heldout.jsonl.gz"),):  # every line renders with the bundled tokenizer
        docs = sft.encode_file(tok, path)
        assert all(m.any() for _, m in docs)


def test_bundled_set_rebuilds_byte_for_byte(tmp_path):
    from glm5.data import sft_corpus

    sft_corpus.build(bundled("corpus"), tmp_path)
    for name in ("train.jsonl.gz", "heldout.jsonl.gz", "PROVENANCE.md"):
        assert (tmp_path / name).read_bytes() == bundled(f"sft/{name}").read_bytes(), name
