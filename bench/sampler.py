"""Sampler and scheduler overhead (issue 5, engine core). The peer is plain torch sampling
(`multinomial(softmax(x / T))`, or `argmax` for greedy) on the same logits in the same run.

  python bench/sampler.py              # cuda if available, else cpu; V = 151552 (GLM-5 vocabulary)
  python bench/sampler.py --rows 1 32 256 --vocab 151552
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from glm5.infer.config import EngineConfig
from glm5.infer.request import Request
from glm5.infer.sampling import Sampler, SamplingParams, SamplingRow
from glm5.infer.scheduler import Scheduler


def timeit(fn, device, iters=20) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3  # ms


def bench_sampler(rows: int, vocab: int, device: str) -> list[dict]:
    logits = torch.randn(rows, vocab, device=device)
    sampler = Sampler(torch.Generator(device=device).manual_seed(0))
    cases = {
        "greedy": (dict(temperature=0.0), False, lambda: logits.argmax(-1)),
        "temp0.8_top_p0.9": (dict(temperature=0.8, top_p=0.9), False,
                             lambda: torch.multinomial(torch.softmax(logits / 0.8, -1), 1)),
        "temp0.8_seeded": (dict(temperature=0.8), True,
                           lambda: torch.multinomial(torch.softmax(logits / 0.8, -1), 1)),
        "temp0.8_penalties_logprobs5": (dict(temperature=0.8, repetition_penalty=1.1, logprobs=5), False,
                                        lambda: torch.multinomial(torch.softmax(logits / 0.8, -1), 1)),
    }
    out = []
    for name, (params, seeded, peer) in cases.items():
        p = SamplingParams(**params)
        gens = [torch.Generator(device=device).manual_seed(i) if seeded else None for i in range(rows)]
        batch = [SamplingRow(p, list(range(512)), list(range(128)), g) for g in gens]
        ours = timeit(lambda: sampler(logits, batch), device)
        base = timeit(peer, device)
        out.append({"case": name, "rows": rows, "vocab": vocab, "device": device, "glm5_ms": round(ours, 3),
                    "peer_ms": round(base, 3), "ratio": round(ours / base, 2)})
    return out


def bench_scheduler(num_requests: int = 256, steps: int = 100) -> dict:
    """Pure-Python schedule() + update() time per decode step with `num_requests` running."""
    s = Scheduler(EngineConfig(num_blocks=40000, max_num_seqs=num_requests, max_num_batched_tokens=8192,
                               max_model_len=4096))
    rng = random.Random(0)
    for i in range(num_requests):
        s.add_request(Request(f"r{i}", [rng.randrange(1000) for _ in range(1024)],
                              SamplingParams(max_tokens=2000, ignore_eos=True)))
    while s.waiting:  # prefill everything first
        out = s.schedule()
        s.update(out, {x.request_id: [5] for x in out.scheduled if x.samples})
    t = time.perf_counter()
    for _ in range(steps):
        out = s.schedule()
        s.update(out, {x.request_id: [5] for x in out.scheduled})
    ms = (time.perf_counter() - t) / steps * 1e3
    return {"case": "scheduler_decode_step", "requests": num_requests, "ms": round(ms, 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--vocab", type=int, default=151552)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    for rows in args.rows:
        for rec in bench_sampler(rows, args.vocab, args.device):
            print(json.dumps(rec))
    print(json.dumps(bench_scheduler()))


if __name__ == "__main__":
    main()
