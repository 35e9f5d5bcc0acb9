"""Build the bundled corpus snapshot (`glm5/data/assets/corpus/`) from licensed text shipped in Debian packages.

Sources (install: `apt-get install python3.11-doc debian-reference-en debian-reference-zh-cn manpages-zh
fortunes fortunes-zh`): Python 3.11 documentation (reST sources), Debian Reference (English and
Simplified Chinese), Chinese man pages (rendered with man-db/groff), BSD fortunes, Chinese fortunes and
Tang/Song poems, and the CPython standard library (code); apart from those, the Maxima manual (math,
`apt-get install maxima-doc`) as `bundled:corpus-math`. Each source has a byte budget; files are
picked in a fixed hash order, so the same packages always give the same snapshot. The split into
train/validation is a hash of the document id. Only format markup is removed here (ANSI colour codes in
fortunes); everything else is left for `glm5 data run` to clean, so the pipeline has real work to do.
Run: `glm5 data corpus` (writes into the package: `bundled:corpus`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from glm5.core.io import atomic_write_text

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FORTUNES = Path("/usr/share/games/fortunes")
PYDOC = Path("/usr/share/doc/python3.11/html/_sources")
DEBREF = Path("/usr/share/debian-reference")
MANZH = Path("/usr/share/man/zh_CN")
STDLIB = Path("/usr/lib/python3.11")
MAXIMA_INFO = Path("/usr/share/info")
ZH_FORTUNES = ("chinese", "tang300", "song100")
SKIP_FORTUNES = ZH_FORTUNES + ("pratchett",)  # pratchett: 1 entry, placeholder file in Debian


@dataclass(kw_only=True)
class Source:
    """One corpus source: where it comes from, its licence and how to turn it into documents."""

    name: str  # `source` field of its documents
    package: str  # Debian package the text comes from
    licence: str  # licence of the text, from the package's copyright file
    lang: str  # "en" | "zh" | "code"
    domain: str  # coarse domain label: tech | code | literature | quotes | math
    budget: int  # max UTF-8 bytes taken from this source
    docs: Callable[[], Iterator[tuple[str, str]]] = field(repr=False)  # yields (doc key, text)


def _hash_order(paths: list[Path]) -> list[Path]:
    """A fixed pseudo-random order (so a byte budget samples the whole source, not the alphabet's start)."""
    return sorted(paths, key=lambda p: hashlib.sha1(str(p).encode()).hexdigest())


def _fortune_entries(path: Path) -> Iterator[tuple[str, str]]:
    text = ANSI.sub("", path.read_text(encoding="utf-8", errors="replace"))
    for i, entry in enumerate(re.split(r"\n%\n", text)):
        entry = entry.strip("\n")
        if entry.strip():
            yield f"{path.name}/{i}", entry + "\n"


def fortunes_en() -> Iterator[tuple[str, str]]:
    files = [p for p in sorted(FORTUNES.iterdir()) if "." not in p.name and p.name not in SKIP_FORTUNES]
    for p in files:
        yield from _fortune_entries(p)


def fortunes_zh() -> Iterator[tuple[str, str]]:
    for name in ZH_FORTUNES:
        yield from _fortune_entries(FORTUNES / name)


def python_docs() -> Iterator[tuple[str, str]]:
    # whatsnew/ is changelog lists; c-api/ is mostly signatures: keep the prose-heavy parts first
    paths = [p for p in PYDOC.rglob("*.rst.txt") if p.parts[len(PYDOC.parts)] not in ("whatsnew", "c-api")]
    for p in _hash_order(paths):
        yield str(p.relative_to(PYDOC)), p.read_text(encoding="utf-8")


def _debref_sections(path: Path) -> Iterator[tuple[str, str]]:
    text = gzip.decompress(path.read_bytes()).decode("utf-8")
    # body section headings ("1.2. Unix-like filesystem") stand alone between blank lines; the table of
    # contents lists them without blank lines around, so it stays with the preface
    parts = re.split(r"\n\n(?=\d+\.\d+\.[ \u00a0][^\n]+\n\n)", text)  # NBSP after the number
    for i, part in enumerate(parts):
        if part.strip():
            yield f"{path.name}#{i}", part.strip("\n") + "\n"


def debref_en() -> Iterator[tuple[str, str]]:
    yield from _debref_sections(DEBREF / "debian-reference.en.txt.gz")


def debref_zh() -> Iterator[tuple[str, str]]:
    yield from _debref_sections(DEBREF / "debian-reference.zh-cn.txt.gz")


def _render_man(path: Path) -> str:
    env = {**os.environ, "MANWIDTH": "80", "LANG": "C.UTF-8", "MAN_KEEP_FORMATTING": ""}
    out = subprocess.run(["man", "-l", str(path)], capture_output=True, env=env, timeout=60).stdout
    # `col -b` semantics: drop overstrike (char BACKSPACE char) used for bold/underline
    return re.sub(r".\x08", "", out.decode("utf-8", errors="replace"))


def manpages_zh() -> Iterator[tuple[str, str]]:
    paths = [p for p in MANZH.rglob("*.gz") if p.is_file() and not p.is_symlink()]
    for p in _hash_order(paths):
        text = _render_man(p)
        if text.strip():
            yield str(p.relative_to(MANZH)), text


def stdlib_code() -> Iterator[tuple[str, str]]:
    skip = ("test", "tests", "idle_test", "site-packages", "dist-packages", "pydoc_data", "encodings",
            "config-3.11-x86_64-linux-gnu", "lib2to3")
    paths = [p for p in STDLIB.rglob("*.py")
             if not set(p.relative_to(STDLIB).parts) & set(skip) and not p.name.startswith("_sysconfigdata")
             and p.stat().st_size <= 120_000]  # a few huge files (e.g. _pydecimal) would eat the budget
    for p in _hash_order(paths):
        yield str(p.relative_to(STDLIB)), p.read_text(encoding="utf-8", errors="replace")


def maxima_manual() -> Iterator[tuple[str, str]]:
    """The Maxima reference manual (info format): one document per info node (function descriptions,
    worked examples with `(%i1)` inputs and 2D-printed outputs), in the manual's order."""
    for path in sorted(MAXIMA_INFO.glob("maxima.info-*.gz"), key=lambda p: int(p.name.split("-")[1][:-3])):
        text = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
        for i, node in enumerate(text.split("\x1f")):
            node = node.lstrip("\n")
            if node.startswith("File:"):  # the info navigation line ("File: ..., Node: ..., Next: ...")
                node = node.partition("\n")[2]
            if len(node.strip()) > 200:  # skip menus and tiny index nodes
                yield f"{path.name}#{i}", node.strip("\n") + "\n"


def package_version(package: str) -> str:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
        return out.stdout.strip() or "not installed"
    except FileNotFoundError:
        return "unknown (no dpkg)"


SOURCES = [
    Source(name="python-docs", package="python3.11-doc", licence="PSF-2.0 (Python Software Foundation License)",
           lang="en", domain="tech", budget=4_500_000, docs=python_docs),
    Source(name="debian-reference-en", package="debian-reference-en", licence="GPL-2+",
           lang="en", domain="tech", budget=1_200_000, docs=debref_en),
    Source(name="fortunes-en", package="fortunes", licence="BSD-style (fortune-mod; see its copyright file)",
           lang="en", domain="quotes", budget=3_000_000, docs=fortunes_en),
    Source(name="debian-reference-zh", package="debian-reference-zh-cn", licence="GPL-2+",
           lang="zh", domain="tech", budget=1_200_000, docs=debref_zh),
    Source(name="manpages-zh", package="manpages-zh", licence="GFDL-1.2+ / GPL-2+ (per page; see copyright)",
           lang="zh", domain="tech", budget=2_500_000, docs=manpages_zh),
    Source(name="fortunes-zh", package="fortunes-zh", licence="GPL-3+",
           lang="zh", domain="literature", budget=3_000_000, docs=fortunes_zh),
    Source(name="cpython-stdlib", package="libpython3.11-stdlib", licence="PSF-2.0 (Python Software Foundation License)",
           lang="code", domain="code", budget=4_000_000, docs=stdlib_code),
]


# The math set (seed D4's 60/30/10 general/code/math mixture) is bundled apart (`bundled:corpus-math`), so
# adding it left the main snapshot byte-identical: `glm5 data corpus --set math`.
MATH_SOURCES = [
    Source(name="maxima-manual", package="maxima-doc", licence="GPL-2 (Maxima; see its copyright file)",
           lang="en", domain="math", budget=1_500_000, docs=maxima_manual),
]
SETS = {"main": SOURCES, "math": MATH_SOURCES}


def collect(source: Source) -> list[dict]:
    """Documents of one source, in its fixed order, until its byte budget is spent."""
    docs, used = [], 0
    for key, text in source.docs():
        n = len(text.encode("utf-8"))
        if used + n > source.budget:
            if n > source.budget // 20:
                continue  # a big file would overshoot: try the smaller ones that follow
            break
        used += n
        docs.append({"id": f"{source.name}/{key}", "text": text, "source": source.name,
                     "lang": source.lang, "domain": source.domain})
    return docs


def is_validation(doc_id: str, fraction: float) -> bool:
    h = int(hashlib.sha1(doc_id.encode()).hexdigest()[:8], 16)
    return h < fraction * 2**32


def _write_jsonl_gz(path: Path, docs: list[dict]) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    # mtime=0 and no file name in the gzip header: byte-identical output on every build
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        for d in docs:
            f.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))
    os.replace(tmp, path)


def build(out_dir: str | Path, validation_fraction: float = 0.02, sources: list[Source] | None = None) -> dict:
    """Assemble every source (default: the main set), split by id hash, write `train/validation.jsonl.gz` +
    PROVENANCE.md."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[dict]] = {"train": [], "validation": []}
    rows = []
    for src in SOURCES if sources is None else sources:
        docs = collect(src)
        n_bytes = sum(len(d["text"].encode("utf-8")) for d in docs)
        n_dup = len(docs) - len({d["text"] for d in docs})
        rows.append((src, len(docs), n_bytes, n_dup))
        for d in docs:
            splits["validation" if is_validation(d["id"], validation_fraction) else "train"].append(d)
    for name, docs in splits.items():
        _write_jsonl_gz(out_dir / f"{name}.jsonl.gz", docs)
    atomic_write_text(out_dir / "PROVENANCE.md", provenance(rows, splits, validation_fraction))
    os.chmod(out_dir / "PROVENANCE.md", 0o644)
    return {name: len(docs) for name, docs in splits.items()}


def provenance(rows, splits: dict[str, list[dict]], validation_fraction: float) -> str:
    lines = [
        "# Bundled corpus: provenance", "",
        "Built by `glm5 data corpus` (logic: `glm5/data/pipeline/corpus.py`) from Debian 12",
        "packages. Documents are real text; the only changes are removing ANSI colour codes (fortunes) and",
        "info navigation lines (the Maxima manual).",
        "Exact duplicates are the ones the packages contain (the same fortune in two files, for example).",
        f"Split: validation = sha1(id) < {validation_fraction} (fixed, deterministic).", "",
        "| source | Debian package | version | licence | lang | domain | docs | MB (UTF-8) | exact dup docs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for src, n_docs, n_bytes, n_dup in rows:
        lines.append(f"| {src.name} | {src.package} | {package_version(src.package)} | {src.licence} | "
                     f"{src.lang} | {src.domain} | {n_docs} | {n_bytes / 1e6:.2f} | {n_dup} |")
    total = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines += [f"| **total** | | | | | | {total[0]} | {total[1] / 1e6:.2f} | |", ""]
    for name, docs in splits.items():
        langs = Counter(d["lang"] for d in docs)
        lines.append(f"- `{name}.jsonl.gz`: {len(docs)} docs ({', '.join(f'{k}: {v}' for k, v in sorted(langs.items()))})")
    train_texts = {d["text"] for d in splits["train"]}
    leaked = sum(d["text"] in train_texts for d in splits["validation"])
    lines.append(f"- validation documents whose exact text is also in train (the split is by id): {leaked}")
    lines += ["", "Each line: `{\"id\", \"text\", \"source\", \"lang\", \"domain\"}`; `lang` is `en`, `zh` or",
              "`code` (Python source). Full licence texts: `/usr/share/doc/<package>/copyright`.", ""]
    return "\n".join(lines)
