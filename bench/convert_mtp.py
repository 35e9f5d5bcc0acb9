"""MTP speculative decoding of a converted model: train its MTP layer on the frozen trunk (CPU, bounded
minutes), then measure draft acceptance at k = 1 and k = 2 and batch-1 decode speed with / without drafts.

    python bench/convert_mtp.py MODEL_DIR                       # train (train/smollm2-mtp), then measure
    python bench/convert_mtp.py MODEL_DIR --trained DIR         # measure an already trained directory
    python bench/convert_mtp.py MODEL_DIR --minutes 4 --prompts 32 --out bench/results/convert_mtp.json

Training: `glm5.distill.mtp.train_mtp_self` (the model's greedy answers to `--self-prompts` prompts of the
bundled chat training set, then the packaged config `train/smollm2-mtp` on them: frozen trunk, closed-form
fit of the MTP layer), within `--minutes`, resumable in `--work` (default `runs/bench-convert-mtp`). Prompts: the user turns of the bundled held-out chat set
(glm5/data/assets/sft/heldout.jsonl.gz, never trained on), every n-th so that every task is in, rendered
with the model's chat template. Everything is greedy (temperature 0), fp32, through `glm5.LLM`:
  * acceptance: `--prompts` prompts batched, `speculative_num_tokens` k = 1 and 2, the engine's own
    counters (`get_stats()`: spec_acceptance_rate = accepted / proposed drafts, and per draft position);
  * identical: those outputs against the same prompts without speculation (token ids, every prompt);
  * speed: `--speed-prompts` prompts one at a time (max_num_seqs = 1), decode tokens/s = generated tokens
    after the first / (last token time - first token time), per k, and the ratio to k = 0.
`--prompt-lookup N` (default 3) also measures both with the drafts corrected by prompt lookup
(`prompt_lookup_max = N`, keys prefixed `lookup_`). `--baseline` also measures the acceptance of MODEL_DIR's MTP layer as converted (untrained).
`run(model_dir, ...) -> dict` is what bench/convert.py calls.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from glm5 import LLM, SamplingParams  # noqa: E402
from glm5.core.resources import bundled  # noqa: E402
from glm5.distill.mtp import train_mtp_self  # noqa: E402


def heldout_prompts(n: int) -> list[list[dict]]:
    """The first user turn of `n` held-out conversations, evenly spread over the file (all its tasks)."""
    with gzip.open(bundled("sft/heldout.jsonl.gz"), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    step = max(1, len(rows) // n)
    return [[next(m for m in r["messages"] if m["role"] == "user")] for r in rows[::step][:n]]


def _engine(path: Path, k: int, seqs: int, lookup: int = 0) -> LLM:
    return LLM(str(path), dtype="float32", speculative_num_tokens=k, max_num_seqs=seqs, prompt_lookup_max=lookup)


def generate(path: Path, k: int, prompts: list[list[int]], max_tokens: int, seqs: int,
             warm_up: bool = False, lookup: int = 0) -> tuple[list, dict, float]:
    """-> (token ids per prompt, engine stats, decode tokens/s over the requests). `warm_up`: one short
    request first (kernels, caches) for timing; its drafts then count in the engine's acceptance stats.
    `lookup`: prompt_lookup_max (MTP drafts corrected by prompt lookup; 0 = MTP alone)."""
    llm = _engine(path, k, seqs, lookup)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    if warm_up:
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))
    outs = llm.generate(prompts, sp)
    stats = llm.engine.get_stats()
    ids = [list(o.outputs[0].token_ids) for o in outs]
    tokens, seconds = 0, 0.0
    for o in outs:
        m = o.metrics
        if m and m.first_token_time is not None and m.last_token_time is not None and m.num_generation_tokens > 1:
            tokens += m.num_generation_tokens - 1
            seconds += m.last_token_time - m.first_token_time
    return ids, stats, tokens / seconds if seconds else 0.0


def acceptance(path: Path, prompts, max_tokens: int, plain: list | None = None, lookup: int = 0) -> dict:
    """Acceptance at k = 1, 2 with `prompts` batched; identical outputs against `plain` (k = 0). Keys get a
    `lookup_` prefix when prompt lookup corrects the drafts."""
    out = {}
    pre = "lookup_" if lookup else ""
    for k in (1, 2):
        ids, st, _ = generate(path, k, prompts, max_tokens, len(prompts), lookup=lookup)
        out[f"{pre}acceptance_k{k}"] = round(st["spec_acceptance_rate"], 4)
        out[f"{pre}acceptance_k{k}_per_position"] = [round(x, 4) for x in st["spec_acceptance_per_position"]]
        out[f"{pre}drafts_k{k}"] = int(st["spec_num_draft_tokens"])
        if lookup:
            out[f"{pre}changed_drafts_k{k}"] = int(st["spec_num_lookup_draft_tokens"])
        if plain is not None:
            out[f"{pre}identical_k{k}"] = sum(a == b for a, b in zip(ids, plain))
    return out


def run(model_dir: str | Path, trained: str | Path | None = None, work: str | Path = "runs/bench-convert-mtp",
        minutes: float = 4.0, prompts: int = 32, max_tokens: int = 64, speed_prompts: int = 4,
        threads: int = 0, baseline: bool = False, train_overrides: list[str] = (), self_prompts: int = 96,
        lookup: int = 3, log=print) -> dict:
    """Train (unless `trained` is given) and measure; returns a flat JSON-able dict (see the module doc)."""
    if threads:
        torch.set_num_threads(threads)
    model_dir, work = Path(model_dir), Path(work)
    res: dict = {"model": str(model_dir), "threads": torch.get_num_threads()}
    if trained is None:
        t0 = time.monotonic()
        overrides = [f"--train.num_threads={threads}"] if threads else []
        trained = train_mtp_self(model_dir, work / "trained", minutes=minutes, prompts=self_prompts,
                                 max_tokens=max_tokens, log=log, work=work / "run",
                                 overrides=[*overrides, *train_overrides])
        res["train_minutes"] = round((time.monotonic() - t0) / 60, 2)  # the answers, the fit, any steps, the write
        res["train_minutes_limit"] = minutes
        res["self_answer_prompts"] = self_prompts
        res.update(_train_record(work / "run" / "train" / "metrics.jsonl"))
    trained = Path(trained)
    res["trained"] = str(trained)
    tok = _engine(trained, 0, 1).tokenizer
    chats = heldout_prompts(prompts)
    ids = [tok.apply_chat_template(c, add_generation_prompt=True) for c in chats]
    res.update(prompts=len(ids), max_tokens=max_tokens)
    log(f"measuring {trained}: {len(ids)} held-out prompts x {max_tokens} tokens, greedy")
    plain, _, _ = generate(trained, 0, ids, max_tokens, len(ids))
    res["generated_tokens"] = sum(len(p) for p in plain)
    res.update(acceptance(trained, ids, max_tokens, plain))
    if lookup:
        res["prompt_lookup_max"] = lookup
        res.update(acceptance(trained, ids, max_tokens, plain, lookup=lookup))
    if baseline:
        base = acceptance(model_dir, ids, max_tokens)
        res.update({f"untrained_{k}": v for k, v in base.items() if k.startswith("acceptance_k") and "per" not in k})
    speed = {}
    outs = {}
    runs = [(0, 0), (1, 0), (2, 0)] + ([(1, lookup), (2, lookup)] if lookup else [])
    for k, n in runs:
        key = f"{'lookup_' if n else ''}k{k}"
        outs[key], _, speed[key] = generate(trained, k, ids[:speed_prompts], max_tokens, 1, warm_up=True, lookup=n)
        res[f"tok_s_{key}"] = round(speed[key], 2)
    res["speed_prompts"] = min(speed_prompts, len(ids))
    for key in speed:
        if key != "k0":
            res[f"speedup_{key}"] = round(speed[key] / speed["k0"], 3) if speed["k0"] else None
            res[f"identical_batch1_{key}"] = sum(a == b for a, b in zip(outs[key], outs["k0"]))
    log(json.dumps(res))
    return res


def _train_record(path: Path) -> dict:
    """The training run's last step metrics and its final validation numbers (metrics.jsonl)."""
    if not path.is_file():
        return {}
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in recs if "mtp_loss" in r]
    final = next((r for r in reversed(recs) if r.get("event") == "final"), {})
    init = next((r for r in recs if r.get("event") == "mtp_init"), {})
    out = {"train_steps": steps[-1]["step"] if steps else 0,
           "fit_positions": init.get("positions", 0), "fit_seconds": round(init.get("seconds", 0.0), 1)}
    for key in ("val_mtp_loss", "val_mtp_agree"):
        if key in final:
            out[key] = round(final[key], 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--trained", default=None, help="an MTP-trained directory to measure (skips training)")
    ap.add_argument("--work", default="runs/bench-convert-mtp")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--speed-prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--self-prompts", type=int, default=96, help="prompts the model answers for its training data")
    ap.add_argument("--baseline", action="store_true", help="also the untrained MTP layer's acceptance")
    ap.add_argument("--prompt-lookup", type=int, default=3,
                    help="also measure MTP drafts corrected by prompt lookup (prompt_lookup_max; 0 = skip)")
    ap.add_argument("--out", default=None)
    args, overrides = ap.parse_known_args()
    res = run(args.model_dir, args.trained, args.work, args.minutes, args.prompts, args.max_tokens,
              args.speed_prompts, args.threads, args.baseline, overrides, args.self_prompts, args.prompt_lookup)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
