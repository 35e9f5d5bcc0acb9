"""`glm5 data tokenizer`: train the byte-level BPE tokenizer (seed D4) and save it as an HF directory.

The BPE is trained with HF `tokenizers` on JSONL(.gz) documents (the bundled corpus or the cleaned
shards of `glm5 data run`), with GLM-4's pre-tokenizer regex. Code indentation (a newline followed by
4/8/12/16 spaces) becomes single tokens (seed D4), and GLM's special tokens take the last ids, as in the real GLM vocabulary, so
that everything fits inside `vocab_size`. The default config reproduces the shipped tokenizer:
`glm5 data tokenizer --config configs/data/tokenizer.toml`.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from glm5.core.config import load_cli_config, to_dict
from glm5.core.io import atomic_dir
from glm5.core.resources import resolve_path
from glm5.data.tokenizer import FIM_TOKENS, PREFIX_TOKENS, SPECIAL_TOKENS, GLMTokenizer

# GLM-4 / GLM-5 pre-tokenizer: contractions, letters with one leading non-letter, 1-3 digit groups,
# punctuation runs (+ newlines), newline runs, spaces.
GLM_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(kw_only=True)
class TokenizerTrainConfig:
    """How to train the glm5 tokenizer."""

    inputs: list[str] = field(default_factory=lambda: ["bundled:corpus/train.jsonl.gz"])
    """JSONL(.gz) files or directories of them; each line a document with a `text` field."""
    output: str = "bundled:tokenizer-8k"
    """Directory to write (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    vocab_size: int = 8192
    """Total number of ids, special and indentation tokens included."""
    min_frequency: int = 2
    """A merge must occur at least this often."""
    indent_widths: list[int] = field(default_factory=lambda: [4, 8, 12, 16])
    """Seed D4: a newline + this many spaces becomes one token each ([] to disable). Anchoring on the
    newline keeps them to line-start indentation, so mid-line space runs stay with the BPE."""
    code_tokens: list[str] = field(default_factory=list)
    """Seed D4: bracket/operator strings that become single tokens, matched before the BPE like the
    indentation tokens (e.g. "()", "):", "==", "->"); see docs/code.md for what they buy."""
    fim_tokens: bool = False
    """Add the fill-in-the-middle sentinels <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|> (special)."""
    max_docs: int = 0
    """Train on at most this many documents (0 = all)."""
    model_max_length: int = 131072
    """Recorded in tokenizer_config.json."""


def iter_texts(inputs: list[str], max_docs: int = 0) -> Iterator[str]:
    """Document texts from JSONL(.gz) files (directories: their *.jsonl[.gz], sorted)."""
    n = 0
    for path in expand_inputs(inputs):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)["text"]
                    n += 1
                    if max_docs and n >= max_docs:
                        return


def expand_inputs(inputs: list[str]) -> list[Path]:
    files = []
    for item in inputs:
        p = resolve_path(item)
        if p.is_dir():
            files += sorted(q for q in p.rglob("*") if q.name.endswith((".jsonl", ".jsonl.gz")))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"tokenizer input not found: {p}")
    if not files:
        raise FileNotFoundError(f"no .jsonl/.jsonl.gz files in {inputs}")
    return files


def split_on_added(texts, added: list[str]) -> Iterator[str]:
    """Cut the training texts where the added (indentation) tokens will match at encode time, so
    that the BPE learns merges for what actually surrounds them (e.g. `return`, not `Ġreturn`, after
    an indent). Longest-first alternation = the added vocabulary's leftmost-longest matching."""
    if not added:
        yield from texts
        return
    pattern = re.compile("|".join(re.escape(a) for a in sorted(added, key=len, reverse=True)))
    for text in texts:
        yield from (piece for piece in pattern.split(text) if piece)


def build_empty_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(cfg: TokenizerTrainConfig, texts=None) -> GLMTokenizer:
    """Train the BPE on `texts` (default: the config's inputs) and attach the GLM special tokens."""
    indents = ["\n" + " " * w for w in sorted(set(cfg.indent_widths), reverse=True)]
    added = indents + [t for t in dict.fromkeys(cfg.code_tokens) if t and t not in indents]
    specials = [*(FIM_TOKENS if cfg.fim_tokens else ()), *SPECIAL_TOKENS]
    n_bpe = cfg.vocab_size - len(specials) - len(added)
    if n_bpe < 256 + 64:
        raise ValueError(f"vocab_size {cfg.vocab_size} leaves only {n_bpe} BPE ids (need > 320)")
    tok = build_empty_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, min_frequency=cfg.min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = texts if texts is not None else iter_texts(cfg.inputs, cfg.max_docs)
    tok.train_from_iterator(split_on_added(texts, added), trainer)
    # Indentation and code tokens are plain added tokens: matched before BPE (leftmost-longest), decoded
    # verbatim. GLM's special tokens take the last ids (the FIM sentinels, if any, just before them).
    tok.add_tokens([AddedToken(s, normalized=False, special=False) for s in added])
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    prefix = " ".join(PREFIX_TOKENS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{prefix} $A", pair=f"{prefix} $A $B",
        special_tokens=[(t, tok.token_to_id(t)) for t in PREFIX_TOKENS])
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"trained {tok.get_vocab_size()} ids > vocab_size {cfg.vocab_size}")
    return GLMTokenizer(tok, config={"model_max_length": cfg.model_max_length})


def main(argv: list[str] | None = None) -> int:
    cfg = load_cli_config(TokenizerTrainConfig, argv, "glm5 data tokenizer", __doc__.splitlines()[0],
                          "configs/data/tokenizer.toml")
    tokenizer = train_tokenizer(cfg)
    with atomic_dir(resolve_path(cfg.output)) as tmp:
        tokenizer.save(tmp)
    sample = "def f(x):\n    return x  # 你好 😀"
    ids = tokenizer.encode(sample)
    print(json.dumps({"output": cfg.output, "vocab_size": tokenizer.vocab_size, "config": to_dict(cfg),
                      "sample_tokens": len(ids), "round_trip": tokenizer.decode(ids) == sample},
                     ensure_ascii=False))
    return 0
