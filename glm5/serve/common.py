"""Shared serving pieces: server state, the OpenAI error type, sampling-param mapping, logprobs, SSE.

Used by the completion and chat handlers; knows nothing about routes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from glm5.data.tokenizer import GLMTokenizer
from glm5.infer.engine import LLMEngine
from glm5.infer.sampling import SamplingParams, check_token_ids
from glm5.serve.sessions import ResponseStore, SessionStore
from glm5.serve.async_engine import AsyncEngine, EngineDead, RequestFailed
from glm5.infer.structured import StructuredOutputs
from glm5.serve.config import ServerConfig
from glm5.serve.protocol import SamplingFields


class APIError(Exception):
    """A client-visible error: HTTP status + OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code or {400: "invalid_value", 401: "invalid_api_key", 404: "not_found",
                             413: "request_too_large", 503: "server_overloaded"}.get(status)
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """The same error in Anthropic's shape (the Messages API routes): its type follows the status."""
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body_for(self, path: str) -> dict:
        """The error object of the API that `path` belongs to."""
        return self.anthropic_body() if path.startswith(ANTHROPIC_PATHS) else self.body()


ANTHROPIC_PATHS = ("/v1/messages",)
ANTHROPIC_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                         529: "overloaded_error"}


def as_api_error(e: BaseException) -> APIError:
    """The client-visible form of an exception from a handler or the engine (also for SSE error chunks)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDead):
        code = "engine_failed" if str(e).startswith("engine failed") else "server_shutting_down"
        return APIError(503, str(e), "service_unavailable", code=code)
    if isinstance(e, RequestFailed):
        return APIError(500, f"the engine failed on this request and aborted it ({e}); other requests are "
                             "unaffected", "internal_server_error", code="request_failed")
    return APIError(500, f"internal error: {type(e).__name__}", "internal_server_error", code="internal_error")


@dataclass
class ServerState:
    engine: LLMEngine
    async_engine: AsyncEngine
    tokenizer: GLMTokenizer
    config: ServerConfig
    model_name: str
    sessions: SessionStore | None = None  # server-side chat sessions (`session_id`)
    # Turns an `image_url` part's URL into text for the prompt (the OCR agent under `glm5 serve --ocr`);
    # raises ValueError for an unreadable image. None: image parts are refused with a 400.
    image_reader: Callable[[str], str] | None = None
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2, "glm5-tokenize"))
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(256))  # `previous_response_id`

    async def prepare(self, fn, *args, **kwargs):
        """Run `fn(*args, **kwargs)` in the tokenizer pool: work that grows with the prompt (chat template,
        tokenising; the tokenizer releases the GIL on long texts) then delays only its own request, never
        the event loop that serves /health and every other stream."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    @property
    def max_model_len(self) -> int:
        """The engine's (the model's max_position_embeddings unless configured lower)."""
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        """The model's (rows of its logits): every token id a request carries must be below it."""
        return int(self.engine.model_config.vocab_size)

    def served_name(self, model: str | None) -> str:
        """The `model` a response names: the one the request asked for (an adapter's name answers as that
        name, as vLLM does), the base model's name when it asked for none."""
        return model if model is not None and (model == self.model_name or model in self.async_engine.loras) \
            else self.model_name

    def check_model(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (None = the base model); 404 for anything else."""
        if model is None or model == self.model_name:
            return None
        if model in self.async_engine.loras:
            return model
        raise APIError(404, f"The model `{model}` does not exist.", "not_found_error", "model", "model_not_found")


def max_tokens_for(state: ServerState, req: SamplingFields, prompt_len: int, requested: int | None) -> int:
    """vLLM's context check: the prompt must leave room; default max_tokens fills what is left."""
    room = state.max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} tokens. "
                            f"However, your prompt has {prompt_len} tokens.", param="prompt",
                       code="context_length_exceeded")
    if requested is None:
        return max(1, min(state.config.default_max_tokens, room))
    if requested > room:
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} tokens. "
                            f"However, you requested {prompt_len + requested} tokens ({prompt_len} in the "
                            f"prompt, {requested} in the completion).", param="max_tokens",
                       code="context_length_exceeded")
    return requested


def sampling_params(req: SamplingFields, max_tokens: int, state: ServerState, **extra) -> SamplingParams:
    """OpenAI/vLLM request fields -> `SamplingParams`; fields the request leaves unset take the model's
    generation_config.json defaults (as vLLM does), then the OpenAI ones. A value the engine rejects
    (including a token id outside the vocabulary) is a 400 naming the field."""
    model = state.engine.generation_config.sampling_defaults()

    def pick(name: str, value, default):
        return value if value is not None else model.get(name, default)

    beam = req.use_beam_search
    temperature = 0.0 if beam and req.temperature is None else pick("temperature", req.temperature, 1.0)
    kwargs = dict(
        n=1 if beam else req.n, temperature=temperature, use_beam_search=beam,
        beam_width=(req.beam_width or req.n) if beam else 1, length_penalty=req.length_penalty,
        early_stopping=req.early_stopping,
        temperature_schedule=tuple(req.temperature_schedule) if req.temperature_schedule else None,
        top_p=pick("top_p", req.top_p, 1.0), top_k=pick("top_k", req.top_k, 0), min_p=pick("min_p", req.min_p, 0.0),
        seed=req.seed, stop=req.stop_list(), stop_token_ids=list(req.stop_token_ids or []),
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        repetition_penalty=pick("repetition_penalty", req.repetition_penalty, 1.0), min_tokens=min(req.min_tokens, max_tokens),
        ignore_eos=req.ignore_eos, max_tokens=max_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        logit_bias={int(k): float(v) for k, v in req.logit_bias.items()} if req.logit_bias else None)
    kwargs.update(extra)
    if beam and req.n > kwargs["beam_width"]:
        raise APIError(400, f"n: {req.n} best beams need beam_width >= n, got {kwargs['beam_width']}", param="n")
    try:
        params = SamplingParams(**kwargs)
        params.check_vocab(state.vocab_size)
        return params
    except (ValueError, TypeError) as e:
        param = str(e).split(" ")[0] if str(e) else None
        raise APIError(400, str(e), param=param if param in kwargs else None) from e


def prompt_token_ids(state: ServerState, ids: list[int], param: str = "prompt") -> list[int]:
    """A token-id prompt, checked against the vocabulary (400 naming `param`)."""
    if not ids:
        raise APIError(400, f"{param}: must not be empty", param=param)
    try:
        check_token_ids(param, ids, state.vocab_size)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from e
    return list(ids)


def structured_spec(req: SamplingFields) -> StructuredOutputs | None:
    """`structured_outputs` (vLLM) or `response_format` (OpenAI) -> the engine's spec; 400 on misuse."""
    so, rf = req.structured_outputs, req.response_format
    constrained_rf = rf is not None and rf.type != "text"
    if so is not None and constrained_rf:
        raise APIError(400, "structured_outputs: give either structured_outputs or response_format, not both",
                       param="structured_outputs")
    try:
        if so is not None:
            schema = so.json_
            return StructuredOutputs(
                json=(schema if isinstance(schema, str) else json.dumps(schema)) if schema is not None else None,
                json_object=bool(so.json_object), regex=so.regex,
                choice=tuple(so.choice) if so.choice is not None else None, grammar=so.grammar)
        if constrained_rf and rf.type == "json_object":
            return StructuredOutputs(json_object=True)
        if constrained_rf:
            return StructuredOutputs(json=json.dumps(rf.json_schema.schema_))
    except ValueError as e:
        raise APIError(400, str(e), param="structured_outputs" if so is not None else "response_format") from e
    return None


async def check_grammar(state: ServerState, spec: StructuredOutputs | None, param: str) -> None:
    """Compile the spec off the event loop (cached for the engine): 400 naming what does not compile."""
    if spec is None:
        return
    try:
        await asyncio.to_thread(state.engine.grammars.compile, spec)
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param) from e


def finite(x: float | None) -> float | None:
    """JSON has no -inf: clamp like vLLM does (-9999.0)."""
    if x is None:
        return None
    return x if math.isfinite(x) else -9999.0


def logprob_of(entry, token_id: int) -> float | None:
    if not entry or token_id not in entry:
        return None
    lp = entry[token_id]
    return finite(getattr(lp, "logprob", lp))


def top_entries(entry, k: int) -> list[tuple[int, float]]:
    """The top-k (token id, logprob) of one position, most likely first."""
    if not entry:
        return []
    items = [(tid, finite(getattr(lp, "logprob", lp))) for tid, lp in entry.items()]
    ranked = sorted(items, key=lambda x: -x[1])
    return ranked[:k]


def token_str(tokenizer, token_id: int) -> str:
    """Text of one token, decoded on its own (what OpenAI's `tokens` / `token` fields show)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_bytes(tokenizer, token_id: int) -> list[int]:
    try:
        return list(tokenizer.token_bytes(token_id))
    except (AttributeError, ValueError, KeyError):
        return list(token_str(tokenizer, token_id).encode("utf-8"))


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators: yields (stream index, item) as items arrive."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, it):
        try:
            async for item in it:
                await q.put((i, item))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def chain(first, rest: AsyncIterator):
    """Yield `first`, then everything from `rest` (re-attach a peeked first item to a stream)."""
    yield first
    async for item in rest:
        yield item
