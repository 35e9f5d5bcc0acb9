"""GLM-4.5/4.6's tool-call layout (`glm45`: the name on the call's first line, one `<arg_key>`/`<arg_value>`
pair per line) against the cases of vLLM's own `glm45` parser tests (tests/tool_parsers/
test_glm4_moe_tool_parser.py: their inputs and expected outputs), non-streaming and streamed in many
chunkings; and the choice of layout from the checkpoint (`auto`) or `--tool-call-parser`."""

import json

import pytest

from glm5.data.chat_template import default_chat_template
from glm5.serve.parsers import GLM45ToolParser, GLMToolParser, make_tool_parser, parse_tool_calls, select_tool_parser

from .test_serve_parsers import chunkings, ids

# vLLM's fixture: one offered tool; calls to other names are still calls in glm45
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def weather(city, state, unit):
    return ("get_current_weather", {"city": city, "state": state, "unit": unit})


def call_text(name, pairs, indent="    "):
    body = "".join(f"\n{indent}<arg_key>{k}</arg_key>\n{indent}<arg_value>{v}</arg_value>" for k, v in pairs)
    return f"<tool_call>{name}{body}\n{indent}</tool_call>"


DALLAS = call_text("get_current_weather", [("city", "Dallas"), ("state", "TX"), ("unit", "fahrenheit")])
ORLANDO = call_text("get_current_weather", [("city", "Orlando"), ("state", "FL"), ("unit", "fahrenheit")])
BEIJING = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n" \
          "<arg_key>date</arg_key>\n<arg_value>2025-08-01</arg_value>\n</tool_call>"
SHANGHAI = BEIJING.replace("Beijing", "Shanghai")
INCOMPLETE = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n" \
             "<arg_key>date</arg_key>\n<arg_value>2025-08-01</arg_value>"

CASES = {  # id: (model output, expected content, expected calls)
    "no_tools": ("This is a test", "This is a test", []),
    "single_tool_call": (DALLAS, None, [weather("Dallas", "TX", "fahrenheit")]),
    "multiple_tool_calls": (DALLAS + "\n    " + ORLANDO, None,
                            [weather("Dallas", "TX", "fahrenheit"), weather("Orlando", "FL", "fahrenheit")]),
    "tool_call_with_content_before": (
        "I'll help you check the weather. " + call_text(
            "get_current_weather", [("city", "Seattle"), ("state", "WA"), ("unit", "celsius")]),
        "I'll help you check the weather. ", [weather("Seattle", "WA", "celsius")]),
    "tool_call_with_mixed_args": (
        call_text("get_current_weather", [("city", "New York"), ("state", "NY"), ("unit", "celsius")]),
        None, [weather("New York", "NY", "celsius")]),
    "tool_call_with_chinese_content": (
        "I will help you get the weather." + call_text("get_weather", [("city", "Beijing"), ("date", "2025-08-01")]),
        "I will help you get the weather.", [("get_weather", {"city": "Beijing", "date": "2025-08-01"})]),
    "with_thinking_tags": (
        "<think>I want to get the weather.</think>\n\nI will help you get the weather.\n" + BEIJING,
        "<think>I want to get the weather.</think>\n\nI will help you get the weather.\n",
        [("get_weather", {"city": "Beijing", "date": "2025-08-01"})]),
    "empty_arguments": ("<tool_call>get_current_time\n</tool_call>", None, [("get_current_time", {})]),
    "mixed_content": (  # content is what precedes the first call; text between calls is not content
        "I will help you get the weather info.\n\n" + BEIJING
        + "\n\nmeaningwhile, I will also check the weather in Shanghai.\n\n" + SHANGHAI,
        "I will help you get the weather info.\n\n",
        [("get_weather", {"city": "Beijing", "date": "2025-08-01"}),
         ("get_weather", {"city": "Shanghai", "date": "2025-08-01"})]),
    "special_characters": (
        "<tool_call>send_message\n<arg_key>recipient</arg_key>\n<arg_value>Amy</arg_value>\n<arg_key>message"
        "</arg_key>\n<arg_value>It is a nice day</arg_value>\n<arg_key>priority</arg_key>\n<arg_value>high"
        "</arg_value>\n</tool_call>", None,
        [("send_message", {"recipient": "Amy", "message": "It is a nice day", "priority": "high"})]),
    "incomplete_tool_call": (INCOMPLETE, INCOMPLETE, []),
    "numeric_deserialization": (
        "<tool_call>calculate\n<arg_key>operation</arg_key>\n<arg_value>add</arg_value>\n<arg_key>a</arg_key>\n"
        "<arg_value>42</arg_value>\n<arg_key>b</arg_key>\n<arg_value>3.14</arg_value>\n<arg_key>enabled"
        "</arg_key>\n<arg_value>true</arg_value>\n</tool_call>", None,
        [("calculate", {"operation": "add", "a": 42, "b": 3.14, "enabled": True})]),
    "zero_argument": ("<tool_call>get_time\n</tool_call>", None, [("get_time", {})]),
    "malformed_no_regex_match": ("<tool_call>   ", "<tool_call>   ", []),
    "unicode_preserved": (
        "<tool_call>send_message\n<arg_key>greeting</arg_key>\n<arg_value>你好世界</arg_value>\n<arg_key>emoji"
        "</arg_key>\n<arg_value>🎉</arg_value>\n</tool_call>", None,
        [("send_message", {"greeting": "你好世界", "emoji": "🎉"})]),
    "streaming_content_before_call": ("I will help you get the weather.<tool_call>",
                                      "I will help you get the weather.<tool_call>", []),
}


def stream(chunks, tools):
    """(content or None, closed calls as (name, arguments dict), streamed arguments per closed call)."""
    p = GLM45ToolParser(tools, ids())
    content, args, names = "", {}, {}
    for piece in [*(p.feed(c) for c in chunks), p.finish()]:
        content += piece.content
        for d in piece.tool_calls:
            if d.name is not None:
                names[d.index] = d.name
            args[d.index] = args.get(d.index, "") + d.arguments
    closed = [i for i, call in enumerate(p._announced) if call in p.tool_calls]
    return content or None, [(names[i], json.loads(args[i])) for i in closed]


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_glm45_cases(case):
    output, content, calls = CASES[case]
    got_content, got = parse_tool_calls(output, TOOLS, kind="glm45")
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id for c in got) and "\\u4f60" not in "".join(c.arguments for c in got)
    for chunks in chunkings(output, full=len(output) < 200):
        assert stream(chunks, TOOLS) == (content, calls), chunks


def test_compact_parser_misses_the_newline_layout_rules():
    """What the issue saw: the compact (glm47) rules give other answers on vLLM's glm45 cases."""
    content, calls = parse_tool_calls(CASES["mixed_content"][0], TOOLS)
    assert [c.name for c in calls] == ["get_weather", "get_weather"] and "meaningwhile" in content
    assert parse_tool_calls(CASES["single_tool_call"][0], TOOLS)[1] == []  # get_current_weather not offered
    assert parse_tool_calls(INCOMPLETE, TOOLS)[0] is None


def test_malformed_xml_and_empty_call_do_not_raise():
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Seattle</arg_value>\n" \
           "<arg_key>incomplete_arg\n<arg_value>value</arg_value>\n</tool_call>"
    content, calls = parse_tool_calls(text, TOOLS, kind="glm45")
    assert [c.name for c in calls] == ["get_weather"] and json.loads(calls[0].arguments)["city"] == "Seattle"
    assert parse_tool_calls("<tool_call></tool_call>", TOOLS, kind="glm45") == ("<tool_call></tool_call>", [])


def test_string_values_keep_whitespace_and_stream_incrementally():
    tools = [{"type": "function", "function": {"name": "write_to_file", "parameters": {"type": "object", "properties": {
        "file_path": {"type": "string"}, "content": {"type": "string"}}}}}]
    code = "def bubble_sort(arr):\n    n = len(arr)\n" + "".join(f"    x{i} = {i}\n" for i in range(12))
    chunks = ["<tool_call>", "write_to_file\n", "<arg_key>file_path</arg_key>", "<arg_value>/tmp/b.py</arg_value>",
              "<arg_key>content</arg_key>", "<arg_value>", *[line + "\n" for line in code.split("\n")],
              "</arg_value>", "</tool_call>"]
    p = GLM45ToolParser(tools, ids())
    fragments = [d.arguments for c in chunks for d in p.feed(c).tool_calls if d.arguments]
    assert len(fragments) >= 10
    args = json.loads("".join(fragments))
    assert args["file_path"] == "/tmp/b.py" and args["content"] == code + "\n"
    _, calls = parse_tool_calls("<tool_call>apply_diff\n<arg_key>s</arg_key>\n<arg_value>    indented code    "
                                "</arg_value>\n</tool_call>",
                                [{"type": "function", "function": {"name": "apply_diff", "parameters": {
                                    "type": "object", "properties": {"s": {"type": "string"}}}}}], kind="glm45")
    assert json.loads(calls[0].arguments) == {"s": "    indented code    "}


# Two templates that differ only in how they write an assistant's tool call
TEMPLATE = ("{%- for m in messages -%}<|{{ m.role }}|>\n{{ m.content }}{%- for tc in m.tool_calls or [] -%}"
            "<tool_call>{{ tc.function.name }}SEP{%- for k, v in tc.function.arguments.items() -%}"
            "<arg_key>{{ k }}</arg_key>SEP<arg_value>{{ v }}</arg_value>SEP{%- endfor -%}</tool_call>"
            "{%- endfor -%}{%- endfor -%}")
NEWLINE_TEMPLATE, COMPACT_TEMPLATE = TEMPLATE.replace("SEP", "{{ '\\n' }}"), TEMPLATE.replace("SEP", "")


def test_layout_chosen_from_the_checkpoint():
    assert select_tool_parser("auto", NEWLINE_TEMPLATE, "glm4_moe") == "glm45"
    assert select_tool_parser("auto", COMPACT_TEMPLATE, "glm4_moe") == "glm47"  # GLM-4.7 is a glm4_moe too
    assert select_tool_parser("auto", default_chat_template(), "glm_moe_dsa") == "glm47"
    assert select_tool_parser("auto", None, "glm4_moe") == "glm45"  # no template shipped: by model_type
    assert select_tool_parser("auto", None, "glm4_moe_lite") == "glm47"
    assert select_tool_parser("auto", "{{ undefined_filter | nope }}", "glm4_moe") == "glm45"
    assert select_tool_parser("glm47", NEWLINE_TEMPLATE, "glm4_moe") == "glm47"  # an explicit choice wins
    assert type(make_tool_parser("glm45", None)) is GLM45ToolParser
    assert type(make_tool_parser("glm47", None)) is GLMToolParser


def test_cli_flag_and_server_resolution():
    from glm5.cli.serve import parse_args
    from glm5.infer.engine import LLMEngine
    from glm5.serve.app import create_app

    assert parse_args(["--model", "tiny", "--tool-call-parser", "glm45"])[1].tool_parser == "glm45"
    assert parse_args(["--model", "tiny"])[1].tool_parser == "auto"
    from .test_hf_glm4 import GQA, _model
    from glm5.data.tokenizer import load_tokenizer

    tok = load_tokenizer("bundled:tokenizer-8k")
    engine = LLMEngine(device="cpu", num_blocks=8, block_size=4, max_model_len=32, model=_model(
        dict(GQA, vocab_size=tok.vocab_size), seed=0), tokenizer=tok)
    app = create_app(engine, tok)  # the bundled tokenizer's template is the default: by model_type
    assert app.state.serve.config.tool_parser == "glm45"
