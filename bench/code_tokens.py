"""Seed D4: do indentation and bracket/operator tokens pay? Tokens per byte on held-out Python.

Trains the 8k byte-level BPE on the bundled corpus three ways (no indentation tokens; the shipped
indentation tokens; indentation + bracket/operator tokens) and counts tokens per UTF-8 byte on
  - held-out Python: the CPython 3.11 standard library files that are NOT in the bundled corpus
    (Debian's libpython3.11-stdlib, same selection rules as the corpus builder),
  - the corpus validation split, by language (what the code tokens cost elsewhere).
Fewer tokens per byte = more text per context window and per training step.

With `--loss-steps N` it also measures the effect on loss: for "bpe only" and the shipped tokenizer, the
bundled corpus + math set is tokenised with each, the code model's recipe (`configs/train/code.toml`,
causal LM only) trains the same `tiny` model for N steps on each, and the held-out Python is scored in
bits per UTF-8 byte (the only loss that compares across tokenizers: nats per token depend on how much
text a token covers).

    python3 bench/code_tokens.py [--out docs/bench-code.md] [--loss-steps 400]
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
import math
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from glm5.core.resources import resolve_path
from glm5.data.pipeline.corpus import STDLIB
from glm5.data.tokenize_cli import TokenizeConfig
from glm5.data.tokenize_cli import run as tokenize_corpus
from glm5.data.tokenizer import GLMTokenizer
from glm5.data.tokenizer_cli import TokenizerTrainConfig, iter_texts, train_tokenizer
from glm5.model.model import GLM5ForCausalLM

LOSS_VARIANTS = ("bpe only", "bpe + indentation (shipped)")
SPLITS = {"train": ["bundled:corpus/train.jsonl.gz", "bundled:corpus-math/train.jsonl.gz"],
          "validation": ["bundled:corpus/validation.jsonl.gz", "bundled:corpus-math/validation.jsonl.gz"]}

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


@torch.no_grad()
def bits_per_byte(model: GLM5ForCausalLM, tok: GLMTokenizer, texts: list[str], window: int) -> float:
    """Causal LM loss on `texts` in bits per UTF-8 byte: each file is cut into `window`-token pieces
    (each piece scored from its own start, as in training), summed nats / bytes / ln 2."""
    nats, n_bytes = 0.0, 0
    for text in texts:
        ids = tok.encode(text)
        n_bytes += len(text.encode("utf-8"))
        for s in range(0, len(ids) - 1, window):
            piece = torch.tensor([ids[s:s + window + 1]])
            if piece.shape[1] < 2:
                continue
            logits = model(piece[:, :-1]).logits.float()
            nats += torch.nn.functional.cross_entropy(logits[0], piece[0, 1:], reduction="sum").item()
    return nats / n_bytes / math.log(2)


def loss_effect(name: str, tok: GLMTokenizer, steps: int, eval_texts: list[str], work: Path) -> dict:
    """Tokenise the corpus with `tok`, train the code recipe (CLM only) for `steps`, score `eval_texts`."""
    slug = "".join(c if c.isalnum() else "-" for c in name)[:24]
    tok_dir, data_dir, run_dir = work / f"tok-{slug}", work / f"tokens-{slug}", work / f"run-{slug}"
    tok.save(tok_dir)
    tokenize_corpus(TokenizeConfig(splits=SPLITS, output=str(data_dir), tokenizer=str(tok_dir)))
    cmd = [sys.executable, "-m", "glm5.cli.main", "train", "--config", "configs/train/code.toml",
           f"--data.train_path={data_dir / 'train'}", f"--data.val_path={data_dir / 'validation'}",
           f"--train.steps={steps}", "--train.objectives={clm = 1.0}", "--train.time_limit_min=0.0",
           f"--log.run_dir={run_dir}", "--checkpoint.every=0", "--log.eval_every=0"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    secs = time.perf_counter() - t0
    model = GLM5ForCausalLM.from_pretrained(run_dir / "final").float().eval()
    window = 256
    return {"variant": name, "steps": steps, "train_s": round(secs, 1),
            "heldout_python_bits_per_byte": bits_per_byte(model, tok, eval_texts, window)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the Markdown table here too")
    ap.add_argument("--loss-steps", type=int, default=0,
                    help="also train the code recipe this many steps per tokenizer and compare held-out loss")
    ap.add_argument("--loss-eval-bytes", type=int, default=300_000,
                    help="held-out Python bytes scored for the loss comparison")
    args = ap.parse_args()
    if not STDLIB.is_dir():
        raise SystemExit(f"{STDLIB} not found: the held-out Python set is Debian's libpython3.11-stdlib")
    code = held_out_python()
    val = validation_by_lang()
    corpus = list(iter_texts(["bundled:corpus/train.jsonl.gz"]))
    rows, toks = [], {}
    for name, kw in VARIANTS.items():
        t0 = time.perf_counter()
        tok = toks[name] = train_tokenizer(TokenizerTrainConfig(**kw), texts=iter(corpus))
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
    if args.loss_steps:
        eval_texts, used = [], 0
        for t in code:  # the first files of the held-out set, up to --loss-eval-bytes
            eval_texts.append(t)
            used += len(t.encode("utf-8"))
            if used >= args.loss_eval_bytes:
                break
        with tempfile.TemporaryDirectory(prefix="glm5-code-tokens-") as work:
            results = [loss_effect(n, toks[n], args.loss_steps, eval_texts, Path(work)) for n in LOSS_VARIANTS]
        for r in results:
            print(json.dumps(r))
        base_bpb = results[0]["heldout_python_bits_per_byte"]
        lines += ["", f"Loss: the code recipe (causal LM only, `tiny`, {args.loss_steps} steps of 8 x 256 tokens) "
                  f"trained once per tokenizer; held-out Python ({len(eval_texts)} files, {used / 1e3:.0f} kB) in "
                  "bits per byte, scored in 256-token windows.", "",
                  "| tokenizer | held-out Python bits/byte | vs bpe only | train s |", "|---|---|---|---|"]
        for r in results:
            bpb = r["heldout_python_bits_per_byte"]
            lines.append(f"| {r['variant']} | {bpb:.4f} | {bpb / base_bpb:.3f}x | {r['train_s']} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
