"""Train the DSA lightning indexers of a checkpoint on its frozen trunk: `train_indexers(model_dir, out_dir)`.

The programmatic form of `glm5 train --config train/smollm2-indexer --model.name=MODEL_DIR`: the dense KL
warm-up of GLM-5 / DeepSeek-V3.2 (only the indexers learn, `train.trainable = "indexer"`) run by the
pretraining `Trainer` (progress, checkpoints, `resume = "auto"` continues an interrupted run), on text
tokenised with the checkpoint's own tokenizer (the bundled corpus unless `data_dir` already holds shards).
`out_dir` is then written atomically: the model's `save_pretrained`, and the tokenizer files and
`generation_config.json` copied from `model_dir` as they are.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from glm5.core.config import load_config
from glm5.core.io import atomic_dir
from glm5.data.tokenize_cli import TokenizeConfig
from glm5.data.tokenize_cli import run as tokenize
from glm5.data.tokenizer import copy_tokenizer_files, load_tokenizer
from glm5.model.hf_adapter import save_pretrained

from .config import TrainConfig
from .trainer import Trainer

CONFIG = "train/smollm2-indexer"


def tokenizer_digest(model_dir: str | Path) -> str:
    """The digest `glm5 data tokenize` records in its shards' meta (`tokenizer_sha256`) for this tokenizer."""
    return hashlib.sha256(load_tokenizer(str(model_dir)).tok.to_str().encode()).hexdigest()[:16]


def prepare_tokens(model_dir: str | Path, data_dir: str | Path, corpus: dict[str, list[str]] | None = None) -> Path:
    """`data_dir/{train,validation}`: `corpus` (split -> JSONL(.gz) files; default the bundled corpus)
    tokenised with `model_dir`'s tokenizer, written once (`glm5 data tokenize --tokenizer=MODEL_DIR
    --output=DATA_DIR`). Existing shards made with another tokenizer are refused (their ids would mean
    other tokens to this model)."""
    data_dir = Path(data_dir)
    want = tokenizer_digest(model_dir)
    metas = [data_dir / split / "meta.json" for split in ("train", "validation")]
    if not all(m.is_file() for m in metas):
        splits = {"splits": corpus} if corpus is not None else {}
        tokenize(TokenizeConfig(tokenizer=str(model_dir), output=str(data_dir), **splits))
    for meta in metas:
        got = json.loads(meta.read_text()).get("tokenizer_sha256")
        if got != want:
            raise ValueError(f"{meta.parent} was tokenised with another tokenizer (tokenizer_sha256 {got}, "
                             f"{model_dir} has {want}): tokenise again into another data_dir")
    return data_dir


def write_checkpoint(model, source_dir: str | Path, out_dir: str | Path) -> Path:
    """`out_dir` atomically: `save_pretrained(model)` + the tokenizer files and generation_config.json of
    `source_dir` copied verbatim (the checkpoint the model was trained from)."""
    source_dir = Path(source_dir)
    with atomic_dir(out_dir) as tmp:
        save_pretrained(model, tmp)
        copy_tokenizer_files(source_dir, tmp, extra=("generation_config.json",))
    return Path(out_dir)


def train_indexers(model_dir: str | Path, out_dir: str | Path, *, data_dir: str | Path | None = None,
                   corpus: dict[str, list[str]] | None = None, run_dir: str | Path | None = None,
                   config: str = CONFIG, overrides: list[str] | tuple = (), resume: str = "auto") -> dict:
    """Train `model_dir`'s indexers on its frozen trunk and write the result to `out_dir` (see the module doc).

    `data_dir`: tokenised shards (default `<out_dir>.tokens`, made from `corpus` when absent, see
    `prepare_tokens`);
    `run_dir`: the run's metrics and checkpoints (default `<out_dir>.run`); `overrides`: more
    `--section.key=value` settings on top of `config`. Returns the run's numbers: `steps`, `train_s` (the
    optimizer steps' wall time, this process), `fit_s` (`Trainer.fit`: + checkpoints, the final evaluation
    and `run_dir/final`), `indexer_kl` per step (this process), the final `val_loss` (LM loss at the
    written `index_topk`) and `out_dir`."""
    out_dir = Path(out_dir)
    data_dir = prepare_tokens(model_dir, data_dir or out_dir.with_name(out_dir.name + ".tokens"), corpus)
    run_dir = Path(run_dir or out_dir.with_name(out_dir.name + ".run"))
    cfg = load_config(TrainConfig, config, [
        f"--model.name={json.dumps(str(model_dir))}",
        f"--data.train_path={json.dumps(str(data_dir / 'train'))}",
        f"--data.val_path={json.dumps(str(data_dir / 'validation'))}",
        f"--log.run_dir={json.dumps(str(run_dir))}",
        f"--checkpoint.resume={json.dumps(resume)}", *overrides])
    if cfg.train.trainable != "indexer":
        raise ValueError(f"train_indexers trains the indexers only: train.trainable must be 'indexer', "
                         f"got {cfg.train.trainable!r}")
    trainer = Trainer(cfg)
    start_step = trainer.step
    t0 = time.monotonic()
    summary = trainer.fit()
    fit_s = time.monotonic() - t0
    write_checkpoint(trainer.raw_model, model_dir, out_dir)
    history = [h for h in trainer.history if "indexer_kl" in h]
    return {"out_dir": str(out_dir), "run_dir": str(run_dir), "data_dir": str(data_dir),
            "steps": trainer.step, "resumed_at": start_step, "train_s": sum(h["step_s"] for h in history),
            "fit_s": fit_s, "indexer_kl": [h["indexer_kl"] for h in history],
            "index_topk": trainer.raw_model.config.index_topk, "num_threads": trainer.num_threads, **summary}
