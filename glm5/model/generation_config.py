"""`GenerationConfig`: a checkpoint's `generation_config.json` (HF keys): the model's default decoding.

`save_pretrained` writes it (token ids from the model config, plus any sampling defaults set on
`model.generation_config`); the engine reads it once: the EOS ids it stops at (this file first, then
the tokenizer's `tokenizer_config.json`, then `config.json`) and, as vLLM does with
`generation_config="auto"`, default sampling values for requests that leave them unset. Keys we do
not model (`do_sample`, `_from_model_config`, ...) are kept in `extra` and written back unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ModelConfig, ModelConfigError

FILE_NAME = "generation_config.json"
# generation_config.json key -> SamplingParams field (vLLM's `get_diff_sampling_param` set and names).
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(kw_only=True)
class GenerationConfig:
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None  # one id or a list: generation stops at any of them
    pad_token_id: int | None = None
    do_sample: bool | None = None  # transformers' switch; written true when a sampling value is set
    temperature: float | None = None  # None: not set by the model (the engine's own default applies)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other keys, written back unchanged

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return tuple([eos] if isinstance(eos, int) else (eos or []))

    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling values this model sets, as `SamplingParams` keyword arguments."""
        return {name: getattr(self, key) for key, name in SAMPLING_KEYS.items() if getattr(self, key) is not None}

    # --- (de)serialisation -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, source: str = FILE_NAME) -> "GenerationConfig":
        if not isinstance(d, dict):
            raise ModelConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        for key in ("bos_token_id", "pad_token_id", "top_k", "max_new_tokens"):
            _check(d, key, int, source)
        for key in ("temperature", "top_p", "min_p", "repetition_penalty"):
            _check(d, key, (int, float), source)
        if d.get("do_sample") is not None and not isinstance(d["do_sample"], bool):
            raise ModelConfigError(f"{source}: 'do_sample' must be true/false, got {d['do_sample']!r}")
        eos = d.get("eos_token_id")
        if eos is not None and not (isinstance(eos, int) or (isinstance(eos, list) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in eos))):
            raise ModelConfigError(f"{source}: 'eos_token_id' must be an integer or a list of integers, got {eos!r}")
        return cls(**{k: v for k, v in d.items() if k in names},
                   extra={k: v for k, v in d.items() if k not in names})

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> "GenerationConfig":
        """What transformers derives from config.json: the special token ids, marked `_from_model_config`
        (as transformers marks it) so that readers know no generation_config.json chose them."""
        return cls(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
                   extra={"_from_model_config": True})

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "GenerationConfig | None":
        """A checkpoint directory's generation_config.json; None when it has none."""
        file = Path(path) / FILE_NAME
        if not file.is_file():
            return None
        try:
            d = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{file}: invalid JSON: {e}") from e
        return cls.from_dict(d, str(file))

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "extra" and getattr(self, f.name) is not None}
        if self.do_sample is None and set(self.sampling_defaults()) - {"max_tokens"}:
            out["do_sample"] = True  # transformers rejects sampling values with do_sample unset
        return {**out, **self.extra}

    def save(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / FILE_NAME).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _check(d: dict, key: str, types, source: str) -> None:
    v = d.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, types)):
        raise ModelConfigError(f"{source}: {key!r} must be a number, got {v!r}")
