"""The FastAPI application: routes, auth, body bounds, OpenAI error objects, request ids, model versions.

`create_app(engine, tokenizer, config)` wraps a synchronous `LLMEngine` (driven by `AsyncEngine` in one
background thread) and serves `/v1/completions`, `/v1/chat/completions`, `/infill` (llama.cpp's code
completion), `/v1/models` (the base model and its loaded LoRA adapters: a request's `model` may name one),
`/v1/responses` (OpenAI's Responses API), `/v1/messages` and `/v1/messages/count_tokens` (Anthropic's
Messages API: its error shape, `x-api-key`),
`/health`, `/metrics`, `/tokenize`, `/detokenize`, the web playground at `/` (playground.py), the expert hot-swap admin routes and vLLM's
`/v1/load_lora_adapter` / `/v1/unload_lora_adapter` (admin key). Every client mistake maps to a 4xx with
`{"error": {"message", "type", "param", "code"}}` (Anthropic's `{"type": "error", "error": {"type",
"message"}}` under `/v1/messages`); a 500 means a server bug.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
from concurrent.futures import ThreadPoolExecutor
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from glm5.data.chat_template import default_chat_template
from glm5.data.tokenizer import GLMTokenizer, TooManyTokens
from glm5.infer.engine import LLMEngine
from glm5.infer.sampling import check_token_ids
from glm5.serve.sessions import ResponseStore, SessionStore
from glm5.serve import admin, playground
from glm5.serve.async_engine import AsyncEngine, EngineDead, Overloaded, RequestFailed
from glm5.serve.common import APIError, ServerState, as_api_error
from glm5.serve.config import ServerConfig
from glm5.serve.metrics import ServerMetrics
from glm5.serve.parsers import select_tool_parser
from glm5.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, InfillRequest,
                                 LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest,
                                 TokenizeRequest, now)
from glm5.serve.serving_chat import create_chat_completion, render_and_encode
from glm5.serve.protocol_anthropic import CountTokensRequest, MessagesRequest
from glm5.serve.serving_completion import create_completion
from glm5.serve.protocol_responses import ResponsesRequest
from glm5.serve.serving_messages import count_tokens, create_message
from glm5.serve.serving_responses import create_response
from glm5.serve.serving_infill import create_infill
from glm5.serve.tenants import TenantLimiter
from glm5.serve.validation import check_body_text


def _error(request: Request, status: int, message: str, type_: str = "invalid_request_error", param=None,
           code=None, headers=None) -> JSONResponse:
    return _error_response(request.url.path, APIError(status, message, type_, param, code, headers))


def _error_response(path: str, e: APIError) -> JSONResponse:
    """`e` as a JSON response in the error shape of the API `path` belongs to (OpenAI or Anthropic)."""
    return JSONResponse(e.body_for(path), status_code=e.status, headers=e.headers)


class IdleHook:
    """Calls `fn` once, in a worker thread, when no API request has been in flight for `after_s` seconds
    after some were (/health, /metrics and other GETs of monitors do not count as work, and do not
    postpone it). `glm5 serve` hands the heap's free pages back to the OS then (`trim_malloc`): the
    allocator keeps what a peak freed while requests keep coming, and returns it once the server is quiet."""

    def __init__(self, fn: Callable[[], object], after_s: float = 1.0):
        self.fn, self.after_s = fn, after_s
        self.inflight, self.generation, self.worked = 0, 0, False
        self.calls = 0
        self._task: asyncio.Future | None = None

    def enter(self) -> None:
        self.inflight += 1
        self.generation += 1
        self.worked = True

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            asyncio.get_running_loop().call_later(self.after_s, self._fire, self.generation)

    def _fire(self, generation: int) -> None:
        if generation != self.generation or self.inflight or not self.worked:
            return  # work came meanwhile (its own end schedules the next try), or nothing to give back
        self.worked, self.calls = False, self.calls + 1
        self._task = asyncio.ensure_future(asyncio.to_thread(self.fn))


class Gatekeeper:
    """Pure ASGI middleware (no BaseHTTPMiddleware, so client disconnects reach the handlers):
    request id, auth before the body is read, body bound (413), per-tenant limits (429), the id/version
    response headers, and the idle hook."""

    def __init__(self, app, state: ServerState, idle: IdleHook | None = None):
        self.app, self.state, self.idle = app, state, idle
        cfg = state.config
        self.limiter = None if cfg.max_running_per_key is None else \
            TenantLimiter(cfg.max_running_per_key, cfg.max_waiting_per_key, cfg.retry_after_s)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        rid = headers.get("x-request-id") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_headers(msg):
            if msg["type"] == "http.response.start":
                extra = [(b"x-request-id", rid.encode("latin-1", "replace"))]
                if not any(k.lower() == b"x-model-version" for k, _ in msg.get("headers", [])):
                    extra.append((b"x-model-version", str(self.state.async_engine.model_version).encode()))
                msg = {**msg, "headers": [*msg.get("headers", []), *extra]}
            await send(msg)

        if self.idle is None or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self._admit(scope, receive, send_with_headers, headers)
        self.idle.enter()
        try:
            return await self._admit(scope, receive, send_with_headers, headers)
        finally:
            self.idle.leave()

    async def _admit(self, scope, receive, send_with_headers, headers):
        """Authorise and apply the tenant's limit, then serve."""
        path = scope["path"]
        try:
            key = self._authorize(path, headers)
            limited = self.limiter is not None and scope["method"] == "POST" and path.startswith(API_ROUTES) \
                and path not in LORA_ADMIN_ROUTES
            client = scope.get("client") or ("unknown", 0)
            slot = self.limiter.slot(f"key {key}" if key is not None else f"client {client[0]}") if limited \
                else None  # a full queue is a 429 here, before the body is read
        except APIError as e:
            return await _error_response(path, e)(scope, receive, send_with_headers)
        if slot is None:
            return await self._serve(scope, receive, send_with_headers, headers)
        async with slot:
            return await self._serve(scope, receive, send_with_headers, headers)

    async def _serve(self, scope, receive, send_with_headers, headers):
        """Read and check the body, then run the app with it."""
        try:
            body = await self._read_body(scope, receive, headers)
            if body and not scope["path"].startswith("/admin/"):
                check_body_text(body)
        except APIError as e:
            return await _error_response(scope["path"], e)(scope, receive, send_with_headers)
        if body is None:
            return await self.app(scope, receive, send_with_headers)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls see the client's disconnect

        await self.app(scope, replay, send_with_headers)

    def _authorize(self, path: str, headers: dict[str, str]) -> int | None:
        """Check the key a route needs; for API routes, the index of the API key presented (its tenant)."""
        cfg, authorization = self.state.config, headers.get("authorization", "")
        if path.startswith("/admin/") or path in LORA_ADMIN_ROUTES:
            if cfg.admin_key is None:
                raise APIError(403, "admin routes are disabled (start the server with --admin-key)",
                               "permission_error", code="admin_disabled")
            _check_bearer(authorization, (cfg.admin_key,), "admin key")
        elif "x-api-key" in headers and path.startswith("/v1/"):  # Anthropic clients send the key this way
            return _check_bearer(f"Bearer {headers['x-api-key']}", cfg.api_keys, "API key")
        elif path.startswith(API_ROUTES):
            return _check_bearer(authorization, cfg.api_keys, "API key")
        return None

    async def _read_body(self, scope, receive, headers) -> bytes | None:
        """The whole body, bounded; None for bodiless methods."""
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return None
        cfg = self.state.config
        limit = cfg.max_admin_body_bytes if scope["path"].startswith("/admin/") else cfg.max_body_bytes
        declared = headers.get("content-length")
        too_big = APIError(413, f"request body larger than {limit} bytes", param="body")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise too_big
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise APIError(499, "client disconnected", code="client_closed_request")
            size += len(msg.get("body", b""))
            if size > limit:
                raise too_big
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                return b"".join(chunks)


LORA_ADMIN_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # vLLM's paths, behind the admin key
API_ROUTES = ("/v1/", "/tokenize", "/detokenize", "/infill")  # behind the API key; per-tenant limits apply


def _check_bearer(authorization: str, keys: tuple[str, ...], what: str) -> int | None:
    """The index of the key `Authorization: Bearer KEY` presents (None when no key is required); 401 when
    it presents none of `keys`. Every key is compared in constant time."""
    if not keys:
        return None
    scheme, _, token = authorization.partition(" ")
    token_bytes = token.strip().encode()
    hits = [hmac.compare_digest(token_bytes, key.encode()) for key in keys]
    if scheme.lower() != "bearer" or not any(hits):
        raise APIError(401, f"missing or invalid {what} (Authorization: Bearer ... or x-api-key)",
                       "authentication_error", code="invalid_api_key")
    return hits.index(True)


async def _until_disconnect(request: Request, coro):
    """Run a non-streaming handler; cancel it (aborting its engine request) if the client goes away."""
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise APIError(499, "client disconnected", code="client_closed_request")


def _json_response(body: dict) -> JSONResponse:
    version = body.pop("_model_version", None)
    headers = {"X-Model-Version": str(version)} if version is not None else None
    return JSONResponse(body, headers=headers)


def create_app(engine: LLMEngine, tokenizer: GLMTokenizer | None = None, config: ServerConfig | None = None,
               model_name: str | None = None, on_engine_failure=None,
               image_reader: Callable[[str], str] | None = None,
               on_idle: Callable[[], object] | None = None) -> FastAPI:
    """The app over `engine`; the context limit is the engine's `max_model_len`.
    `on_engine_failure(exc)` runs (on the engine thread) if the engine loop dies of a fault that no
    single request explains; `glm5 serve` uses it to exit non-zero. Without it the server stays up and
    answers 503 "engine failed" (and /health 503) until it is restarted. `image_reader(url) -> text`
    answers `image_url` chat parts (the OCR agent); without it they are a 400. `on_idle()` runs in a
    worker thread once the server has been quiet for a second after serving (`IdleHook`)."""
    config = config or ServerConfig()
    tokenizer = tokenizer or engine.tokenizer
    if tokenizer is None:  # text in and out needs one; say so at start, not as a 500 per request
        raise ValueError(f"glm5 serve needs a tokenizer: {engine.config.model} has no tokenizer.json")
    name = config.served_model_name or model_name or Path(engine.config.model).name
    shipped = tokenizer.chat_template if tokenizer.chat_template != default_chat_template() else None
    config = dataclasses.replace(config, tool_parser=select_tool_parser(config.tool_parser, shipped,
                                                                        engine.model_config.model_type))
    metrics = ServerMetrics(name)
    aengine = AsyncEngine(engine, metrics, max_waiting_requests=config.max_waiting_requests,
                          on_failure=on_engine_failure)
    state = ServerState(engine, aengine, tokenizer, config, name,
                        SessionStore(engine.config.max_session_len, engine.config.session_policy),
                        image_reader=image_reader,
                        responses=ResponseStore(config.max_stored_responses),
                        pool=ThreadPoolExecutor(config.tokenizer_workers, "glm5-tokenize"))

    @asynccontextmanager
    async def lifespan(app):
        aengine.start()
        yield
        await aengine.shutdown(config.shutdown_timeout_s)
        state.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="glm5", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    _install_handlers(app, state)
    _install_routes(app, state)
    app.add_middleware(Gatekeeper, state=state, idle=None if on_idle is None else IdleHook(on_idle))
    return app


def _install_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _error_response(request.url.path, e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        ctype = request.headers.get("content-type", "")
        if tuple(first.get("loc", ())) == ("body",) and "json" not in ctype.lower():  # curl -d sends a form
            return _error(request, 400, f"the request body must be JSON: send the header 'Content-Type: "
                          f"application/json' (got {ctype or 'no Content-Type'!r})", param="body")
        if first.get("type") == "json_invalid":
            return _error(request, 400, f"Malformed JSON body: {first.get('ctx', {}).get('error', '')}".strip(), param="body")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        msg = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ())[1:]) or 'body'}: {err.get('msg')}"
                        for err in errs[:5])
        return _error(request, 400, msg or "invalid request", param=param)

    @app.exception_handler(Overloaded)
    async def overloaded(request, e):
        return _error(request, 503, f"server overloaded: {e}; retry later", "server_overloaded",
                      headers={"Retry-After": str(state.config.retry_after_s)})

    @app.exception_handler(EngineDead)
    @app.exception_handler(RequestFailed)
    async def engine_error(request, e):
        return _error_response(request.url.path, as_api_error(e))

    @app.exception_handler(TooManyTokens)
    async def prompt_too_long(request, e: TooManyTokens):  # counted only up to the limit (tokenizer.py)
        return _error(request, 400, f"This model's maximum context length is {state.max_model_len} tokens. "
                      f"However, your prompt has at least {e.at_least} tokens.", param="prompt",
                      code="context_length_exceeded")

    @app.exception_handler(ValueError)
    async def engine_rejected(request, e):  # the engine's own parameter validation
        return _error(request, 400, str(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        return _error(request, e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else
                      "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal(request, e):
        return _error(request, 500, f"internal error: {type(e).__name__}", "internal_server_error", code="internal_error")


def _install_routes(app: FastAPI, state: ServerState) -> None:

    async def respond(request: Request, body, work):
        """Streams return their own response; a non-streaming request is aborted if the client leaves."""
        result = await (work if body.stream else _until_disconnect(request, work))
        return result if isinstance(result, Response) else _json_response(result)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(request, body, create_completion(state, body, f"cmpl-{uuid.uuid4().hex}"))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await respond(request, body, create_chat_completion(state, body, f"chatcmpl-{uuid.uuid4().hex}"))

    @app.post("/v1/responses")  # OpenAI's Responses API
    async def responses(body: ResponsesRequest, request: Request):
        return await respond(request, body, create_response(state, body))

    @app.post("/v1/messages")  # Anthropic's Messages API
    async def messages(body: MessagesRequest, request: Request):
        return await respond(request, body, create_message(state, body))

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest, request: Request):
        state.check_model(body.model)
        return await state.prepare(count_tokens, state, body)

    @app.post("/infill")
    async def infill(body: InfillRequest, request: Request):  # llama.cpp's code-completion route
        return await respond(request, body, create_infill(state, body, f"infill-{uuid.uuid4().hex}"))

    _install_info_routes(app, state)
    _install_admin_routes(app, state)
    playground.install(app)


def _install_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def models(request: Request):
        card = {"id": state.model_name, "object": "model", "created": now(), "owned_by": "glm5",
                "root": state.engine.config.model,
                "max_model_len": state.max_model_len, "model_version": state.async_engine.model_version}
        adapters = [{"id": name, "object": "model", "created": card["created"], "owned_by": "glm5", "root": path,
                     "parent": state.model_name, "max_model_len": state.max_model_len}
                    for name, path in state.async_engine.loras.items()]  # in load order, as vLLM lists them
        return {"object": "list", "data": [card, *adapters]}

    @app.get("/health")
    async def health():
        ae = state.async_engine
        reason = ae.unavailable_reason()
        if reason is not None:
            err = as_api_error(EngineDead(reason))
            return JSONResponse(err.body(), status_code=err.status)
        return {"status": "ok", "model_version": ae.model_version}

    @app.get("/metrics")
    async def prometheus():
        ae = state.async_engine
        text = ae.metrics.render(ae.stats(), extra_queued=ae.num_queued())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        state.check_model(body.model)
        if body.messages is not None:
            chat_req = ChatCompletionRequest(messages=body.messages,
                                             add_generation_prompt=body.add_generation_prompt)
            ids = (await state.prepare(render_and_encode, state, chat_req))[3]
        else:
            ids = await state.prepare(state.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens,
                                      limit=state.max_model_len)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        state.check_model(body.model)
        try:
            check_token_ids("tokens", body.tokens, state.tokenizer.vocab_size)
        except ValueError as e:
            raise APIError(400, str(e), param="tokens") from e
        return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}



def _install_admin_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/admin/experts")
    async def swap_experts(request: Request):
        body = await request.body()
        tensors, info = await asyncio.to_thread(admin.parse_expert_upload, body, state.engine)
        version = await state.async_engine.swap_experts(tensors, info)
        return JSONResponse({"model_version": version, **info}, headers={"X-Model-Version": str(version)})

    @app.post("/admin/experts/rollback")
    async def rollback_experts(request: Request):
        try:
            version = await state.async_engine.swap_experts(None, {"rollback": True, "experts": []})
        except ValueError as e:  # nothing to roll back
            raise APIError(409, str(e), "invalid_request_error") from e
        return JSONResponse({"model_version": version, "rollback": True}, headers={"X-Model-Version": str(version)})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        name = body.lora_name
        if name == state.model_name or name in state.async_engine.loras:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                           code="lora_name_in_use")
        try:
            await state.async_engine.lora_op("load", name, body.lora_path)
        except (ValueError, OSError) as e:  # AdapterError names the key; nothing changed
            raise APIError(400, f"lora_path: {e}", param="lora_path") from e
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        name = body.lora_name
        if name not in state.async_engine.loras:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "not_found_error", "lora_name")
        try:
            await state.async_engine.lora_op("unload", name)
        except ValueError as e:  # running requests use it
            raise APIError(409, str(e), param="lora_name", code="lora_in_use") from e
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.get("/admin/experts")
    async def expert_versions(request: Request):
        return {"model_version": state.async_engine.model_version, "versions": state.async_engine.versions}
