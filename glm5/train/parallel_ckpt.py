"""Distributed checkpoints with `torch.distributed.checkpoint` (DCP), and export to the HF layout.

Owns: `save_dcp(path, model, optimizer)` / `load_dcp(path, model, optimizer)` for model + optimizer
state, and `gather_model(model)` / `export_hf(model, path)` for a plain HF directory.

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

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from glm5.core import dist as gdist
from glm5.model.hf_adapter import save_pretrained
from glm5.model.layers import rope_inv_freq
from glm5.model.model import GLM5ForCausalLM


def _barrier() -> None:
    if gdist.is_dist():
        dist.barrier()


def save_dcp(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Path:
    """Collective: all ranks call it. Writes `path` (a directory) atomically; returns it."""
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
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a distributed checkpoint (no .metadata)")
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        return
    model_sd, optim_sd = get_state_dict(model, optimizer)
    saved = set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    optim_sd["state"] = {fqn: st for fqn, st in optim_sd["state"].items()
                         if all(f"optim.state.{fqn}.{k}" in saved for k in st)}
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"], options=StateDictOptions(strict=False))


def gather_model(model: nn.Module) -> GLM5ForCausalLM | None:
    """Collective: rank 0 gets a plain fp32 CPU `GLM5ForCausalLM` with the full weights, others None."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(model, options=opts)
    if not gdist.is_main():
        return None
    cfg = model.config
    with torch.device("meta"):
        plain = GLM5ForCausalLM(cfg)
    plain.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()},
                          strict=True, assign=True)
    plain.model.inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta)  # non-persistent buffer
    if cfg.tie_word_embeddings:
        plain.lm_head.weight = plain.model.embed_tokens.weight
    return plain


def export_hf(model: nn.Module, path: str | Path) -> Path | None:
    """Collective: write the model as a HF directory (`glm5.model.hf_adapter.save_pretrained`) from rank 0."""
    plain = gather_model(model)
    if plain is not None:
        save_pretrained(plain, path)
    _barrier()
    return Path(path) if plain is not None else None
