"""Output blocks: the chat pipeline's per-token OpenAI deltas regrouped into ordered blocks (reasoning,
text, tool call) with start / delta / stop events.

The Messages API (content blocks) and the Responses API (output items) both describe an answer as an
ordered list of such blocks; they render `BlockStream`'s events in their own wire format and build their
non-streamed answer from the same blocks, so a stream adds up to the non-streamed answer. A block closes
when output of another kind (or another tool call) starts. Knows nothing about HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from glm5.serve.serving_chat import ChatChoice


@dataclass
class Block:
    kind: Literal["reasoning", "text", "tool_call"]
    text: str = ""  # the reasoning or text, or a tool call's arguments (JSON text)
    call_id: str | None = None  # tool calls: the parser's call id and the function name
    name: str | None = None


@dataclass
class BlockEvent:
    type: Literal["start", "delta", "stop"]
    index: int  # position of the block in the answer
    block: Block
    delta: str = ""  # "delta": the new text


class BlockStream:
    """Feed it each OpenAI chat delta dict (`ChatChoice.feed(...)["delta"]`), then `close()` at the end."""

    def __init__(self):
        self.blocks: list[Block] = []
        self.open: tuple[str, int | None] | None = None  # (kind, tool call index) of the open block

    def feed(self, delta: dict) -> list[BlockEvent]:
        events = []
        if delta.get("reasoning_content"):
            events += self._put(("reasoning", None), None, delta["reasoning_content"])
        if delta.get("content"):
            events += self._put(("text", None), None, delta["content"])
        for call in delta.get("tool_calls", []):
            events += self._put(("tool_call", call["index"]), call, call["function"]["arguments"])
        return events

    def close(self) -> list[BlockEvent]:
        if self.open is None:
            return []
        self.open = None
        return [BlockEvent("stop", len(self.blocks) - 1, self.blocks[-1])]

    def _put(self, key: tuple[str, int | None], call: dict | None, text: str) -> list[BlockEvent]:
        """Open block `key` unless it is the open one, then append `text` to it."""
        events = []
        if self.open != key:
            events += self.close()
            self.open = key
            if call is None:
                self.blocks.append(Block(key[0]))
            else:
                self.blocks.append(Block("tool_call", call_id=call["id"], name=call["function"]["name"]))
            events.append(BlockEvent("start", len(self.blocks) - 1, self.blocks[-1]))
        if text:
            self.blocks[-1].text += text
            events.append(BlockEvent("delta", len(self.blocks) - 1, self.blocks[-1], text))
        return events

    def final(self, choice: ChatChoice) -> list[Block]:
        """The answer's blocks once `choice` is finished: a tool call keeps the parser's final arguments,
        and one cut by max_tokens is not a call (streamed pieces of it stay sent, as in the chat route)."""
        calls = {c.id: c for c in (choice.tools.tool_calls if choice.tools is not None else [])}
        return [b if b.kind != "tool_call" else Block("tool_call", calls[b.call_id].arguments, b.call_id, b.name)
                for b in self.blocks if b.kind != "tool_call" or b.call_id in calls]
