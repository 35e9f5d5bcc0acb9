"""GLM reasoning parser (vLLM's `glm45`, used by GLM-4.5/4.7/5): splits `<think>...</think>` from content.

Owns only text splitting; it knows nothing about tokens or HTTP. GLM-4.7/5 chat templates end the
generation prompt with `<think>` when thinking is on (so the model's output has no opener) and with
`</think>` (or `<think></think>`) when it is off. `prompt_opens_reasoning(prompt)` tells which, and the
parser then starts inside the reasoning block; an explicit leading `<think>` in the output is also
accepted. This fixes the classic leak (F2) where a missing opener sent all reasoning into `content`.
Rules: reasoning and content both drop their leading whitespace; output that ends before `</think>`
is all reasoning. Streaming == non-streaming for every chunking.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ASSISTANT_TAG = "<|assistant|>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """True if the rendered prompt leaves a `<think>` block open for the model to continue."""
    tail = prompt[prompt.rfind(ASSISTANT_TAG) + len(ASSISTANT_TAG):] if ASSISTANT_TAG in prompt else prompt
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (must be held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class GLMReasoningParser:
    """Incremental splitter: `feed(delta) -> (reasoning_delta, content_delta)`, then `finish()`."""

    def __init__(self, start_in_reasoning: bool):
        self.start_in_reasoning = start_in_reasoning
        self.state = "start"  # start -> reasoning -> content (or start -> content)
        self.buf = ""
        self.content_started = False  # leading whitespace of content is dropped
        self.reasoning_started = False

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = "", ""
        if self.state == "start":
            head = self.buf.lstrip()
            if not head or (THINK_OPEN.startswith(head) and head != THINK_OPEN):
                return "", ""  # could still become `<think>`: wait
            if head.startswith(THINK_OPEN):
                self.buf = head[len(THINK_OPEN):]
                self.state = "reasoning"
            else:
                self.state = "reasoning" if self.start_in_reasoning else "content"
        if self.state == "reasoning":
            idx = self.buf.find(THINK_CLOSE)
            if idx >= 0:
                reasoning = self._reasoning(self.buf[:idx])
                self.buf = self.buf[idx + len(THINK_CLOSE):]
                self.state = "content"
            else:
                keep = _partial_suffix(self.buf, THINK_CLOSE)
                reasoning = self._reasoning(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
        if self.state == "content":
            content, self.buf = self._content(self.buf), ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """End of output: flush held-back text (a partial tag is plain text after all)."""
        rest, self.buf = self.buf, ""
        if self.state == "start":
            self.state = "reasoning" if self.start_in_reasoning else "content"
        if self.state == "reasoning":
            return self._reasoning(rest), ""
        return "", self._content(rest)

    def _reasoning(self, text: str) -> str:
        if not self.reasoning_started:
            text = text.lstrip()
            self.reasoning_started = bool(text)
        return text

    def _content(self, text: str) -> str:
        if not self.content_started:
            text = text.lstrip()
            self.content_started = bool(text)
        return text


def parse_reasoning(output: str, start_in_reasoning: bool) -> tuple[str | None, str | None]:
    """Non-streaming: `(reasoning_content or None, content or None)` for a whole model output."""
    p = GLMReasoningParser(start_in_reasoning)
    r1, c1 = p.feed(output)
    r2, c2 = p.finish()
    return (r1 + r2) or None, (c1 + c2) or None
