"""Model benchmarks (issue: model core). Each measurement runs in its own subprocess so that peak RSS is
its own; the peer is measured in the same run. Children run under an address-space cap so that a dense
run that would not fit fails cleanly (reported as OOM) instead of taking the machine down.

  python bench/model.py train   # fwd+bwd tokens/s + peak memory: glm5 vs transformers, `small` preset
  python bench/model.py prefill # prefill time + peak memory: sparse (index_topk 256) vs dense, T = 2K/8K/32K
  python bench/model.py moe     # grouped MoE strategies on CPU (loop over sorted slices vs padded bmm)
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


# --- children ---------------------------------------------------------------------------------------------
def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _train_setup(impl: str, layers: int):
    import torch

    from glm5.model.config import ModelConfig
    from glm5.model.model import GLM5ForCausalLM
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("small", num_nextn_predict_layers=0, num_hidden_layers=layers)
    if impl == "glm5":
        model = GLM5ForCausalLM(cfg).init_weights(0)
    else:
        import transformers
        hcfg = transformers.GlmMoeDsaConfig(**{k: v for k, v in cfg.to_dict().items() if k != "dtype"})
        hcfg._attn_implementation = "eager" if impl == "hf-eager" else "sdpa"
        model = transformers.GlmMoeDsaForCausalLM(hcfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x):
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return cfg, step


def child_train(impls: str, batch: int, seq: int, steps: int, layers: int) -> dict:
    """Time several implementations in ONE process, alternating step by step, so that a noisy machine
    slows all of them alike; the ratio of medians is the result."""
    import torch
    names = impls.split("+")
    runs = {n: _train_setup(n, layers) for n in names}
    x = torch.randint(2, runs[names[0]][0].vocab_size, (batch, seq))
    times = {n: [] for n in names}
    for i in range(steps + 1):
        for n in names:
            t = time.perf_counter()
            runs[n][1](x)
            if i:  # the first step is warm-up
                times[n].append(time.perf_counter() - t)
    med = {n: sorted(v)[len(v) // 2] for n, v in times.items()}
    return {"tokens_per_step": batch * seq, **{f"{n}_tokens_per_s": batch * seq / med[n] for n in names},
            **{f"{n}_step_s": med[n] for n in names}}


def child_train_mem(impl: str, batch: int, seq: int, layers: int) -> dict:
    import torch
    cfg, step = _train_setup(impl, layers)
    base = _peak_rss_mb()
    x = torch.randint(2, cfg.vocab_size, (batch, seq))
    for _ in range(2):
        step(x)
    return {"impl": impl, "peak_rss_mb": _peak_rss_mb(), "rss_after_build_mb": base}


def child_prefill(mode: str, seq: int, layers: int) -> dict:
    import torch

    from glm5.model.config import ModelConfig
    from glm5.model.model import GLM5ForCausalLM
    torch.manual_seed(0)
    topk = 256 if mode == "sparse" else seq
    cfg = ModelConfig.from_preset("small", num_nextn_predict_layers=0, num_hidden_layers=layers, index_topk=topk,
                                  max_position_embeddings=max(seq, 4096))
    base = _peak_rss_mb()
    if mode == "hf-eager":
        import transformers
        hcfg = transformers.GlmMoeDsaConfig(**{k: v for k, v in cfg.to_dict().items() if k != "dtype"})
        hcfg._attn_implementation = "eager"
        model = transformers.GlmMoeDsaForCausalLM(hcfg).eval()
    else:
        model = GLM5ForCausalLM(cfg).init_weights(0).eval()
    x = torch.randint(2, cfg.vocab_size, (1, seq))
    with torch.no_grad():
        t = time.perf_counter()
        model(x, logits_to_keep=1)
        dt = time.perf_counter() - t
    return {"mode": mode, "seq": seq, "time_s": dt, "peak_rss_mb": _peak_rss_mb(), "start_rss_mb": base}


def child_moe(strategy: str, tokens: int) -> dict:
    import torch
    import torch.nn.functional as F

    from glm5.model.config import ModelConfig
    from glm5.model.moe import MoE
    torch.manual_seed(0)
    moe = MoE(ModelConfig.from_preset("small"))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(tokens, 384, requires_grad=True)
    with torch.no_grad():
        _, _, w, idx = moe.gate(x)
    ex = moe.experts

    def padded_bmm():
        E = ex.n_experts
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        cmax = int(counts.max())
        slot = torch.arange(len(order)) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        buf = x.new_zeros(E, cmax, x.shape[1])
        buf = buf.index_put((flat[order], slot), x[order // idx.shape[1]])
        h = torch.bmm(buf, ex.gate_up_proj.transpose(1, 2))
        g, u = h.chunk(2, -1)
        y = torch.bmm(F.silu(g) * u, ex.down_proj.transpose(1, 2))[flat[order], slot]
        y = y * w.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, order // idx.shape[1], y)

    def reference_loop():  # one F.linear pair per expert over its rows (transformers' formulation)
        out = torch.zeros_like(x)
        for e in range(ex.n_experts):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                g, u = F.linear(x[tok], ex.gate_up_proj[e]).chunk(2, dim=-1)
                out = out.index_add(0, tok, F.linear(F.silu(g) * u, ex.down_proj[e]) * w[tok, slot, None])
        return out

    fn = {"sorted-loop": lambda: ex(x, idx, w), "padded-bmm": padded_bmm, "reference-loop": reference_loop}[strategy]
    ref = reference_loop()
    err = (fn() - ref).abs().max().item()
    times = []
    for _ in range(6):
        t = time.perf_counter()
        fn().sum().backward()
        times.append(time.perf_counter() - t)
    return {"strategy": strategy, "tokens": tokens, "fwd_bwd_ms": 1e3 * sorted(times)[3], "max_err": err}


# --- parent -----------------------------------------------------------------------------------------------
def run_child(args: list[str], mem_cap_gb: float, timeout: float = 1800) -> dict:
    cmd = [sys.executable, __file__, "_child", json.dumps({"args": args, "cap": mem_cap_gb})]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f}s"}
    if p.returncode != 0:
        tail = (p.stderr or "").strip().splitlines()[-1:] or ["?"]
        oom = "memory" in tail[0].lower() or "alloc" in tail[0].lower() or p.returncode in (-9, 137)
        return {"error": f"OOM (> {mem_cap_gb:g} GB cap)" if oom else tail[0][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _child_main(spec: str) -> None:
    spec = json.loads(spec)
    cap = int(spec["cap"] * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    kind, *rest = spec["args"]
    fn = {"train": child_train, "train_mem": child_train_mem, "prefill": child_prefill, "moe": child_moe}[kind]
    conv = [int(r) if str(r).isdigit() else r for r in rest]
    print(json.dumps(fn(*conv)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["train", "prefill", "moe"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--mem-cap-gb", type=float, default=14.0)
    args = ap.parse_args()
    import torch
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, cpu count {os.cpu_count()}")
    if args.what == "train":
        impls = ("glm5", "hf-eager", "hf-sdpa")
        t = run_child(["train", "+".join(impls), args.batch, args.seq, args.steps, args.layers], args.mem_cap_gb)
        print(json.dumps(t))
        mem = {i: run_child(["train_mem", i, args.batch, args.seq, args.layers], args.mem_cap_gb) for i in impls}
        for i in impls:
            print(json.dumps(mem[i]))
        if "glm5_tokens_per_s" in t:
            for i in impls[1:]:
                print(f"glm5 / {i}: {t['glm5_tokens_per_s'] / t[i + '_tokens_per_s']:.2f}x tokens/s "
                      f"(fwd+bwd+AdamW, batch {args.batch} x {args.seq}); peak RSS "
                      f"{mem['glm5'].get('peak_rss_mb', float('nan')):.0f} vs {mem[i].get('peak_rss_mb', float('nan')):.0f} MB")
    elif args.what == "prefill":
        for seq in [int(s) for s in args.lengths.split(",")]:
            for mode in ("sparse", "dense", "hf-eager"):
                r = run_child(["prefill", mode, seq, args.layers], args.mem_cap_gb)
                print(json.dumps({"mode": mode, "seq": seq, **r}))
    else:
        for tokens in (256, 1024, 4096):
            for s in ("sorted-loop", "padded-bmm", "reference-loop"):
                print(json.dumps(run_child(["moe", s, tokens], args.mem_cap_gb)))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_child":
        _child_main(sys.argv[2])
    else:
        main()
