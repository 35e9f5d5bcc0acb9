"""Build the bundled bilingual SFT set from the bundled corpus: `python -m glm5.data.sft_corpus CORPUS OUT`.

Every conversation is derived mechanically from one corpus document, so it inherits that document's
licence and provenance (`source`, `license` on each line; PROVENANCE.md in OUT). Tasks:
  manpage      (zh) what a command / call does, from a man page's NAME and SYNOPSIS; a third of them
               as a tool-call conversation (`man` tool -> result -> answer, with reasoning), a quarter
               with a follow-up turn about the manual section
  python-doc   (en) what a stdlib module is for (its `:synopsis:` + first paragraph), and what a section
               of its documentation says (first paragraph under the heading)
  poem         (zh) continue a Tang / Song poem from its first lines
  code-explain (en) explain a stdlib function shown without its docstring; the answer is the docstring's
               first paragraph, the reasoning lists its parameters and the calls it makes
  fortune      (en/zh) a saying of a given fortune category
The split is by source document (sha1 of its id), so held-out conversations come from documents that
no training conversation saw. Deterministic: the same corpus gives byte-identical files.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import re
import textwrap
from collections import Counter
from pathlib import Path

HELDOUT_FRACTION = 0.08
LICENSES = {  # from the corpus PROVENANCE.md (Debian 12 packages)
    "python-docs": "PSF-2.0", "cpython-stdlib": "PSF-2.0", "debian-reference-en": "GPL-2+",
    "debian-reference-zh": "GPL-2+", "manpages-zh": "GFDL-1.2+ / GPL-2+", "fortunes-en": "BSD-style (fortune-mod)",
    "fortunes-zh": "GPL-3+",
}
MAN_SECTIONS = {"1": "用户命令", "2": "系统调用", "3": "库函数", "4": "特殊文件", "5": "文件格式", "6": "游戏",
                "7": "杂项", "8": "系统管理命令"}
MAN_TOOL = {"type": "function", "function": {
    "name": "man", "description": "Read a Linux manual page (中文手册页)",
    "parameters": {"type": "object", "properties": {"page": {"type": "string"}, "section": {"type": "integer"}},
                   "required": ["page"]}}}


def _unit(key: str) -> float:
    """A deterministic number in [0, 1) from a string."""
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) / 16 ** 8


def _pick(options: list[str], key: str) -> str:
    return options[int(_unit(key) * len(options))]


# --- man pages ----------------------------------------------------------------------------------------
def _man_sections(text: str) -> dict[str, list[str]]:
    """Heading (first word of an unindented line) -> its indented body lines."""
    out, cur = {}, None
    for line in text.splitlines():
        if line and not line[0].isspace():
            cur = line.split()[0]
            out.setdefault(cur, [])
        elif cur is not None:
            out[cur].append(line)
    return out


def manpage(doc: dict) -> list[dict]:
    sec = _man_sections(doc["text"])
    name = next((sec[h] for h in ("NAME", "名称") if sec.get(h)), [])
    name_lines = " ".join(x.strip() for x in name if x.strip())
    m = re.match(r"^(.+?)\s+[-—]{1,2}\s*(.+)$", name_lines)
    synopsis = next((sec[h] for h in ("SYNOPSIS", "总览", "大纲", "概要", "概述", "语法") if sec.get(h)), [])
    synopsis = textwrap.dedent("\n".join(x for x in synopsis if x.strip())).strip().splitlines()
    if not m or not synopsis or len(m.group(2)) > 200:
        return []
    names, desc = m.group(1).strip(), m.group(2).strip().rstrip("。.")
    page = names.split(",")[0].strip()
    section = re.search(r"/man(\d)", doc["id"]).group(1)
    usage = "\n".join(synopsis[:6])
    answer = f"`{page}`：{desc}。\n\n用法：\n```\n{usage}\n```"
    question = _pick([f"`{page}` 是做什么用的？", f"{page} 这个命令（或函数）有什么作用？",
                      f"请简单介绍一下 man {section} {page}。"], doc["id"])
    key = _unit(doc["id"] + "#form")
    if key < 1 / 3:
        call = {"id": "call_0", "type": "function",
                "function": {"name": "man", "arguments": json.dumps({"page": page, "section": int(section)},
                                                                    ensure_ascii=False)}}
        result = f"NAME\n  {names} - {desc}\nSYNOPSIS\n" + textwrap.indent(usage, "  ")
        msgs = [{"role": "user", "content": question},
                {"role": "assistant", "content": "", "tool_calls": [call],
                 "reasoning_content": f"用户问的是 `{page}`，先查手册第 {section} 节。"},
                {"role": "tool", "tool_call_id": "call_0", "content": result},
                {"role": "assistant", "content": answer,
                 "reasoning_content": "手册的 NAME 和 SYNOPSIS 部分已经回答了这个问题。"}]
        return [{"task": "manpage", "lang": "zh", "messages": msgs, "tools": [MAN_TOOL]}]
    msgs = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if key > 3 / 4:
        msgs += [{"role": "user", "content": "它在手册的第几节？"},
                 {"role": "assistant", "content": f"第 {section} 节（{MAN_SECTIONS.get(section, '其他')}）。"}]
    return [{"task": "manpage", "lang": "zh", "messages": msgs}]


# --- Python documentation -----------------------------------------------------------------------------
def _clean_rst(text: str) -> str:
    text = re.sub(r":[\w:]+:`~?!?([^`<]+?)(?:\s*<[^>]+>)?`", r"`\1`", text)  # :class:`Foo` -> `Foo`
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return re.sub(r"\s+", " ", text).strip()


def _prose_paragraphs(block: str) -> list[str]:
    """Unindented paragraphs that are plain prose (no directives, headings, lists, tables)."""
    out = []
    for para in re.split(r"\n\s*\n", block):
        first = para.lstrip("\n")
        if not first or first[0] in " \t.:*-=+|>#~" or first.startswith("**Source code"):
            continue
        if re.search(r"\n[=\-~^]{3,}\s*$", para):  # a heading
            continue
        out.append(_clean_rst(para))
    return [p for p in out if 40 <= len(p) <= 900 and not p.endswith(":")]  # no list introductions


def python_doc(doc: dict) -> list[dict]:
    text = doc["text"]
    m = re.search(r"^\.\. module:: (\S+)\n(?:[ \t]+:[^\n]*\n)*?[ \t]+:synopsis: (.+)$", text, re.M)
    if not m:
        return []
    module, synopsis = m.group(1), _clean_rst(m.group(2)).rstrip(".")
    heads = list(re.finditer(r"^([^\n]+)\n([=\-~^])\2{2,}\s*$", text, re.M))
    intro_end = heads[1].start() if len(heads) > 1 else len(text)
    intro = _prose_paragraphs(text[m.end():intro_end])
    out = []
    if intro:
        q = _pick([f"What is the Python module `{module}` for?", f"What does `{module}` in the standard library do?",
                   f"Briefly explain the `{module}` module."], doc["id"])
        out.append({"task": "python-doc", "lang": "en", "messages": [
            {"role": "user", "content": q}, {"role": "assistant", "content": f"`{module}`: {synopsis}.\n\n{intro[0]}"}]})
    for i, h in enumerate(heads[1:3], 1):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        paras = _prose_paragraphs(text[h.end():end])
        title = _clean_rst(h.group(1))
        if paras and len(title) < 80:
            out.append({"task": "python-doc", "lang": "en", "messages": [
                {"role": "user", "content": f'In the Python documentation of `{module}`, what does the section '
                                            f'"{title}" explain?'},
                {"role": "assistant", "content": paras[0]}]})
    return out


# --- poems --------------------------------------------------------------------------------------------
def poem(doc: dict) -> list[dict]:
    lines = [x.strip() for x in doc["text"].splitlines() if x.strip()]
    if len(lines) < 5 or not lines[0].startswith("《") or not lines[1].startswith("作者"):
        return []
    title, author, verse = lines[0], lines[1].split("：", 1)[-1], lines[2:]
    if not 3 <= len(verse) <= 16:
        return []
    k = 1 if len(verse) <= 4 else 2
    q = _pick([f"请续写{author}的{title}：\n", f"接着背诵这首诗（{author}{title}）：\n", "请接着写下去：\n"], doc["id"])
    return [{"task": "poem", "lang": "zh", "messages": [
        {"role": "user", "content": q + "\n".join(verse[:k])},
        {"role": "assistant", "content": "\n".join(verse[k:])}]}]


# --- code ---------------------------------------------------------------------------------------------
def _calls(fn: ast.FunctionDef) -> list[str]:
    names = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name and name not in names:
                names.append(name)
    return names


def code_explain(doc: dict, per_module: int = 3) -> list[dict]:
    try:
        tree = ast.parse(doc["text"])
    except SyntaxError:
        return []
    lines, module = doc["text"].splitlines(), doc["id"].rsplit("/", 1)[-1].removesuffix(".py")
    out = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        docstring = ast.get_docstring(fn)
        if not docstring or fn.name.startswith("__") or len(out) >= per_module:
            continue
        summary = re.sub(r"\s+", " ", docstring.split("\n\n")[0]).strip()
        ds = fn.body[0]
        body = lines[fn.lineno - 1:ds.lineno - 1] + lines[ds.end_lineno:fn.end_lineno]
        if not 3 <= len(body) <= 20 or len(summary) < 20 or fn.decorator_list:
            continue
        args = [a.arg for a in fn.args.args if a.arg not in ("self", "cls")]
        calls = _calls(fn)[:4]
        reasoning = (f"`{fn.name}` takes {', '.join(f'`{a}`' for a in args) or 'no arguments'}"
                     + (f" and calls {', '.join(f'`{c}`' for c in calls)}" if calls else "")
                     + f". It comes from the standard library module `{module}`.")
        src = textwrap.dedent("\n".join(body))
        out.append({"task": "code-explain", "lang": "en", "messages": [
            {"role": "user", "content": f"Explain what this Python function does:\n\n```python\n{src}\n```"},
            {"role": "assistant", "content": summary, "reasoning_content": reasoning}]})
    return out


# --- fortunes -----------------------------------------------------------------------------------------
def fortune(doc: dict, keep: float) -> list[dict]:
    text = doc["text"].strip()
    if _unit(doc["id"] + "#keep") >= keep or not 20 <= len(text) <= 300:
        return []
    category = doc["id"].split("/")[1]
    if doc["lang"] == "zh":
        q = "给我一句格言或者一段有意思的话。" if category == "chinese" else f"给我一段 {category} 里的话。"
    else:
        q = _pick([f"Give me a fortune from the '{category}' file.", f"Share a saying from the fortune collection '{category}'."], doc["id"])
    return [{"task": "fortune", "lang": doc["lang"], "messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": text}]}]


def conversations(doc: dict) -> list[dict]:
    """All SFT conversations derived from one corpus document."""
    src, did = doc["source"], doc["id"]
    if src == "manpages-zh":
        out = manpage(doc)
    elif src == "python-docs" and "/library/" in did:
        out = python_doc(doc)
    elif src == "fortunes-zh" and ("/tang300/" in did or "/song100/" in did):
        out = poem(doc)
    elif src == "cpython-stdlib":
        out = code_explain(doc)
    elif src.startswith("fortunes"):
        out = fortune(doc, keep=0.02 if src == "fortunes-en" else 0.04)
    else:
        out = []
    return [{"id": f"{c['task']}/{did}#{k}", **c, "source": did, "license": LICENSES[src]}
            for k, c in enumerate(out)]


def build(corpus: Path, out: Path) -> dict:
    """Write OUT/train.jsonl.gz, OUT/heldout.jsonl.gz and OUT/PROVENANCE.md; return the counts."""
    out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[dict]] = {"train": [], "heldout": []}
    for name in ("train.jsonl.gz", "validation.jsonl.gz"):
        with gzip.open(corpus / name, "rt", encoding="utf-8") as f:
            for line in f:
                doc = json.loads(line)
                split = "heldout" if _unit(doc["id"] + "#split") < HELDOUT_FRACTION else "train"
                splits[split].extend(conversations(doc))
    counts = {}
    for split, convs in splits.items():
        convs.sort(key=lambda c: c["id"])
        # mtime=0: the same corpus gives byte-identical files
        with gzip.GzipFile(out / f"{split}.jsonl.gz", "wb", mtime=0) as f:
            for c in convs:
                f.write((json.dumps(c, ensure_ascii=False) + "\n").encode("utf-8"))
        counts[split] = Counter(f"{c['task']}/{c['lang']}" for c in convs)
    (out / "PROVENANCE.md").write_text(_provenance(counts))
    return {k: dict(sorted(v.items())) for k, v in counts.items()}


def _provenance(counts: dict[str, Counter]) -> str:
    rows = sorted(set(counts["train"]) | set(counts["heldout"]))
    table = "\n".join(f"| {r} | {counts['train'][r]} | {counts['heldout'][r]} |" for r in rows)
    return (f"# Bundled SFT set: provenance\n\nBuilt by `python -m glm5.data.sft_corpus CORPUS OUT` from the bundled "
            f"corpus (`glm5/data/sft_corpus.py` documents every task). Each line carries `source` (the corpus "
            f"document id) and `license` (that document's licence; the corpus PROVENANCE.md names the Debian "
            f"packages). Held-out = sha1(source id) < {HELDOUT_FRACTION}: no held-out document feeds training.\n\n"
            f"| task/lang | train | heldout |\n|---|---|---|\n{table}\n"
            f"| **total** | {sum(counts['train'].values())} | {sum(counts['heldout'].values())} |\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm5.data.sft_corpus", description=__doc__.splitlines()[0])
    ap.add_argument("corpus", type=Path, help="directory with the corpus train/validation .jsonl.gz")
    ap.add_argument("out", type=Path, help="output directory (e.g. glm5/data/assets/sft)")
    print(json.dumps(build(**vars(ap.parse_args(argv))), ensure_ascii=False, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
