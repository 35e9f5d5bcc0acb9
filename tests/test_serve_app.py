"""Server behaviour against a scripted fake engine (fast, deterministic): parsers through the API,
streaming == non-streaming, errors, auth, body bound, admission control, dynamic batching, disconnect
-> abort, hot-swap validation, metrics. The same API runs through the real engine in test_serve_e2e.py.
"""

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch
from safetensors.torch import save

from glm5.data.tokenizer import IncrementalDetokenizer, load_tokenizer
from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.infer.outputs import CompletionOutput, Logprob, RequestOutput
from glm5.infer.sampling import SamplingParams
from glm5.serve.app import create_app
from glm5.serve.async_engine import AsyncEngine, EngineDead
from glm5.serve.metrics import ServerMetrics
from glm5.serve.config import ServerConfig
from glm5.serve.testing import serve_in_thread
from glm5.model.config import ModelConfig
from glm5.model.generation_config import GenerationConfig
from glm5.model.model import GLM5ForCausalLM
from tests._tiny import tiny_config

TOK = load_tokenizer("bundled:tokenizer-8k")
SCRIPT = ("The user wants weather.</think>Let me check.<tool_call>get_weather<arg_key>city</arg_key>"
          "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


class FakeEngine:
    """Emits a fixed token script (one token per step per sample) with the LLMEngine interface."""

    def __init__(self, script=SCRIPT, step_sleep=0.0, fail_step=False, **cfg):
        self.tokenizer, self.script = TOK, TOK.encode(script)
        self.config = EngineConfig(model="fake", device="cpu", dtype="float32",
                                   **{"max_model_len": 512, "batch_timeout_ms": 0, **cfg})
        self.model_config = tiny_config()
        self.generation_config = GenerationConfig.from_model_config(self.model_config)
        self.max_model_len = self.config.max_model_len
        self.model_version, self.step_sleep, self.fail_step = 0, step_sleep, fail_step
        self.reqs, self.aborted, self.batch_sizes, self.swaps = {}, [], [], []
        self.prompts = []  # every prompt the engine was given, in order

    def add_request(self, request_id, prompt=None, prompt_token_ids=None, params=None, infill=None):
        assert request_id not in self.reqs
        self.prompts.append(list(prompt_token_ids))
        self.reqs[request_id] = (list(prompt_token_ids), params, [[] for _ in range(params.n)])

    def abort_request(self, request_id):
        if self.reqs.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def batch_wait(self, batching):
        return None  # the scripted engine runs every request at once (batching: tests on the real engine below)

    def list_loras(self):
        return {}

    def get_stats(self):
        return {"num_running": len(self.reqs), "num_waiting": 0, "kv_cache_usage": 0.0}

    def swap_experts(self, updates):
        self.swaps.append(sorted(updates))
        self.model_version += 1

    def rollback_experts(self):
        if not self.swaps:
            raise ValueError("no expert swap to roll back")
        self.swaps.pop()
        self.model_version -= 1
        return self.model_version

    def step(self, batching=None):
        time.sleep(self.step_sleep)
        if self.fail_step:
            raise RuntimeError("simulated device error")
        self.batch_sizes.append(len(self.reqs))
        outs = []
        for rid, (prompt, params, samples) in list(self.reqs.items()):
            outputs = [self._sample(i, ids, params) for i, ids in enumerate(samples)]
            finished = all(o.finish_reason for o in outputs)
            prompt_lp = [None] + [{t: Logprob(-1.0, 1)} for t in prompt[1:]] if params.prompt_logprobs is not None else None
            outs.append(RequestOutput(rid, None, prompt, prompt_lp, outputs, finished, None, self.model_version))
            if finished:
                del self.reqs[rid]
        return outs

    def _sample(self, i, ids, params):
        limit = min(params.max_tokens, len(self.script))
        if len(ids) < limit:
            ids.append(self.script[len(ids)])
        det = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        text = det.add(ids) + det.finish()
        reason = ("length" if len(ids) == params.max_tokens else "stop") if len(ids) == limit else None
        stop_reason = None
        for s in params.stop:
            if s in text:
                text, reason, stop_reason = text[: text.index(s)], "stop", s
        lps = [{t: Logprob(-0.5, 1), 7: Logprob(-2.0, 2)} for t in ids] if params.logprobs is not None else None
        return CompletionOutput(i, text, list(ids), None, lps, reason, stop_reason)


@pytest.fixture
def server(request):
    opts = getattr(request, "param", {})
    engine = FakeEngine(**opts.get("engine", {}))
    app = create_app(engine, config=ServerConfig(**opts.get("server", {})), model_name="fake")
    with serve_in_thread(app) as url:
        yield engine, url


class RecordingEngine(LLMEngine):
    """The real engine (a one-layer `tiny` preset on CPU) recording how many requests each step ran, for the
    admission and batching rules, which live in its scheduler."""

    def __init__(self, step_sleep=0.0, **cfg):
        torch.manual_seed(0)
        model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", num_hidden_layers=1, num_nextn_predict_layers=0))
        super().__init__(EngineConfig(device="cpu", dtype="float32", max_model_len=128, num_blocks=64, block_size=16,
                                      **cfg), model=model.init_weights(0), tokenizer=TOK)
        self.batch_sizes, self.step_sleep = [], step_sleep

    def step(self, batching=None):
        time.sleep(self.step_sleep)
        outs = super().step(batching)
        if outs:  # running after the step + finished in it = the requests this step ran
            self.batch_sizes.append(len(self.scheduler.running) + sum(o.finished for o in outs))
        return outs


@pytest.fixture
def real_server(request):
    opts = getattr(request, "param", {})
    engine = RecordingEngine(**opts.get("engine", {}))
    app = create_app(engine, config=ServerConfig(**opts.get("server", {})), model_name="tiny")
    with serve_in_thread(app) as url:
        yield engine, url


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_chat_tools_reasoning_stream_equals_nonstream(server):
    engine, url = server
    c = client(url)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    full = c.chat.completions.create(model="fake", messages=msgs, tools=TOOLS, max_tokens=200)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.reasoning_content == "The user wants weather."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 3})]
    content, reasoning, args, names, finish = "", "", "", [], None
    for chunk in c.chat.completions.create(model="fake", messages=msgs, tools=TOOLS, max_tokens=200,
                                           stream=True, stream_options={"include_usage": True}):
        if not chunk.choices:
            assert chunk.usage.completion_tokens == full.usage.completion_tokens
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for t in d.tool_calls or []:
            names += [t.function.name] if t.function.name else []
            args += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (content, reasoning, names, args, finish) == (
        "Let me check.", "The user wants weather.", ["get_weather"], choice.message.tool_calls[0].function.arguments,
        "tool_calls")


def test_chat_thinking_off_and_tool_choice_none(server):
    _, url = server
    r = client(url).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="none",
        max_tokens=200, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = r.choices[0].message
    assert msg.reasoning_content is None and "<tool_call>get_weather" in msg.content and not msg.tool_calls


def test_completions_logprobs_echo_n_stop(server):
    _, url = server
    c = client(url)
    r = c.completions.create(model="fake", prompt="Hello world", max_tokens=5, n=2, logprobs=2, echo=True,
                             stop=["check"])
    assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text
    lp = r.choices[0].logprobs
    n_prompt = len(TOK.encode("Hello world", add_special_tokens=True))
    assert lp.token_logprobs[0] is None and len(lp.tokens) == n_prompt + 5
    assert r.choices[0].text.startswith("Hello world")
    r = c.completions.create(model="fake", prompt="x", max_tokens=200, stop=["check"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text.endswith("Let me ")
    assert r.usage.prompt_tokens == len(TOK.encode("x", add_special_tokens=True))


BAD = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400),
    ("/v1/completions", {"prompt": "hi " * 1000}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000}, 400),
    ("/v1/completions", {"prompt": [[99999]]}, 400),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": "hi", "n": "many"}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{bad"}}]}]}, 400),
    ("/v1/chat/completions", [1, 2, 3], 400),
    ("/v1/nothing", {}, 404),
    ("/detokenize", {"tokens": [-1]}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD)
def test_bad_inputs_get_error_objects(server, path, body, status):
    _, url = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


@pytest.mark.parametrize("server", [{"server": {"api_key": "sk-1", "admin_key": "adm", "max_body_bytes": 1000}}],
                         indirect=True)
def test_auth_and_body_limit(server):
    engine, url = server
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong").models.list()
    assert client(url, "sk-1").models.list().data[0].id == "fake"
    assert httpx.get(url + "/health").status_code == 200  # health stays open
    r = httpx.post(url + "/v1/completions", json={"prompt": "x" * 5000}, headers={"Authorization": "Bearer sk-1"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    assert httpx.get(url + "/admin/experts", headers={"Authorization": "Bearer sk-1"}).status_code == 401
    r = httpx.get(url + "/admin/experts", headers={"Authorization": "Bearer adm", "X-Request-Id": "abc"})
    assert r.status_code == 200 and r.json()["model_version"] == 0 and r.headers["x-request-id"] == "abc"


@pytest.mark.parametrize("real_server", [{"engine": {"step_sleep": 0.05, "max_batch_size": 1, "preferred_batch_size": 1},
                                          "server": {"max_waiting_requests": 2}}], indirect=True)
def test_admission_control_503_with_retry_after(real_server):
    engine, url = real_server

    async def go():
        async with httpx.AsyncClient(timeout=30) as h:
            return await asyncio.gather(*[h.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 20})
                                          for _ in range(8)])
    responses = asyncio.run(go())
    codes = [r.status_code for r in responses]
    rejected = [r for r in responses if r.status_code == 503]
    assert 200 in codes and 503 in codes and set(codes) <= {200, 503}
    assert rejected and all(r.headers["retry-after"] == "1" for r in rejected)
    assert max(engine.batch_sizes) == 1  # max_batch_size is never exceeded


@pytest.mark.parametrize("real_server", [{"engine": {"max_batch_size": 4, "preferred_batch_size": 4,
                                                     "batch_timeout_ms": 20000}}], indirect=True)
def test_dynamic_batching_gathers_preferred_batch(real_server):
    engine, url = real_server

    async def go():
        async with httpx.AsyncClient(timeout=60) as h:
            return await asyncio.gather(*[h.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
                                          for _ in range(4)])
    t0 = time.monotonic()
    assert all(r.status_code == 200 for r in asyncio.run(go()))
    assert engine.batch_sizes[0] == 4  # the idle engine waited for the preferred batch
    assert time.monotonic() - t0 < 15  # ...and did not sit out the whole timeout once it was full


@pytest.mark.parametrize("real_server", [{"engine": {"max_batch_size": 4, "preferred_batch_size": 3,
                                                     "batch_timeout_ms": 20000}}], indirect=True)
def test_gathering_requests_wait_in_the_engine_queue(real_server):
    """One admission queue: requests gathered for the preferred batch are already in the engine's queue (and
    counted once in vllm:num_requests_waiting); the third one starts the batch."""
    engine, url = real_server

    def waiting_gauge():
        text = httpx.get(url + "/metrics").text
        return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("vllm:num_requests_waiting{"))

    async def go():
        async with httpx.AsyncClient(timeout=60) as h:
            post = lambda: h.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})  # noqa: E731
            first = [asyncio.ensure_future(post()) for _ in range(2)]
            deadline = time.monotonic() + 20
            while engine.num_waiting_requests() < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            seen = (engine.num_waiting_requests(), await asyncio.to_thread(waiting_gauge), engine.batch_sizes[:])
            return seen, await asyncio.gather(*first, post())
    (queued, gauge, sizes), responses = asyncio.run(go())
    assert (queued, gauge, sizes) == (2, 2.0, [])  # in the scheduler's queue, nothing stepped yet
    assert all(r.status_code == 200 for r in responses) and engine.batch_sizes[0] == 3


@pytest.mark.parametrize("server", [{"engine": {"step_sleep": 0.05}}], indirect=True)
def test_stream_disconnect_aborts(server):
    engine, url = server
    with httpx.stream("POST", url + "/v1/completions",
                      json={"prompt": "x", "max_tokens": 200, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 10
    while not engine.aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(engine.aborted) == 1 and not engine.reqs


@pytest.mark.parametrize("server", [{"engine": {"step_sleep": 0.1}}], indirect=True)
def test_nonstream_disconnect_aborts(server):
    engine, url = server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 200}, timeout=0.3)
    deadline = time.monotonic() + 10
    while not engine.aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(engine.aborted) == 1 and not engine.reqs


@pytest.mark.parametrize("server", [{"engine": {"fail_step": True}}], indirect=True)
def test_engine_failure_is_503_not_a_hang(server):
    _, url = server
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 503 and err["code"] == "engine_failed", err
    assert "simulated device error" in err["message"] and "shutting down" not in err["message"]
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and health.json()["error"]["message"].startswith("engine failed")
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"


def test_graceful_shutdown_drains_then_aborts():
    """Shutdown lets short requests finish, aborts what outlives the drain timeout, refuses new ones."""
    engine = FakeEngine(step_sleep=0.05)
    ae = AsyncEngine(engine, ServerMetrics("x"), max_waiting_requests=256)

    async def collect(rid, max_tokens):
        try:
            return [o async for o in ae.generate(rid, [1, 2], SamplingParams(max_tokens=max_tokens))][-1]
        except EngineDead as e:
            return e

    async def go():
        ae.start()
        tasks = [asyncio.create_task(collect("short", 3)), asyncio.create_task(collect("long", 500))]
        await asyncio.sleep(0.05)
        await ae.shutdown(timeout_s=0.5)
        assert isinstance(await collect("late", 1), EngineDead)
        return await asyncio.gather(*tasks)
    short, long = asyncio.run(asyncio.wait_for(go(), 30))
    assert short.finished and short.outputs[0].finish_reason == "length"
    assert isinstance(long, EngineDead) and engine.aborted == ["long"]


def _expert_file(**override) -> bytes:
    cfg = tiny_config()
    layer = cfg.moe_layers[0]
    t = {f"model.layers.{layer}.mlp.experts.1.gate_proj.weight": torch.zeros(cfg.moe_intermediate_size, cfg.hidden_size),
         f"model.layers.{layer}.mlp.experts.1.down_proj.weight": torch.zeros(cfg.hidden_size, cfg.moe_intermediate_size)}
    t.update(override)
    return save(t)


@pytest.mark.parametrize("server", [{"server": {"admin_key": "adm"}}], indirect=True)
def test_hot_swap_validation(server):
    engine, url = server
    h = {"Authorization": "Bearer adm"}
    bad = [b"garbage", _expert_file(**{"model.layers.0.mlp.experts.1.up_proj.weight": torch.zeros(32, 64)}),
           _expert_file(**{"model.layers.1.mlp.experts.99.up_proj.weight": torch.zeros(32, 64)}),
           _expert_file(**{"model.layers.1.mlp.experts.2.up_proj.weight": torch.zeros(64, 32)}),
           _expert_file(**{"model.layers.1.mlp.experts.2.up_proj.weight": torch.zeros(32, 64, dtype=torch.float16)}),
           _expert_file(**{"lm_head.weight": torch.zeros(2, 2)})]
    for body in bad:
        r = httpx.post(url + "/admin/experts", content=body, headers=h)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
    assert engine.swaps == [] and engine.model_version == 0
    r = httpx.post(url + "/admin/experts", content=_expert_file(), headers=h)
    assert r.status_code == 200 and r.json()["model_version"] == 1 and r.headers["x-model-version"] == "1"
    versions = httpx.get(url + "/admin/experts", headers=h).json()
    assert versions["model_version"] == 1 and versions["versions"][-1]["experts"] == [[1, 1]]
    r = client(url).completions.with_raw_response.create(model="fake", prompt="x", max_tokens=2)
    assert r.headers["x-model-version"] == "1" and r.parse().model_extra["model_version"] == 1
    r = httpx.post(url + "/admin/experts/rollback", headers=h)
    assert r.status_code == 200 and r.json()["model_version"] == 0 and engine.swaps == []
    r = httpx.post(url + "/admin/experts/rollback", headers=h)
    assert r.status_code == 409 and "no expert swap" in r.json()["error"]["message"]
    assert httpx.get(url + "/admin/experts", headers=h).json()["versions"][-1]["rollback"] is True


def test_metrics_and_tokenize(server):
    _, url = server
    client(url).completions.create(model="fake", prompt="hi", max_tokens=4)
    text = httpx.get(url + "/metrics").text
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum", "vllm:request_queue_time_seconds_count",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
        assert name + "{" in text, name
    assert 'vllm:generation_tokens_total{model_name="fake"} 4.0' in text
    ids = httpx.post(url + "/tokenize", json={"prompt": "hello"}).json()["tokens"]
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"].endswith("hello")


def test_cli_parse_args():
    from glm5.cli.serve import parse_args
    from glm5.core.config import ConfigError
    engine, srv = parse_args(["--model", "tiny", "--max_num_seqs=8", "--engine.block_size", "32", "--port", "9000",
                              "--api-key", "k", "--batch-timeout-ms=5", "--server.max_waiting_requests=3"])
    assert (engine.model, engine.max_num_seqs, engine.block_size, engine.batch_timeout_ms) == ("tiny", 8, 32, 5)
    assert (srv.host, srv.port, srv.api_key, srv.max_waiting_requests) == ("127.0.0.1", 9000, "k", 3)
    for bad in (["--model", "x", "--bogus=1"], ["--model", "x", "--server.port=0"], ["--model", "x", "--other.k=1"]):
        with pytest.raises(ConfigError):
            parse_args(bad)


@pytest.mark.slow
def test_cli_serves_tiny_preset(tmp_path):
    """`glm5 serve` as a subprocess: health, a completion, SIGTERM shuts it down cleanly."""
    import subprocess
    import sys

    from glm5.serve.testing import free_port
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "glm5.cli.main", "serve", "--model", "tiny", "--port", str(port),
                             "--device=cpu", "--batch_timeout_ms=0", "--max_model_len=256"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        r = client(url).completions.create(model="tiny", prompt="hi", max_tokens=4)
        assert r.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        code, out = proc.wait(timeout=60), proc.stdout.read()
        # uvicorn re-raises the caught SIGTERM after its graceful shutdown
        assert code in (0, -15) and "Application shutdown complete" in out, out


@pytest.mark.parametrize("server", [{"engine": {"script": "Fine, thanks.", "max_session_len": 60}},
                                    {"engine": {"script": "Fine, thanks.", "max_session_len": 60,
                                                "session_policy": "summarize"}}], indirect=True)
def test_server_side_sessions_keep_history_and_cut_it(server):
    """`session_id`: the server prepends the session's history (the prompt is exactly the template over all
    turns); past max_session_len (prompt + max_tokens) the oldest turns are dropped or summarised."""
    engine, url = server
    policy = engine.config.session_policy
    h = {"Authorization": "Bearer none"}
    sent, replies = [], []
    for turn in range(6):
        msg = {"role": "user", "content": f"turn {turn}: tell me more"}
        body = {"model": "fake", "messages": [msg], "max_tokens": 8, "session_id": "s1"}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=h, timeout=30)
        assert r.status_code == 200, r.text
        sent.append(msg)
        replies.append(r.json()["choices"][0]["message"]["content"])
        info = r.json()["session"]
        if turn == 0:
            history = [msg]
            assert engine.prompts[-1] == TOK.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        if turn == 1:  # the first reply is in the second prompt
            full = [sent[0], {"role": "assistant", "content": replies[0]}, msg]
            assert engine.prompts[-1] == TOK.apply_chat_template(full, add_generation_prompt=True, tokenize=True)
        assert len(engine.prompts[-1]) + 8 <= 60 or info["history_messages"] <= 2, TOK.decode(engine.prompts[-1])
    assert info["turns"] == 6 and info["cut_messages"] > 0 and info["cut_tokens"] > 0
    assert TOK.decode(engine.prompts[-1]).count("tell me more") < 6  # the oldest turns are gone
    if policy == "summarize":
        assert info["summaries"] > 0
        assert any("Summarize our conversation" in TOK.decode(p) for p in engine.prompts)
        assert "Summary of the earlier conversation" in TOK.decode(engine.prompts[-1])
