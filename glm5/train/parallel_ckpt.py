"""Distributed checkpoints with `torch.distributed.checkpoint` (DCP), and export to the HF layout.

Owns: `save_dcp(path, model, optimizer)` / `load_dcp(path, model, optimizer)` for model + optimizer
state, `gather_model(model)` / `export_hf(model, path)` for a plain HF directory, and the trainer's
distributed checkpoint directory (`save_train_checkpoint` / `load_train_checkpoint`):
  step_00000100/dcp/                 model + optimizer (DCP; any world size can load it)
  step_00000100/model/               HF export of the full model (optional)
  step_00000100/state.{json,safetensors}          rank 0's trainer state (step, data, guard, RNG)
  step_00000100/state_rank<r>.{json,safetensors}  the other ranks' (data position and RNG differ)
  step_00000100/train_config.json

DCP stores every tensor under its fully qualified name with its global shape; each rank writes the
shards it owns and reads back whatever slices its *current* layout needs. So a checkpoint written by
FSDP2 + expert parallel on 2 ranks loads on 1 plain process (and the other way round): the state dicts
come from `torch.distributed.checkpoint.state_dict.get_state_dict`, which names the optimizer state by
parameter name rather than by position. The FSDP/EP layout never appears in the names: `EPExperts` keeps
`Experts`' parameter names and exposes the full [E, ...] shapes as DTensors.

Writes are atomic: every rank writes into `.tmp-<name>`, and rank 0 renames it once all are done.
Note that DCP's `.metadata` file is a pickle (torch's format); load only checkpoints you trust.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from glm5.core import dist as gdist
from glm5.core.io import CheckpointError, atomic_dir, atomic_write_text
from glm5.model.hf_adapter import save_pretrained
from glm5.model.model import GLM5ForCausalLM

from .checkpoint import load_state, rng_state, save_state, set_rng_state, step_dirs


def _barrier() -> None:
    if gdist.is_dist():
        dist.barrier()


def trainable_names(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def frozen_names(model: nn.Module) -> set[str]:
    """What a trainable-only checkpoint leaves out (the base checkpoint's): the frozen parameters and
    the buffers of modules marked `frozen_storage` (a quantised base's scales, glm5/finetune/quant_base.py)."""
    out = {n for n, p in model.named_parameters() if not p.requires_grad}
    for name, mod in model.named_modules():
        if getattr(mod, "frozen_storage", False):
            out |= {f"{name}.{b}" if name else b for b, _ in mod.named_buffers()}
    return out


def save_dcp(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             trainable_only: bool = False) -> Path:
    """Collective: all ranks call it. Writes `path` (a directory) atomically; returns it. With
    `trainable_only` the model part holds only the parameters that train (a fine-tuning run's adapters:
    the frozen base is its base checkpoint's, not rewritten at every checkpoint)."""
    final = Path(path)
    tmp = final.with_name(f".tmp-{final.name}")
    if gdist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    if trainable_only:  # the trained parameters and the (small) buffers, e.g. the routers' correction bias
        keep = (trainable_names(model) | {n for n, _ in model.named_buffers()}) - frozen_names(model)
        state["model"] = {k: v for k, v in state["model"].items() if k in keep}
    dcp.save(state, checkpoint_id=str(tmp))
    _barrier()
    if gdist.is_main():
        old = final.with_name(f".old-{final.name}")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_dcp(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Collective: load model (+ optimizer) state in place, resharding to the current layout.

    Parameters that never had a gradient before the save (e.g. the DSA indexer outside its warm-up)
    have no optimizer state in the checkpoint; they get none after the load either, as in the run
    that wrote it (`get_state_dict` would otherwise invent a zero state with step 1 for them).

    A checkpoint that holds only the trainable parameters (`save_dcp(trainable_only=True)`) loads
    those and leaves the frozen rest as built; one that lacks a trainable parameter is refused naming it.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a distributed checkpoint (no .metadata)")
    saved = set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    if optimizer is None:
        state = {"model": _saved_part(get_model_state_dict(model), saved, model, path)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
        return
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_sd = _saved_part(model_sd, saved, model, path)
    optim_sd["state"] = {fqn: st for fqn, st in optim_sd["state"].items()
                         if all(f"optim.state.{fqn}.{k}" in saved for k in st)}
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizer, state["optim"], options=StateDictOptions(strict=False))


def _saved_part(model_sd: dict, saved: set[str], model: nn.Module, path: Path) -> dict:
    """The entries of `model_sd` the checkpoint holds; every missing one must be frozen (`frozen_names`: a
    trainable-only checkpoint), else CheckpointError naming it."""
    missing = [k for k in model_sd if f"model.{k}" not in saved]
    frozen = frozen_names(model)
    lost = [k for k in missing if k not in frozen]
    if lost:
        raise CheckpointError(f"{path}: the checkpoint has no {lost[0]!r} (and {len(lost) - 1} more), which this "
                              "run needs: it was written by another model or method")
    return {k: v for k, v in model_sd.items() if k not in missing}


def _full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Collective: the full (unsharded) CPU state dict on rank 0, None elsewhere. Under pipeline parallel
    each stage gathers its own parameters and one rank per stage sends them to rank 0 (the embedding
    the last stage shares for MTP arrives twice, identical)."""
    plan = getattr(model, "parallel_plan", None)
    if plan is None or plan.pp == 1:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if gdist.is_main() else None
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    leader = plan.data_rank == 0 and plan.mesh["tp"].get_local_rank() == 0
    mine = {k: v.detach().cpu() for k, v in sd.items()} if leader else {}
    parts: list | None = [None] * gdist.world_size() if gdist.is_main() else None
    dist.gather_object(mine, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts is not None else None


def gather_model(model: nn.Module) -> GLM5ForCausalLM | None:
    """Collective: rank 0 gets a plain fp32 CPU `GLM5ForCausalLM` with the full weights, others None."""
    sd = _full_state_dict(model)
    if sd is None:
        return None
    cfg = model.config
    with torch.device("meta"):
        plain = GLM5ForCausalLM(cfg)
    plain.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()},
                          strict=True, assign=True)
    plain.model.inv_freq = cfg.rope_inv_freq()  # non-persistent buffer
    if cfg.tie_word_embeddings:
        plain.lm_head.weight = plain.model.embed_tokens.weight
    return plain


def export_hf(model: nn.Module, path: str | Path, extra=None) -> Path | None:
    """Collective: write the model as a HF directory (`glm5.model.hf_adapter.save_pretrained`) from rank 0,
    atomically; `extra(tmp_dir)` (rank 0) may add files first, e.g. the tokenizer."""
    plain = gather_model(model)
    if plain is not None:
        with atomic_dir(path) as tmp:
            save_pretrained(plain, tmp)
            if extra is not None:
                extra(tmp)
    _barrier()
    return Path(path) if plain is not None else None


# --- the trainer's checkpoint directory ----------------------------------------------------------------
def _state_name(rank: int) -> str:
    return "state" if rank == 0 else f"state_rank{rank}"


def save_train_checkpoint(ckpt_root: str | Path, step: int, model: nn.Module, optimizer, trainer_state: dict,
                          config: dict, keep_last: int = 3, hf: bool = True,
                          export: Callable[[Path], None] | None = None, trainable_only: bool = False) -> Path:
    """Collective: write `ckpt_root/step_<step>` (layout in the module docstring) atomically, then keep
    only the newest `keep_last` step directories. `trainer_state` is this rank's. `export(dir)`
    (collective) writes `model/` instead of the HF export (fine-tuning: the gathered adapter);
    `trainable_only`: see `save_dcp`."""
    ckpt_root = Path(ckpt_root)
    final = ckpt_root / f"step_{step:08d}"
    tmp = ckpt_root / f".tmp-{final.name}"
    if gdist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    save_dcp(tmp / "dcp", model, optimizer, trainable_only)
    if export is not None:
        export(tmp / "model")
    elif hf:
        export_hf(model, tmp / "model")
    save_state({"step": step, **trainer_state, "rng": rng_state()}, tmp, _state_name(gdist.rank()))
    if gdist.is_main():
        atomic_write_text(tmp / "train_config.json", json.dumps(config, indent=2) + "\n")
    _barrier()
    if gdist.is_main():
        os.sync()  # every rank's files are on disk before the rename makes the checkpoint visible
        old = final.with_name(f".old-{final.name}")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        for stale in step_dirs(ckpt_root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


def is_train_checkpoint(path: str | Path) -> bool:
    return (Path(path) / "dcp" / ".metadata").is_file()


def load_train_checkpoint(path: str | Path, model: nn.Module, optimizer) -> dict:
    """Collective: load model + optimizer (resharded to the current mesh), restore this rank's RNG and
    return its trainer state. A rank the saving run did not have (the world grew) gets rank 0's state;
    the data position is the same on every rank (elastic order), so the run continues at its rows."""
    path = Path(path)
    load_dcp(path / "dcp", model, optimizer)
    name = _state_name(gdist.rank())
    if not (path / f"{name}.json").is_file():
        name = "state"
    state = load_state(path, name)
    set_rng_state(state.pop("rng"))
    return state
