"""JSONL(.gz) shard I/O: streaming readers, atomic deterministic writers, input sharding (executor jobs).

Writers go to a temporary sibling and `os.replace` into place, so a crash never leaves a half-written
shard; gzip headers carry no mtime or name, so identical content gives identical bytes.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from glm5.core.io import atomic_write_json
from glm5.core.resources import resolve_path

if TYPE_CHECKING:
    from .executor import Executor


def open_text(path: str | Path):
    path = str(path)
    if "://" in path:  # fsspec URL (see expand_inputs)
        import fsspec

        return fsspec.open(path, "rt", encoding="utf-8", compression="gzip" if path.endswith(".gz") else None).open()
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def read_jsonl(path: str | Path) -> Iterator[dict]:
    with open_text(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def write_jsonl(path: str | Path, docs: Iterable[dict]) -> int:
    """Atomically write `docs` as (gzip if `.gz`) JSONL; returns the number written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    n = 0
    try:
        with os.fdopen(fd, "wb") as raw:
            sink = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) if path.suffix == ".gz" else raw
            for d in docs:
                sink.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))
                n += 1
            if sink is not raw:
                sink.close()  # writes the gzip trailer; does not close `raw`
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return n


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files and globs -> existing files, each pattern's matches sorted. `bundled:corpus/train.jsonl.gz`
    names the packaged corpus; a URL (`s3://...`, `gs://...`, `memory://...`) is read through fsspec
    (installed apart; any filesystem it supports). A pattern matching nothing is an error naming it."""
    files: list[str] = []
    for p in map(str, patterns):
        if "://" in p:
            fs, matches = _fsspec_glob(p)
        else:
            p = str(resolve_path(p))
            matches = sorted(glob.glob(p)) if any(c in p for c in "*?[") else [p] if Path(p).is_file() else []
        if not matches:
            raise FileNotFoundError(f"input {'pattern' if any(c in p for c in '*?[') else 'file'} {p!r} "
                                    "matches no file")
        files += matches
    return files


def _fsspec_glob(url: str) -> tuple[object, list[str]]:
    """(filesystem, sorted matching URLs) of an fsspec URL or URL glob."""
    try:
        import fsspec
    except ImportError:
        raise FileNotFoundError(f"input {url!r}: reading URLs needs fsspec (pip install fsspec)") from None
    fs, _, _ = fsspec.get_fs_token_paths(url)
    paths = sorted(fs.glob(url)) if any(c in url for c in "*?[") else [url] if fs.isfile(url) else []
    return fs, [fs.unstrip_protocol(p) for p in paths]


def make_input_shards(patterns: list[str], text_key: str, shard_docs: int, out_dir: Path, limit: int,
                      executor: Executor) -> dict:
    """Split the inputs into `out_dir/input-FFFFF-NNNNN.jsonl.gz` shards of `shard_docs` documents: one
    executor job per input file (FFFFF; its last shard may be shorter), or, with a `limit`, one job over
    all files (the first `limit` documents). Shards are listed in input order, so the global document
    order is the files' order whatever the executor.

    Idempotent: `out_dir/manifest.json` is written last and, if present, the sharding is not redone.
    Documents missing an `id` get `<file stem>/<line number>`; `text_key` is renamed to `text`.
    """
    manifest = out_dir / "manifest.json"
    if manifest.is_file():
        return json.loads(manifest.read_text())
    files = expand_inputs(patterns)
    groups = [files] if limit else [[f] for f in files]
    parts = executor.map(shard_files, [(g, text_key, shard_docs, out_dir / f"input-{k:05d}", limit)
                                       for k, g in enumerate(groups)],
                         [f"input sharding of {g[0]}" + (f" (+{len(g) - 1} files)" if len(g) > 1 else "")
                          for g in groups], "input sharding")
    shards = [s for p in parts for s in p]
    info = {"num_docs": sum(s["num_docs"] for s in shards), "shards": shards}
    atomic_write_json(manifest, info)
    return info


def shard_files(files: list[str], text_key: str, shard_docs: int, prefix: Path, limit: int) -> list[dict]:
    """One sharding job: stream `files` (at most `limit` documents, 0 = all) into `<prefix>-NNNNN.jsonl.gz`."""
    buf, shards, total = [], [], 0
    for doc in _iter_inputs(files, text_key):
        if limit and total >= limit:
            break
        buf.append(doc)
        total += 1
        if len(buf) == shard_docs:
            shards.append(_flush(prefix, len(shards), buf))
            buf = []
    if buf:
        shards.append(_flush(prefix, len(shards), buf))
    return shards


def _flush(prefix: Path, index: int, docs: list[dict]) -> dict:
    path = prefix.with_name(f"{prefix.name}-{index:05d}.jsonl.gz")
    write_jsonl(path, docs)
    return {"path": path.name, "num_docs": len(docs)}


def _iter_inputs(files: list[str], text_key: str) -> Iterator[dict]:
    for f in files:
        stem = f.rstrip("/").rsplit("/", 1)[-1].split(".")[0]
        for i, doc in enumerate(read_jsonl(f)):
            if text_key != "text":
                doc["text"] = doc.pop(text_key)
            if not isinstance(doc.get("text"), str):
                raise ValueError(f"{f}:{i + 1}: no string field {text_key!r}")
            doc.setdefault("id", f"{stem}/{i}")
            yield doc
