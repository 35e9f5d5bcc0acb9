"""GLM output parsers: `<think>` reasoning separation and the GLM XML tool-call format.

Both are incremental state machines; the non-streaming result is defined as "feed the whole text, then
finish", so a stream cut into any chunks yields exactly the non-streaming result.
"""

from glm5.serve.parsers.reasoning_glm import GLMReasoningParser, parse_reasoning, prompt_opens_reasoning
from glm5.serve.parsers.tool_glm import GLMToolParser, ToolCall, ToolCallDelta, parse_tool_calls

__all__ = [
    "GLMReasoningParser", "parse_reasoning", "prompt_opens_reasoning",
    "GLMToolParser", "ToolCall", "ToolCallDelta", "parse_tool_calls",
]
