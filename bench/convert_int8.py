"""INT8 weight-only quantisation on the converted SmolLM2 (the embedded model): quality, speed, memory.

    python bench/convert_int8.py                       # the embedded model (built first if needed)
    python bench/convert_int8.py --model DIR --windows 16 --rounds 3 --out bench/results/convert_int8.json
    python bench/convert_int8.py --group-sizes 64,128                  # grouped expert scales too

Same run, same machine, fp32 against `glm5.infer.quant.quantize_model` (int8 per output channel, routed
experts per expert and channel; router, indexer and kv_b_proj kept in fp32):
  * quality: perplexity on `--windows` windows of 512 tokens of the bundled validation corpus (never trained
    on by SmolLM2's converter; teacher-forced, the model's own forward), its relative change, the share of
    positions whose argmax changes (target: perplexity within +1 %);
  * speed: batch-1 engine decode tokens/s (64 tokens after a 64-token prompt), fp32 and INT8 alternated
    `--rounds` times (the shared machine's load moves; the per-round ratios are reported);
  * memory: bytes of parameters and buffers;
  * the same quality, speed and memory with grouped expert scales (`int8_expert_group_size`) for each of
    `--group-sizes`.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import alternate, engine_decode_tok_s, median, ratio_stats  # noqa: E402

from glm5.core.resources import bundled  # noqa: E402
from glm5.data.tokenizer import load_tokenizer  # noqa: E402
from glm5.infer import quant  # noqa: E402
from glm5.model.hf_adapter import from_pretrained  # noqa: E402


def windows(tok, n: int, size: int = 512) -> torch.Tensor:
    """[n, size + 1] token windows of the bundled validation corpus (documents joined with EOS)."""
    ids: list[int] = []
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    with gzip.open(bundled("corpus/validation.jsonl.gz"), "rt", encoding="utf-8") as f:
        for line in f:
            ids += tok.encode(json.loads(line)["text"]) + [eos]
            if len(ids) >= n * (size + 1):
                break
    n = min(n, len(ids) // (size + 1))
    return torch.tensor(ids[: n * (size + 1)]).view(n, size + 1)


@torch.inference_mode()
def nll_argmax(m, data: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Mean NLL (nats/token) and the argmax per position, teacher-forced."""
    x, y = data[:, :-1], data[:, 1:]
    total, argmax = 0.0, []
    for i in range(x.shape[0]):
        logits = m(x[i:i + 1]).logits[0].float()  # [T, V]
        total += float(torch.nn.functional.cross_entropy(logits, y[i], reduction="sum"))
        argmax.append(logits.argmax(-1))
    return total / y.numel(), torch.cat(argmax)


def quality(ref: tuple[float, torch.Tensor], qmodel, data: torch.Tensor) -> dict:
    nll, argmax = nll_argmax(qmodel, data)
    return {"tokens": argmax.numel(), "ppl_fp32": round(math.exp(ref[0]), 4), "ppl_int8": round(math.exp(nll), 4),
            "ppl_change_pct": round(100 * (math.exp(nll - ref[0]) - 1), 3),
            "argmax_flip_rate": round(float((argmax != ref[1]).float().mean()), 4), "target_ppl_change_pct": 1.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a converted checkpoint (default: the embedded model)")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--group-sizes", default="", help="also grouped expert scales of these sizes (comma list)")
    ap.add_argument("--out", default="bench/results/convert_int8.json")
    args = ap.parse_args()
    if args.model is None:
        from glm5.apps.embedded import embedded_model

        args.model = str(embedded_model())
    model = from_pretrained(args.model, dtype=torch.float32).eval()
    tok = load_tokenizer(args.model)
    data = windows(tok, args.windows)
    prompt = data[0, :64].tolist()
    ref = nll_argmax(model, data)
    fp = quant.weight_bytes(model)
    res = {"model": args.model, "threads": torch.get_num_threads(), "fp32_weight_mb": round(fp / 2**20, 1)}
    for gs in [None] + [int(g) for g in args.group_sizes.split(",") if g]:
        qmodel = quant.quantize_model(copy.deepcopy(model), expert_group_size=gs).eval()
        row = {"quality": quality(ref, qmodel, data)}
        runs = alternate({"int8": lambda: engine_decode_tok_s(qmodel, prompt, args.decode_tokens),
                          "fp32": lambda: engine_decode_tok_s(model, prompt, args.decode_tokens)}, args.rounds)
        row["speed"] = {"rounds": args.rounds, "fp32_decode_tok_s": round(median(runs["fp32"], 0), 2),
                        "int8_decode_tok_s": round(median(runs["int8"], 0), 2),
                        "speedup": {k: round(v, 3) for k, v in ratio_stats(runs["int8"], runs["fp32"], 0).items()}}
        q = quant.weight_bytes(qmodel)
        row["memory"] = {"int8_weight_mb": round(q / 2**20, 1), "ratio": round(q / fp, 3)}
        key = "per_channel" if gs is None else f"expert_groups_{gs}"
        res[key] = row
        print(json.dumps({key: row}), flush=True)
        del qmodel
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
