"""GLM tool-call parser (vLLM's `glm45`/`glm47` format), streaming and non-streaming from one state machine.

Format: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>` (GLM-4.7/5; GLM-4.5
puts newlines between the parts, which are ignored). Values are raw text; a value is JSON-typed (json, then
Python literal, else kept as a string) unless the tool's schema declares that parameter a string, as
vLLM's glm47 parser does. Text outside the calls is content (stripped as a whole; `None` if empty).

Streaming emits the call's name (with its id) as soon as the name is complete, then one arguments
fragment per finished key/value pair (`{"k": v`, `, "k2": v2`, `}`), so long calls show progress and
zero-argument calls still produce a name and `{}` (F1). The concatenated fragments equal the final
`arguments` string. An output that ends inside a call (max_tokens) closes the arguments JSON with the
pairs seen so far; one that ends before the name is complete is content, unless the call was forced
(`tool_choice`), in which case the name so far is the call.
"""

from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from glm5.serve.parsers.reasoning_glm import _partial_suffix

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VAL_OPEN, VAL_CLOSE = "<arg_value>", "</arg_value>"


@dataclass
class ToolCallDelta:
    """One streamed piece of call `index`: the first piece has `id` and `name`, later ones only arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as the OpenAI API sends it


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _string_params(tools: list[dict] | None) -> dict[str, set[str]]:
    """tool name -> names of the parameters its JSON schema declares as strings."""
    out: dict[str, set[str]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        props = ((fn.get("parameters") or {}).get("properties") or {}) if isinstance(fn, dict) else {}
        names = set()
        for pname, schema in props.items():
            t = schema.get("type") if isinstance(schema, dict) else None
            if t == "string" or (isinstance(t, list) and "string" in t):
                names.add(pname)
        out[fn.get("name", "")] = names
    return out


def _deserialize(value: str) -> Any:
    """vLLM glm4_moe `_deserialize`: JSON, then a Python literal, else the string itself."""
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


class GLMToolParser:
    """`feed(delta) -> ParsedDelta`, `finish() -> ParsedDelta`; `content`/`tool_calls` hold the totals."""

    def __init__(self, tools: list[dict] | None = None, id_factory: Callable[[], str] = new_call_id,
                 forced: bool = False):
        self.forced = forced  # tool_choice forced a call: a name cut off by the end is still a call
        self.string_params = _string_params(tools)
        self.id_factory = id_factory
        self.state = "outside"  # outside | name | key | before_value | value | after_value
        self.buf = ""
        self.tool_calls: list[ToolCall] = []
        self._content: list[str] = []
        self._pending_ws = ""  # whitespace held back: emitted only if more content follows
        self._started = False
        self._key = ""
        self._nargs = 0

    @property
    def content(self) -> str | None:
        return "".join(self._content) or None

    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        rest, self.buf = self.buf, ""
        if self.state == "outside":
            self._emit_content(rest, out)
        elif self.state == "name" and self.forced and rest.strip():
            self.buf = rest + TOOL_CLOSE
            self._on_name(out)
            self.buf = ""
            self._close_call(out)
        elif self.state == "name":  # never announced: it was text after all
            self._emit_content(TOOL_OPEN + rest, out)
        else:
            self._close_call(out)
        self.state = "outside"
        return out

    def _step(self, out: ParsedDelta) -> bool:
        """Consume as much of `buf` as the current state allows; True if the state changed."""
        handler = getattr(self, f"_on_{self.state}")
        return handler(out)

    def _on_outside(self, out: ParsedDelta) -> bool:
        idx = self.buf.find(TOOL_OPEN)
        if idx < 0:
            keep = _partial_suffix(self.buf, TOOL_OPEN)
            self._emit_content(self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        self._emit_content(self.buf[:idx], out)
        self.buf = self.buf[idx + len(TOOL_OPEN):]
        self.state = "name"
        return True

    def _on_name(self, out: ParsedDelta) -> bool:
        ends = [i for i in (self.buf.find(KEY_OPEN), self.buf.find(TOOL_CLOSE)) if i >= 0]
        if not ends:
            return False
        idx = min(ends)
        name = self.buf[:idx].strip()
        call = ToolCall(id=self.id_factory(), name=name, arguments="")
        self.tool_calls.append(call)
        out.tool_calls.append(ToolCallDelta(index=len(self.tool_calls) - 1, id=call.id, name=name))
        self._nargs = 0
        self.buf = self.buf[idx:]
        self.state = "after_value"  # same transitions: next is `<arg_key>` or `</tool_call>`
        return True

    def _on_after_value(self, out: ParsedDelta) -> bool:
        k, c = self.buf.find(KEY_OPEN), self.buf.find(TOOL_CLOSE)
        if k >= 0 and (c < 0 or k < c):
            self.buf, self.state = self.buf[k + len(KEY_OPEN):], "key"
            return True
        if c >= 0:
            self.buf = self.buf[c + len(TOOL_CLOSE):]
            self._close_call(out)
            self.state = "outside"
            return True
        return False

    def _on_key(self, out: ParsedDelta) -> bool:
        idx = self.buf.find(KEY_CLOSE)
        if idx < 0:
            return False
        self._key = self.buf[:idx].strip()
        self.buf, self.state = self.buf[idx + len(KEY_CLOSE):], "before_value"
        return True

    def _on_before_value(self, out: ParsedDelta) -> bool:
        idx = self.buf.find(VAL_OPEN)
        if idx < 0:
            return False
        self.buf, self.state = self.buf[idx + len(VAL_OPEN):], "value"
        return True

    def _on_value(self, out: ParsedDelta) -> bool:
        idx = self.buf.find(VAL_CLOSE)
        if idx < 0:
            return False
        call = self.tool_calls[-1]
        raw = self.buf[:idx].strip()
        value = raw if self._key in self.string_params.get(call.name, ()) else _deserialize(raw)
        sep = "{" if self._nargs == 0 else ", "
        self._nargs += 1
        self._emit_args(sep + json.dumps(self._key, ensure_ascii=False) + ": "
                        + json.dumps(value, ensure_ascii=False), out)
        self.buf, self.state = self.buf[idx + len(VAL_CLOSE):], "after_value"
        return True

    def _close_call(self, out: ParsedDelta) -> None:
        self._emit_args("}" if self._nargs else "{}", out)

    def _emit_args(self, piece: str, out: ParsedDelta) -> None:
        index = len(self.tool_calls) - 1
        self.tool_calls[index].arguments += piece
        if out.tool_calls and out.tool_calls[-1].index == index:
            out.tool_calls[-1].arguments += piece
        else:
            out.tool_calls.append(ToolCallDelta(index=index, arguments=piece))

    def _emit_content(self, text: str, out: ParsedDelta) -> None:
        """Append text so that the total content equals `strip()` of all text outside calls."""
        if not self._started:
            text = text.lstrip()
        if not text:
            return
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        piece = self._pending_ws + body
        self._pending_ws = text[len(body):]
        self._started = True
        self._content.append(piece)
        out.content += piece


def parse_tool_calls(output: str, tools: list[dict] | None = None,
                     id_factory: Callable[[], str] = new_call_id) -> tuple[str | None, list[ToolCall]]:
    """Non-streaming: `(content or None, tool calls)` for a whole model output."""
    p = GLMToolParser(tools, id_factory)
    p.feed(output)
    p.finish()
    return p.content, p.tool_calls
