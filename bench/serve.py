"""Serving load generator (loopback only, bounded in time), with `vllm bench serve` metric definitions.

    python bench/serve.py --model small [--engine.KEY=VALUE ...] [--concurrency 1 8 32 64]
           [--input-len 128] [--output-len 64] [--duration-s 60] [--knobs "A;B"] [--out results.json]
    python bench/serve.py --url http://127.0.0.1:8000 ...   # an already running server

It starts `glm5 serve` as a subprocess on 127.0.0.1 (a free port) unless `--url` is given, sends streaming
`/v1/completions` requests with random token-id prompts and `ignore_eos` (fixed output lengths) at each
concurrency level, and reports per level: completed/failed, request and output-token throughput, and
mean/p50/p99 of TTFT (send -> first streamed token), TPOT ((e2e - TTFT) / (output tokens - 1)), ITL (gap
between streamed chunks) and E2EL. The 64-vs-1 throughput ratio is the batching gain. `--knobs` reruns
one level with engine overrides per server (e.g. "preferred_batch_size=1,batch_timeout_ms=0;
preferred_batch_size=16,batch_timeout_ms=200") under Poisson arrivals (`--request-rate`) to show the
dynamic-batching trade (TTFT vs throughput).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from glm5.serve.testing import free_port  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def one_request(h: httpx.AsyncClient, url: str, model: str, prompt: list[int], out_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, last, itl, n_out = None, None, [], 0
    try:
        async with h.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"ok": False, "error": f"{r.status_code} {r.text[:200]}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"ok": False, "error": chunk["error"]["message"]}
                if chunk.get("usage"):
                    n_out = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itl.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        return {"ok": False, "error": repr(e)}
    e2e = time.perf_counter() - t0
    tpot = (e2e - ttft) / (n_out - 1) if n_out > 1 and ttft is not None else None
    return {"ok": True, "ttft": ttft, "e2e": e2e, "itl": itl, "tpot": tpot, "out": n_out, "in": len(prompt)}


async def run_level(url, model, concurrency, num_prompts, in_len, out_len, vocab, duration_s,
                    request_rate=None, seed=0) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(in_len)] for _ in range(num_prompts)]
    sem = asyncio.Semaphore(concurrency)
    deadline = time.perf_counter() + duration_s
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(duration_s + 60), limits=limits) as h:
        async def worker(p, delay):
            await asyncio.sleep(delay)
            async with sem:
                if time.perf_counter() > deadline:
                    return None  # time bound: requests not started by the deadline are skipped
                return await one_request(h, url, model, p, out_len)
        delays, t = [], 0.0
        for _ in prompts:
            delays.append(t)
            if request_rate:
                t += rng.expovariate(request_rate)
        t0 = time.perf_counter()
        results = [r for r in await asyncio.gather(*[worker(p, d) for p, d in zip(prompts, delays)]) if r]
        wall = time.perf_counter() - t0
    return summarize(results, wall, concurrency)


def summarize(results: list[dict], wall: float, concurrency: int) -> dict:
    ok = [r for r in results if r["ok"]]
    ms = lambda xs: {"mean": 1e3 * sum(xs) / len(xs) if xs else float("nan"), "p50": 1e3 * pct(xs, 50),
                     "p99": 1e3 * pct(xs, 99)}
    out_tokens = sum(r["out"] for r in ok)
    return {
        "concurrency": concurrency, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:3], "duration_s": wall,
        "total_input": sum(r["in"] for r in ok), "total_output": out_tokens,
        "request_throughput": len(ok) / wall, "output_throughput": out_tokens / wall,
        "ttft_ms": ms([r["ttft"] for r in ok]), "tpot_ms": ms([r["tpot"] for r in ok if r["tpot"] is not None]),
        "itl_ms": ms([x for r in ok for x in r["itl"]]), "e2el_ms": ms([r["e2e"] for r in ok]),
    }


class Server:
    """`glm5 serve` in a subprocess on loopback; stopped (SIGTERM, then kill) on exit."""

    def __init__(self, model: str, engine_opts: list[str], log_path: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "glm5.cli.main", "serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(self.port), *engine_opts]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("server did not become healthy")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def bench_server(url, args, levels, request_rate=None, num_prompts=0) -> list[dict]:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    asyncio.run(run_level(url, model, 2, 2, args.input_len, 4, args.vocab, 120))  # warm-up (compile, caches)
    rows = []
    for c in levels:
        n = num_prompts or args.num_prompts or max(4 * c, 8)
        row = asyncio.run(run_level(url, model, c, n, args.input_len, args.output_len, args.vocab,
                                    args.duration_s, request_rate))
        print(json.dumps({k: row[k] for k in ("concurrency", "completed", "failed", "output_throughput")}),
              flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict], label: str = "") -> str:
    head = "| run | rate/s | conc | done/fail | req/s | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms | E2EL p50/p99 ms |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        f = lambda k: f"{r[k]['p50']:.1f} / {r[k]['p99']:.1f}"
        lines.append(f"| {r.get('label', label)} | {r.get('request_rate') or 'inf'} | {r['concurrency']} | {r['completed']}/{r['failed']} | "
                     f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {f('ttft_ms')} | "
                     f"{f('tpot_ms')} | {f('itl_ms')} | {f('e2el_ms')} |")
    return "\n".join(lines)


def knob_runs(args, engine_opts: list[str]) -> list[dict]:
    """One server per engine-override set; each serves one level per request rate."""
    rows = []
    for knob in filter(None, (k.strip() for k in args.knobs.split(";"))):
        opts = engine_opts + [f"--{kv.strip()}" for kv in knob.split(",")]
        s = Server(args.model, opts, args.out + ".knob.log")
        try:
            s.wait(args.startup_timeout_s)
            for rate in args.request_rate:
                row = bench_server(s.url, args, [args.knob_concurrency], rate, args.knob_num_prompts)[0]
                row["label"], row["request_rate"] = knob, rate
                rows.append(row)
        finally:
            s.stop()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--url", help="benchmark this running server instead of starting one")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--num-prompts", type=int, default=0, help="per level (default 4 x concurrency)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=8000, help="prompt ids are drawn from [100, vocab - 100)")
    p.add_argument("--duration-s", type=float, default=60.0, help="per level: no new request after this")
    p.add_argument("--knobs", default="", help="';'-separated engine override sets for the batching run")
    p.add_argument("--knob-concurrency", type=int, default=16)
    p.add_argument("--knob-num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, nargs="+", default=[8.0],
                   help="Poisson arrivals/s for the knob runs, 0 = all at once (each knob set runs at each rate)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default="bench_serve.json")
    args, engine_opts = p.parse_known_args()
    result: dict = {"args": vars(args), "engine_opts": engine_opts}
    server = None if args.url else Server(args.model, engine_opts, args.out + ".server.log")
    try:
        if server:
            server.wait(args.startup_timeout_s)
        url = args.url or server.url
        rows = bench_server(url, args, args.concurrency)
        result["levels"] = rows
        by_c = {r["concurrency"]: r["output_throughput"] for r in rows}
        if 1 in by_c and max(by_c) > 1:
            result["throughput_ratio_max_vs_1"] = by_c[max(by_c)] / by_c[1]
    finally:
        if server:
            server.stop()
    result["knobs"] = knob_runs(args, engine_opts)
    print(table(result["levels"], "levels"))
    if "throughput_ratio_max_vs_1" in result:
        print(f"\noutput throughput at concurrency {max(by_c)} / concurrency 1 = "
              f"{result['throughput_ratio_max_vs_1']:.2f}x")
    if result["knobs"]:
        print("\ndynamic batching knobs (Poisson arrivals):\n" + table(result["knobs"]))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
