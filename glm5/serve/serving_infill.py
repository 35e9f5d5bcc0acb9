"""Code completion routes: llama.cpp's `/infill` (what llama.vim / llama.vscode call), the infill prompt
for `/v1/completions` with `suffix` (OpenAI's insert mode), and beam search driven from the server.

`/infill` answers in llama.cpp's `/completion` shape: `content`, `tokens`, `stop`, `stop_type`
(`eos` | `limit` | `word`), `stopping_word`, `tokens_predicted`, `tokens_evaluated`, `tokens_cached`,
`truncated`, `timings`, `generation_settings`; streamed as SSE chunks `{"content", "tokens", "stop":
false}` and a final `stop: true` object, with no `[DONE]` (llama.cpp's native endpoints send none).
`n_indent` and `t_max_predict_ms` end a completion as llama.cpp does: at a line indented less than
`n_indent`, or at a newline once the time budget has passed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from glm5.infer.beam_search import BeamSearch
from glm5.infer.infill import InfillError, InfillPrompt, build_infill, choose_format
from glm5.infer.outputs import RequestOutput
from glm5.infer.sampling import SamplingParams
from glm5.serve.common import APIError, ServerState, as_api_error, sse


def infill_prompt_for(state: ServerState, prefix: str, suffix: str, max_tokens: int,
                      extra: list[tuple[str, str]] = (), middle_start: str = "", **code) -> InfillPrompt:
    """The model's infill prompt within max_model_len - max_tokens tokens; 400 when the model cannot
    infill or (with truncation off) the input does not fit. `code`: `path`, `language`, `mode` of GLM's
    code-completion prompt (`build_infill`)."""
    if state.tokenizer is None:
        raise APIError(400, "this model has no tokenizer: infilling needs one", param="model")
    try:
        fmt = choose_format(state.tokenizer, state.engine.model_config.block_position_embedding,
                            state.config.infill_format)
        return build_infill(state.tokenizer, fmt, prefix, suffix, room=state.max_model_len - max_tokens,
                            extra=extra, middle_start=middle_start, truncate=state.config.infill_truncate,
                            **code)
    except InfillError as e:
        raise APIError(400, str(e), param=e.param or "suffix") from e


def truncation_header(ip: InfillPrompt) -> dict[str, str]:
    """`X-Infill-Truncated: prefix=N, suffix=M, extra=K` (tokens dropped) when anything was cut."""
    if not ip.is_truncated:
        return {}
    return {"X-Infill-Truncated": ", ".join(f"{k}={v}" for k, v in ip.truncated.items())}


async def beam_generate(state: ServerState, request_id: str, ids: list[int], params: SamplingParams,
                        infill=None, num: int = 1) -> RequestOutput:
    """HF-semantics beam search on the async engine: one single-token request per live beam and step
    (the prefix cache shares the beams' common blocks); returns the best `num` beams."""
    eos = () if params.ignore_eos else state.engine.eos_token_ids
    if infill is not None:
        eos = (*eos, infill.end_token_id)
    search = BeamSearch(params.beam_width, params.max_tokens or 16, eos, params.length_penalty,
                        params.early_stopping)
    step, n_steps = search.step_params(), 0

    async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        return out

    while not search.done:  # the live beams' requests run in one batch
        outs = await asyncio.gather(*[
            last(state.async_engine.generate(f"{request_id}-b{n_steps}-{b}", ids + beam.token_ids, step,
                                             infill=infill)) for b, beam in enumerate(search.beams)])
        search.step_outputs(list(outs), state.vocab_size)
        n_steps += 1
    decode = (lambda t: state.tokenizer.decode(t, skip_special_tokens=params.skip_special_tokens)) \
        if state.tokenizer is not None else None
    return RequestOutput(request_id, None, ids, outputs=search.completions(num, decode), finished=True,
                         model_version=state.async_engine.model_version)


@dataclasses.dataclass
class _CodeStop:
    """llama.cpp's code-completion stops: a line indented less than `n_indent`; a newline after
    `t_max_predict_ms` from the first token."""

    n_indent: int
    t_max_ms: int
    t_first: float | None = None

    def cut(self, text: str) -> int | None:
        """Where to cut `text` (None: keep going)."""
        now = time.monotonic()
        if text and self.t_first is None:
            self.t_first = now
        if self.n_indent > 0:
            start = 0
            for line in text.split("\n")[1:]:  # lines after the first newline (the cursor's line is free)
                start = text.index("\n", start) + 1
                body = line.lstrip(" \t")
                if body and len(line) - len(body) < self.n_indent:
                    return start
        if self.t_max_ms > 0 and self.t_first is not None and (now - self.t_first) * 1000 > self.t_max_ms:
            nl = text.rfind("\n")
            if nl >= 0:
                return nl + 1
        return None


class _InfillJob:
    def __init__(self, state: ServerState, req, ip: InfillPrompt, params: SamplingParams, request_id: str):
        self.state, self.req, self.ip, self.params, self.id = state, req, ip, params, request_id
        self.stopper = _CodeStop(req.n_indent, req.t_max_predict_ms)
        self.t0 = time.monotonic()
        self.t_first: float | None = None
        self.text, self.token_ids = "", []
        self.stop_type, self.stopping_word, self.cached = "limit", "", 0

    def update(self, out: RequestOutput) -> bool:
        """Take the latest output; True when the completion is over (finished or cut)."""
        c = out.outputs[0]
        if self.t_first is None and c.token_ids:
            self.t_first = time.monotonic()
        self.cached = max(out.metrics.num_cached_tokens, 0) if out.metrics is not None else 0
        text, self.token_ids = c.text, list(c.token_ids)
        cut = self.stopper.cut(text)
        if cut is not None:
            self.text, self.stop_type = text[:cut], "limit"
            return True
        self.text = text
        if c.finish_reason is not None:
            word = c.stop_reason if isinstance(c.stop_reason, str) else ""
            self.stop_type = "word" if word else ("eos" if c.finish_reason == "stop" else "limit")
            self.stopping_word = word
            return True
        return False

    def final(self) -> dict:
        now = time.monotonic()
        first = self.t_first or now
        n_gen = len(self.token_ids)
        predicted_ms = (now - first) * 1000
        tok = self.state.tokenizer
        return {
            "index": 0, "id_slot": 0, "content": self.text, "tokens": self.token_ids if self.req.return_tokens
            else [], "stop": True, "model": self.state.served_name(self.req.model), "tokens_predicted": n_gen,
            "tokens_evaluated": len(self.ip.token_ids), "tokens_cached": self.cached,
            "prompt": tok.decode(self.ip.token_ids, skip_special_tokens=False),
            "has_new_line": "\n" in self.text, "truncated": self.ip.is_truncated,
            "truncated_tokens": self.ip.truncated, "stop_type": self.stop_type,
            "stopping_word": self.stopping_word, "infill_format": self.ip.format,
            "generation_settings": {"n_predict": self.params.max_tokens, "temperature": self.req.temperature,
                                    "top_k": self.req.top_k, "top_p": self.req.top_p, "min_p": self.req.min_p,
                                    "seed": self.req.seed, "n_ctx": self.state.max_model_len,
                                    "model": self.state.served_name(self.req.model)},
            "timings": {"prompt_n": len(self.ip.token_ids) - self.cached, "prompt_ms": (first - self.t0) * 1000,
                        "predicted_n": n_gen, "predicted_ms": predicted_ms,
                        "predicted_per_second": n_gen / (predicted_ms / 1000) if predicted_ms > 0 else 0.0},
        }


def infill_params(state: ServerState, req, max_tokens: int) -> SamplingParams:
    """llama.cpp `/completion` options -> SamplingParams (400 naming the field on a bad value)."""
    beam = req.use_beam_search
    kwargs: dict[str, Any] = dict(
        temperature=0.0 if beam else req.temperature, top_k=0 if beam else max(req.top_k, 0),
        top_p=1.0 if beam else req.top_p, min_p=0.0 if beam else req.min_p,
        repetition_penalty=req.repeat_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, seed=None if req.seed < 0 else req.seed, stop=list(req.stop),
        ignore_eos=req.ignore_eos, max_tokens=max_tokens, use_beam_search=beam, beam_width=req.beam_width,
        length_penalty=req.length_penalty, skip_special_tokens=True,
        temperature_schedule=tuple(req.temperature_schedule) if req.temperature_schedule else None)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        param = str(e).split(" ")[0]
        raise APIError(400, str(e), param=param if param in kwargs else None) from e


async def create_infill(state: ServerState, req, request_id: str):
    state.check_model(req.model)
    if req.n_predict == 0:
        raise APIError(400, "n_predict: must be -1 (up to the default) or >= 1", param="n_predict")
    max_tokens = state.config.default_max_tokens if req.n_predict < 0 else req.n_predict
    max_tokens = max(1, min(max_tokens, state.max_model_len - 4))
    extra = [(c.filename, c.text) for c in req.input_extra]
    ip = infill_prompt_for(state, req.input_prefix, req.input_suffix, max_tokens, extra, req.prompt,
                           path=req.path, language=req.language, mode=req.mode)
    params = infill_params(state, req, max_tokens)
    job = _InfillJob(state, req, ip, params, request_id)
    headers = truncation_header(ip)
    if params.use_beam_search:
        out = await beam_generate(state, request_id, ip.token_ids, params, ip.layout)
        job.update(out)
        job.stop_type = "eos" if out.outputs[0].finish_reason == "stop" else "limit"
        return JSONResponse(job.final(), headers=headers)
    stream = state.async_engine.generate(request_id, ip.token_ids, params, infill=ip.layout)
    if req.stream:
        first = await stream.__anext__()  # admission errors become a 4xx before any byte is sent
        return StreamingResponse(_sse(job, first, stream), media_type="text/event-stream", headers=headers)
    try:
        async for out in stream:
            if job.update(out):
                break
    finally:
        await stream.aclose()  # a cut completion aborts its engine request
    return JSONResponse(job.final(), headers=headers)


async def _sse(job: _InfillJob, first: RequestOutput, stream: AsyncIterator) -> AsyncIterator[str]:
    sent_text, sent_tokens = 0, 0

    async def outputs():
        yield first
        async for out in stream:
            yield out

    try:
        async for out in outputs():
            done = job.update(out)
            delta, new_ids = job.text[sent_text:], job.token_ids[sent_tokens:]
            if delta or (new_ids and not done):
                yield sse({"index": 0, "id_slot": 0, "content": delta, "tokens": new_ids, "stop": False})
                sent_text, sent_tokens = len(job.text), len(job.token_ids)
            if done:
                break
        yield sse({**job.final(), "content": ""})
    except Exception as e:  # noqa: BLE001 - the engine failed mid-stream: tell the client
        yield sse(as_api_error(e).body())
    finally:
        await stream.aclose()
