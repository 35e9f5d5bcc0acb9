"""The API fuzzer's pieces (used by tests/test_serve_fuzz.py and bench/serve_fuzz.py).

Request bodies come from Hypothesis strategies built from the server's own pydantic request models
(`glm5.serve.protocol`): every field of every model, typed by its annotation, with values near its
declared bounds (`ge`/`le`/`gt`) and beyond them, plus, with some probability, one field replaced by a
hostile value (lone surrogates, huge and non-finite numbers, wrong types, deep nesting). A fixed list of
hand-written hostile requests (broken tool schemas, out-of-vocabulary ids, odd headers and methods,
malformed or oversized bodies) runs alongside. `check_response` is the property every answer must
satisfy: no 5xx; a 4xx carries an OpenAI error object; a 200 is a well-formed completion or SSE stream.
"""

from __future__ import annotations

import json
import socket
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import annotated_types as at
import httpx
from hypothesis import strategies as st
from pydantic import BaseModel

from glm5.serve import protocol, protocol_anthropic, protocol_responses

ROUTES = {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest,
          "/tokenize": protocol.TokenizeRequest, "/detokenize": protocol.DetokenizeRequest}
# Anthropic's Messages and OpenAI's Responses routes (their own test, so the counts above stay comparable)
API_ROUTES = {"/v1/messages": protocol_anthropic.MessagesRequest,
              "/v1/messages/count_tokens": protocol_anthropic.CountTokensRequest,
              "/v1/responses": protocol_responses.ResponsesRequest}
SURROGATES = ["\ud800", "a\udfffb", "\udbff\ud800", "x" * 3 + "\udc00"]
HUGE = [2**63, -(2**63) - 1, 10**30, -(10**30), 1e308, -1e308, float("nan"), float("inf"), float("-inf")]
# Fields whose valid values cost engine time: keep the valid ones small (hostile ones stay hostile).
CHEAP = {"n": [1, 1, 2], "max_tokens": [None, 1, 2, 4], "max_completion_tokens": [None, 1, 3],
         "min_tokens": [0, 1, 2], "logprobs": None, "top_logprobs": [0, 1, 5], "max_output_tokens": [None, 1, 3],
         "budget_tokens": [None, 1, 2]}


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


def json_values(max_leaves: int = 8) -> st.SearchStrategy:
    """Arbitrary JSON (NaN, surrogates and big ints included, as Python's json accepts them)."""
    leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12),
                       st.sampled_from(SURROGATES + HUGE))
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                        max_leaves=max_leaves)


HOSTILE = st.one_of(st.sampled_from([None, True, "", [], {}, [[]], {"a": {}}, "NaN", -1, 0] + SURROGATES + HUGE),
                    st.just(nested(200)), st.just("x" * 20_000), json_values())


def _bounds(metadata) -> tuple[float | None, float | None, bool]:
    lo = hi = None
    strict = False
    for m in metadata:
        if isinstance(m, at.Ge):
            lo = m.ge
        elif isinstance(m, at.Gt):
            lo, strict = m.gt, True
        elif isinstance(m, at.Le):
            hi = m.le
    return lo, hi, strict


def _number(kind: type, metadata, valid: bool) -> st.SearchStrategy:
    lo, hi, strict = _bounds(metadata)
    edges = [v for v in (lo, hi) if v is not None]
    edges += [e + d for e in edges for d in (-1, 1)] if kind is int else [e + d for e in edges for d in (-1e-9, 1e-9)]
    if kind is int:
        inner = st.integers(int(lo) if lo is not None else -5, int(min(hi, 64)) if hi is not None else 64)
        return inner if valid else st.one_of(inner, st.sampled_from([kind(e) for e in edges] or [0]), st.integers())
    inner = st.floats(lo if lo is not None else -10, hi if hi is not None else 10, exclude_min=strict)
    tiny = [1e-300, 1e-38, 5e-324] if strict or lo == 0 else []
    if valid:
        return st.one_of(inner, st.sampled_from(tiny)) if tiny else inner
    return st.one_of(inner, st.sampled_from(edges + tiny or [0.0]), st.floats())


def for_annotation(ann: Any, metadata=(), name: str = "", valid: bool = True) -> st.SearchStrategy:
    """A strategy for a value of type `ann`: in its declared bounds when `valid`, else also at and past
    them and of any size."""
    if name in NAMED:
        return NAMED[name]
    if name in CHEAP and CHEAP[name] is not None:
        return st.sampled_from(CHEAP[name]) if valid else st.one_of(st.sampled_from(CHEAP[name]),
                                                                    _number(int, metadata, valid))
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:  # a discriminated union of content blocks / input items
        return for_annotation(args[0], metadata, name, valid)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[for_annotation(a, metadata, name, valid) for a in args])
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is list:
        min_size = next((m.min_length for m in metadata if isinstance(m, at.MinLen)), 0) if valid else 0
        return st.lists(for_annotation(args[0], (), name, valid), min_size=min_size, max_size=max(min_size, 4))
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), json_values(), max_size=3)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return model_bodies(ann, valid)
    if ann is type(None):
        return st.none()
    if ann is bool:
        return st.booleans()
    if ann in (int, float):
        return _number(ann, metadata, valid)
    if ann is str:
        return st.one_of(st.text(max_size=40), st.sampled_from(["Hello", "The capital of France is"]))
    return json_values()


MODEL_OVERRIDES: dict[tuple[type, str], st.SearchStrategy] = {}
NAMED = {"model": st.sampled_from([None, "tiny", "tiny", "tiny", "gpt-4"])}  # mostly the served name


def model_bodies(model: type[BaseModel], valid: bool = True) -> st.SearchStrategy[dict]:
    """Dicts with every required field of `model` and any subset of its optional ones."""
    required, optional = {}, {}
    for fname, f in model.model_fields.items():
        override = MODEL_OVERRIDES.get((model, fname))
        strat = override if override is not None else for_annotation(f.annotation, f.metadata, fname, valid)
        (required if f.is_required() else optional)[fname] = strat
    return st.fixed_dictionaries(required, optional=optional)


def _tool_schemas() -> st.SearchStrategy:
    good = st.sampled_from([{}, {"type": "object"}, {"type": "object", "properties": {"city": {"type": "string"}}},
                            {"type": "object", "properties": {"a": True, "b": {"type": ["integer", "null"]}},
                             "required": ["a"]},
                            {"$ref": "#"}, {"type": "object", "properties": {"x": {"$ref": "#/$defs/x"}},
                                            "$defs": {"x": {"enum": [1, "a"]}}}])
    bad = st.sampled_from([{"type": "object", "properties": "str"}, {"type": "objec"}, {"required": "a"},
                           {"properties": {"a": {"type": 5}}}, {"type": "object", "properties": {"a": []}},
                           {"$defs": 3}, {"minimum": "low"}])
    return st.one_of(good, bad, st.dictionaries(st.text(max_size=6), json_values(), max_size=3))


def _install_overrides() -> None:
    """Fields where plain typing says too little: chat content parts, tool definitions, prompts."""
    parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "bogus"]),
                                            "text": st.text(max_size=20)}), max_size=3)
    MODEL_OVERRIDES[(protocol.ChatMessage, "content")] = st.one_of(st.none(), st.text(max_size=40), parts)
    MODEL_OVERRIDES[(protocol.FunctionDef, "parameters")] = st.one_of(st.none(), _tool_schemas())
    MODEL_OVERRIDES[(protocol.FunctionDef, "name")] = st.sampled_from(["get_weather", "f", "", "x" * 300])
    ids = st.integers(-3, 9000)  # the tiny model's vocabulary is 8192
    MODEL_OVERRIDES[(protocol.CompletionRequest, "prompt")] = st.one_of(
        st.text(max_size=60), st.lists(st.text(max_size=20), min_size=0, max_size=3),
        st.lists(ids, min_size=0, max_size=12), st.lists(st.lists(ids, max_size=6), max_size=3))
    MODEL_OVERRIDES[(protocol.DetokenizeRequest, "tokens")] = st.lists(ids, max_size=12)


_install_overrides()


@st.composite
def requests(draw, routes: dict[str, type[BaseModel]] = ROUTES) -> tuple[str, Any]:
    """(route, JSON body): a body from the route's model, half of them with every value in its declared
    bounds, the other half also at and past them; one in four gets a hostile value in one field."""
    path = draw(st.sampled_from(sorted(routes)))
    body = draw(model_bodies(routes[path], valid=draw(st.sampled_from([True, False]))))
    if draw(st.sampled_from([False, False, False, True])):  # (st.integers would favour 0: not one in four)
        key = draw(st.sampled_from(sorted(routes[path].model_fields)))
        body[key] = draw(HOSTILE)
    return path, body


def encode(body: Any) -> bytes:
    """JSON as a hostile client sends it: NaN/Infinity literals allowed, surrogates as \\u escapes."""
    return json.dumps(body, allow_nan=True, ensure_ascii=True).encode()


@dataclass
class Case:
    """One hand-written request: raw body bytes and headers, so that anything can be sent. `raw` cases
    go over a plain socket (httpx refuses to send them); one that is malformed at the HTTP level is
    answered by uvicorn's protocol layer (a plain-text 400) and never reaches the app."""

    name: str
    path: str
    body: bytes | None = None
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})
    raw: bool = False
    status: int | None = None  # the status it must get, where one is certain
    message: str | None = None  # ... and a part of its error message


def _json_case(name: str, path: str, body: Any, **kw) -> Case:
    return Case(name, path, body if isinstance(body, bytes) else encode(body), **kw)


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def _wide_schema(n: int) -> dict:
    """An object of n optional string properties: xgrammar's compile time grows steeply with n."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def hand_written_cases() -> list[Case]:
    tool = lambda params: [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]  # noqa: E731
    cases = [
        _json_case("oov stop ids + min_tokens", COMPLETIONS, {"prompt": "hi", "stop_token_ids": [99999], "min_tokens": 2}),
        _json_case("negative stop id", CHAT, {"messages": USER, "stop_token_ids": [-1], "min_tokens": 1}),
        _json_case("huge stop id", COMPLETIONS, {"prompt": "hi", "stop_token_ids": [2**80]}),
        _json_case("oov prompt id", COMPLETIONS, {"prompt": [1, 2, 8192]}),
        _json_case("oov nested prompt id", COMPLETIONS, {"prompt": [[1], [2**64]]}),
        _json_case("oov detokenize", "/detokenize", {"tokens": [10**20]}),
        _json_case("surrogate prompt", COMPLETIONS, {"prompt": "\ud800"}),
        _json_case("surrogate chat", CHAT, {"messages": [{"role": "user", "content": "\udfff"}]}),
        _json_case("surrogate part", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}),
        _json_case("surrogate tokenize", "/tokenize", {"prompt": "\ud800"}),
        _json_case("surrogate key", CHAT, {"messages": USER, "chat_template_kwargs": {"\ud800": 1}}),
        _json_case("surrogate stop", COMPLETIONS, {"prompt": "hi", "stop": "\ud800"}),
        _json_case("surrogate tool name", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "\ud800"}}]}),
        _json_case("tiny temperature", COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "temperature": 1e-38}),
        _json_case("tiny repetition penalty", COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e-300}),
        _json_case("NaN temperature", COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}'),
        _json_case("Infinity top_p", COMPLETIONS, b'{"prompt": "hi", "top_p": Infinity}'),
        _json_case("huge max_tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": 10**30}),
        _json_case("huge n", COMPLETIONS, {"prompt": "hi", "n": 10**9}),
        _json_case("huge seed", COMPLETIONS, {"prompt": "hi", "seed": 2**64}),
        _json_case("schema of 20000 properties", CHAT, {"messages": USER, "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "big", "schema": _wide_schema(20000)}}},
                   status=400, message="over the limit"),
        _json_case("schema of 600 optional properties", CHAT, {"messages": USER, "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "wide", "schema": _wide_schema(600)}}},
                   status=400, message="600 properties is over the limit of 512"),
        # its prompt (the tool's schema is in it) is over the context, found first: the compile-cost limit
        # on tool schemas is tested in test_serve_structured
        _json_case("tool of 600 parameters", CHAT, {"messages": USER, "max_tokens": 2, "tool_choice": "required",
                                                    "tools": tool(_wide_schema(600))},
                   status=400, message="maximum context length"),
        _json_case("huge top_k", COMPLETIONS, {"prompt": [1264, 328], "top_k": 2**74, "seed": -8367},
                   status=400, message="top_k must fit in a signed 64-bit integer"),
        _json_case("top_k above vocab", COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "top_k": 2**40}),
        _json_case("huge top_k chat", CHAT, {"messages": USER, "max_tokens": 2, "top_k": 10**25}),
        _json_case("seed at int64 edge", COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1, "n": 2}),
        _json_case("huge logprobs", COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "logprobs": 2**70}),
        _json_case("huge beam_width", COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "use_beam_search": True,
                                                    "beam_width": 2**70}),
        _json_case("float n", COMPLETIONS, {"prompt": "hi", "n": 1.5}),
        _json_case("string temperature", COMPLETIONS, {"prompt": "hi", "temperature": "hot"}),
        _json_case("prompt object", COMPLETIONS, {"prompt": {"text": "hi"}}),
        _json_case("prompt mixed list", COMPLETIONS, {"prompt": [1, "a", None]}),
        _json_case("deep nesting", COMPLETIONS, b'{"prompt": ' + deep_array(5000) + b"}"),
        _json_case("very deep nesting", COMPLETIONS, deep_array(100_000)),
        _json_case("deep chat kwargs", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
                                             b'"chat_template_kwargs": {"x": ' + deep_array(3000) + b"}}"),
        _json_case("messages not a list", CHAT, {"messages": "hi"}),
        _json_case("content number", CHAT, {"messages": [{"role": "user", "content": 5}]}),
        _json_case("tool_calls garbage", CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"function": 3}]}]}),
        _json_case("tool_calls args not json", CHAT, {"messages": [{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}),
        _json_case("tool schema properties str", CHAT, {"messages": USER, "tools": tool({"type": "object", "properties": "str"})}),
        _json_case("tool schema bad type", CHAT, {"messages": USER, "tools": tool({"type": "objec"})}),
        _json_case("tool schema recursive ref", CHAT, {"messages": USER, "tools": tool({"$ref": "#"}), "max_tokens": 2}),
        _json_case("tool schema deep", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
                                             b'"function", "function": {"name": "f", "parameters": ' + _deep_schema(2000)
                                             + b"}}]}"),
        _json_case("tool schema remote ref", CHAT, {"messages": USER, "tools": tool({"$ref": "http://127.0.0.1:1/x.json"}),
                                                    "max_tokens": 2}),
        _json_case("tool_choice unknown", CHAT, {"messages": USER, "tools": tool({}), "tool_choice":
                                                 {"type": "function", "function": {"name": "nope"}}}),
        _json_case("tool_choice required forced", CHAT, {"messages": USER, "tools": tool({"type": "object"}),
                                                         "tool_choice": "required", "max_tokens": 3}),
        _json_case("logit_bias oov", COMPLETIONS, {"prompt": "hi", "logit_bias": {"99999": 5}}),
        _json_case("logit_bias negative", COMPLETIONS, {"prompt": "hi", "logit_bias": {"-1": 5}}),
        _json_case("logit_bias superscript", COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "logit_bias": {"²": 5}}),
        _json_case("logit_bias arabic digit", COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "logit_bias": {"٣": 5}}),
        _json_case("logit_bias 5000 digits", COMPLETIONS, {"prompt": "hi", "logit_bias": {"9" * 5000: 1}}),
        _json_case("logit_bias NaN", COMPLETIONS, b'{"prompt": "hi", "logit_bias": {"5": NaN}}'),
        _json_case("json_schema broken", CHAT, {"messages": USER, "max_tokens": 3, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}}),
        _json_case("json_schema properties str", CHAT, {"messages": USER, "max_tokens": 3, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": "s"}}}}),
        _json_case("json_schema recursive", CHAT, {"messages": USER, "max_tokens": 3, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}),
        _json_case("json_schema deep", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, '
                                             b'"response_format": {"type": "json_schema", "json_schema": {"name": "x", '
                                             b'"schema": ' + _deep_schema(500) + b"}}}"),
        _json_case("structured regex bad", COMPLETIONS, {"prompt": "hi", "max_tokens": 3,
                                                         "structured_outputs": {"regex": "(unclosed"}}),
        _json_case("structured grammar bad", COMPLETIONS, {"prompt": "hi", "max_tokens": 3,
                                                           "structured_outputs": {"grammar": "root ::= ("}}),
        _json_case("structured choice empty", COMPLETIONS, {"prompt": "hi", "max_tokens": 3,
                                                            "structured_outputs": {"choice": []}}),
        _json_case("structured json string", COMPLETIONS, {"prompt": "hi", "max_tokens": 3,
                                                           "structured_outputs": {"json": "{not json"}}),
        _json_case("structured two fields", COMPLETIONS, {"prompt": "hi", "max_tokens": 3,
                                                          "structured_outputs": {"regex": "a", "choice": ["b"]}}),
        _json_case("beam search huge width", COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "use_beam_search": True,
                                                           "beam_width": 64, "n": 64}),
        _json_case("best_of < n", COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "n": 3, "best_of": 2}),
        _json_case("suffix with echo", COMPLETIONS, {"prompt": "hi", "suffix": "x", "echo": True}),
        _json_case("session id junk", CHAT, {"messages": USER, "max_tokens": 2, "session_id": "../../etc"}),
        _json_case("template kwargs odd", CHAT, {"messages": USER, "chat_template_kwargs": {"enable_thinking": "maybe",
                                                                                            "thinking": [1]}}),
        _json_case("template kwargs reserved", CHAT, {"messages": USER, "chat_template_kwargs": {"messages": 1, "tools": 2}}),
        _json_case("logprobs without max", COMPLETIONS, {"prompt": [1, 2, 3], "echo": True, "logprobs": 20, "max_tokens": 0}),
        _json_case("top_logprobs no logprobs", CHAT, {"messages": USER, "top_logprobs": 3}),
        _json_case("prompt too long", COMPLETIONS, {"prompt": "word " * 500}),
        _json_case("empty prompt list", COMPLETIONS, {"prompt": [[]]}),
        _json_case("empty string prompt", COMPLETIONS, {"prompt": "", "max_tokens": 2}),
        _json_case("null body", COMPLETIONS, b"null"),
        _json_case("array body", CHAT, b"[1, 2]"),
        _json_case("string body", CHAT, b'"hi"'),
        _json_case("truncated json", COMPLETIONS, b'{"prompt": "hi'),
        _json_case("invalid utf-8", COMPLETIONS, b'{"prompt": "\xff\xfe"}'),
        _json_case("utf-8 bom", COMPLETIONS, b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 1}'),
        _json_case("duplicate keys", COMPLETIONS, b'{"prompt": "hi", "prompt": [1], "max_tokens": 1}'),
        _json_case("empty body", COMPLETIONS, b""),
        _json_case("wrong model", COMPLETIONS, {"model": "gpt-4", "prompt": "hi"}),
        _json_case("model surrogate", COMPLETIONS, {"model": "\ud800", "prompt": "hi"}),
        Case("text/plain body", COMPLETIONS, encode({"prompt": "hi", "max_tokens": 1}), headers={"content-type": "text/plain"}),
        Case("no content-type", COMPLETIONS, encode({"prompt": "hi", "max_tokens": 1}), headers={}),
        Case("latin-1 charset", COMPLETIONS, encode({"prompt": "hi", "max_tokens": 1}),
             headers={"content-type": "application/json; charset=latin-1"}),
        Case("form body", COMPLETIONS, b"prompt=hi", headers={"content-type": "application/x-www-form-urlencoded"}),
        Case("gzip claimed", COMPLETIONS, encode({"prompt": "hi", "max_tokens": 1}),
             headers={"content-type": "application/json", "content-encoding": "gzip"}),
        Case("bad content-length", COMPLETIONS, encode({"prompt": "hi"}), raw=True,
             headers={"content-type": "application/json", "content-length": "abc"}),
        Case("negative content-length", COMPLETIONS, encode({"prompt": "hi"}), raw=True,
             headers={"content-type": "application/json", "content-length": "-5"}),
        Case("huge content-length", COMPLETIONS, encode({"prompt": "hi"}), raw=True,
             headers={"content-type": "application/json", "content-length": str(10**12)}),
        Case("odd auth header", COMPLETIONS, encode({"prompt": "hi", "max_tokens": 1}), raw=True,
             headers={"content-type": "application/json", "authorization": "Bearer \x7f\x01 é"}),
        Case("odd request id", COMPLETIONS, encode({"prompt": "hi", "max_tokens": 1}), raw=True,
             headers={"content-type": "application/json", "x-request-id": "é\t" * 200}),
        Case("huge header", COMPLETIONS, encode({"prompt": "hi", "max_tokens": 1}),
             headers={"content-type": "application/json", "x-junk": "a" * 60_000}),
        Case("body too large", COMPLETIONS, b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}'),
        Case("GET on POST route", COMPLETIONS, method="GET"),
        Case("PUT on POST route", CHAT, encode({"messages": USER}), method="PUT"),
        Case("DELETE health", "/health", method="DELETE"),
        Case("unknown route", "/v1/engines/x/completions", encode({})),
        Case("path traversal", "/v1/../../etc/passwd", method="GET"),
        Case("query junk", COMPLETIONS + "?stream=true&n=99", encode({"prompt": "hi", "max_tokens": 1})),
        Case("admin without key", "/admin/experts", b"garbage", headers={}),
        Case("metrics POST", "/metrics", b"{}"),
    ]
    return cases


def deep_array(depth: int) -> bytes:
    """JSON text of `depth` nested arrays (built as text: json.dumps itself recurses)."""
    return b"[" * depth + b"]" * depth


def _deep_schema(depth: int) -> bytes:
    return b'{"type": "object", "properties": {"a": ' * depth + b'{"type": "string"}' + b"}}" * depth


@dataclass
class Tally:
    """What the fuzzer saw: cases by status class; every entry must keep 5xx == 0."""

    total: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    ok: int = 0
    client_errors: int = 0
    server_errors: list[str] = field(default_factory=list)
    alive_checks: int = 0

    def add(self, status: int, what: str) -> None:
        self.total += 1
        self.by_status[status] = self.by_status.get(status, 0) + 1
        if status < 400:
            self.ok += 1
        elif status < 500:
            self.client_errors += 1
        else:
            self.server_errors.append(what)


def send_raw(base_url: str, case: Case, timeout_s: float = 60.0) -> httpx.Response:
    """Send `case` byte for byte over a socket (Connection: close) and parse the reply."""
    host, port = base_url.removeprefix("http://").split(":")
    lines = [f"{case.method} {case.path} HTTP/1.1", f"host: {host}", "connection: close"]
    lines += [f"{k}: {v}" for k, v in case.headers.items()]
    if "content-length" not in case.headers and case.body is not None:
        lines.append(f"content-length: {len(case.body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(head + (case.body or b""))  # no half-close: uvicorn drops a request whose client sent EOF
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(h.lower().split(": ", 1) for h in header_lines if ": " in h)
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return httpx.Response(int(status_line.split()[1]), content=body, headers=[
        (k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items() if k != "transfer-encoding"])


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, data = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, data = out + data[:n], data[n + 2:]
    return out


def check_response(r: httpx.Response, what: str, path: str = "") -> None:
    """The property: never a 5xx; a 4xx is an OpenAI error object (Anthropic's under `/v1/messages`;
    except uvicorn's plain-text 400 for a request that is not valid HTTP, which never reaches the app);
    a 200 is well formed."""
    assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"
    if r.status_code == 400 and r.headers.get("content-type", "").startswith("text/plain"):
        assert "Invalid HTTP request" in r.text, f"{what}: {r.text[:300]}"
        return
    if path.startswith(("/v1/messages", "/v1/responses")):
        return _check_api_response(r, what, path)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"} and isinstance(err["message"], str) \
            and err["message"], f"{what}: {r.text[:300]}"
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"{what}: stream did not end with [DONE]"
        for ev in events[:-1]:
            chunk = json.loads(ev)
            assert "error" not in chunk, f"{what}: error chunk {ev[:300]}"
        return
    r.json()  # any other 200 is a JSON document


def _check_api_response(r: httpx.Response, what: str, path: str) -> None:
    """The Messages / Responses forms of the property: their own error object; a stream whose last event
    ends the answer (`message_stop`; `response.completed` / `response.incomplete`) with no error event."""
    anthropic = path.startswith("/v1/messages")
    if r.status_code >= 400:
        body = r.json()
        err = body["error"]
        assert not anthropic or body["type"] == "error", f"{what}: {r.text[:300]}"
        assert isinstance(err["message"], str) and err["message"] and err["type"], f"{what}: {r.text[:300]}"
        return
    if not r.headers.get("content-type", "").startswith("text/event-stream"):
        r.json()
        return
    events = [json.loads(ln[len("data: "):]) for ln in r.text.splitlines() if ln.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert "error" not in kinds, f"{what}: error event {r.text[-300:]}"
    ends = ("message_stop",) if anthropic else ("response.completed", "response.incomplete")
    assert kinds and kinds[-1] in ends, f"{what}: stream ended with {kinds[-1:]}"
