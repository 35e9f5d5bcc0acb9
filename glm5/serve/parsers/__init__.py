"""GLM output parsers: `<think>` reasoning separation and the GLM XML tool-call formats (GLM-4.5/4.6's
newline layout and GLM-4.7/5's compact one).

Both are incremental state machines; the non-streaming result is defined as "feed the whole text, then
finish", so a stream cut into any chunks yields exactly the non-streaming result.
"""

from glm5.serve.parsers.reasoning_glm import GLMReasoningParser, parse_reasoning, prompt_opens_reasoning
from glm5.serve.parsers.tool_glm import (GLM45ToolParser, GLMToolParser, ToolCall, ToolCallDelta, make_tool_parser,
                                         parse_tool_calls, select_tool_parser)

__all__ = [
    "GLMReasoningParser", "parse_reasoning", "prompt_opens_reasoning",
    "GLMToolParser", "GLM45ToolParser", "ToolCall", "ToolCallDelta", "make_tool_parser", "parse_tool_calls",
    "select_tool_parser",
]
