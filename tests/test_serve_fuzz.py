"""The API fuzzer (issue 16) against the real app and the REAL engine on a tiny checkpoint.

Property, for every request: no 5xx; a 4xx is an OpenAI error object; a 200 is a well-formed
completion or an SSE stream ending in [DONE]; `/health` answers 200 afterwards; and every 25 cases (and
after each hand-written case) a good greedy request still returns the model's own greedy text.
Requests come from Hypothesis strategies built from the server's pydantic request models plus the
hand-written hostile list in tests/_fuzz.py. The default run is derandomized with a fixed number of
examples (a fixed budget, the same cases every run); `-m slow` explores more cases at random.
"""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import _fuzz
from ._live import PROMPT, live_server
from glm5.serve.config import ServerConfig

FAST = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=1500, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(tmp_path_factory, one_thread):
    cfg = ServerConfig(default_max_tokens=4)  # valid fuzzed requests stay cheap; limits are what is fuzzed
    with live_server(tmp_path_factory.mktemp("tiny-fuzz"), max_model_len=256, server=cfg) as live:
        with httpx.Client(base_url=live["url"], timeout=120) as client:
            live["client"], live["tally"] = client, _fuzz.Tally()
            yield live


def send(server, path: str, content: bytes | None, headers: dict, method: str = "POST") -> httpx.Response:
    return server["client"].request(method, path, content=content, headers=headers)


def assert_alive(server, good_request: bool) -> None:
    assert server["client"].get("/health").status_code == 200
    server["tally"].alive_checks += 1
    if good_request:
        r = server["client"].post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == server["expected"], r.text


def fuzz_one(server, req) -> None:
    path, body = req
    content = _fuzz.encode(body)
    r = send(server, path, content, {"content-type": "application/json"})
    what = f"POST {path} {content[:300]!r}"
    server["tally"].add(r.status_code, what)
    _fuzz.check_response(r, what)
    assert_alive(server, good_request=server["tally"].total % 25 == 0)


@FAST
@given(req=_fuzz.requests())
def test_fuzzed_requests_never_take_the_server_down(server, req):
    fuzz_one(server, req)


@pytest.mark.slow
@SLOW
@given(req=_fuzz.requests())
def test_fuzzed_requests_never_take_the_server_down_long(server, req):
    fuzz_one(server, req)


@pytest.mark.parametrize("case", _fuzz.hand_written_cases(), ids=lambda c: c.name)
def test_hand_written_hostile_requests(server, case):
    if case.raw:
        r = _fuzz.send_raw(server["url"], case)
    else:
        r = send(server, case.path, case.body, case.headers, case.method)
    server["tally"].add(r.status_code, case.name)
    _fuzz.check_response(r, case.name)
    if case.status is not None:
        assert r.status_code == case.status and case.message in r.json()["error"]["message"], r.text
    assert_alive(server, good_request=True)


def test_tally_has_no_5xx(server):
    """Runs after the cases above (file order): the counts the docs report come from the same Tally."""
    t = server["tally"]
    print(f"\nfuzz: {t.total} requests, {t.ok} 2xx, {t.client_errors} 4xx, {len(t.server_errors)} 5xx, "
          f"{t.alive_checks} alive checks; by status {sorted(t.by_status.items())}")
    assert t.total > 0 and not t.server_errors


@FAST
@given(req=_fuzz.requests(_fuzz.API_ROUTES))
def test_fuzzed_messages_and_responses_requests_never_5xx(server, req):
    """The same property for Anthropic's Messages and OpenAI's Responses routes (after the tally above,
    whose counts the docs report), each with its own error shape and stream ending."""
    path, body = req
    content = _fuzz.encode(body)
    r = send(server, path, content, {"content-type": "application/json"})
    _fuzz.check_response(r, f"POST {path} {content[:300]!r}", path)
    assert_alive(server, good_request=False)


TAGS = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>",
        "</think>", "get_weather", "city", '{"a": [1, ', "null", "\n"]


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(pieces=st.lists(st.one_of(st.sampled_from(TAGS), st.text(max_size=8)), max_size=30),
       params=st.one_of(st.none(), _fuzz._tool_schemas()), opens=st.booleans())
def test_parsers_never_raise_on_model_output(pieces, params, opens):
    """Whatever the model emits, in any chunking, against any tool schema the server accepts, the
    reasoning and tool parsers return text (a raise here would be a 500 mid-stream)."""
    from glm5.serve.parsers import GLMReasoningParser, GLMToolParser
    from glm5.serve.validation import schema_error
    if params is not None and schema_error(params) is not None:
        params = {}  # the server refuses invalid schemas before a parser ever sees them
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    reasoning, parser = GLMReasoningParser(opens), GLMToolParser(tools)
    for piece in pieces:
        r, c = reasoning.feed(piece)
        assert isinstance(r, str) and isinstance(c, str)
        parser.feed(c)
    parser.feed(reasoning.finish()[1])
    parser.finish()
    for call in parser.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


def test_a_body_sent_as_a_form_is_told_to_send_json(server):
    """`curl -d '{...}'` without -H sends application/x-www-form-urlencoded: the 400 names the header to add."""
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    for headers in ({"content-type": "application/x-www-form-urlencoded"}, {}):
        r = send(server, "/v1/completions", body, headers)
        err = r.json()["error"]
        assert r.status_code == 400 and "Content-Type: application/json" in err["message"], r.text
        assert err["type"] == "invalid_request_error" and err["param"] == "body"
    assert send(server, "/v1/completions", body, {"content-type": "application/json"}).status_code == 200
