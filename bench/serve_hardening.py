"""Hardening runs against `glm5 serve` on a tiny checkpoint (loopback only, bounded in time).

    python bench/serve_hardening.py disconnect [--clients 64] [--duration-s 60] [--model DIR]
    python bench/serve_hardening.py hugeprompt [--prompt-mb 3.9] [--model DIR]
    python bench/serve_hardening.py fuzz [--cases 2000]

`disconnect`: the issue-16 load run. N streaming clients for D seconds; each request streams a random
number of chunks and then drops the connection (about three in four) or reads to the end. Reports
requests, abrupt disconnects, failures (any non-200 or malformed stream), the server's RSS before
(after a warm-up) and after (once idle), the gauges once idle (running requests, KV usage), and
whether /health and a greedy completion are still right afterwards.
`hugeprompt`: /health latency and the inter-chunk gaps of 4 other streams, first with nothing else
going on, then while a multi-megabyte prompt is being tokenised; reports both and their ratio.
`fuzz`: the API fuzzer of tests/_fuzz.py (Hypothesis, random seed) for N cases plus the hand-written
hostile requests, against the real engine in-process; prints the result table of docs/serve.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from glm5.serve.testing import free_port  # noqa: E402

PROMPT = "The capital of France is"


def tiny_checkpoint(path: Path) -> Path:
    """The tiny preset (2 layers), random init, with the bundled tokenizer: what the tests serve."""
    import torch

    from glm5.data.tokenizer import load_tokenizer
    from glm5.model.config import ModelConfig
    from glm5.model.hf_adapter import save_pretrained
    from glm5.model.model import GLM5ForCausalLM
    cfg = ModelConfig.from_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    save_pretrained(GLM5ForCausalLM(cfg).init_weights(0).eval(), path)
    load_tokenizer("bundled:tokenizer-8k").save(path)
    return path


class Server:
    """`glm5 serve` as a subprocess on a free loopback port."""

    def __init__(self, model: Path, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "glm5.cli.main", "serve", "--model", str(model), "--port", str(self.port),
             "--device=cpu", "--batch_timeout_ms=0", "--max_model_len=512", "--num_blocks=512",
             "--max_num_seqs=64", "--max_batch_size=64", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError("server did not start")

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb / 1024

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def greedy(self) -> str:
        r = httpx.post(self.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                       timeout=60)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=120)


async def _client(url: str, until: float, rng: random.Random, tally: dict) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as h:
        while time.monotonic() < until:
            body = {"prompt": PROMPT + " " + str(rng.random()), "max_tokens": rng.randint(8, 64), "stream": True,
                    "ignore_eos": True}
            cut = rng.randint(1, 6) if rng.random() < 0.75 else None  # chunks before an abrupt disconnect
            tally["requests"] += 1
            try:
                async with h.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        _fail(tally, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    seen, done = 0, False
                    async for line in r.aiter_lines():
                        if not line:
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        if "error" in json.loads(line[len("data: "):]):  # an error chunk, not the word in text
                            _fail(tally, line[:300])
                            break
                        seen += 1
                        if cut is not None and seen >= cut:
                            break  # leaving the block closes the connection mid-stream
                    if cut is not None and not done and seen >= cut:
                        tally["disconnects"] += 1
                    elif done:
                        tally["completed"] += 1
            except httpx.HTTPError as e:
                _fail(tally, f"{type(e).__name__}: {e}")


def _fail(tally: dict, why: str) -> None:
    tally["failed"] += 1
    tally.setdefault("failures", []).append(why)


def _settled_rss(server: Server) -> float:
    """RSS once the server is idle again (no running request)."""
    deadline = time.monotonic() + 60
    while server.metric("vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)
    return server.rss_mib()


def disconnect(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else tiny_checkpoint(Path(tmp) / "tiny")
        server = Server(model)
        try:
            reference = server.greedy()
            asyncio.run(_load(server.url, args.clients, 10.0, 1))  # warm-up: allocator, caches, buffers
            before = _settled_rss(server)
            tally = {"requests": 0, "completed": 0, "disconnects": 0, "failed": 0}
            t0 = time.monotonic()
            asyncio.run(_load(server.url, args.clients, args.duration_s / 2, 2, tally))
            middle = _settled_rss(server)  # a leak keeps growing from here; a warm heap does not
            asyncio.run(_load(server.url, args.clients, args.duration_s / 2, 3, tally))
            elapsed = time.monotonic() - t0
            after = _settled_rss(server)
            out = {**tally, "clients": args.clients, "seconds": round(elapsed, 1),
                   "rss_before_mib": round(before, 1), "rss_half_mib": round(middle, 1),
                   "rss_after_mib": round(after, 1), "rss_second_half_ratio": round(after / middle, 3),
                   "running_after": server.metric("vllm:num_requests_running"),
                   "kv_usage_after": server.metric("vllm:kv_cache_usage_perc"),
                   "health_after": httpx.get(server.url + "/health", timeout=30).status_code,
                   "greedy_unchanged": server.greedy() == reference}
            out["rss_ratio"] = round(out["rss_after_mib"] / out["rss_before_mib"], 3)
        finally:
            out_code = server.stop()
        out["exit_code_on_sigterm"] = out_code
        return out


async def _load(url: str, clients: int, seconds: float, seed: int, tally: dict | None = None) -> None:
    tally = tally if tally is not None else {"requests": 0, "completed": 0, "disconnects": 0, "failed": 0}
    until = time.monotonic() + seconds
    await asyncio.gather(*[_client(url, until, random.Random(seed * 1000 + i), tally) for i in range(clients)])


async def _probe(url: str, seconds: float, stop: asyncio.Event | None = None) -> tuple[list[float], list[float]]:
    """(/health latencies, inter-chunk gaps of 4 streams) for `seconds`, or until `stop` is set."""
    health, gaps = [], []
    until = time.monotonic() + seconds

    def going() -> bool:
        return not stop.is_set() if stop is not None else time.monotonic() < until

    async def stream(h):
        while going():
            async with h.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 32, "stream": True,
                                                                 "ignore_eos": True}) as r:
                last = time.monotonic()
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        now = time.monotonic()
                        gaps.append(now - last)
                        last = now

    async def ping(h):
        while going():
            t = time.monotonic()
            await h.get("/health")
            health.append(time.monotonic() - t)
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(base_url=url, timeout=300) as h:
        await asyncio.gather(ping(h), *[stream(h) for _ in range(4)])
    return health, gaps


def hugeprompt(args) -> dict:
    text = ("The quick brown fox jumps over the lazy dog; def f(x): return x + 1\n" * 80000)
    text = text[: int(args.prompt_mb * 1e6)]  # ASCII: one byte per character, under the 4 MiB body bound
    body = json.dumps({"prompt": text, "max_tokens": 1}).encode()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else tiny_checkpoint(Path(tmp) / "tiny")
        server = Server(model)
        try:
            quiet = asyncio.run(_probe(server.url, args.window_s))

            async def with_huge():
                async with httpx.AsyncClient(base_url=server.url, timeout=600) as h:
                    done = asyncio.Event()
                    probe = asyncio.create_task(_probe(server.url, 0, done))
                    t = time.monotonic()
                    r = await h.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                    huge_s = time.monotonic() - t
                    done.set()
                    return r.status_code, huge_s, await probe
            status, huge_s, busy = asyncio.run(with_huge())
        finally:
            server.stop()
    def summary(xs):
        xs = sorted(xs)
        return {"n": len(xs), "p50_ms": round(1000 * xs[len(xs) // 2], 1), "max_ms": round(1000 * xs[-1], 1)}
    out = {"prompt_bytes": len(body), "huge_status": status, "huge_request_s": round(huge_s, 2),
           "health_quiet": summary(quiet[0]), "health_during": summary(busy[0]),
           "stream_gap_quiet": summary(quiet[1]), "stream_gap_during": summary(busy[1])}
    out["health_max_ratio"] = round(out["health_during"]["max_ms"] / max(out["health_quiet"]["max_ms"], 1e-3), 2)
    out["gap_max_ratio"] = round(out["stream_gap_during"]["max_ms"] / max(out["stream_gap_quiet"]["max_ms"], 1e-3), 2)
    return out


def fuzz(args) -> dict:
    from hypothesis import HealthCheck, given, settings

    from glm5.serve.config import ServerConfig
    from tests import _fuzz
    from tests._live import live_server
    rows: dict[str, list[int]] = {}  # kind -> [cases, 2xx, 4xx, 5xx, alive after]

    def record(kind: str, status: int, alive: bool) -> None:
        row = rows.setdefault(kind, [0, 0, 0, 0, 0])
        row[0] += 1
        row[1 if status < 400 else 2 if status < 500 else 3] += 1
        row[4] += alive

    with tempfile.TemporaryDirectory() as tmp, \
            live_server(Path(tmp), max_model_len=256, server=ServerConfig(default_max_tokens=4)) as live:
        c = httpx.Client(base_url=live["url"], timeout=120)

        def alive() -> bool:
            return c.get("/health").status_code == 200

        @settings(max_examples=args.cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(_fuzz.requests())
        def run(req):
            path, body = req
            r = c.post(path, content=_fuzz.encode(body), headers={"content-type": "application/json"})
            _fuzz.check_response(r, f"{path} {_fuzz.encode(body)[:200]!r}")
            record(f"generated {path}", r.status_code, alive())
        run()
        for case in _fuzz.hand_written_cases():
            r = _fuzz.send_raw(live["url"], case) if case.raw else c.request(
                case.method, case.path, content=case.body, headers=case.headers)
            _fuzz.check_response(r, case.name)
            record("hand-written hostile", r.status_code, alive())
        good = c.post("/v1/completions", json={"prompt": _fuzz_prompt(), "max_tokens": 6, "temperature": 0})
        final_ok = good.status_code == 200 and good.json()["choices"][0]["text"] == live["expected"]
    table = {k: dict(zip(("cases", "2xx", "4xx", "5xx", "alive_after"), v)) for k, v in sorted(rows.items())}
    return {"table": table, "total": sum(v[0] for v in rows.values()), "good_request_after": final_ok}


def _fuzz_prompt() -> str:
    from tests._live import PROMPT as p
    return p


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("disconnect")
    d.add_argument("--clients", type=int, default=64)
    d.add_argument("--duration-s", type=float, default=60.0)
    d.add_argument("--model")
    h = sub.add_parser("hugeprompt")
    h.add_argument("--prompt-mb", type=float, default=3.9)
    h.add_argument("--window-s", type=float, default=8.0)
    h.add_argument("--model")
    f = sub.add_parser("fuzz")
    f.add_argument("--cases", type=int, default=2000)
    args = p.parse_args()
    out = {"disconnect": disconnect, "hugeprompt": hugeprompt, "fuzz": fuzz}[args.cmd](args)
    print(json.dumps({"run": args.cmd, "load_avg_1m": round(os.getloadavg()[0], 1), **out}, indent=2))


if __name__ == "__main__":
    main()
