"""Chat-template rendering with jinja2, byte-for-byte as `transformers.apply_chat_template` renders.

Owns the jinja environment (same settings and helpers as transformers: sandboxed, `trim_blocks`,
`lstrip_blocks`, loop controls, a `tojson` that keeps non-ASCII, `raise_exception`, the
`{% generation %}` tag), message normalisation (OpenAI-style JSON-string tool arguments become dicts,
`reasoning`/`thinking` alias `reasoning_content`), and the default GLM-5-style template (the bundled
tokenizer's `chat_template.jinja`, its only copy). Knows nothing about token ids: `tokenizer.py`
tokenizes the text.
"""

from __future__ import annotations

import copy
import json
import re
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from glm5.core.resources import bundled

DEFAULT_TEMPLATE = "tokenizer-8k/chat_template.jinja"  # a bundled asset (package data)
# The released GLM generation a checkpoint's model_type stands for -> glm5's template with its semantics
# (GLM-4.5/4.6 are glm4_moe; GLM-4.7-Flash is glm4_moe_lite, GLM-5 glm_moe_dsa, both in GLM-4.7/5's format;
# GLM-4.7 is a glm4_moe too, but it ships its template).
GENERATION_TEMPLATES = {
    "glm4_moe": "chat-templates/glm45.jinja",
    "glm4_moe_lite": "chat-templates/glm47.jinja",
    "glm_moe_dsa": "chat-templates/glm47.jinja",
    "glm5_ext": "chat-templates/glm47.jinja",
}
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def default_chat_template(model_type: str | None = None) -> str:
    """The template for a GLM-vocabulary tokenizer that ships none: for a checkpoint's `model_type`, the
    format of that GLM generation (GENERATION_TEMPLATES); without one, glm5's own (the bundled tokenizer's,
    GLM-5-style but with `<think></think>` for a turn without reasoning)."""
    return bundled(GENERATION_TEMPLATES.get(model_type, DEFAULT_TEMPLATE)).read_text(encoding="utf-8")


class _GenerationTracker(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: records the character spans the assistant generates.

    Same mechanism as transformers: the template is rendered block by block (`generate`), and when a
    generation block is emitted its start is the length of everything emitted before it. The blocks
    and spans travel in the `_tracker` render variable, so rendering stays re-entrant; without it the
    tag is a no-op.
    """

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_mark", [jinja2.nodes.Name("_tracker", "load")])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _mark(self, tracker, caller):
        text = caller()
        if isinstance(tracker, _Tracker):
            start = sum(len(b) for b in tracker.blocks)
            tracker.spans.append((start, start + len(text)))
        return text


class _Tracker:
    def __init__(self):
        self.blocks: list[str] = []
        self.spans: list[tuple[int, int]] = []


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers overrides jinja's tojson (which HTML-escapes); match it exactly.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def normalize_messages(messages) -> list[dict]:
    """Plain-dict deep copy of `messages`, with reasoning aliases and tool-call arguments as dicts."""
    out = []
    for m in copy.deepcopy(list(messages)):
        m = dict(m)
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m["reasoning_content"] = reasoning
        if m.get("tool_calls"):
            m["tool_calls"] = [_normalize_tool_call(tc) for tc in m["tool_calls"]]
        out.append(m)
    return out


def _normalize_tool_call(tc: dict) -> dict:
    tc = dict(tc)
    fn = dict(tc.get("function", tc))
    args = fn.get("arguments")
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call {fn.get('name')!r}: arguments are not valid JSON: {e}") from e
    if args is not None and not isinstance(args, dict):
        raise ValueError(f"tool call {fn.get('name')!r}: arguments must be an object, got {args!r}")
    fn["arguments"] = args or {}
    if "function" in tc:
        tc["function"] = fn
        return tc
    return fn


def render(source: str, messages, tools=None, add_generation_prompt: bool = True, **kwargs) -> str:
    """Render a conversation to text with the template `source`."""
    return compile_template(source).render(messages=normalize_messages(messages), tools=tools or None,
                                           add_generation_prompt=add_generation_prompt, **kwargs)


def render_with_spans(source: str, messages, tools=None, add_generation_prompt: bool = False,
                      **kwargs) -> tuple[str, list[tuple[int, int]]]:
    """Render and return the [start, end) character spans of the `{% generation %}` blocks. A template
    without them (most released ones: SmolLM2's, Llama's, Qwen's) gets the spans from prefix renders."""
    if not _GENERATION_TAG.search(source):
        return _spans_by_prefix(source, messages, tools, add_generation_prompt, **kwargs)
    tracker = _Tracker()
    for block in compile_template(source).generate(
            messages=normalize_messages(messages), tools=tools or None,
            add_generation_prompt=add_generation_prompt, _tracker=tracker, **kwargs):
        tracker.blocks.append(block)
    return "".join(tracker.blocks), tracker.spans


_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def _spans_by_prefix(source: str, messages, tools, add_generation_prompt: bool, **kwargs):
    """Each assistant turn's span is what the conversation through that turn adds to the prompt that asks
    for it (the conversation before it + the generation prompt), trailing whitespace excluded: its text
    and the template's end-of-turn token. The template must render each such prompt as a prefix of the
    whole conversation; where it does not (it rewrites earlier turns), the tokens cannot be told apart."""
    msgs = normalize_messages(messages)
    full = render(source, msgs, tools, add_generation_prompt=add_generation_prompt, **kwargs)
    spans = []
    for i, m in enumerate(msgs):
        if m.get("role") != "assistant":
            continue
        before = render(source, msgs[:i], tools, add_generation_prompt=True, **kwargs)
        through = render(source, msgs[:i + 1], tools, add_generation_prompt=False, **kwargs)
        if not (through.startswith(before) and full.startswith(through)):
            raise ValueError(f"the chat template has no {{% generation %}} blocks and does not render the "
                             f"conversation before messages[{i}] as a prefix of it: cannot tell which tokens "
                             "the assistant generates (add {% generation %} blocks to the template)")
        spans.append((len(before), len(through.rstrip())))
    return full, spans
