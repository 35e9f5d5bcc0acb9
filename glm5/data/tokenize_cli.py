"""`glm5 data tokenize`: JSONL(.gz) documents -> tokenised memmap shards (see `shards.py`).

Reads the bundled corpus or the cleaned shards of `glm5 data run` (fields `text`, `source`, `lang`,
`domain`, optional `quality`), encodes in batches (multithreaded in Rust), appends `<|endoftext|>` and
writes one shard directory per split. The shard meta records the special-token ids and the ids of
sentence-ending tokens, so that the loader needs no tokenizer.
Run: `glm5 data tokenize --config configs/data/tokenize.toml`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from glm5.core.config import load_cli_config, to_dict
from glm5.core.io import atomic_dir
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


def tokenize_split(tokenizer: GLMTokenizer, inputs: list[str], out_dir: Path, cfg: TokenizeConfig,
                   meta: dict) -> dict:
    writer = ShardWriter(out_dir, tokenizer.vocab_size, meta, cfg.max_tokens_per_part)
    batch = []

    def flush():
        for doc, ids in zip(batch, tokenizer.encode_batch([d["text"] for d in batch])):
            if cfg.append_eos:
                ids.append(tokenizer.eos_token_id)
            writer.add(ids, doc.get("source", ""), doc.get("lang", ""), doc.get("domain", ""))
        batch.clear()

    for doc in iter_docs(inputs, cfg.min_quality):
        batch.append(doc)
        if len(batch) >= cfg.batch_docs:
            flush()
    flush()
    return writer.close()


def run(cfg: TokenizeConfig) -> dict[str, dict]:
    tokenizer = load_tokenizer(cfg.tokenizer)
    digest = hashlib.sha256(tokenizer.tok.to_str().encode()).hexdigest()[:16]
    meta = {"tokenizer_source": str(cfg.tokenizer), "tokenizer_sha256": digest,
            "special_tokens": tokenizer.special_tokens,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
            "append_eos": cfg.append_eos, "sentence_end_ids": sentence_end_ids(tokenizer),
            "config": to_dict(cfg)}
    summary = {}
    for split, inputs in cfg.splits.items():
        final = Path(cfg.output).resolve() / split
        # The tokenizer travels with its shards (a model must use the tokenizer its data was made with).
        meta["tokenizer"] = str(final / "tokenizer")
        with atomic_dir(final) as tmp:
            tokenizer.save(tmp / "tokenizer")
            m = tokenize_split(tokenizer, inputs, tmp, cfg, meta)
        summary[split] = {"docs": m["num_docs"], "tokens": m["num_tokens"], "dtype": m["dtype"],
                          "domains": m["categories"]["domain"]}
    return summary


def main(argv: list[str] | None = None) -> int:
    cfg = load_cli_config(TokenizeConfig, argv, "glm5 data tokenize", __doc__.splitlines()[0],
                          "configs/data/tokenize.toml")
    print(json.dumps(run(cfg), ensure_ascii=False))
    return 0
