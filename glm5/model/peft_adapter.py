"""PEFT LoRA adapter directories, both ways: `adapter_config.json` + `adapter_model.safetensors`.

Key names are PEFT's for transformers' `GlmMoeDsaForCausalLM` (whose module paths equal ours):
`base_model.model.<module>.lora_A.weight` [r, in] / `lora_B.weight` [out, r]. The routed experts use
PEFT's `target_parameters` layout: for a fused weight [E, d1, d2], lora_A is [r*E, d2] (expert-major
rows) and lora_B is [d1, r*E] (rank-major columns); when both `gate_up_proj` and `down_proj` of one
experts module are adapted, PEFT nests the wrappers in registration order, so `gate_up_proj` lives
under `experts.base_layer.` and `down_proj` under `experts.`.

PEFT on transformers v5 rewrites `target_modules` entries named `gate_proj`/`up_proj`/`down_proj` to
the fused experts, so the dense MLP and shared experts cannot be named there: we save them as
`target_parameters` (`mlp.gate_proj.weight`, ...), which PEFT applies as plain LoRA with the same
keys. PEFT refuses `lora_dropout` with `target_parameters`, so such adapters are saved with 0.
Only safetensors are read; a pickled `adapter_model.bin` is refused.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import re2
import torch
from safetensors.torch import save_file

from glm5.core.io import LazyTensors, all_finite, atomic_dir, atomic_write_json

from .lora import Target, _layer_index, _matches, apply_lora, base_shape, candidates, lora_layers, scaling

PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# transformers-v4 names PEFT maps onto transformers-v5's fused experts (PEFT's _MOE_TARGET_MODULE_MAPPING)
_MOE_RENAMES = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj", "gate": "gate.weight"}
# PEFT LoRA options glm5 cannot honour: loading refuses them by name rather than silently diverging
_UNSUPPORTED = {"use_dora": False, "lora_bias": False, "fan_in_fan_out": False, "modules_to_save": None,
                "trainable_token_indices": None, "layer_replication": None, "use_qalora": False,
                "alora_invocation_tokens": None, "use_bdlora": None, "megatron_config": None}


class AdapterError(ValueError):
    """An adapter directory does not fit the model (or is not a safe LoRA adapter): names the key."""


# --- reading ------------------------------------------------------------------------------------------
def read_adapter_config(path: str | Path) -> dict:
    """The adapter's config, after refusing pickle-only adapters and unreadable configs."""
    path = Path(path)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise AdapterError(f"{path} is not an adapter directory (no {CONFIG_FILE})")
    if not (path / WEIGHTS_FILE).is_file():
        if any((path / n).is_file() for n in ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")):
            raise AdapterError(f"{path} holds only a pickled adapter (adapter_model.bin): glm5 never unpickles "
                               "files (loading one can run arbitrary code). Convert it to safetensors with PEFT "
                               "(`PeftModel.from_pretrained(...).save_pretrained(dir, safe_serialization=True)`).")
        raise AdapterError(f"{path} has no {WEIGHTS_FILE}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{cfg_file}: invalid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_file}: expected a JSON object, got {type(cfg).__name__}")
    if not isinstance(cfg.get("peft_type", ""), str):
        raise AdapterError(f"{cfg_file}: peft_type={cfg['peft_type']!r} must be a string")
    return cfg


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _strs(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# the config keys glm5 reads, each with PEFT's type (a null is PEFT's default for every one of them)
_CONFIG_TYPES: dict[str, tuple[Callable[[object], bool], str]] = {
    "r": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "lora_alpha": (_is_number, "a finite number"),
    "lora_dropout": (lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "use_rslora": (lambda v: isinstance(v, bool), "true or false"),
    "target_modules": (lambda v: isinstance(v, str) or _strs(v), "a regex string or a list of module names"),
    "target_parameters": (_strs, "a list of parameter names"),
    "exclude_modules": (lambda v: isinstance(v, str) or _strs(v), "a regex string or a list of module names"),
    "layers_to_transform": (lambda v: _is_int(v) or isinstance(v, list) and all(_is_int(x) for x in v),
                            "a layer index or a list of them"),
    "rank_pattern": (lambda v: isinstance(v, dict) and all(_is_int(x) for x in v.values()),
                     "an object of pattern -> rank (integer)"),
    "alpha_pattern": (lambda v: isinstance(v, dict) and all(_is_number(x) for x in v.values()),
                      "an object of pattern -> alpha (finite number)"),
}


def _check_lora_config(cfg: dict, where: Path) -> None:
    for key, (ok, what) in _CONFIG_TYPES.items():
        if cfg.get(key) is not None and not ok(cfg[key]):
            raise AdapterError(f"{where}/{CONFIG_FILE}: {key}={cfg[key]!r} must be {what}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}/{CONFIG_FILE}: peft_type {cfg.get('peft_type')!r} is not a LoRA adapter")
    for key, neutral in _UNSUPPORTED.items():
        if cfg.get(key, neutral) not in (neutral, [], {}, None, False):
            raise AdapterError(f"{where}/{CONFIG_FILE}: {key}={cfg[key]!r} is not supported by glm5")
    pattern = cfg.get("layers_pattern")
    if pattern not in (None, "layers", ["layers"]):
        raise AdapterError(f"{where}/{CONFIG_FILE}: layers_pattern={pattern!r} (this model's layers are 'layers')")


def _re2(pattern: str, what: str):
    """`pattern` compiled by RE2 (linear-time matching: a catastrophic regex cannot freeze the server);
    one RE2 cannot compile (backreferences, lookaround) is refused naming `what`."""
    if not isinstance(pattern, str):
        raise AdapterError(f"{CONFIG_FILE}: {what}={pattern!r} is not a string")
    try:
        return re2.compile(pattern)
    except Exception as e:  # re2.error: backreferences, lookaround, bad syntax
        raise AdapterError(f"{CONFIG_FILE}: {what}={pattern!r} is not a supported regular expression "
                           f"(RE2 syntax, no backreferences or lookaround): {e}") from e


def _pattern_value(patterns: dict, key: str, default, what: str = "rank_pattern"):
    """PEFT's `get_pattern_key`: the first pattern p with re.match(r"(.*\\.)?(p)$", key) (matched by RE2)."""
    for p, v in (patterns or {}).items():
        _re2(p, f"{what} key")
        if _re2(rf"(.*\.)?({p})$", f"{what} key {p!r}").match(key):
            return v
    return default


def _split_targets(cfg: dict) -> tuple[list[str] | str, list[str]]:
    """(target_modules, target_parameters) after PEFT's transformers-v5 MoE rewrite of target_modules."""
    modules, params = cfg.get("target_modules") or [], list(cfg.get("target_parameters") or [])
    if isinstance(modules, str):
        return modules, params
    kept = []
    for t in modules:
        old = next((o for o in _MOE_RENAMES if t == o or t.endswith("." + o)), None)
        if old is None:
            kept.append(t)
        else:
            params.append(_MOE_RENAMES[old])
    return kept, params


def _module_hit(name: str, spec: list[str] | str) -> bool:
    if isinstance(spec, str):
        return _re2(spec, "target_modules").fullmatch(name) is not None
    return any(_matches(name, t) for t in spec)


def peft_targets(model: torch.nn.Module, cfg: dict) -> list[Target]:
    """What PEFT would adapt on transformers' model for this LoRA config, as glm5 targets (MTP excluded)."""
    modules, params = _split_targets(cfg)
    if any(_matches("model.layers.0.mlp.gate.weight", p) for p in params):
        raise AdapterError("adapter targets the MoE router (mlp.gate): not supported by glm5")
    exclude = cfg.get("exclude_modules") or []
    layers = cfg.get("layers_to_transform")
    layers = {layers} if isinstance(layers, int) else set(layers or [])
    r = int(8 if cfg.get("r") is None else cfg["r"])  # PEFT's defaults
    alpha = float(8 if cfg.get("lora_alpha") is None else cfg["lora_alpha"])
    linears, experts = candidates(model)
    picked: list[tuple[str, str | None]] = []
    for name in linears:
        if exclude and _module_hit(name, exclude):
            continue
        by_module = _module_hit(name, modules) and (not layers or _layer_index(name) in layers)
        if by_module or any(_matches(f"{name}.weight", p) for p in params):
            picked.append((name, None))
    picked += [(m, p) for key, (m, p) in experts.items() if any(_matches(key, t) for t in params)]
    out = []
    for name, param in picked:
        key = name if param is None else f"{name}.{param}"
        t = Target(name, param, int(_pattern_value(cfg.get("rank_pattern"), key, r, "rank_pattern")),
                   float(_pattern_value(cfg.get("alpha_pattern"), key, alpha, "alpha_pattern")))
        bound = min(base_shape(model, t)[-2:])
        if not 1 <= t.r <= bound:
            raise AdapterError(f"{CONFIG_FILE}: rank {t.r} for {key!r} is out of range [1, {bound}] "
                               f"(min(out, in) of the base tensor {base_shape(model, t)})")
        out.append(t)
    return out


# --- key layout ---------------------------------------------------------------------------------------
def _expert_nesting(targets: list[Target]) -> dict[tuple[str, str], int]:
    """Number of `.base_layer` hops of each expert parameter's PEFT wrapper (see module docstring)."""
    by_module: dict[str, list[str]] = {}
    for t in targets:
        if t.param is not None:
            by_module.setdefault(t.name, []).append(t.param)
    depth = {}
    for name, ps in by_module.items():
        ordered = [p for p in ("gate_up_proj", "down_proj") if p in ps]
        for i, p in enumerate(ordered):
            depth[(name, p)] = len(ordered) - 1 - i
    return depth


def expected_tensors(model: torch.nn.Module, targets: list[Target]) -> dict[str, tuple[Target, str, list[int]]]:
    """PEFT key -> (target, "A"|"B", shape) for every adapter tensor `targets` need."""
    depth = _expert_nesting(targets)
    out = {}
    for t in targets:
        if t.param is None:
            out_f, in_f = base_shape(model, t)
            k = t.r
            base = f"{PREFIX}{t.name}"
        else:
            E, out_f, in_f = base_shape(model, t)
            k = t.r * E
            base = f"{PREFIX}{t.name}" + ".base_layer" * depth[(t.name, t.param)]
        out[f"{base}.lora_A.weight"] = (t, "A", [k, in_f])
        out[f"{base}.lora_B.weight"] = (t, "B", [out_f, k])
    return out


def _to_peft(t: Target, which: str, x: torch.Tensor) -> torch.Tensor:
    """glm5 tensor -> PEFT layout (experts: A [E, r, in] -> [E*r, in]; B [E, out, r] -> [out, r*E])."""
    if t.param is None:
        return x
    if which == "A":
        return x.reshape(-1, x.shape[-1])
    return x.permute(1, 2, 0).reshape(x.shape[1], -1)


def _from_peft(t: Target, which: str, x: torch.Tensor, num_experts: int) -> torch.Tensor:
    if t.param is None:
        return x
    if which == "A":
        return x.reshape(num_experts, t.r, x.shape[-1])
    return x.reshape(x.shape[0], t.r, num_experts).permute(2, 0, 1)


# --- load / save --------------------------------------------------------------------------------------
def _read_checked(model: torch.nn.Module, path: Path) -> tuple[dict, dict, dict, LazyTensors]:
    """(config, expected tensors, file key by expected key, tensors), after checking every tensor."""
    cfg = read_adapter_config(path)
    _check_lora_config(cfg, path)
    targets = peft_targets(model, cfg)
    if not targets:
        raise AdapterError(f"{path}/{CONFIG_FILE}: target_modules={cfg.get('target_modules')!r} / "
                           f"target_parameters={cfg.get('target_parameters')!r} match nothing in this model")
    tensors = LazyTensors([path / WEIGHTS_FILE])
    want = expected_tensors(model, targets)
    got = {k.replace(".default.", "."): k for k in tensors.keys()}  # some writers keep the adapter name
    for key, (t, _, shape) in want.items():
        if key not in got:
            raise AdapterError(f"{path}/{WEIGHTS_FILE}: missing tensor {key!r} (adapter_config.json targets "
                               f"{t.key!r}; was the adapter trained on another base model?)")
        have = tensors.shape(got[key])
        if list(have) != shape:
            raise AdapterError(f"{path}/{WEIGHTS_FILE}: tensor {key!r} has shape {list(have)}, expected {shape} "
                               f"(rank {t.r} from adapter_config.json; base tensor {t.key!r} is "
                               f"{base_shape(model, t)}: another rank or another base model?)")
    extra = sorted(set(got) - set(want))
    if extra:
        raise AdapterError(f"{path}/{WEIGHTS_FILE}: unexpected tensor(s) {extra[:5]} ({len(extra)} in all): they "
                           "match no target of adapter_config.json in this model")
    return cfg, want, got, tensors


@dataclass
class AdapterWeights:
    """One target's adapter in glm5's layout: A [r, in] / B [out, r] (experts: [E, r, in] / [E, out, r])."""

    target: Target
    A: torch.Tensor
    B: torch.Tensor
    scaling: float


def read_adapter(model: torch.nn.Module, path: str | Path) -> tuple[dict, list[AdapterWeights]]:
    """A PEFT LoRA directory checked against `model` (nothing applied): (its config, per-target weights)."""
    path = Path(path)
    cfg, want, got, tensors = _read_checked(model, path)
    rslora = bool(cfg.get("use_rslora", False))
    parts: dict[Target, dict[str, torch.Tensor]] = {}
    for key, (t, which, _) in want.items():
        x = tensors.get(got[key])
        if not all_finite(x):
            raise AdapterError(f"{path}/{WEIGHTS_FILE}: tensor {got[key]!r} holds NaN or Inf")
        if t.param is not None:
            x = _from_peft(t, which, x, getattr(model.get_submodule(t.name), t.param).shape[0])
        parts.setdefault(t, {})[which] = x
    return cfg, [AdapterWeights(t, p["A"], p["B"], scaling(t.r, t.alpha, rslora)) for t, p in parts.items()]


@torch.no_grad()
def _copy_weights(model: torch.nn.Module, weights: list[AdapterWeights]) -> None:
    layers = {(t.name, t.param): mod for t, mod in lora_layers(model)}
    for w in weights:
        mod = layers.get((w.target.name, w.target.param))
        if mod is None or mod.r != w.target.r:
            raise AdapterError(f"{w.target.key!r}: the model's adapter has no such target (or another rank)")
        dst_a, dst_b = (mod.lora_A.weight, mod.lora_B.weight) if w.target.param is None else (mod.lora_A, mod.lora_B)
        dst_a.copy_(w.A.to(dst_a.dtype))
        dst_b.copy_(w.B.to(dst_b.dtype))


def load_adapter(model: torch.nn.Module, path: str | Path, dropout: float | None = None) -> list[Target]:
    """Read a PEFT LoRA directory and apply it to `model` (in place, base frozen). Everything is checked
    before the model is touched: a missing, unexpected or mis-shaped tensor raises naming it.
    `dropout` (for further training) defaults to the file's `lora_dropout`."""
    cfg, weights = read_adapter(model, path)
    targets = [w.target for w in weights]
    dropout = float(cfg.get("lora_dropout") or 0.0) if dropout is None else dropout
    apply_lora(model, targets, dropout=dropout, use_rslora=bool(cfg.get("use_rslora", False)))
    _copy_weights(model, weights)
    return targets


def copy_adapter_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Overwrite the weights of the adapter already applied to `model` (same targets and ranks) from
    `path`, keeping the parameter objects (an optimizer that holds them stays valid): training resume."""
    _, weights = read_adapter(model, path)
    have = {(t.name, t.param) for t, _ in lora_layers(model)}
    if have != {(w.target.name, w.target.param) for w in weights}:
        raise AdapterError(f"{path}: its targets differ from the adapter being trained")
    _copy_weights(model, weights)


def adapter_state(model: torch.nn.Module) -> tuple[list[Target], dict[str, torch.Tensor]]:
    """The model's adapters as PEFT-named tensors (contiguous CPU copies)."""
    layers = lora_layers(model)
    if not layers:
        raise AdapterError("the model has no LoRA adapter to save")
    targets = [t for t, _ in layers]
    keys = {(t.name, t.param, which): k for k, (t, which, _) in expected_tensors(model, targets).items()}
    out = {}
    for t, mod in layers:
        for which in ("A", "B"):
            x = (mod.lora_A.weight if which == "A" else mod.lora_B.weight) if t.param is None else \
                (mod.lora_A if which == "A" else mod.lora_B)
            out[keys[(t.name, t.param, which)]] = _to_peft(t, which, x.detach()).cpu().contiguous()
    return targets, out


def _compact_config(model, targets: list[Target]) -> dict:
    """Short target lists (leaf names, suffixes, layers_to_transform) when they select exactly
    `targets` under PEFT's rules; else full names."""
    n_main = model.config.num_hidden_layers
    mods = sorted({t.name.rsplit(".", 1)[-1] for t in targets if t.param is None and not _is_mlp(t.name)})
    params = sorted({".".join(t.name.split(".")[-2:]) + ".weight" for t in targets if t.param is None and _is_mlp(t.name)}
                    | {f"{t.name.rsplit('.', 1)[-1]}.{t.param}" for t in targets if t.param is not None})
    layers = sorted({_layer_index(t.name) for t in targets if t.param is None and not _is_mlp(t.name)} - {None})
    compact = {"target_modules": mods, "target_parameters": params}
    if layers and layers != list(range(n_main)):
        compact.update(layers_to_transform=layers, layers_pattern="layers")
    want = {(t.name, t.param) for t in targets}
    if {(t.name, t.param) for t in peft_targets(model, compact)} == want:
        return compact
    return {"target_modules": sorted(t.name for t in targets if t.param is None and not _is_mlp(t.name)),
            "target_parameters": sorted(f"{t.name}.weight" for t in targets if t.param is None and _is_mlp(t.name))
            + sorted(t.key for t in targets if t.param is not None)}


def _is_mlp(name: str) -> bool:
    """Dense-MLP / shared-expert projections: PEFT v5 would hijack their names in target_modules."""
    return name.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj")


def adapter_config(model: torch.nn.Module, targets: list[Target], base_model_name_or_path: str = "") -> dict:
    """The PEFT `adapter_config.json` describing `targets` (ranks/alphas as patterns where they differ)."""
    mods = [m for _, m in lora_layers(model)]
    r = max(t.r for t in targets)
    alpha = next(t.alpha for t in targets if t.r == r)
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
           "r": r, "lora_alpha": alpha, "use_rslora": any(m.use_rslora for m in mods), "bias": "none",
           "inference_mode": True, "init_lora_weights": True, "lora_dropout": max(m.dropout for m in mods),
           "fan_in_fan_out": False, **_compact_config(model, targets),
           "rank_pattern": {re.escape(t.key): t.r for t in targets if t.r != r},
           "alpha_pattern": {re.escape(t.key): t.alpha for t in targets if t.alpha != alpha}}
    if cfg["target_parameters"]:
        cfg["lora_dropout"] = 0.0  # PEFT raises on dropout with target_parameters (training-only anyway)
    return cfg


def write_adapter(model: torch.nn.Module, directory: str | Path, base_model_name_or_path: str = "") -> None:
    """Write the adapter files into `directory` (created if needed; not atomic: see `save_adapter`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    targets, tensors = adapter_state(model)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    atomic_write_json(directory / CONFIG_FILE, adapter_config(model, targets, base_model_name_or_path))


def save_adapter(model: torch.nn.Module, path: str | Path, base_model_name_or_path: str = "") -> Path:
    """Write the model's LoRA adapters as a PEFT directory (atomically) that `PeftModel.from_pretrained`
    loads onto transformers' GlmMoeDsaForCausalLM."""
    path = Path(path)
    with atomic_dir(path) as tmp:
        write_adapter(model, tmp, base_model_name_or_path)
    return path


# --- MLA latent prefix (glm5's own format; see glm5/finetune/prefix.py and docs/finetune.md) ------------
PREFIX_PEFT_TYPE = "GLM5_MLA_PREFIX"


def prefix_config(cfg, num_tokens: int, base_model_name_or_path: str = "") -> dict:
    """`adapter_config.json` of a latent prefix for a model with config `cfg`."""
    return {"peft_type": PREFIX_PEFT_TYPE, "base_model_name_or_path": base_model_name_or_path,
            "num_virtual_tokens": num_tokens, "num_layers": cfg.num_hidden_layers,
            "kv_lora_rank": cfg.kv_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "index_head_dim": cfg.index_head_dim,
            "position_offset": "real tokens start at position num_virtual_tokens"}


def write_prefix_files(directory: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(directory / WEIGHTS_FILE),
              metadata={"format": "pt"})
    atomic_write_json(directory / CONFIG_FILE, config)


def read_prefix(cfg, path: str | Path) -> tuple[int, dict[str, torch.Tensor]]:
    """A latent prefix for a model with config `cfg`, checked: -> (P, {"prefix.layers.{i}.latent" [P, R],
    ".rope_key" [P, rope], ".index_key" [P, D] on full-indexer layers}). Errors name the key or tensor."""
    path = Path(path)
    meta = read_adapter_config(path)
    if meta.get("peft_type") != PREFIX_PEFT_TYPE:
        raise AdapterError(f"{path}/{CONFIG_FILE}: peft_type {meta.get('peft_type')!r} is not {PREFIX_PEFT_TYPE!r}")
    P = int(meta["num_virtual_tokens"])
    for key, want in (("num_layers", cfg.num_hidden_layers), ("kv_lora_rank", cfg.kv_lora_rank),
                      ("qk_rope_head_dim", cfg.qk_rope_head_dim)):
        if int(meta.get(key, -1)) != want:
            raise AdapterError(f"{path}/{CONFIG_FILE}: {key} = {meta.get(key)} but the model has {want}")
    expected = {}
    for i in range(cfg.num_hidden_layers):
        expected[f"prefix.layers.{i}.latent"] = [P, cfg.kv_lora_rank]
        expected[f"prefix.layers.{i}.rope_key"] = [P, cfg.qk_rope_head_dim]
        if cfg.indexer_types[i] == "full":
            expected[f"prefix.layers.{i}.index_key"] = [P, cfg.index_head_dim]
    tensors = LazyTensors([path / WEIGHTS_FILE])
    for key, shape in expected.items():
        if key not in tensors:
            raise AdapterError(f"{path}/{WEIGHTS_FILE}: missing tensor {key!r}")
        if list(tensors.shape(key)) != shape:
            raise AdapterError(f"{path}/{WEIGHTS_FILE}: tensor {key!r} has shape {tensors.shape(key)}, "
                               f"expected {shape}")
    extra = sorted(set(tensors.keys()) - set(expected))
    if extra:
        raise AdapterError(f"{path}/{WEIGHTS_FILE}: unexpected tensor(s) {extra[:5]}")
    return P, {k: tensors.get(k) for k in expected}


def adapter_kind(path: str | Path) -> str:
    """"lora" or "prefix", from the directory's adapter_config.json (pickle-only adapters refused)."""
    meta = read_adapter_config(Path(path))
    kind = {"LORA": "lora", PREFIX_PEFT_TYPE: "prefix"}.get(meta.get("peft_type", "LORA"))
    if kind is None:
        raise AdapterError(f"{path}/{CONFIG_FILE}: peft_type {meta.get('peft_type')!r} is not supported "
                           f"(LORA or {PREFIX_PEFT_TYPE})")
    return kind
