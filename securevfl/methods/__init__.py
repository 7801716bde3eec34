"""The method registry.

A method is one module (or package) of `securevfl.methods` that defines ``SPEC`` (a
`MethodSpec`) or ``SPECS`` (several); it is found by being there, with no list to edit.
Methods from other distributions register through the ``securevfl.methods`` entry-point group
(an entry point names a `MethodSpec`, or a module defining ``SPEC``/``SPECS``). Discovery imports
method modules, never their model code: a method module must not import torch at import time
(`securevfl.lazy`), so that a config is parsed and validated in a fraction of a second.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections.abc import Iterable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from securevfl.methods.base import (
    ActiveContext,
    ActiveMethod,
    MethodSpec,
    Operation,
    PartyDropped,
    PartyMethod,
    Release,
    SumSpec,
    UnknownOperation,
    register_method,
    registry,
)

ENTRY_POINT_GROUP = "securevfl.methods"
_LOADED = False


def _specs_of(obj: Any) -> Iterable[MethodSpec]:
    if isinstance(obj, MethodSpec):
        return [obj]
    specs = list(getattr(obj, "SPECS", ()))
    if getattr(obj, "SPEC", None) is not None:
        specs.append(obj.SPEC)
    return specs


def _declares_a_method(path: Path) -> bool:
    """Whether a module's source assigns ``SPEC`` or ``SPECS`` at top level (read, not run: a
    toolkit or a model module is never imported just to look)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id in ("SPEC", "SPECS") for t in targets):
            return True
    return False


def _load_builtin() -> None:
    """Register every method module of this package and every entry point, once."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    here = Path(__file__).parent
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        source = here / info.name / "__init__.py" if info.ispkg else here / f"{info.name}.py"
        if not _declares_a_method(source):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for spec in _specs_of(module):
            register_method(spec)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        for spec in _specs_of(ep.load()):
            register_method(spec)


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
    "ENTRY_POINT_GROUP",
    "ActiveContext",
    "ActiveMethod",
    "MethodSpec",
    "Operation",
    "PartyDropped",
    "PartyMethod",
    "Release",
    "SumSpec",
    "UnknownOperation",
    "method_names",
    "method_spec",
    "register_method",
]
