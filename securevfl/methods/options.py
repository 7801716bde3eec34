"""A method's `[method]` options: one frozen dataclass per method, each field declared once with
its default, its documentation and its bounds (`option`). `parse_options` validates a config's
``[method]`` table against it, naming the key and the fix; `describe` lists the options for docs
and error messages. Nothing here imports torch, so a config is validated without loading any
model code.

    @dataclass(frozen=True)
    class RidgeOptions:
        alpha: float = option(1.0, "L2 penalty", minimum=0.0)
        iterations: int = option(200, "gradient steps", minimum=1)
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from securevfl.errors import ConfigError

_META = "securevfl.option"


def option(
    default: Any,
    doc: str,
    *,
    choices: Sequence[Any] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
) -> Any:
    """A dataclass field for a method option: its default, a one-line doc, and bounds
    (`choices` for strings; `minimum`/`maximum` for numbers and for the items of a list)."""
    meta = {
        "doc": doc,
        "choices": tuple(choices) if choices is not None else None,
        "minimum": minimum,
        "maximum": maximum,
        "exclusive_minimum": exclusive_minimum,
        "exclusive_maximum": exclusive_maximum,
    }
    if isinstance(default, list):
        default = tuple(default)
    return dataclasses.field(default=default, metadata={_META: meta})


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """A method without `[method]` options."""


def parse_options(cls: type, raw: Mapping[str, Any], *, method: str) -> Any:
    """An instance of options class `cls` from a config's ``[method]`` table; raises
    `ConfigError` naming ``[method] key`` for an unknown key or a bad value."""
    if not isinstance(raw, Mapping):
        raise ConfigError("[method]", f"must be a table of options, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            known = ", ".join(sorted(fields)) or "none"
            raise ConfigError(
                f"[method] {key}", f"unknown option for method {method!r}; known: {known}"
            )
    values = {}
    for name, value in raw.items():
        meta = fields[name].metadata.get(_META, {})
        values[name] = _check(value, hints[name], meta, f"[method] {name}")
    return cls(**values)


def describe(cls: type) -> list[dict[str, Any]]:
    """[{name, type, default, doc, choices, minimum, maximum}] of an options class."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_META, {})
        out.append(
            {
                "name": f.name,
                "type": _type_name(hints[f.name]),
                "default": f.default,
                "doc": meta.get("doc", ""),
                "choices": meta.get("choices"),
                "minimum": meta.get("minimum"),
                "maximum": meta.get("maximum"),
            }
        )
    return out


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, whether None is allowed) of ``X | None``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _check(value: Any, tp: Any, meta: Mapping[str, Any], key: str) -> Any:
    inner, nullable = _optional(tp)
    if value is None:
        if nullable:
            return None
        raise ConfigError(key, "needs a value")
    origin = typing.get_origin(inner)
    if origin in (tuple, list):
        item_type = typing.get_args(inner)[0]
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"must be a list of {_type_name(item_type)}, got {value!r}")
        return tuple(_scalar(v, item_type, meta, key) for v in value)
    return _scalar(value, inner, meta, key)


def _scalar(value: Any, tp: Any, meta: Mapping[str, Any], key: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}")
        return value
    if tp is str:
        choices = meta.get("choices")
        if not isinstance(value, str) or (choices is not None and value not in choices):
            allowed = f"one of {', '.join(map(str, choices))}" if choices else "a string"
            raise ConfigError(key, f"must be {allowed}, got {value!r}")
        return value
    if tp in (int, float):
        ok = isinstance(value, int) if tp is int else isinstance(value, int | float)
        if isinstance(value, bool) or not ok:
            raise ConfigError(
                key, f"must be {'an integer' if tp is int else 'a number'}, got {value!r}"
            )
        if tp is float and not math.isfinite(value):
            raise ConfigError(key, f"must be finite, got {value!r}")
        _bounds(value, meta, key)
        return tp(value)
    if tp is Any:
        return value
    raise TypeError(f"{key}: options of type {tp!r} are not supported")


def _bounds(value: float, meta: Mapping[str, Any], key: str) -> None:
    lo, hi = meta.get("minimum"), meta.get("maximum")
    lo_open, hi_open = meta.get("exclusive_minimum"), meta.get("exclusive_maximum")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ConfigError(key, f"must be {'>' if lo_open else '>='} {lo:g}, got {value!r}")
    if hi is not None and (value >= hi if hi_open else value > hi):
        raise ConfigError(key, f"must be {'<' if hi_open else '<='} {hi:g}, got {value!r}")
