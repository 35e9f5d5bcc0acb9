"""HF checkpoint interchange: load and save `GlmMoeDsaForCausalLM` directories (config.json + safetensors).

On disk, experts are stored one by one (`mlp.experts.{e}.gate_proj.weight`, ...); in memory we keep them
fused (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]),
as transformers v5 does. Loading is memory-mapped and tensor by tensor (the model is built on the meta
device and materialised once), FP8 e4m3 block-scaled weights (`weight_scale_inv`) are dequantised on the
fly, and every missing, unexpected, mis-shaped, non-finite or checksum-failing tensor raises
`CheckpointError` naming it and its file (as does a garbled config.json or an unreadable shard), before
the model is used. Only safetensors are ever read: nothing is unpickled.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from glm5.core.io import CheckpointError, LazyTensors, check_finite, safetensors_files, save_sharded

from .config import ModelConfig
from .generation_config import GenerationConfig
from .model import GLM5ForCausalLM

_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# Kept in fp32 whatever the model dtype (as transformers' _keep_in_fp32_modules(_strict)).
FP32_SUFFIXES = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")


# --- state dict <-> HF names -------------------------------------------------------------------------
def state_dict_to_hf(model: GLM5ForCausalLM) -> dict[str, torch.Tensor]:
    """Our state dict with fused experts split into HF's per-expert on-disk names."""
    out = {}
    for name, t in model.state_dict().items():
        m = _FUSED.match(name)
        if m is None:
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    return out


def _hf_sources(name: str, shape: torch.Size) -> list[str]:
    """HF on-disk names that make up our tensor `name`."""
    m = _FUSED.match(name)
    if m is None:
        return [name]
    prefix, kind = m.groups()
    parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    return [f"{prefix}.{e}.{p}.weight" for e in range(shape[0]) for p in parts]


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """Checkpoint keys we knowingly do not load."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    m = re.match(r"^model\.layers\.(\d+)\.(embed_tokens\.weight|shared_head\.head\.weight)$", name)
    return bool(m) and int(m.group(1)) >= cfg.num_hidden_layers  # MTP copies of the tied embed/head


# --- FP8 ------------------------------------------------------------------------------------------------
def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """W [..., N, K] = W_fp8 * scale, each scale of scale_inv [..., ceil(N/b0), ceil(K/b1)] covering a
    block[0] x block[1] tile (ragged edge tiles included); leading dims (experts) broadcast as they come."""
    out_f, in_f = w.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], -2)[..., :out_f, :]
    s = s.repeat_interleave(block[1], -1)[..., :in_f]
    return fp8_to_float(w) * s


def fp8_to_float(w: torch.Tensor) -> torch.Tensor:
    """w.float(); for float8 on CPU through a 256-entry table (the same values, NaNs included): 2.4 vs
    12.5 ms for a [4, 1536, 576] tensor on one thread of this 2-core machine (the dtype conversion is
    the cost of dequantising FP8 weights per forward, glm5/finetune/quant_base.py)."""
    if w.device.type != "cpu" or w.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return w.float()
    table = torch.arange(256, dtype=torch.uint8).view(w.dtype).float()
    return table.index_select(0, w.reshape(-1).view(torch.uint8).int()).view(w.shape)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for tests, exports and a FP8-held base: per-tile absmax scaling of w [..., N, K] into
    float8_e4m3fn -> (fp8 [..., N, K], fp32 scale [..., ceil(N/b0), ceil(K/b1)])."""
    *lead, out_f, in_f = w.shape
    bo, bi = block
    rows, cols = -(-out_f // bo), -(-in_f // bi)
    padded = torch.zeros(*lead, rows * bo, cols * bi, dtype=torch.float32, device=w.device)
    padded[..., :out_f, :in_f] = w.float()
    tiles = padded.view(*lead, rows, bo, cols, bi)
    amax = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-12)  # [..., rows, cols]
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (tiles / scale[..., :, None, :, None]).view(*lead, rows * bo, cols * bi)[..., :out_f, :in_f]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


# A weight read as its checkpoint holds it: (fp8 [..., N, K], scale [..., P, ceil(N/P/b0), ceil(K/b1)]),
# P = the on-disk tensors fused into it along N (2 for gate_up_proj, else 1), each with its own tiles.
FP8Parts = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class WeightStore:
    """Where a weight held in a quantised form (a frozen fine-tuning base, glm5/finetune/quant_base.py)
    is fed from the checkpoint: `put` gets the tensor in our layout, fp32 (dequantised if FP8 on disk),
    or with `keep_fp8` and a FP8 checkpoint its `FP8Parts` untouched."""

    shape: torch.Size
    keep_fp8: bool
    put: Callable[[torch.Tensor | FP8Parts], None]


class _Reader:
    """Reads HF tensors by name, dequantising FP8 weights; remembers which checkpoint keys were used."""

    def __init__(self, tensors: LazyTensors, cfg: ModelConfig):
        self.t = tensors
        self.used: set[str] = set()
        qc = cfg.extra.get("quantization_config") or {}
        self.block = tuple(qc.get("weight_block_size") or (128, 128))

    def get(self, name: str) -> torch.Tensor:
        x = self.get_raw(name)
        if isinstance(x, tuple):
            x = dequantize_fp8(*x, self.block)
        check_finite(x, name, self.t.file_of(name))
        return x

    def get_raw(self, name: str) -> torch.Tensor | FP8Parts:
        """The tensor as stored: a FP8 weight as (fp8, scale_inv), not dequantised (nor finite-checked)."""
        if name not in self.t:
            where = self.t.files[0].parent if self.t.files else "checkpoint"
            raise CheckpointError(f"{where}: missing tensor {name!r} in checkpoint")
        self.used.add(name)
        x = self.t.get(name)  # checksum-verified when the reader asked for it
        if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_name = name + "_scale_inv"
            if scale_name not in self.t:
                raise CheckpointError(f"{self.t.file_of(name)}: FP8 tensor {name!r} has no {scale_name!r} next to it")
            self.used.add(scale_name)
            return x, self.t.get(scale_name).float()
        return x


# --- loading --------------------------------------------------------------------------------------------
def _read(reader: _Reader, tensors: LazyTensors, name: str, shape: torch.Size, keep_fp8: bool = False
          ) -> torch.Tensor | FP8Parts:
    """Our tensor `name` of `shape` from its HF source(s): fused experts are stacked per expert (gate rows
    then up rows). With `keep_fp8` and FP8 sources, their fp8 values and scales untouched."""
    sources = _hf_sources(name, shape)
    fused = _FUSED.match(name) is not None  # (a single expert's down_proj is one source too, but fused)
    raw = [reader.get_raw(s) for s in sources] if keep_fp8 else []
    as_fp8 = bool(raw) and all(isinstance(r, tuple) for r in raw)
    if as_fp8:
        per = [r[0] for r in raw]
    else:
        per = [reader.get(s) for s in sources]  # dequantised, finite-checked
    if fused:
        k = len(per) // shape[0]  # 2 (gate, up) or 1 (down) tensors per expert
        want = torch.Size([shape[1] // k, shape[2]])
        for s, p in zip(sources, per):
            if p.shape != want:
                raise CheckpointError(f"{tensors.file_of(s)}: tensor {s!r} has shape {list(p.shape)}, "
                                      f"expected {list(want)}")
        src = torch.stack([torch.cat(per[e * k:(e + 1) * k], dim=0) for e in range(shape[0])])
    else:
        src = per[0]
    if src.shape != shape:
        raise CheckpointError(f"{tensors.file_of(sources[0])}: tensor {sources[0]!r} has shape "
                              f"{list(src.shape)}, expected {list(shape)}")
    if not as_fp8:
        return src
    scales = [r[1] for r in raw]
    if fused:  # [E, P, R, C]: each on-disk part keeps its own tiles
        k = len(scales) // shape[0]
        scale = torch.stack([torch.stack(scales[e * k:(e + 1) * k]) for e in range(shape[0])])
    else:
        scale = scales[0][None]  # [1, R, C]
    return src, scale


@torch.no_grad()
def load_hf_state_dict(model: GLM5ForCausalLM, tensors: LazyTensors, strict: bool = True,
                       stores: Mapping[str, WeightStore] | None = None) -> None:
    """Copy HF-named tensors into `model` (already materialised), one tensor at a time. `stores`: weights
    held quantised (by our name), fed through their `WeightStore` instead of copied."""
    reader = _Reader(tensors, model.config)
    stores = stores or {}
    held = {re.sub(r"\.parametrizations\.(\w+)\.original$", r".\1", n) for n, _ in model.named_parameters()
            if n.endswith(".original")}
    if held - set(stores):
        raise ValueError(f"parametrized weights without a WeightStore to load them: {sorted(held - set(stores))[:5]}")
    targets = {n: p for n, p in model.named_parameters() if ".parametrizations." not in n}
    targets.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    for name, dst in targets.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        dst.copy_(_read(reader, tensors, name, dst.shape).to(dst.dtype))
    for name, store in stores.items():
        store.put(_read(reader, tensors, name, store.shape, store.keep_fp8))
    extra = [k for k in tensors.keys() if k not in reader.used and not _ignorable(k, model.config)]
    if strict and extra:
        first = sorted(extra)[0]
        raise CheckpointError(f"{tensors.file_of(first)}: unexpected tensor(s) in checkpoint: {sorted(extra)[:10]}"
                              f"{' ...' if len(extra) > 10 else ''} ({len(extra)} in all)")


def default_dtype(cfg: ModelConfig, device: str | torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 matmul is very slow there); the checkpoint's dtype elsewhere."""
    if torch.device(device).type == "cpu":
        return torch.float32
    name = cfg.extra.get("dtype") or cfg.extra.get("torch_dtype") or "bfloat16"
    return getattr(torch, str(name).replace("torch.", ""), torch.bfloat16)


def cast_model(model: GLM5ForCausalLM, dtype: torch.dtype) -> GLM5ForCausalLM:
    """Cast to `dtype`, keeping the router, its bias and the indexer head weights in fp32, and weights held
    quantised (parametrized storage and scales: glm5/finetune/quant_base.py) as they are."""
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        held = p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or (
            ".parametrizations." in name and name.endswith(".scale"))  # quantised storage and its scales
        if held or not p.is_floating_point():
            continue
        p.data = p.data.float() if name.endswith(FP32_SUFFIXES) or name.endswith("inv_freq") else p.data.to(dtype)
    return model


def build_empty(cfg: ModelConfig, device="cpu", dtype=torch.float32,
                model_cls: type[GLM5ForCausalLM] = GLM5ForCausalLM,
                on_meta: Callable[[GLM5ForCausalLM], None] | None = None) -> GLM5ForCausalLM:
    """Build on the meta device (no memory, no init), then allocate uninitialised storage once.
    `model_cls`: GLM5ForCausalLM or a subclass that adds methods (e.g. glm5.finetune's adapter model);
    `on_meta(model)` runs before storage is allocated (e.g. to swap weights for quantised storage)."""
    with torch.device("meta"):
        model = model_cls(cfg)
        if on_meta is not None:
            on_meta(model)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty allocates each module's parameters apart: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    cast_model(model, dtype)
    model.model.inv_freq.copy_(cfg.rope_inv_freq())
    return model


def from_pretrained(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                    strict: bool = True, model_cls: type[GLM5ForCausalLM] = GLM5ForCausalLM,
                    hold: Callable[[GLM5ForCausalLM], Mapping[str, WeightStore]] | None = None) -> GLM5ForCausalLM:
    """Load a HF-format GLM-5 checkpoint directory (single-file or sharded safetensors, FP8 or not).
    `hold(meta_model)` swaps weights for other storage before any is allocated and says where each is fed
    (a quantised frozen base: glm5/finetune/quant_base.py)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no config.json)")
    cfg = load_config(path)
    dtype = dtype or default_dtype(cfg, device)
    stores: dict[str, WeightStore] = {}
    model = build_empty(cfg, device, dtype, model_cls, None if hold is None else lambda m: stores.update(hold(m)))
    load_hf_state_dict(model, LazyTensors(safetensors_files(path), verify=True), strict=strict, stores=stores)
    model.generation_config = GenerationConfig.from_pretrained(path) or model.generation_config
    return model.eval()


def load_config(path: Path) -> ModelConfig:
    """The checkpoint's config.json; any problem with it is a `CheckpointError` naming the file."""
    try:
        return ModelConfig.from_pretrained(path)
    except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError) as e:
        msg = str(e) if str(path) in str(e) else f"{path / 'config.json'}: {e}"
        raise CheckpointError(f"{msg} ({type(e).__name__})" if not isinstance(e, ValueError) else msg) from None


def save_pretrained(model: GLM5ForCausalLM, path: str | Path, max_shard_size: int | str = "5GB",
                    dtype: torch.dtype | None = None) -> None:
    """Write config.json, generation_config.json (`model.generation_config`: the token ids from the config
    plus any sampling defaults set on it) and HF-named safetensors (sharded past max_shard_size)."""
    path = Path(path)
    cfg = model.config
    tensors = state_dict_to_hf(model)
    if dtype is not None:
        tensors = {k: (v if k.endswith(FP32_SUFFIXES) else v.to(dtype)) for k, v in tensors.items()}
    save_sharded({k: v.detach().cpu() for k, v in tensors.items()}, path, max_shard_size)
    d = cfg.to_dict()
    d["dtype"] = str(dtype or next(model.parameters()).dtype).replace("torch.", "")
    (path / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    model.generation_config.save(path)


def convert_checkpoint(src: str | Path, dst: str | Path, dtype: torch.dtype | None = torch.bfloat16,
                       max_shard_size: int | str = "5GB") -> dict:
    """Stream a HF checkpoint into a new directory: FP8 block-scaled weights dequantised, everything cast
    to `dtype` (fp32-kept tensors stay fp32), re-sharded. Memory stays at about one output shard, so
    a 744B FP8 checkpoint converts on a machine that could never hold the model."""
    from glm5.core.io import parse_size, save_file_checked

    src, dst = Path(src), Path(dst)
    cfg = ModelConfig.from_pretrained(src)
    reader = _Reader(LazyTensors(safetensors_files(src)), cfg)
    dst.mkdir(parents=True, exist_ok=True)
    limit, shard, size, names = parse_size(max_shard_size), {}, 0, []
    weight_map: dict[str, int] = {}

    def flush():
        nonlocal shard, size
        if shard:
            names.append(f"part-{len(names)}.safetensors")
            save_file_checked(shard, dst / names[-1])
            weight_map.update({k: len(names) - 1 for k in shard})
            shard, size = {}, 0

    for name in sorted(reader.t.keys()):
        if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in reader.t:
            continue  # consumed with its weight
        t = reader.get(name)
        if dtype is not None and t.is_floating_point() and not name.endswith(FP32_SUFFIXES):
            t = t.to(dtype)
        n = t.numel() * t.element_size()
        if shard and size + n > limit:
            flush()
        shard[name] = t.contiguous()
        size += n
    flush()
    final = ["model.safetensors"] if len(names) == 1 else [
        f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" for i in range(len(names))]
    for old, new in zip(names, final):
        (dst / old).rename(dst / new)
    if len(final) > 1:
        total = sum((dst / f).stat().st_size for f in final)
        index = {"metadata": {"total_size": total}, "weight_map": {k: final[i] for k, i in weight_map.items()}}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    d = cfg.to_dict()
    d.pop("quantization_config", None)
    if dtype is not None:
        d["dtype"] = str(dtype).replace("torch.", "")
    (dst / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                  "special_tokens_map.json"):
        if (src / extra).is_file():
            (dst / extra).write_bytes((src / extra).read_bytes())
    return {"tensors": len(weight_map), "files": final}
