"""DSA indexer warm-up of a converted model: held-out perplexity at 2K context, index_topk 256 vs dense, with
the indexer as converted (initialised from the attention's rope queries / keys) and after training it.

    python bench/convert_indexer.py MODEL_DIR                    # train (train/smollm2-indexer), then measure
    python bench/convert_indexer.py MODEL_DIR --trained DIR      # measure an already trained directory
    python bench/convert_indexer.py MODEL_DIR --windows 25 --out bench/results/convert_indexer.json

Training: `glm5.train.indexer_train.train_indexers` (the packaged config: frozen trunk, dense KL warm-up of
the indexers only, one thread), resumable in `--work` (`runs/bench-convert-indexer`). Held-out text: the
bundled corpus' validation split tokenised with the model's own tokenizer; every document of at least
`seq` tokens cut into non-overlapping `seq`-token windows, each attended causally from its first token;
the first `windows` of them. Perplexity is over every predicted token of a window, and over the positions
past `topk` (the only ones where selection changes anything: a query at position t < topk keeps all t+1 of
its keys). Sparse = the model's training forward with `config.index_topk = topk` (`needs_selection`: topk <
keys), the selection applied as a [T, S] mask on dense SDPA (`DENSE_MASK_RATIO` lifted: the same result as
the gathered-latent kernel, tests/test_sparse_attention.py, and 2-3x faster on CPU at T = 2048, K = 256);
`--gather-windows N` also runs N windows through the gathered kernel and reports both.
`run(model_dir, ...) -> dict` is what bench/convert.py calls.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import glm5.model.attention as attention  # noqa: E402
from glm5.core.io import LazyTensors, safetensors_files  # noqa: E402
from glm5.data.shards import TokenShards  # noqa: E402
from glm5.model.hf_adapter import from_pretrained  # noqa: E402
from glm5.train.indexer_train import prepare_tokens, train_indexers  # noqa: E402
from glm5.train.loss import linear_ce_sum  # noqa: E402


def heldout_windows(val_dir: Path, seq: int, windows: int) -> list[np.ndarray]:
    """The first `windows` non-overlapping `seq`-token windows of the documents of >= seq tokens, in order."""
    shards = TokenShards(val_dir)
    out = [shards.doc(i)[k * seq:(k + 1) * seq].astype(np.int64)
           for i in range(len(shards)) if shards.doc_len[i] >= seq for k in range(int(shards.doc_len[i]) // seq)]
    if not out:
        raise ValueError(f"{val_dir} has no document of >= {seq} tokens")
    return out[:windows]


@contextlib.contextmanager
def selection_as_mask(enabled: bool):
    """Apply every selection as a mask on dense SDPA (equal to the gathered kernel; faster on CPU here)."""
    old = attention.DENSE_MASK_RATIO
    if enabled:
        attention.DENSE_MASK_RATIO = 1 << 30
    try:
        yield
    finally:
        attention.DENSE_MASK_RATIO = old


@torch.no_grad()
def perplexity(model, windows: list[np.ndarray], index_topk: int, past: int, masked: bool = True) -> dict:
    """Perplexity of `model` over the windows with `config.index_topk = index_topk` (restored afterwards): over
    every predicted token (`ppl`) and over positions >= `past` (`ppl_past_topk`)."""
    old = model.config.index_topk
    model.config.index_topk = index_topk
    nll = late = 0.0
    n = n_late = 0
    t0 = time.perf_counter()
    try:
        with selection_as_mask(masked):
            for w in windows:
                ids = torch.from_numpy(w)[None]
                labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
                h = model(ids, logits_to_keep=1).hidden_states
                per_token = [float(linear_ce_sum(h[:, a:b], model.lm_head.weight, labels[:, a:b]))
                             for a, b in ((0, past), (past, ids.shape[1]))]
                nll += sum(per_token)
                late += per_token[1]
                n += ids.shape[1] - 1
                n_late += ids.shape[1] - 1 - past
    finally:
        model.config.index_topk = old
    return {"ppl": math.exp(nll / n), "ppl_past_topk": math.exp(late / n_late), "tokens": n,
            "seconds": round(time.perf_counter() - t0, 1)}


def trunk_unchanged(model_dir: Path, trained_dir: Path) -> dict:
    """Which tensors training changed: every changed one must be an indexer's."""
    a, b = LazyTensors(safetensors_files(model_dir)), LazyTensors(safetensors_files(trained_dir))
    changed = [k for k in a.keys() if not torch.equal(a.get(k), b.get(k))]
    return {"tensors_changed": len(changed), "only_indexers_changed": all(".indexer." in k for k in changed)}


def run(model_dir: str | Path, trained_dir: str | Path | None = None, *, work_dir: str | Path | None = None,
        windows: int = 8, seq: int = 2048, topk: int = 256, threads: int = 1, gather_windows: int = 0,
        overrides: list[str] | tuple = ()) -> dict:
    """Train `model_dir`'s indexers (unless `trained_dir` is given) and measure dense / sparse perplexity."""
    torch.set_num_threads(threads)
    model_dir = Path(model_dir)
    with contextlib.ExitStack() as stack:
        work = Path(work_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-idx-")))
        data_dir = prepare_tokens(model_dir, work / "tokens")
        out: dict = {"seq": seq, "topk": topk, "threads": threads}
        if trained_dir is None:
            trained_dir = work / "indexer"
            res = train_indexers(model_dir, trained_dir, data_dir=data_dir, run_dir=work / "run",
                                 overrides=[f"--train.num_threads={threads}", *overrides])
            kl = res["indexer_kl"]
            out.update(steps=res["steps"], resumed_at=res["resumed_at"], train_s=round(res["train_s"], 1),
                       fit_s=round(res["fit_s"], 1), indexer_kl_first=kl[0] if kl else None,
                       indexer_kl_last=kl[-1] if kl else None, indexer_kl=[round(k, 4) for k in kl],
                       val_loss_sparse=res.get("val_loss"))
        trained_dir = Path(trained_dir)
        out.update(trunk_unchanged(model_dir, trained_dir))
        wins = heldout_windows(data_dir / "validation", seq, windows)
        out["windows"] = len(wins)
        base = from_pretrained(model_dir).eval()
        dense = perplexity(base, wins, 1 << 62, topk)
        untrained = perplexity(base, wins, topk, topk)
        del base
        trained_model = from_pretrained(trained_dir).eval()
        trained = perplexity(trained_model, wins, topk, topk)
        if gather_windows:
            few = wins[:gather_windows]
            out["gather_check"] = {"windows": len(few), "masked": perplexity(trained_model, few, topk, topk)["ppl"],
                                   "gathered": perplexity(trained_model, few, topk, topk, masked=False)["ppl"]}
        out.update(ppl_dense=dense["ppl"], ppl_sparse_untrained=untrained["ppl"], ppl_sparse_trained=trained["ppl"],
                   sparse_trained_vs_dense=trained["ppl"] / dense["ppl"] - 1,
                   sparse_untrained_vs_dense=untrained["ppl"] / dense["ppl"] - 1,
                   ppl_past_topk={"dense": dense["ppl_past_topk"], "sparse_untrained": untrained["ppl_past_topk"],
                                  "sparse_trained": trained["ppl_past_topk"]},
                   tokens=dense["tokens"], eval_s={"dense": dense["seconds"], "sparse_untrained": untrained["seconds"],
                                                   "sparse_trained": trained["seconds"]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", help="a converted checkpoint (glm5 convert --from-llama ...)")
    ap.add_argument("--trained", default=None, help="an already trained directory: measure only")
    ap.add_argument("--work", default="runs/bench-convert-indexer", help="tokens, run (resumable), trained model")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gather-windows", type=int, default=0)
    ap.add_argument("--out", default="bench/results/convert_indexer.json")
    args, overrides = ap.parse_known_args()  # the rest: --section.key=value for the training config
    res = run(args.model_dir, args.trained, work_dir=args.work, windows=args.windows, seq=args.seq, topk=args.topk,
              threads=args.threads, gather_windows=args.gather_windows, overrides=overrides)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
