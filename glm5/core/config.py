"""Typed configs: TOML files -> nested dataclasses, with `--section.key=value` CLI overrides.

Every subsystem (data, train, engine, server) declares `@dataclass(kw_only=True)` configs; this module
loads them, rejects unknown keys loudly (naming the dotted key), checks types, and serialises the
resolved config back to a plain dict so that it can be stored next to checkpoints and logs.
stdlib only (plus `glm5.core.resources` to find packaged configs).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from glm5.core.resources import config_file

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override is malformed; the message names the key and says why."""


def load_toml(path: str | Path) -> dict:
    """A TOML file, or a packaged config by name (`configs/train/tiny.toml`, `train/tiny`: see resources.py)."""
    try:
        path = config_file(path)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e


def parse_value(text: str) -> Any:
    """Parse an override value as a TOML value (numbers, bools, lists, quoted strings); else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(d: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Apply `--a.b.c=value` (or `a.b.c=value`) overrides to a nested dict, in place, and return it."""
    for item in overrides:
        key, sep, text = item.removeprefix("--").partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        node = d
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        node[leaf] = parse_value(text)
    return d


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and gently coerce: int -> float, list -> tuple) `value` against the annotation `tp`."""
    if tp is Any or tp is typing.Any:
        return value
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {value!r} does not match {_type_name(tp)}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{key}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        inner = args[0] if args else Any
        out = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    return value


def from_dict(cls: type[T], d: dict, prefix: str = "") -> T:
    """Build dataclass `cls` from a nested dict. Unknown keys raise `ConfigError` naming the key."""
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix or cls.__name__}: expected a table, got {d!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in d if k not in fields]
    if unknown:
        where = f" in [{prefix}]" if prefix else ""
        raise ConfigError(
            f"unknown config key {', '.join(repr(f'{prefix}.{k}' if prefix else k) for k in unknown)}"
            f"{where}; valid keys: {sorted(fields)}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in d.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from e


def to_dict(obj: Any) -> Any:
    """Resolved config -> plain JSON-able dict (nested dataclasses become tables)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def load_config(cls: type[T], path: str | Path | None = None, overrides=()) -> T:
    """Load `cls` from an optional TOML file, then apply dotted CLI overrides."""
    d = load_toml(path) if path else {}
    apply_overrides(d, list(overrides))
    return from_dict(cls, d)


def save_json(obj: Any, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_dict(obj), indent=2, sort_keys=False) + "\n")


def load_cli_config(cls: type[T], argv: list[str] | None, prog: str, description: str = "",
                    example: str = "") -> T:
    """`--config FILE [--section.key=value ...]` -> `cls`; a bad file or key exits 2 with one clear line."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--config", default=None, help=f"TOML file{f' (see {example})' if example else ''}")
    args, overrides = ap.parse_known_args(argv)
    try:
        return load_config(cls, args.config, overrides)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
