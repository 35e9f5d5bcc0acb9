"""`ModelConfig`: the HF `config.json` of the GLM MoE family, as a typed dataclass.

One config for three architectures that share everything but the attention (`model_type` selects):
`glm_moe_dsa` (GLM-5: MLA + DSA indexer), `glm4_moe_lite` (GLM-4.7-Flash: MLA, no indexer) and
`glm4_moe` (GLM-4.5/4.6/4.7: GQA with partial rotary, optional QK-norm, q/k/v bias). Any other
`model_type` is refused naming it and the supported list.

Field names are the HF keys, so loading a checkpoint is a field-filtered dict and parity tests need no
translation table. Keys we do not model (legacy `ep_size`, `pretraining_tp`, `transformers_version`,
anything new) are kept in `extra` and written back unchanged, so a config round-trips exactly.
Derived fields (`indexer_types`, `mlp_layer_types`, `layer_types`, `qk_head_dim`, `head_dim`) follow
transformers' `GlmMoeDsaConfig.__post_init__`. glm5-only options (the seeds' routing and sparse-pattern
variants, GLM blank infilling) default to off, i.e. to real GLM-5 behaviour. A config that turns on an
option transformers' `glm_moe_dsa` cannot represent is labelled `glm5_ext` / `Glm5ExtForCausalLM`
(derived, like the per-layer lists), so transformers refuses the checkpoint instead of silently
computing a different model; every other config stays `glm_moe_dsa` and loads in transformers.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5.core.resources import configs_dir, list_configs


class ModelConfigError(ValueError):
    """A config key is missing, mistyped or inconsistent; the message names the key."""


HF_IDENTITY = ("glm_moe_dsa", ["GlmMoeDsaForCausalLM"])  # transformers' GLM-5: computes the same logits
EXT_IDENTITY = ("glm5_ext", ["Glm5ExtForCausalLM"])  # glm5-only options on: no transformers class exists
# model_type -> (transformers architecture, attention kind): "dsa" = MLA + DSA indexer, "mla" = MLA, "gqa"
MODEL_TYPES = {"glm_moe_dsa": ("GlmMoeDsaForCausalLM", "dsa"), "glm5_ext": ("Glm5ExtForCausalLM", "dsa"),
               "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", "mla"), "glm4_moe": ("Glm4MoeForCausalLM", "gqa")}


@dataclass(kw_only=True)
class ModelConfig:
    # --- identity -------------------------------------------------------------------------------
    architectures: list[str] = field(default_factory=lambda: ["GlmMoeDsaForCausalLM"])
    model_type: str = "glm_moe_dsa"
    # --- sizes (defaults: the real GLM-5) --------------------------------------------------------
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288  # dense FFN width (layers < first_k_dense_replace)
    moe_intermediate_size: int = 2048  # routed/shared expert FFN width
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64  # MLA: no GQA sharing; kept for HF compatibility
    # --- MLA ----------------------------------------------------------------------------------------
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    qk_head_dim: int = 256  # derived: nope + rope
    # MLA: derived = qk_rope_head_dim (what the rotary embedding reads); GQA: the per-head width
    # (default hidden_size // num_attention_heads)
    head_dim: int | None = None
    attention_bias: bool = False  # MLA: q_a / kv_a / o_proj biases; GQA: q / k / v biases (o_proj has none)
    use_qk_norm: bool = False  # GQA: per-head RMSNorm on queries and keys before RoPE
    attention_dropout: float = 0.0
    rope_parameters: dict = field(default_factory=lambda: {"rope_theta": 1e6, "rope_type": "default"})
    rope_interleave: bool = True  # GPT-J pairs (x[2i], x[2i+1]) in MLA; False = half-split (NeoX)
    max_position_embeddings: int = 202752
    # --- DSA lightning indexer ----------------------------------------------------------------------
    index_topk: int = 2048
    index_n_heads: int = 32
    index_head_dim: int = 128  # layout [rope qk_rope_head_dim | nope rest]
    indexer_rope_interleave: bool = True
    index_topk_freq: int | None = None  # IndexShare: a layer is full iff max(i-offset+1,0) % freq == 0
    index_skip_topk_offset: int | None = None
    index_topk_pattern: str | None = None  # explicit "FSS..." pattern; overrides freq/offset
    indexer_types: list[str] | None = None  # derived when absent: "full" | "shared" per layer
    index_share_for_mtp_iteration: bool | None = None
    # --- MoE ----------------------------------------------------------------------------------------
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"  # "sigmoid" (GLM-5) | "softmax" (the seeds' top-2 gating)
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    mlp_layer_types: list[str] | None = None  # derived when absent: "dense" | "sparse" per layer
    layer_types: list[str] | None = None  # derived: attention kind per layer
    moe_router_dtype: str | None = None
    # --- misc HF ------------------------------------------------------------------------------------
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    num_nextn_predict_layers: int = 0  # MTP layers stored at index num_hidden_layers (+i)
    # --- glm5-only options (off = real GLM-5) --------------------------------------------------------
    router_temperature: float = 1.0  # router logits are divided by this before scoring
    moe_capacity_factor: float | None = None  # None = dropless; else per-expert capacity, overflow dropped
    expert_dropout: float = 0.0  # training only: drop a routed expert assignment with this probability
    moe_type: str = "topk"  # "topk" | "soft" (dense soft mixture over all experts, causal-safe)
    sparse_attention: str = "dsa"  # "dsa" (lightning indexer top-k) | "window" (seeds' window+global+routed)
    window_size: int = 512  # window selector: local causal window (keys i-w+1..i)
    window_global_every: int = 64  # window selector: every 64th position is a global token
    window_routed_blocks: int = 4  # window selector: content-routed blocks per query
    window_block_size: int = 64  # window selector: block size for content routing
    block_position_embedding: bool = False  # GLM blank infilling: learned intra-span position embedding
    max_block_positions: int | None = None  # block-position table size; None = max_position_embeddings + 1
    # --- unknown / legacy keys, written back unchanged ---------------------------------------------
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self._check_types()
        if self.model_type not in MODEL_TYPES:
            raise ModelConfigError(f"model_type {self.model_type!r} is not supported; supported: {list(MODEL_TYPES)}")
        if self.attention_kind == "dsa":
            self.model_type, self.architectures = EXT_IDENTITY if self.non_hf_options() else HF_IDENTITY
        elif self.non_hf_options():
            raise ModelConfigError(f"glm5-only options {self.non_hf_options()} cannot be used with model_type "
                                   f"{self.model_type!r} (transformers' class would compute other logits)")
        self.architectures = [MODEL_TYPES[self.model_type][0]]
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.attention_kind == "gqa":
            self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
            if isinstance(self.rope_parameters, dict):  # transformers' Glm4MoeConfig default
                self.rope_parameters = {**self.rope_parameters}
                self.rope_parameters.setdefault("partial_rotary_factor", 0.5)
        else:
            self.head_dim = self.qk_rope_head_dim
        if self.indexer_types is None:
            self.indexer_types = _derive_indexer_types(self)
        n = self.num_hidden_layers
        n_dense = min(self.first_k_dense_replace, n)
        dense_first = ["dense"] * n_dense + ["sparse"] * (n - n_dense)
        if self.model_type == "glm4_moe_lite" and self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense"] + ["sparse"] * (n - 1)  # transformers' rule for glm4_moe_lite
        if self.mlp_layer_types is None:
            self.mlp_layer_types = dense_first
        if self.attention_kind == "gqa" and self.mlp_layer_types != dense_first:
            raise ModelConfigError(f"config key 'mlp_layer_types' = {self.mlp_layer_types!r}: glm4_moe has dense "
                                   f"layers below first_k_dense_replace={self.first_k_dense_replace}, MoE after")
        if self.layer_types is None:
            self.layer_types = ["indexed_attention"] * self.num_hidden_layers
        if self.block_position_embedding and self.max_block_positions is None:
            self.max_block_positions = self.max_position_embeddings + 1
        self._check_values()

    # ---------------------------------------------------------------------------------------------
    def _check_types(self):
        hints = {f.name: f.type for f in dataclasses.fields(self)}
        for name, tp in hints.items():
            v = getattr(self, name)
            tp = str(tp)
            if tp == "int" and (isinstance(v, bool) or not isinstance(v, int)):
                raise ModelConfigError(f"config key {name!r} must be an integer, got {v!r}")
            if tp == "float" and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ModelConfigError(f"config key {name!r} must be a number, got {v!r}")
            if tp == "bool" and not isinstance(v, bool):
                raise ModelConfigError(f"config key {name!r} must be true/false, got {v!r}")
            if tp == "str" and not isinstance(v, str):
                raise ModelConfigError(f"config key {name!r} must be a string, got {v!r}")

    def _check_values(self):
        def need(cond, key, why):
            if not cond:
                raise ModelConfigError(f"config key {key!r} = {getattr(self, key, None)!r}: {why}")

        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                    "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_n_heads", "index_topk",
                    "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"):
            need(getattr(self, key) > 0, key, "must be > 0")
        need(self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
             "must be a positive even number")
        need(self.index_head_dim >= self.qk_rope_head_dim, "index_head_dim", "must be >= qk_rope_head_dim")
        prf = self.rope_parameters.get("partial_rotary_factor", 1.0) if isinstance(self.rope_parameters, dict) else 1
        if self.attention_kind == "gqa":
            need(isinstance(self.head_dim, int) and not isinstance(self.head_dim, bool) and self.head_dim > 0,
                 "head_dim", "must be a positive integer")
            need(self.num_key_value_heads > 0 and self.num_attention_heads % self.num_key_value_heads == 0,
                 "num_key_value_heads", f"must divide num_attention_heads={self.num_attention_heads}")
            need(isinstance(prf, (int, float)) and 0 < prf <= 1 and self.rotary_dim % 2 == 0, "rope_parameters",
                 f"partial_rotary_factor = {prf!r} must be in (0, 1] and give an even rotary width "
                 f"(head_dim * factor = {self.head_dim * prf if isinstance(prf, (int, float)) else '?'})")
        else:
            need(prf == 1.0, "rope_parameters", "MLA rotates the whole qk_rope_head_dim: partial_rotary_factor "
                 "must be 1.0")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             f"cannot exceed n_routed_experts={self.n_routed_experts}")
        need(self.n_routed_experts % self.n_group == 0, "n_group", "must divide n_routed_experts")
        need(self.topk_group <= self.n_group, "topk_group", f"cannot exceed n_group={self.n_group}")
        need(self.n_group == 1 or self.n_routed_experts // self.n_group >= 2, "n_group",
             "group-limited routing sums each group's top-2 scores: groups need >= 2 experts")
        need(self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group),
             "num_experts_per_tok", "more than the experts in the kept groups")
        need(self.hidden_act == "silu", "hidden_act", "only 'silu' (SwiGLU) is supported")
        need(self.scoring_func in ("sigmoid", "softmax"), "scoring_func", "must be 'sigmoid' or 'softmax'")
        need(self.moe_type in ("topk", "soft"), "moe_type", "must be 'topk' or 'soft'")
        need(self.sparse_attention in ("dsa", "window"), "sparse_attention", "must be 'dsa' or 'window'")
        need(self.router_temperature > 0, "router_temperature", "must be > 0")
        need(self.moe_capacity_factor is None or self.moe_capacity_factor > 0, "moe_capacity_factor",
             "must be > 0 (or null for dropless)")
        need(0.0 <= self.expert_dropout < 1.0, "expert_dropout", "must be in [0, 1)")
        need(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", "must be >= 0")
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            ids = getattr(self, key)
            ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
            need(all(isinstance(i, int) and 0 <= i < self.vocab_size for i in ids), key,
                 f"token ids must be integers in [0, vocab_size={self.vocab_size})")
        rp = self.rope_parameters
        need(isinstance(rp, dict) and "rope_theta" in rp, "rope_parameters", "needs a 'rope_theta' entry")
        need(rp.get("rope_type", "default") in ("default", "longrope"), "rope_parameters",
             "only rope_type 'default' or 'longrope' (per-pair frequencies) is supported (GLM-5 uses no yarn)")
        if rp.get("rope_type") == "longrope":
            self._check_longrope(rp, need)
        n = self.num_hidden_layers
        need(len(self.indexer_types) == n, "indexer_types", f"needs {n} entries (num_hidden_layers)")
        need(set(self.indexer_types) <= {"full", "shared"}, "indexer_types", "entries must be 'full'/'shared'")
        need(self.indexer_types[0] == "full", "indexer_types", "layer 0 must be 'full' (nothing to share yet)")
        need(len(self.mlp_layer_types) == n, "mlp_layer_types", f"needs {n} entries (num_hidden_layers)")
        need(set(self.mlp_layer_types) <= {"dense", "sparse"}, "mlp_layer_types",
             "entries must be 'dense'/'sparse'")

    def _check_longrope(self, rp: dict, need) -> None:
        """`longrope` as a way to set each rotary pair's frequency (a converted Llama's shared rope key):
        factors that never change with the position and no cos/sin scaling, so every position computes
        the same angles in glm5 and in transformers."""
        half = self.rotary_dim // 2
        for key in ("short_factor", "long_factor"):
            f = rp.get(key)
            need(isinstance(f, list) and len(f) == half and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in f), "rope_parameters",
                f"longrope needs '{key}': a list of rotary width / 2 = {half} positive numbers")
        orig = rp.get("original_max_position_embeddings")
        need(isinstance(orig, int) and orig > 0, "rope_parameters",
             "longrope needs 'original_max_position_embeddings' (a positive integer)")
        need(rp["short_factor"] == rp["long_factor"] or self.max_position_embeddings <= orig, "rope_parameters",
             "longrope with long_factor != short_factor past original_max_position_embeddings changes the "
             "frequencies with the sequence length; not supported")
        factor = rp.get("factor") or self.max_position_embeddings / orig
        attention_factor = rp.get("attention_factor", 1.0 if factor <= 1.0 else None)
        need(attention_factor == 1.0, "rope_parameters",
             "longrope with an attention_factor other than 1.0 (cos/sin scaling) is not supported: "
             "set 'attention_factor': 1.0")

    # --- (de)serialisation -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ModelConfigError(f"a model config must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        if "rope_parameters" not in d and "rope_theta" in d:  # legacy top-level key
            d["rope_parameters"] = {"rope_theta": d["rope_theta"], "rope_type": "default"}
        if "partial_rotary_factor" in d and isinstance(d.get("rope_parameters"), dict):  # legacy top-level key
            d["rope_parameters"] = {"partial_rotary_factor": d.pop("partial_rotary_factor"), **d["rope_parameters"]}
        if "torch_dtype" in d and "dtype" not in d:
            d["dtype"] = d.pop("torch_dtype")
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        extra.update(d.get("extra", {}) if isinstance(d.get("extra"), dict) else {})
        extra.pop("extra", None)
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        """config.json: the keys of this model_type's transformers config (other architectures' keys left out)."""
        drop = _NOT_WRITTEN[self.attention_kind]
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "extra" and f.name not in drop
               and (getattr(self, f.name) is not None or f.name in _KEEP_NULL)}
        out.update(self.extra)
        return json.loads(json.dumps(out))  # deep copy, JSON types only

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path}: invalid JSON: {e}") from e
        return cls.from_dict(d)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        return cls.from_json_file(path / "config.json" if path.is_dir() else path)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named preset, packaged as `glm5/configs/model/<name>.toml` (`tiny`, `small`, `glm-5`, `glm-5.2`)."""
        path = configs_dir() / "model" / f"{name}.toml"
        if "/" in name or not path.is_file():
            looks_like_path = "/" in name or "\\" in name or name.startswith(".")
            what = "no such checkpoint directory" if looks_like_path else "unknown model preset"
            raise ModelConfigError(f"{what} {name!r}: give a checkpoint directory (config.json + safetensors) "
                                   f"or a preset (available: {list_presets()})")
        with open(path, "rb") as f:
            d = tomllib.load(f)
        d.update(overrides)
        return cls.from_dict(d)

    @classmethod
    def load(cls, name_or_path: str | Path, **overrides) -> "ModelConfig":
        """A preset name, a checkpoint directory, a config.json or a preset-style TOML file."""
        p = Path(name_or_path)
        if p.suffix == ".toml" and p.is_file():
            with open(p, "rb") as f:
                return cls.from_dict({**tomllib.load(f), **overrides})
        if p.exists():
            d = cls.from_pretrained(p).to_dict()
            return cls.from_dict({**d, **overrides})
        return cls.from_preset(str(name_or_path), **overrides)

    def replace(self, **changes) -> "ModelConfig":
        d = self.to_dict()
        d.update(changes)
        if "num_hidden_layers" in changes:  # re-derive the per-layer lists for the new depth
            for k in ("indexer_types", "mlp_layer_types", "layer_types"):
                if k not in changes:
                    d.pop(k, None)
        return ModelConfig.from_dict(d)

    def non_hf_options(self) -> list[str]:
        """Keys set to values that transformers' class for this model_type would ignore, computing other
        logits. (`expert_dropout` acts in training only, so inference matches and it is not listed.)"""
        differs = {"scoring_func": self.scoring_func != "sigmoid", "router_temperature": self.router_temperature != 1.0,
                   "moe_capacity_factor": self.moe_capacity_factor is not None, "moe_type": self.moe_type != "topk",
                   "sparse_attention": self.sparse_attention != "dsa",
                   "block_position_embedding": self.block_position_embedding}
        if self.attention_kind == "dsa":  # glm4_moe_lite honours rope_interleave; glm4_moe has no such key
            differs.update({"rope_interleave": not self.rope_interleave,  # transformers' GLM-5 always interleaves
                            "indexer_rope_interleave": not self.indexer_rope_interleave})
        return [key for key, on in differs.items() if on]

    @property
    def attention_kind(self) -> str:
        """"dsa" (MLA + DSA indexer: GLM-5), "mla" (GLM-4.7-Flash) or "gqa" (GLM-4.5/4.6/4.7)."""
        return MODEL_TYPES[self.model_type][1]

    @property
    def rotary_dim(self) -> int:
        """Channels each query/key head rotates: MLA's qk_rope_head_dim, GQA's head_dim * partial_rotary_factor."""
        if self.attention_kind == "gqa":
            return int(self.head_dim * self.rope_parameters.get("partial_rotary_factor", 1.0))
        return self.qk_rope_head_dim

    # --- convenience -------------------------------------------------------------------------------
    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @property
    def rope_factors(self) -> list[float] | None:
        """Per-pair frequency divisors (`longrope`'s short_factor; checked equal to long_factor where
        that one would apply), or None for the `default` rope type."""
        if self.rope_parameters.get("rope_type") == "longrope":
            return [float(x) for x in self.rope_parameters["short_factor"]]
        return None

    def rope_inv_freq(self, device=None):
        """The rotary inverse frequencies [rotary_dim / 2], fp32, as transformers computes them."""
        from .layers import rope_inv_freq

        return rope_inv_freq(self.rotary_dim, self.rope_theta, device, self.rope_factors)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"]


# Optional keys written as null when unset; every other unset optional key is left out of config.json
# (transformers' GlmMoeDsaConfig, for one, cannot take `index_topk_freq: null`).
_KEEP_NULL = {"pad_token_id", "bos_token_id", "eos_token_id"}

# Keys each attention kind leaves out of config.json: the other architectures' (transformers validates some,
# e.g. `layer_types`) and the glm5-only options, which only `glm_moe_dsa` / `glm5_ext` carry.
_DSA_KEYS = {"index_topk", "index_n_heads", "index_head_dim", "indexer_rope_interleave", "index_topk_freq",
             "index_skip_topk_offset", "index_topk_pattern", "indexer_types", "index_share_for_mtp_iteration",
             "layer_types"}
_MLA_KEYS = {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
             "rope_interleave"}
_GLM5_OPTIONS = {"router_temperature", "moe_capacity_factor", "expert_dropout", "moe_type", "sparse_attention",
                 "window_size", "window_global_every", "window_routed_blocks", "window_block_size",
                 "block_position_embedding", "max_block_positions"}
_NOT_WRITTEN = {"dsa": {"use_qk_norm"}, "mla": _DSA_KEYS | _GLM5_OPTIONS | {"use_qk_norm"},
                "gqa": _DSA_KEYS | _MLA_KEYS | _GLM5_OPTIONS | {"mlp_layer_types"}}


def _derive_indexer_types(cfg: ModelConfig) -> list[str]:
    """transformers' rule: a pattern string wins, else full iff max(i - offset + 1, 0) % freq == 0."""
    if cfg.index_topk_pattern is not None:
        bad = set(cfg.index_topk_pattern) - {"F", "S"}
        if bad:
            raise ModelConfigError(f"config key 'index_topk_pattern' has characters {sorted(bad)}; use F/S")
        return [{"F": "full", "S": "shared"}[c] for c in cfg.index_topk_pattern]
    freq = max(cfg.index_topk_freq if cfg.index_topk_freq is not None else 1, 1)
    offset = cfg.index_skip_topk_offset if cfg.index_skip_topk_offset is not None else 2
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(cfg.num_hidden_layers)]


def list_presets() -> list[str]:
    return list_configs("model")
