"""Tokenised shards: documents as token ids in flat `np.memmap` files plus a document index.

Layout of a shard directory (written by `glm5 data tokenize`, read by the loader):
  meta.json            dtype, vocab_size, special-token ids, sentence-end ids, category names, parts
  part-00000.bin       all token ids of the part's documents back to back (uint16 if vocab < 65536)
  part-00000.idx.npz   offsets [N+1] int64, and source/lang/domain codes [N] int16 (names in meta)
  tokenizer/           a copy of the tokenizer that made the shards (meta["tokenizer"] = its path)
Documents end with `<|endoftext|>` when `append_eos` (the default). Knows nothing about tokenizers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from glm5.core.io import atomic_write_json

CATEGORIES = ("source", "lang", "domain")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size < 65536 else np.uint32)


class ShardWriter:
    """Append documents, then `close()`; parts roll over every `max_tokens_per_part` tokens."""

    def __init__(self, out_dir: str | Path, vocab_size: int, meta: dict | None = None,
                 max_tokens_per_part: int = 1 << 27):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = vocab_size
        self.meta = dict(meta or {})
        self.max_tokens = max_tokens_per_part
        self.names: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
        self.parts: list[dict] = []
        self._open_part()

    def _open_part(self):
        self._name = f"part-{len(self.parts):05d}"
        self._f = open(self.dir / f"{self._name}.bin", "wb")
        self._offsets, self._codes = [0], {c: [] for c in CATEGORIES}

    def _close_part(self):
        self._f.close()
        np.savez(self.dir / f"{self._name}.idx.npz", offsets=np.asarray(self._offsets, dtype=np.int64),
                 **{c: np.asarray(v, dtype=np.int16) for c, v in self._codes.items()})
        self.parts.append({"name": self._name, "num_docs": len(self._offsets) - 1,
                           "num_tokens": self._offsets[-1]})

    def add(self, ids, source: str = "", lang: str = "", domain: str = "") -> None:
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        if self._offsets[-1] and self._offsets[-1] + arr.size > self.max_tokens:
            self._close_part()
            self._open_part()
        self._f.write(arr.astype(self.dtype).tobytes())
        self._offsets.append(self._offsets[-1] + arr.size)
        for cat, value in zip(CATEGORIES, (source, lang, domain)):
            self._codes[cat].append(self.names[cat].setdefault(value, len(self.names[cat])))

    def close(self) -> dict:
        self._close_part()
        meta = {**self.meta, "dtype": self.dtype.name, "vocab_size": self.vocab_size, "parts": self.parts,
                "num_docs": sum(p["num_docs"] for p in self.parts),
                "num_tokens": sum(p["num_tokens"] for p in self.parts),
                "categories": {c: list(names) for c, names in self.names.items()}}
        atomic_write_json(self.dir / "meta.json", meta)
        return meta


class TokenShards:
    """Read-only view of a shard directory: `doc(i)` is a zero-copy memmap slice."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        if not (self.dir / "meta.json").is_file():
            raise FileNotFoundError(f"{self.dir}/meta.json not found: run `glm5 data tokenize` first")
        self.meta = json.loads((self.dir / "meta.json").read_text())
        dtype = np.dtype(self.meta["dtype"])
        self._tokens, part, start, codes = [], [], [], {c: [] for c in CATEGORIES}
        for i, p in enumerate(self.meta["parts"]):
            n = p["num_tokens"]
            self._tokens.append(np.memmap(self.dir / f"{p['name']}.bin", dtype=dtype, mode="r", shape=(n,))
                                if n else np.zeros(0, dtype))
            with np.load(self.dir / f"{p['name']}.idx.npz") as idx:
                offsets = idx["offsets"]
                for c in CATEGORIES:
                    codes[c].append(idx[c])
            part.append(np.full(len(offsets) - 1, i, dtype=np.int32))
            start.append(offsets)
        self.doc_part = np.concatenate(part) if part else np.zeros(0, np.int32)
        self.doc_start = np.concatenate([o[:-1] for o in start]) if start else np.zeros(0, np.int64)
        self.doc_len = np.concatenate([np.diff(o) for o in start]) if start else np.zeros(0, np.int64)
        self.codes = {c: np.concatenate(v) if v else np.zeros(0, np.int16) for c, v in codes.items()}
        self.names = {c: list(self.meta["categories"][c]) for c in CATEGORIES}

    def __len__(self) -> int:
        return len(self.doc_len)

    @property
    def num_tokens(self) -> int:
        return int(self.doc_len.sum())

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self.meta.get("special_tokens", {}))

    @property
    def sentence_end_ids(self) -> list[int]:
        return list(self.meta.get("sentence_end_ids", []))

    def doc(self, i: int) -> np.ndarray:
        s = int(self.doc_start[i])
        return self._tokens[int(self.doc_part[i])][s: s + int(self.doc_len[i])]

    def category(self, i: int, cat: str) -> str:
        return self.names[cat][int(self.codes[cat][i])]

    def groups(self, by: str) -> dict[str, np.ndarray]:
        """Category value -> sorted doc indices (e.g. by="domain")."""
        codes = self.codes[by]
        return {name: np.flatnonzero(codes == k) for k, name in enumerate(self.names[by])
                if np.any(codes == k)}
