"""The official `openai` client against a live server (uvicorn on 127.0.0.1, random port) running the
REAL engine on a tiny random checkpoint: completions, chat, streaming == non-streaming (greedy), logprobs
vs the model's own forward, `n`, `stop`, usage, auth, disconnect -> abort + KV blocks back, and expert hot
swap while 16 clients stream (zero failures, every response equal to the greedy output of the version it
reports, computed by full recompute on the model).
"""

import asyncio
import copy
import json
import time

import httpx
import openai
import pytest
import torch
from safetensors.torch import save

from glm5.data.tokenizer import load_tokenizer
from glm5.infer.config import EngineConfig
from glm5.model.config import ModelConfig
from glm5.model.hf_adapter import save_pretrained
from glm5.model.model import GLM5ForCausalLM
from glm5.serve.app import create_app
from glm5.serve.config import ServerConfig
from glm5.serve.testing import serve_in_thread

engine_mod = pytest.importorskip("glm5.infer.engine")
KEY, ADMIN = "sk-test", "admin-test"
TOK = load_tokenizer("bundled:tokenizer-8k")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-ckpt")
    cfg = ModelConfig.from_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg).init_weights(0).eval()
    save_pretrained(model, path)
    TOK.save(path)
    engine = engine_mod.LLMEngine(EngineConfig(
        model=str(path), device="cpu", dtype="float32", max_model_len=256, num_blocks=256, block_size=16,
        max_num_seqs=32, max_batch_size=32, preferred_batch_size=1, batch_timeout_ms=0))
    app = create_app(engine, config=ServerConfig(api_key=KEY, admin_key=ADMIN), model_name="tiny")
    with serve_in_thread(app) as url:
        yield {"url": url, "engine": engine, "model": model, "cfg": cfg}


def oai(live, key=KEY):
    return openai.OpenAI(base_url=live["url"] + "/v1", api_key=key, max_retries=0)


def greedy_reference(model, prompt_ids, n):
    out = model.generate_greedy(torch.tensor([prompt_ids]), n)  # [1, P + n]
    return TOK.decode(out[0, len(prompt_ids):].tolist(), skip_special_tokens=True)


def test_completion_greedy_matches_model_and_stream(live):
    c = oai(live)
    r = c.completions.create(model="tiny", prompt="The capital of France is", max_tokens=12, temperature=0,
                             extra_body={"ignore_eos": True})
    ids = TOK.encode("The capital of France is", add_special_tokens=True)
    assert r.choices[0].text == greedy_reference(live["model"], ids, 12)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 12)
    assert r.choices[0].finish_reason == "length"
    text, usage = "", None
    for chunk in c.completions.create(model="tiny", prompt="The capital of France is", max_tokens=12,
                                      temperature=0, stream=True, stream_options={"include_usage": True},
                                      extra_body={"ignore_eos": True}):
        text += "".join(ch.text for ch in chunk.choices)
        usage = chunk.usage or usage
    assert text == r.choices[0].text and usage.completion_tokens == 12


def test_completion_echo_logprobs_match_forward(live):
    """lm-eval's loglikelihood request: token-id prompt, echo, logprobs, max_tokens=1."""
    ids = TOK.encode("one two three four five", add_special_tokens=True)
    r = oai(live).completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True,
                                     logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids) + 1
    with torch.no_grad():
        ref = torch.log_softmax(live["model"](torch.tensor([ids])).logits[0].float(), -1)  # [T, V]
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-3)
        assert len(lp.top_logprobs[pos]) <= 2
        assert max(lp.top_logprobs[pos].values()) == pytest.approx(float(ref[pos - 1].max()), abs=1e-3)


def test_completion_n_seed_stop_logprobs(live):
    c = oai(live)
    r = c.completions.create(model="tiny", prompt="hello", max_tokens=8, n=3, temperature=1.0, seed=7,
                             logprobs=3, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 24
    again = c.completions.create(model="tiny", prompt="hello", max_tokens=8, n=3, temperature=1.0, seed=7,
                                 extra_body={"ignore_eos": True})
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]  # seeded: reproducible
    for ch in r.choices:
        assert len(ch.logprobs.tokens) == 8 and all(x <= 0 for x in ch.logprobs.token_logprobs)
    base = c.completions.create(model="tiny", prompt="hello", max_tokens=16, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]
    if stop.strip():
        cut = c.completions.create(model="tiny", prompt="hello", max_tokens=16, temperature=0, stop=[stop],
                                   extra_body={"ignore_eos": True}).choices[0]
        assert cut.finish_reason == "stop" and cut.text == base[: base.index(stop)]


def test_chat_stream_equals_nonstream(live):
    c = oai(live)
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}):
        req = dict(model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=16, temperature=0,
                   extra_body={"chat_template_kwargs": kwargs, "ignore_eos": True}, logprobs=True, top_logprobs=2)
        full = c.chat.completions.create(**req)
        msg = full.choices[0].message
        content, reasoning, lps = "", "", []
        for chunk in c.chat.completions.create(**req, stream=True):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                reasoning += getattr(ch.delta, "reasoning_content", None) or ""
                lps += [t.token for t in (ch.logprobs.content or [])] if ch.logprobs else []
        assert (content or None, reasoning or None) == (msg.content, getattr(msg, "reasoning_content", None))
        assert lps == [t.token for t in full.choices[0].logprobs.content] and len(lps) == 16
        if not kwargs["enable_thinking"]:
            assert getattr(msg, "reasoning_content", None) is None


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_auth_and_errors_through_real_engine(live):
    with pytest.raises(openai.AuthenticationError):
        oai(live, "bad").completions.create(model="tiny", prompt="x", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        oai(live).completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        oai(live).completions.create(model="tiny", prompt="word " * 400, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    assert httpx.get(live["url"] + "/health").json()["status"] == "ok"


EDGE_BODIES = [
    {"prompt": "x", "max_tokens": 3, "top_k": 10**9, "min_p": 1.0},
    {"prompt": "x", "max_tokens": 3, "temperature": 1e-9, "top_p": 1e-9},
    {"prompt": "x", "max_tokens": 3, "n": 3, "seed": 2**63 - 65, "temperature": 2.0},
    {"prompt": "x", "max_tokens": 3, "seed": 2**64},
    {"prompt": "x", "max_tokens": 3, "stop": ["é", "\u0000"], "stop_token_ids": [10**9], "logprobs": 20},
    {"prompt": "x", "max_tokens": 3, "repetition_penalty": 10, "presence_penalty": 2, "frequency_penalty": -2},
    {"prompt": "x", "max_tokens": 3, "min_tokens": 50},
    {"prompt": [[]], "max_tokens": 3},
    {"prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 0},
    {"prompt": "x", "max_tokens": 3, "logprobs": 21},
    {"prompt": "x", "max_tokens": 3, "stream": True, "n": 2, "echo": True, "logprobs": 1},
]


def test_edge_parameters_never_500(live):
    """Odd but parseable parameters answer 200 or a 4xx, and the engine keeps serving."""
    h = {"Authorization": f"Bearer {KEY}"}
    for body in EDGE_BODIES:
        r = httpx.post(live["url"] + "/v1/completions", json={"model": "tiny", **body}, headers=h, timeout=60)
        assert r.status_code in (200, 400), (body, r.status_code, r.text)
        if r.status_code == 400:
            assert r.json()["error"]["message"]
    assert httpx.get(live["url"] + "/health").status_code == 200


def test_metrics_from_real_engine(live):
    oai(live).completions.create(model="tiny", prompt="metrics please", max_tokens=4, temperature=0)
    text = httpx.get(live["url"] + "/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:") and "_bucket" not in line}
    assert values["vllm:prefix_cache_queries"] > 0 and values["vllm:generation_tokens_total"] >= 4
    assert values["vllm:time_to_first_token_seconds_count"] >= 1 and values["vllm:num_requests_running"] == 0
    assert 'model_name="tiny"' in text


def _kv_stats(engine):
    s = engine.get_stats()
    return {k: v for k, v in s.items() if "block" in k or "kv" in k}


def _aborted_count(live) -> float:
    for line in httpx.get(live["url"] + "/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_stream_disconnect_aborts_and_frees_kv(live):
    engine = live["engine"]
    before, aborted = _kv_stats(engine), _aborted_count(live)
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", live["url"] + "/v1/completions", headers=h, json={
            "model": "tiny", "prompt": "a long story " * 10, "max_tokens": 200, "stream": True,
            "ignore_eos": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (engine.has_unfinished_requests() or _kv_stats(engine) != before):
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()
    assert _kv_stats(engine) == before
    assert _aborted_count(live) == aborted + 1  # it was aborted, not run to its 200 tokens


def _new_experts(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    out = {}
    for layer in cfg.moe_layers:
        for e in range(cfg.n_routed_experts):
            for proj, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
                out[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] = torch.randn(*shape, generator=g) * 0.3
    return out


def _apply_experts(model, tensors):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, t in tensors.items():
            _, _, layer, _, _, e, proj, _ = name.split(".")
            proj = proj.removesuffix("_proj")
            ex = m.model.layers[int(layer)].mlp.experts
            inter = t.shape[0] if proj != "down" else t.shape[1]
            if proj == "gate":
                ex.gate_up_proj[int(e), :inter] = t
            elif proj == "up":
                ex.gate_up_proj[int(e), inter:] = t
            else:
                ex.down_proj[int(e)] = t
    return m


def test_hot_swap_while_16_clients_stream(live):
    url, model = live["url"], live["model"]
    prompt = "Once upon a time"
    ids = TOK.encode(prompt, add_special_tokens=True)
    v0 = httpx.get(url + "/admin/experts", headers={"Authorization": f"Bearer {ADMIN}"}).json()["model_version"]
    experts = _new_experts(live["cfg"], seed=1)
    refs = {v0: greedy_reference(model, ids, 10)}
    swapped = {}

    async def one(h):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": True,
                "ignore_eos": True}
        async with h.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            version, text = int(r.headers["x-model-version"]), ""
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    assert chunk["model_version"] == version
                    text += "".join(c["text"] for c in chunk["choices"])
        return version, text

    async def client_loop(h, deadline):
        """Stream requests back to back until one started after the swap has finished."""
        results = []
        while time.monotonic() < deadline:
            after_swap = "version" in swapped
            results.append(await one(h))
            if after_swap:
                break
        return results

    async def swap(h):
        await asyncio.sleep(0.5)
        r = await h.post(url + "/admin/experts", content=save(experts),
                         headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        swapped["version"] = r.json()["model_version"]

    async def main():
        async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as h:
            deadline = time.monotonic() + 120
            got = await asyncio.gather(*[client_loop(h, deadline) for _ in range(16)], swap(h))
        return [x for per in got[:16] for x in per]

    results = asyncio.run(main())
    v1 = swapped["version"]
    assert v1 == v0 + 1
    refs[v1] = greedy_reference(_apply_experts(model, experts), ids, 10)
    assert refs[v0] != refs[v1]
    versions = {v for v, _ in results}
    assert versions == {v0, v1}, versions  # requests ran before and after the swap
    for v, text in results:
        assert text == refs[v], (v, text, refs)
    log = httpx.get(url + "/admin/experts", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert log["model_version"] == v1 and log["versions"][-1]["version"] == v1
    assert len(log["versions"][-1]["experts"]) == len(live["cfg"].moe_layers) * live["cfg"].n_routed_experts
