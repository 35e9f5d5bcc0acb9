"""GLM tool-call and reasoning parsers against the behaviour vLLM's and SGLang's GLM-4.5/4.7/5 parser
tests assert (cases rewritten here from what those tests check; docs/serve.md says where the two
peers disagree and which one we follow).

Every case is checked non-streaming and streamed in many chunkings (one character at a time, every
2-way split, random splits): the streamed deltas must add up to exactly the non-streaming result.
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


def chunkings(text, seed=0, full=True):
    """One char at a time, every 2-way split (if `full`), and random multi-way splits."""
    yield [text]
    yield list(text)
    if full:
        for i in range(len(text) + 1):
            yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(20 if full else 6):
        if len(text) < 2:
            break
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def stream_tools(chunks, tools):
    """Streamed result: (content or None, closed calls as dicts, every announced call's streamed args)."""
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
    closed = {c.id for c in p.tool_calls}
    return content or None, [calls[i] for i in sorted(calls) if calls[i]["id"] in closed]


def check_tools(raw, tools, full=True):
    """Non-streaming result (content, [(name, args)]), after checking every chunking streams the same."""
    content, calls = parse_tool_calls(raw, tools, ids())
    reference = (content, [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls])
    for chunks in chunkings(raw, full=full):
        assert stream_tools(chunks, tools) == reference, chunks
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


TOOL_CASES = [
    # (raw output, expected content, expected [(name, arguments dict)])
    ("I'll check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
     "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
     "I'll check.", [("get_weather", {"city": "Paris", "days": 3})]),
    # zero-argument call, inline and GLM-4.5 newline layout
    ("<tool_call>now</tool_call>", None, [("now", {})]),
    ("<tool_call>now\n</tool_call>", None, [("now", {})]),
    ("  \n  <tool_call>now</tool_call>", None, [("now", {})]),
    # several calls, GLM-4.5 newline layout, content between calls kept
    ("Two calls:\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>\n"
     "Also:\n<tool_call>now\n</tool_call>",
     "Two calls:\n\nAlso:", [("get_weather", {"city": "Oslo"}), ("now", {})]),
    # string values keep their whitespace and their raw text; typed params become JSON
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>    indented code    </arg_value>"
     "<arg_key>days</arg_key><arg_value> 7 </arg_value></tool_call>",
     None, [("get_weather", {"city": "    indented code    ", "days": 7})]),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>123</arg_value><arg_key>units</arg_key>"
     "<arg_value>null</arg_value><arg_key>opts</arg_key><arg_value>{\"a\": [1, 2]}</arg_value></tool_call>",
     None, [("get_weather", {"city": "123", "units": None, "opts": {"a": [1, 2]}})]),
    # literal escapes: an object written with \" is unescaped; a string keeps its backslashes
    ('<tool_call>get_weather<arg_key>opts</arg_key><arg_value>{\\"k\\": \\"v\\"}</arg_value>'
     '<arg_key>city</arg_key><arg_value>a\\nb \\"q\\"</arg_value></tool_call>',
     None, [("get_weather", {"opts": {"k": "v"}, "city": 'a\\nb \\"q\\"'})]),
    # unicode and tag-like text in string values, content around the call
    ("Météo <b>ok</b><tool_call>get_weather<arg_key>city</arg_key><arg_value>São Paulo <arg> 你好 🎉"
     "</arg_value></tool_call> done", "Météo <b>ok</b> done", [("get_weather", {"city": "São Paulo <arg> 你好 🎉"})]),
    # a parameter not in the schema: JSON if it parses, else the raw text (no Python literals)
    ("<tool_call>get_weather<arg_key>extra</arg_key><arg_value>{'x': True}</arg_value>"
     "<arg_key>n</arg_key><arg_value>5</arg_value></tool_call>",
     None, [("get_weather", {"extra": "{'x': True}", "n": 5})]),
    # no calls at all, text with a lookalike tag
    ("Plain answer with <tool_ but no call.", "Plain answer with <tool_ but no call.", []),
    # calls to tools that were never offered are dropped, arguments and all
    ("<tool_call>unknown<arg_key>q</arg_key><arg_value>secret</arg_value></tool_call><tool_call>now</tool_call>",
     None, [("now", {})]),
    ("<tool_call></tool_call>", None, []),
    # output ends inside a call (max_tokens): not a call, not content
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value><arg_key>da", None, []),
    ("Sure <tool_call>get_wea", "Sure", []),
    ("<tool_call>   ", None, []),
    # a key without a value is ignored; `</tool_call>` inside a value closes value and call
    ("<tool_call>get_weather<arg_key>city</arg_key></tool_call>", None, [("get_weather", {})]),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Lima</tool_call>", None,
     [("get_weather", {"city": "Lima"})]),
]


@pytest.mark.parametrize("raw,content,expected", TOOL_CASES)
def test_tool_parser_golden_and_streaming(raw, content, expected):
    assert check_tools(raw, WEATHER) == (content, expected)


def test_tools_none_accepts_any_name():
    assert check_tools("<tool_call>anything<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", None) == \
        (None, [("anything", {"a": 1})])


def inspect_tool(schema):
    return [{"type": "function", "function": {"name": "inspect", "parameters": schema}}]


def typed(schema, pairs):
    """Arguments of one `inspect` call with raw (key, value) pairs, streamed == non-streamed."""
    text = "<tool_call>inspect" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in pairs) \
        + "</tool_call>"
    _, calls = check_tools(text, inspect_tool(schema), full=False)
    assert len(calls) == 1
    return calls[0][1]


def prop(field):
    return {"type": "object", "properties": {"value": field}}


# (field schema, raw value text, expected JSON value): SGLang's GLM-4.7 schema-type cases
FIELD_CASES = [
    ({"type": ["integer", "string"]}, "auto", "auto"),
    ({"type": ["string", "integer"]}, "7", 7),
    ({"type": ["number", "string"]}, "auto", "auto"),
    ({"type": ["string", "object"]}, '{"ok": false}', {"ok": False}),
    ({"type": ["string", "boolean"]}, "false", False),
    ({"type": ["string", "null"]}, "null", None),
    ({"type": ["string", "null"]}, '"null"', "null"),
    ({"type": "null"}, "null", None),
    ({"enum": ["ok", None]}, "null", None),
    ({"anyOf": [{"type": "string", "enum": ["auto"]}, {"type": "integer"}]}, "7", 7),
    ({"oneOf": [{"type": "null"}, {"type": "array", "items": {"type": "integer"}}]}, "[1, 2]", [1, 2]),
    ({"const": 7}, "7", 7),
    ({"const": {"ok": False}}, '{"ok": false}', {"ok": False}),
    ({"const": "null"}, "null", "null"),
    ({"allOf": [{"type": ["integer", "string"]}, {"type": "integer"}]}, "7", 7),
    ({}, "123_456", "123_456"),
    ({}, '{"ok": false}', {"ok": False}),
    # a string parameter keeps JSON-looking text, escapes and quotes byte for byte
    *[({"type": "string"}, v, v) for v in ("null", "true", "1e2", "123_456", "\\d+", 'line one\n"quoted" \\ café',
                                            '{"a":1}', "[1,2]")],
    # a parse of a type the schema forbids stays the text
    ({"type": ["string", "object"]}, "7", "7"),
    ({"type": ["string", "array"]}, "1e2", "1e2"),
    ({"type": ["string", "integer"]}, "true", "true"),
    ({"type": ["string", "integer"]}, "null", "null"),
    ({"enum": ["7", None]}, "7", "7"),
    ({"enum": ["7", 8]}, "7", "7"),
    ({"enum": ["7", 8]}, "8", 8),
    ({"enum": ["true", 7]}, "true", "true"),
    ({"type": ["number", "string"], "enum": [1, "auto"]}, "1", 1),
    ({"type": ["number", "string"], "enum": [1, "auto"]}, "1.0", 1.0),
    # numbers: inside strings, escaped, bad, empty, non-finite
    ({"type": "integer"}, '"123"', 123),
    ({"type": "number"}, '\\"123\\"', 123),
    ({"type": "number"}, "1.25e2", 125.0),
    ({"type": "integer"}, "-12", -12),
    ({"type": "number"}, "123abc", "123abc"),
    ({"type": "number"}, "", ""),
    ({"type": "number"}, "NaN", "NaN"),
    ({"type": "number"}, "Infinity", "Infinity"),
    ({"type": "number", "enum": [1, 2]}, '"1"', 1),
    # Python-style containers for object/array parameters become strict JSON
    ({"type": "object"}, "{'a': None, 'b': True}", {"a": None, "b": True}),
    ({"type": "array"}, "[1, 2,]", [1, 2]),
    ({"type": "boolean"}, "True", True),
]


@pytest.mark.parametrize("field,raw,expected", FIELD_CASES)
def test_values_typed_by_schema(field, raw, expected):
    got = typed(prop(field), [("value", raw)])["value"]
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("defs", ["$defs", "definitions"])
@pytest.mark.parametrize("field,raw,expected", [({"type": "integer"}, "7", 7), ({"type": "string"}, "null", "null"),
                                                ({"type": "object"}, '{"ok": false}', {"ok": False})])
def test_local_refs_with_pointer_escapes(defs, field, raw, expected):
    schema = {defs: {"a/b~c": field}, "type": "object", "properties": {"value": {"$ref": f"#/{defs}/a~1b~0c"}}}
    assert typed(schema, [("value", raw)]) == {"value": expected}


def test_root_ref_and_ref_cycle():
    root_ref = {"$defs": {"args": {"type": "object", "properties": {"value": {"type": "string"}}}},
                "$ref": "#/$defs/args"}
    assert typed(root_ref, [("value", "null")]) == {"value": "null"}
    cycle = {"$defs": {"c": {"$ref": "#/$defs/c"}}, "properties": {"value": {"$ref": "#/$defs/c"}}}
    assert typed(cycle, [("value", "auto")]) == {"value": "auto"}


@pytest.mark.parametrize("word", ["anyOf", "oneOf"])
def test_discriminated_root_union_types_siblings_in_any_order(word):
    text = {"properties": {"kind": {"const": "text"}, "value": {"type": "string"}}}
    count = {"properties": {"kind": {"enum": ["count"]}, "value": {"type": "integer"}}}
    for branches in ([text, count], [count, text]):
        for schema in ({word: branches}, {word: [{"allOf": [b]} for b in branches]},
                       {"$defs": {"0": branches[0], "1": branches[1]}, word: [{"$ref": "#/$defs/0"}, {"$ref": "#/$defs/1"}]}):
            assert typed(schema, [("kind", "text"), ("value", "7")]) == {"kind": "text", "value": "7"}
            assert typed(schema, [("value", "7"), ("kind", "count")]) == {"value": 7, "kind": "count"}


@pytest.mark.parametrize("schema", [None, [], "x", {"properties": []}, {"properties": {"value": 5}},
                                    {"type": 3, "enum": "x", "anyOf": "y", "$ref": 7},
                                    {"$ref": "http://example.com/s.json"}, {"$ref": "#/nope/0"},
                                    {"anyOf": [None, {"type": "integer"}]}, {"properties": {"value": {"$ref": "#"}}}])
def test_odd_schemas_never_raise(schema):
    tools = [{"type": "function", "function": {"name": "inspect", "parameters": schema}}]
    content, calls = check_tools("<tool_call>inspect<arg_key>value</arg_key><arg_value>42</arg_value></tool_call>",
                                 tools, full=False)
    assert calls[0][0] == "inspect" and calls[0][1]["value"] in (42, "42")


def test_string_arguments_stream_as_they_arrive():
    p = GLMToolParser(WEATHER, ids())
    first = p.feed("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par")
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("get_weather", '{"city": "Par')]
    assert [d.arguments for d in p.feed("is \"x").tool_calls] == ['is \\"x']
    assert [d.arguments for d in p.feed("</arg_value><arg_key>days</arg_key><arg_value>3").tool_calls] == ['"']
    assert [d.arguments for d in p.feed("</arg_value></tool_call>").tool_calls] == [', "days": 3}']


def test_long_string_value_streams_in_many_fragments():
    code = "\n".join(f"    line {i} = {i} * 2  # \"c\"" for i in range(30))
    p = GLMToolParser(WEATHER, ids())
    chunks = ["<tool_call>", "get_weather\n", "<arg_key>city</arg_key>", "<arg_value>",
              *[ln + "\n" for ln in code.split("\n")], "</arg_value>", "</tool_call>"]
    fragments = [d.arguments for c in chunks for d in p.feed(c).tool_calls if d.arguments]
    assert len(fragments) >= 30
    assert json.loads("".join(fragments)) == {"city": code + "\n"}


def test_unknown_call_streams_nothing():
    p = GLMToolParser(WEATHER, ids())
    deltas = [p.feed(c) for c in "<tool_call>nope<arg_key>q</arg_key><arg_value>secret</arg_value></tool_call>"]
    assert all(not d.tool_calls and not d.content for d in deltas) and p.tool_calls == []


def test_cut_inside_call_was_streamed_but_is_not_a_call():
    p = GLMToolParser(WEATHER, ids())
    d = p.feed("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Ro")
    assert d.tool_calls[0].name == "get_weather"  # already on the wire, as with both peers
    end = p.finish()
    assert end.tool_calls == [] and end.content == "" and p.tool_calls == [] and p.content is None


REASONING_CASES = [
    # (prompt tail, raw output, reasoning, content)
    ("<|user|>hi<|assistant|><think>", "Let me think.\nOK.</think>\n\nHello!", "Let me think.\nOK.", "Hello!"),
    ("<|user|>hi<|assistant|><think>", "This is a reasoning section</think>", "This is a reasoning section", None),
    ("<|user|>hi<|assistant|><think>", "</think>This is the rest", None, "This is the rest"),
    ("<|user|>hi<|assistant|><think>", "", None, None),
    # thinking off (GLM-4.7/5 template closes the block in the prompt)
    ("<|user|>hi<|assistant|></think>", "Hello!", None, "Hello!"),
    ("<|user|>hi<|assistant|>\n<think></think>", "  Hello </think> x", None, "Hello </think> x"),
    # opener emitted by the model itself (GLM-4.5)
    ("<|user|>hi<|assistant|>", "\n<think>hmm</think>Yes.", "hmm", "Yes."),
    ("<|user|>hi<|assistant|>", "<think></think>This is the rest", None, "This is the rest"),
    ("<|user|>hi<|assistant|>", "<think></think>", None, None),
    ("<|user|>hi<|assistant|>", "<thinking is fun", None, "<thinking is fun"),
    # truncated while thinking: everything is reasoning, nothing leaks into content
    ("<|user|>hi<|assistant|><think>", "still thinking </thi", "still thinking </thi", None),
    ("<|user|>hi<|assistant|>", "<think>This is a reasoning section", "This is a reasoning section", None),
    # a tool call ends reasoning that was never closed; the tag stays in the content
    ("<|user|>hi<|assistant|><think>", "I need the weather.<tool_call>now</tool_call>", "I need the weather.",
     "<tool_call>now</tool_call>"),
    ("<|user|>hi<|assistant|><think>", "partial <tool_ca", "partial <tool_ca", None),
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
    """Thinking cut short by a tool call, as GLM-5 sometimes emits it: the call is parsed from content."""
    raw = "I need the weather.\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
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
    assert reference == ("I need the weather.\n", "", [("get_weather", '{"city": "Paris"}')], '{"city": "Paris"}')
