"""Training throughput: glm5's Trainer vs transformers' GlmMoeDsaForCausalLM in a plain PyTorch loop, same
`small`-preset config, optimizer (AdamW, clip 1.0), batch and sequence length, same run; and the
parallel layouts on this machine (`--parallel`).

Each implementation runs in its own subprocess (its own peak RSS), `--rounds` times, interleaved, so that
the machine's load hits all of them alike; ratios are per round, then the median. glm5 runs its full
training step (guard, clipping, balance loss, bias update, metrics) and, to separate the trainer's
overhead from the model's speed, glm5's model also runs in the same plain loop as HF (default AdamW
there, as HF's). MTP is off everywhere (HF has no MTP loss). Each child measures the fp32 matmul peak
right before and after its timed steps (the best of both): MFU is relative to that, under the same load.

  python bench/train.py [--batch 4 --seq 256 --steps 5 --layers 4 --threads 1 --rounds 2]
  python bench/train.py --baseline /tmp/glm5-main     # also the Trainer of another glm5 tree (before/after)
  python bench/train.py --profile                     # torch.profiler table of one glm5 Trainer step
  python bench/train.py --mtp --baseline DIR          # the Trainer with the MTP layer and loss, before/after
  python bench/train.py --parallel [--steps 4]     # torchrun layouts: tokens/s, MFU, communication share
  python bench/train.py --device cuda --layers 8 --batch 16 --seq 1024   # on a GPU: bf16 autocast, fp32 masters
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _model_cfg(layers: int, mtp: bool = False):
    from glm5.model.config import ModelConfig
    return ModelConfig.from_preset("small", num_nextn_predict_layers=int(mtp), num_hidden_layers=layers)


MTP_WEIGHT = 0.3  # with --mtp: the MTP layer's loss weight (configs/train/tiny.toml's)


def child_glm5(a) -> dict:
    from glm5.core.config import from_dict
    from glm5.train.config import TrainConfig
    from glm5.train.data import SyntheticData
    from glm5.train.trainer import Trainer
    mcfg = _model_cfg(a.layers, a.mtp)
    cfg = from_dict(TrainConfig, {
        "model": {"name": "small", "overrides": {"num_nextn_predict_layers": int(a.mtp), "num_hidden_layers": a.layers}},
        "optim": {"lr": 1e-4}, "schedule": {"warmup_steps": 1},
        "train": {"steps": a.steps + 1, "mtp_weight": MTP_WEIGHT if a.mtp else 0.0, "num_threads": a.threads},
        "log": {"run_dir": "/tmp/glm5-bench-train", "progress": False, "measure_peak": False}})
    trainer = Trainer(cfg, data=SyntheticData(mcfg.vocab_size, a.batch, a.seq))
    if trainer.device.type != a.device:
        raise SystemExit(f"--device {a.device}: the Trainer picked {trainer.device} (it uses CUDA whenever "
                         "there is one; hide it with CUDA_VISIBLE_DEVICES= for a CPU run)")
    peak = _peak(a.device)
    times = []
    for i in range(a.steps + 1):
        t = time.perf_counter()
        trainer.train_step()
        _sync(a.device)
        if i:
            times.append(time.perf_counter() - t)
    row = _result("glm5 Trainer" + (" (MTP on)" if a.mtp else ""), times, a, trainer.active_params,
                  max(peak, _peak(a.device)))
    return {**row, "experts": experts_path(a.device)}


def profile(a) -> None:
    """One glm5 Trainer step (after two warm-up steps) under torch.profiler: ops by self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from glm5.core.config import from_dict
    from glm5.train.config import TrainConfig
    from glm5.train.data import SyntheticData
    from glm5.train.trainer import Trainer
    cfg = from_dict(TrainConfig, {
        "model": {"name": "small", "overrides": {"num_nextn_predict_layers": int(a.mtp), "num_hidden_layers": a.layers}},
        "optim": {"lr": 1e-4}, "schedule": {"warmup_steps": 1},
        "train": {"steps": 4, "mtp_weight": MTP_WEIGHT if a.mtp else 0.0, "num_threads": a.threads},
        "log": {"run_dir": "/tmp/glm5-bench-train", "progress": False, "measure_peak": False}})
    trainer = Trainer(cfg, data=SyntheticData(_model_cfg(a.layers).vocab_size, a.batch, a.seq))
    trainer.train_step()
    trainer.train_step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        trainer.train_step()
        print(f"step {time.perf_counter() - t:.2f} s (profiled)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=40))


def _peak(device: str = "cpu") -> float:
    """The matmul peak in the training compute dtype: fp32 on CPU, bf16 (autocast's) on CUDA."""
    import torch

    from glm5.train.perf import measure_matmul_peak
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return measure_matmul_peak(torch.device(device), dtype, use_cache=False)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def experts_path(device: str) -> str:
    """Which routed-expert kernel glm5's training step ran (glm5/model/moe.py `grouped_swiglu`)."""
    if device != "cuda":
        return "per-expert loop (CPU)"
    from glm5.model.moe import _GROUPED_MM_OK
    return "per-expert loop (torch._grouped_mm failed here)" if _GROUPED_MM_OK.get(0) is False else "torch._grouped_mm"


def child_plain(a) -> dict:
    """glm5's model or transformers' in the same plain loop (`a.child` = "glm5-plain" / "hf")."""
    import torch

    from glm5.model.model import GLM5ForCausalLM
    from glm5.train.perf import active_params
    from glm5.train.trainer import set_threads
    set_threads(a.threads)
    torch.manual_seed(0)
    mcfg = _model_cfg(a.layers)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.device == "cuda")  # as the Trainer's
    if a.child == "hf":
        import transformers
        hcfg = transformers.GlmMoeDsaConfig(**{k: v for k, v in mcfg.to_dict().items() if k != "dtype"})
        hcfg._attn_implementation = "sdpa"
        if a.hf_experts:  # else transformers' default (grouped_mm where it can dispatch)
            hcfg._experts_implementation = a.hf_experts
        model = transformers.GlmMoeDsaForCausalLM(hcfg).to(a.device).train()
        name = "transformers GlmMoeDsaForCausalLM (sdpa), plain loop"
        experts = f"transformers experts_implementation={model.config._experts_implementation}"
    else:
        model = GLM5ForCausalLM(mcfg).init_weights(0).to(a.device).train()
        name = "glm5 GLM5ForCausalLM, plain loop"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    x = torch.randint(0, mcfg.vocab_size, (a.batch, a.seq + 1)).to(a.device)
    peak = _peak(a.device)
    times = []
    for i in range(a.steps + 1):
        t = time.perf_counter()
        with autocast:
            logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(a.device)
        if i:
            times.append(time.perf_counter() - t)
    with torch.device("meta"):
        n_active = active_params(GLM5ForCausalLM(mcfg))
    row = _result(name, times, a, n_active, max(peak, _peak(a.device)))
    return {**row, "experts": experts} if a.child == "hf" else {**row, "experts": experts_path(a.device)}


def _result(name: str, times: list[float], a, n_active: int, peak: float) -> dict:
    import torch

    from glm5.train.perf import mfu
    dt = sorted(times)[len(times) // 2]
    tps = a.batch * a.seq / dt
    row = {"impl": name, "tokens_per_s": tps, "step_s": dt, "peak_rss_mb": _peak_rss_mb(),
           "active_params": n_active, "threads": torch.get_num_threads(), "peak_flops": peak,
           "mfu": mfu(n_active, tps, peak)}
    if a.device == "cuda":
        row["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return row


def _run_child(a, impl: str, tree: str | None = None, timeout: float | None = None) -> dict:
    """One child process; `tree`: import glm5 from that directory instead (a checkout of another commit)."""
    argv = [sys.executable, __file__, "--child", impl] + [f"--{k}={getattr(a, k)}" for k in
                                                          ("batch", "seq", "steps", "layers", "threads", "device")]
    argv += ["--mtp"] if a.mtp else []
    argv += [f"--hf-experts={a.hf_experts}"] if getattr(a, "hf_experts", "") else []
    env = {**os.environ, "PYTHONPATH": tree} if tree else None
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env,
                         timeout=timeout).stdout.strip().splitlines()[-1]
    row = json.loads(out)
    if tree:
        row["impl"] = f"glm5 Trainer, baseline tree {os.path.basename(tree.rstrip('/'))}" + (" (MTP on)" if a.mtp else "")
    return row


def single(a) -> None:
    if a.mtp:  # transformers has no MTP loss: the glm5 Trainer, before/after
        return mtp_rounds(a)
    rounds = []
    for _ in range(a.rounds):
        rows = []
        for impl, tree in [("glm5", None), ("glm5-plain", None), ("hf", None)] + ([("glm5", a.baseline)] if a.baseline else []):
            rows.append(_run_child(a, impl, tree))
            print(json.dumps({"round": len(rounds), **rows[-1]}), flush=True)  # survives a time limit
        rounds.append(rows)
    print(f"batch {a.batch} x seq {a.seq}, small preset with {a.layers} layers, {a.steps} timed steps (median), "
          f"{rounds[0][0]['threads']} threads, {a.rounds} interleaved rounds; MFU vs each child's fp32 matmul peak")
    _print_rounds(rounds, threads=True)
    med = statistics.median
    ratio = lambda i, j, k="tokens_per_s": med([rows[i][k] / rows[j][k] for rows in rounds])  # noqa: E731
    print(f"median over rounds: glm5 Trainer / HF tokens/s {ratio(0, 2):.2f}x, glm5 plain loop / HF {ratio(1, 2):.2f}x, "
          f"glm5 Trainer MFU {med([rows[0]['mfu'] for rows in rounds]):.1%}")
    if a.baseline:  # MFU ratio: tokens/s per GFLOP/s of each child's own peak, i.e. corrected for the load
        print(f"glm5 Trainer / baseline tree's Trainer: tokens/s {ratio(0, 3):.2f}x, MFU {ratio(0, 3, 'mfu'):.2f}x; "
              f"baseline / HF {ratio(3, 2):.2f}x, baseline MFU {med([rows[3]['mfu'] for rows in rounds]):.1%}")


def _print_rounds(rounds: list[list[dict]], threads: bool) -> None:
    """One table row per child result of every round."""
    print(f"{'round':<6}{'impl':<56}" + (f"{'threads':>8}" if threads else "")
          + f"{'tokens/s':>10}{'step s':>9}{'peak MB':>9}{'GFLOP/s':>9}{'MFU':>8}")
    for k, rows in enumerate(rounds):
        for r in rows:
            print(f"{k:<6}{r['impl']:<56}" + (f"{r['threads']:>8}" if threads else "")
                  + f"{r['tokens_per_s']:>10.0f}{r['step_s']:>9.2f}{r['peak_rss_mb']:>9.0f}"
                  f"{r['peak_flops'] / 1e9:>9.1f}{r['mfu']:>8.1%}")


def mtp_rounds(a) -> None:
    """The glm5 Trainer with the MTP layer and its loss on, and the `--baseline` tree's, interleaved."""
    trees = [None] + ([a.baseline] if a.baseline else [])
    rounds = []
    for _ in range(a.rounds):
        rounds.append([_run_child(a, "glm5", tree) for tree in trees])
        for r in rounds[-1]:
            print(json.dumps({"round": len(rounds) - 1, **r}), flush=True)
    print(f"MTP on (weight {MTP_WEIGHT}), batch {a.batch} x seq {a.seq}, small preset with {a.layers} layers + 1 MTP "
          f"layer, {a.steps} timed steps (median), {a.threads} threads, {a.rounds} interleaved rounds")
    _print_rounds(rounds, threads=False)
    if a.baseline:
        med = statistics.median
        print(f"median over rounds: Trainer / baseline tree's Trainer tokens/s "
              f"{med([r[0]['tokens_per_s'] / r[1]['tokens_per_s'] for r in rounds]):.2f}x, "
              f"MFU {med([r[0]['mfu'] / r[1]['mfu'] for r in rounds]):.2f}x")


LAYOUTS = {"1 process": {}, "fsdp x2": {"data_parallel": 2}, "ep x2": {"expert_parallel": 2},
           "tp x2": {"tensor_parallel": 2}, "pp x2 (1f1b)": {"pipeline_parallel": 2}}


def parallel(a) -> None:
    """The tiny preset under torchrun for each layout (same global batch: 8 x 128 tokens per micro-batch, 2
    micro-batches, MTP on; SyntheticData in the elastic order, so every layout trains on the same rows).
    Every other step runs under the profiler for its communication time (comm share: of that step's wall
    time); tokens/s, MFU and step time are medians of the other steps (the first one excluded)."""
    import tempfile

    from glm5.core.log import read_metrics
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"tiny preset, global batch 2 x 8 x 128 tokens per step, {a.steps} steps, 1 thread per rank; "
          "comm share from the profiled (even) steps, the rest from the odd ones")
    print(f"{'layout':<16}{'tokens/s':>10}{'MFU':>8}{'comm share':>12}{'comm s/step':>13}{'step s':>9}")
    for name, par in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as run:
            worker = [__file__, "--parallel-worker", name, f"--steps={a.steps}", f"--out-dir={run}"]
            launch = [sys.executable] if not par else \
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            done = subprocess.run(launch + worker, env=env, capture_output=True, text=True)
            if done.returncode:
                print(f"{name:<16} failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            recs = [r for r in read_metrics(f"{run}/metrics.jsonl") if "tokens_per_s" in r][1:]
        plain = [r for r in recs if "comm_frac" not in r]  # speed from the steps the profiler left alone
        prof = [r for r in recs if "comm_frac" in r] or [{}]
        med = lambda rows, k: sorted(r.get(k, 0.0) for r in rows)[len(rows) // 2]  # noqa: E731
        print(f"{name:<16}{med(plain, 'tokens_per_s'):>10.0f}{med(plain, 'mfu'):>8.1%}{med(prof, 'comm_frac'):>12.0%}"
              f"{med(prof, 'comm_s'):>13.3f}{med(plain, 'step_s'):>9.2f}", flush=True)


def parallel_worker(a) -> None:
    """One rank of a `--parallel` layout (or the single process): Trainer.fit() on SyntheticData, this rank's
    rows of the global batch by its data coordinates on the ("pp", "dp", "ep", "tp") mesh."""
    from glm5.core.config import from_dict
    from glm5.model.config import ModelConfig
    from glm5.train.config import TrainConfig
    from glm5.train.data import SyntheticData
    from glm5.train.trainer import Trainer
    par = LAYOUTS[a.parallel_worker]
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    tp, pp = par.get("tensor_parallel", 1), par.get("pipeline_parallel", 1)
    D = world // (tp * pp)
    cfg = from_dict(TrainConfig, {
        "model": {"name": "tiny"}, "optim": {"lr": 5e-3}, "schedule": {"warmup_steps": 1},
        "train": {"steps": a.steps, "grad_accum": 2, "mtp_weight": 0.3, "num_threads": 1},
        "parallel": par, "checkpoint": {"at_exit": False},
        "log": {"run_dir": a.out_dir, "every": 1, "progress": False, "eval_batches": 1, "profile_comm_every": 2}})
    vocab = ModelConfig.from_preset("tiny").vocab_size
    Trainer(cfg, data=SyntheticData(vocab, 8 // D, 128, seed=1, rank=(rank // tp) % D, world_size=D)).fit()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads in every child (the same for all: "
                   "comparable on a shared machine)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hf-experts", default="", help="transformers' experts_implementation (eager, batched_mm, "
                   "grouped_mm; default: transformers' choice)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: every child on the GPU, bf16 "
                   "autocast with fp32 master weights (the Trainer's default there), MFU vs the bf16 matmul peak")
    p.add_argument("--baseline", help="a directory holding another version's glm5 package (e.g. `git archive "
                   "main glm5 | tar -x -C DIR`): its Trainer runs as a fourth child in every round")
    p.add_argument("--parallel", action="store_true", help="the torchrun layouts instead of the 1-process step")
    p.add_argument("--profile", action="store_true", help="profile one glm5 Trainer step instead")
    p.add_argument("--mtp", action="store_true", help="the glm5 Trainer(s) only, with the MTP layer and loss on "
                   "(transformers has none)")
    p.add_argument("--child", choices=["glm5", "glm5-plain", "hf"])
    p.add_argument("--parallel-worker", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.parallel_worker:
        parallel_worker(a)
    elif a.child:
        print(json.dumps((child_glm5 if a.child == "glm5" else child_plain)(a)))
    elif a.parallel:
        parallel(a)
    elif a.profile:
        profile(a)
    else:
        single(a)


if __name__ == "__main__":
    main()
