"""GLM tool-call parsers (vLLM's `glm47` and `glm45`, SGLang's GLM-4.7/4.5 detectors): one incremental state
machine for streaming and non-streaming, in two layouts.

`GLMToolParser` (glm47): `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`
(GLM-4.7/5; newlines between the parts are ignored). Rules, as the peers' parser tests assert them:
- Keys are stripped; values keep their whitespace. Values are typed by the offered tool's JSON schema
  (`schema_types.py`): `string` parameters keep their raw text, others become JSON of an allowed type.
- A call to a tool that was not offered is dropped whole: no call, no content, arguments never leak.
  (`tools=None` accepts any name.)
- Streaming: a known call's name (with its id) goes out as soon as it is complete; a `string` argument
  streams as it arrives (`{"k": "par`, `tial`, `"`); other values go out when they close; `}` when the
  call closes. A tool whose schema makes a value's type depend on its siblings (a root `oneOf` with a
  discriminator) sends its arguments in one piece at `</tool_call>`.
- Text outside calls is content (stripped as a whole; `None` if empty).
- A call still open when the output ends (max_tokens) is not a call and not content; whatever of it
  was already streamed stays sent (both peers do the same), so the one place where a stream can
  differ from the non-streaming response is an output cut inside a call, with finish_reason "length".

`GLM45ToolParser` (glm45): GLM-4.5/4.6's layout, the name alone on the call's first line, then one
`<arg_key>`/`<arg_value>` pair per line. Its rules are vLLM's `glm45` parser's (tests/tool_parsers/
test_glm4_moe_tool_parser.py), where they differ from the above:
- The name is the call's first line; a call closed before its first newline is not a call.
- Calls to any name are calls (the offered tools only type the values).
- Content is the text before the first call, raw (`None` when blank); text after it is not content.
  An output with no complete call is all content, exactly as generated.
`select_tool_parser` picks the layout from the checkpoint (its chat template, else its model_type).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from glm5.data.chat_template import render
from glm5.serve.parsers.reasoning_glm import _partial_suffix
from glm5.serve.parsers.schema_types import (allowed_types, coerce_value, is_free_string, needs_context,
                                             single_type)

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


def tool_schemas(tools: list[dict] | None) -> dict[str, dict] | None:
    """Offered tool name -> its parameters schema ({} when absent or not an object); None = no list."""
    if tools is None:
        return None
    out: dict[str, dict] = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def _find_first(buf: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """Earliest occurrence of any tag: (index, tag), or (-1, "")."""
    best, which = -1, ""
    for tag in tags:
        i = buf.find(tag)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, tag
    return best, which


def _held(buf: str, tags: tuple[str, ...]) -> int:
    """Characters at the end of `buf` that could still become one of `tags`."""
    return max(_partial_suffix(buf, t) for t in tags)


@dataclass
class _OpenCall:
    """The call being parsed: its index (None for a dropped call), schema and arguments so far."""

    index: int | None
    name: str
    schema: dict
    buffered: bool  # arguments typed together at the close (sibling-dependent types)
    pairs: list[tuple[str, str]] = field(default_factory=list)
    key: str = ""
    value_type: str | None = None  # "string" while a string value streams
    value: str = ""
    num_args: int = 0


class GLMToolParser:
    """`feed(delta) -> ParsedDelta`, `finish() -> ParsedDelta`; `content`/`tool_calls` hold the totals
    (`tool_calls` lists only calls that closed)."""

    def __init__(self, tools: list[dict] | None = None, id_factory: Callable[[], str] = new_call_id):
        self.schemas = tool_schemas(tools)
        self.id_factory = id_factory
        self.state = "outside"  # outside | name | args | key | before_value | value
        self.buf = ""
        self.tool_calls: list[ToolCall] = []
        self._announced: list[ToolCall] = []  # every call whose name went out (the last may never close)
        self.call: _OpenCall | None = None
        self._content: list[str] = []
        self._pending_ws = ""  # whitespace held back: emitted only if more content follows
        self._started = False

    @property
    def content(self) -> str | None:
        return "".join(self._content) or None

    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        out = ParsedDelta()
        while getattr(self, f"_on_{self.state}")(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        """End of output: plain text (and a partial `<tool_call>`) is content; an open call is dropped."""
        out = ParsedDelta()
        if self.state == "outside":
            self._emit_content(self.buf, out)
        self.buf, self.state, self.call = "", "outside", None
        return out

    # ---- states: each consumes what it can and returns True when it moved to another state ----------
    def _on_outside(self, out: ParsedDelta) -> bool:
        idx = self.buf.find(TOOL_OPEN)
        if idx < 0:
            keep = _partial_suffix(self.buf, TOOL_OPEN)
            self._emit_content(self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        self._emit_content(self.buf[:idx], out)
        self.buf, self.state = self.buf[idx + len(TOOL_OPEN):], "name"
        return True

    NAME_ENDS = (KEY_OPEN, TOOL_CLOSE, "\n")  # the name ends at the first of these

    def _on_name(self, out: ParsedDelta) -> bool:
        head = self.buf.lstrip()
        idx, tag = _find_first(head, self.NAME_ENDS)
        if idx < 0:
            return False
        name = head[:idx].strip()
        self.buf = head[idx:]
        schema = None if self.schemas is None else self.schemas.get(name)
        if self._accepts(name, schema, tag):
            call = ToolCall(id=self.id_factory(), name=name, arguments="")
            self._announced.append(call)
            index = len(self._announced) - 1
            out.tool_calls.append(ToolCallDelta(index=index, id=call.id, name=name))
            self.call = _OpenCall(index, name, schema or {}, needs_context(schema or {}))
        else:  # never offered (or empty): parse it to its end, emit nothing
            self.call = _OpenCall(None, name, {}, True)
        self.state = "args"
        return True

    def _accepts(self, name: str, schema: dict | None, end: str) -> bool:
        """Whether a call named `name` (its name ended at `end`) is a call: offered, or any with no tool list."""
        return bool(name) and (self.schemas is None or schema is not None)

    def _on_args(self, out: ParsedDelta) -> bool:
        idx, tag = _find_first(self.buf, (KEY_OPEN, TOOL_CLOSE))
        if idx < 0:
            self.buf = self.buf[len(self.buf) - _held(self.buf, (KEY_OPEN, TOOL_CLOSE)):]
            return False
        self.buf = self.buf[idx + len(tag):]
        if tag == TOOL_CLOSE:
            self._close_call(out)
        else:
            self.state = "key"
        return True

    def _on_key(self, out: ParsedDelta) -> bool:
        idx, tag = _find_first(self.buf, (KEY_CLOSE, TOOL_CLOSE))
        if idx < 0:
            return False
        self.call.key = self.buf[:idx].strip()
        self.buf = self.buf[idx + len(tag):]
        if tag == TOOL_CLOSE:  # a key without a value: ignored
            self._close_call(out)
        else:
            self.state = "before_value"
        return True

    def _on_before_value(self, out: ParsedDelta) -> bool:
        idx, tag = _find_first(self.buf, (VAL_OPEN, TOOL_CLOSE))
        if idx < 0:
            self.buf = self.buf[len(self.buf) - _held(self.buf, (VAL_OPEN, TOOL_CLOSE)):]
            return False
        self.buf = self.buf[idx + len(tag):]
        if tag == TOOL_CLOSE:
            self._close_call(out)
            return True
        call = self.call
        call.value = ""
        call.value_type = None
        if not call.buffered:
            kind = single_type(allowed_types(call.schema, call.schema, call.key))
            if kind == "string" and is_free_string(call.schema, call.key):  # streams as it arrives
                call.value_type = "string"
                self._emit_args(self._separator() + json.dumps(call.key, ensure_ascii=False) + ': "', out)
        self.state = "value"
        return True

    def _on_value(self, out: ParsedDelta) -> bool:
        """`</tool_call>` inside a value ends the value and the call (vLLM's regexes do the same)."""
        call = self.call
        idx, tag = _find_first(self.buf, (VAL_CLOSE, TOOL_CLOSE))
        piece = self.buf[:idx] if idx >= 0 else self.buf[: len(self.buf) - _held(self.buf, (VAL_CLOSE, TOOL_CLOSE))]
        call.value += piece
        self.buf = self.buf[len(piece):]
        if call.value_type == "string" and piece:
            self._emit_args(json.dumps(piece, ensure_ascii=False)[1:-1], out)
        if idx < 0:
            return False
        self.buf = self.buf[len(tag):]
        self._close_value(out)
        if tag == TOOL_CLOSE:
            self._close_call(out)
        else:
            self.state = "args"
        return True

    # ---- emitting ---------------------------------------------------------------------------------
    def _close_value(self, out: ParsedDelta) -> None:
        call = self.call
        call.pairs.append((call.key, call.value))
        if call.buffered:
            return
        if call.value_type == "string":
            self._emit_args('"', out)
            return
        # typed now that the value is complete
        types = allowed_types(call.schema, call.schema, call.key)
        value = coerce_value(call.value, types, call.schema, call.key)
        self._emit_args(self._separator() + json.dumps(call.key, ensure_ascii=False) + ": "
                        + json.dumps(value, ensure_ascii=False), out)

    def _close_call(self, out: ParsedDelta) -> None:
        call = self.call
        if call.index is not None:
            if call.buffered:
                self._emit_args(json.dumps(type_arguments(call.pairs, call.schema), ensure_ascii=False), out)
            else:
                self._emit_args("}" if call.num_args else "{}", out)
            self.tool_calls.append(self._announced[call.index])
        self.call, self.state = None, "outside"

    def _separator(self) -> str:
        self.call.num_args += 1
        return "{" if self.call.num_args == 1 else ", "

    def _emit_args(self, piece: str, out: ParsedDelta) -> None:
        index = self.call.index
        if index is None or not piece:
            return
        self._announced[index].arguments += piece
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


class GLM45ToolParser(GLMToolParser):
    """GLM-4.5/4.6's layout with vLLM `glm45`'s rules (see the module docstring); the same interface."""

    NAME_ENDS = ("\n", TOOL_CLOSE)

    def __init__(self, tools: list[dict] | None = None, id_factory: Callable[[], str] = new_call_id):
        super().__init__(tools, id_factory)
        self._text = ""  # everything fed: an output without a complete call is all content
        self._seen = 0  # characters of _text before the first call read so far
        self._sent = 0  # characters of _text given out as content
        self._in_call = False  # a `<tool_call>` was seen: nothing after it is content unless no call completes

    def feed(self, text: str) -> ParsedDelta:
        self._text += text
        return super().feed(text)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if not self.tool_calls:  # no complete call: the whole output is content, as generated
            self._give(self._text[self._sent:], out)
        self.buf, self.state, self.call = "", "outside", None
        return out

    def _accepts(self, name: str, schema: dict | None, end: str) -> bool:
        return bool(name) and end == "\n"

    def _on_outside(self, out: ParsedDelta) -> bool:
        moved = super()._on_outside(out)
        self._in_call = self._in_call or moved
        return moved

    def _emit_content(self, text: str, out: ParsedDelta) -> None:
        """Raw text before the first call; blank text is held until something else follows it."""
        if self._in_call:
            return
        self._seen += len(text)  # the pieces before the first call arrive in order: _text[_seen_before:_seen]
        if self._text[:self._seen].strip():
            self._give(self._text[self._sent:self._seen], out)

    def _give(self, piece: str, out: ParsedDelta) -> None:
        if piece:
            self._sent += len(piece)
            self._content.append(piece)
            out.content += piece


def select_tool_parser(setting: str, chat_template: str | None, model_type: str | None) -> str:
    """The tool-call layout to parse: `setting` unless "auto"; then the layout the checkpoint's chat
    template writes for an assistant tool call (`chat_template`: None when the checkpoint ships none),
    else GLM-4.5/4.6's for `glm4_moe` checkpoints and the compact GLM-4.7/5 one for the rest (GLM-4.7
    is a glm4_moe too, and ships its template)."""
    if setting != "auto":
        return setting
    if chat_template is not None:
        call = {"type": "function", "function": {"name": "probe_tool", "arguments": {"probe_key": "v"}}}
        try:
            text = render(chat_template, [{"role": "user", "content": "x"},
                                          {"role": "assistant", "content": "", "tool_calls": [call]}],
                          tools=None, add_generation_prompt=False, enable_thinking=False)
        except Exception:  # noqa: BLE001 (a template that cannot render this says nothing about the layout)
            text = ""
        head, sep, _ = text.partition("<arg_key>probe_key")
        if sep and "<tool_call>" in head:
            return "glm45" if "\n" in head.rsplit("<tool_call>", 1)[1] else "glm47"
    return "glm45" if model_type == "glm4_moe" else "glm47"


def make_tool_parser(kind: str, tools: list[dict] | None) -> GLMToolParser:
    """The parser for layout `kind` ("glm45" | "glm47")."""
    return GLM45ToolParser(tools) if kind == "glm45" else GLMToolParser(tools)


def type_arguments(pairs: list[tuple[str, str]], schema: dict) -> dict[str, Any]:
    """Type all of a call's (key, raw value) pairs together. Values whose type is certain on their own
    are typed first, so a discriminator (`kind: "count"`) can pick the union branch that types its
    siblings, whatever their order."""
    known: dict[str, Any] = {}
    for key, raw in pairs:
        value = coerce_value(raw, allowed_types(schema, schema, key), schema, key)
        native = allowed_types(schema, schema, key, value=raw)
        if isinstance(value, str) or native is None or "string" not in native:
            known[key] = value
    args: dict[str, Any] = {}
    for key, raw in pairs:
        types = allowed_types(schema, schema, key, known=known)
        args[key] = coerce_value(raw, types, schema, key, known)
        known[key] = args[key]
    return args


def parse_tool_calls(output: str, tools: list[dict] | None = None,
                     id_factory: Callable[[], str] = new_call_id, kind: str = "glm47"
                     ) -> tuple[str | None, list[ToolCall]]:
    """Non-streaming: `(content or None, tool calls)` for a whole model output in layout `kind`."""
    p = (GLM45ToolParser if kind == "glm45" else GLMToolParser)(tools, id_factory)
    p.feed(output)
    p.finish()
    return p.content, p.tool_calls
