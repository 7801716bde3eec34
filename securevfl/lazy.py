"""Modules imported on first use, so that parsing a config, making keys or printing help never
loads torch (about a second on a small machine).

Method modules and their toolkits write ``from securevfl.lazy import torch, nn`` and use the
names as usual inside functions; a class statement that subclasses ``nn.Module`` at import time
would load torch, so such classes live in model modules that the method imports inside its
functions (a test imports every method module and checks torch stayed unloaded).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for module `name`; the first attribute access imports it (later ones go through
    `sys.modules`, one dictionary lookup: a party reads `torch.…` a dozen times an answer)."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        module: ModuleType | None = sys.modules.get(self._name)
        # not imported yet, or still being imported (by another thread: import_module waits
        # for it, as the import system does)
        if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
            module = importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


torch: Any = LazyModule("torch")
nn: Any = LazyModule("torch.nn")
functional: Any = LazyModule("torch.nn.functional")
