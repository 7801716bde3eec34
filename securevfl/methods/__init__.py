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
_ENTRY_POINTS_LOADED = False


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
    for name, ispkg in _builtin_modules().items():
        _register_module(name, ispkg)
    _load_entry_points()


def _builtin_modules() -> dict[str, bool]:
    """This package's modules (name -> is a package), private ones left out."""
    return {i.name: i.ispkg for i in pkgutil.iter_modules(__path__) if not i.name.startswith("_")}


def _register_module(name: str, ispkg: bool) -> None:
    """Import and register built-in module `name` if its source declares a method."""
    here = Path(__file__).parent
    if _declares_a_method(here / name / "__init__.py" if ispkg else here / f"{name}.py"):
        for spec in _specs_of(importlib.import_module(f"{__name__}.{name}")):
            register_method(spec)


def _load_entry_points() -> None:
    """Register the methods of other distributions (entry points), once: also when a config's
    method was found among the built-ins, so that a plugin declaring a built-in's name is
    refused as before (`register_method`: registered twice), never silently ignored."""
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        for spec in _specs_of(ep.load()):
            register_method(spec)


def _load_named(name: str) -> None:
    """Import the built-in module a method's name points to, if there is one: ``a-b`` is looked
    for in module ``a_b``, then ``a`` and ``b`` (``tabvfl-le`` in ``tabvfl``, ``cc-ols`` in
    ``ols``). A role then imports its own method's module only, not every method's (a tenth of
    a second of start-up per process); a name found nowhere loads everything
    (`_load_builtin`), entry points included."""
    modules = _builtin_modules()  # exact module names: nothing else reaches the file system
    for guess in dict.fromkeys([name.replace("-", "_"), *name.split("-")]):
        if guess in modules:
            _register_module(guess, modules[guess])
            if name in registry():
                return


def known_method(name: str) -> bool:
    """Whether `name` is a registered method (its own module loaded first, then everything)."""
    if name not in registry():
        _load_named(name)
    if name in registry():
        _load_entry_points()  # a plugin of the same name is refused here, as before
    else:
        _load_builtin()
    return name in registry()


def method_names() -> tuple[str, ...]:
    _load_builtin()
    return tuple(sorted(registry()))


def method_spec(name: str) -> MethodSpec:
    if not known_method(name):
        raise KeyError(f"unknown method {name!r}; known: {', '.join(method_names())}")
    return registry()[name]


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
    "known_method",
    "method_names",
    "method_spec",
    "register_method",
]
