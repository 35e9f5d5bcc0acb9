"""Readers for the files a user brings (official layouts) and for the bundled sets.

- MMLU: headerless CSV rows `question, A, B, C, D, answer` in `<subject>_<split>.csv` (official tarball:
  `data/{dev,val,test}/`); few-shot examples come from `<subject>_dev.csv`.
- C-Eval: CSV with header `id, question, A, B, C, D, answer[, explanation]`, same file naming.
- HumanEval: JSONL (optionally .gz) with `task_id, prompt, entry_point, test`.
- JSONL sets (perplexity, exact, queries): one object per line.
Every malformed record raises `DataError` naming the file and line.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

LETTERS = ("A", "B", "C", "D")
SPLIT_RE = re.compile(r"^(?P<subject>.+)_(?P<split>dev|val|test)\.csv$")


class DataError(ValueError):
    """A task file is malformed; the message starts with `file:line:`."""


@dataclass
class ChoiceDoc:
    id: str
    question: str
    choices: list[str]
    answer: int  # index into choices
    subject: str = ""
    extra: dict = field(default_factory=dict)


def open_text(path: Path):
    """Text handle for a plain or gzip-compressed file."""
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path), encoding="utf-8")
    return open(path, encoding="utf-8", newline="")


def read_jsonl(path: str | Path, required: tuple[str, ...] = ()) -> list[tuple[int, dict]]:
    """(line number, object) per non-empty line; objects must have the `required` keys."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    out = []
    with open_text(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
            missing = [k for k in required if k not in obj]
            if missing:
                raise DataError(f"{path}:{n}: missing field(s) {missing}")
            out.append((n, obj))
    return out


def _answer_index(value: str, path: Path, line: int) -> int:
    v = value.strip().upper()
    if v not in LETTERS:
        raise DataError(f"{path}:{line}: answer must be one of A, B, C, D, got {value!r}")
    return LETTERS.index(v)


def read_mmlu_csv(path: str | Path) -> list[ChoiceDoc]:
    path = Path(path)
    subject = subject_of(path)
    docs = []
    with open_text(path) as f:
        reader = csv.reader(f)
        for i, row in enumerate(reader):
            if len(row) != 6:
                raise DataError(f"{path}:{reader.line_num}: expected 6 columns (question, A, B, C, D, answer), "
                                f"got {len(row)}")
            docs.append(ChoiceDoc(f"{subject}/{i}", row[0], row[1:5], _answer_index(row[5], path, reader.line_num),
                                  subject))
    return docs


def read_ceval_csv(path: str | Path) -> list[ChoiceDoc]:
    path = Path(path)
    subject = subject_of(path)
    docs = []
    with open_text(path) as f:
        reader = csv.DictReader(f)
        need = {"question", "A", "B", "C", "D", "answer"}
        missing = need - set(reader.fieldnames or [])
        if missing:
            raise DataError(f"{path}:1: header lacks {sorted(missing)} (C-Eval: id,question,A,B,C,D,answer"
                            f"[,explanation]; the test split has no answers)")
        for i, row in enumerate(reader):
            if None in row or any(row[k] is None for k in need):
                raise DataError(f"{path}:{reader.line_num}: wrong number of columns")
            doc_id = f"{subject}/{row.get('id') or i}"
            docs.append(ChoiceDoc(doc_id, row["question"], [row[k] for k in LETTERS],
                                  _answer_index(row["answer"], path, reader.line_num), subject,
                                  {"explanation": row.get("explanation") or ""}))
    return docs


def subject_of(path: Path) -> str:
    m = SPLIT_RE.match(path.name)
    return m.group("subject") if m else path.stem


def find_split_files(data: str | Path, split: str) -> list[Path]:
    """`<subject>_<split>.csv` files: the file itself, or every match under a directory (sorted)."""
    data = Path(data)
    if data.is_file():
        return [data]
    if not data.is_dir():
        raise DataError(f"{data}: no such file or directory")
    files = sorted(data.rglob(f"*_{split}.csv"))
    if not files:
        raise DataError(f"{data}: no *_{split}.csv files (expected the MMLU/C-Eval layout)")
    return files


def find_dev_file(eval_file: Path, root: Path) -> Path | None:
    """The few-shot file of `eval_file`'s subject: next to it, in a sibling `dev/`, or anywhere under root."""
    name = f"{subject_of(eval_file)}_dev.csv"
    for cand in (eval_file.with_name(name), eval_file.parent.parent / "dev" / name):
        if cand.is_file():
            return cand
    hits = sorted(root.rglob(name)) if root.is_dir() else []
    return hits[0] if hits else None


def read_humaneval(path: str | Path) -> list[dict]:
    rows = read_jsonl(path, required=("task_id", "prompt", "entry_point", "test"))
    return [obj for _, obj in rows]
