"""Type a raw GLM tool-call argument value by the offered tool's JSON schema.

GLM writes every argument as raw text (`<arg_value>42</arg_value>`); the OpenAI API wants JSON. This
module decides which JSON types a parameter may take (`allowed_types`: `type` and type lists, `enum`,
`const`, local `$ref` into `$defs`/`definitions` with JSON-pointer escapes, `anyOf`/`oneOf` unions,
`allOf` intersections, cycles) and turns the raw text into a value of such a type (`coerce_value`):
JSON first, then the text with its literal escapes (`\\"`, `\\n`) undone, then a Python literal
(`True`, `None`, single quotes, trailing commas) for object/array/boolean/null parameters, else the
raw text. Numbers inside strings (`"42"`) become numbers for numeric parameters; NaN/Infinity never
reach the JSON. A parameter declared `string` keeps its raw text byte for byte (whitespace, quotes
and backslashes included), so it can stream as it arrives.

Follows the behaviour SGLang's GLM-4.7/5 detector tests assert (docs/serve.md lists where vLLM
differs). Nothing here raises on an odd schema: unknown shapes mean "no constraint".
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

UNSET: Any = object()
_PROBE: Any = object()  # equal to no enum/const entry
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_MAX_LITERAL_CHARS = 100_000  # ast.literal_eval cost grows with the input; longer text stays a string


def json_type(value: Any) -> str:
    """JSON Schema type name of a Python value (an integral float counts as an integer)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else "unknown"


def json_equal(a: Any, b: Any) -> bool:
    """JSON equality: `True != 1`, `1 == 1.0`, containers compared element by element."""
    if json_type(a) != json_type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(json_equal(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return a == b


def _resolve(ref: Any, root: Any) -> Any:
    """A local `$ref` (`#`, `#/$defs/a~1b`) inside `root`; None when it does not resolve."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    target = root
    try:
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            target = target[int(part)] if isinstance(target, list) else target[part]
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return target


def allowed_types(schema: Any, root: Any, key: str | None = None, value: Any = UNSET,
                  known: dict | None = None, _seen: frozenset = frozenset()) -> set[str] | None:
    """JSON types the schema admits: for property `key` of an object schema, or for the schema itself
    when `key` is None. `value` narrows `enum`/`const` to the entries equal to it; `known` (arguments
    already typed) drops union branches whose properties they contradict. None = unconstrained."""
    if not isinstance(schema, dict) or id(schema) in _seen:
        return None  # not a schema, or a $ref cycle
    seen = _seen | {id(schema)}
    found: list[set[str]] = []

    def add(types: set[str] | None) -> None:
        if types is not None:
            found.append(types)

    if "$ref" in schema:
        add(allowed_types(_resolve(schema["$ref"], root), root, key, value, known, seen))
    if key is not None:
        props = schema.get("properties")
        if isinstance(props, dict):
            add(allowed_types(props.get(key), root, None, value, None, seen))
    else:
        add(_own_types(schema, value))
    for word in ("anyOf", "oneOf"):
        branches = schema.get(word)
        if isinstance(branches, list):
            alts = [allowed_types(b, root, key, value, known, seen) for b in branches
                    if key is None or _consistent(b, root, known or {})]
            if alts and all(a is not None for a in alts):
                found.append(set().union(*alts))
    if isinstance(schema.get("allOf"), list):
        for branch in schema["allOf"]:
            add(allowed_types(branch, root, key, value, known, seen))
    return set.intersection(*found) if found else None


def _own_types(schema: dict, value: Any) -> set[str] | None:
    """Types from this node's `type` and `enum`/`const` (a number admits integers too)."""
    found = []
    t = schema.get("type")
    names = [t] if isinstance(t, str) else t if isinstance(t, list) else None
    if names is not None:
        s = {n for n in names if isinstance(n, str)}
        found.append(s | ({"integer"} if "number" in s else set()))
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        found.append({json_type(v) for v in values if value is UNSET or json_equal(value, v)})
    return set.intersection(*found) if found else None


def _consistent(branch: Any, root: Any, known: dict) -> bool:
    """True unless an already-typed argument has a type this union branch forbids (a discriminator)."""
    for name, v in known.items():
        types = allowed_types(branch, root, name, value=v)
        if types is not None and json_type(v) not in types:
            return False
    return True


def needs_context(schema: Any) -> bool:
    """True when some property's type depends on the other arguments (a union at or above it that
    leaves several types open): such calls are typed once all their arguments have arrived."""
    keys: set[str] = set()
    has_union = False
    seen: set[int] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node.get("properties"), dict):
            keys.update(k for k in node["properties"] if isinstance(k, str))
        if "$ref" in node:
            stack.append(_resolve(node["$ref"], schema))
        for word in ("anyOf", "oneOf", "allOf"):
            if isinstance(node.get(word), list):
                has_union |= word != "allOf"
                stack.extend(node[word])
    if not has_union:
        return False
    for k in keys:
        types = allowed_types(schema, schema, k)
        if types is None or (len(types) > 1 and types != {"number", "integer"}):
            return True
    return False


def single_type(types: set[str] | None) -> str | None:
    """The one type a parameter must have ("number" covers integer too), or None if open."""
    if types == {"number", "integer"}:
        return "number"
    return next(iter(types)) if types and len(types) == 1 else None


def coerce_value(raw: str, types: set[str] | None, schema: Any = None, key: str | None = None,
                 known: dict | None = None) -> Any:
    """The JSON value for raw argument text whose parameter admits `types` (see module docstring).
    `schema`/`key`/`known` let an open union reject a parse its enum forbids (`enum: ["7", 8]`)."""
    kind = single_type(types)
    if kind == "string":
        return _enum_string(raw, schema, key, known)
    value = _parse(raw, kind)
    if kind is None and schema is not None and key is not None and not isinstance(value, str):
        allowed = allowed_types(schema, schema, key, value=value, known=known)
        native = allowed_types(schema, schema, key, value=raw, known=known)
        if allowed is not None and json_type(value) not in allowed and native is not None and "string" in native:
            return raw  # e.g. "true" for ["string", "integer"]: the text, not a forbidden boolean
    return value


def is_free_string(schema: Any, key: str) -> bool:
    """True when property `key` takes any string (no enum/const to match): it may stream as it arrives."""
    return allowed_types(schema, schema, key, value=_PROBE) != set()


def _enum_string(raw: str, schema: Any, key: str | None, known: dict | None) -> str:
    """A string parameter keeps its raw text, except that an enum/const string written with
    surrounding whitespace (grammar-forced calls allow a space there) is the value it names."""
    if schema is None or key is None or allowed_types(schema, schema, key, value=raw, known=known) != set():
        return raw
    stripped = raw.strip()
    return stripped if allowed_types(schema, schema, key, value=stripped, known=known) else raw


def _parse(raw: str, kind: str | None) -> Any:
    for text in (raw, _unescaped(raw)):
        if text is None:
            continue
        try:
            return _numeric(_strict_json(text), kind)
        except (ValueError, RecursionError):
            pass
    if kind is None:  # an open type: the text itself, without wrapping quotes
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
            return raw[1:-1]
        return raw
    literal = _python_literal(raw)
    return raw if literal is UNSET else literal


def _strict_json(text: str) -> Any:
    """json.loads without NaN/Infinity (they are not JSON); raises ValueError."""
    def reject(name: str) -> Any:
        raise ValueError(name)
    value = json.loads(text, parse_constant=reject)
    if not _finite(value):
        raise ValueError("non-finite number")  # 1e999 parses to inf
    return value


def _unescaped(raw: str) -> str | None:
    """The text with JSON string escapes undone (`{\\"a\\": 1}` -> `{"a": 1}`), or None."""
    if "\\" not in raw:
        return None
    try:
        return json.loads('"' + raw + '"')
    except ValueError:
        return None


def _numeric(value: Any, kind: str | None) -> Any:
    """A number written inside a JSON string counts as a number for numeric parameters."""
    if isinstance(value, str) and kind in ("integer", "number"):
        text = value.strip()
        m = _NUMBER.fullmatch(text)
        if m and kind == "integer" and not (m.group(2) or m.group(3)):
            return int(text)
        if m and kind == "number":
            return float(text) if (m.group(2) or m.group(3)) else int(text)
    return value


def _python_literal(raw: str) -> Any:
    """A Python literal made JSON (tuples -> lists); UNSET when it is not one or has no JSON form."""
    if len(raw) > _MAX_LITERAL_CHARS:
        return UNSET
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return UNSET
    value = _jsonable(value)
    return value if value is not UNSET and _finite(value) else UNSET


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_jsonable(v) for v in value]
        return UNSET if any(v is UNSET for v in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = {k: _jsonable(v) for k, v in value.items()}
        return UNSET if any(v is UNSET for v in items.values()) else items
    return UNSET  # sets, bytes, complex, non-string keys


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True
