"""File I/O shared by every layer: atomic writes, safetensors reading (memory-mapped) and writing.

Only safetensors are ever read as tensors: no pickle, so untrusted checkpoints cannot run code.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


@contextlib.contextmanager
def atomic_dir(final: str | Path):
    """Yield a temporary directory next to `final`; on success rename it into place atomically.

    A crash (even `kill -9`) at any point leaves either the old `final` or nothing half-written:
    the temporary `.tmp-*` sibling is garbage that the next writer may delete.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        if final.exists():
            old = final.with_name(f".old-{final.name}-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a text file atomically (write to a temp file in the same dir, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with contextlib.suppress(OSError), open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a HF checkpoint dir (sharded via the index json, or single)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


class LazyTensors:
    """Name -> tensor view over one or more safetensors files, memory-mapped, read on demand."""

    def __init__(self, files: list[Path]):
        self._handles = []
        self.where: dict[str, int] = {}
        for f in files:
            h = safe_open(str(f), framework="pt", device="cpu")
            self._handles.append(h)
            for k in h.keys():
                self.where[k] = len(self._handles) - 1

    def keys(self):
        return self.where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self.where[name]].get_tensor(name)

    def shape(self, name: str) -> list[int]:
        return self._handles[self.where[name]].get_slice(name).get_shape()


def save_sharded(tensors: dict[str, torch.Tensor], path: str | Path, max_shard_size: int | str = "5GB",
                 metadata: dict | None = None) -> None:
    """Write tensors as HF safetensors: one `model.safetensors`, or shards plus an index json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += n
    meta = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata=meta)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata=meta)
        for k, t in shard.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def parse_size(size: int | str) -> int:
    """'5GB' / '500MB' / '10KB' / int -> bytes (decimal units, as HF uses)."""
    if isinstance(size, int):
        return size
    s = size.strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6),
                       ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)
