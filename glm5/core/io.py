"""File I/O shared by every layer: atomic writes, safetensors reading (memory-mapped) and writing.

Only safetensors are ever read as tensors: no pickle, so untrusted checkpoints cannot run code.
Every safetensors file we write carries a CRC32 per tensor in its header metadata (`glm5.crc32`, a
JSON object; transformers and safetensors ignore unknown metadata keys), and a reader that asks for
verification checks it, so a flipped bit in a checkpoint is an error naming the file and the tensor
rather than a silently different model. Files without checksums (other tools' checkpoints) load as
they are. Unreadable files (truncated, not safetensors) raise `CheckpointError` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and safetensors load on first use: the data pipeline (its Ray workers included)
    import torch   # only needs the atomic writers, and importing torch costs seconds per fresh process

CHECKSUMS_KEY = "glm5.crc32"  # safetensors metadata key: {"tensor name": "crc32 hex", ...}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    """A checkpoint is unreadable, corrupt or does not match the model; the message names the file
    and, when there is one, the tensor."""


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


def remove_stale_tmp(directory: str | Path) -> list[Path]:
    """Delete the `.tmp-*` / `.old-*` leftovers of atomic writes that a crash (`kill -9`) interrupted.
    Call it only where no other writer is active (e.g. when a run starts). Returns what was removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = [p for p in directory.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    for p in stale:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    return stale


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a HF checkpoint dir (sharded via the index json, or single)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [path / f for f in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard(s) {missing} that are not in {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*") if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise FileNotFoundError(f"{path} has no *.safetensors files, only pickle checkpoints "
                                    f"({', '.join(pickles[:3])}); glm5 never unpickles (loading a pickle can run "
                                    "code): convert it to safetensors in a trusted environment, e.g. with "
                                    "transformers' save_pretrained(safe_serialization=True)")
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def tensor_crc32(t: torch.Tensor) -> str:
    """CRC32 of a tensor's bytes (any dtype), as 8 hex digits."""
    import torch

    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return f"{zlib.crc32(memoryview(flat.numpy())) & 0xFFFFFFFF:08x}"


def save_file_checked(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    """`safetensors.torch.save_file` plus a CRC32 per tensor in the header metadata."""
    from safetensors.torch import save_file

    sums = {name: tensor_crc32(t) for name, t in tensors.items()}
    save_file(tensors, str(path), metadata={"format": "pt", **(metadata or {}), CHECKSUMS_KEY: json.dumps(sums)})


def check_finite(t: torch.Tensor, name: str, file: str | Path) -> None:
    """Raise `CheckpointError` naming the file and tensor if a floating tensor holds NaN or inf."""
    import torch

    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise CheckpointError(f"{file}: tensor {name!r} has {bad} NaN/inf value(s); the checkpoint is corrupt "
                              "(resume from an earlier checkpoint)")


class LazyTensors:
    """Name -> tensor view over one or more safetensors files, memory-mapped, read on demand.
    With `verify`, `get` checks each tensor against its stored CRC32 (when the file has them)."""

    def __init__(self, files: list[Path], verify: bool = False):
        from safetensors import safe_open

        self._handles = []
        self.files = [Path(f) for f in files]
        self.verify = verify
        self.where: dict[str, int] = {}
        self.checksums: dict[str, str] = {}
        for f in self.files:
            try:
                h = safe_open(str(f), framework="pt", device="cpu")
                sums = json.loads((h.metadata() or {}).get(CHECKSUMS_KEY, "{}"))
            except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, bad JSON: all "unreadable"
                raise CheckpointError(f"{f}: not a readable safetensors file (truncated or corrupt?): {e}") from None
            self._handles.append(h)
            for k in h.keys():
                self.where[k] = len(self._handles) - 1
            self.checksums.update(sums if isinstance(sums, dict) else {})

    def keys(self):
        return self.where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def file_of(self, name: str) -> Path:
        return self.files[self.where[name]]

    def get(self, name: str) -> torch.Tensor:
        try:
            t = self._handles[self.where[name]].get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{self.file_of(name)}: cannot read tensor {name!r}: {e}") from None
        want = self.checksums.get(name) if self.verify else None
        if want is not None and tensor_crc32(t) != want:
            raise CheckpointError(f"{self.file_of(name)}: tensor {name!r} does not match its checksum (the file "
                                  "was modified or damaged after it was written)")
        return t

    def load_all(self) -> dict[str, torch.Tensor]:
        return {name: self.get(name) for name in self.where}

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
    meta = dict(metadata or {})
    if len(shards) == 1:
        save_file_checked(shards[0], path / "model.safetensors", meta)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file_checked(shard, path / fname, meta)
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


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in `t`: the one check every tensor loaded at run time (expert uploads, LoRA adapters) passes."""
    import torch

    return bool(torch.isfinite(t).all())
