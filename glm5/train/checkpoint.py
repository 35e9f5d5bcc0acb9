"""Training checkpoints: atomic, resumable, safetensors only (no pickle).

Layout of `RUN_DIR/checkpoints/step_00000100/` (written through `glm5.core.io.atomic_dir`, so a
`kill -9` at any moment leaves the previous checkpoint intact and never a half-written one):
  model/                 HF layout (config.json + safetensors), loadable by `glm5.from_pretrained`
  optimizer.safetensors  optimizer tensors; optimizer.json the rest of its state_dict
  state.safetensors      torch RNG states; state.json: step, schedule/guard state, data-loader
                         state, python and numpy RNG states
  train_config.json      the resolved TrainConfig
Nested Python states are split generically: tensors go to safetensors, everything else to JSON.
Every safetensors file carries per-tensor CRC32s (glm5.core.io), and loading verifies them and that
weights and optimizer moments are finite, so a damaged checkpoint is refused with its file and tensor
named; `resume_candidates("auto")` lets the trainer fall back to the previous checkpoint.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from glm5.core.io import (CheckpointError, LazyTensors, atomic_dir, check_finite, safetensors_files,
                          save_file_checked)
from glm5.model.hf_adapter import load_hf_state_dict, save_pretrained

STEP_RE = re.compile(r"^step_(\d+)$")


# --- generic state <-> (json, tensors) ---------------------------------------------------------------
def flatten_state(obj, tensors: dict[str, torch.Tensor], storages: set | None = None):
    """Replace every tensor in a nested dict/list/tuple by {"__tensor__": key}, collecting tensors."""
    storages = set() if storages is None else storages
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        t = obj.detach().cpu().contiguous()
        if t.untyped_storage().data_ptr() in storages:
            t = t.clone()  # safetensors refuses shared storage (e.g. one quantisation map for many params)
        storages.add(t.untyped_storage().data_ptr())
        tensors[key] = t
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: flatten_state(v, tensors, storages) for k, v in obj.items()}
        return {"__items__": [[k, flatten_state(v, tensors, storages)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [flatten_state(v, tensors, storages) for v in obj]}
    if isinstance(obj, list):
        return [flatten_state(v, tensors, storages) for v in obj]
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    return obj


def unflatten_state(obj, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__items__" in obj:
            return {k: unflatten_state(v, tensors) for k, v in obj["__items__"]}
        if "__tuple__" in obj:
            return tuple(unflatten_state(v, tensors) for v in obj["__tuple__"])
        if "__ndarray__" in obj:
            return np.array(obj["__ndarray__"], dtype=obj["dtype"])
        return {k: unflatten_state(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unflatten_state(v, tensors) for v in obj]
    return obj


def save_state(obj, directory: Path, name: str) -> None:
    """Write a nested state as `name.json` + `name.safetensors`."""
    tensors: dict[str, torch.Tensor] = {}
    meta = flatten_state(obj, tensors)
    save_file_checked(tensors, directory / f"{name}.safetensors")
    (directory / f"{name}.json").write_text(json.dumps(meta) + "\n")


def load_state(directory: Path, name: str):
    """The state `save_state` wrote; a missing, unreadable, damaged or non-finite part is a
    `CheckpointError` naming the file (and tensor)."""
    file = directory / f"{name}.safetensors"
    if not file.is_file():
        raise CheckpointError(f"{file} is missing")
    tensors = LazyTensors([file], verify=True).load_all()
    for key, t in tensors.items():
        check_finite(t, key, file)
    try:
        meta = json.loads((directory / f"{name}.json").read_text())
        return unflatten_state(meta, tensors)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{directory / f'{name}.json'}: unreadable ({type(e).__name__}: {e})") from None


# --- RNG ---------------------------------------------------------------------------------------------
def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- checkpoints -------------------------------------------------------------------------------------
def step_dirs(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints under `ckpt_root`, oldest first (temp dirs of interrupted writes excluded)."""
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir() if (m := STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(ckpt_root: Path, step: int, model, optimizer, trainer_state: dict, config: dict,
                    keep_last: int = 3, write_model=save_pretrained) -> Path:
    """Write `ckpt_root/step_<step>` atomically, then delete all but the newest `keep_last`.
    `write_model(model, dir)` writes `model/` (fine-tuning passes an adapter writer: only what trains)."""
    final = ckpt_root / f"step_{step:08d}"
    with atomic_dir(final) as tmp:
        write_model(model, tmp / "model")
        save_state(optimizer.state_dict(), tmp, "optimizer")
        save_state({"step": step, **trainer_state, "rng": rng_state()}, tmp, "state")
        (tmp / "train_config.json").write_text(json.dumps(config, indent=2) + "\n")
    for old in step_dirs(ckpt_root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_hf_model(model, directory: Path) -> None:
    """Load HF-layout weights from `directory` into `model` in place (strict, checksums verified)."""
    load_hf_state_dict(model, LazyTensors(safetensors_files(directory), verify=True))


def load_checkpoint(path: Path, model, optimizer, read_model=read_hf_model) -> dict:
    """Load model weights (`read_model(model, path/"model")`, in place) and optimizer state; restore RNG;
    return the trainer state (with `step` = the number of optimizer steps already done)."""
    read_model(model, path / "model")
    optimizer_state, state = load_state(path, "optimizer"), load_state(path, "state")  # all read before use
    optimizer.load_state_dict(optimizer_state)
    set_rng_state(state.pop("rng"))
    return state


def resume_candidates(resume: str, ckpt_root: Path) -> list[Path]:
    """Checkpoints to try, in order: "" -> none; "auto" -> every checkpoint under `ckpt_root`, newest
    first (the trainer falls back to the next when one is corrupt); otherwise the given directory,
    which must exist (and is not replaced by another if it is corrupt)."""
    if not resume:
        return []
    if resume == "auto":
        return step_dirs(ckpt_root)[::-1]
    path = Path(resume)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"checkpoint.resume={resume!r} is not a checkpoint directory (no state.json)")
    return [path]


def resolve_resume(resume: str, ckpt_root: Path) -> Path | None:
    """The first of `resume_candidates` (None when there is none)."""
    found = resume_candidates(resume, ckpt_root)
    return found[0] if found else None
