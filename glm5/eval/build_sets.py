"""Build the bundled evaluation sets from the bundled corpus (run once by a developer; the output is
committed as package data under glm5/eval/data, see its PROVENANCE.md).

    python -m glm5.eval.build_sets            # rewrites glm5/eval/data/{mmlu_corpus,ceval_corpus,...}

Sources (all in glm5/data/assets/corpus/train.jsonl.gz): the `.. module:: NAME` + `:synopsis:` lines of
the Python documentation (python-docs, PSF-2.0) and the `NAME` line of the Chinese man pages
(manpages-zh, GFDL/GPL). The sets measure what a model knows of that text: which module or command a
description belongs to (multiple choice, exact answer, free-form query). Distractors and answer
positions come from a seeded RNG, so the build is deterministic.
"""

from __future__ import annotations

import csv
import gzip
import json
import random
import re
from pathlib import Path

from glm5.core.resources import bundled

OUT = Path(__file__).with_name("data")
MODULE_RE = re.compile(r"^\.\. module:: (\S+)\s*\n(?:.*\n){0,3}?\s*:synopsis: (.+)$", re.M)
MAN_RE = re.compile(r"^NAME.*\n\s+([\w.+-]+(?:,\s*[\w.+-]+)*)\s+-\s+(.+)$", re.M)
LETTERS = "ABCD"


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


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


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
    print(f"{len(modules)} modules, {len(pages)} man pages -> {OUT}")


if __name__ == "__main__":
    main()
