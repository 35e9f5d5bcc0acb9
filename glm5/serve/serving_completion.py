"""`/v1/completions`: text or token-id prompts, `n`, `echo` with prompt logprobs (lm-eval's loglikelihood
path), `logprobs` (top-N per token), SSE streaming with an optional final usage chunk, `suffix` (OpenAI's
insert mode: the model fills the gap, see serving_infill.py) and vLLM's `use_beam_search`.

Choice `i` of prompt `p` has index `p * n + i`, as in OpenAI. `max_tokens=0` with `echo` scores the prompt
only (one token is generated and dropped, since the engine always generates at least one).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from glm5.infer.infill import InfillPrompt
from glm5.serve.common import (APIError, ServerState, as_api_error, chain, check_grammar, logprob_of, max_tokens_for,
                               merge_streams, prompt_token_ids, sampling_params, sse, structured_spec, token_str,
                               top_entries)
from glm5.serve.protocol import CompletionRequest, Usage, now
from glm5.serve.serving_infill import beam_generate, infill_prompt_for, truncation_header


def _prompt_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return state.tokenizer.encode(prompt, add_special_tokens=True, limit=state.max_model_len)
    return prompt_token_ids(state, prompt)


class _LogprobBuilder:
    """OpenAI completions `logprobs` object, built incrementally (tokens, token_logprobs, top, offsets)."""

    def __init__(self, tokenizer, k: int):
        self.tokenizer, self.k, self.offset = tokenizer, k, 0

    def build(self, token_ids: list[int], entries: list | None) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for pos, tid in enumerate(token_ids):
            entry = entries[pos] if entries and pos < len(entries) else None
            text = token_str(self.tokenizer, tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob_of(entry, tid))
            out["top_logprobs"].append(
                None if entry is None else {token_str(self.tokenizer, t): lp
                                            for t, lp in top_entries(entry, self.k)})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def _merge_logprobs(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


async def create_completion(state: ServerState, req: CompletionRequest, request_id: str):
    lora = state.check_model(req.model)
    echo_only = req.max_tokens == 0
    if echo_only and not req.echo:
        raise APIError(400, "max_tokens: must be >= 1 unless echo=true", param="max_tokens")
    infills = await state.prepare(_infill_prompts, state, req) if req.suffix is not None else None
    prompts = [ip.token_ids for ip in infills] if infills else await state.prepare(  # tokenised off the loop
        lambda: [_prompt_ids(state, p) for p in req.prompts()])
    max_tokens = [max_tokens_for(state, req, len(ids), 1 if echo_only else req.max_tokens) for ids in prompts]
    spec = structured_spec(req)
    await check_grammar(state, spec, "structured_outputs" if req.structured_outputs is not None else "response_format")
    extra: dict[str, Any] = {"structured_outputs": spec}
    if req.logprobs is not None:
        extra["logprobs"] = req.logprobs
        if req.echo:
            extra["prompt_logprobs"] = req.logprobs
    best_of = req.best_of or req.n
    if best_of > req.n:  # rank by cumulative logprob, which the engine tracks only with logprobs on
        extra.update(n=best_of, logprobs=extra.get("logprobs", 0))
    params = [sampling_params(req, mt, state, **extra) for mt in max_tokens]
    layouts = [ip.layout for ip in infills] if infills else [None] * len(prompts)
    streams = [_generate(state, f"{request_id}-{i}", ids, p, layout, req.n, lora)
               for i, (ids, p, layout) in enumerate(zip(prompts, params, layouts))]
    merged = merge_streams(streams)
    job = _Job(state, req, request_id, prompts, echo_only)
    first = await _first(merged)  # admission errors surface here, before any byte is sent
    headers = truncation_header(infills[0]) if infills and len(infills) == 1 else {}
    if req.stream:
        return StreamingResponse(job.stream(first, merged), media_type="text/event-stream",
                                 headers={"X-Model-Version": str(job.version(first)), **headers})
    body = await job.collect(first, merged)
    return JSONResponse(body, headers={"X-Model-Version": str(body.pop("_model_version")), **headers}) \
        if headers else body


def _infill_prompts(state: ServerState, req: CompletionRequest) -> list[InfillPrompt]:
    """OpenAI insert mode: each (text) prompt is the prefix, `suffix` what follows the gap."""
    texts = req.prompts()
    if not all(isinstance(t, str) for t in texts):
        raise APIError(400, "suffix: needs text prompts (not token ids)", param="suffix")
    mt = req.max_tokens or min(state.config.default_max_tokens, state.max_model_len // 2)
    return [infill_prompt_for(state, t, req.suffix, mt) for t in texts]


async def _generate(state: ServerState, request_id: str, ids: list[int], params, infill, n: int,
                    lora: str | None = None):
    """The engine's outputs for one prompt: streamed, or (beam search) one final output with the n best."""
    if params.use_beam_search:
        if lora is not None:
            raise APIError(400, "use_beam_search: not available with a LoRA adapter model", param="use_beam_search")
        yield await beam_generate(state, request_id, ids, params, infill, num=n)
        return
    async for out in state.async_engine.generate(request_id, ids, params, infill=infill, lora=lora):
        yield out


async def _first(merged: AsyncIterator):
    try:
        return await merged.__anext__()
    except StopAsyncIteration:  # pragma: no cover - the engine always sends a finished output
        raise APIError(500, "engine returned no output", "internal_server_error")


class _Job:
    """One completion request: turns engine outputs into OpenAI choices (whole or as SSE chunks)."""

    def __init__(self, state, req, request_id, prompts, echo_only):
        self.state, self.req, self.id, self.prompts, self.echo_only = state, req, request_id, prompts, echo_only
        self.created = now()
        self.sent_text: dict[int, str] = {}
        self.sent_tokens: dict[int, int] = {}
        self.builders: dict[int, _LogprobBuilder] = {}
        self.final: dict[int, Any] = {}  # prompt index -> last RequestOutput
        self.finished: set[int] = set()
        self.num_samples = req.best_of or req.n  # generated per prompt; the n best are returned

    def version(self, first) -> Any:
        return first[1].model_version if first[1].model_version is not None else self.state.async_engine.model_version

    def _echo_prefix(self, p: int, out, choice: int) -> tuple[str, dict | None]:
        """Prompt text (+ its logprobs) that `echo` puts before the first delta of a choice."""
        if not self.req.echo:
            return "", None
        p = self.req.prompts()[p]
        text = p if isinstance(p, str) else self.state.tokenizer.decode(p, skip_special_tokens=False)
        lp = None
        if self.req.logprobs is not None:
            lp = self.builders[choice].build(out.prompt_token_ids, out.prompt_logprobs)
        return text, lp

    def _delta(self, p: int, out, c) -> tuple[int, str, dict | None]:
        """New text/logprobs of CompletionOutput `c` of prompt `p` since the last call."""
        choice = p * self.num_samples + c.index
        first = choice not in self.sent_text
        if first:
            self.sent_text[choice], self.sent_tokens[choice] = "", 0
            self.builders[choice] = _LogprobBuilder(self.state.tokenizer, self.req.logprobs or 0)
        text, lp = self._echo_prefix(p, out, choice) if first else ("", None)
        if not self.echo_only:
            text += c.text[len(self.sent_text[choice]):]
            new_ids = c.token_ids[self.sent_tokens[choice]:]
            if self.req.logprobs is not None:
                entries = (c.logprobs or [])[self.sent_tokens[choice]:]
                lp = _merge_logprobs(lp, self.builders[choice].build(new_ids, entries))
            self.sent_text[choice], self.sent_tokens[choice] = c.text, len(c.token_ids)
        return choice, text, lp

    def _chunk(self, choices: list[dict], version) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model":
                self.state.served_name(self.req.model), "choices": choices, "model_version": version}

    def _usage(self) -> dict:
        prompt = sum(len(ids) for ids in self.prompts)
        gen = 0 if self.echo_only else sum(len(c.token_ids) for o in self.final.values() for c in o.outputs)
        return Usage(prompt_tokens=prompt, completion_tokens=gen, total_tokens=prompt + gen).model_dump()

    def _finish(self, choice: int, c) -> tuple[str | None, Any]:
        """(finish_reason, stop_reason) the first time choice `choice` is seen finished, else Nones."""
        if c.finish_reason is None or choice in self.finished:
            return None, None
        self.finished.add(choice)
        return ("length" if self.echo_only else c.finish_reason), c.stop_reason

    async def collect(self, first, merged) -> dict:
        texts: dict[int, list] = {}
        version = self.version(first)
        async for p, out in chain(first, merged):
            self.final[p] = out
            for c in out.outputs:
                choice, text, lp = self._delta(p, out, c)
                acc = texts.setdefault(choice, ["", None, None, None])
                acc[0] += text
                if lp:
                    acc[1] = _merge_logprobs(acc[1], lp)
                if c.finish_reason is not None and choice not in self.finished:
                    acc[2], acc[3] = self._finish(choice, c)
        choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": fr, "stop_reason": sr}
                   for i, (t, lp, fr, sr) in sorted(texts.items())]
        if self.num_samples > self.req.n:
            choices = self._best(choices)
        return {**self._chunk(choices, version), "usage": self._usage(), "_model_version": version}

    def _best(self, choices: list[dict]) -> list[dict]:
        """best_of: per prompt, the n samples with the highest cumulative logprob (ties: lower index),
        renumbered 0..n-1 per prompt as OpenAI does; usage still counts every sample."""
        by_choice = {c["index"]: c for c in choices}  # a sample the engine never reported is simply absent
        out = []
        for p, o in sorted(self.final.items()):
            seen = [c for c in o.outputs if p * self.num_samples + c.index in by_choice]
            rank = sorted(seen, key=lambda c: (-(c.cumulative_logprob or 0.0), c.index))[: self.req.n]
            for j, c in enumerate(rank):
                out.append({**by_choice[p * self.num_samples + c.index], "index": p * self.req.n + j})
        return out

    async def stream(self, first, merged) -> AsyncIterator[str]:
        version = self.version(first)
        try:
            async for p, out in chain(first, merged):
                self.final[p] = out
                choices = []
                for c in out.outputs:
                    choice, text, lp = self._delta(p, out, c)
                    fr, sr = self._finish(choice, c)
                    if text or fr or lp:
                        choices.append({"index": choice, "text": text, "logprobs": lp, "finish_reason": fr,
                                        "stop_reason": sr})
                if choices:
                    yield sse(self._chunk(choices, version))
            if self.req.stream_options and self.req.stream_options.include_usage:
                yield sse({**self._chunk([], version), "usage": self._usage()})
        except Exception as e:  # noqa: BLE001 - the stream ends with an error object, then [DONE]
            yield sse(as_api_error(e).body())
        yield sse("[DONE]")
