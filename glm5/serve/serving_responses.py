"""`POST /v1/responses` (OpenAI's Responses API, stateless) over the chat pipeline.

A Responses request becomes the internal `ChatCompletionRequest` (`to_chat_request`): `instructions`
-> a system message, input items -> chat messages (`function_call` -> an assistant tool call,
`function_call_output` -> a tool message, a `reasoning` item -> the next assistant turn's reasoning),
`reasoning.effort` "none"/"minimal" -> thinking off, `text.format` -> `response_format`. It runs through
`serving_chat.start_chat`; `blocks.BlockStream` regroups the output into items (reasoning, message,
function_call), streamed as the Responses events or returned whole. `previous_response_id` prepends the
conversation the server kept for that response (a bounded store, `ResponseStore`: an unknown or evicted
id is a 400). Errors keep OpenAI's shape.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from glm5.serve.blocks import Block, BlockEvent, BlockStream
from glm5.serve.common import APIError, ServerState, as_api_error
from glm5.serve.protocol import ChatCompletionRequest, now
from glm5.serve.protocol_responses import (FunctionCallItem, FunctionCallOutputItem, InputContent, InputImage,
                                           MessageItem, NamedFunction, ReasoningItem, Refusal, ResponsesRequest)
from glm5.serve.serving_chat import ChatJob, chat_request, start_chat

THINKING_OFF = ("none", "minimal")  # reasoning efforts that turn GLM's thinking off
ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}  # output item ids, as OpenAI's look


def _content(state: ServerState, parts: str | list[InputContent], where: str) -> str | list[dict]:
    """Item content -> chat content: a string, or parts when an image (read by the OCR agent) is in it."""
    if isinstance(parts, str):
        return parts
    out = []
    for k, p in enumerate(parts):
        if isinstance(p, InputImage):
            if state.image_reader is None or not p.image_url:
                raise APIError(400, f"{where}[{k}]: input_image needs an image_url and the OCR agent (start the "
                                    "server with --ocr)", param=f"{where}[{k}]", code="images_not_supported")
            out.append({"type": "image_url", "image_url": {"url": p.image_url}})
        else:
            out.append({"type": "text", "text": p.refusal if isinstance(p, Refusal) else p.text})
    if any(p["type"] == "image_url" for p in out):
        return out
    return "".join(p["text"] for p in out)


def _known_calls(messages: list[dict]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls") or []}


def _input_messages(state: ServerState, req: ResponsesRequest, history: list[dict]) -> list[dict]:
    """The request's input items as chat messages (what this turn adds to `history`)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict] = []
    calls, reasoning = _known_calls(history), None
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if isinstance(item, ReasoningItem):
            reasoning = item.text() or None
            continue
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _content(state, item.content, f"{where}.content")})
        elif isinstance(item, FunctionCallItem):
            try:
                json.loads(item.arguments)
            except ValueError as e:
                raise APIError(400, f"{where}.arguments: not JSON ({e})", param=f"{where}.arguments") from e
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            calls.add(item.call_id)
            if out and out[-1]["role"] == "assistant" and reasoning is None:  # parallel calls: one turn
                out[-1].setdefault("tool_calls", []).append(call)
                continue
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise APIError(400, f"{where}: no function_call with call_id {item.call_id!r} before this output",
                               param=f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _content(state, item.output, f"{where}.output")})
            continue
        if reasoning is not None and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], reasoning = reasoning, None
    return out


def _format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}


def to_chat_request(state: ServerState, req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest,
                                                                                          list[dict]]:
    """-> (the internal chat request, the conversation to store once answered, without the reply)."""
    conversation = history + _input_messages(state, req, history)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"model": req.model, "messages": system + conversation,
                            "max_tokens": req.max_output_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "top_k": req.top_k, "user": req.user,
                            "parallel_tool_calls": req.parallel_tool_calls, "response_format": _format(req)}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"},
                                                                       exclude_none=True)} for t in req.tools]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.reasoning.effort not in THINKING_OFF}
    return chat_request(body), conversation


def _item(b: Block, item_id: str, done: bool) -> dict:
    """A block as a Responses output item: empty while it streams (`done=False`), whole when done."""
    status, text = ("completed", b.text) if done else ("in_progress", "")
    if b.kind == "reasoning":
        return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}] if done else []}
    if b.kind == "text":
        return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                "content": [_part(b, text)] if done else []}
    return {"type": "function_call", "id": item_id, "call_id": b.call_id, "name": b.name, "arguments": text,
            "status": status}


def _part(b: Block, text: str) -> dict:
    if b.kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseRun:
    """One answered request: builds the response object and its stream events."""

    def __init__(self, state: ServerState, req: ResponsesRequest, job: ChatJob, response_id: str,
                 conversation: list[dict]):
        self.state, self.req, self.job, self.id = state, req, job, response_id
        self.conversation, self.created, self.seq = conversation, now(), 0
        self.blocks = BlockStream()

    def item_id(self, index: int, b: Block) -> str:
        return f"{ITEM_PREFIX[b.kind]}_{self.id.removeprefix('resp_')}_{index}"

    def response(self, done: bool) -> dict:
        choice = self.job.choices[0]
        cut = done and choice.finish_reason == "length"
        output = [_item(b, self.item_id(i, b), True) for i, b in enumerate(self.blocks.final(choice))] if done else []
        req, reasoning = self.req, "".join(b.text for b in self.blocks.blocks if b.kind == "reasoning")
        usage = {"input_tokens": self.job.num_prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": self.job.num_generated, "total_tokens": self.job.num_prompt_tokens + self.job.num_generated,
                 "output_tokens_details": {"reasoning_tokens": len(self.state.tokenizer.encode(reasoning))}}
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.state.served_name(self.req.model),
                "status": ("incomplete" if cut else "completed") if done else "in_progress",
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
                "instructions": req.instructions, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
                "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else
                req.tool_choice or "auto", "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
                "previous_response_id": req.previous_response_id, "metadata": req.metadata or {},
                "store": req.store, "text": {"format": {"type": "text"}}, "user": req.user,
                "usage": usage if done else None}

    def finish(self) -> dict:
        """Keep the conversation (when `store`) and return the final response object."""
        if self.req.store:
            reply = {k: v for k, v in self.job.choices[0].message().items() if v not in (None, [])}
            self.state.responses.put(self.id, self.conversation + [reply])
        return self.response(done=True)

    def event(self, type_: str, **fields) -> str:
        obj = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def render(self, e: BlockEvent) -> list[str]:
        """One block event as the Responses stream events."""
        at = {"output_index": e.index}
        item_id, b = self.item_id(e.index, e.block), e.block
        if e.type == "start":
            out = [self.event("response.output_item.added", **at, item=_item(b, item_id, False))]
            if b.kind != "tool_call":
                out.append(self.event("response.content_part.added", **at, item_id=item_id, content_index=0,
                                      part=_part(b, "")))
            return out
        if e.type == "delta":
            if b.kind == "tool_call":
                return [self.event("response.function_call_arguments.delta", **at, item_id=item_id, delta=e.delta)]
            kind = "response.reasoning_text.delta" if b.kind == "reasoning" else "response.output_text.delta"
            extra = {} if b.kind == "reasoning" else {"logprobs": []}
            return [self.event(kind, **at, item_id=item_id, content_index=0, delta=e.delta, **extra)]
        if b.kind == "tool_call":
            out = [self.event("response.function_call_arguments.done", **at, item_id=item_id, name=b.name,
                              arguments=b.text)]
        else:
            kind = "response.reasoning_text.done" if b.kind == "reasoning" else "response.output_text.done"
            extra = {} if b.kind == "reasoning" else {"logprobs": []}
            out = [self.event(kind, **at, item_id=item_id, content_index=0, text=b.text, **extra),
                   self.event("response.content_part.done", **at, item_id=item_id, content_index=0,
                              part=_part(b, b.text))]
        return out + [self.event("response.output_item.done", **at, item=_item(b, item_id, True))]

    async def stream(self) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.response(done=False))
        yield self.event("response.in_progress", response=self.response(done=False))
        try:
            async for _, d in self.job.deltas():
                for e in self.blocks.feed(d["delta"]):
                    for frame in self.render(e):
                        yield frame
            for e in self.blocks.close():
                for frame in self.render(e):
                    yield frame
            final = self.finish()
            kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            yield self.event(kind, response=final)
        except Exception as e:  # noqa: BLE001 - the stream ends with an error event
            err = as_api_error(e)
            yield self.event("error", code=err.code, message=err.message, param=err.param)

    async def collect(self) -> dict:
        async for _, d in self.job.deltas():
            self.blocks.feed(d["delta"])
        self.blocks.close()
        return {**self.finish(), "_model_version": self.job.version}


async def create_response(state: ServerState, req: ResponsesRequest) -> dict | StreamingResponse:
    response_id = f"resp_{uuid.uuid4().hex}"
    history: list[dict] = []
    if req.previous_response_id is not None:
        found = state.responses.get(req.previous_response_id)
        if found is None:
            raise APIError(400, f"Previous response with id '{req.previous_response_id}' not found (unknown, not "
                                f"stored, or evicted: the server keeps the last {state.responses.max_responses})",
                           param="previous_response_id", code="previous_response_not_found")
        history = list(found)
    chat_req, conversation = await state.prepare(to_chat_request, state, req, history)
    job = await start_chat(state, chat_req, response_id)
    run = ResponseRun(state, req, job, response_id, conversation)
    if req.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream",
                                 headers={"X-Model-Version": str(job.version)})
    return await run.collect()
