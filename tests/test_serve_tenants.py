"""Issue 30: one tenant cannot take the server from the others. Several API keys are accepted, each its
own tenant under `max_running_per_key` / `max_waiting_per_key` (a full queue is a 429 with Retry-After and
OpenAI's `rate_limit_exceeded`, before the body is read); a multi-megabyte prompt is refused after counting
only up to the context, with vLLM's context-length error; the real engine on a tiny checkpoint."""

import asyncio
import json
import socket
import time

import httpx
import pytest

from glm5.serve.common import APIError
from glm5.serve.config import ServerConfig
from glm5.serve.tenants import TenantLimiter

from ._live import PROMPT, live_server

KEYS = ("sk-alice", "sk-bob")


@pytest.fixture(scope="module")
def live(tmp_path_factory, one_thread):
    server = ServerConfig(api_key=KEYS, max_running_per_key=1, max_waiting_per_key=0, retry_after_s=2)
    idle = []
    with live_server(tmp_path_factory.mktemp("tenants"), max_model_len=2048, num_blocks=256,
                     server=server, on_idle=lambda: idle.append(1)) as s:
        yield {**s, "idle": idle}


def post(live, path, body, key, **kw):
    return httpx.post(live["url"] + path, content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json", "authorization": f"Bearer {key}"}, **kw)


def test_every_key_is_accepted_and_a_wrong_one_is_not(live):
    for key in KEYS:
        r = post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}, key)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == live["expected"]
    assert post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, "sk-eve").status_code == 401
    r = httpx.post(live["url"] + "/v1/messages", headers={"x-api-key": KEYS[1]}, timeout=60,
                   json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200


def test_a_tenant_over_its_limit_gets_429_and_the_others_are_served(live):
    # alice's one slot is taken by a request whose body is still arriving (a slot is held from admission,
    # before the body is read, to the response's last byte): deterministic, unlike a stream that may end
    host, port = live["url"].removeprefix("http://").split(":")
    held = socket.create_connection((host, int(port)), timeout=30)
    held.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEYS[0]}\r\n"
                 "content-type: application/json\r\ncontent-length: 100\r\n\r\n{".encode())
    try:
        for _ in range(200):  # until the server has admitted it
            r = post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, KEYS[0])
            if r.status_code == 429:
                break
            time.sleep(0.02)
        r = post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, KEYS[0])
        assert r.status_code == 429 and r.headers["retry-after"] == "2", r.text
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests" and "per API key" in err["message"]
        r = httpx.post(live["url"] + "/v1/messages", headers={"x-api-key": KEYS[0]}, timeout=60,
                       json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"  # Anthropic's shape
        r = post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}, KEYS[1])
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == live["expected"]  # bob is served
        assert httpx.get(live["url"] + "/health", timeout=30).status_code == 200  # never limited
    finally:
        held.close()
    # the held request's client went away: alice's slot is free again
    for _ in range(100):
        r = post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}, KEYS[0])
        if r.status_code != 429:
            break
        time.sleep(0.05)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == live["expected"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "ab " * 1_300_000, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab " * 1_300_000}], "max_tokens": 2}),
    ("/tokenize", {"prompt": "ab " * 1_300_000}),
])
def test_a_multi_megabyte_prompt_is_refused_after_counting_to_the_context(live, path, body):
    r = post(live, path, body, KEYS[1])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "maximum context length is 2048 tokens" in err["message"] and "at least" in err["message"]
    r = post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}, KEYS[1])
    assert r.json()["choices"][0]["text"] == live["expected"]


def test_limiter_admits_in_order_and_frees_on_cancel():
    """The limiter alone: `concurrency` run, `queue` wait in arrival order, the next is a 429; a waiter
    cancelled (its client left) gives its place back; idle tenants are forgotten."""

    async def scenario():
        lim, order = TenantLimiter(concurrency=1, queue=2), []

        async def request(name, hold):
            async with lim.slot("t"):
                order.append(name)
                await hold.wait()

        holds = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(request(i, h)) for i, h in enumerate(holds)]
        await asyncio.sleep(0)
        assert lim.admitted("t") == 3 and order == [0]
        with pytest.raises(APIError) as e:
            lim.slot("t")
        assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
        lim.slot("other")  # another tenant is not affected (admitted, then dropped below)
        lim._leave("other", lim._tenants["other"])
        tasks[2].cancel()  # the last waiter leaves the queue
        await asyncio.sleep(0)
        assert lim.admitted("t") == 2
        for h in holds[:2]:
            h.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert order == [0, 1] and lim.admitted("t") == 0 and not lim._tenants

    asyncio.run(scenario())


def test_the_idle_hook_runs_once_the_server_is_quiet():
    """`IdleHook` (glm5 serve: malloc_trim): after the last API request ends and `after_s` pass with none in
    flight; not while one runs, once per quiet spell however many requests came before, never without work."""
    from glm5.serve.app import IdleHook

    async def scenario():
        calls = []
        hook = IdleHook(lambda: calls.append(1), after_s=0.05)
        await asyncio.sleep(0.1)
        assert calls == []  # no work yet: nothing to give back
        hook.enter()
        hook.enter()
        hook.leave()
        await asyncio.sleep(0.15)
        assert calls == []  # one request still in flight
        hook.leave()
        hook.enter()  # another arrives within after_s: the first timer is void
        hook.leave()
        await asyncio.sleep(0.15)
        await hook._task
        assert calls == [1] and hook.calls == 1
        await asyncio.sleep(0.1)
        assert calls == [1]  # quiet with no new work: not again

    asyncio.run(scenario())


def test_the_server_calls_its_idle_hook_after_api_work_only(live):
    time.sleep(1.5)  # whatever ran before has had its quiet second
    n = len(live["idle"])
    for _ in range(5):  # monitors polling do not count as work
        assert httpx.get(live["url"] + "/health", timeout=30).status_code == 200
    time.sleep(1.5)
    assert len(live["idle"]) == n
    for _ in range(3):
        r = post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, KEYS[1])
        assert r.status_code == 200
    for _ in range(100):
        if len(live["idle"]) > n:
            break
        time.sleep(0.05)
    calls = len(live["idle"])
    time.sleep(1.5)
    assert calls > n and len(live["idle"]) == calls  # after the work, and not again while quiet
