"""GLM's code-completion prompt (CodeGeeX4's layout), shared by `/infill` (glm5.infer.infill) and the
`fim` training objective (glm5.data.loader), so that a model is trained on what it is served.

The layout, from THUDM/CodeGeeX4 `guides/Infilling_guideline.md` ("Contextual Completion" and "Cross File
Infilling"), behind GLM's `[gMASK]<sop>` prompt prefix (what GLM's tokenizers prepend):

    <|user|>
    ###REFERENCE:
    ###PATH:{reference path}
    {reference code}
    (one ###REFERENCE: block per other file)
    ###PATH:{path}
    ###LANGUAGE:{language}
    ###MODE:{LINE|BLOCK}
    <|code_suffix|>{suffix}<|code_prefix|>{prefix}<|code_middle|><|assistant|>
    {middle}

`LINE` asks for one line, `BLOCK` (the default) for several. The language tag is the language's name
with its initial capital ("Python"), empty when unknown, as the guide says. Knows no HTTP and no engine;
`CodeFim` takes a loaded tokenizer (the one a shard directory carries).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal

import numpy as np

CodeMode = Literal["LINE", "BLOCK"]
MODES = ("LINE", "BLOCK")
# What the prompt needs from the vocabulary (prefix, suffix, middle sentinels and the chat roles).
NEEDED = ("<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>", "<|user|>", "<|assistant|>")
START = ("[gMASK]", "<sop>")  # GLM's prompt prefix, used when the vocabulary has it
# File extension -> the language tag CodeGeeX4 expects (its guide: initial capital, a few exceptions).
LANGUAGES = {
    ".py": "Python", ".js": "JavaScript", ".jsx": "JavaScript", ".ts": "TypeScript", ".tsx": "TypeScript",
    ".java": "Java", ".c": "C", ".h": "C", ".cc": "C++", ".cpp": "C++", ".hpp": "C++", ".cu": "Cuda",
    ".cs": "C#", ".go": "Go", ".rs": "Rust", ".rb": "Ruby", ".php": "PHP", ".swift": "Swift",
    ".kt": "Kotlin", ".scala": "Scala", ".lua": "Lua", ".sh": "Shell", ".sql": "SQL", ".r": "R",
    ".dart": "Dart", ".hs": "Haskell", ".html": "HTML", ".css": "CSS", ".json": "JSON", ".xml": "XML",
    ".md": "Markdown", ".tex": "TeX", ".vue": "Vue", ".m": "Objective-C", ".pas": "Pascal",
}


def language_of(path: str) -> str:
    """The language tag for a file path ("" when the extension is not known)."""
    return LANGUAGES.get(PurePosixPath(path).suffix.lower(), "")


def choose_mode(suffix: str, mode: str | None = None) -> CodeMode:
    """`mode` when given (LINE | BLOCK, any case), else LINE when the cursor is inside a line (text follows
    it on the same line: only the rest of that line can fit), else BLOCK."""
    if mode:
        if mode.upper() not in MODES:
            raise ValueError(f"mode must be LINE or BLOCK, got {mode!r}")
        return mode.upper()  # type: ignore[return-value]
    return "LINE" if suffix.split("\n", 1)[0].strip() else "BLOCK"


def references_text(references: list[tuple[str, str]]) -> str:
    """Other files as `###REFERENCE:` blocks: path line, then the code, then a newline."""
    return "".join(f"###REFERENCE:\n###PATH:{path}\n{code}\n" for path, code in references)


def header_text(path: str, language: str, mode: CodeMode) -> str:
    return f"###PATH:{path}\n###LANGUAGE:{language}\n###MODE:{mode}\n"


@dataclass(frozen=True)
class CodeTokens:
    """The special-token ids the prompt uses."""

    prefix: int
    suffix: int
    middle: int
    user: int
    assistant: int
    start: tuple[int, ...] = ()  # [gMASK] <sop>, when the vocabulary has them

    @classmethod
    def from_special_tokens(cls, special: dict[str, int]) -> "CodeTokens | None":
        """From a name -> id map (a tokenizer's or a shard directory's); None when something is missing."""
        if any(t not in special for t in NEEDED):
            return None
        start = tuple(special[t] for t in START) if all(t in special for t in START) else ()
        return cls(*(special[t] for t in NEEDED), start=start)

    def prompt(self, context: list[int], suffix: list[int], prefix: list[int], newline: list[int]) -> list[int]:
        """The prompt ids: `context` is the encoded text between `<|user|>` and `<|code_suffix|>`
        ("\\n" + references + headers), `newline` the encoded "\\n" after `<|assistant|>`."""
        return [*self.start, self.user, *context, self.suffix, *suffix, self.prefix, *prefix, self.middle,
                self.assistant, *newline]

    @property
    def overhead(self) -> int:
        """Special tokens in a prompt (everything but the encoded text)."""
        return len(self.start) + 5


@dataclass(frozen=True)
class CodeFim:
    """The `fim` training objective in this layout: a document piece cut into prefix / middle / suffix
    becomes the prompt above (no path, no language, no references: a document carries none) followed by
    the middle and `<|endoftext|>`; `###MODE:LINE` when the middle has no newline, else BLOCK."""

    tokens: CodeTokens
    context: dict[str, tuple[int, ...]]  # mode -> encoded "\n" + headers
    newline: tuple[int, ...]  # encoded "\n" (after <|assistant|>)
    end: int  # <|endoftext|>
    line_breaks: frozenset[int]  # ids whose text contains a newline

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "CodeFim | None":
        """From a `glm5.data.tokenizer.GLMTokenizer`; None when its vocabulary lacks the tokens."""
        tokens = CodeTokens.from_special_tokens(tokenizer.special_tokens)
        end = tokenizer.special_tokens.get("<|endoftext|>")
        if tokens is None or end is None:
            return None
        context = {m: tuple(tokenizer.encode("\n" + header_text("", "", m))) for m in MODES}
        breaks = frozenset(i for i in range(tokenizer.vocab_size) if b"\n" in tokenizer.token_bytes(i))
        return cls(tokens, context, tuple(tokenizer.encode("\n")), end, breaks)

    @property
    def overhead(self) -> int:
        """Tokens a sample adds to its piece (the longest mode's headers)."""
        return self.tokens.overhead + max(map(len, self.context.values())) + len(self.newline) + 1

    def sample(self, tokens, i: int, j: int):
        """prefix = tokens[:i], middle = tokens[i:j], suffix = tokens[j:] -> the sample's ids (int64)."""
        middle = [int(t) for t in tokens[i:j]]
        mode = "BLOCK" if any(t in self.line_breaks for t in middle) else "LINE"
        ids = self.tokens.prompt(list(self.context[mode]), [int(t) for t in tokens[j:]],
                                 [int(t) for t in tokens[:i]], list(self.newline))
        return np.asarray([*ids, *middle, self.end], dtype=np.int64)
