"""LoRA as a module converter: the model code stays untouched, adapters are swapped in from outside.

Two kinds of target, matching how PEFT adapts transformers' `GlmMoeDsaForCausalLM`:
  * `nn.Linear` modules (attention, indexer, dense/shared MLP, lm_head) become `LoRALinear`:
    y = W x + s * B A dropout(x), with the frozen original kept as `base_layer`. Its `.weight` is the
    effective matrix W + s B A, so code that reads the matrix instead of calling the module (the
    absorbed-MLA path reads `kv_b_proj.weight`, the indexer reads `weights_proj.weight`) sees the adapter.
  * the routed experts' fused `[E, out, in]` parameters (`gate_up_proj`, `down_proj`) get a torch
    parametrization `ExpertLoRA`: W[e] + s * B[e] A[e], one rank-r pair per expert (PEFT's
    `target_parameters`). Every reader of the parameter (grouped, reference, dense experts) sees it.
s = alpha / r, or alpha / sqrt(r) with rsLoRA. B starts at zero, so a fresh adapter changes nothing.
Both work on a base whose weights are held quantised as parametrizations (glm5/finetune/quant_base.py):
LoRALinear wraps the parametrized nn.Linear, ExpertLoRA chains after the dequantisation; such a base is
never merged into (merge onto the unquantised base).
MTP layers (`model.layers.{>= num_hidden_layers}`) are never adapted: transformers has no MTP layer.
PEFT file I/O lives in `peft_adapter.py`; this module knows no file formats. It sits in `glm5.model` (not
`glm5.finetune`) because training, the engine and the server all apply adapters.

Dims: E experts, r rank, N tokens.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from .moe import Experts

# Target groups of `LoraConfig.targets`; each entry is a name suffix (PEFT's list matching:
# the module/parameter name equals it or ends with "." + it).
TARGET_GROUPS: dict[str, tuple[str, ...]] = {
    # MLA's projections (glm_moe_dsa, glm4_moe_lite) and GQA's (glm4_moe): a group adapts what the model has
    "attn": ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
             "self_attn.kv_b_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "indexer": ("indexer.wq_b", "indexer.wk", "indexer.weights_proj"),
    "mlp": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
            "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"),
    "experts": ("experts.gate_up_proj", "experts.down_proj"),
}
EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # registration order in Experts (PEFT nests in this order)


@dataclass(kw_only=True)
class LoraConfig:
    r: int = 8
    """Rank of every adapter pair."""
    alpha: float = 16.0
    """Scale numerator: the update is (alpha / r) * B A (alpha / sqrt(r) with `use_rslora`)."""
    dropout: float = 0.0
    """Dropout on the input of the LoRA branch of `nn.Linear` targets (training only; the fused
    expert targets have none, as in PEFT)."""
    use_rslora: bool = False
    """Rank-stabilised LoRA scaling alpha / sqrt(r)."""
    targets: list[str] = field(default_factory=lambda: ["attn"])
    """Groups (`attn`, `indexer`, `mlp` = dense MLP + shared experts, `experts` = routed experts'
    fused weights) or name suffixes (`q_a_proj`, `shared_experts.down_proj`, `experts.gate_up_proj`,
    `lm_head`). The indexer only learns from an indexer loss: its top-k is not differentiable."""
    layers: list[int] = field(default_factory=list)
    """Decoder layers to adapt (empty = all)."""

    def __post_init__(self):
        if self.r < 1:
            raise ValueError(f"lora.r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ValueError("lora.targets is empty")


@dataclass(frozen=True)
class Target:
    """One adapted tensor: module `name` (HF module path) and `param` (None = the whole nn.Linear,
    else the fused expert parameter), with its rank and alpha."""

    name: str
    param: str | None
    r: int
    alpha: float

    @property
    def key(self) -> str:
        """PEFT's name for rank/alpha patterns: the module path, or `module.param` for parameters."""
        return self.name if self.param is None else f"{self.name}.{self.param}"


def scaling(r: int, alpha: float, use_rslora: bool) -> float:
    return alpha / (math.sqrt(r) if use_rslora else r)


# --- modules ------------------------------------------------------------------------------------------
class WrappedLinear(nn.Module):
    """A module standing in for the nn.Linear it keeps as `base_layer` (training LoRA here; the engine's
    multi-adapter LoRA in glm5/infer/lora.py): still the same adapter target."""

    base_layer: nn.Linear

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features


class LoRALinear(WrappedLinear):
    """`base_layer(x) + scaling * lora_B(lora_A(dropout(x)))`; the base layer is frozen by the caller."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False):
        super().__init__()
        self.base_layer = base
        w = base.weight
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=w.device, dtype=w.dtype)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=w.device, dtype=w.dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.r, self.alpha, self.use_rslora, self.dropout = r, alpha, use_rslora, dropout
        self.scaling = scaling(r, alpha, use_rslora)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """s * B A: [out, in]."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    @property
    def weight(self) -> torch.Tensor:
        """The effective matrix W + s B A (for code that reads the weight instead of calling us)."""
        return self.base_layer.weight + self.delta_weight().to(self.base_layer.weight.dtype)


class ExpertLoRA(nn.Module):
    """Parametrization of a fused expert weight W [E, out, in] -> W + s * B A with A [E, r, in],
    B [E, out, r] (one rank-r pair per expert)."""

    def __init__(self, shape: torch.Size, r: int, alpha: float, use_rslora: bool, device=None, dtype=None):
        super().__init__()
        E, out_f, in_f = shape
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.dropout = 0.0  # the input is not separable from a merged weight (as PEFT's ParamWrapper)
        self.scaling = scaling(r, alpha, use_rslora)
        self.lora_A = nn.Parameter(torch.empty(E, r, in_f, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(E, out_f, r, device=device, dtype=dtype))
        # PEFT initialises its [E*r, in] nn.Linear with kaiming_uniform(a=sqrt(5)): same bound (fan_in = in)
        nn.init.kaiming_uniform_(self.lora_A.view(E * r, in_f), a=math.sqrt(5))

    def delta_weight(self) -> torch.Tensor:
        return torch.bmm(self.lora_B, self.lora_A) * self.scaling  # [E, out, in]

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + self.delta_weight().to(w.dtype)


# --- target resolution --------------------------------------------------------------------------------
def _layer_index(name: str) -> int | None:
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def candidates(model: nn.Module) -> tuple[dict[str, nn.Linear], dict[str, tuple[str, str]]]:
    """Adaptable tensors outside MTP layers: nn.Linear modules by name, and fused expert parameters
    by `module.param` name -> (module name, param)."""
    n_main = model.config.num_hidden_layers
    linears, experts = {}, {}
    for name, mod in model.named_modules():
        layer = _layer_index(name)
        if layer is not None and layer >= n_main:
            continue
        if isinstance(mod, WrappedLinear):  # already adapted: still the same target
            linears[name] = mod.base_layer
        elif isinstance(mod, nn.Linear) and not re.search(r"\.(lora_A|lora_B|base_layer)$", name):
            linears[name] = mod
        elif isinstance(mod, Experts):
            for p in EXPERT_PARAMS:
                experts[f"{name}.{p}"] = (name, p)
    return linears, experts


def _matches(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def resolve_targets(model: nn.Module, cfg: LoraConfig) -> list[Target]:
    """The tensors `cfg` adapts, in model order; an entry of `cfg.targets` that matches nothing raises
    (a name suffix that matches no module, or a group none of whose members the model has)."""
    groups = {t: TARGET_GROUPS.get(t, (t,)) for t in cfg.targets}
    suffixes = [s for members in groups.values() for s in members]
    linears, experts = candidates(model)
    layers = set(cfg.layers)
    found, used = [], set()
    for key, (mod_name, param) in [(n, (n, None)) for n in linears] + list(experts.items()):
        hit = [s for s in suffixes if _matches(key, s)]
        if not hit:
            continue
        used.update(hit)
        layer = _layer_index(mod_name)
        if layers and (layer is None or layer not in layers):
            continue
        found.append(Target(mod_name, param, cfg.r, cfg.alpha))
    unused = [t for t, members in groups.items() if not used.intersection(members)]
    if unused:
        raise ValueError(f"lora.targets: {unused} match no module or expert parameter of this model "
                         f"(groups: {sorted(TARGET_GROUPS)})")
    if not found:
        raise ValueError(f"lora.layers={cfg.layers}: no target in these layers")
    return found


# --- applying, merging, inspecting --------------------------------------------------------------------
def apply_lora(model: nn.Module, targets: list[Target], dropout: float = 0.0, use_rslora: bool = False,
               freeze: bool = True) -> nn.Module:
    """Swap in LoRA for `targets` (in place). With `freeze`, every base parameter stops training."""
    if has_lora(model):
        raise ValueError("the model already has LoRA adapters: merge or remove them first")
    if freeze:
        model.requires_grad_(False)
    for t in targets:
        mod = model.get_submodule(t.name)
        if t.param is None:
            if not isinstance(mod, nn.Linear):
                raise ValueError(f"LoRA target {t.name!r} is a {type(mod).__name__}, not nn.Linear")
            parent_name, _, child = t.name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, LoRALinear(mod, t.r, t.alpha, dropout, use_rslora))
        else:
            w = getattr(mod, t.param)
            parametrize.register_parametrization(
                mod, t.param, ExpertLoRA(w.shape, t.r, t.alpha, use_rslora, w.device, w.dtype))
    return model


def lora_layers(model: nn.Module) -> list[tuple[Target, nn.Module]]:
    """Every adapter in the model: (target, LoRALinear or ExpertLoRA)."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, LoRALinear):
            out.append((Target(name, None, mod.r, mod.alpha), mod))
        elif isinstance(mod, Experts) and parametrize.is_parametrized(mod):
            for p in EXPERT_PARAMS:
                for pm in getattr(mod.parametrizations, p, []) if parametrize.is_parametrized(mod, p) else []:
                    if isinstance(pm, ExpertLoRA):
                        out.append((Target(name, p, pm.r, pm.alpha), pm))
    return out


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (in place) and restore the plain modules: afterwards the
    model's state dict has the original names and saves as an ordinary checkpoint."""
    for t, mod in lora_layers(model):
        held = mod.base_layer if isinstance(mod, LoRALinear) else model.get_submodule(t.name)
        if parametrize.is_parametrized(held, "weight" if t.param is None else t.param) and (
                t.param is None or len(held.parametrizations[t.param]) > 1):
            raise ValueError(f"{t.key}: the base weight is held in another form (quantised); merge the "
                             "adapter onto the unquantised base")
    for t, mod in lora_layers(model):
        if isinstance(mod, LoRALinear):
            base = mod.base_layer
            base.weight.add_(mod.delta_weight().to(base.weight.dtype))
            parent_name, _, child = t.name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, base)
        else:
            parametrize.remove_parametrizations(model.get_submodule(t.name), t.param, leave_parametrized=True)
    return model


def remove_lora(model: nn.Module) -> nn.Module:
    """Drop every adapter without merging (the base weights are untouched)."""
    for t, mod in lora_layers(model):
        if isinstance(mod, LoRALinear):
            parent_name, _, child = t.name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, mod.base_layer)
        else:
            experts = model.get_submodule(t.name)
            chain = experts.parametrizations[t.param]
            if len(chain) > 1:  # the weight is also held another way (a quantised base): drop only the adapter
                del chain[next(i for i, p in enumerate(chain) if p is mod)]
            else:
                parametrize.remove_parametrizations(experts, t.param, leave_parametrized=False)
    return model


def base_tensor(model: nn.Module, t: Target) -> torch.Tensor:
    """The base tensor a target adapts ([out, in], or [E, out, in] for experts), without the adapter
    (read as stored: no delta is computed, so it works on a meta-device model too)."""
    mod = model.get_submodule(t.name)
    if t.param is None:
        return mod.base_layer.weight if isinstance(mod, WrappedLinear) else mod.weight
    if parametrize.is_parametrized(mod, t.param):
        return mod.parametrizations[t.param].original
    return getattr(mod, t.param)


def base_shape(model: nn.Module, t: Target) -> list[int]:
    """Shape of the base tensor a target adapts ([out, in], or [E, out, in] for experts)."""
    return list(base_tensor(model, t).shape)


def trainable_report(model: nn.Module) -> dict:
    """Trainable and total parameter counts (adapter included in the total, as PEFT reports)."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"trainable_params": trainable, "total_params": total, "trainable_fraction": trainable / max(1, total)}
