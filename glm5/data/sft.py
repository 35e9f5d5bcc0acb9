"""Supervised fine-tuning data: chat JSONL -> token ids with an assistant-only loss -> packed rows.

One JSON object per line: `{"messages": [...], "tools": [...]?}` in the OpenAI format (roles system,
user, assistant, tool; assistant `tool_calls` with JSON-string or object arguments; reasoning as
`reasoning_content` / `reasoning` / `thinking`); other fields (`id`, `source`, ...) ride along. The
conversation is rendered with the tokenizer's chat template; the loss covers exactly what the template
marks as generated (`{% generation %}`: reasoning, content, tool calls) plus the token that ends each
assistant turn (`<|observation|>` before tool results, `<|user|>`, or a final `<|endoftext|>`).
Reasoning: with `keep_reasoning` (default) every turn keeps its reasoning (`clear_thinking=False`,
GLM's preserved thinking); without it earlier turns are rendered as at inference (reasoning cleared to
`<think></think>`, or `</think>` in GLM-4.7/5's template) and those emptied think blocks get no loss: the
model never produced them.
A line `{"text": "..."}` is plain text trained on every token (domain-adaptive pretraining).
Packing concatenates documents into fixed rows; `segment_ids` (1.. per document, 0 = padding) keep
attention inside each document and `position_ids` restart at 0, as `glm5.data.loader` does.
Knows nothing about models or training; `glm5.finetune.sft_data` feeds the trainer.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from glm5.core.resources import resolve_path
from glm5.data.infilling import IGNORE

ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")  # the chat template's aliases


class SFTDataError(ValueError):
    """A malformed SFT file: the message names the file and line."""


@dataclass
class ChatExample:
    messages: list[dict]
    tools: list[dict] | None = None
    text: str | None = None  # a plain-text line ({"text": ...}): every token is a target
    meta: dict = field(default_factory=dict)  # the line's other fields (id, source, task, ...)


# --- reading ------------------------------------------------------------------------------------------
def _open(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _check_message(m, i: int) -> None:
    if not isinstance(m, dict):
        raise ValueError(f"messages[{i}] is not an object")
    role = m.get("role")
    if role not in ROLES:
        raise ValueError(f"messages[{i}].role is {role!r}; expected one of {list(ROLES)}")
    content = m.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise ValueError(f"messages[{i}].content must be a string, a list of parts or null")
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls must be a list on an assistant message")
        for j, c in enumerate(calls):
            fn = c.get("function", c) if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"messages[{i}].tool_calls[{j}] has no function name")


def parse_example(obj) -> ChatExample:
    """Validate one decoded line; raises ValueError saying what is wrong."""
    if isinstance(obj, dict) and "messages" not in obj and isinstance(obj.get("text"), str) and obj["text"]:
        return ChatExample(messages=[], text=obj["text"], meta={k: v for k, v in obj.items() if k != "text"})
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
        raise ValueError('expected an object with a non-empty "messages" list (or a "text" string)')
    for i, m in enumerate(obj["messages"]):
        _check_message(m, i)
    if not any(m["role"] == "assistant" for m in obj["messages"]):
        raise ValueError("no assistant message: nothing to train on")
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError('"tools" must be a list')
    meta = {k: v for k, v in obj.items() if k not in ("messages", "tools")}
    return ChatExample(messages=obj["messages"], tools=tools, meta=meta)


def read_chat_jsonl(path: str | Path) -> list[ChatExample]:
    """All examples of a chat JSONL file (.jsonl or .jsonl.gz); a bad line raises naming it."""
    path = resolve_path(path)  # `bundled:sft/train.jsonl.gz` = the bundled SFT set
    if not path.is_file():
        raise SFTDataError(f"SFT file not found: {path}")
    out = []
    with _open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(parse_example(json.loads(line)))
            except (json.JSONDecodeError, ValueError) as e:
                raise SFTDataError(f"{path}:{lineno}: {e}") from e
    if not out:
        raise SFTDataError(f"{path}: no examples")
    return out


# --- encoding -----------------------------------------------------------------------------------------
def _text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return content or ""


def _cleared_turns(messages: list[dict]) -> list[bool]:
    """Per assistant message (in order): does the template's default clear its reasoning (it has
    reasoning, and a user message comes after it)?"""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            has_reasoning = any(m.get(k) for k in REASONING_FIELDS) or "</think>" in _text(m.get("content"))
            out.append(i < last_user and has_reasoning)
    return out


def encode_example(tokenizer, ex: ChatExample, keep_reasoning: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """-> ids [L] int64 and target mask [L] bool (True = the model is trained to produce this token)."""
    if ex.text is not None:  # plain text (domain-adaptive pretraining lines): every token, then EOS
        ids = np.asarray(tokenizer.encode(ex.text) + [tokenizer.eos_token_id], dtype=np.int64)
        return ids, np.ones(len(ids), dtype=bool)
    kwargs = {"clear_thinking": False} if keep_reasoning else {}
    try:
        ids, mask = tokenizer.encode_chat(ex.messages, tools=ex.tools, **kwargs)
    except Exception as e:  # template errors, bad tool-call arguments
        raise ValueError(f"cannot render: {e}") from e
    ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
    if not keep_reasoning:
        _unmask_cleared_think(tokenizer, ex.messages, ids, mask)
    return ids, mask


def _unmask_cleared_think(tokenizer, messages, ids: np.ndarray, mask: np.ndarray) -> None:
    """Drop the loss on what opens a cleared turn's generated block: `<think></think>` (glm5's and
    GLM-4.5's templates) or a bare `</think>` (GLM-4.7/5's)."""
    think, end = tokenizer.special_tokens["<think>"], tokenizer.special_tokens["</think>"]
    starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]  # block starts
    for start, cleared in zip(starts, _cleared_turns(messages)):
        if cleared and ids[start] == think and start + 1 < len(ids) and ids[start + 1] == end:
            mask[start:start + 2] = False
        elif cleared and ids[start] == end:
            mask[start] = False


def encode_file(tokenizer, path: str | Path, keep_reasoning: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
    """Read and encode every example of `path`; a line that cannot be rendered raises naming it."""
    out = []
    for n, ex in enumerate(read_chat_jsonl(path), 1):
        try:
            out.append(encode_example(tokenizer, ex, keep_reasoning))
        except ValueError as e:
            raise SFTDataError(f"{path}: example {n} (id {ex.meta.get('id', '?')}): {e}") from e
    return out


# --- packing ------------------------------------------------------------------------------------------
def pack(docs: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """Greedy in-order packing of (ids, target mask) documents into rows of `seq_len`.

    A document longer than a row is cut to `seq_len` tokens. Returns arrays [R, T]: input_ids,
    labels (labels[t] = ids[t+1] where that token is a target, else -100; never across documents),
    position_ids (restart per document), segment_ids (1.. per document, 0 = padding).
    """
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    used = 0
    for ids, mask in docs:
        ids, mask = ids[:seq_len], mask[:seq_len]
        if used + len(ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((ids, mask))
        used += len(ids)
    R = len(rows)
    out = {"input_ids": np.full((R, seq_len), pad_id, dtype=np.int64),
           "labels": np.full((R, seq_len), IGNORE, dtype=np.int64),
           "position_ids": np.zeros((R, seq_len), dtype=np.int64),
           "segment_ids": np.zeros((R, seq_len), dtype=np.int64)}
    for r, row in enumerate(rows):
        s = 0
        for seg, (ids, mask) in enumerate(row, 1):
            n = len(ids)
            out["input_ids"][r, s:s + n] = ids
            out["labels"][r, s:s + n - 1] = np.where(mask[1:], ids[1:], IGNORE)
            out["position_ids"][r, s:s + n] = np.arange(n)
            out["segment_ids"][r, s:s + n] = seg
            s += n
    return out
