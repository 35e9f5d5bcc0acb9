"""Evaluation-harness benchmark: MMLU-format log-likelihood throughput of `glm5 eval`'s engine path vs
lm-evaluation-harness's `hf` model (transformers) on the same checkpoint and the same requests, in one
run; and the sandbox's cost per program vs a bare interpreter start.

    python bench/eval.py [--preset tiny] [--shots 5] [--limit 97] [--repeats 3] [--programs 20]

The requests are the bundled MMLU-layout set with lm-eval's prompt (`--shots` examples): 4 one-token
continuations per question. lm-eval runs with its logits cache on (one forward per question for
one-token choices, its fastest setting) and `--hf-batch` rows per batch. Each of `--repeats` rounds
times both peers on every request, wall clock and the process's CPU time (the cores are shared, so CPU
seconds are the steadier measure); the median, min and max over rounds are printed, with the agreement
of the two sets of log-likelihoods.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from glm5.data.tokenizer import load_tokenizer  # noqa: E402
from glm5.core.resources import bundled  # noqa: E402
from glm5.eval.engine_model import EngineModel  # noqa: E402
from glm5.eval.loaders import LETTERS  # noqa: E402
from glm5.eval.sandbox import Limits, isolation, run_program  # noqa: E402
from glm5.eval.tasks import TaskConfig, build_task  # noqa: E402
from glm5.model.config import ModelConfig  # noqa: E402
from glm5.model.hf_adapter import save_pretrained  # noqa: E402
from glm5.model.model import GLM5ForCausalLM  # noqa: E402


def requests(shots: int, limit: int) -> list[tuple[str, str]]:
    task = build_task(TaskConfig(task="mmlu", num_fewshot=shots))
    docs = task.docs()[:limit]
    return [(task.context(*d.data), f" {letter}") for d in docs for letter in LETTERS]


def timed(fn) -> tuple[float, float, object]:
    """(wall s, CPU s of this process, result): CPU time counts every thread of the process, so it
    says how much machine a peer used, whatever else the shared cores were running meanwhile."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w0, time.process_time() - c0, out


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def bench_loglikelihood(ckpt: str, reqs, hf_batch: int, repeats: int) -> dict:
    """Both peers loaded once, then `repeats` rounds, each timing glm5 then lm-eval on all requests
    (alternating, so slow phases of the shared machine hit both). glm5's engine is rebuilt per round
    so its prefix cache starts cold every time, as in a fresh `glm5 eval` run."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=ckpt, dtype="float32", device="cpu", batch_size=hf_batch, max_length=2048)
    insts = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)]
    hf.loglikelihood(insts[:8], disable_tqdm=True)  # warm-up (allocations, first-call paths)
    rounds = []
    for _ in range(repeats):
        ours = EngineModel(ckpt, max_length=2048, device="cpu")
        ours.loglikelihood(reqs[-8:])  # warm-up on other questions than the first batch's prefix
        ours.llm.engine.block_manager.reset_prefix_cache()  # start cold, as a fresh run
        w_ours, c_ours, a = timed(lambda: ours.loglikelihood(reqs))
        del ours
        w_hf, c_hf, b = timed(lambda: hf.loglikelihood(insts, disable_tqdm=True))
        rounds.append({"glm5_wall_s": w_ours, "glm5_cpu_s": c_ours, "lm_eval_hf_wall_s": w_hf, "lm_eval_hf_cpu_s": c_hf,
                       "wall_ratio": w_hf / w_ours, "cpu_ratio": c_hf / c_ours,
                       "max_abs_diff": max(abs(x[0] - y[0]) for x, y in zip(a, b)), "load_avg": os.getloadavg()[0]})
        print(json.dumps({"round": len(rounds), **rounds[-1]}), flush=True)  # kept if a later round is cut off
    n_q = len(reqs) // 4
    return {"questions": n_q, "repeats": repeats, "rounds": rounds,
            "glm5_questions_per_s": spread([n_q / r["glm5_wall_s"] for r in rounds]),
            "lm_eval_hf_questions_per_s": spread([n_q / r["lm_eval_hf_wall_s"] for r in rounds]),
            "wall_ratio": spread([r["wall_ratio"] for r in rounds]),
            "cpu_ratio": spread([r["cpu_ratio"] for r in rounds])}


def bench_sandbox(n: int) -> dict:
    src = "assert sum(range(10)) == 45\n"
    run_program(src)
    t0 = time.perf_counter()
    statuses = [run_program(src, Limits()).status for _ in range(n)]
    t_box = (time.perf_counter() - t0) / n
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        for _ in range(n):
            subprocess.run([sys.executable, "-I", "-c", src], cwd=d, check=True)
        t_bare = (time.perf_counter() - t0) / n
    return {"isolation": isolation(), "programs": n, "all_pass": statuses.count("pass") == n,
            "sandbox_ms": 1000 * t_box, "bare_python_ms": 1000 * t_bare, "overhead_ms": 1000 * (t_box - t_bare)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--shots", type=int, default=5)
    ap.add_argument("--limit", type=int, default=97)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--programs", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        cfg = ModelConfig.load(args.preset, num_nextn_predict_layers=0)
        save_pretrained(GLM5ForCausalLM(cfg).init_weights(0), d)
        load_tokenizer(bundled("tokenizer-8k")).save(d)
        reqs = requests(args.shots, args.limit)
        ll = bench_loglikelihood(d, reqs, args.hf_batch, args.repeats)
    print(json.dumps({"bench": "mmlu_loglikelihood", "preset": args.preset, "shots": args.shots, **ll}), flush=True)
    print(json.dumps({"bench": "sandbox", **bench_sandbox(args.programs)}), flush=True)
    print(json.dumps({"bench": "machine", "load_avg": os.getloadavg(), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
