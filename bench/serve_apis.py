"""Overhead of `/v1/messages` and `/v1/responses` against `/v1/chat/completions` on the same requests.

    python bench/serve_apis.py [--model DIR] [--requests 24] [--concurrency 1 4] [--max-tokens 32]
           [--out bench_serve_apis.json]

Starts `glm5 serve` in a subprocess on loopback (bench/serve.py's `Server`; without `--model`, a tiny random
checkpoint with the bundled 8k tokenizer is written to a temporary directory: the model's compute is small,
so the routes' own cost shows at its largest). Each route gets the same conversations, greedy, thinking off
(the same prompt through all three routes), streamed; the routes take turns request by request, so drift
hits them alike. Reported per route and concurrency: output tokens/s, mean TTFT (send -> first text delta),
mean e2e, and the ratios to chat (tokens/s ratio >= 0.95 is the issue's target). Output token counts
come from each API's own usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from serve import Server  # noqa: E402  (bench/serve.py)
from serve_hardening import tiny_checkpoint  # noqa: E402

ROUTES = ("chat", "messages", "responses")


def bodies(text: str, max_tokens: int) -> dict[str, tuple[str, dict]]:
    """The same request in each API's shape: (path, body)."""
    msgs = [{"role": "user", "content": text}]
    return {
        "chat": ("/v1/chat/completions", {"messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                                          "stream": True, "stream_options": {"include_usage": True},
                                          "chat_template_kwargs": {"enable_thinking": False}}),
        "messages": ("/v1/messages", {"messages": msgs, "max_tokens": max_tokens, "temperature": 0, "stream": True}),
        "responses": ("/v1/responses", {"input": text, "max_output_tokens": max_tokens, "temperature": 0,
                                        "stream": True, "store": False, "reasoning": {"effort": "none"}}),
    }


def _first_text(route: str, data: dict) -> bool:
    if route == "chat":
        return bool(data.get("choices") and data["choices"][0]["delta"].get("content"))
    if route == "messages":
        return data.get("type") == "content_block_delta"
    return data.get("type") == "response.output_text.delta"


def _usage(route: str, data: dict) -> int | None:
    if route == "chat":
        return (data.get("usage") or {}).get("completion_tokens")
    if route == "messages":
        return data["usage"]["output_tokens"] if data.get("type") == "message_delta" else None
    done = data.get("type") in ("response.completed", "response.incomplete")
    return data["response"]["usage"]["output_tokens"] if done else None


async def one(h: httpx.AsyncClient, url: str, route: str, path: str, body: dict) -> dict:
    t0 = time.perf_counter()
    ttft, n_out = None, None
    async with h.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{route}: {r.status_code} {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if ttft is None and _first_text(route, data):
                ttft = time.perf_counter() - t0
            n_out = _usage(route, data) if _usage(route, data) is not None else n_out
    return {"route": route, "e2e": time.perf_counter() - t0, "ttft": ttft, "out": n_out or 0}


async def level(url: str, texts: list[str], concurrency: int, max_tokens: int) -> dict[str, dict]:
    """All requests of all routes, round-robin over routes, `concurrency` in flight."""
    jobs = [(route, *bodies(t, max_tokens)[route]) for t in texts for route in ROUTES]
    results: list[dict] = []
    walls = {r: 0.0 for r in ROUTES}
    async with httpx.AsyncClient(timeout=600) as h:
        it = iter(jobs)

        async def worker():
            for route, path, body in it:
                res = await one(h, url, route, path, body)
                walls[route] += res["e2e"]
                results.append(res)

        await asyncio.gather(*[worker() for _ in range(concurrency)])
    out = {}
    for route in ROUTES:
        mine = [r for r in results if r["route"] == route]
        ttfts = [r["ttft"] for r in mine if r["ttft"] is not None]
        tokens = sum(r["out"] for r in mine)
        # per-route throughput: its tokens over the busy time its requests took (per worker slot)
        out[route] = {"requests": len(mine), "output_tokens": tokens,
                      "tokens_per_s": tokens * concurrency / walls[route] if walls[route] else 0.0,
                      "mean_ttft_s": statistics.fmean(ttfts) if ttfts else float("nan"),
                      "mean_e2e_s": statistics.fmean(r["e2e"] for r in mine)}
    for route in ROUTES:
        out[route]["tokens_per_s_vs_chat"] = out[route]["tokens_per_s"] / out["chat"]["tokens_per_s"]
        out[route]["ttft_vs_chat"] = out[route]["mean_ttft_s"] / out["chat"]["mean_ttft_s"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint to serve (default: a tiny random one)")
    p.add_argument("--requests", type=int, default=24, help="conversations per route and level")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default="bench_serve_apis.json")
    args, engine_opts = p.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_checkpoint(Path(tmp) / "tiny"))
        server = Server(model, engine_opts, args.out + ".server.log")
        try:
            server.wait(args.startup_timeout_s)
            texts = [f"Question {i}: tell me something about the number {i * 7}." for i in range(args.requests)]
            asyncio.run(level(server.url, texts[:2], 1, args.max_tokens))  # warm-up
            result = {"args": vars(args), "levels": {c: asyncio.run(level(server.url, texts, c, args.max_tokens))
                                                     for c in args.concurrency}}
        finally:
            server.stop()
    for c, rows in result["levels"].items():
        print(f"concurrency {c}")
        print(f"{'route':<10} {'tok/s':>8} {'vs chat':>8} {'TTFT ms':>8} {'vs chat':>8} {'e2e ms':>8}")
        for route, r in rows.items():
            print(f"{route:<10} {r['tokens_per_s']:8.1f} {r['tokens_per_s_vs_chat']:8.3f} {r['mean_ttft_s'] * 1e3:8.1f} "
                  f"{r['ttft_vs_chat']:8.3f} {r['mean_e2e_s'] * 1e3:8.1f}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
