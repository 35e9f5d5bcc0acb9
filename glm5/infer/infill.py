"""Infill prompts: text before and after a gap (plus other files as context) -> engine prompt ids.

Four prompt formats, picked per model (`choose_format`, "auto": a vocabulary with FIM sentinels of its own
(a code tokenizer, `fim_tokens = true`) gets `codegeex` when it also has GLM's code tokens, else `spm`;
otherwise `glm` on a blank-infilling model, else `codegeex` on a GLM vocabulary):
- `glm`: GLM autoregressive blank infilling (seed M4; needs a model trained with the `glm` objective,
  i.e. a block-position table): Part A = context + prefix + [MASK] + suffix, attended bidirectionally,
  then `<sop>` and the span is generated until `<eop>` (`glm5.data.infilling.infill_prompt`). Any edit
  anywhere in Part A changes all of its KV, so a repeat request reuses the cache only when Part A is
  identical. Every GLM vocabulary has `<|code_*|>` now, so only a tokenizer with sentinels of its own
  outranks a model's block-position table (the sign it was built for blank infilling).
- `codegeex`: GLM's code-completion prompt (CodeGeeX4's layout, `glm5.data.code_completion`): a user turn
  with `###REFERENCE:` blocks (the other files), `###PATH:`, `###LANGUAGE:` and `###MODE:` (LINE | BLOCK)
  headers, then `<|code_suffix|>suffix<|code_prefix|>prefix<|code_middle|><|assistant|>\n`. Needs GLM's
  `<|code_*|>` tokens and `<|user|>`/`<|assistant|>` (every GLM-4.5/4.7/5 vocabulary and the bundled one).
- `spm` / `psm`: fill-in-the-middle with sentinel tokens on a causal model: GLM's `<|code_prefix|>`,
  `<|code_suffix|>`, `<|code_middle|>` first (llama.cpp's GLM-4.5 FIM tokens), else StarCoder / Qwen-coder /
  the glm5 code tokenizer's `<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>`. `spm` puts the suffix first
  (`<suf> suffix <pre> context + prefix <mid>`), so typing at the cursor keeps the suffix and most of the
  prefix in the prefix cache; `psm` is the order most FIM models (and llama.cpp by default) use.

Too long inputs are truncated from the far ends (llama.cpp's split: the suffix gets at most a quarter
of the room, the prefix the rest, other files what is left), or refused. Knows no HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from glm5.data import code_completion as cc
from glm5.data.infilling import InfillLayout, InfillTokens, infill_prompt
from glm5.data.tokenizer import CODE_TOKENS
from glm5.data.tokenizer import FIM_TOKENS as GLM5_FIM_TOKENS

InfillFormat = Literal["glm", "codegeex", "spm", "psm"]
# Sentinel spellings, in the order they are looked up: (prefix, suffix, middle)
FIM_TOKENS = (CODE_TOKENS, GLM5_FIM_TOKENS, ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))
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


def code_tokens(tokenizer: InfillTokenizer) -> cc.CodeTokens | None:
    """The ids GLM's code-completion prompt uses, or None when the vocabulary lacks one of them."""
    ids = {n: tokenizer.token_to_id(n) for n in (*cc.NEEDED, *cc.START)}
    return cc.CodeTokens.from_special_tokens({n: i for n, i in ids.items() if i is not None})


def _spellings() -> str:
    return " or ".join(", ".join(names) for names in FIM_TOKENS)


def choose_format(tokenizer: InfillTokenizer, has_block_positions: bool,
                  requested: InfillFormat | Literal["auto"] = "auto") -> InfillFormat:
    """The format to use for this model, or `InfillError` saying what the model lacks."""
    fim, glm = fim_tokens(tokenizer) is not None, glm_tokens(tokenizer) is not None
    code = code_tokens(tokenizer) is not None
    can_glm = glm and has_block_positions
    if requested == "auto":
        # a vocabulary given FIM sentinels of its own (a code tokenizer): the sentinel objective it was made for
        if any(all(tokenizer.token_to_id(n) is not None for n in names) for names in FIM_TOKENS[1:]):
            return "codegeex" if code else "spm"
        if can_glm:
            return "glm"
        if code:
            return "codegeex"
        raise InfillError(f"this model cannot infill: its tokenizer has no fill-in-the-middle tokens ({_spellings()}) "
                          "and it is not a GLM blank-infilling model ([MASK]/<sop>/<eop> tokens and "
                          "block_position_embedding = true)")
    if requested == "glm" and not can_glm:
        raise InfillError("infill format 'glm' needs [MASK], <sop>, <eop> in the tokenizer and a model "
                          "trained for blank infilling (block_position_embedding = true)")
    if requested == "codegeex" and not code:
        missing = [n for n in cc.NEEDED if tokenizer.token_to_id(n) is None]
        raise InfillError(f"infill format 'codegeex' (GLM's code-completion prompt) needs {missing}, which the "
                          "tokenizer lacks")
    if requested in ("spm", "psm") and not fim:
        raise InfillError(f"infill format {requested!r} needs the tokenizer's fill-in-the-middle tokens "
                          f"({_spellings()})")
    return requested


def _take(ids: list[int], n: int, from_end: bool) -> list[int]:
    n = max(n, 0)
    if n >= len(ids):
        return ids
    return ids[len(ids) - n:] if from_end else ids[:n]


def _split(room: int, n_pre: int, n_suf: int, n_ext: int) -> tuple[int, int, int]:
    """Tokens kept of (prefix, suffix, extra) within `room`: llama.cpp's split (the suffix gets a quarter, or
    what the others leave free; the prefix the rest; the other files what is left)."""
    suf_keep = min(n_suf, max(room // 4, room - n_pre - n_ext))
    pre_keep = min(n_pre, room - suf_keep)
    return pre_keep, suf_keep, min(n_ext, room - suf_keep - pre_keep)


def _check_room(room: int, need: int, fixed: int, truncate: bool) -> None:
    if room < 1:
        raise InfillError("no room left for the prompt: lower max_tokens (n_predict)", "max_tokens")
    if need > room and not truncate:
        raise InfillError(f"the infill prompt needs {need + fixed} tokens but only {room + fixed} fit "
                          "(max_model_len minus max_tokens); shorten the input or allow truncation", "input_prefix")


def build_infill(tokenizer: InfillTokenizer, fmt: InfillFormat, prefix: str, suffix: str, *,
                 room: int, extra: list[tuple[str, str]] = (), middle_start: str = "",
                 truncate: bool = True, path: str = "", language: str | None = None,
                 mode: str | None = None) -> InfillPrompt:
    """Prompt ids for the gap between `prefix` and `suffix`, within `room` prompt tokens.
    `extra`: (filename, text) context files placed before the prefix; `middle_start`: text the middle
    starts with (llama.cpp's `prompt`: the line typed so far), part of the prefix side. `path`, `language`
    (None: from the path's extension) and `mode` (LINE | BLOCK; None: `code_completion.choose_mode`) fill
    the `codegeex` prompt's headers; the other formats ignore them."""
    if fmt == "codegeex":
        return _build_code(tokenizer, prefix + middle_start, suffix, room, list(extra), truncate, path,
                           language, mode)
    pre = tokenizer.encode(prefix + middle_start)
    suf = tokenizer.encode(suffix)
    ext = tokenizer.encode("".join(f"{name}\n{text}\n\n" for name, text in extra)) if extra else []
    n_special = 3  # [MASK] + suffix + <sop> (glm) or the three sentinels
    room -= n_special
    _check_room(room, len(pre) + len(suf) + len(ext), n_special, truncate)
    pre_keep, suf_keep, ext_keep = _split(room, len(pre), len(suf), len(ext))
    dropped = {"prefix": len(pre) - pre_keep, "suffix": len(suf) - suf_keep, "extra": len(ext) - ext_keep}
    pre, suf = _take(pre, pre_keep, from_end=True), _take(suf, suf_keep, from_end=False)
    context = _take(ext, ext_keep, from_end=True) + pre  # far ends go first: the start of the files
    if fmt == "glm":
        ids, layout = infill_prompt(context, suf, glm_tokens(tokenizer))
        return InfillPrompt(ids, layout, fmt, dropped)
    p, s, m = fim_tokens(tokenizer)
    ids = [s] + suf + [p] + context + [m] if fmt == "spm" else [p] + context + [s] + suf + [m]
    return InfillPrompt(ids, None, fmt, dropped)


def _build_code(tokenizer: InfillTokenizer, prefix: str, suffix: str, room: int, extra: list[tuple[str, str]],
                truncate: bool, path: str, language: str | None, mode: str | None) -> InfillPrompt:
    """GLM's (CodeGeeX4's) code-completion prompt; other files that do not fit are dropped whole, the
    first ones first (the ones nearest the cursor's file are sent last)."""
    tokens = code_tokens(tokenizer)
    try:
        mode = cc.choose_mode(suffix, mode)
    except ValueError as e:
        raise InfillError(str(e), "mode") from e
    header = cc.header_text(path, cc.language_of(path) if language is None else language, mode)
    newline = tokenizer.encode("\n")
    context = lambda refs: tokenizer.encode("\n" + cc.references_text(refs) + header)  # noqa: E731
    base = context([])
    pre, suf, ctx = tokenizer.encode(prefix), tokenizer.encode(suffix), context(extra)
    fixed = tokens.overhead + len(newline) + len(base)
    room -= fixed
    _check_room(room, len(pre) + len(suf) + len(ctx) - len(base), fixed, truncate)
    pre_keep, suf_keep, ext_keep = _split(room, len(pre), len(suf), len(ctx) - len(base))
    kept = extra
    while kept and len(context(kept)) - len(base) > ext_keep:
        kept = kept[1:]
    kept_ctx = context(kept)
    dropped = {"prefix": len(pre) - pre_keep, "suffix": len(suf) - suf_keep, "extra": len(ctx) - len(kept_ctx)}
    ids = tokens.prompt(kept_ctx, _take(suf, suf_keep, from_end=False), _take(pre, pre_keep, from_end=True),
                        newline)
    return InfillPrompt(ids, None, "codegeex", dropped)
