"""`/v1/responses` through the official `openai` SDK's `client.responses` against a live server on the
scripted fake engine (test_serve_app.py's): streaming == non-streaming (deltas added up, and the SDK's
own final response), the event sequence, a function-call round trip by items and by
`previous_response_id`, reasoning items, the bounded store's eviction, and 4xx for malformed requests.
"""

import json

import httpx
import openai
import pytest

from glm5.serve.app import create_app
from glm5.serve.config import ServerConfig
from glm5.serve.testing import serve_in_thread
from tests.test_serve_app import SCRIPT, TOK, TOOLS, FakeEngine

WEATHER = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
            "parameters": TOOLS[0]["function"]["parameters"]}]


@pytest.fixture
def serve():
    """serve(script, **server_config) -> (engine, openai client, base url)."""
    stack = []

    def start(script=SCRIPT, **cfg):
        engine = FakeEngine(script=script)
        ctx = serve_in_thread(create_app(engine, config=ServerConfig(**cfg), model_name="fake"))
        url = ctx.__enter__()
        stack.append(ctx)
        return engine, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), url

    yield start
    for ctx in reversed(stack):
        ctx.__exit__(None, None, None)


def _summary(output) -> list[tuple]:
    out = []
    for item in output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content)))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        else:
            out.append(("function_call", item.name, item.arguments, item.status))
    return out


def test_stream_equals_nonstream(serve):
    _, c, _ = serve()
    full = c.responses.create(model="fake", input="Weather in Paris?", tools=WEATHER, max_output_tokens=200,
                              instructions="Use tools.")
    assert full.status == "completed"
    assert _summary(full.output) == [("reasoning", "The user wants weather."), ("message", "Let me check."),
                                     ("function_call", "get_weather", '{"city": "Paris", "days": 3}', "completed")]
    assert full.output_text == "Let me check." and full.usage.total_tokens == \
        full.usage.input_tokens + full.usage.output_tokens
    deltas: dict[str, str] = {}
    kinds = []
    with c.responses.stream(model="fake", input="Weather in Paris?", tools=WEATHER, max_output_tokens=200,
                            instructions="Use tools.") as s:
        for e in s:
            kinds.append(e.type)
            if e.type.endswith(".delta"):
                deltas[e.type] = deltas.get(e.type, "") + e.delta
        final = s.get_final_response()
    assert _summary(final.output) == _summary(full.output)
    assert deltas == {"response.reasoning_text.delta": "The user wants weather.",
                      "response.output_text.delta": "Let me check.",
                      "response.function_call_arguments.delta": full.output[2].arguments}
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and kinds.count("response.output_item.done") == 3
    assert final.usage.output_tokens == full.usage.output_tokens


def test_sequence_numbers_and_item_lifecycle(serve):
    _, _, url = serve()
    r = httpx.post(url + "/v1/responses", json={"model": "fake", "input": "hi", "tools": WEATHER, "stream": True})
    events = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in r.text.strip().split("\n\n")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for i in range(3):  # each item is added, streamed, then done, before the next one is added
        mine = [e["type"] for e in events if e.get("output_index") == i]
        assert mine[0] == "response.output_item.added" and mine[-1] == "response.output_item.done"
    assert events[0]["response"]["status"] == "in_progress" and events[-1]["response"]["status"] == "completed"


def test_function_call_round_trip_by_items_and_by_previous_response_id(serve):
    engine, c, _ = serve()
    first = c.responses.create(model="fake", input="Weather in Paris?", tools=WEATHER)
    call = first.output[-1]
    engine.script = TOK.encode("Got it.</think>It is sunny.")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}
    chained = c.responses.create(model="fake", previous_response_id=first.id, input=[result], tools=WEATHER)
    assert chained.output_text == "It is sunny." and chained.previous_response_id == first.id
    by_chain = engine.prompts[-1]
    replay = [{"role": "user", "content": "Weather in Paris?"},
              {"type": "reasoning", "id": first.output[0].id, "summary": [],
               "content": [{"type": "reasoning_text", "text": first.output[0].content[0].text}]},
              {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              result]
    stateless = c.responses.create(model="fake", input=replay, tools=WEATHER, store=False)
    assert stateless.output_text == "It is sunny."
    assert engine.prompts[-1] == by_chain  # the stored conversation is exactly the replayed items
    prompt = TOK.decode(by_chain, skip_special_tokens=False)
    assert "sunny, 21C" in prompt and "<|observation|>" in prompt
    with pytest.raises(openai.BadRequestError, match="not found"):  # store=False kept nothing
        c.responses.create(model="fake", previous_response_id=stateless.id, input="again")


def test_reasoning_effort_turns_thinking_off(serve):
    engine, c, _ = serve(script="Hello there.")
    r = c.responses.create(model="fake", input="hi", reasoning={"effort": "minimal"})
    assert _summary(r.output) == [("message", "Hello there.")]
    assert TOK.decode(engine.prompts[-1], skip_special_tokens=False).rstrip().endswith("</think>")
    r = c.responses.create(model="fake", input="hi", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_store_is_bounded(serve):
    _, c, _ = serve(script="ok", max_stored_responses=2)
    ids = [c.responses.create(model="fake", input=f"q{i}").id for i in range(3)]
    c.responses.create(model="fake", previous_response_id=ids[2], input="more")  # recent: still there
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="fake", previous_response_id=ids[0], input="more")
    assert e.value.body["code"] == "previous_response_not_found" and "evicted" in e.value.body["message"]


def _req(**kw):
    return {"model": "fake", "input": "hi", **kw}


BAD = [
    (_req(input=[{"type": "computer_call", "id": "x"}]), 400),
    (_req(input=[{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}]), 400),
    (_req(input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]), 400),
    (_req(input=[{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{bad"}]), 400),
    (_req(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]),
     400),
    (_req(input=[]), 400),
    (_req(tools=[{"type": "web_search"}]), 400),
    (_req(tools=[{"type": "function", "name": "f", "parameters": {"type": "nope"}}]), 400),
    (_req(tool_choice="required"), 400),
    (_req(tool_choice={"type": "function", "name": "nope"}, tools=WEATHER), 400),
    (_req(max_output_tokens=0), 400),
    (_req(max_output_tokens=100_000), 400),
    (_req(temperature=3), 400),
    (_req(previous_response_id="resp_unknown"), 400),
    (_req(model="gpt-nope"), 404),
    ({"model": "fake"}, 400),
    (b"{not json", 400),
    (_req(input="x" * 5000), 413),
]


@pytest.mark.parametrize("body,status", BAD)
def test_bad_requests_get_openai_errors(serve, body, status):
    _, _, url = serve(max_body_bytes=4096)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + "/v1/responses", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] in ("invalid_request_error", "not_found_error")
