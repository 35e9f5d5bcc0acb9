"""Request checks at the HTTP boundary that pydantic types alone do not express.

- Text: JSON may carry lone surrogates (`"\\ud800"`), which Python strings hold but UTF-8 (and so every
  tokenizer) cannot encode; `check_body_text` finds the first one in a raw body and names its field.
- Tool schemas: `function.parameters` must be a valid JSON Schema (Draft 2020-12 metaschema, via the
  `jsonschema` package, no network); `check_tools` names the tool and the path inside its schema.
- Token ids are checked by `glm5.infer.sampling.check_token_ids` (engine and server share it).
Every failure is an `APIError(400)` whose `param` is the offending field's path.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from glm5.serve.common import APIError

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # \uD800-\uDFFF (a literal search: fast)
_SCHEMA_VALIDATOR = jsonschema.Draft202012Validator(jsonschema.Draft202012Validator.META_SCHEMA)


def _bad_text(s: str) -> int | None:
    """Index of the first character UTF-8 cannot encode, or None."""
    try:
        s.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def find_lone_surrogate(obj: Any, path: str = "") -> tuple[str, str, int] | None:
    """(field path, the string, character index) of the first unencodable string in a JSON value
    (keys included), or None. Iterative, so a deeply nested body cannot exhaust the stack."""
    stack = [(obj, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            i = _bad_text(value)
            if i is not None:
                return where or "body", value, i
        elif isinstance(value, dict):
            for k, v in reversed(list(value.items())):
                child = f"{where}.{k}" if where else str(k)
                if _bad_text(k) is not None:
                    return (where or "body") + " (a key)", k, _bad_text(k)
                stack.append((v, child))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(value))))
    return None


def _lone_surrogate_escape(body: bytes) -> bool:
    """Whether some surrogate escape is not part of a high-low pair (`\\ud83d\\ude00` is an emoji)."""
    open_high = None  # end offset of a high surrogate escape still waiting for its low half
    for m in _SURROGATE_ESCAPE.finditer(body):
        if m.group()[3:4] in b"89abAB":  # high half
            if open_high is not None:
                return True
            open_high = m.end()
        elif open_high != m.start():  # a low half that does not follow a high half
            return True
        else:
            open_high = None
    return open_high is not None


def check_body_text(body: bytes) -> None:
    """400 naming the field if a JSON body holds a lone surrogate. A byte scan decides whether the body
    needs parsing at all (a lone surrogate can only arrive as a `\\uXXXX` escape), so a clean 4 MB body
    costs about a millisecond on the event loop."""
    if not _lone_surrogate_escape(body):
        return
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return  # malformed JSON: the route's own parsing answers 400
    found = find_lone_surrogate(data)
    if found is not None:
        where, text, i = found
        raise APIError(400, f"{where}: not valid Unicode (lone surrogate U+{ord(text[i]):04X} at character {i}); "
                            "send UTF-8 text, with surrogates only in valid pairs", param=where,
                       code="invalid_unicode")


def schema_error(schema: Any) -> str | None:
    """Why `schema` is not a valid JSON Schema (with the path inside it), or None when it is."""
    try:
        error = jsonschema.exceptions.best_match(_SCHEMA_VALIDATOR.iter_errors(schema))
    except RecursionError:
        return "nested too deeply"
    if error is None:
        return None
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    return f"{error.message} (at {where.lstrip('.') or 'the top level'})"


def check_tools(tools: list | None) -> None:
    """400 naming the tool and the path in its schema if a tool's `parameters` is not a JSON Schema."""
    for i, tool in enumerate(tools or []):
        params = tool.function.parameters
        if params is None:
            continue
        why = schema_error(params)
        if why is not None:
            raise APIError(400, f"Invalid schema for function '{tool.function.name}': {why}",
                           param=f"tools[{i}].function.parameters", code="invalid_function_parameters")
