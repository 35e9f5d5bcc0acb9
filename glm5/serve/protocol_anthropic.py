"""Anthropic Messages API request schemas (pydantic v2): `/v1/messages` and `/v1/messages/count_tokens`.

Content blocks are a union discriminated by `type`, so an unknown block type is a 400 naming where it
is. Numbers are bounded here (Anthropic's ranges); cross-field rules (`budget_tokens < max_tokens`, a
`tool_result` answering an earlier `tool_use`) are checked by `serving_messages.to_chat_request`.
Unknown fields are ignored, as Anthropic does for forward compatibility.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from glm5.serve.protocol import OpenAIModel


class _Block(OpenAIModel):
    cache_control: dict[str, Any] | None = None  # prompt-caching hint: accepted, the prefix cache is automatic


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageSource(OpenAIModel):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    def data_url(self) -> str:
        """The image as a URL the OCR reader takes (a `data:` URL for base64 sources)."""
        if self.type == "base64":
            return f"data:{self.media_type or 'image/png'};base64,{self.data or ''}"
        return self.url or ""


class ImageBlock(_Block):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]


ResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[ResultPart] = ""
    is_error: bool = False


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # echoed back by clients; glm5 does not sign its thinking


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock |
                         RedactedThinkingBlock, Field(discriminator="type")]


class AnthropicMessage(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(OpenAIModel):
    """A client tool; server tools (`web_search_...`, `bash_...` types) are not offered by glm5."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(OpenAIModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)


class CountTokensRequest(OpenAIModel):
    """The prompt half of a Messages request (what `/v1/messages/count_tokens` takes)."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=64)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None  # `user_id`: accepted (Anthropic uses it for abuse detection)

