"""Server-side chat sessions (seed I8): `session_id` on a chat request, the history kept by the server.

A request with `session_id` sends only its new messages; the server prepends the session's earlier turns
(messages and the assistant's replies) and, once the reply is done, appends the new turn. The prompt is
the exact previous history plus the new turn, so the prefix cache serves the history from the blocks the
last turn left. Past `max_session_len` tokens (prompt + max_tokens), the oldest turns are cut (system
messages and the new turn are kept): dropped (`policy="drop"`), or replaced by one system message with a
summary the model writes of them (`"summarize"`); both free the cut history's KV for other requests.
Sessions idle longest are forgotten past `max_sessions`. Two concurrent requests on one session each see
the history as it was when they started; the later reply is appended last.

Knows no HTTP: `serving_chat.py` calls `messages_for`, `cut`, `record`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Literal

SUMMARY_REQUEST = "Summarize our conversation so far in a few sentences, keeping names, numbers and decisions."
SUMMARY_PREFIX = "Summary of the earlier conversation: "


@dataclass
class ChatSession:
    messages: list[dict] = field(default_factory=list)  # the conversation so far (OpenAI message dicts)
    turns: int = 0
    cut_messages: int = 0
    cut_tokens: int = 0  # history tokens dropped or summarised away (KV the session no longer holds)
    summaries: int = 0
    last_used: float = field(default_factory=time.monotonic)


class SessionStore:
    def __init__(self, max_session_len: int | None = None, policy: Literal["drop", "summarize"] = "drop",
                 max_sessions: int = 4096):
        if policy not in ("drop", "summarize"):
            raise ValueError(f"session policy must be 'drop' or 'summarize', got {policy!r}")
        self.max_session_len, self.policy, self.max_sessions = max_session_len, policy, max_sessions
        self._sessions: OrderedDict[str, ChatSession] = OrderedDict()

    def get(self, session_id: str) -> ChatSession:
        s = self._sessions.pop(session_id, None) or ChatSession()
        s.last_used = time.monotonic()
        self._sessions[session_id] = s  # most recently used last
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return s

    def messages_for(self, session_id: str, new: list[dict]) -> list[dict]:
        """The prompt's messages: the session's history, then the request's new messages."""
        return self.get(session_id).messages + new

    def cut(self, session_id: str, new: list[dict], count_tokens: Callable[[list[dict]], int],
            reserve: int, keep: dict | None = None) -> tuple[list[dict], list[dict]]:
        """Cut the oldest history turns (an earlier summary counts as one) until count_tokens(history + new)
        + reserve fits max_session_len (`keep`: a message never cut, e.g. a summary just written).
        -> (kept history, cut messages); the session keeps the shortened history (the caller may insert
        a summary with `add_summary`)."""
        s = self.get(session_id)
        if self.max_session_len is None:
            return s.messages, []
        before = count_tokens(s.messages + new)
        history, cut = list(s.messages), []
        while history and count_tokens(history + new) + reserve > self.max_session_len:
            i = next((j for j, m in enumerate(history) if _cuttable(m) and m is not keep), None)
            if i is None:
                break  # only system messages left: nothing more to cut
            cut.append(history.pop(i))
        if cut:
            s.messages = history
            s.cut_messages += len(cut)
            s.cut_tokens += before - count_tokens(history + new)
        return history, cut

    def add_summary(self, session_id: str, text: str) -> dict:
        """Insert the summary of cut turns as a system message after the leading system messages."""
        s = self.get(session_id)
        msg = {"role": "system", "content": SUMMARY_PREFIX + text.strip()}
        i = next((j for j, m in enumerate(s.messages) if m.get("role") != "system"), len(s.messages))
        s.messages.insert(i, msg)
        s.summaries += 1
        return msg

    def record(self, session_id: str, new: list[dict], reply: dict | None) -> None:
        """Append a finished turn: the request's new messages and the assistant's reply."""
        s = self.get(session_id)
        s.messages = s.messages + new + ([reply] if reply is not None else [])
        s.turns += 1

    def info(self, session_id: str) -> dict:
        s = self.get(session_id)
        return {"id": session_id, "turns": s.turns, "history_messages": len(s.messages),
                "cut_messages": s.cut_messages, "cut_tokens": s.cut_tokens, "summaries": s.summaries,
                "max_session_len": self.max_session_len, "policy": self.policy}


def _cuttable(message: dict) -> bool:
    """Everything but the user's own system messages; an earlier summary is cut (and summarised again)."""
    content = message.get("content")
    return message.get("role") != "system" or (isinstance(content, str) and content.startswith(SUMMARY_PREFIX))


class ResponseStore:
    """The Responses API's `previous_response_id`: response id -> the conversation up to and including
    that response (OpenAI chat message dicts), the `max_responses` most recent only (oldest evicted).
    Thread-safe (read in the tokenizer pool, written on the event loop)."""

    def __init__(self, max_responses: int):
        if max_responses < 1:
            raise ValueError(f"max_responses must be >= 1, got {max_responses}")
        self.max_responses = max_responses
        self._items: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict]) -> None:
        with self._lock:
            self._items[response_id] = messages
            while len(self._items) > self.max_responses:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict] | None:
        with self._lock:
            return self._items.get(response_id)
