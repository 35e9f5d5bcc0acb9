"""`OpenAIModel`: any OpenAI-compatible server (glm5 serve, vLLM, SGLang) evaluated over HTTP.

Scoring uses `/v1/completions` as lm-eval's `local-completions` does: the prompt is the token ids of
context + continuation, `echo=true, max_tokens=1, logprobs=1, temperature=0`; the continuation's
`token_logprobs` are summed and it is greedy when each equals the best of its `top_logprobs`. So the
harness tokenizes (`tokenizer=` a tokenizer directory, by default the server's own checkpoint when
`model` names one). Generation sends text prompts. Requests go in batches, several at a time; a
refused connection, a timeout, a 429 or a 5xx is retried with backoff, then reported naming the URL.
stdlib HTTP only.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from .lm import EvalModel, GenerationParams, Score, Tokenizer, TokenPair


class ModelUnavailable(RuntimeError):
    """The server kept refusing, timing out or failing after every retry."""


class OpenAIClient:
    """POST/GET JSON with retries. `base_url` ends before `/v1` or at it (both accepted)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 120.0, retries: int = 3,
                 backoff: float = 1.0):
        base = base_url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.api_key, self.timeout, self.retries, self.backoff = api_key, timeout, retries, backoff

    def request(self, path: str, payload: dict | None = None) -> dict:
        url = self.base + path
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                req = urllib.request.Request(url, data=data, headers=headers)
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                body = e.read().decode("utf-8", "replace")[:500]
                if e.code != 429 and e.code < 500:  # the request is wrong: retrying will not help
                    raise ValueError(f"{url}: HTTP {e.code}: {body}") from None
                last = f"HTTP {e.code}: {body}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        raise ModelUnavailable(f"{url}: no answer after {self.retries + 1} tries ({last})")

    def first_model(self) -> str:
        models = self.request("/models").get("data") or []
        if not models:
            raise ValueError(f"{self.base}/models lists no model; pass the model name")
        return models[0]["id"]


class OpenAIModel(EvalModel):
    def __init__(self, base_url: str, *, tokenizer: Tokenizer | None = None, model: str | None = None,
                 prefix_token_id: int | None = None, max_length: int = 2048, batch_size: int = 16,
                 concurrency: int = 4, api_key: str | None = None, timeout: float = 120.0, retries: int = 3,
                 name: str | None = None, add_special_tokens: bool = True, client: OpenAIClient | None = None):
        self.client = client or OpenAIClient(base_url, api_key, timeout, retries)
        self.model = model or self.client.first_model()
        self.tokenizer = tokenizer  # type: ignore[assignment]
        eos = getattr(tokenizer, "eos_token_ids", None) or [0]
        self.prefix_token_id = prefix_token_id if prefix_token_id is not None else eos[0]
        self.max_length, self.batch_size, self.concurrency = max_length, batch_size, concurrency
        self.add_special_tokens = add_special_tokens
        self.name = name or f"{base_url}#{self.model}"

    def _map(self, fn, batches: list) -> list:
        with ThreadPoolExecutor(max(1, self.concurrency)) as pool:
            return [r for rs in pool.map(fn, batches) for r in rs]

    def _batches(self, items: list) -> list[list]:
        return [items[i:i + self.batch_size] for i in range(0, len(items), self.batch_size)]

    def score(self, pairs: list[TokenPair]) -> list[Score]:
        if self.tokenizer is None:
            raise ValueError("scoring over the API needs the model's tokenizer: pass --tokenizer DIR")
        return self._map(self._score_batch, self._batches(pairs))

    def _score_batch(self, pairs: list[TokenPair]) -> list[Score]:
        payload = {"model": self.model, "prompt": [c + x for c, x in pairs], "max_tokens": 1, "temperature": 0,
                   "logprobs": 1, "echo": True}
        choices = sorted(self.client.request("/completions", payload)["choices"], key=lambda c: c["index"])
        out = []
        for (ctx, cont), choice in zip(pairs, choices):
            lp = choice["logprobs"]
            n = len(ctx) + len(cont)  # the echoed prompt; the generated token after it is ignored
            token_lps, tops = lp["token_logprobs"][len(ctx):n], lp["top_logprobs"][len(ctx):n]
            greedy = all(t >= max(top.values()) for t, top in zip(token_lps, tops))
            out.append((float(sum(token_lps)), greedy))
        return out

    def generate(self, prompts: list[str], params: GenerationParams) -> list[list[str]]:
        if params.chat:
            return self._map(lambda batch: [self._chat(p, params) for p in batch], self._batches(prompts))

        def run(batch: list[str]) -> list[list[str]]:
            payload = {"model": self.model, "prompt": batch, "max_tokens": params.max_tokens,
                       "temperature": params.temperature, "top_p": params.top_p, "n": params.n}
            if params.stop:
                payload["stop"] = list(params.stop)
            if params.seed is not None:
                payload["seed"] = params.seed
            payload.update(_decoding(params))
            choices = self.client.request("/completions", payload)["choices"]
            texts = [[""] * params.n for _ in batch]
            for c in choices:  # OpenAI: choice index = prompt index * n + sample index
                texts[c["index"] // params.n][c["index"] % params.n] = c["text"]
            return texts
        return self._map(run, self._batches(prompts))

    def _chat(self, prompt: str, params: GenerationParams) -> list[str]:
        """One user turn through `/v1/chat/completions` (the server applies its chat template)."""
        payload = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                   "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
                   "n": params.n}
        if params.stop:
            payload["stop"] = list(params.stop)
        if params.seed is not None:
            payload["seed"] = params.seed
        payload.update(_decoding(params))
        choices = sorted(self.client.request("/chat/completions", payload)["choices"], key=lambda c: c["index"])
        return [c["message"]["content"] or "" for c in choices]


def _decoding(params: GenerationParams) -> dict:
    """Beam search and the temperature schedule as the request fields glm5's server (and, for beam search,
    vLLM's) reads; nothing for plain sampling, so other OpenAI-compatible servers see a standard request."""
    out: dict = {}
    if params.beam_width > 1:
        out.update(use_beam_search=True, beam_width=params.beam_width)
    if params.temperature_schedule is not None:
        out["temperature_schedule"] = list(params.temperature_schedule)
    return out
