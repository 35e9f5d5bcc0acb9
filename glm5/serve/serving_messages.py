"""`/v1/messages` and `/v1/messages/count_tokens` (Anthropic's Messages API) over the chat pipeline.

A Messages request is converted into the internal `ChatCompletionRequest` (`to_chat_request`) and runs
through `serving_chat.start_chat`: the same chat template, validation, sampler, tool-call grammar and
GLM reasoning / tool parsers. `blocks.BlockStream` regroups the chat pipeline's per-token deltas into
blocks, rendered here as Anthropic content blocks and stream events; a non-streaming answer is the
same blocks, so streaming and non-streaming agree by construction. `stop_reason` is `tool_use` only when a tool_use
block was emitted. Errors keep Anthropic's shape (`{"type": "error", "error": {...}}`, built in app.py).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from glm5.serve.blocks import Block, BlockEvent, BlockStream
from glm5.serve.common import APIError, ServerState, as_api_error
from glm5.serve.protocol import ChatCompletionRequest
from glm5.serve.protocol_anthropic import (AnthropicMessage, CountTokensRequest, ImageBlock, MessagesRequest,
                                           RedactedThinkingBlock, TextBlock, ThinkingBlock, ToolResultBlock,
                                           ToolUseBlock)
from glm5.serve.serving_chat import ChatChoice, ChatJob, chat_request, render_and_encode, start_chat

TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}  # "tool" names one: a NamedToolChoice


def _text_of(blocks: str | list[TextBlock]) -> str:
    return blocks if isinstance(blocks, str) else "\n".join(b.text for b in blocks)


def _image_part(state: ServerState, block: ImageBlock, where: str) -> dict:
    """An image block as the chat route's `image_url` part (read by the OCR agent); 400 without one."""
    if state.image_reader is None:
        raise APIError(400, f"{where}: image blocks need the OCR agent (start the server with --ocr)",
                       param=where, code="images_not_supported")
    return {"type": "image_url", "image_url": {"url": block.source.data_url()}}


def _tool_message(state: ServerState, block: ToolResultBlock, where: str) -> dict:
    if isinstance(block.content, str):
        content: str | list[dict] = block.content
    else:
        parts = [_image_part(state, p, f"{where}.content[{k}]") if isinstance(p, ImageBlock) else
                 {"type": "text", "text": p.text} for k, p in enumerate(block.content)]
        content = parts if any(p["type"] == "image_url" for p in parts) else "\n".join(p["text"] for p in parts)
    if block.is_error:
        content = f"Error: {content}" if isinstance(content, str) else [{"type": "text", "text": "Error:"}, *content]
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _user_messages(state: ServerState, msg: AnthropicMessage, where: str, tool_use_ids: set[str]) -> list[dict]:
    """One Anthropic user turn -> chat messages: its tool results (as `tool` messages) first, then the rest."""
    if isinstance(msg.content, str):
        return [{"role": "user", "content": msg.content}]
    results, parts = [], []
    for k, block in enumerate(msg.content):
        at = f"{where}.content[{k}]"
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in tool_use_ids:
                raise APIError(400, f"{at}: tool_result for tool_use_id {block.tool_use_id!r}, which no earlier "
                                    "assistant tool_use block has", param=at)
            results.append(_tool_message(state, block, at))
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append(_image_part(state, block, at))
        else:
            raise APIError(400, f"{at}: {block.type} blocks belong to assistant messages", param=at)
    return results + ([{"role": "user", "content": parts}] if parts else [])


def _assistant_message(msg: AnthropicMessage, where: str, tool_use_ids: set[str]) -> dict:
    """One Anthropic assistant turn -> a chat message with content, reasoning_content and tool_calls."""
    if isinstance(msg.content, str):
        return {"role": "assistant", "content": msg.content}
    text, thinking, calls = [], [], []
    for k, block in enumerate(msg.content):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            tool_use_ids.add(block.id)
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif not isinstance(block, RedactedThinkingBlock):  # redacted thinking has nothing to replay
            at = f"{where}.content[{k}]"
            raise APIError(400, f"{at}: {block.type} blocks belong to user messages", param=at)
    out: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def _chat_messages(state: ServerState, req: CountTokensRequest) -> list[dict]:
    messages = [{"role": "system", "content": _text_of(req.system)}] if req.system else []
    tool_use_ids: set[str] = set()
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        if msg.role == "user":
            messages += _user_messages(state, msg, where, tool_use_ids)
        else:
            messages.append(_assistant_message(msg, where, tool_use_ids))
    return messages


def _prompt_fields(state: ServerState, req: CountTokensRequest) -> dict[str, Any]:
    """The chat-request fields that make the prompt: messages, tools, tool_choice, thinking."""
    body: dict[str, Any] = {"model": req.model, "messages": _chat_messages(state, req)}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise APIError(400, "tool_choice.name: required when tool_choice.type is 'tool'", param="tool_choice")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = TOOL_CHOICE[choice.type]
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    thinking = req.thinking is not None and req.thinking.type == "enabled"
    body["chat_template_kwargs"] = {"enable_thinking": thinking}  # Anthropic's default: no thinking
    return body


def to_chat_request(state: ServerState, req: MessagesRequest) -> ChatCompletionRequest:
    """The internal chat request for a Messages request; 400 for what Anthropic rejects."""
    budget = req.thinking.budget_tokens if req.thinking is not None and req.thinking.type == "enabled" else None
    if budget is not None and budget >= req.max_tokens:
        raise APIError(400, f"thinking.budget_tokens: must be less than max_tokens ({req.max_tokens}), "
                            f"got {budget}", param="thinking.budget_tokens")
    return chat_request({**_prompt_fields(state, req), "max_tokens": req.max_tokens,
                         "stop": req.stop_sequences or None, "temperature": req.temperature, "top_p": req.top_p,
                         "top_k": req.top_k, "thinking_budget": budget,
                         "user": (req.metadata or {}).get("user_id")})


def count_tokens(state: ServerState, req: CountTokensRequest) -> dict:
    """The prompt's length in tokens, exactly as `/v1/messages` would give it to the engine."""
    return {"input_tokens": len(render_and_encode(state, chat_request(_prompt_fields(state, req)))[3])}


def _block(b: Block, final: bool) -> dict:
    """A block as Anthropic's content block: empty when it starts streaming, whole when `final`."""
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": b.text if final else "", "signature": ""}
    if b.kind == "text":
        return {"type": "text", "text": b.text if final else ""}
    return {"type": "tool_use", "id": b.call_id, "name": b.name, "input": json.loads(b.text) if final else {}}


DELTA = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
         "tool_call": ("input_json_delta", "partial_json")}


def _render(e: BlockEvent) -> dict:
    """A block event as Anthropic's stream event."""
    if e.type == "start":
        return {"type": "content_block_start", "index": e.index, "content_block": _block(e.block, final=False)}
    if e.type == "stop":
        return {"type": "content_block_stop", "index": e.index}
    kind, field = DELTA[e.block.kind]
    return {"type": "content_block_delta", "index": e.index, "delta": {"type": kind, field: e.delta}}


def stop_reason(choice: ChatChoice, stops: list[str]) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished choice."""
    if choice.finish_reason == "tool_calls":  # set only when the parser produced a call
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if isinstance(choice.stop_reason, str) and choice.stop_reason in stops:
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def _message(job: ChatJob, msg_id: str, content: list[dict], reason: str | None, seq: str | None) -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": job.state.served_name(job.req.model),
            "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": {"input_tokens": job.num_prompt_tokens, "output_tokens": job.num_generated}}


def _event(obj: dict) -> str:
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(job: ChatJob, msg_id: str, stops: list[str]) -> AsyncIterator[str]:
    yield _event({"type": "message_start", "message": _message(job, msg_id, [], None, None)})
    yield _event({"type": "ping"})
    blocks = BlockStream()
    try:
        async for _, d in job.deltas():
            for e in blocks.feed(d["delta"]):
                yield _event(_render(e))
        for e in blocks.close():
            yield _event(_render(e))
        reason, seq = stop_reason(job.choices[0], stops)
        yield _event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                      "usage": {"output_tokens": job.num_generated}})
        yield _event({"type": "message_stop"})
    except Exception as e:  # noqa: BLE001 - the stream ends with Anthropic's error event
        yield _event(as_api_error(e).anthropic_body())


async def create_message(state: ServerState, req: MessagesRequest) -> dict | StreamingResponse:
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    chat_req = await state.prepare(to_chat_request, state, req)
    job = await start_chat(state, chat_req, msg_id)
    stops = req.stop_sequences or []
    if req.stream:
        return StreamingResponse(_stream(job, msg_id, stops), media_type="text/event-stream",
                                 headers={"X-Model-Version": str(job.version)})
    blocks = BlockStream()
    async for _, d in job.deltas():
        blocks.feed(d["delta"])
    choice = job.choices[0]
    content = [_block(b, final=True) for b in blocks.final(choice)]
    return {**_message(job, msg_id, content, *stop_reason(choice, stops)),
            "_model_version": job.version}
