"""GLM reasoning parser (vLLM's `glm45`, used by GLM-4.5/4.7/5): splits `<think>...</think>` from content.

Owns only text splitting; it knows nothing about tokens or HTTP. GLM-4.7/5 chat templates end the
generation prompt with `<think>` when thinking is on (so the model's output has no opener) and with
`</think>` (or `<think></think>`) when it is off. `prompt_opens_reasoning(prompt)` tells which, and the
parser then starts inside the reasoning block; an explicit leading `<think>` in the output is also
accepted. This fixes the classic leak (F2) where a missing opener sent all reasoning into `content`.
Rules: reasoning and content both drop their leading whitespace; output that ends before `</think>`
is all reasoning; a `<tool_call>` inside an open block ends the reasoning too (GLM sometimes calls a
tool without closing its thinking; SGLang's GLM-4.5 detector and vLLM's GLM parser route it to
content), and the tag itself starts the content so the tool parser sees it. Empty reasoning is None,
never "". Streaming == non-streaming for every chunking.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL_TAG = "<tool_call>"  # ends an open reasoning block and stays in the content
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
            end, tool = self.buf.find(THINK_CLOSE), self.buf.find(TOOL_CALL_TAG)
            if tool >= 0 and (end < 0 or tool < end):
                reasoning = self._reasoning(self.buf[:tool])
                self.buf = self.buf[tool:]
                self.state = "content"
            elif end >= 0:
                reasoning = self._reasoning(self.buf[:end])
                self.buf = self.buf[end + len(THINK_CLOSE):]
                self.state = "content"
            else:
                keep = max(_partial_suffix(self.buf, THINK_CLOSE), _partial_suffix(self.buf, TOOL_CALL_TAG))
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
