"""Golden tests for the GLM tool-call and reasoning parsers on fixed raw model outputs.

Every case is checked non-streaming and streamed in every chunking we can afford: one character at a
time, every single split point, and random splits; the streamed deltas must add up to exactly the
non-streaming result (F1/F2 in FEATURE_ANCHORS.md).
"""

import itertools
import json
import random

import pytest

from glm5.serve.parsers import (GLMReasoningParser, GLMToolParser, parse_reasoning, parse_tool_calls,
                                prompt_opens_reasoning)

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "units": {"type": ["string", "null"]}, "opts": {"type": "object"}}}}},
           {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def chunkings(text, seed=0):
    """One char at a time, every 2-way split, and 20 random multi-way splits."""
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def stream_tools(chunks, tools):
    p = GLMToolParser(tools, ids())
    content, calls = "", {}
    for piece in [*(p.feed(c) for c in chunks), p.finish()]:
        content += piece.content
        for d in piece.tool_calls:
            if d.index not in calls:
                assert d.name is not None and d.id is not None, "first delta of a call must name it"
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            else:
                assert d.name is None
            calls[d.index]["arguments"] += d.arguments
    return content or None, [calls[i] for i in sorted(calls)]


TOOL_CASES = [
    # (raw output, expected content, expected [(name, arguments dict)])
    ("I'll check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
     "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
     "I'll check.", [("get_weather", {"city": "Paris", "days": 3})]),
    # zero-argument call (the one vLLM dropped in streaming)
    ("<tool_call>now</tool_call>", None, [("now", {})]),
    # several calls, GLM-4.5 newline layout, whitespace between calls
    ("Two calls:\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>\n"
     "<tool_call>now\n</tool_call>",
     "Two calls:", [("get_weather", {"city": "Oslo"}), ("now", {})]),
    # declared-string params stay strings even when they look like numbers/JSON; others are typed
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>123</arg_value><arg_key>units</arg_key>"
     "<arg_value>null</arg_value><arg_key>opts</arg_key><arg_value>{\"a\": [1, 2]}</arg_value>"
     "<arg_key>extra</arg_key><arg_value>{'x': True}</arg_value></tool_call>",
     None, [("get_weather", {"city": "123", "units": "null", "opts": {"a": [1, 2]}, "extra": {"x": True}})]),
    # non-JSON value of a non-string param stays a string; unicode and tag-like text in values
    ("Météo <b>ok</b><tool_call>get_weather<arg_key>days</arg_key><arg_value>three</arg_value>"
     "<arg_key>city</arg_key><arg_value>São Paulo <arg></arg_value></tool_call> done",
     "Météo <b>ok</b> done", [("get_weather", {"days": "three", "city": "São Paulo <arg>"})]),
    # no calls at all, text with a lookalike tag
    ("Plain answer with <tool_ but no call.", "Plain answer with <tool_ but no call.", []),
    # output truncated inside a call (max_tokens): arguments closed with what was complete
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value><arg_key>da",
     None, [("get_weather", {"city": "Rome"})]),
    # truncated before the name was complete: it was text
    ("Sure <tool_call>get_wea", "Sure <tool_call>get_wea", []),
]


@pytest.mark.parametrize("raw,content,expected", TOOL_CASES)
def test_tool_parser_golden_and_streaming(raw, content, expected):
    got_content, calls = parse_tool_calls(raw, WEATHER, ids())
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    reference = (got_content, [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls])
    for chunks in chunkings(raw):
        assert stream_tools(chunks, WEATHER) == reference, chunks


def test_forced_call_cut_in_name_is_still_a_call():
    for chunks in chunkings("<tool_call>get_wea"):
        p = GLMToolParser(WEATHER, ids(), forced=True)
        deltas = [d for c in chunks for d in p.feed(c).tool_calls] + p.finish().tool_calls
        assert [(c.name, c.arguments) for c in p.tool_calls] == [("get_wea", "{}")] and p.content is None
        assert "".join(d.arguments for d in deltas) == "{}" and deltas[0].name == "get_wea"


def test_tool_arguments_stream_per_pair():
    p = GLMToolParser(WEATHER, ids())
    first = p.feed("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>")
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("get_weather", '{"city": "Paris"')]
    second = p.feed("</tool_call>")
    assert [(d.index, d.name, d.arguments) for d in second.tool_calls] == [(0, None, "}")]


REASONING_CASES = [
    # (prompt tail, raw output, reasoning, content)
    ("<|user|>hi<|assistant|><think>", "Let me think.\nOK.</think>\n\nHello!", "Let me think.\nOK.", "Hello!"),
    # thinking off (GLM-4.7/5 template closes the block in the prompt)
    ("<|user|>hi<|assistant|></think>", "Hello!", None, "Hello!"),
    ("<|user|>hi<|assistant|>\n<think></think>", "  Hello </think> x", None, "Hello </think> x"),
    # opener emitted by the model itself
    ("<|user|>hi<|assistant|>", "\n<think>hmm</think>Yes.", "hmm", "Yes."),
    ("<|user|>hi<|assistant|>", "<thinking is fun", None, "<thinking is fun"),
    # truncated while thinking: everything is reasoning, nothing leaks into content
    ("<|user|>hi<|assistant|><think>", "still thinking </thi", "still thinking </thi", None),
    # multi-turn with tool results: history blocks are closed, the open one is the last
    ("<|user|>w?<|assistant|><think>a</think><tool_call>now</tool_call><|observation|><tool_response>12:00"
     "</tool_response><|assistant|><think>", "It is noon.</think>It's 12:00.", "It is noon.", "It's 12:00."),
]


@pytest.mark.parametrize("prompt,raw,reasoning,content", REASONING_CASES)
def test_reasoning_parser_golden_and_streaming(prompt, raw, reasoning, content):
    opens = prompt_opens_reasoning(prompt)
    assert parse_reasoning(raw, opens) == (reasoning, content)
    for chunks in chunkings(raw):
        p = GLMReasoningParser(opens)
        r, c = "", ""
        for dr, dc in [*(p.feed(x) for x in chunks), p.finish()]:
            r, c = r + dr, c + dc
        assert (r or None, c or None) == (reasoning, content), chunks


def test_reasoning_then_tool_call_pipeline():
    """Thinking + a tool call, as GLM-5 emits them: reasoning first, the call parsed from content only."""
    raw = "I need the weather.<tool_call>fake</tool_call></think>Checking.<tool_call>get_weather<arg_key>city" \
          "</arg_key><arg_value>Paris</arg_value></tool_call>"
    reference = None
    for chunks in chunkings(raw):
        rp, tp = GLMReasoningParser(True), GLMToolParser(WEATHER, ids())
        reasoning, content, args = "", "", ""
        for chunk in [*chunks, None]:
            dr, dc = rp.feed(chunk) if chunk is not None else rp.finish()
            reasoning += dr
            outs = [tp.feed(dc)] + ([tp.finish()] if chunk is None else [])
            content += "".join(o.content for o in outs)
            args += "".join(d.arguments for o in outs for d in o.tool_calls)
        result = (reasoning, content, [(c.name, c.arguments) for c in tp.tool_calls], args)
        reference = reference or result
        assert result == reference
    assert reference[0] == "I need the weather.<tool_call>fake</tool_call>"
    assert reference[1] == "Checking."
    assert reference[2] == [("get_weather", '{"city": "Paris"}')]
