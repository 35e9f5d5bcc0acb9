"""The user-facing adapter API: `glm5.from_pretrained(base, adapter=DIR)`, `model.load_adapter(DIR)`,
`model.save_adapter(DIR)`, `model.merge_adapter()`, and `merge_checkpoint` behind `glm5 merge`.

`GLM5AdapterModel` is `GLM5ForCausalLM` with these methods added and nothing else changed (same
forward, same state dict until an adapter is applied); it lives here, above `glm5.model`, because
adapters are applied from outside the model. Formats: PEFT LoRA (`peft_adapter.py`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from glm5.core.io import atomic_dir, safetensors_files
from glm5.model import hf_adapter, lora, peft_adapter
from glm5.model.model import GLM5ForCausalLM

from . import prefix, quant_base

# Files copied from the base checkpoint next to a merged one (tokenizer and generation defaults).
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "special_tokens_map.json")


class GLM5AdapterModel(GLM5ForCausalLM):
    """A GLM-5 causal LM that can carry a LoRA adapter (PEFT format on disk)."""

    name_or_path: str = ""  # the base checkpoint it was loaded from (recorded in saved adapters)

    def add_lora(self, cfg: lora.LoraConfig) -> list[lora.Target]:
        """Attach a fresh adapter (B = 0: the model's outputs are unchanged) and freeze the base."""
        targets = lora.resolve_targets(self, cfg)
        lora.apply_lora(self, targets, cfg.dropout, cfg.use_rslora)
        return targets

    def load_adapter(self, path: str | Path, dropout: float | None = None) -> None:
        """Apply the adapter in `path`, a PEFT LoRA or a latent prefix (replacing any adapter already
        applied, which is dropped)."""
        kind = peft_adapter.adapter_kind(path)
        lora.remove_lora(self)
        prefix.remove_prefix(self)
        if kind == "prefix":
            prefix.load_prefix(self, path)
        else:
            peft_adapter.load_adapter(self, path, dropout)

    def save_adapter(self, path: str | Path) -> Path:
        """Write the adapter: a PEFT LoRA directory, or the latent prefix files."""
        if prefix.has_prefix(self):
            return prefix.save_prefix(self, path, self.name_or_path)
        return peft_adapter.save_adapter(self, path, self.name_or_path)

    def merge_adapter(self) -> "GLM5AdapterModel":
        """Fold the LoRA adapter into the base weights (in place); the result saves as a plain checkpoint.
        A prefix has no weights to fold into: it is served as cache entries (docs/finetune.md)."""
        if prefix.has_prefix(self):
            raise ValueError("a prefix adapter cannot be merged into the weights; serve it with the engine")
        if quant_base.is_quantized(self):
            raise ValueError("the base is held quantised (model.base_quant): merge the adapter onto the "
                             "unquantised base checkpoint instead (glm5 merge BASE ADAPTER OUT)")
        return lora.merge_lora(self)

    def trainable_report(self) -> dict:
        return lora.trainable_report(self)


def from_pretrained(path: str | Path, adapter: str | Path | None = None, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu", strict: bool = True,
                    base_quant: quant_base.BaseQuant = "none") -> GLM5AdapterModel:
    """Load a HF-format GLM-5 checkpoint (see `glm5.model.hf_adapter.from_pretrained`), its weights held
    as `base_quant` (`quant_base.load_base`), then the adapter directory `adapter` if given."""
    model = quant_base.load_base(path, base_quant, dtype=dtype, device=device, strict=strict,
                                 model_cls=GLM5AdapterModel)
    model.name_or_path = str(path)
    if adapter is not None:
        model.load_adapter(adapter)
    return model.eval()


def merge_checkpoint(base: str | Path, adapter: str | Path, out: str | Path,
                     dtype: torch.dtype | None = None) -> Path:
    """`glm5 merge`: base + adapter -> a plain HF checkpoint in `out` (atomically), with the base's
    tokenizer and generation config copied next to it."""
    model = from_pretrained(base, adapter=adapter)  # a sharded base (index + several files) too
    model.merge_adapter()
    out = Path(out)
    files = safetensors_files(base)
    # a sharded base gives a sharded merge, files no larger than the base's largest
    shard = max(f.stat().st_size for f in files) if len(files) > 1 else "5GB"
    with atomic_dir(out) as tmp:
        hf_adapter.save_pretrained(model, tmp, max_shard_size=shard, dtype=dtype)
        for name in SIDE_FILES:
            if (Path(base) / name).is_file():
                shutil.copyfile(Path(base) / name, tmp / name)
    return out
