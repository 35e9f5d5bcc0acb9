"""bench/serve.py --hot-swap pieces: the upload passes the server's own validator, requests land in the
windows the docstring defines, and a response counts as completed only if it is well-formed."""

import asyncio
import importlib.util
import json
import types
from pathlib import Path

import httpx
import pytest

from glm5.model.config import ModelConfig
from glm5.serve import admin

_spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).parent.parent / "bench" / "serve.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_expert_upload_is_what_the_admin_route_accepts():
    cfg = ModelConfig.load("tiny")
    engine = types.SimpleNamespace(model_config=cfg, config=types.SimpleNamespace(dtype="float32"))
    n_layers = min(2, len(cfg.moe_layers))
    body, pairs = bench.expert_upload(cfg, n_layers, 3, seed=0)
    tensors, info = admin.parse_expert_upload(body, engine)  # raises APIError(400) on any mismatch
    assert info["experts"] == sorted(pairs)
    assert len(tensors) == 3 * n_layers * 3
    assert len({layer for layer, _ in pairs}) == n_layers and all(layer in cfg.moe_layers for layer, _ in pairs)
    with pytest.raises(ValueError, match="--swap-experts"):
        bench.expert_upload(cfg, 1, cfg.n_routed_experts + 1, seed=0)


def test_windows_follow_the_admin_calls():
    calls = [{"kind": "swap", "t0": 10.0, "t1": 11.0}, {"kind": "rollback", "t0": 20.0, "t1": 21.0}]
    where = lambda t0, t1: bench.classify({"t0": t0, "t1": t1}, calls, ramp_end=5.0)
    assert where(1, 3) == ["ramp"]
    assert where(6, 9.9) == ["before"]
    assert where(9, 10.5) == ["during swap"]  # sent before the call, still streaming when it was sent
    assert where(10.5, 12) == ["during swap"]  # sent while the call was in flight
    assert where(11.5, 15) == ["swapped"]
    assert where(10.5, 20.5) == ["during rollback", "during swap"]
    assert where(22, 25) == ["after rollback"]
    running = [{"times": [9.0, 9.2, 10.8, 11.0]}, {"times": [1.0, 4.0]}]
    assert bench.longest_gap_over(running, 10.0, 11.0) == pytest.approx(1.6)  # not the 3 s gap far before


def _sse(*chunks: dict, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


@pytest.mark.parametrize("status,body,kind", [
    (200, _sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
               {"choices": [], "usage": {"completion_tokens": 2}}), None),
    (200, _sse({"choices": [{"text": "a"}]}, {"choices": [], "usage": {"completion_tokens": 1}}), "truncated"),
    (200, _sse({"choices": [{"text": "a"}]}, done=False), "truncated"),
    (200, _sse({"choices": [{"text": "a"}]}, {"error": {"message": "boom"}}), "error_chunk"),
    (200, b"data: {\"choices\": [\n\n", "malformed"),
    (503, b'{"error": {"message": "overloaded"}}', "5xx"),
])
def test_only_well_formed_streams_count_as_completed(status, body, kind):
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body,
                                                                    headers={"x-model-version": "0"}))

    async def go():
        async with httpx.AsyncClient(transport=transport) as h:
            return await bench.one_request(h, "http://x", "m", [1, 2, 3], 2)

    r = asyncio.run(go())
    assert r["ok"] == (kind is None) and r.get("kind") == kind
    if kind is None:
        assert len(r["itl"]) == 1 and r["version"] == "0"
