"""Multi-turn sessions: each turn's prompt is the previous turns' exact tokens plus the new user turn,
so the prefix cache serves the whole history from the blocks the last turn left behind (nothing is
recomputed but the new turn). Past `max_session_len` tokens the oldest turns are cut: dropped
(`policy="drop"`), or replaced by one summary turn that the model writes itself (`"summarize"`).
Between turns a session holds no blocks: its history lives in free, cached blocks (reusable until
evicted), so a cut history simply stops being hit and its blocks age out of the LRU free queue.

    s = Session(engine, max_session_len=2048, policy="drop")
    reply = s.send("Hello!", SamplingParams(max_tokens=64))   # text in, RequestOutput out
    s.stats()   # tokens served from cache, tokens cut, KV bytes saved

Turns are kept as token ids (rendered with the tokenizer's chat template when there is one; plain
token-id turns work without a tokenizer).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling import SamplingParams

SUMMARY_REQUEST = "Summarize our conversation so far in a few sentences, keeping names, numbers and decisions."


@dataclass
class Turn:
    role: str  # "system" | "user" | "assistant" | "summary"
    token_ids: list[int]


@dataclass
class SessionStats:
    turns: int = 0
    prompt_tokens: int = 0  # summed over turns
    cached_tokens: int = 0  # of which served from the prefix cache
    cut_tokens: int = 0  # history tokens dropped or summarised away
    summaries: int = 0
    kv_bytes_reused: int = 0  # cached_tokens x KV bytes per token: KV not recomputed
    kv_bytes_cut: int = 0  # cut_tokens x KV bytes per token: KV the session no longer needs


class Session:
    _ids = itertools.count()

    def __init__(self, engine: LLMEngine, max_session_len: int | None = None, policy: str | None = None,
                 system: str | None = None, keep_last_turns: int = 2, summary_max_tokens: int = 96):
        self.engine = engine
        self.max_session_len = max_session_len or engine.config.max_session_len
        self.policy = policy or engine.config.session_policy
        if self.policy not in ("drop", "summarize"):
            raise ValueError(f"session policy must be 'drop' or 'summarize', got {self.policy!r}")
        self.keep_last_turns, self.summary_max_tokens = keep_last_turns, summary_max_tokens
        self.tok = engine.tokenizer
        self.prefix = self._render([], prefix=True)  # [gMASK]<sop> with a GLM tokenizer
        self.turns: list[Turn] = []
        if system:
            self.turns.append(Turn("system", self._render([{"role": "system", "content": system}])))
        self._stats = SessionStats()
        self.id = f"session-{next(self._ids)}"

    # ---- rendering --------------------------------------------------------------------------------
    def _render(self, messages: list[dict], prefix: bool = False, gen: bool = False) -> list[int]:
        """Chat-template tokens of `messages` without the conversation prefix (or only the prefix)."""
        if self.tok is None:
            return []
        full = self.tok.apply_chat_template(messages or [{"role": "user", "content": ""}],
                                            add_generation_prompt=gen, tokenize=True)
        n = sum(1 for t in full[:2] if t in (self.tok.special_tokens.get("[gMASK]"), self.tok.special_tokens.get("<sop>")))
        return list(full[:n]) if prefix else list(full[n:])

    def history_ids(self) -> list[int]:
        return self.prefix + [t for turn in self.turns for t in turn.token_ids]

    def _user_turn(self, message: str | list[int]) -> Turn:
        if isinstance(message, str):
            if self.tok is None:
                raise ValueError("this model has no tokenizer: send token ids")
            return Turn("user", self._render([{"role": "user", "content": message}], gen=True))
        return Turn("user", list(message))

    # ---- one turn ---------------------------------------------------------------------------------
    def send(self, message: str | list[int], params: SamplingParams | None = None) -> RequestOutput:
        params = params or SamplingParams(max_tokens=128)
        self.turns.append(self._user_turn(message))
        self._fit(params.max_tokens or 0)
        out = self._generate(self.history_ids(), params)
        eos = set(self.engine.eos_token_ids)
        reply = list(out.outputs[0].token_ids)
        while reply and reply[-1] in eos:  # the next user turn opens with its own role token
            reply.pop()
        self.turns.append(Turn("assistant", reply))
        return out

    def _generate(self, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        rid = f"{self.id}-{self._stats.turns}-{len(prompt_ids)}"
        self.engine.add_request(rid, prompt_token_ids=prompt_ids, params=params)
        final = None
        while final is None or not final.finished:
            for o in self.engine.step():
                if o.request_id == rid:
                    final = o
        s = self._stats
        s.turns += 1
        s.prompt_tokens += len(prompt_ids)
        cached = max(final.metrics.num_cached_tokens, 0) if final.metrics else 0
        s.cached_tokens += cached
        s.kv_bytes_reused += cached * self.engine.runner.cache.bytes_per_token()
        return final

    # ---- cutting history --------------------------------------------------------------------------
    def _fit(self, reserve: int) -> None:
        """Cut the oldest turns until history + `reserve` new tokens fit max_session_len."""
        if self.max_session_len is None or len(self.history_ids()) + reserve <= self.max_session_len:
            return
        first = 1 if self.turns and self.turns[0].role == "system" else 0
        cut: list[Turn] = []
        while (len(self.history_ids()) + reserve > self.max_session_len
               and len(self.turns) - first > self.keep_last_turns):
            cut.append(self.turns.pop(first))
        if not cut:
            return
        num_cut = sum(len(t.token_ids) for t in cut)
        self._stats.cut_tokens += num_cut
        self._stats.kv_bytes_cut += num_cut * self.engine.runner.cache.bytes_per_token()
        if self.policy == "summarize":
            summary = self._summarize(cut)
            room = self.max_session_len - reserve - len(self.history_ids())
            if room > 0:  # a summary longer than the room left is truncated, never over the limit
                self.turns.insert(first, Turn(summary.role, summary.token_ids[:room]))

    def _summarize(self, cut: list[Turn]) -> Turn:
        """Ask the model for a summary of the cut turns; it becomes one turn in their place."""
        ask = self._user_turn(SUMMARY_REQUEST) if self.tok is not None else Turn("user", [])
        prompt = self.prefix + [t for turn in cut for t in turn.token_ids] + ask.token_ids
        out = self._generate(prompt, SamplingParams(temperature=0, max_tokens=self.summary_max_tokens))
        eos = set(self.engine.eos_token_ids)
        body = [t for t in out.outputs[0].token_ids if t not in eos]
        self._stats.summaries += 1
        if self.tok is None:
            return Turn("summary", body)
        text = "Summary of the earlier conversation: " + self.tok.decode(body, skip_special_tokens=True)
        return Turn("summary", self._render([{"role": "system", "content": text}]))

    def stats(self) -> dict:
        s = self._stats
        d = dict(s.__dict__)
        d["history_tokens"] = len(self.history_ids())
        d["cache_hit_rate"] = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
        return d
