"""OpenAI-compatible request/response schemas (pydantic v2) for completions, chat, tokenize and errors.

Requests validate every client-controllable number here, so a bad value becomes a 400 with the field
named, never a 500 deeper down. Unknown fields are ignored (as OpenAI and vLLM do); vLLM's extra
sampling fields (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, ...) are accepted so
`extra_body` works. Responses are plain models dumped with `exclude_none` where OpenAI omits fields.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaSpec(OpenAIModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI `response_format`: `text`, `json_object`, or `json_schema` (with `strict`; the output
    always matches the schema, strict or not)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format.json_schema.schema: required when type is json_schema")
        return self


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's `structured_outputs` (exactly one field)."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names + vLLM extras)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=64)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1 - 64)  # child i of n uses seed + i
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)  # None: the model's default, else 1
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's beam search (`n` best beams of `beam_width`, HF semantics) and glm5's temperature decay
    use_beam_search: bool = False
    beam_width: int | None = Field(default=None, ge=1, le=64)
    length_penalty: float = Field(default=1.0, ge=-10.0, le=10.0)
    early_stopping: bool | Literal["never"] = False
    temperature_schedule: list[float] | None = Field(default=None, min_length=2, max_length=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @model_validator(mode="after")
    def _check_stop(self):
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):  # vLLM: any number of stop strings, none empty
            raise ValueError("stop: stop strings must not be empty")
        for key, bias in (self.logit_bias or {}).items():
            digits = key.strip().lstrip("-")
            if not (digits.isascii() and digits.isdigit() and len(digits) <= 19):  # int() takes "²", "٣"
                raise ValueError(f"logit_bias: keys must be token ids (decimal integers), got {key[:30]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias: values must be in [-100, 100], got {bias} for token {key}")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(default=None, ge=1, le=64)  # sample best_of, return the n most likely
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_prompt(self):
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt: must not be empty")
        if self.suffix is not None and self.echo:
            raise ValueError("suffix: cannot be combined with echo")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be >= n ({self.n}), got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of: cannot stream when best_of > n (as OpenAI)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Normalise the four OpenAI prompt shapes into a list of strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class InfillExtra(OpenAIModel):
    filename: str = ""
    text: str


class InfillRequest(OpenAIModel):
    """llama.cpp server's `/infill` body (what llama.vim / llama.vscode send): the gap between
    `input_prefix` and `input_suffix`, other files in `input_extra`, and `/completion`'s options."""

    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillExtra] = Field(default_factory=list, max_length=1024)
    prompt: str = ""  # what the middle starts with (the current line typed so far)
    # glm5 extensions for GLM's code-completion prompt (`###PATH:`, `###LANGUAGE:`, `###MODE:` headers):
    path: str = Field(default="", max_length=4096)  # the file's relative path
    language: str | None = Field(default=None, max_length=64)  # None: from the path's extension
    mode: Literal["LINE", "BLOCK"] | None = None  # None: LINE when text follows the cursor on its line
    n_predict: int = Field(default=-1, ge=-1)
    temperature: float = Field(default=0.8, ge=0.0, le=100.0)
    top_k: int = Field(default=40, ge=-1)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int = Field(default=-1, ge=-1, le=2**63 - 1)
    stop: list[str] = Field(default_factory=list, max_length=16)
    ignore_eos: bool = False
    stream: bool = False
    n_indent: int = Field(default=0, ge=0)  # stop at a line indented less than this (once one is complete)
    t_max_predict_ms: int = Field(default=0, ge=0)  # stop after a newline once this much time has passed
    return_tokens: bool = False
    use_beam_search: bool = False
    beam_width: int = Field(default=1, ge=1, le=64)
    length_penalty: float = Field(default=1.0, ge=-10.0, le=10.0)
    temperature_schedule: list[float] | None = Field(default=None, min_length=2, max_length=2)


class FunctionDef(OpenAIModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: dict[str, str]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "observation"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str | None:
        """Content as a string: text parts of a multi-part content are concatenated."""
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    session_id: str | None = Field(default=None, min_length=1, max_length=256)  # server-side history (sessions.py)
    # glm5 extra (Anthropic's `thinking.budget_tokens`): at most this many reasoning tokens, then `</think>`
    thinking_budget: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _check_tools(self):
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if self.tool_choice.function.get("name") not in names:
                raise ValueError("tool_choice: names a function that is not in tools")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice: 'required' needs tools")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return self


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        return self


class LoadLoRAAdapterRequest(OpenAIModel):
    """vLLM's `POST /v1/load_lora_adapter` body."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(OpenAIModel):
    """vLLM's `POST /v1/unload_lora_adapter` body (`lora_int_id` accepted and ignored)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def now() -> int:
    return int(time.time())
