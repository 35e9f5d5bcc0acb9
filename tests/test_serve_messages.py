"""`/v1/messages` through the official `anthropic` SDK against a live server on the scripted fake engine
(test_serve_app.py's): streaming == non-streaming (the SDK's own stream accumulator), Anthropic's event
sequence, tool round trips, thinking on/off, stop_reason for each way an answer ends, count_tokens ==
the prompt the engine got, x-api-key auth and Anthropic-shaped 4xx errors for malformed requests.
The thinking budget runs through the real engine on a tiny checkpoint (the fake engine samples nothing).
"""

import json

import anthropic
import httpx
import pytest

from glm5.serve.app import create_app
from glm5.serve.config import ServerConfig
from glm5.serve.testing import serve_in_thread
from tests._live import live_server
from tests._tiny import tiny_config
from tests.test_serve_app import SCRIPT, TOK, TOOLS, FakeEngine

KEY = "sk-ant-test"
WEATHER = [{"name": "get_weather", "description": "Weather of a city",
            "input_schema": TOOLS[0]["function"]["parameters"]}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
THINK = {"type": "enabled", "budget_tokens": 100}


@pytest.fixture
def serve():
    """serve(script, **server_config) -> (engine, anthropic client, base url); servers stop at teardown."""
    stack = []

    def start(script=SCRIPT, ocr=False, **cfg):
        engine = FakeEngine(script=script)
        engine.model_config = tiny_config(vocab_size=TOK.vocab_size)  # the tokenizer's ids are in range
        app = create_app(engine, config=ServerConfig(api_key=KEY, **cfg), model_name="fake",
                         image_reader=(lambda url: "OCR TEXT") if ocr else None)
        ctx = serve_in_thread(app)
        url = ctx.__enter__()
        stack.append(ctx)
        return engine, anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0), url

    yield start
    for ctx in reversed(stack):
        ctx.__exit__(None, None, None)


def _blocks(message) -> list[dict]:
    return [b.model_dump(exclude_none=True, exclude={"parsed_output"}) for b in message.content]


def test_stream_equals_nonstream_with_thinking_and_tool_use(serve):
    _, c, url = serve()
    full = c.messages.create(model="fake", max_tokens=200, messages=ASK, tools=WEATHER, thinking=THINK)
    assert [b.type for b in full.content] == ["thinking", "text", "tool_use"]
    assert full.content[0].thinking == "The user wants weather."
    assert full.content[1].text == "Let me check."
    assert (full.content[2].name, full.content[2].input) == ("get_weather", {"city": "Paris", "days": 3})
    assert full.stop_reason == "tool_use" and full.stop_sequence is None
    with c.messages.stream(model="fake", max_tokens=200, messages=ASK, tools=WEATHER, thinking=THINK) as s:
        streamed = s.get_final_message()
    ids = lambda blocks: [{k: v for k, v in b.items() if k != "id"} for b in blocks]  # noqa: E731
    assert ids(_blocks(streamed)) == ids(_blocks(full))
    assert (streamed.stop_reason, streamed.usage.input_tokens, streamed.usage.output_tokens) == \
        (full.stop_reason, full.usage.input_tokens, full.usage.output_tokens)


def test_event_sequence_is_anthropics(serve):
    _, _, url = serve()
    body = {"model": "fake", "max_tokens": 200, "messages": ASK, "tools": WEATHER, "thinking": THINK, "stream": True}
    r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = []
    for frame in r.text.strip().split("\n\n"):
        name, data = frame.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        events.append(payload)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = {e["delta"]["type"] for e in events if e["type"] == "content_block_delta"}
    assert deltas == {"thinking_delta", "text_delta", "input_json_delta"}
    for i in range(3):  # every block opens, gets its deltas, and closes before the next opens
        mine = [n for n, e in enumerate(events) if e.get("index") == i]
        assert events[mine[0]]["type"] == "content_block_start" and events[mine[-1]]["type"] == "content_block_stop"
        assert all(events[n]["type"] == "content_block_delta" for n in mine[1:-1])
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] > 0


def test_tool_round_trip(serve):
    engine, c, _ = serve()
    first = c.messages.create(model="fake", max_tokens=200, messages=ASK, tools=WEATHER, thinking=THINK)
    call = next(b for b in first.content if b.type == "tool_use")
    engine.script = TOK.encode("It is sunny in Paris.")
    turn = [*ASK, {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": [{"type": "text", "text": "sunny, 21C"}]}]}]
    answer = c.messages.create(model="fake", max_tokens=200, messages=turn, tools=WEATHER)
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text == "It is sunny in Paris."
    assert answer.stop_reason == "end_turn"
    prompt = TOK.decode(engine.prompts[-1], skip_special_tokens=False)
    assert "sunny, 21C" in prompt and "<|observation|>" in prompt  # the result went in as the tool's turn
    assert "Paris" in prompt.split("<|observation|>")[0]  # after the assistant's replayed call


def test_thinking_off_and_tool_choice_none(serve):
    engine, c, _ = serve(script="Hello there.")
    m = c.messages.create(model="fake", max_tokens=50, messages=[{"role": "user", "content": "hi"}],
                          system=[{"type": "text", "text": "Be brief."}])
    assert _blocks(m) == [{"type": "text", "text": "Hello there."}] and m.stop_reason == "end_turn"
    prompt = TOK.decode(engine.prompts[-1], skip_special_tokens=False)
    assert "Be brief." in prompt and prompt.rstrip().endswith("</think>")  # the template's thinking-off form
    engine.script = TOK.encode(SCRIPT)
    m = c.messages.create(model="fake", max_tokens=200, messages=ASK, tools=WEATHER, tool_choice={"type": "none"})
    assert [b.type for b in m.content] == ["text"] and "<tool_call>get_weather" in m.content[0].text
    assert m.stop_reason == "end_turn"  # tool_use only with a tool_use block


def test_stop_sequence_and_max_tokens(serve):
    _, c, _ = serve(script="Let me check the weather.")
    m = c.messages.create(model="fake", max_tokens=50, messages=ASK, stop_sequences=["check"])
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", "check", "Let me ")
    with c.messages.stream(model="fake", max_tokens=50, messages=ASK, stop_sequences=["check"]) as s:
        assert s.get_final_message().stop_sequence == "check"
    m = c.messages.create(model="fake", max_tokens=2, messages=ASK, metadata={"user_id": "u1"},
                          extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})  # this SDK has no kwargs
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2


def test_count_tokens_is_the_engines_prompt(serve):
    engine, c, _ = serve()
    for kwargs in ({}, {"tools": WEATHER, "system": "You are terse.", "thinking": THINK}):
        n = c.messages.count_tokens(model="fake", messages=ASK, **kwargs).input_tokens
        m = c.messages.create(model="fake", max_tokens=200, messages=ASK, **kwargs)
        assert n == len(engine.prompts[-1]) == m.usage.input_tokens


def test_x_api_key_auth(serve):
    _, c, url = serve()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="fake", max_tokens=5, messages=ASK)
    r = httpx.post(url + "/v1/messages", json={"model": "fake", "max_tokens": 5, "messages": ASK},
                   headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200  # the Bearer form of the same key works too


def test_images_go_through_the_ocr_reader(serve):
    engine, c, _ = serve(ocr=True)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    c.messages.create(model="fake", max_tokens=5, messages=[{"role": "user", "content": [
        image, {"type": "text", "text": "Read it."}]}])
    assert "OCR TEXT" in TOK.decode(engine.prompts[-1], skip_special_tokens=False)


def _msg(**kw):
    return {"model": "fake", "max_tokens": 20, "messages": ASK, **kw}


# (body, status, error type, whether count_tokens rejects it too: it takes the prompt fields only)
BAD = [
    (_msg(messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}]), 400, "invalid_request_error", True),
    (_msg(messages=[*ASK, {"role": "assistant", "content": "ok"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]), 400, "invalid_request_error", True),
    (_msg(thinking={"type": "enabled", "budget_tokens": 20}), 400, "invalid_request_error", False),
    (_msg(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]), 400, "invalid_request_error", True),
    ({"model": "fake", "messages": ASK}, 400, "invalid_request_error", False),  # max_tokens is required
    (_msg(max_tokens=0), 400, "invalid_request_error", False),
    (_msg(messages=[]), 400, "invalid_request_error", True),
    (_msg(messages=[{"role": "system", "content": "x"}]), 400, "invalid_request_error", True),
    (_msg(temperature=1.5), 400, "invalid_request_error", False),
    (_msg(tools=WEATHER, tool_choice={"type": "tool", "name": "nope"}), 400, "invalid_request_error", True),
    (_msg(tools=WEATHER, tool_choice={"type": "tool"}), 400, "invalid_request_error", True),
    (_msg(tools=[{"name": "f", "input_schema": {"type": "nope"}}]), 400, "invalid_request_error", True),
    (_msg(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400, "invalid_request_error", True),
    (_msg(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
     400, "invalid_request_error", True),
    (_msg(max_tokens=10_000), 400, "invalid_request_error", False),
    (_msg(model="claude-nope"), 404, "not_found_error", True),
    (b"{not json", 400, "invalid_request_error", True),
    (b'{"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": "' + b"x" * 3000 + b'"}]}',
     413, "request_too_large", True),
]


@pytest.mark.parametrize("body,status,kind,count_too", BAD)
def test_bad_requests_get_anthropic_errors(serve, body, status, kind, count_too):
    _, _, url = serve(max_body_bytes=2048)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    for path in ("/v1/messages", "/v1/messages/count_tokens")[:2 if count_too else 1]:
        r = httpx.post(url + path, content=content, headers={"x-api-key": KEY, "content-type": "application/json"})
        assert r.status_code == status, (path, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]


def test_unauthenticated_error_is_anthropic_shaped(serve):
    _, _, url = serve()
    r = httpx.post(url + "/v1/messages", json=_msg(), headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def _greedy_tokens(url: str, **extra) -> list[str]:
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": "tiny", "messages": ASK, "max_tokens": 8, "temperature": 0, "logprobs": True,
        "chat_template_kwargs": {"enable_thinking": True}, **extra})
    assert r.status_code == 200, r.text
    return [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("tiny-messages")) as server:
        yield server


def test_thinking_budget_forces_the_end_of_thinking(live):
    """Real engine, greedy: with budget_tokens=b the output's token b is `</think>` (unbudgeted, the
    random model does not close its thinking that early), and /v1/messages generates the same."""
    url = live["url"]
    c = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    free = _greedy_tokens(url)
    assert "</think>" not in free[:4]
    for budget in (1, 3):
        tokens = _greedy_tokens(url, thinking_budget=budget)
        assert tokens[:budget] == free[:budget] and tokens[budget] == "</think>"
        m = c.messages.create(model="tiny", max_tokens=8, messages=ASK, extra_body={"temperature": 0},
                              thinking={"type": "enabled", "budget_tokens": budget})
        assert m.usage.output_tokens == len(tokens)
        assert [b.type for b in m.content][:1] == ["thinking"]


def test_stop_sequence_on_the_real_engine(live):
    """The engine's stop-string match becomes stop_reason stop_sequence, streamed and not."""
    c = anthropic.Anthropic(base_url=live["url"], api_key="none", max_retries=0)
    ask = dict(model="tiny", max_tokens=12, messages=ASK, extra_body={"temperature": 0})
    free = c.messages.create(**ask).content[0].text
    assert len(free) > 8
    stop = free[4:7]
    m = c.messages.create(**ask, stop_sequences=[stop])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert free.startswith(m.content[0].text) and stop not in m.content[0].text
    with c.messages.stream(**ask, stop_sequences=[stop]) as s:
        streamed = s.get_final_message()
    assert (streamed.stop_reason, streamed.content[0].text) == ("stop_sequence", m.content[0].text)
