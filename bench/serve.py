"""Serving load generator (loopback only, bounded in time), with `vllm bench serve` metric definitions.

    python bench/serve.py --model small [--engine.KEY=VALUE ...] [--concurrency 1 8 32 64]
           [--input-len 128 | --input-len-range 16 512 [--input-len-dist log-uniform]] [--output-len 64]
           [--duration-s 60] [--knobs "A;B"] [--knob-concurrency 16] [--request-rate 8] [--out results.json]
           [--seed 0]                                      # a bare --concurrency: only the --knobs runs
    python bench/serve.py --url http://127.0.0.1:8000 ...   # an already running server
    python bench/serve.py --model small --hot-swap [--swap-concurrency 32] [--swap-layers 2] [--swap-experts 4]
           [--swap-cycles 2] [--swap-settle-s 10] [--swap-baseline-s 40] [--swap-hold-s 25] [--input-len 32]
           [--output-len 16]                               # expert hot swap under streaming load

It starts `glm5 serve` as a subprocess on 127.0.0.1 (a free port) unless `--url` is given, sends streaming
`/v1/completions` requests with random token-id prompts and `ignore_eos` (fixed output lengths) at each
concurrency level, and reports per level: completed/failed, request and output-token throughput, and
mean/p50/p99 of TTFT (send -> first streamed token), TPOT ((e2e - TTFT) / (output tokens - 1)), ITL (gap
between streamed chunks) and E2EL. The 64-vs-1 throughput ratio is the batching gain. `--knobs` reruns
one level with engine overrides per server (e.g. "preferred_batch_size=1,batch_timeout_ms=0;
preferred_batch_size=16,batch_timeout_ms=200") under Poisson arrivals (`--request-rate`) to show the
dynamic-batching trade (TTFT vs throughput). Repeating a set (ABAB) repeats its server; the knob summary gives
each set's median over its repeats and the ratio to the first set, per rate.

Prompt lengths: fixed at `--input-len`, or with `--input-len-range LO HI` drawn per prompt in [LO, HI]
(`--input-len-dist uniform` or `log-uniform`, the default: as many short as long prompts per octave) from
`--seed`, so the sweep and every knob server get the same prompts for the same level; the JSON records the
arguments and each row's prompt-length min/p50/max. A spread is what gives length grouping
(`batch_by_length`) something to group.

`--hot-swap` runs only this scenario: `--swap-concurrency` closed-loop streaming clients (each sends its next
request as soon as its last one ends) for settle + baseline seconds; then, while they keep streaming,
`--swap-cycles` times: `POST /admin/experts` (a safetensors upload of new random weights for
`--swap-experts` experts in each of `--swap-layers` MoE layers, the admin route's format), hold, `POST
/admin/experts/rollback`, hold. Each request is put in a window by its lifetime [sent, last byte]: "during
swap" / "during rollback" if it overlaps an admin call's [sent, response received]; otherwise by the last
call that returned before it was sent ("before", "swapped", "after rollback"; requests sent in the first
settle seconds, when all clients start at once, are "ramp" and not part of the baseline). Reported per
window: completed/failed (a response counts only if well-formed: 200, valid chunks, no error chunk, the
usage chunk's fixed length, `[DONE]`), TTFT/ITL/E2EL p50/p99 and the model versions the responses ran on;
per call: latency, requests in flight and the longest inter-token gap over it; p99 during / p99 before. The
exit status is 1 if any request or call failed. `--model` must name the served model (for the expert
shapes). With `--url`, pass the server's `--admin-key`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch
from safetensors.torch import save as save_safetensors

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from glm5.model.config import ModelConfig  # noqa: E402
from glm5.serve.testing import free_port  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def one_request(h: httpx.AsyncClient, url: str, model: str, prompt: list[int], out_len: int) -> dict:
    """One streaming completion. A response counts as completed only if it is well-formed: status 200, every
    chunk valid JSON without an error object, a usage chunk saying `out_len` tokens (ignore_eos makes the
    length fixed) and the closing `data: [DONE]`. Failures carry a `kind`: 5xx, 4xx, error_chunk, malformed,
    truncated (the stream ended early or short) or transport. `t0`/`t1`/`times` are perf_counter stamps
    (send, end, each streamed chunk) for the hot-swap windows."""
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, n_out, done, header_version, chunk_versions = [], None, False, None, set()

    def fail(kind: str, error: str) -> dict:
        return {"ok": False, "kind": kind, "error": error, "t0": t0, "t1": time.perf_counter(), "times": times}

    try:
        async with h.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return fail(f"{r.status_code // 100}xx", f"{r.status_code} {r.text[:200]}")
            header_version = r.headers.get("x-model-version")
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    continue
                if not line.startswith("data: "):
                    continue
                try:
                    chunk = json.loads(line[6:])
                except json.JSONDecodeError:
                    return fail("malformed", f"not JSON: {line[:200]!r}")
                if "error" in chunk:
                    return fail("error_chunk", str(chunk["error"].get("message")))
                if "model_version" in chunk:
                    chunk_versions.add(str(chunk["model_version"]))
                if chunk.get("usage"):
                    n_out = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    times.append(time.perf_counter())
    except httpx.HTTPError as e:
        return fail("transport", repr(e))
    if not done or n_out != out_len or not times:
        return fail("truncated", f"[DONE] seen: {done}, completion_tokens {n_out} of {out_len}, "
                                 f"{len(times)} token chunks")
    t1 = time.perf_counter()
    e2e, ttft = t1 - t0, times[0] - t0
    itl = [b - a for a, b in zip(times, times[1:])]
    tpot = (e2e - ttft) / (n_out - 1) if n_out > 1 else None
    return {"ok": True, "ttft": ttft, "e2e": e2e, "itl": itl, "tpot": tpot, "out": n_out, "in": len(prompt),
            "t0": t0, "t1": t1, "times": times, "version": header_version, "chunk_versions": chunk_versions}


def prompt_lengths(rng: random.Random, n: int, in_len: int, len_range: tuple[int, int] | None = None,
                   dist: str = "log-uniform") -> list[int]:
    """`n` prompt lengths: all `in_len`, or drawn from `rng` in [lo, hi] (both ends included) of `len_range`,
    uniform in the length or in its log (`dist`)."""
    if len_range is None:
        return [in_len] * n
    lo, hi = len_range
    if not 1 <= lo <= hi:
        raise ValueError(f"--input-len-range needs 1 <= LO <= HI, got {lo} {hi}")
    if dist == "uniform":
        return [rng.randint(lo, hi) for _ in range(n)]
    if dist == "log-uniform":  # floor of exp(U[log lo, log (hi + 1))): each length in [lo, hi], log-spread
        return [min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))) for _ in range(n)]
    raise ValueError(f"--input-len-dist must be uniform or log-uniform, got {dist!r}")


def make_prompts(seed: int, n: int, in_len: int, vocab: int, len_range: tuple[int, int] | None = None,
                 dist: str = "log-uniform") -> list[list[int]]:
    """`n` random token-id prompts (ids in [100, vocab - 100)), lengths by `prompt_lengths`; the same `seed`
    gives the same prompts."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(k)]
            for k in prompt_lengths(rng, n, in_len, len_range, dist)]


async def run_level(url, model, concurrency, num_prompts, in_len, out_len, vocab, duration_s,
                    request_rate=None, seed=0, len_range=None, len_dist="log-uniform") -> dict:
    prompts = make_prompts(seed, num_prompts, in_len, vocab, len_range, len_dist)
    rng = random.Random(seed + 1)  # arrivals
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
        "failed_by_kind": dict(collections.Counter(r["kind"] for r in results if not r["ok"])),
        "total_input": sum(r["in"] for r in ok), "total_output": out_tokens,
        "input_len": {"min": min((r["in"] for r in ok), default=None), "p50": pct([r["in"] for r in ok], 50),
                      "max": max((r["in"] for r in ok), default=None)},
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
                                    args.duration_s, request_rate, args.seed, args.input_len_range,
                                    args.input_len_dist))
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


def knob_summary(rows: list[dict]) -> list[dict]:
    """Per request rate and knob set (in first-seen order): the median over its repeats of output tok/s,
    req/s and TTFT/TPOT p50/p99, and each as a ratio to the first set at that rate."""
    keys = {"out tok/s": ("output_throughput",), "req/s": ("request_throughput",),
            "TTFT p50": ("ttft_ms", "p50"), "TTFT p99": ("ttft_ms", "p99"),
            "TPOT p50": ("tpot_ms", "p50"), "TPOT p99": ("tpot_ms", "p99")}
    get = lambda r, path: r[path[0]] if len(path) == 1 else r[path[0]][path[1]]
    out = []
    for rate in dict.fromkeys(r.get("request_rate") for r in rows):
        groups: dict[str, list[dict]] = {}
        for r in rows:
            if r.get("request_rate") == rate:
                groups.setdefault(r["label"], []).append(r)
        base = None
        for label, rs in groups.items():
            med = {k: statistics.median([get(r, path) for r in rs]) for k, path in keys.items()}
            base = base or med
            out.append({"label": label, "request_rate": rate, "repeats": len(rs),
                        "failed": sum(r["failed"] for r in rs), "median": med,
                        "ratio_to_first": {k: med[k] / base[k] if base[k] else float("nan") for k in keys}})
    return out


def knob_summary_table(summary: list[dict]) -> str:
    cols = ("out tok/s", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99")
    lines = ["| run | rate/s | repeats | failed | " + " | ".join(f"{c} (ratio)" for c in cols) + " |",
             "|" + "---|" * (4 + len(cols))]
    for s in summary:
        cells = [f"{s['median'][c]:.1f} ({s['ratio_to_first'][c]:.2f}x)" for c in cols]
        lines.append(f"| {s['label']} | {s['request_rate'] or 'inf'} | {s['repeats']} | {s['failed']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- hot swap under streaming load (--hot-swap) ------------------------------------------------------------

# The admin call's poster, a child process started before the load: it reads the body and builds its client,
# then waits for a line on stdin and posts. argv: URL, body file ("" for none); the key comes in
# $GLM5_BENCH_ADMIN_KEY. perf_counter is CLOCK_MONOTONIC on Linux, so its stamps compare with the parent's.
ADMIN_POST = """
import json, os, sys, time, httpx
body = open(sys.argv[2], "rb").read() if sys.argv[2] else None
client = httpx.Client(timeout=600, headers={"Authorization": "Bearer " + os.environ["GLM5_BENCH_ADMIN_KEY"]})
if sys.stdin.readline().strip() != "go":  # the bench ended first: post nothing
    sys.exit(0)
t0 = time.perf_counter()
try:
    r = client.post(sys.argv[1], content=body)
    status, reply = r.status_code, (r.json() if r.status_code == 200 else r.text[:300])
except httpx.HTTPError as e:
    status, reply = None, repr(e)
print(json.dumps({"t0": t0, "t1": time.perf_counter(), "status": status, "reply": reply,
                  "body_bytes": len(body or b"")}))
"""

WINDOWS = ("ramp", "before", "during swap", "swapped", "during rollback", "after rollback")


def expert_upload(cfg: ModelConfig, n_layers: int, n_experts: int, seed: int,
                  dtype: torch.dtype = torch.float32) -> tuple[bytes, list[list[int]]]:
    """A `POST /admin/experts` body: a safetensors file with new random gate/up/down weights (std
    `initializer_range`, as at init) for `n_experts` random experts in each of `n_layers` MoE layers spread
    over the model's MoE layers; -> (body, [[layer, expert], ...])."""
    moe = list(cfg.moe_layers)
    if not 1 <= n_layers <= len(moe) or not 1 <= n_experts <= cfg.n_routed_experts:
        raise ValueError(f"--swap-layers must be in [1, {len(moe)}] and --swap-experts in "
                         f"[1, {cfg.n_routed_experts}] for this model")
    layers = [moe[round(i * (len(moe) - 1) / max(n_layers - 1, 1))] for i in range(n_layers)]
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    inter, hidden, std = cfg.moe_intermediate_size, cfg.hidden_size, cfg.initializer_range
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    tensors, pairs = {}, []
    for layer in layers:
        for e in sorted(rng.sample(range(cfg.n_routed_experts), n_experts)):
            pairs.append([layer, e])
            for proj, shape in shapes.items():
                w = torch.randn(*shape, generator=g) * std
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] = w.to(dtype)
    return save_safetensors(tensors), pairs


def classify(r: dict, calls: list[dict], ramp_end: float) -> list[str]:
    """The windows request `r` belongs to. "during swap" / "during rollback": its lifetime [t0 = sent,
    t1 = last byte] overlaps the admin call's [sent, response received] (a request overlapping both kinds of
    call is in both). Otherwise by the last call that returned before it was sent: none -> "before" ("ramp"
    if sent in the first settle seconds, when all clients start at once), a swap -> "swapped" (on the new
    experts), a rollback -> "after rollback"."""
    during = sorted({f"during {c['kind']}" for c in calls if r["t0"] <= c["t1"] and r["t1"] >= c["t0"]})
    if during:
        return during
    prior = [c for c in calls if c["t1"] < r["t0"]]
    if not prior:
        return ["ramp" if r["t0"] < ramp_end else "before"]
    return ["swapped" if prior[-1]["kind"] == "swap" else "after rollback"]


def longest_gap_over(results: list[dict], t0: float, t1: float) -> float:
    """Longest gap between two streamed chunks of one request (an ITL) that overlaps [t0, t1]: the stall the
    call caused for the streams running through it (seconds; nan if none). Send -> first chunk is left out:
    that is queueing and prefill (TTFT), reported per window."""
    gaps = [b - a for r in results for a, b in zip(r["times"], r["times"][1:]) if a <= t1 and b >= t0]
    return max(gaps, default=float("nan"))


async def hot_swap_load(url: str, model: str, args, cfg: ModelConfig, tmp: str) -> dict:
    """`args.swap_concurrency` closed-loop streaming clients (each sends its next request when the last one
    ends; their first sends spread over half the settle time) for settle + baseline seconds, then
    `args.swap_cycles` x (swap -> hold -> rollback -> hold) while they keep streaming (each admin call is
    posted by a child process started beforehand); then the clients stop sending and their last requests
    finish."""
    uploads = []
    for c in range(args.swap_cycles):
        body, experts = expert_upload(cfg, args.swap_layers, args.swap_experts, seed=1000 + c)
        with open(os.path.join(tmp, f"experts{c}.safetensors"), "wb") as f:
            f.write(body)
        uploads.append((f.name, experts))
    results, calls, loads = [], [], [("start", os.getloadavg())]
    stop = asyncio.Event()
    admin = {"Authorization": f"Bearer {args.admin_key}"}
    n = args.swap_concurrency + 4
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)

    async def client(i: int, h: httpx.AsyncClient):
        rng = random.Random(i)
        # staggered first sends over half the settle time: clients started together stay in lock step
        # (same lengths), and every call would then land at the same point of one wave of 32 requests
        await asyncio.sleep(i / args.swap_concurrency * args.swap_settle_s / 2)
        while not stop.is_set():
            prompt = [rng.randrange(100, args.vocab - 100) for _ in range(args.input_len)]
            results.append(await one_request(h, url, model, prompt, args.output_len))

    async def poster(path: str, body_file: str) -> asyncio.subprocess.Process:
        # a child process posts: a large upload written from this process (its event loop, or a thread
        # fighting it for the GIL) would slow the upload and delay the clients' own chunk timestamps
        env = {**os.environ, "GLM5_BENCH_ADMIN_KEY": args.admin_key}
        return await asyncio.create_subprocess_exec(sys.executable, "-c", ADMIN_POST, url + path, body_file,
                                                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    async def call(kind: str, child: asyncio.subprocess.Process, experts: list):
        out = json.loads((await child.communicate(b"go\n"))[0])
        calls.append({"kind": kind, **out, "experts": experts})
        loads.append((kind, os.getloadavg()))

    async def driver(posters: list):
        await asyncio.sleep(args.swap_settle_s + args.swap_baseline_s)
        for (swap, rollback), (_, experts) in zip(posters, uploads):
            await call("swap", swap, experts)
            await asyncio.sleep(args.swap_hold_s)
            await call("rollback", rollback, experts)
            await asyncio.sleep(args.swap_hold_s)
        stop.set()

    version = lambda: httpx.get(url + "/admin/experts", headers=admin, timeout=60).json()["model_version"]
    v_start = version()
    posters = [(await poster("/admin/experts", f), await poster("/admin/experts/rollback", "")) for f, _ in uploads]
    await asyncio.sleep(5)  # let them start (python + httpx imports) before the load
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as h:
        t_start = time.perf_counter()
        await asyncio.gather(driver(posters), *[client(i, h) for i in range(args.swap_concurrency)])
        t_end = time.perf_counter()
    v_end = version()
    loads.append(("end", os.getloadavg()))
    return {"results": results, "calls": calls, "loads": loads, "t_start": t_start, "t_end": t_end,
            "ramp_end": t_start + args.swap_settle_s, "version_start": v_start, "version_end": v_end}


def version_label(r: dict) -> str:
    """The X-Model-Version a response started on, plus its chunks' `model_version` if they differ ("0->2":
    a second swap or a rollback overtook it)."""
    extra = r["chunk_versions"] - {r["version"]}
    return r["version"] + (f" (chunks {sorted(extra)})" if extra else "")


def hot_swap_report(run: dict) -> dict:
    """Per window: completed/failed (by kind), TTFT/ITL/E2EL p50/p99, model versions the responses ran on;
    per admin call: latency, status, requests in flight when it was sent, longest inter-token gap over it."""
    results, calls, t_start = run["results"], run["calls"], run["t_start"]
    by_window = {w: [] for w in WINDOWS}
    for r in results:
        for w in classify(r, calls, run["ramp_end"]):
            by_window[w].append(r)
    windows = []
    for w, rs in by_window.items():
        row = summarize(rs, float("nan"), len(rs))
        row["versions"] = dict(collections.Counter(version_label(r) for r in rs if r["ok"]))
        row["window"] = w
        row["itl_ms"]["max"] = 1e3 * max((x for r in rs if r["ok"] for x in r["itl"]), default=float("nan"))
        windows.append(row)
    call_rows = [{"kind": c["kind"], "at_s": c["t0"] - t_start, "latency_ms": 1e3 * (c["t1"] - c["t0"]),
                  "status": c["status"], "reply": c["reply"], "experts": len(c["experts"]),
                  "body_bytes": c["body_bytes"],
                  "in_flight": sum(1 for r in results if r["t0"] <= c["t0"] <= r["t1"]),
                  "longest_itl_ms": 1e3 * longest_gap_over(results, c["t0"], c["t1"])} for c in calls]
    before = next(w for w in windows if w["window"] == "before")
    ratios = {}
    for w in windows:
        if w["window"] in ("ramp", "before"):
            continue
        ratios[w["window"]] = {k: w[k]["p99"] / before[k]["p99"] for k in ("ttft_ms", "itl_ms", "e2el_ms")}
    bad = [r for r in results if not r["ok"]]
    return {"windows": windows, "calls": call_rows, "p99_vs_before": ratios,
            "requests": len(results), "failed": len(bad),
            "failed_by_kind": dict(collections.Counter(r["kind"] for r in bad)),
            "status_5xx": sum(1 for r in bad if r["kind"] == "5xx"),
            "all_well_formed": not bad and all(c["status"] == 200 for c in calls),
            "version_start": run["version_start"], "version_end": run["version_end"],
            "loadavg": [[label, *load] for label, load in run["loads"]], "duration_s": run["t_end"] - t_start}


def hot_swap_tables(rep: dict) -> str:
    f = lambda row, k: f"{row[k]['p50']:.0f} / {row[k]['p99']:.0f}"
    lines = ["| window | done/fail | TTFT p50/p99 ms | ITL p50/p99/max ms | E2EL p50/p99 ms | versions |",
             "|" + "---|" * 6]
    for w in rep["windows"]:
        lines.append(f"| {w['window']} | {w['completed']}/{w['failed']} | {f(w, 'ttft_ms')} | "
                     f"{f(w, 'itl_ms')} / {w['itl_ms']['max']:.0f} | {f(w, 'e2el_ms')} | {w['versions']} |")
    lines += ["", "| call | at s | latency ms | status | experts | upload | in flight | longest ITL over it ms |",
              "|" + "---|" * 8]
    for c in rep["calls"]:
        lines.append(f"| {c['kind']} | {c['at_s']:.1f} | {c['latency_ms']:.0f} | {c['status']} | {c['experts']} | "
                     f"{c['body_bytes'] / 2**20:.1f} MiB | {c['in_flight']} | {c['longest_itl_ms']:.0f} |")
    lines += ["", "p99 / p99 before: " + "; ".join(
        f"{w}: TTFT {r['ttft_ms']:.2f}x, ITL {r['itl_ms']:.2f}x, E2EL {r['e2el_ms']:.2f}x"
        for w, r in rep["p99_vs_before"].items()),
        f"requests {rep['requests']}, failed {rep['failed']} {rep['failed_by_kind']}, 5xx {rep['status_5xx']}, "
        f"all well-formed: {rep['all_well_formed']}, model version {rep['version_start']} -> {rep['version_end']}, "
        f"load average (1/5/15 min) " + ", ".join(f"{lab} {a:.1f}/{b:.1f}/{c:.1f}" for lab, a, b, c in rep["loadavg"])]
    return "\n".join(lines)


def hot_swap(url: str, args) -> dict:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    asyncio.run(run_level(url, model, 2, 2, args.input_len, 4, args.vocab, 120))  # warm-up (compile, caches)
    with tempfile.TemporaryDirectory(prefix="glm5-hot-swap-") as tmp:
        rep = hot_swap_report(asyncio.run(hot_swap_load(url, model, args, ModelConfig.load(args.model), tmp)))
    print(hot_swap_tables(rep), flush=True)
    return rep


def sweep(args, engine_opts: list[str]) -> list[dict]:
    """The concurrency levels on one server (started here unless `--url`)."""
    server = None if args.url else Server(args.model, engine_opts, args.out + ".server.log")
    try:
        if server:
            server.wait(args.startup_timeout_s)
        return bench_server(args.url or server.url, args, args.concurrency)
    finally:
        if server:
            server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--url", help="benchmark this running server instead of starting one")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32, 64],
                   help="closed-loop levels; none (a bare --concurrency) = only the --knobs runs")
    p.add_argument("--num-prompts", type=int, default=0, help="per level (default 4 x concurrency)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--input-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                   help="draw each prompt's length in [LO, HI] instead of --input-len (sweep and knob runs)")
    p.add_argument("--input-len-dist", choices=("uniform", "log-uniform"), default="log-uniform",
                   help="how --input-len-range lengths are drawn")
    p.add_argument("--seed", type=int, default=0, help="prompts (ids and lengths) and Poisson arrivals")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=8000, help="prompt ids are drawn from [100, vocab - 100)")
    p.add_argument("--duration-s", type=float, default=60.0, help="per level: no new request after this")
    p.add_argument("--knobs", default="", help="';'-separated engine override sets for the batching run")
    p.add_argument("--knob-concurrency", type=int, default=16)
    p.add_argument("--knob-num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, nargs="+", default=[8.0],
                   help="Poisson arrivals/s for the knob runs, 0 = all at once (each knob set runs at each rate)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--hot-swap", action="store_true", help="run only the expert hot-swap scenario (see above)")
    p.add_argument("--swap-concurrency", type=int, default=32, help="streaming clients kept busy")
    p.add_argument("--swap-layers", type=int, default=2, help="MoE layers per swap")
    p.add_argument("--swap-experts", type=int, default=4, help="experts per swapped layer")
    p.add_argument("--swap-cycles", type=int, default=2, help="swap -> hold -> rollback -> hold cycles")
    p.add_argument("--swap-settle-s", type=float, default=10.0, help="ramp excluded from the baseline")
    p.add_argument("--swap-baseline-s", type=float, default=40.0, help="baseline window before the first swap")
    p.add_argument("--swap-hold-s", type=float, default=25.0, help="streaming after each swap and each rollback")
    p.add_argument("--admin-key", default=None,
                   help="admin key of the --url server (a started server gets a random one)")
    p.add_argument("--out", default="bench_serve.json")
    args, engine_opts = p.parse_known_args()
    result: dict = {"args": vars(args), "engine_opts": engine_opts}
    if args.hot_swap:
        return hot_swap_main(args, engine_opts, result)
    result["levels"] = sweep(args, engine_opts) if args.concurrency else []
    by_c = {r["concurrency"]: r["output_throughput"] for r in result["levels"]}
    if 1 in by_c and max(by_c) > 1:
        result["throughput_ratio_max_vs_1"] = by_c[max(by_c)] / by_c[1]
    result["knobs"] = knob_runs(args, engine_opts)
    result["knob_summary"] = knob_summary(result["knobs"])
    if result["levels"]:
        print(table(result["levels"], "levels"))
    if "throughput_ratio_max_vs_1" in result:
        print(f"\noutput throughput at concurrency {max(by_c)} / concurrency 1 = "
              f"{result['throughput_ratio_max_vs_1']:.2f}x")
    if result["knobs"]:
        print("\ndynamic batching knobs (Poisson arrivals; rate inf = all sent at once, closed loop):\n" + table(result["knobs"]))
        print("\nknob sets, median over repeats (ratio to the first set):\n" + knob_summary_table(result["knob_summary"]))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


def hot_swap_main(args, engine_opts: list[str], result: dict) -> int:
    server = None
    if not args.url:
        args.admin_key = args.admin_key or secrets.token_hex(16)
        server = Server(args.model, engine_opts + ["--admin-key", args.admin_key], args.out + ".server.log")
    elif args.admin_key is None:
        raise SystemExit("--hot-swap with --url needs --admin-key")
    try:
        if server:
            server.wait(args.startup_timeout_s)
        result["hot_swap"] = hot_swap(args.url or server.url, args)
    finally:
        if server:
            server.stop()
    result["args"]["admin_key"] = None  # never written to the results file
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0 if result["hot_swap"]["all_well_formed"] else 1


if __name__ == "__main__":
    sys.exit(main())
