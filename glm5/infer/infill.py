"""Infill prompts: text before and after a gap (plus other files as context) -> engine prompt ids.

Two prompt formats, picked per model (`choose_format`):
- `glm`: GLM autoregressive blank infilling (seed M4; needs a model trained with the `glm` objective,
  i.e. a block-position table): Part A = context + prefix + [MASK] + suffix, attended bidirectionally,
  then `<sop>` and the span is generated until `<eop>` (`glm5.data.infilling.infill_prompt`). Any edit
  anywhere in Part A changes all of its KV, so a repeat request reuses the cache only when Part A is
  identical.
- `spm` / `psm`: fill-in-the-middle with sentinel tokens on a causal model (StarCoder / Qwen-coder / the
  glm5 code tokenizer's `<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>`). `spm` puts the suffix first
  (`<suf> suffix <pre> context + prefix <mid>`), so typing at the cursor keeps the suffix and most of the
  prefix in the prefix cache; `psm` is the order most FIM models (and llama.cpp by default) use.

Too long inputs are truncated from the far ends (llama.cpp's split: the suffix gets at most a quarter
of the room, the prefix the rest, other files what is left), or refused. Knows no HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from glm5.data.infilling import InfillLayout, InfillTokens, infill_prompt
from glm5.data.tokenizer import FIM_TOKENS as GLM5_FIM_TOKENS

InfillFormat = Literal["glm", "spm", "psm"]
# Sentinel spellings, in the order they are looked up: (prefix, suffix, middle)
FIM_TOKENS = (GLM5_FIM_TOKENS, ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))
GLM_TOKENS = ("[MASK]", "[sMASK]", "[gMASK]", "<sop>", "<eop>")


class InfillTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def token_to_id(self, token: str) -> int | None: ...


class InfillError(ValueError):
    """A request that cannot be turned into an infill prompt; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class InfillPrompt:
    token_ids: list[int]
    layout: InfillLayout | None  # GLM Part A / Part B layout; None for sentinel (causal) formats
    format: InfillFormat
    truncated: dict[str, int] = field(default_factory=dict)  # tokens dropped per part (prefix/suffix/extra)

    @property
    def is_truncated(self) -> bool:
        return any(self.truncated.values())


def fim_tokens(tokenizer: InfillTokenizer) -> tuple[int, int, int] | None:
    """(prefix, suffix, middle) sentinel ids, or None when the tokenizer has none."""
    for names in FIM_TOKENS:
        ids = [tokenizer.token_to_id(n) for n in names]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]
    return None


def glm_tokens(tokenizer: InfillTokenizer) -> InfillTokens | None:
    ids = [tokenizer.token_to_id(n) for n in GLM_TOKENS]
    return None if any(i is None for i in ids) else InfillTokens(*ids)


def choose_format(tokenizer: InfillTokenizer, has_block_positions: bool,
                  requested: InfillFormat | Literal["auto"] = "auto") -> InfillFormat:
    """The format to use for this model, or `InfillError` saying what the model lacks."""
    fim, glm = fim_tokens(tokenizer) is not None, glm_tokens(tokenizer) is not None
    can_glm = glm and has_block_positions
    if requested == "auto":
        if fim:
            return "spm"
        if can_glm:
            return "glm"
        raise InfillError("this model cannot infill: its tokenizer has no fill-in-the-middle tokens "
                          f"({', '.join(FIM_TOKENS[0])}) and it is not a GLM blank-infilling model "
                          "([MASK]/<sop>/<eop> tokens and block_position_embedding = true)")
    if requested == "glm" and not can_glm:
        raise InfillError("infill format 'glm' needs [MASK], <sop>, <eop> in the tokenizer and a model "
                          "trained for blank infilling (block_position_embedding = true)")
    if requested in ("spm", "psm") and not fim:
        raise InfillError(f"infill format {requested!r} needs the tokenizer's fill-in-the-middle tokens "
                          f"({', '.join(FIM_TOKENS[0])})")
    return requested


def _take(ids: list[int], n: int, from_end: bool) -> list[int]:
    n = max(n, 0)
    if n >= len(ids):
        return ids
    return ids[len(ids) - n:] if from_end else ids[:n]


def build_infill(tokenizer: InfillTokenizer, fmt: InfillFormat, prefix: str, suffix: str, *,
                 room: int, extra: list[tuple[str, str]] = (), middle_start: str = "",
                 truncate: bool = True) -> InfillPrompt:
    """Prompt ids for the gap between `prefix` and `suffix`, within `room` prompt tokens.
    `extra`: (filename, text) context files placed before the prefix; `middle_start`: text the middle
    starts with (llama.cpp's `prompt`: the line typed so far), part of the prefix side."""
    pre = tokenizer.encode(prefix + middle_start)
    suf = tokenizer.encode(suffix)
    ext = tokenizer.encode("".join(f"{name}\n{text}\n\n" for name, text in extra)) if extra else []
    n_special = 3  # [MASK] + suffix + <sop> (glm) or the three sentinels
    room -= n_special
    if room < 1:
        raise InfillError("no room left for the prompt: lower max_tokens (n_predict)", "max_tokens")
    need = len(pre) + len(suf) + len(ext)
    if need > room and not truncate:
        raise InfillError(f"the infill prompt needs {need + n_special} tokens but only {room + n_special} fit "
                          "(max_model_len minus max_tokens); shorten the input or allow truncation", "input_prefix")
    suf_keep = min(len(suf), max(room // 4, room - len(pre) - len(ext)))  # suffix: a quarter, or what is free
    pre_keep = min(len(pre), room - suf_keep)
    ext_keep = min(len(ext), room - suf_keep - pre_keep)
    dropped = {"prefix": len(pre) - pre_keep, "suffix": len(suf) - suf_keep, "extra": len(ext) - ext_keep}
    pre, suf = _take(pre, pre_keep, from_end=True), _take(suf, suf_keep, from_end=False)
    context = _take(ext, ext_keep, from_end=True) + pre  # far ends go first: the start of the files
    if fmt == "glm":
        ids, layout = infill_prompt(context, suf, glm_tokens(tokenizer))
        return InfillPrompt(ids, layout, fmt, dropped)
    p, s, m = fim_tokens(tokenizer)
    ids = [s] + suf + [p] + context + [m] if fmt == "spm" else [p] + context + [s] + suf + [m]
    return InfillPrompt(ids, None, fmt, dropped)
