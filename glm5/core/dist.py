"""Process-group helpers: rank/world size that work with or without torch.distributed, `print0`."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if is_dist() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    return rank() == 0


def print0(*args, **kwargs) -> None:
    if is_main():
        print(*args, **kwargs, flush=True)


def init_from_env(backend: str | None = None) -> bool:
    """Initialise the default process group when launched by torchrun; returns whether it did."""
    if is_dist() or "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
        return is_dist()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend)
    return True


def all_reduce_scalars(values: list[float], op: str = "sum") -> list[float]:
    """Per-rank scalars reduced over all ranks ("sum" or "max") in one float64 all-reduce; `values`
    unchanged without a process group."""
    if not is_dist():
        return list(values)
    t = torch.tensor([float(v) for v in values], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()
