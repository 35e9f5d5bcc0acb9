"""Editor-style load on `glm5 serve` (seed A1): /infill vs the same requests as plain completions, and
prefix-cache reuse when one file is edited at the cursor again and again.

1. Throughput/latency: 64 concurrent clients, each one request shaped like an editor's: a 1-2K token
   prefix, a 200-token suffix, 32 new tokens (greedy). Run as llama.cpp `/infill` and, in the same run,
   as `/v1/completions` with the prefix and suffix text as one prompt (same token count, no infill).
   Reported: requests/s, p50/p99 latency, and the ratio; `--rounds R` runs each route R times in ABBA
   order with a cold prefix cache each time (the machine's load drifts; both routes see it alike).
2. Repeated edits: one file, 20 rounds of "type a few characters at the cursor, ask again" through
   `/infill`; per round the share of the prompt that had to be computed (1 - tokens_cached / prompt
   tokens), for each infill format the model supports (target: < 10% with SPM).

Model: a checkpoint with a FIM tokenizer (e.g. runs/code/final), or by default a random-init `tiny`
with a freshly trained 8k FIM tokenizer (speed does not depend on the weights).

    python3 bench/code_serve.py [--model runs/code/final] [--rounds 2] [--out docs/bench-code-serve.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from glm5.data.tokenizer import load_tokenizer
from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.serve.app import create_app
from glm5.serve.config import ServerConfig
from glm5.serve.testing import serve_in_thread

from code_tokens import held_out_python  # noqa: E402

CLIENTS, NEW, SUFFIX_TOKENS = 64, 32, 200


def editor_requests(tok, files: list[str], n: int, rng: random.Random) -> list[tuple[str, str]]:
    """(prefix, suffix) texts: a cursor in a long file, 1-2K tokens before it, ~200 after."""
    out = []
    big = [f for f in files if len(tok.encode(f)) > 2600]
    while len(out) < n:
        ids = tok.encode(rng.choice(big))
        cut = rng.randint(2000, len(ids) - SUFFIX_TOKENS - 1)
        n_pre = rng.randint(1000, 2000)
        out.append((tok.decode(ids[cut - n_pre:cut]), tok.decode(ids[cut:cut + SUFFIX_TOKENS])))
    return out


async def timed(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = await client.post(url, json=body, timeout=3600)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()


async def load(base: str, reqs: list[tuple[str, str]], reset, rounds: int) -> dict:
    """Each route `rounds` times in ABBA order (infill, completion, completion, infill, ...) with a cold
    prefix cache each time, so warm-up and a drifting machine load fall on both routes alike."""
    order = [("infill", "completion") if r % 2 == 0 else ("completion", "infill") for r in range(rounds)]
    runs: dict[str, list[dict]] = {"infill": [], "completion": []}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=CLIENTS)) as client:
        for names in order:
            for name in names:
                bodies = [({"input_prefix": p, "input_suffix": s, "n_predict": NEW, "temperature": 0,
                            "ignore_eos": True}, "/infill") if name == "infill" else
                          ({"prompt": p + s, "max_tokens": NEW, "temperature": 0, "ignore_eos": True},
                           "/v1/completions") for p, s in reqs]
                reset()
                t0 = time.perf_counter()
                done = await asyncio.gather(*[timed(client, base + url, body) for body, url in bodies])
                wall = time.perf_counter() - t0
                lat = sorted(d for d, _ in done)
                runs[name].append({"requests_per_s": len(done) / wall, "p50_s": statistics.median(lat),
                                   "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "wall_s": wall})
                print(json.dumps({name: runs[name][-1]}), flush=True)
    # per route: the median of each metric over its rounds (the mean of the middle two for an even count)
    return {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()} | {
        "ratios": [i["requests_per_s"] / c["requests_per_s"] for i, c in zip(runs["infill"], runs["completion"])]}


async def edits(base: str, prefix: str, suffix: str, fmt_rounds: int = 20) -> list[float]:
    """Share of the prompt recomputed per round while typing at the cursor."""
    shares = []
    async with httpx.AsyncClient() as client:
        for k in range(fmt_rounds):
            prefix += "x" if k % 5 else "\n    "  # a few keystrokes at the cursor
            _, js = await timed(client, base + "/infill", {"input_prefix": prefix, "input_suffix": suffix,
                                                           "n_predict": 4, "temperature": 0})
            if k:  # the first request has nothing cached
                shares.append(1 - js["tokens_cached"] / js["tokens_evaluated"])
    return shares


def build_engine(model: str | None) -> tuple[LLMEngine, object]:
    if model:
        engine = LLMEngine(EngineConfig(model=model, device="cpu", max_model_len=2560, num_blocks=64 * 160 + 64,
                                        block_size=16, batch_timeout_ms=0, max_num_batched_tokens=8192))
        return engine, engine.tokenizer
    from glm5.data.tokenizer_cli import TokenizerTrainConfig, iter_texts, train_tokenizer
    tok = train_tokenizer(TokenizerTrainConfig(fim_tokens=True), texts=iter_texts(["bundled:corpus/train.jsonl.gz"]))
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", max_model_len=2560, num_blocks=64 * 160 + 64,
                                    block_size=16, batch_timeout_ms=0, max_num_batched_tokens=8192), tokenizer=tok)
    return engine, tok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint with a FIM tokenizer (default: random tiny)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=2, help="load rounds per route (ABBA order)")
    args = ap.parse_args()
    engine, tok = build_engine(args.model)
    rng = random.Random(0)
    files = held_out_python(limit_bytes=8_000_000)
    reqs = editor_requests(tok, files, CLIENTS, rng)
    lines = []
    for fmt in ("spm", "psm", "glm"):
        app = create_app(engine, tok, ServerConfig(infill_format=fmt), model_name="code")
        try:
            with serve_in_thread(app) as base:
                if fmt == "spm":
                    res = asyncio.run(load(base, reqs, engine.block_manager.reset_prefix_cache, args.rounds))
                    i, c = res["infill"], res["completion"]
                    ratios = ", ".join(f"{r:.2f}x" for r in res["ratios"])
                    lines += ["| route | requests/s | p50 s | p99 s |", "|---|---|---|---|",
                              f"| /infill (spm) | {i['requests_per_s']:.2f} | {i['p50_s']:.1f} | {i['p99_s']:.1f} |",
                              f"| /v1/completions (same tokens) | {c['requests_per_s']:.2f} | {c['p50_s']:.1f} | "
                              f"{c['p99_s']:.1f} |",
                              f"| ratio infill / completion (median rounds) | "
                              f"{i['requests_per_s'] / c['requests_per_s']:.2f}x | per round: {ratios} | |", ""]
                    lines += ["| infill format | prompt share recomputed per edit (mean) | max |", "|---|---|---|"]
                engine.block_manager.reset_prefix_cache()
                shares = asyncio.run(edits(base, *reqs[0]))
                lines.append(f"| {fmt} | {statistics.mean(shares):.1%} | {max(shares):.1%} |")
                print(json.dumps({"format": fmt, "recomputed": shares}), flush=True)
        except httpx.HTTPStatusError as e:  # the model cannot use this format
            print(json.dumps({"format": fmt, "skipped": e.response.text[:200]}))
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
