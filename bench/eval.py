"""Evaluation-harness benchmark: MMLU-format log-likelihood throughput of `glm5 eval`'s engine path vs
lm-evaluation-harness's `hf` model (transformers) on the same checkpoint and the same requests, in one
run; and the sandbox's cost per program vs a bare interpreter start.

    python bench/eval.py [--preset tiny] [--shots 5] [--limit 97] [--programs 20]

The requests are the bundled MMLU-layout set with lm-eval's prompt (`--shots` examples): 4 one-token
continuations per question. lm-eval runs with its logits cache on (one forward per question for
one-token choices, its fastest setting) and `--hf-batch` rows per batch; the agreement of the two
sets of log-likelihoods is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
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


def bench_loglikelihood(ckpt: str, reqs, hf_batch: int) -> dict:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    ours = EngineModel(ckpt, max_length=2048, device="cpu")
    ours.loglikelihood(reqs[:8])  # warm-up (allocations, first-call paths)
    t0 = time.perf_counter()
    a = ours.loglikelihood(reqs)
    t_ours = time.perf_counter() - t0
    del ours
    hf = HFLM(pretrained=ckpt, dtype="float32", device="cpu", batch_size=hf_batch, max_length=2048)
    insts = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)]
    hf.loglikelihood(insts[:8], disable_tqdm=True)
    t0 = time.perf_counter()
    b = hf.loglikelihood(insts, disable_tqdm=True)
    t_hf = time.perf_counter() - t0
    n_q = len(reqs) // 4
    diff = max(abs(x[0] - y[0]) for x, y in zip(a, b))
    return {"questions": n_q, "glm5_s": t_ours, "lm_eval_hf_s": t_hf, "glm5_items_per_s": n_q / t_ours,
            "lm_eval_hf_items_per_s": n_q / t_hf, "ratio": t_hf / t_ours, "max_abs_diff": diff}


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
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        cfg = ModelConfig.load(args.preset, num_nextn_predict_layers=0)
        save_pretrained(GLM5ForCausalLM(cfg).init_weights(0), d)
        load_tokenizer(bundled("tokenizer-8k")).save(d)
        reqs = requests(args.shots, args.limit)
        ll = bench_loglikelihood(d, reqs, args.hf_batch)
    print(json.dumps({"bench": "mmlu_loglikelihood", "preset": args.preset, "shots": args.shots, **ll}), flush=True)
    print(json.dumps({"bench": "sandbox", **bench_sandbox(args.programs)}), flush=True)
    print(json.dumps({"bench": "machine", "load_avg": os.getloadavg(), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
