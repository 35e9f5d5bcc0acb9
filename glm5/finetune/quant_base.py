"""A frozen low-precision base for LoRA and prefix fine-tuning (QLoRA-style): `[model] base_quant`.

The base's linear weights inside the decoder layers and its routed experts are held as INT8 (the serving
quantiser's format, glm5/infer/quant.py: one fp32 scale per output channel, per expert) or as FP8 e4m3
with 128 x 128 block scales (the released checkpoints' format, glm5/model/hf_adapter.py). Each is a torch
parametrization on the module's own weight: the stored tensor is the int8 / fp8 one, and every read of
`module.weight` (or `experts.gate_up_proj`) returns the dequantised matrix in the compute dtype, made
at that moment. So nn.Linear stays nn.Linear (LoRALinear wraps it unchanged), the routed experts' LoRA
(`ExpertLoRA`) chains after the dequantisation on the same parameter, and code that reads the matrix
(absorbed MLA's `kv_b_proj.weight`, the indexer) sees the effective weight. The stored tensors never
require grad: gradients reach the adapters and the activations only. Autograd keeps a module's
dequantised matrix until that module's backward (as it keeps an activation); with
`precision.activation_checkpointing` only the layer being recomputed holds one.

Kept at the base dtype: embeddings, LM head, norms, the router and `indexer.weights_proj` (fp32 in
transformers too). A FP8 checkpoint loads with `base_quant = "fp8"` tensor by tensor as it is stored;
any other source is quantised tensor by tensor as it is read, so the whole model never exists in fp32.
Saved adapters are ordinary PEFT files: they load onto the unquantised base and into PEFT.

Dims: E experts, N out features, K in features, P on-disk tensors fused into one (gate_up: 2), R x C tiles.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.nn.utils import parametrize

from glm5.infer.quant import dequantize_weight, quantize_weight
from glm5.model import hf_adapter
from glm5.model.hf_adapter import FP8Parts, WeightStore, dequantize_fp8, quantize_fp8
from glm5.model.model import GLM5ForCausalLM
from glm5.model.moe import Experts

BaseQuant = Literal["none", "int8", "fp8"]
BASE_QUANTS = ("none", "int8", "fp8")
_KEEP = ("indexer.weights_proj",)  # linear weights under model.layers kept at the base dtype
FP8_BLOCK = (128, 128)


class Int8Weight(nn.Module):
    """Parametrization: int8 [..., N, K] -> q * scale [..., N] in `dtype` (glm5.infer.quant's format)."""

    frozen_storage = True  # its scale is the base's: not in fine-tuning checkpoints (glm5/train/parallel_ckpt.py)

    def __init__(self, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("scale", scale)
        self.dtype = dtype

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return self.dequant(q, self.scale)

    def dequant(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize_weight(q, scale).to(self.dtype)

    def split(self, dim: int, lo: int, hi: int) -> Int8Weight:
        """The parametrization of rows (dim -2) or columns (dim -1) [lo, hi) of the weight (tensor
        parallel): a row's scale goes with it, the columns keep them all."""
        return Int8Weight((self.scale[..., lo:hi] if dim == -2 else self.scale).clone(), self.dtype)

    def select(self, lo: int, hi: int) -> Int8Weight:
        """The parametrization of experts [lo, hi) of a fused [E, ...] weight (expert parallel)."""
        return Int8Weight(self.scale[lo:hi].clone(), self.dtype)

    @staticmethod
    def quantize(w: torch.Tensor, parts: int, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_weight(w)  # per output channel: fused parts need nothing special

    @staticmethod
    def empty(shape: torch.Size, parts: int, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(shape, dtype=torch.int8), torch.empty(shape[:-1])


class FP8Weight(nn.Module):
    """Parametrization: fp8 e4m3 [..., N, K] with tile scales [..., P, R, C] (each of the P fused parts
    tiled on its own, as its on-disk tensor was) -> W in `dtype`."""

    frozen_storage = True

    def __init__(self, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype):
        super().__init__()
        self.register_buffer("scale", scale)
        self.block, self.dtype = block, dtype

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return self.dequant(w, self.scale)

    def dequant(self, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        *lead, n, k = w.shape
        parts = w.view(*lead, scale.shape[-3], -1, k)  # [..., P, N/P, K]
        return dequantize_fp8(parts, scale, self.block).view(w.shape).to(self.dtype)

    def split(self, dim: int, lo: int, hi: int) -> FP8Weight:
        """The parametrization of rows (dim -2) or columns (dim -1) [lo, hi) of an unfused weight (tensor
        parallel): their tiles' scales. Raises ValueError unless the slice starts on a tile edge."""
        size = self.block[0 if dim == -2 else 1]
        if self.scale.shape[-3] != 1:
            raise ValueError("tensor parallel: a fused FP8 weight cannot be split")
        if lo % size:
            raise ValueError(f"{hi - lo} {'rows' if dim == -2 else 'columns'} per tensor-parallel rank do not "
                             f"align with the FP8 block {list(self.block)}")
        tiles = slice(lo // size, -(-hi // size))
        scale = self.scale[..., tiles, :] if dim == -2 else self.scale[..., tiles]
        return FP8Weight(scale.clone(), self.block, self.dtype)

    def select(self, lo: int, hi: int) -> FP8Weight:
        """The parametrization of experts [lo, hi) of a fused [E, ...] weight (expert parallel)."""
        return FP8Weight(self.scale[lo:hi].clone(), self.block, self.dtype)

    @staticmethod
    def quantize(w: torch.Tensor, parts: int, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        *lead, n, k = w.shape
        q, scale = quantize_fp8(w.reshape(*lead, parts, n // parts, k), block)  # [..., P, N/P, K], [..., P, R, C]
        return q.view(w.shape), scale

    @staticmethod
    def empty(shape: torch.Size, parts: int, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        *lead, n, k = shape
        rows, cols = -(-(n // parts) // block[0]), -(-k // block[1])
        return torch.empty(shape, dtype=torch.float8_e4m3fn), torch.empty(*lead, parts, rows, cols)


WEIGHT_KINDS: dict[str, type[Int8Weight] | type[FP8Weight]] = {"int8": Int8Weight, "fp8": FP8Weight}


def check_base_quant(value: str, key: str = "model.base_quant") -> None:
    if value not in BASE_QUANTS:
        raise ValueError(f"{key} = {value!r}: must be one of {list(BASE_QUANTS)}")


def quant_targets(model: GLM5ForCausalLM) -> Iterator[tuple[str, nn.Module, str, int]]:
    """(our tensor name, module, attribute, P fused on-disk parts) of every weight held quantised: the
    nn.Linear weights under `model.layers` (but `_KEEP`) and the routed experts' fused weights."""
    for name, mod in model.named_modules():
        if not name.startswith("model.layers."):
            continue
        if isinstance(mod, nn.Linear) and not name.endswith(_KEEP):
            yield f"{name}.weight", mod, "weight", 1
        elif isinstance(mod, Experts):
            yield f"{name}.gate_up_proj", mod, "gate_up_proj", 2
            yield f"{name}.down_proj", mod, "down_proj", 1


def _hold(mod: nn.Module, attr: str, storage: torch.Tensor, weight: nn.Module) -> None:
    """Replace `mod.attr` by frozen `storage` read through the parametrization `weight`."""
    mod._parameters[attr] = nn.Parameter(storage, requires_grad=False)
    parametrize.register_parametrization(mod, attr, weight, unsafe=True)  # unsafe: the dtype changes


def _weight(kind: str, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> nn.Module:
    return Int8Weight(scale, dtype) if kind == "int8" else FP8Weight(scale, block, dtype)


def quantize_base(model: GLM5ForCausalLM, kind: BaseQuant, block: tuple[int, int] = FP8_BLOCK) -> GLM5ForCausalLM:
    """Hold an already loaded model's eligible weights quantised (in place), module by module; the
    compute dtype is each weight's current dtype."""
    check_base_quant(kind)
    if kind == "none":
        return model
    cls = WEIGHT_KINDS[kind]
    for _, mod, attr, parts in list(quant_targets(model)):
        w = getattr(mod, attr).detach()
        q, scale = cls.quantize(w, parts, block)
        _hold(mod, attr, q, _weight(kind, scale, block, w.dtype))
    return model


@torch.no_grad()
def _put(mod: nn.Module, attr: str, kind: str, parts: int, block: tuple[int, int],
         src: torch.Tensor | FP8Parts) -> None:
    """Fill one held weight from the checkpoint: FP8 parts as stored, anything else quantised here."""
    plist = mod.parametrizations[attr]
    q, scale = src if isinstance(src, tuple) else WEIGHT_KINDS[kind].quantize(src, parts, block)
    plist.original.copy_(q)
    plist[0].scale.copy_(scale)


def _hold_empty(model: GLM5ForCausalLM, kind: str, block: tuple[int, int], dtype: torch.dtype
                ) -> Mapping[str, WeightStore]:
    """On the meta model: swap every target for empty quantised storage; -> where the loader feeds each."""
    stores = {}
    cls = WEIGHT_KINDS[kind]
    for name, mod, attr, parts in list(quant_targets(model)):
        shape = getattr(mod, attr).shape
        q, scale = cls.empty(shape, parts, block)
        _hold(mod, attr, q, _weight(kind, scale, block, dtype))
        stores[name] = WeightStore(shape, kind == "fp8", partial(_put, mod, attr, kind, parts, block))
    return stores


def load_base(path: str | Path, kind: BaseQuant, dtype: torch.dtype | None = None,
              device: str | torch.device = "cpu", strict: bool = True,
              model_cls: type[GLM5ForCausalLM] = GLM5ForCausalLM) -> GLM5ForCausalLM:
    """A HF checkpoint directory loaded with its eligible weights held as `kind` (tensor by tensor, never
    the whole model in fp32); `dtype` is the compute dtype of everything else and of the dequantised
    weights (default: fp32 on CPU, the checkpoint's elsewhere)."""
    check_base_quant(kind)
    if kind == "none":
        return hf_adapter.from_pretrained(path, dtype=dtype, device=device, strict=strict, model_cls=model_cls)
    cfg = hf_adapter.load_config(Path(path))
    qc = cfg.extra.get("quantization_config") or {}
    block = tuple(qc.get("weight_block_size") or FP8_BLOCK)
    dtype = dtype or hf_adapter.default_dtype(cfg, device)
    return hf_adapter.from_pretrained(path, dtype=dtype, device=device, strict=strict, model_cls=model_cls,
                                      hold=partial(_hold_empty, kind=kind, block=block, dtype=dtype))


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (Int8Weight, FP8Weight)) for m in model.modules())


def base_bytes(model: nn.Module) -> int:
    """Bytes of the base's tensors (parameters and buffers, adapters excluded; a tied tensor once)."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "lora_" in name or "prefix" in name or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
