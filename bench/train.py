"""Training throughput (issue 4): glm5's Trainer vs transformers' GlmMoeDsaForCausalLM in a plain PyTorch
loop, same `small`-preset config, optimizer (AdamW, clip 1.0), batch and sequence length, same run.

Each implementation runs in its own subprocess (its own peak RSS). glm5 runs its full training step
(guard, clipping, balance loss, bias update, metrics) and, to separate the trainer's overhead from the
model's speed, glm5's model also runs in the same plain loop as HF. MTP is off everywhere (HF has no
MTP loss).
MFU uses one matmul peak measured in the parent for both.

  python bench/train.py [--batch 4 --seq 256 --steps 5 --layers 4 --threads 0]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _model_cfg(layers: int):
    from glm5.model.config import ModelConfig
    return ModelConfig.from_preset("small", num_nextn_predict_layers=0, num_hidden_layers=layers)


def child_glm5(a) -> dict:
    from glm5.core.config import from_dict
    from glm5.train.config import TrainConfig
    from glm5.train.data import SyntheticData
    from glm5.train.trainer import Trainer
    mcfg = _model_cfg(a.layers)
    cfg = from_dict(TrainConfig, {
        "model": {"name": "small", "overrides": {"num_nextn_predict_layers": 0, "num_hidden_layers": a.layers}},
        "optim": {"lr": 1e-4}, "schedule": {"warmup_steps": 1}, "train": {"steps": a.steps + 1, "mtp_weight": 0.0,
                                                                             "num_threads": a.threads},
        "log": {"run_dir": "/tmp/glm5-bench-train", "progress": False, "measure_peak": False}})
    trainer = Trainer(cfg, data=SyntheticData(mcfg.vocab_size, a.batch, a.seq))
    times = []
    for i in range(a.steps + 1):
        t = time.perf_counter()
        trainer.train_step()
        if i:
            times.append(time.perf_counter() - t)
    return _result("glm5 Trainer", times, a, trainer.active_params)


def child_plain(a) -> dict:
    """glm5's model or transformers' in the same plain loop (`a.child` = "glm5-plain" / "hf")."""
    import torch

    from glm5.model.model import GLM5ForCausalLM
    from glm5.train.perf import active_params
    from glm5.train.trainer import set_threads
    set_threads(a.threads)
    torch.manual_seed(0)
    mcfg = _model_cfg(a.layers)
    if a.child == "hf":
        import transformers
        hcfg = transformers.GlmMoeDsaConfig(**{k: v for k, v in mcfg.to_dict().items() if k != "dtype"})
        hcfg._attn_implementation = "sdpa"
        model = transformers.GlmMoeDsaForCausalLM(hcfg).train()
        name = "transformers GlmMoeDsaForCausalLM (sdpa), plain loop"
    else:
        model = GLM5ForCausalLM(mcfg).init_weights(0).train()
        name = "glm5 GLM5ForCausalLM, plain loop"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    x = torch.randint(0, mcfg.vocab_size, (a.batch, a.seq + 1))
    times = []
    for i in range(a.steps + 1):
        t = time.perf_counter()
        logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t)
    with torch.device("meta"):
        n_active = active_params(GLM5ForCausalLM(mcfg))
    return _result(name, times, a, n_active)


def _result(name: str, times: list[float], a, n_active: int) -> dict:
    import torch
    dt = sorted(times)[len(times) // 2]
    return {"impl": name, "tokens_per_s": a.batch * a.seq / dt, "step_s": dt, "peak_rss_mb": _peak_rss_mb(),
            "active_params": n_active, "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--child", choices=["glm5", "glm5-plain", "hf"])
    a = p.parse_args()
    if a.child:
        print(json.dumps((child_glm5 if a.child == "glm5" else child_plain)(a)))
        return
    import torch

    from glm5.train.perf import measure_matmul_peak, mfu
    from glm5.train.trainer import set_threads
    set_threads(a.threads)
    peak = measure_matmul_peak(torch.device("cpu"), torch.float32, use_cache=False)
    rows = []
    for impl in ("glm5", "glm5-plain", "hf"):
        argv = [sys.executable, __file__, "--child", impl] + [f"--{k}={getattr(a, k)}" for k in
                                                              ("batch", "seq", "steps", "layers", "threads")]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        r["mfu"] = mfu(r["active_params"], r["tokens_per_s"], peak)
        rows.append(r)
    print(f"matmul peak {peak / 1e9:.1f} GFLOP/s fp32, {rows[0]['threads']} threads; batch {a.batch} x seq "
          f"{a.seq}, small preset with {a.layers} layers, {a.steps} timed steps (median)")
    print(f"{'impl':<56}{'tokens/s':>10}{'step s':>9}{'peak MB':>9}{'MFU':>8}")
    for r in rows:
        print(f"{r['impl']:<56}{r['tokens_per_s']:>10.0f}{r['step_s']:>9.2f}{r['peak_rss_mb']:>9.0f}{r['mfu']:>8.1%}")
    print(f"glm5 Trainer / HF tokens/s: {rows[0]['tokens_per_s'] / rows[2]['tokens_per_s']:.2f}x; "
          f"glm5 plain loop / HF: {rows[1]['tokens_per_s'] / rows[2]['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
