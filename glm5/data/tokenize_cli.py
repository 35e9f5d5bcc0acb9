"""`glm5 data tokenize`: JSONL(.gz) documents -> tokenised memmap shards (see `shards.py`).

Reads the bundled corpus or the cleaned shards of `glm5 data run` (fields `text`, `source`, `lang`,
`domain`, optional `quality`), encodes in batches (multithreaded in Rust), appends `<|endoftext|>` and
writes one shard directory per split. The shard meta records the special-token ids and the ids of
sentence-ending tokens, so that the loader needs no tokenizer.
Run: `glm5 data tokenize --config configs/data/tokenize.toml`.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from glm5.core.config import load_cli_config, to_dict
from glm5.core.io import atomic_dir
from glm5.data.pipeline.executor import Executor, ExecutorConfig, make_executor
from glm5.data.shards import ShardWriter
from glm5.data.tokenizer import GLMTokenizer, load_tokenizer
from glm5.data.tokenizer_cli import expand_inputs

SENTENCE_END = (".", "!", "?", "。", "！", "？", "；", ";")


@dataclass(kw_only=True)
class TokenizeConfig:
    """What to tokenise and where to write it."""

    splits: dict[str, list[str]] = field(default_factory=lambda: {
        "train": ["bundled:corpus/train.jsonl.gz"], "validation": ["bundled:corpus/validation.jsonl.gz"]})
    """Split name -> JSONL(.gz) files or directories; each split becomes `<output>/<split>/`."""
    output: str = "runs/data/tokens"
    """Parent directory of the split shard directories."""
    tokenizer: str = "bundled:tokenizer-8k"
    """Tokenizer directory (`bundled:tokenizer-8k` = the one shipped in the package)."""
    append_eos: bool = True
    """End every document with <|endoftext|>."""
    min_quality: float = 0.0
    """Skip documents whose `quality` field (cleaning pipeline) is below this."""
    batch_docs: int = 256
    """Documents per encode batch."""
    max_tokens_per_part: int = 1 << 27
    """Roll over to a new part file after this many tokens."""
    run: ExecutorConfig = field(default_factory=lambda: ExecutorConfig(num_workers=1))
    """Where the encode batches run (`--run.executor=ray`, `--run.num_workers=N`); the shards are the same."""


def sentence_end_ids(tokenizer: GLMTokenizer) -> list[int]:
    """Ids of tokens whose text ends a sentence (used by the [sMASK] objective)."""
    out = []
    for i in range(tokenizer.vocab_size):
        if i in tokenizer.all_special_ids.values():
            continue
        text = tokenizer.token_bytes(i).decode("utf-8", errors="ignore").rstrip()
        if text.endswith(SENTENCE_END):
            out.append(i)
    return out


def iter_docs(inputs: list[str], min_quality: float):
    for path in expand_inputs(inputs):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                doc = json.loads(line)
                if doc.get("quality", 1.0) >= min_quality and doc.get("text"):
                    yield doc


@functools.lru_cache(maxsize=2)
def _cached_tokenizer(path: str) -> GLMTokenizer:
    return load_tokenizer(path)


def encode_texts(tokenizer: str, texts: list[str]) -> list[list[int]]:
    """One encode job: token ids of `texts` (the tokenizer is loaded once per worker process)."""
    return _cached_tokenizer(tokenizer).encode_batch(texts)


def tokenize_split(tokenizer: GLMTokenizer, inputs: list[str], out_dir: Path, cfg: TokenizeConfig,
                   meta: dict, executor: Executor) -> dict:
    """Encode batches of `batch_docs` documents as executor jobs, a window of them at a time, and write
    them in input order (so the shards do not depend on the executor or the worker count)."""
    writer = ShardWriter(out_dir, tokenizer.vocab_size, meta, cfg.max_tokens_per_part)
    window = 4 * (cfg.run.num_workers or os.cpu_count() or 1)
    batches: list[list[dict]] = [[]]
    done = 0

    def flush():
        nonlocal done
        full = [b for b in batches if b]
        names = [f"tokenize batch {done + k}" for k in range(len(full))]
        encoded = executor.map(encode_texts, [(cfg.tokenizer, [d["text"] for d in b]) for b in full], names,
                               "tokenize")
        for batch, ids_list in zip(full, encoded):
            for doc, ids in zip(batch, ids_list):
                if cfg.append_eos:
                    ids.append(tokenizer.eos_token_id)
                writer.add(ids, doc.get("source", ""), doc.get("lang", ""), doc.get("domain", ""))
        done += len(full)
        batches[:] = [[]]

    for doc in iter_docs(inputs, cfg.min_quality):
        if len(batches[-1]) >= cfg.batch_docs:
            if len(batches) >= window:
                flush()
            else:
                batches.append([])
        batches[-1].append(doc)
    flush()
    return writer.close()


def run(cfg: TokenizeConfig) -> dict[str, dict]:
    tokenizer = load_tokenizer(cfg.tokenizer)
    digest = hashlib.sha256(tokenizer.tok.to_str().encode()).hexdigest()[:16]
    meta = {"tokenizer_source": str(cfg.tokenizer), "tokenizer_sha256": digest,
            "special_tokens": tokenizer.special_tokens,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
            "append_eos": cfg.append_eos, "sentence_end_ids": sentence_end_ids(tokenizer),
            "config": {k: v for k, v in to_dict(cfg).items() if k != "run"}}  # run: where, not what
    executor = make_executor(cfg.run)
    try:
        summary = _run_splits(cfg, tokenizer, meta, executor)
    finally:
        executor.close()
    return summary


def _run_splits(cfg: TokenizeConfig, tokenizer: GLMTokenizer, meta: dict, executor: Executor) -> dict[str, dict]:
    summary = {}
    for split, inputs in cfg.splits.items():
        final = Path(cfg.output).resolve() / split
        # The tokenizer travels with its shards (a model must use the tokenizer its data was made with).
        meta["tokenizer"] = str(final / "tokenizer")
        with atomic_dir(final) as tmp:
            tokenizer.save(tmp / "tokenizer")
            m = tokenize_split(tokenizer, inputs, tmp, cfg, meta, executor)
        summary[split] = {"docs": m["num_docs"], "tokens": m["num_tokens"], "dtype": m["dtype"],
                          "domains": m["categories"]["domain"]}
    return summary


def main(argv: list[str] | None = None) -> int:
    cfg = load_cli_config(TokenizeConfig, argv, "glm5 data tokenize", __doc__.splitlines()[0],
                          "configs/data/tokenize.toml")
    print(json.dumps(run(cfg), ensure_ascii=False))
    return 0
