"""Fine-tuning benchmarks (issue 9): on the trained quickstart model (runs/tiny/final) or the embedded one.

  python bench/finetune.py sft   --base runs/tiny/final [--steps 60 --minutes 1.5]
      SFT on the bundled chat set: held-out assistant-token loss of the base, LoRA, prefix tuning and full
      fine-tuning (8-bit AdamW, and fp32 AdamW as the optimizer peer), with trainable parameters,
      optimizer-state bytes, peak RSS and training tokens/s; each method in its own process.
  python bench/finetune.py sft   --base EMBEDDED_DIR --methods base lora full_8bit --exact
      The same on a real model, plus an instruction-following check with exact answers: for each held-out
      "Explain what this Python function does" conversation, the model is asked (zero-shot, greedy) to
      list the function's parameters and nothing else; the answer must equal the parameter list the
      bundled set records for it (its reasoning line: "`f` takes `a`, `b` and calls ..."). The SFT data
      does not contain these questions, so the check measures whether fine-tuning keeps (or costs) the
      base's instruction following, next to the held-out loss it gains.
  python bench/finetune.py --parallel [--steps 9]
      LoRA (attn + mlp + experts, r 16) on the distributed mesh: 1 process vs 2 ranks under torchrun
      (FSDP, expert parallel, tensor parallel) on a fresh `tiny` base, same global batch (8 packed SFT rows
      x 128 tokens): training tokens/s, peak RSS per rank, and the communication share of the profiled
      steps (every other one: the profiler's collective time over the step's wall time).
  python bench/finetune.py sft   --base EMBEDDED_DIR --methods lora lora_int8 lora_fp8 --steps 12 --minutes 30
      LoRA on a fp32 vs INT8 vs FP8 frozen base (`model.base_quant`): base bytes, tokens/s, held-out loss.
  python bench/finetune.py serve --base runs/tiny/final [--adapter runs/finetune-lora/final]
      Multi-LoRA serving: the same requests (greedy, fixed length) spread over 4 adapters in one batch vs
      all on the base model; output tokens/s, alternated rounds, median.

Results go to stdout as JSON lines; BENCHMARKS.md has the numbers with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import re
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
METHODS = {  # name -> config overrides
    "base": ["--method=lora", "--train.steps=1"],  # evaluated before any step: B = 0 is the base model
    "lora": ["--method=lora", "--lora.r=16", "--lora.alpha=32", '--lora.targets=["attn", "mlp", "experts"]'],
    # the same LoRA on a frozen base held in INT8 / FP8 (model.base_quant; dequantised to fp32 per module)
    "lora_int8": ["--method=lora", "--lora.r=16", "--lora.alpha=32", '--lora.targets=["attn", "mlp", "experts"]',
                  "--model.base_quant=int8"],
    "lora_fp8": ["--method=lora", "--lora.r=16", "--lora.alpha=32", '--lora.targets=["attn", "mlp", "experts"]',
                 "--model.base_quant=fp8"],
    # ... and with activation checkpointing (autograd then keeps one layer's dequantised weights, not all)
    "lora_ckpt": ["--method=lora", "--lora.r=16", "--lora.alpha=32", '--lora.targets=["attn", "mlp", "experts"]',
                  "--precision.activation_checkpointing=true"],
    "lora_int8_ckpt": ["--method=lora", "--lora.r=16", "--lora.alpha=32", '--lora.targets=["attn", "mlp", "experts"]',
                       "--model.base_quant=int8", "--precision.activation_checkpointing=true"],
    "prefix": ["--method=prefix", "--data.pack=false", "--prefix.num_virtual_tokens=16"],
    "full_8bit": ["--method=full", "--optim.name=adamw8bit", "--precision.activation_checkpointing=true"],
    "full_fp32adamw": ["--method=full", "--optim.name=adamw", "--precision.activation_checkpointing=true"],
}


ARGS_QUESTION = ("Which parameters does this Python function take? Reply with their names only, separated by "
                 "commas, or with the word none if it takes no parameters.\n\n```python\n{code}\n```")
TAKES = re.compile(r"^`[^`]+` takes (?P<args>no arguments|.+?) and calls ")


def exact_cases(path: str = "sft/heldout.jsonl.gz") -> list[dict]:
    """(question, parameter names) for every held-out function-explanation conversation."""
    from glm5.core.resources import bundled
    from glm5.data.sft import read_chat_jsonl
    cases = []
    for ex in read_chat_jsonl(bundled(path)):
        user, answer = ex.messages[0]["content"], ex.messages[-1]
        m = TAKES.match(answer.get("reasoning_content") or "")
        code = re.search(r"```python\n(.*)```", user, re.S)
        if m and code and user.startswith("Explain what this Python function does"):
            names = [] if m["args"] == "no arguments" else re.findall(r"`([^`]+)`", m["args"])
            cases.append({"question": ARGS_QUESTION.format(code=code[1].rstrip("\n")), "names": names})
    return cases


def parse_names(text: str) -> list[str]:
    text = text.strip().splitlines()[0].strip().rstrip(".") if text.strip() else ""
    if text.lower().strip("`* ") == "none":
        return []
    return [t.strip().strip("`*'\" ") for t in text.split(",") if t.strip()]


def exact_check(base: str, adapter: str | None = None, full: str | None = None) -> dict:
    """Greedy answers of the base, base + LoRA adapter, or a fully fine-tuned model to the questions about
    the held-out functions and, separately, about the training set's functions (SFT saw their code and
    explanations, never this question)."""
    from glm5 import LLM, SamplingParams
    held, seen = exact_cases(), exact_cases("sft/train.jsonl.gz")
    cases = held + seen
    llm = LLM(full or base, device="cpu", max_model_len=1024, max_num_seqs=32,
              lora={"sft": adapter} if adapter else None)
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": c["question"]}], add_generation_prompt=True)
               for c in cases]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), lora="sft" if adapter else None)
    answers = [o.outputs[0].text for o in outs]
    strict = [parse_names(a) == c["names"] for a, c in zip(answers, cases)]  # the asked format, exactly
    named = [mentioned_names(a) == c["names"] for a, c in zip(answers, cases)]  # the right names, any wording
    h = len(held)
    return {"heldout_exact": sum(strict[:h]) / h, "heldout_names": sum(named[:h]) / h, "heldout_n": h,
            "seen_code_exact": sum(strict[h:]) / len(seen), "seen_code_names": sum(named[h:]) / len(seen),
            "seen_code_n": len(seen), "answers": [{"want": c["names"], "got": a} for c, a in zip(cases, answers)]}


def mentioned_names(text: str) -> list[str]:
    """The parameter names an answer gives in any wording: its `backticked` names in order (first
    sentence), else the strict comma list; "no parameters"-style answers are the empty list."""
    first = re.split(r"(?<=[.!?])\s", text.strip(), maxsplit=1)[0] if text.strip() else ""
    if re.search(r"\b(no|zero|any) (parameters|arguments)\b|^none\b", first, re.I):
        return []
    quoted = re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", first)
    return list(dict.fromkeys(quoted)) if quoted else parse_names(text)


def _state_bytes(opt) -> int:
    seen = {t.untyped_storage().data_ptr(): t for s in opt.state.values() for t in s.values()
            if hasattr(t, "untyped_storage") and t.numel() > 1}
    return sum(t.numel() * t.element_size() for t in seen.values())


def child_sft(a) -> dict:
    import torch

    from glm5.core.config import load_config
    from glm5.finetune.config import FinetuneConfig
    from glm5.finetune.quant_base import base_bytes
    from glm5.finetune.trainer import FinetuneTrainer

    torch.set_num_threads(a.threads) if a.threads else None
    run = Path(tempfile.mkdtemp(prefix=f"glm5-bench-ft-{a.method}-"))
    cfg = load_config(FinetuneConfig, "configs/finetune/lora.toml", [
        f"--model.name={a.base}", f"--train.steps={a.steps}", f"--train.time_limit_min={a.minutes}",
        f"--data.batch_size={a.batch}", f"--data.seq_len={a.seq}", f"--log.run_dir={run}", "--log.progress=false",
        "--log.measure_peak=false", "--checkpoint.every=0", "--checkpoint.at_exit=false",
        f"--log.eval_batches={a.eval_batches}", *METHODS[a.method]])
    trainer = FinetuneTrainer(cfg)
    report = {**trainer.raw_model.trainable_report(), "base_bytes": base_bytes(trainer.raw_model),
              "load_rss_mb": _peak_rss_mb()}
    if a.method == "base":
        val = trainer.evaluate()
        return {"method": a.method, "heldout_loss": val["val_loss"], "heldout_tokens": val["val_tokens"],
                "peak_rss_mb": _peak_rss_mb(), **({"exact": exact_check(a.base)} if a.exact else {})}
    t0 = time.perf_counter()
    summary = trainer.fit()
    wall = time.perf_counter() - t0
    exact = {}
    if a.exact and a.method in ("lora", "full_8bit", "full_fp32adamw"):
        final = str(trainer.save_final())
        exact = {"exact": exact_check(a.base, adapter=final) if a.method == "lora" else exact_check(a.base, full=final)}
    tps = [h["tokens_per_s"] for h in trainer.history[1:]]
    return {"method": a.method, "heldout_loss": summary["val_loss"], "steps": trainer.step, "train_s": round(wall, 1),
            "tokens_per_s": round(statistics.median(tps), 1) if tps else None,
            "final_train_loss": trainer.history[-1]["loss"], **report,
            "optimizer_state_bytes": _state_bytes(trainer.optimizer), "lr": cfg.resolved_lr() if cfg.optim.lr == 0
            else cfg.optim.lr, "peak_rss_mb": _peak_rss_mb(), **exact}


def _peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def run_sft(a) -> None:
    for method in a.methods:
        cmd = [sys.executable, __file__, "child-sft", "--method", method, *_pass(a)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("{")), None)
        print(line or json.dumps({"method": method, "error": out.stderr[-2000:]}), flush=True)


def _pass(a) -> list[str]:
    return ["--base", a.base, "--steps", str(a.steps), "--minutes", str(a.minutes), "--batch", str(a.batch),
            "--seq", str(a.seq), "--eval-batches", str(a.eval_batches), "--threads", str(a.threads),
            *(["--exact"] if a.exact else [])]


# ---- multi-LoRA serving --------------------------------------------------------------------------------
def make_adapters(base: str, trained: str | None, root: Path, n: int = 4) -> dict[str, str]:
    """`n` adapters on `base`: the trained one (if given) plus random-B ones with the same targets and rank."""
    import torch

    from glm5.finetune.adapters import from_pretrained
    from glm5.model import lora

    out = {}
    if trained:
        out["trained"] = trained
    k = 0
    while len(out) < n:
        m = from_pretrained(base)
        m.add_lora(lora.LoraConfig(r=16, alpha=32, targets=["attn", "mlp", "experts"]))
        torch.manual_seed(k)
        with torch.no_grad():
            for t, mod in lora.lora_layers(m):
                (mod.lora_B.weight if t.param is None else mod.lora_B).normal_(0, 0.02)
        m.save_adapter(root / f"rand{k}")
        out[f"rand{k}"] = str(root / f"rand{k}")
        k += 1
    return out


def run_serve(a) -> None:
    from glm5 import LLM, SamplingParams
    from glm5.core.resources import bundled
    from glm5.data.sft import read_chat_jsonl

    root = Path(tempfile.mkdtemp(prefix="glm5-bench-mlora-"))
    adapters = make_adapters(a.base, a.adapter, root)
    llm = LLM(a.base, device="cpu", max_model_len=1024, max_loras=len(adapters), lora=adapters,
              max_num_seqs=a.requests, enable_prefix_caching=False)
    tok = llm.tokenizer
    convs = read_chat_jsonl(bundled("sft/heldout.jsonl.gz"))[: a.requests]
    prompts = [tok.apply_chat_template(c.messages[:1], add_generation_prompt=True)[:256] for c in convs]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    names = list(adapters)
    mixed = [names[i % len(names)] for i in range(len(prompts))]
    llm.generate(prompts[:4], params, lora=mixed[:4])  # warm-up
    rates = {"base": [], "mixed": []}
    for r in range(a.rounds):
        for kind in (("base", "mixed") if r % 2 == 0 else ("mixed", "base")):
            t = time.perf_counter()
            outs = llm.generate(prompts, params, lora=None if kind == "base" else mixed)
            dt = time.perf_counter() - t
            rates[kind].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    base, mix = statistics.median(rates["base"]), statistics.median(rates["mixed"])
    print(json.dumps({"bench": "multi_lora_serving", "requests": len(prompts), "max_tokens": a.max_tokens,
                      "adapters": len(names), "base_tok_s": round(base, 1), "mixed_tok_s": round(mix, 1),
                      "ratio": round(mix / base, 3), "rounds": rates, "load_avg": os.getloadavg()}))


LAYOUTS = {"1 process": {}, "fsdp x2": {"data_parallel": 2}, "ep x2": {"expert_parallel": 2},
           "tp x2": {"tensor_parallel": 2}}
GLOBAL_ROWS, PAR_SEQ = 8, 128


def tiny_base(root: Path) -> Path:
    """A freshly initialised `tiny` preset (seed 0) with the bundled tokenizer: the LoRA base."""
    from glm5.core.resources import bundled
    from glm5.data.tokenizer import load_tokenizer
    from glm5.model.config import ModelConfig
    from glm5.model.hf_adapter import save_pretrained
    from glm5.model.model import GLM5ForCausalLM
    save_pretrained(GLM5ForCausalLM(ModelConfig.from_preset("tiny")).init_weights(seed=0), root / "base")
    load_tokenizer(bundled("tokenizer-8k")).save(root / "base")
    return root / "base"


def run_parallel(a) -> None:
    """Each layout in its own launch (torchrun for 2 ranks); medians over the steps after the first."""
    from glm5.core.log import read_metrics
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = Path(tempfile.mkdtemp(prefix="glm5-bench-ftmesh-"))
    base = tiny_base(root)
    print(json.dumps({"load_avg": os.getloadavg()}))
    print(f"LoRA r 16 on attn + mlp + experts, tiny base, global batch {GLOBAL_ROWS} x {PAR_SEQ} tokens, "
          f"{a.steps} steps, 1 thread per rank; comm share from the profiled (even) steps, the rest from the odd ones")
    print(f"{'layout':<12}{'tokens/s':>10}{'comm share':>12}{'comm s/step':>13}{'step s':>9}{'peak RSS/rank MiB':>20}")
    for name, par in LAYOUTS.items():
        run = root / name.replace(" ", "_")
        worker = [__file__, "--parallel-worker", name, f"--steps={a.steps}", f"--out-dir={run}", f"--base={base}"]
        launch = [sys.executable] if not par else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        done = subprocess.run(launch + worker, env=env, capture_output=True, text=True)
        if done.returncode:
            print(f"{name:<12} failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        recs = [r for r in read_metrics(run / "metrics.jsonl") if "tokens_per_s" in r][1:]
        plain = [r for r in recs if "comm_frac" not in r]
        prof = [r for r in recs if "comm_frac" in r] or [{}]
        med = lambda rows, k: sorted(r.get(k, 0.0) for r in rows)[len(rows) // 2]  # noqa: E731
        rss = [json.loads(f.read_text())["peak_rss_mib"] for f in sorted(run.glob("rss_rank*.json"))]
        comm = (f"{med(prof, 'comm_frac'):>12.0%}{med(prof, 'comm_s'):>13.3f}" if par else f"{'-':>12}{'-':>13}")
        print(f"{name:<12}{med(plain, 'tokens_per_s'):>10.0f}{comm}{med(plain, 'step_s'):>9.2f}"
              f"{' / '.join(f'{m:.0f}' for m in rss):>20}", flush=True)
    print(json.dumps({"load_avg": os.getloadavg()}))


def parallel_worker(a) -> None:
    """One rank of a `--parallel` layout: FinetuneTrainer.fit() (LoRA), then this rank's peak RSS."""
    from glm5.core.config import from_dict
    from glm5.finetune.config import FinetuneConfig
    from glm5.finetune.trainer import FinetuneTrainer
    par = LAYOUTS[a.parallel_worker]
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    data_world = world // par.get("tensor_parallel", 1)
    cfg = from_dict(FinetuneConfig, {
        "method": "lora", "model": {"name": a.base},
        "data": {"batch_size": GLOBAL_ROWS // data_world, "seq_len": PAR_SEQ, "val_path": ""},
        "lora": {"r": 16, "alpha": 32, "targets": ["attn", "mlp", "experts"]},
        "train": {"steps": a.steps, "num_threads": 1}, "parallel": par, "checkpoint": {"at_exit": False},
        "log": {"run_dir": a.out_dir, "every": 1, "progress": False, "eval_batches": 0, "measure_peak": False,
                "profile_comm_every": 2 if par else 0}})
    FinetuneTrainer(cfg).fit()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    (Path(a.out_dir) / f"rss_rank{rank}.json").write_text(json.dumps({"peak_rss_mib": peak}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", choices=["sft", "serve", "child-sft"], default="sft")
    ap.add_argument("--parallel", action="store_true", help="LoRA on the torchrun mesh layouts (see the docstring)")
    ap.add_argument("--parallel-worker", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--base", default="runs/tiny/final")
    ap.add_argument("--adapter", default=None, help="a trained LoRA adapter to serve among the 4")
    ap.add_argument("--method", default="lora")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS), help="sft: which to run")
    ap.add_argument("--exact", action="store_true", help="sft: the held-out exact-answer instruction check")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--minutes", type=float, default=1.5, help="time limit per method (LR annealed by time)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.parallel_worker:
        parallel_worker(a)
    elif a.parallel:
        run_parallel(a)
    elif a.what == "child-sft":
        print(json.dumps(child_sft(a)))
    elif a.what == "sft":
        print(json.dumps({"load_avg": os.getloadavg()}))
        run_sft(a)
    else:
        run_serve(a)


if __name__ == "__main__":
    main()
