"""Method registry. Importing this package registers every built-in method."""

from __future__ import annotations

from securevfl.methods.base import (
    ActiveContext,
    ActiveMethod,
    MethodSpec,
    PartyDropped,
    PartyMethod,
    SumSpec,
    UnknownOperation,
    call_recipients,
    register_method,
    registry,
)

_LOADED = False


def _load_builtin() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    # each module registers its methods on import
    from securevfl.methods import baselines, laser, ols, splitnn, vfem  # noqa: F401


def method_names() -> tuple[str, ...]:
    _load_builtin()
    return tuple(sorted(registry()))


def method_spec(name: str) -> MethodSpec:
    _load_builtin()
    try:
        return registry()[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; known: {', '.join(method_names())}") from None


__all__ = [
    "ActiveContext",
    "ActiveMethod",
    "MethodSpec",
    "PartyDropped",
    "PartyMethod",
    "SumSpec",
    "UnknownOperation",
    "call_recipients",
    "method_names",
    "method_spec",
    "register_method",
]
