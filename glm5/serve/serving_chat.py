"""`/v1/chat/completions`: chat template, `chat_template_kwargs` (`enable_thinking`, `clear_thinking`),
`reasoning_content` from the GLM reasoning parser, tools + `tool_choice` with the GLM XML tool parser,
logprobs/top_logprobs, `n`, SSE streaming with a final usage chunk.

Streaming and non-streaming share one per-choice pipeline (engine text delta -> reasoning parser ->
tool parser), so a streamed response adds up to exactly the non-streamed one. `tool_choice` "required"
or a named function is enforced by a grammar (xgrammar's GLM-4.7/5 structural tag: GLM's XML call
format with each tool's JSON schema for its arguments, after the reasoning block when thinking is on);
`response_format` / `structured_outputs` constrain the content the same way.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import jinja2
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from glm5.data.tokenizer import MissingSpecialTokens
from glm5.infer.outputs import RequestOutput
from glm5.infer.sampling import SamplingParams
from glm5.infer.structured import StructuredOutputs, glm_tool_call_tag
from glm5.serve.common import (APIError, ServerState, as_api_error, chain, check_grammar, logprob_of, max_tokens_for,
                               sampling_params, sse, structured_spec, token_bytes, token_str, top_entries)
from glm5.serve.parsers import GLMReasoningParser, make_tool_parser, prompt_opens_reasoning
from glm5.serve.parsers.reasoning_glm import THINK_CLOSE
from glm5.serve.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Usage, now
from glm5.serve.sessions import SUMMARY_REQUEST
from glm5.serve.validation import check_tools

EOS_TEXTS = ("<|endoftext|>", "<|user|>", "<|observation|>")


def _thinking(kwargs: dict) -> bool:
    """`enable_thinking` (vLLM/GLM name); the Z.ai-style `thinking` ({"type": "disabled"} or a bool) too."""
    flag = kwargs.pop("enable_thinking", None)
    alias = kwargs.pop("thinking", None)
    if flag is None and alias is not None:
        flag = alias.get("type") != "disabled" if isinstance(alias, dict) else bool(alias)
    return True if flag is None else bool(flag)


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request built by another API's route (Messages, Responses) from its own request; a field
    the chat schema rejects is a 400 naming it."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"{where or 'body'}: {err.get('msg')}", param=where or None) from e


def render_prompt(state: ServerState, req: ChatCompletionRequest) -> tuple[str, list | None]:
    """-> (prompt text, tools to parse against or None)."""
    check_tools(req.tools)
    kwargs = dict(req.chat_template_kwargs or {})
    enable_thinking = _thinking(kwargs)
    for reserved in ("messages", "tools", "add_generation_prompt", "tokenize"):
        kwargs.pop(reserved, None)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    parse_tools = tools if tools and req.tool_choice != "none" and state.config.tool_parser else None
    try:
        if parse_tools:
            state.tokenizer.require("tool calls")
        text = state.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=req.add_generation_prompt,
            enable_thinking=enable_thinking, tokenize=False, **kwargs)
    except MissingSpecialTokens as e:  # a non-GLM tokenizer: say which feature and which tokens
        raise APIError(400, str(e), param="tools" if e.feature == "tool calls" else "messages",
                       code="unsupported_by_tokenizer") from e
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as e:
        raise APIError(400, f"messages: cannot apply the chat template: {e}", param="messages") from e
    return text, parse_tools


def output_constraint(req: ChatCompletionRequest, prompt: str, tools: list | None) -> StructuredOutputs | None:
    """The grammar the output must follow: a forced tool call (`tool_choice` "required" / named), else
    `response_format` / `structured_outputs` (both at once: 400)."""
    spec = structured_spec(req)
    forced = tools is not None and (req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice))
    if not forced:
        return spec
    if spec is not None:
        raise APIError(400, "tool_choice: a forced tool call cannot be combined with response_format or "
                            "structured_outputs", param="tool_choice")
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function["name"]
        chosen, choice = [t for t in tools if t["function"]["name"] == name], req.tool_choice.model_dump()
    else:
        chosen, choice = tools, "required"
    try:
        tag = glm_tool_call_tag(chosen, choice, prompt_opens_reasoning(prompt), req.parallel_tool_calls)
    except (ValueError, TypeError) as e:  # a schema xgrammar's tag builder rejects
        raise APIError(400, f"tools: cannot build the tool-call grammar: {e}", param="tools") from e
    return StructuredOutputs(structural_tag=tag)


def render_and_encode(state: ServerState, req: ChatCompletionRequest):
    """`render_prompt`, the output constraint, and the prompt's token ids -> (text, spec or None, tools,
    ids); runs in the tokenizer pool (all of it grows with the prompt and the tool schemas)."""
    text, tools = render_prompt(state, req)
    spec = output_constraint(req, text, tools)
    if spec is not None and spec.structural_tag is None and prompt_opens_reasoning(text):
        text += "</think>"  # a constrained answer is the content: close the thinking block first
    return text, spec, tools, state.tokenizer.encode(text, limit=state.max_model_len)


class ChatChoice:
    """Per-choice parser pipeline and accumulated message."""

    def __init__(self, state: ServerState, index: int, reasoning_open: bool, tools):
        self.index, self.state = index, state
        use_reasoning = bool(state.config.reasoning_parser)
        self.reasoning = GLMReasoningParser(reasoning_open) if use_reasoning else None
        self.tools = make_tool_parser(state.config.tool_parser, tools) if tools is not None else None
        self.sent_text, self.sent_tokens = "", 0
        self.reasoning_text, self.content_text = "", ""
        self.logprobs: list[dict] = []
        self.finish_reason, self.stop_reason = None, None

    def feed(self, c, top_k: int | None) -> dict:
        """Process CompletionOutput `c`; return the OpenAI delta dict of what is new."""
        if self.finish_reason is not None:  # outputs of finished siblings are repeated: nothing new
            return {"delta": {}, "logprobs": [], "finished": False}
        new = c.text[len(self.sent_text):]
        self.sent_text = c.text
        finished = c.finish_reason is not None
        if finished:
            for eos in EOS_TEXTS:
                new = new.removesuffix(eos)
        delta: dict[str, Any] = {}
        r, content = self._split(new, finished)
        tool_deltas = []
        if self.tools is not None:
            outs = [self.tools.feed(content)] + ([self.tools.finish()] if finished else [])
            content = "".join(o.content for o in outs)
            tool_deltas = [d for o in outs for d in o.tool_calls]
        if r:
            delta["reasoning_content"] = r
            self.reasoning_text += r
        if content:
            delta["content"] = content
            self.content_text += content
        if tool_deltas:
            delta["tool_calls"] = [_tool_delta(d) for d in tool_deltas]
        lps = self._logprobs(c, top_k) if top_k is not None else []
        self.logprobs += lps
        if finished:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
            if self.tools is not None and self.tools.tool_calls and c.finish_reason == "stop":
                self.finish_reason = "tool_calls"
        return {"delta": delta, "logprobs": lps, "finished": finished}

    def _split(self, new: str, finished: bool) -> tuple[str, str]:
        if self.reasoning is None:
            return "", new
        r, c = self.reasoning.feed(new)
        if finished:
            r2, c2 = self.reasoning.finish()
            r, c = r + r2, c + c2
        return r, c

    def _logprobs(self, c, top_k: int) -> list[dict]:
        tok = self.state.tokenizer
        ids, entries = c.token_ids[self.sent_tokens:], (c.logprobs or [])[self.sent_tokens:]
        self.sent_tokens = len(c.token_ids)
        out = []
        for tid, entry in zip(ids, entries):
            out.append({"token": token_str(tok, tid), "logprob": logprob_of(entry, tid),
                        "bytes": token_bytes(tok, tid),
                        "top_logprobs": [{"token": token_str(tok, t), "logprob": lp, "bytes": token_bytes(tok, t)}
                                         for t, lp in top_entries(entry, top_k)]})
        return out

    def message(self) -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content_text or None}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning_text or None
        calls = self.tools.tool_calls if self.tools is not None else []
        msg["tool_calls"] = [{"id": t.id, "type": "function",
                              "function": {"name": t.name, "arguments": t.arguments}} for t in calls]
        return msg


def _tool_delta(d) -> dict:
    out: dict[str, Any] = {"index": d.index, "function": {"arguments": d.arguments}}
    if d.name is not None:
        out.update(id=d.id, type="function")
        out["function"]["name"] = d.name
    return out


async def read_images(state: ServerState, req: ChatCompletionRequest) -> ChatCompletionRequest:
    """Replace every `image_url` content part by the text `state.image_reader` makes of it (in a worker
    thread: OCR is slow); without a reader, image parts are a 400."""
    parts = [(m, k) for m in req.messages if isinstance(m.content, list)
             for k, p in enumerate(m.content) if p.get("type") == "image_url"]
    if not parts:
        return req
    if state.image_reader is None:
        raise APIError(400, "messages: image_url parts need the OCR agent (start the server with --ocr)",
                       param="messages", code="images_not_supported")
    req = req.model_copy(deep=True)
    for n, m in enumerate(req.messages):
        if not isinstance(m.content, list):
            continue
        for k, part in enumerate(m.content):
            if part.get("type") != "image_url":
                continue
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            if not isinstance(url, str) or not url:
                raise APIError(400, f"messages[{n}].content[{k}].image_url.url: a data: URL is required",
                               param="messages")
            try:
                text = await asyncio.to_thread(state.image_reader, url)
            except ValueError as e:
                raise APIError(400, f"messages[{n}].content[{k}]: {e}", param="messages",
                               code="invalid_image") from e
            m.content[k] = {"type": "text", "text": text}
    return req


async def start_chat(state: ServerState, req: ChatCompletionRequest, request_id: str) -> ChatJob:
    """Validate, render, encode and admit `req`; -> the running job (its first engine output already in,
    so admission errors surface before any byte is sent). The Messages and Responses routes convert
    their requests into a `ChatCompletionRequest` and run through here too."""
    lora = state.check_model(req.model)
    req = await read_images(state, req)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    new_messages = await _with_session(state, req, requested, request_id) if req.session_id is not None else None
    text, spec, tools, prompt_ids = await state.prepare(render_and_encode, state, req)
    await check_grammar(state, spec, "tool_choice" if spec is not None and spec.structural_tag else
                        "structured_outputs" if req.structured_outputs is not None else "response_format")
    if requested == 0:
        raise APIError(400, "max_tokens: must be >= 1", param="max_tokens")
    max_tokens = max_tokens_for(state, req, len(prompt_ids), requested)
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    extra = {"skip_special_tokens": False, "structured_outputs": spec}  # <think>/<tool_call> reach the parsers
    if top_k is not None:
        extra["logprobs"] = top_k
    if req.thinking_budget is not None and prompt_opens_reasoning(text):
        extra.update(thinking_budget=req.thinking_budget, thinking_end_token_id=_think_end_id(state))
    params = sampling_params(req, max_tokens, state, **extra)
    stream = state.async_engine.generate(request_id, prompt_ids, params, lora=lora)
    choices = [ChatChoice(state, i, prompt_opens_reasoning(text), tools) for i in range(req.n)]
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:  # pragma: no cover
        raise APIError(500, "engine returned no output", "internal_server_error")
    version = first.model_version if first.model_version is not None else state.async_engine.model_version
    job = ChatJob(state, req, request_id, choices, len(prompt_ids), top_k, version, first, stream)
    if new_messages is not None:
        job.on_done = lambda reply: state.sessions.record(req.session_id, new_messages, reply)
    return job


def _think_end_id(state: ServerState) -> int:
    """The `</think>` token a thinking budget forces; 400 if the tokenizer has no single token for it."""
    ids = state.tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
    if len(ids) != 1:
        raise APIError(400, f"thinking_budget: the tokenizer has no single {THINK_CLOSE} token",
                       param="thinking_budget", code="unsupported_by_tokenizer")
    return ids[0]


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request_id: str):
    job = await start_chat(state, req, request_id)
    if req.stream:
        return StreamingResponse(job.stream(), media_type="text/event-stream",
                                 headers={"X-Model-Version": str(job.version)})
    return await job.collect()


async def _with_session(state: ServerState, req: ChatCompletionRequest, requested: int | None,
                        request_id: str) -> list[dict]:
    """Prepend the session's history to the request's messages, cutting (or summarising) the oldest turns
    past max_session_len; -> the request's own new messages (recorded with the reply when it is done)."""
    store, sid = state.sessions, req.session_id
    new = [m.model_dump(exclude_none=True) for m in req.messages]
    reserve = requested if requested is not None else state.config.default_max_tokens

    def count(messages: list[dict]) -> int:
        return len(state.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    summarize = store.policy == "summarize"
    headroom = min(96, (store.max_session_len or 0) // 4) if summarize else 0  # tokens kept free for a summary
    history, cut = store.cut(sid, new, count, reserve + headroom)
    if cut and summarize and headroom > 8:  # 8: the summary message's framing
        summary = store.add_summary(sid, await _summary(state, cut, f"{request_id}-summary", headroom - 8))
        store.cut(sid, new, count, reserve, keep=summary)  # never over the limit: more old turns go if needed
    req.messages = [ChatMessage.model_validate(m) for m in store.messages_for(sid, new)]
    return new


async def _summary(state: ServerState, cut: list[dict], request_id: str, max_tokens: int) -> str:
    """The model's own summary of the cut turns (greedy, no thinking)."""
    ask = cut + [{"role": "user", "content": SUMMARY_REQUEST}]
    ids = state.tokenizer.apply_chat_template(ask, add_generation_prompt=True, enable_thinking=False, tokenize=True)
    final = None
    async for out in state.async_engine.generate(request_id, list(ids), SamplingParams(temperature=0, max_tokens=max_tokens)):
        final = out
    return final.outputs[0].text if final is not None else ""


class ChatJob:
    """One admitted chat request: its choices' parser pipelines over the engine's output stream.
    `collect()` / `stream()` answer in the chat-completions shape; `deltas()` gives other API shapes
    the same per-choice OpenAI deltas to convert."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest, request_id: str, choices: list[ChatChoice],
                 num_prompt_tokens: int, top_k: int | None, version: int, first: RequestOutput,
                 rest: AsyncIterator[RequestOutput]):
        self.state, self.req, self.id, self.choices = state, req, request_id, choices
        self.num_prompt_tokens, self.top_k, self.version = num_prompt_tokens, top_k, version
        self.first, self.rest = first, rest
        self.created = now()
        self.num_generated = 0
        self.on_done = None  # called with the first choice's reply message once the response is complete

    def _done(self) -> None:
        if self.on_done is not None:
            msg = self.choices[0].message()
            self.on_done({k: v for k, v in msg.items() if k != "reasoning_content" and v not in (None, [])})

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.state.served_name(self.req.model), "choices": choices, "model_version": self.version}

    def _usage(self) -> dict:
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_generated,
                     total_tokens=self.num_prompt_tokens + self.num_generated).model_dump()

    def _feed(self, out) -> list[tuple[ChatChoice, dict]]:
        self.num_generated = sum(len(c.token_ids) for c in out.outputs)
        return [(self.choices[c.index], self.choices[c.index].feed(c, self.top_k)) for c in out.outputs]

    async def deltas(self) -> AsyncIterator[tuple[ChatChoice, dict]]:
        """(choice, its `ChatChoice.feed` result) for every engine output, in order; the reply is recorded
        (sessions) once the stream is through."""
        async for out in chain(self.first, self.rest):
            for item in self._feed(out):
                yield item
        self._done()

    async def collect(self) -> dict:
        async for out in chain(self.first, self.rest):
            self._feed(out)
        choices = [{"index": ch.index, "message": ch.message(),
                    "logprobs": {"content": ch.logprobs} if self.top_k is not None else None,
                    "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason} for ch in self.choices]
        body = {**self._chunk(choices), "object": "chat.completion", "usage": self._usage()}
        self._done()
        if self.req.session_id is not None:
            body["session"] = self.state.sessions.info(self.req.session_id)
        return {**body, "_model_version": self.version}

    async def stream(self) -> AsyncIterator[str]:
        yield sse(self._chunk([{"index": ch.index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None} for ch in self.choices]))
        try:
            async for out in chain(self.first, self.rest):
                chunk = []
                for ch, d in self._feed(out):
                    if d["delta"] or d["finished"] or d["logprobs"]:
                        chunk.append({"index": ch.index, "delta": d["delta"],
                                      "logprobs": {"content": d["logprobs"]} if self.top_k is not None else None,
                                      "finish_reason": ch.finish_reason if d["finished"] else None,
                                      "stop_reason": ch.stop_reason if d["finished"] else None})
                if chunk:
                    yield sse(self._chunk(chunk))
            self._done()
            if self.req.stream_options and self.req.stream_options.include_usage:
                yield sse({**self._chunk([]), "usage": self._usage()})
        except Exception as e:  # noqa: BLE001 - the stream ends with an error object, then [DONE]
            yield sse(as_api_error(e).body())
        yield sse("[DONE]")
