"""OpenAI Responses API request schemas (pydantic v2) for `POST /v1/responses`.

`input` is a string or a list of items, each told apart by `type` (a message may leave it out, as the
SDK's "easy" input message does); an unknown item or content type is a 400 naming where it is. Only
function tools exist here (the hosted tools, such as web search, are OpenAI's). Cross-item rules (a
`function_call_output` answers an earlier `function_call`) are checked in `serving_responses`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from glm5.serve.protocol import OpenAIModel


class InputText(OpenAIModel):
    type: Literal["input_text", "output_text"]
    text: str


class InputImage(OpenAIModel):
    type: Literal["input_image"]
    image_url: str | None = None
    detail: str | None = None


class Refusal(OpenAIModel):
    type: Literal["refusal"]
    refusal: str


InputContent = Annotated[InputText | InputImage | Refusal, Field(discriminator="type")]


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputContent]


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[InputContent]


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(OpenAIModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


def _item_type(v: Any) -> str:
    return (v.get("type") or "message") if isinstance(v, dict) else getattr(v, "type", "message")


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")] |
                      Annotated[FunctionCallOutputItem, Tag("function_call_output")] |
                      Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(OpenAIModel):
    type: Literal["function"]
    name: str


class ReasoningConfig(OpenAIModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class TextFormat(OpenAIModel):
    """`text.format`: plain text, any JSON object, or a JSON schema (flat, as the Responses API puts it)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, max_length=256)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM extra
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True  # keep the conversation for a later `previous_response_id`
    metadata: dict[str, str] | None = None
    user: str | None = None
