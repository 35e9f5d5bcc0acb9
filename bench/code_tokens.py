"""Seed D4: do indentation and bracket/operator tokens pay? Tokens per byte on held-out Python.

Trains the 8k byte-level BPE on the bundled corpus three ways (no indentation tokens; the shipped
indentation tokens; indentation + bracket/operator tokens) and counts tokens per UTF-8 byte on
  - held-out Python: the CPython 3.11 standard library files that are NOT in the bundled corpus
    (Debian's libpython3.11-stdlib, same selection rules as the corpus builder),
  - the corpus validation split, by language (what the code tokens cost elsewhere).
Fewer tokens per byte = more text per context window and per training step.

    python3 bench/code_tokens.py [--out docs/bench-code.md]
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections import defaultdict
from pathlib import Path

from glm5.core.resources import resolve_path
from glm5.data.pipeline.corpus import STDLIB
from glm5.data.tokenizer_cli import TokenizerTrainConfig, iter_texts, train_tokenizer

# Python's multi-character brackets and operators (the seeds' "bracket tokens"), most frequent first
CODE_TOKENS = ["()", "):", "])", "[]", "{}", "==", "!=", "<=", ">=", "->", "**", "+=", "-=", "//", "...",
               "('", "')", '("', '")', "['", "']", "=[", "=(", ")\n", "):\n", "self."]
VARIANTS = {
    "bpe only": dict(indent_widths=[]),
    "bpe + indentation (shipped)": dict(),
    "bpe + indentation + brackets/operators": dict(code_tokens=CODE_TOKENS),
}


def held_out_python(limit_bytes: int = 3_000_000) -> list[str]:
    """Stdlib sources not in the bundled corpus (test packages excluded, as the corpus builder does)."""
    in_corpus = set()
    for split in ("train", "validation"):
        with gzip.open(resolve_path(f"bundled:corpus/{split}.jsonl.gz"), "rt", encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                if d["source"] == "cpython-stdlib":
                    in_corpus.add(d["id"].split("/", 1)[1])
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "pydoc_data", "encodings", "lib2to3"}
    texts, used = [], 0
    for p in sorted(STDLIB.rglob("*.py")):
        rel = p.relative_to(STDLIB)
        if str(rel) in in_corpus or set(rel.parts) & skip or p.name.startswith("_sysconfigdata"):
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        used += len(text.encode("utf-8"))
        if used >= limit_bytes:
            break
    return texts


def validation_by_lang() -> dict[str, list[str]]:
    out = defaultdict(list)
    with gzip.open(resolve_path("bundled:corpus/validation.jsonl.gz"), "rt", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            out[d["lang"]].append(d["text"])
    return dict(out)


def tokens_per_byte(tok, texts: list[str]) -> float:
    n_tok = sum(len(ids) for ids in tok.encode_batch(texts))
    return n_tok / sum(len(t.encode("utf-8")) for t in texts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the Markdown table here too")
    args = ap.parse_args()
    if not STDLIB.is_dir():
        raise SystemExit(f"{STDLIB} not found: the held-out Python set is Debian's libpython3.11-stdlib")
    code = held_out_python()
    val = validation_by_lang()
    corpus = list(iter_texts(["bundled:corpus/train.jsonl.gz"]))
    rows = []
    for name, kw in VARIANTS.items():
        t0 = time.perf_counter()
        tok = train_tokenizer(TokenizerTrainConfig(**kw), texts=iter(corpus))
        secs = time.perf_counter() - t0
        rows.append((name, tokens_per_byte(tok, code), {k: tokens_per_byte(tok, v) for k, v in sorted(val.items())},
                     secs))
        print(json.dumps({"variant": name, "heldout_python_tokens_per_byte": rows[-1][1], "validation": rows[-1][2],
                          "train_s": round(secs, 1)}))
    base = rows[0][1]
    langs = sorted(val)
    lines = [f"Held-out Python: {len(code)} CPython 3.11 stdlib files not in the bundled corpus, "
             f"{sum(len(t.encode()) for t in code) / 1e6:.2f} MB. Vocabulary 8192 in every variant.", "",
             "| tokenizer | held-out Python tokens/byte | vs bpe only | " + " | ".join(
                 f"validation {k} tokens/byte" for k in langs) + " |",
             "|---|---|---|" + "---|" * len(langs)]
    for name, tpb, by_lang, _ in rows:
        lines.append(f"| {name} | {tpb:.4f} | {tpb / base:.3f}x | " + " | ".join(f"{by_lang[k]:.4f}" for k in langs)
                     + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
