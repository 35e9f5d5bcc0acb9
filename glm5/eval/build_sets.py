"""Build the bundled evaluation sets from the bundled corpus (run once by a developer; the output is
committed as package data under glm5/eval/data, see its PROVENANCE.md).

    python -m glm5.eval.build_sets            # rewrites glm5/eval/data/{mmlu_corpus,ceval_corpus,...}

Knowledge sources (glm5/data/assets/corpus/train.jsonl.gz): the `.. module:: NAME` + `:synopsis:` lines
of the Python documentation (python-docs, PSF-2.0) and the `NAME` line of the Chinese man pages
(manpages-zh, GFDL/GPL). The sets measure what a model knows of that text: which module or command a
description belongs to (multiple choice, exact answer, free-form query).

Held-out text (glm5/data/assets/corpus/validation.jsonl.gz): the English fortunes (fortunes-en,
BSD-style), one paragraph each, attribution line removed, none seen in training (no word 13-gram shared
with a training fortune). `continuation_heldout.jsonl` (hellaswag-style): the first part of a fortune,
its true ending and three endings of other fortunes; `lambada_heldout.jsonl` (lambada-style): a fortune
without its last word, and that word. Distractors and answer positions come from seeded RNGs, so the
build is deterministic.
"""

from __future__ import annotations

import csv
import gzip
import json
import random
import re
import string
import unicodedata
from pathlib import Path

from glm5.core.resources import bundled

OUT = Path(__file__).with_name("data")
MODULE_RE = re.compile(r"^\.\. module:: (\S+)\s*\n(?:.*\n){0,3}?\s*:synopsis: (.+)$", re.M)
MAN_RE = re.compile(r"^NAME.*\n\s+([\w.+-]+(?:,\s*[\w.+-]+)*)\s+-\s+(.+)$", re.M)
LETTERS = "ABCD"
ATTRIBUTION_RE = re.compile(r"^\s+--\s", re.M)  # the indented "-- Author" line that ends most fortunes
SENTENCE_END_RE = re.compile(r"\w\w[.!?][\"')]*$")  # "dogs." or "it?\"", not an initial such as "S."
FORTUNE_WORDS = (12, 80)  # continuation: fortunes of this many words (inclusive)
LAMBADA_MAX_WORDS, LAMBADA_MIN_CONTEXT = 80, 8
NGRAM = 13  # held-out fortunes sharing a word 13-gram with a training fortune are left out


def corpus_docs():
    with gzip.open(bundled("corpus/train.jsonl.gz"), "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def python_modules() -> list[tuple[str, str, str]]:
    """(module, synopsis, doc id), one per module, sorted by module name."""
    found = {}
    for d in corpus_docs():
        if d["source"].startswith("python-docs"):
            for m in MODULE_RE.finditer(d["text"]):
                name, syn = m.group(1), " ".join(m.group(2).split())
                if "." not in name and len(syn) > 12:
                    found.setdefault(name, (name, syn.rstrip("."), d["id"]))
    return sorted(found.values())


def man_pages() -> list[tuple[str, str, str]]:
    """(command, Chinese description, doc id) from the man pages whose NAME line is in Chinese."""
    found = {}
    for d in corpus_docs():
        if d["source"].startswith("manpages-zh"):
            m = MAN_RE.search(d["text"])
            if m and re.search(r"[\u4e00-\u9fff]", m.group(2)):
                name = m.group(1).split(",")[0].strip()
                desc = " ".join(m.group(2).split()).rstrip("。.")
                if 4 <= len(desc) <= 60:
                    found.setdefault(name, (name, desc, d["id"]))
    return sorted(found.values())


def choice_rows(items, question, rng: random.Random) -> list[list[str]]:
    """[question, A, B, C, D, answer letter] per item; three distractor names from the other items."""
    names = [n for n, _, _ in items]
    rows = []
    for name, desc, _ in items:
        options = rng.sample([n for n in names if n != name], 3) + [name]
        rng.shuffle(options)
        rows.append([question(desc), *options, LETTERS[options.index(name)]])
    return rows


def write_mmlu(modules, rng) -> None:
    rows = choice_rows(modules, lambda s: f'Which Python standard library module is described as "{s}"?', rng)
    for split, part in (("dev", rows[:5]), ("test", rows[5:])):
        path = OUT / "mmlu_corpus" / f"python_stdlib_{split}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows(part)


def write_ceval(pages, rng) -> None:
    rows = choice_rows(pages, lambda s: f"哪个命令或函数的手册页说明是“{s}”？", rng)
    explain = [f"手册页 NAME 一节：{n} - {s}" for n, s, _ in pages]
    for split, part, notes in (("dev", rows[:5], explain[:5]), ("val", rows[5:105], [""] * 100)):
        path = OUT / "ceval_corpus" / f"linux_commands_{split}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["id", "question", "A", "B", "C", "D", "answer", "explanation"])
            for i, (r, note) in enumerate(zip(part, notes)):
                w.writerow([i, *r, note])


def training_fortunes() -> tuple[str, set[tuple[str, ...]]]:
    """The training split's English fortunes as one string without whitespace, and their lower-cased word
    13-grams (lm-eval's decontamination n-gram size)."""
    texts = [d["text"] for d in corpus_docs() if d["source"] == "fortunes-en"]
    grams = {tuple(w[k:k + NGRAM]) for t in texts for w in [t.lower().split()] for k in range(len(w) - NGRAM + 1)}
    return "\x00".join("".join(t.split()) for t in texts), grams


def heldout_fortunes() -> list[tuple[str, list[str]]]:
    """(doc id, words) of the held-out English fortunes that are one paragraph of plain text (no control
    characters), without the attribution line, and not seen in training (the same text inside a training
    fortune, or a shared 13-gram: the corpus splits by id, and a fortune can be in two files); sorted by
    id, a repeated text once."""
    train, grams = training_fortunes()
    found: dict[str, str] = {}
    with gzip.open(bundled("corpus/validation.jsonl.gz"), "rt", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if d["source"] != "fortunes-en":
                continue
            m = ATTRIBUTION_RE.search(d["text"])
            body = (d["text"][:m.start()] if m else d["text"]).strip()
            if "\n\n" in body or any(unicodedata.category(c) == "Cc" and not c.isspace() for c in body):
                continue
            low = body.lower().split()
            if "".join(body.split()) in train or any(tuple(low[k:k + NGRAM]) in grams
                                                     for k in range(len(low) - NGRAM + 1)):
                continue
            found.setdefault(" ".join(body.split()), d["id"])
    return sorted((doc_id, text.split()) for text, doc_id in found.items())


def cut_point(words: list[str]) -> tuple[int, bool]:
    """(context length in words, cut at a sentence end?): the sentence end nearest 60 % of the words
    among those at 40-75 %, else the word boundary at 60 %."""
    n = len(words)
    ends = [k for k in range(1, n) if SENTENCE_END_RE.search(words[k - 1]) and 0.4 <= k / n <= 0.75]
    if ends:
        return min(ends, key=lambda k: (abs(k - 0.6 * n), k)), True
    return round(0.6 * n), False


def continuation_rows(fortunes: list[tuple[str, list[str]]], rng: random.Random) -> list[dict]:
    """{id, context, endings, label} per fortune of FORTUNE_WORDS words: the true ending and three endings
    of other fortunes, drawn from the 8 nearest in kind (cut at a sentence end or not) and length."""
    items = []
    for doc_id, words in fortunes:
        if FORTUNE_WORDS[0] <= len(words) <= FORTUNE_WORDS[1]:
            k, sentence = cut_point(words)
            items.append((doc_id, " ".join(words[:k]), " ".join(words[k:]), sentence))
    rows = []
    for doc_id, context, ending, sentence in items:
        others = sorted((o for o in items if o[2] != ending),
                        key=lambda o: (o[3] != sentence, abs(len(o[2]) - len(ending)), o[0]))
        pool = list(dict.fromkeys(o[2] for o in others))[:8]
        endings = rng.sample(pool, 3) + [ending]
        rng.shuffle(endings)
        rows.append({"id": doc_id, "context": context, "endings": endings, "label": endings.index(ending)})
    return rows


def lambada_rows(fortunes: list[tuple[str, list[str]]]) -> list[dict]:
    """{id, context, target} per fortune of at most LAMBADA_MAX_WORDS words whose last word, without its
    trailing punctuation (which is dropped), is alphabetic and 3+ letters; the context has 8+ words."""
    rows = []
    for doc_id, words in fortunes:
        last = words[-1].rstrip(string.punctuation)
        if (LAMBADA_MIN_CONTEXT < len(words) <= LAMBADA_MAX_WORDS and last.isalpha() and len(last) >= 3):
            rows.append({"id": doc_id, "context": " ".join(words[:-1]), "target": last})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def write_heldout() -> tuple[int, int]:
    """The held-out sets (their own seeded RNG, independent of the others); (rows, rows) written."""
    fortunes = heldout_fortunes()
    endings, last_words = continuation_rows(fortunes, random.Random(20260531)), lambada_rows(fortunes)
    write_jsonl(OUT / "continuation_heldout.jsonl", endings)
    write_jsonl(OUT / "lambada_heldout.jsonl", last_words)
    return len(endings), len(last_words)


def main() -> None:
    rng = random.Random(20260530)
    modules, pages = python_modules(), man_pages()
    write_mmlu(modules, rng)
    write_ceval(pages, rng)
    # exact answers: name the module (greedy, first identifier of the answer)
    write_jsonl(OUT / "exact_corpus.jsonl", [
        {"id": f"python/{n}", "prompt": f"Q: Which Python module: {s}?\nA: The module is named", "answer": n,
         "source": src} for n, s, src in modules])
    # real queries: what a user asks about a module or a command, answered by the documentation's own words
    queries = [{"id": f"python/{n}", "prompt": f"What is the Python module {n} for?", "reference": f"{n}: {s}.",
                "keywords": [w for w in re.findall(r"[A-Za-z]{5,}", s)][:3], "source": src}
               for n, s, src in rng.sample(modules, 30)]
    queries += [{"id": f"man/{n}", "prompt": f"Linux 里的 {n} 是做什么用的？", "reference": f"{n} - {s}。", "source": src}
                for n, s, src in rng.sample(pages, 30)]
    write_jsonl(OUT / "queries_corpus.jsonl", queries)
    endings, last_words = write_heldout()
    print(f"{len(modules)} modules, {len(pages)} man pages, {endings} sentence endings and {last_words} last "
          f"words from the held-out fortunes -> {OUT}")


if __name__ == "__main__":
    main()
