"""Tokenizer: any HF `tokenizer.json` (`tokenizers`), plus GLM's special tokens and chat template when present.

Owns loading and saving HF tokenizer directories (`tokenizer.json` + `tokenizer_config.json` +
`chat_template.jinja`), encoding/decoding, the chat template (rendered with jinja2 exactly as
`transformers` renders it, see `chat_template.py`), and `IncrementalDetokenizer` for streaming output.
It loads our own tokenizers, real GLM-4.5/GLM-5 files and third-party ones (GPT-2/Llama-style byte-level
BPE, SentencePiece-style byte fallback) alike; it never imports `transformers`. Completions need nothing
GLM-specific: EOS and PAD come from `tokenizer_config.json`. GLM's special tokens are needed only by the
features built on them (the default chat template, tool calls, blank infilling); `require` raises
`MissingSpecialTokens` naming what is absent. Training lives in `tokenizer_cli.py` (`glm5 data tokenizer`).
"""

from __future__ import annotations

import codecs
import json
import re
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from glm5.core.io import atomic_write_json, atomic_write_text
from glm5.core.resources import resolve_path
from glm5.data import chat_template as ct

# GLM-5's 36 special tokens, in the order of the released vocabulary (ids 154820-154855 there): ours take
# the last 36 ids in the same order, so that id - first_id agrees with GLM-5's for every one of them.
SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>", "<|end_of_transcription|>",
    "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "/nothink", "<|begin_of_box|>", "<|end_of_box|>", "<|image|>", "<|video|>",
)
# GLM's code-completion tokens (CodeGeeX4's prompt; llama.cpp takes them as GLM-4.5's FIM tokens).
CODE_TOKENS = ("<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>")
# Fill-in-the-middle sentinels (a code tokenizer trained with `fim_tokens = true`; Qwen-coder's spelling).
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
# A GLM turn ends when the model emits one of these (GLM-5 generation_config: eos_token_id list).
EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")
PAD_TOKEN = "<|endoftext|>"
PREFIX_TOKENS = ("[gMASK]", "<sop>")  # GLM prompt prefix (chat template, `add_special_tokens=True`)
# What each GLM feature needs from the vocabulary.
FEATURE_TOKENS = {
    "the default GLM chat template": (*PREFIX_TOKENS, "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                                      "<think>", "</think>"),
    "tool calls": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    "blank infilling": ("[MASK]", "[sMASK]", "[gMASK]", "<sop>", "<eop>"),
}
CHAT = "the default GLM chat template"


class MissingSpecialTokens(ValueError):
    """A GLM feature was asked of a tokenizer without the special tokens it needs (names them)."""

    def __init__(self, feature: str, missing: list[str], hint: str = ""):
        self.feature, self.missing = feature, list(missing)
        super().__init__(f"{feature} needs GLM special tokens {self.missing}, which this tokenizer lacks"
                         f"{hint}; plain completions still work")
# Texts longer than this are encoded with `encode_batch([text])` (same ids): the Rust tokenizer then
# runs without the GIL, so other Python threads (a server's event loop) keep running meanwhile.
GIL_FREE_CHARS = 4096
# `encode(..., limit=N)` counts a text longer than this in pieces of about this many characters and stops
# at the first piece that takes the count past N: the cost of refusing is bounded by N, not by the text.
COUNT_PIECE_CHARS = 65536


class TooManyTokens(ValueError):
    """`encode(text, limit=N)`: the text has more than N tokens (`at_least` counted before stopping)."""

    def __init__(self, at_least: int, limit: int):
        self.at_least, self.limit = at_least, limit
        super().__init__(f"the text has at least {at_least} tokens, more than the limit of {limit}")


def _piece_end(text: str, at: int, look: int = 4096) -> int:
    """Where to cut `text` at or after `at`: the start of the next whitespace run within `look`
    characters, else `at` itself (a text without spaces is cut mid-word: one more token at most)."""
    if at >= len(text):
        return len(text)
    for i in range(at, min(at + look, len(text))):
        if text[i].isspace() and not text[i - 1].isspace():
            return i
    return at


def check_encodable(text: str, name: str = "text") -> None:
    """Raise `ValueError` naming `name` unless `text` is a str that encodes to UTF-8. JSON escapes can
    carry lone surrogates ("\\ud800") that Python strings hold but no tokenizer can encode."""
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode: lone surrogate U+{ord(text[e.start]):04X} at "
                         f"character {e.start}; send UTF-8 text (surrogates only in valid pairs)") from None


class GLMTokenizer:
    """A loaded tokenizer: `tokenizers.Tokenizer` + special-token ids + chat template (None: no chat)."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None, config: dict | None = None,
                 model_type: str | None = None):
        self.tok = tokenizer
        self.config = dict(config or {})
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.special_tokens = {t: vocab[t] for t in (*SPECIAL_TOKENS, *FIM_TOKENS) if t in vocab}
        # The tokenizer's own template, else GLM's default when the vocabulary has GLM's chat tokens: the one
        # of the GLM generation `model_type` (a checkpoint's config.json) names, else glm5's own.
        self.chat_template = chat_template or (ct.default_chat_template(model_type) if not self.missing(CHAT)
                                               else None)
        self.eos_token_ids = self._eos_ids(vocab)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        pad = _token_text(self.config.get("pad_token")) or (PAD_TOKEN if PAD_TOKEN in vocab else None)
        self.pad_token_id = vocab.get(pad, self.eos_token_id) if pad else self.eos_token_id
        # Every token the tokenizer itself marks special (a real GLM file also has image/audio tokens).
        self.all_special_ids = {a.content: i for i, a in tokenizer.get_added_tokens_decoder().items()
                                if a.special}

    def _eos_ids(self, vocab: dict[str, int]) -> list[int]:
        """`tokenizer_config.json`'s eos_token, then GLM's turn-ending tokens when this is a GLM vocabulary."""
        names = [_token_text(self.config.get("eos_token"))]
        if not self.missing(CHAT):
            names += EOS_TOKENS
        return list(dict.fromkeys(vocab[n] for n in names if n in vocab))

    def missing(self, feature: str) -> list[str]:
        """The GLM special tokens `feature` (a key of FEATURE_TOKENS) needs that this vocabulary lacks."""
        return [t for t in FEATURE_TOKENS[feature] if t not in self.special_tokens]

    def require(self, feature: str) -> None:
        """Raise `MissingSpecialTokens` unless the vocabulary has what `feature` needs."""
        missing = self.missing(feature)
        if missing:
            raise MissingSpecialTokens(feature, missing)

    def _template(self) -> str:
        if self.chat_template is None:
            raise MissingSpecialTokens("chat", self.missing(CHAT), " (and it has no chat template of its own: no "
                                       "chat_template.jinja, no tokenizer_config.json 'chat_template')")
        return self.chat_template

    @property
    def vocab_size(self) -> int:
        """Number of ids (BPE vocabulary + added tokens); the model's vocab_size must be >= this."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False, limit: int | None = None) -> list[int]:
        """Text -> ids. Special-token strings in `text` become their ids (as in HF);
        `add_special_tokens` applies the file's post-processor (ours prepends `[gMASK]<sop>`).
        Text that is not valid Unicode (a lone surrogate such as "\\ud800") raises `ValueError`.
        `limit`: raise `TooManyTokens` when the ids would be more than `limit`, having tokenised little
        more than `limit` tokens' worth of the text (a server's context check on a multi-megabyte prompt)."""
        if limit is not None and len(text) > COUNT_PIECE_CHARS:
            self._count_up_to(text, limit)
        ids = self._encode(text, add_special_tokens)
        if limit is not None and len(ids) > limit:
            raise TooManyTokens(len(ids), limit)
        return ids

    def _count_up_to(self, text: str, limit: int) -> None:
        """Tokenise `text` piece by piece, cut where a run of whitespace starts (where byte-level and
        SentencePiece pre-tokenisers split anyway), and raise `TooManyTokens` as soon as the count, less
        one token per cut for what a cut may change, passes `limit`."""
        count, start, cuts = 0, 0, 0
        while start < len(text):
            end = _piece_end(text, start + COUNT_PIECE_CHARS)
            count += len(self._encode(text[start:end], False))
            if count - cuts > limit:
                raise TooManyTokens(count - cuts, limit)
            start, cuts = end, cuts + 1

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            if len(text) > GIL_FREE_CHARS:  # `encode` holds the GIL throughout; `encode_batch` releases it
                return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            return self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            check_encodable(text)  # raises ValueError with the position when that is the reason
            raise

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Batch encode (multithreaded in Rust), no special prefix."""
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(int(i))

    def apply_chat_template(self, messages, tools=None, add_generation_prompt: bool = True,
                            enable_thinking: bool = True, tokenize: bool = True, **kwargs):
        """Render a conversation (OpenAI-style dicts) with the chat template; ids, or the text when
        `tokenize=False`. Extra kwargs (e.g. `clear_thinking=False`) go to the template."""
        text = ct.render(self._template(), messages, tools=tools,
                         add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                         **kwargs)
        return self.encode(text) if tokenize else text

    def encode_chat(self, messages, tools=None, enable_thinking: bool = True, **kwargs):
        """SFT encoding: (ids, loss_mask). The mask is 1 on what the assistant generates (its
        `{% generation %}` blocks) plus the token that ends each assistant turn (`<|user|>`,
        `<|observation|>`, or an appended `<|endoftext|>` after a final assistant turn)."""
        text, spans = ct.render_with_spans(self._template(), messages, tools=tools,
                                           add_generation_prompt=False,
                                           enable_thinking=enable_thinking, **kwargs)
        enc = self.tok.encode(text, add_special_tokens=False)
        ids, mask = list(enc.ids), [0] * len(enc.ids)
        for i, (start, end) in enumerate(enc.offsets):
            if any(s <= start and end <= e and end > start for s, e in spans):
                mask[i] = 1
        for i in range(1, len(ids)):  # the turn-ending token right after a generated span
            if mask[i - 1] and not mask[i] and ids[i] in self.eos_token_ids:
                mask[i] = 1
        if ids and mask[-1] and ids[-1] not in self.eos_token_ids:  # the template ended no final turn
            ids.append(self.eos_token_id)
            mask.append(1)
        return ids, mask

    @cached_property
    def _byte_decoder(self) -> dict[str, int]:
        return {c: b for b, c in _bytes_to_unicode().items()}

    @cached_property
    def decoder_kind(self) -> str:
        """How token strings map to bytes: "byte_level" (GPT-2/GLM/Llama-3 BPE), "metaspace"
        (SentencePiece-style: `▁` is a space, `<0xNN>` a byte), or "text" (anything else)."""
        state = json.loads(self.tok.decoder.__getstate__()) if self.tok.decoder is not None else {}
        kinds = {d.get("type") for d in state.get("decoders", [state])}
        if "ByteLevel" in kinds:
            return "byte_level"
        return "metaspace" if kinds & {"Metaspace", "ByteFallback", "Replace"} else "text"

    def token_bytes(self, i: int) -> bytes:
        """The raw bytes of one token; added tokens are their UTF-8 content. For a "text" decoder the
        token decoded on its own (not always exact: `IncrementalDetokenizer` decodes whole runs there)."""
        tok = self.tok.id_to_token(int(i))
        if tok is None:
            raise ValueError(f"token id {i} out of range (vocab {self.vocab_size})")
        if int(i) in self._added_ids:
            return tok.encode("utf-8")
        if self.decoder_kind == "byte_level":
            return bytes(self._byte_decoder[c] for c in tok)
        if self.decoder_kind == "metaspace":
            byte = _BYTE_FALLBACK.fullmatch(tok)
            return bytes([int(byte.group(1), 16)]) if byte else tok.replace("\u2581", " ").encode("utf-8")
        return self.tok.decode([int(i)], skip_special_tokens=False).encode("utf-8")

    @cached_property
    def _added_ids(self) -> set[int]:
        return set(self.tok.get_added_tokens_decoder())

    def save(self, path: str | Path) -> None:
        """Write an HF tokenizer directory (loadable by `transformers.AutoTokenizer` and `load_tokenizer`)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path / "tokenizer.json", self.tok.to_str(pretty=True))
        atomic_write_json(path / "tokenizer_config.json", self._hf_config())
        if self.chat_template is not None:  # the template's only copy (transformers reads it from there)
            atomic_write_text(path / "chat_template.jinja", self.chat_template)

    def _hf_config(self) -> dict:
        """The loaded tokenizer_config.json, with our added tokens; GLM defaults fill what it leaves unset."""
        decoder = {str(i): {"content": a.content, "lstrip": a.lstrip, "normalized": a.normalized,
                            "rstrip": a.rstrip, "single_word": a.single_word, "special": a.special}
                   for i, a in sorted(self.tok.get_added_tokens_decoder().items())}
        out = {k: v for k, v in self.config.items() if k not in ("added_tokens_decoder", "chat_template")}
        out["added_tokens_decoder"] = decoder
        defaults = {"clean_up_tokenization_spaces": False, "do_lower_case": False, "model_max_length": 131072,
                    "padding_side": "left", "tokenizer_class": "PreTrainedTokenizerFast"}
        if not self.missing(CHAT):
            defaults.update(additional_special_tokens=[t for t in (*SPECIAL_TOKENS, *FIM_TOKENS)
                                                        if t in self.special_tokens],
                            eos_token=EOS_TOKENS[0], pad_token=PAD_TOKEN)
        for key, value in defaults.items():
            out.setdefault(key, value)
        return out


# A checkpoint's tokenizer files, copied verbatim next to a model made from it (converted, or trained).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "added_tokens.json")


def copy_tokenizer_files(src: str | Path, dst: str | Path, extra: tuple[str, ...] = ()) -> list[str]:
    """Copy the TOKENIZER_FILES (and `extra` names) that exist in directory `src` into `dst`, byte for byte;
    returns the names copied."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in (*TOKENIZER_FILES, *extra):
        if (src / name).is_file():
            (dst / name).write_bytes((src / name).read_bytes())
            copied.append(name)
    return copied


def load_tokenizer(path: str | Path, model_type: str | None = None) -> GLMTokenizer:
    """Load a tokenizer directory (or a bare `tokenizer.json`, or `bundled:tokenizer-8k`): any HF one.

    The chat template comes from `chat_template.jinja`, else `tokenizer_config.json["chat_template"]`,
    else, when the vocabulary has GLM's chat tokens, the default of the GLM generation `model_type` names
    (default: `config.json`'s next to the tokenizer, a checkpoint's; see `chat_template.default_chat_template`),
    else there is none.
    """
    path = resolve_path(path)
    file = path if path.is_file() else path / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    root = file.parent
    config = {}
    if (root / "tokenizer_config.json").is_file():
        config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = config.get("chat_template")
    if isinstance(template, list):  # HF allows named templates: [{"name": "default", "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    if model_type is None and (root / "config.json").is_file():
        try:
            model_type = json.loads((root / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (ValueError, AttributeError):  # not a model config: no generation to follow
            model_type = None
    return GLMTokenizer(Tokenizer.from_file(str(file)), template, config, model_type)


def _token_text(token) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-char table used by ByteLevel (taken from `tokenizers` itself)."""
    alphabet = ByteLevel.alphabet()
    # Same construction as GPT-2: printable latin-1 bytes map to themselves, the rest to 256+n.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    assert set(table.values()) == set(alphabet), "ByteLevel alphabet differs from GPT-2's table"
    return table


class IncrementalDetokenizer:
    """Streaming decode: `add(ids)` returns only the new text, never a partial UTF-8 character.

    Tokens are turned into raw bytes and fed to an incremental UTF-8 decoder, so a character split
    across tokens (Chinese, emoji) is emitted once its last byte arrives. `finish()` flushes a dangling
    incomplete sequence as U+FFFD (only possible if generation stopped mid-character). A tokenizer
    whose tokens are not bytes ("text" decoder, e.g. WordPiece) is decoded whole and diffed instead.
    """

    def __init__(self, tokenizer: GLMTokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = set(tokenizer.all_special_ids.values()) if skip_special_tokens else set()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.token_ids: list[int] = []

    def add(self, ids) -> str:
        if isinstance(ids, int):
            ids = [ids]
        self.token_ids.extend(int(i) for i in ids)
        if self.tokenizer.decoder_kind == "text":
            return self._diff(final=False)
        data = b"".join(self.tokenizer.token_bytes(i) for i in ids if int(i) not in self.skip)
        new = self._utf8.decode(data, final=False)
        self.text += new
        return new

    def finish(self) -> str:
        if self.tokenizer.decoder_kind == "text":
            return self._diff(final=True)
        new = self._utf8.decode(b"", final=True)
        self.text += new
        return new

    def _diff(self, final: bool) -> str:
        full = self.tokenizer.decode([i for i in self.token_ids if i not in self.skip])
        if not final and full.endswith("\ufffd"):  # an incomplete character: wait for its other bytes
            return ""
        new = full[len(self.text):]
        self.text += new
        return new
