"""Structured output: grammars compiled by xgrammar, enforced as a per-row token bitmask in the sampler.

`StructuredOutputs` (vLLM's name and fields) says what a request's output must match: a JSON schema,
any JSON object, a regex, one of several strings, an EBNF/Lark grammar, or an xgrammar structural tag
(the server builds GLM tool-call tags for `tool_choice`). `GrammarBackend` (one per engine) turns a
tokenizer into xgrammar's vocabulary, compiles specs (cached by spec) and hands each request a
`GrammarState`, which fills the allowed-token bitmask for the next position and advances on accepted
tokens. The sampler applies the bitmask (`apply_token_bitmask`); unconstrained rows in the same batch
are untouched. Knows nothing about HTTP; xgrammar is imported on first use (it is slow to import).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, fields
from typing import Any

import torch

_BYTE_LEVEL_CHARS: dict[str, int] | None = None


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint (vLLM's `structured_outputs`); strings so the spec is hashable."""

    json: str | None = None  # JSON schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF (GBNF) or Lark
    structural_tag: str | None = None  # xgrammar structural tag, as JSON text

    def __post_init__(self):
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of json, json_object, regex, choice, grammar, "
                             f"structural_tag (got {given or 'none'})")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))


def vocab_bytes(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """The bytes each token id stands for, for any HF `tokenizers` vocabulary: byte-level BPE (GPT-2
    style), byte-fallback / metaspace (SentencePiece style), or plain strings. Added tokens are their
    text. Ids past the tokenizer's vocabulary (model padding) are empty and never allowed."""
    tok = tokenizer.tok  # tokenizers.Tokenizer
    decoder = json.dumps(json.loads(tok.to_str()).get("decoder"))
    added = {i for i in tok.get_added_tokens_decoder()}
    out = []
    for i in range(vocab_size):
        piece = tok.id_to_token(i)
        if piece is None:
            out.append(b"")
        elif i in added:
            out.append(piece.encode("utf-8"))
        elif "ByteLevel" in decoder:
            out.append(_byte_level(piece))
        elif "ByteFallback" in decoder or "Metaspace" in decoder or "\u2581" in decoder:
            out.append(_sentencepiece(piece))
        else:
            out.append(piece.encode("utf-8"))
    return out


def _byte_level(piece: str) -> bytes:
    global _BYTE_LEVEL_CHARS
    if _BYTE_LEVEL_CHARS is None:
        from glm5.data.tokenizer import _bytes_to_unicode  # noqa: PLC0415
        _BYTE_LEVEL_CHARS = {c: b for b, c in _bytes_to_unicode().items()}
    if all(c in _BYTE_LEVEL_CHARS for c in piece):
        return bytes(_BYTE_LEVEL_CHARS[c] for c in piece)
    return piece.encode("utf-8")


def _sentencepiece(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode("utf-8")


# Bounds on what one request may ask the grammar compiler to do, checked before it starts (it cannot be
# interrupted). Compile time grows steeply with an object's optional properties (xgrammar 0.1 on this CPU:
# 300 -> 0.1 s, 1000 -> 2.9 s, 5000 -> 282 s), while 2000 required ones take 0.3 s.
MAX_SPEC_BYTES = 256 * 1024  # the spec's text (schema, regex, grammar, choices, structural tag)
MAX_OBJECT_PROPERTIES = 512  # `properties` of one object schema
MAX_SCHEMA_PROPERTIES = 4096  # `properties` over the whole schema (or every tool's)


def check_spec_cost(spec: StructuredOutputs) -> None:
    """ValueError naming the limit when `spec` would cost more to compile than one request may."""
    text = {"json": spec.json, "regex": spec.regex, "grammar": spec.grammar, "structural_tag": spec.structural_tag,
            "choice": "".join(spec.choice or ()), "json_object": ""}[spec.kind]
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise ValueError(f"structured_outputs.{spec.kind}: {len(text):,} characters is over the limit of "
                         f"{MAX_SPEC_BYTES:,} bytes")
    if spec.kind not in ("json", "structural_tag"):
        return
    total, stack = 0, [json.loads(text)]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                if len(props) > MAX_OBJECT_PROPERTIES:
                    raise ValueError(f"structured_outputs.{spec.kind}: an object schema with {len(props):,} "
                                     f"properties is over the limit of {MAX_OBJECT_PROPERTIES}")
                total += len(props)
                if total > MAX_SCHEMA_PROPERTIES:
                    raise ValueError(f"structured_outputs.{spec.kind}: over {MAX_SCHEMA_PROPERTIES:,} properties in "
                                     "all (the limit)")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, bitmask_words: int):
        self.matcher = matcher
        self.bitmask_words = bitmask_words  # int32 words of the bitmask: ceil(V / 32)

    def fill_bitmask(self, out: torch.Tensor) -> None:
        """Write the allowed next tokens into `out` (int32 [W], bit t of word t // 32 = token t)."""
        self.matcher.fill_next_token_bitmask(out[None])

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(int(token_id)))

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class GrammarBackend:
    """xgrammar compiler for one tokenizer; `compile` is thread-safe and cached, so the server can
    validate a spec (400 on error) before the engine thread compiles it again for free."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        try:
            import xgrammar as xgr  # noqa: PLC0415 (slow import: only when structured output is used)
        except ImportError as e:
            raise ValueError("structured_outputs: the grammar engine is not installed: "
                             "pip install 'glm5[structured]' (xgrammar)") from e
        self.xgr = xgr
        info = xgr.TokenizerInfo(vocab_bytes(tokenizer, vocab_size), xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size
        self._cache: dict[StructuredOutputs, Any] = {}
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> Any:
        """CompiledGrammar for `spec`; ValueError naming what could not be compiled."""
        with self._lock:
            hit = self._cache.get(spec)
        if hit is not None:
            return hit
        check_spec_cost(spec)
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors (InvalidJSONError is a ValueError)
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"structured_outputs.{spec.kind}: cannot compile: {msg}") from e
        with self._lock:
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[spec] = compiled
        return compiled

    def _compile(self, spec: StructuredOutputs) -> Any:
        c, xgr = self.compiler, self.xgr
        if spec.json is not None:
            json.loads(spec.json)  # a ValueError names bad JSON before xgrammar does
            return c.compile_grammar(_json_grammar(xgr, spec.json))
        if spec.json_object:
            return c.compile_grammar(_json_grammar(xgr, '{"type": "object"}'))
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            rule = " | ".join(json.dumps(s) for s in spec.choice)
            return c.compile_grammar(xgr.Grammar.from_ebnf(f"root ::= {rule}"))
        if spec.grammar is not None:
            return c.compile_grammar(_grammar(xgr, spec.grammar))
        return c.compile_structural_tag(spec.structural_tag)

    def state(self, spec: StructuredOutputs) -> GrammarState:
        return GrammarState(self.xgr.GrammarMatcher(self.compile(spec)), (self.vocab_size + 31) // 32)


# xgrammar writes the characters of a length-limited string (minLength/maxLength) as [^"\\\r\n], which
# admits raw control characters: JSON forbids them, so such output would not parse. Same class, minus
# the control characters (as its unlimited strings already are).
_LOOSE_CHARS, _JSON_CHARS = '[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\]'


def _json_grammar(xgr: Any, schema: str) -> Any:
    """The JSON-schema grammar (no free whitespace, like vLLM's default), with strings that parse."""
    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    if _LOOSE_CHARS not in text:
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _JSON_CHARS))


def _grammar(xgr: Any, text: str) -> Any:
    """EBNF (xgrammar/GBNF, `root ::= ...`) or Lark (`start: ...`), as vLLM accepts both."""
    if "::=" in text:
        return xgr.Grammar.from_ebnf(text)
    return xgr.Grammar.from_lark(text)


def apply_token_bitmask(logits: torch.Tensor, bitmasks: list[torch.Tensor | None]) -> torch.Tensor:
    """Set disallowed tokens to -inf: logits [N, V], one int32 [W] bitmask (or None) per row.
    Returns a copy when any row is constrained, else `logits` itself."""
    rows = [i for i, m in enumerate(bitmasks) if m is not None]
    if not rows:
        return logits
    packed = torch.stack([bitmasks[i] for i in rows]).to(logits.device)  # [R, W]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bits = (packed[:, :, None] >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(len(rows), -1)[:, : logits.shape[1]].bool()  # [R, V]
    out = logits.clone()
    idx = torch.tensor(rows, device=logits.device)
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out


def glm_tool_call_tag(tools: list[dict], tool_choice: str | dict, thinking: bool, parallel: bool) -> str:
    """JSON text of xgrammar's maintained GLM-4.7/GLM-5 structural tag (`glm_4_7`) for `tool_choice`
    "required" (text, then at least one call to an offered tool) or a named function (exactly that
    call). Arguments follow each tool's JSON schema in GLM's XML form. `thinking`: the prompt left a
    `<think>` block open, so the output first finishes it."""
    import xgrammar as xgr  # noqa: PLC0415
    tag = xgr.get_model_structural_tag("glm_4_7", tools=tools, tool_choice=tool_choice,
                                       reasoning="enabled" if thinking else "disabled",
                                       parallel_tool_calls=parallel, max_whitespace_cnt=1)
    return tag.model_dump_json()
