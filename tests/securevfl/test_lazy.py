"""`securevfl.lazy.LazyModule`: the module is imported at the first attribute read, not when
the name is made; later reads go straight to `sys.modules` (a party reads `torch.…` many times
an answer), and a module that is still being imported is left to the import system."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from securevfl.lazy import LazyModule


def test_the_first_attribute_read_imports_the_module_and_later_reads_do_not(tmp_path, monkeypatch):
    (tmp_path / "lazy_probe_mod.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_probe_mod", raising=False)
    lazy = LazyModule("lazy_probe_mod")
    assert "lazy_probe_mod" not in sys.modules
    assert lazy.VALUE == 42
    assert "lazy_probe_mod" in sys.modules

    def no_import(name, package=None):
        raise AssertionError(f"import_module({name!r}) on a module already imported")

    monkeypatch.setattr(importlib, "import_module", no_import)
    assert lazy.VALUE == 42
    with pytest.raises(AttributeError):
        _ = lazy.MISSING


def test_a_module_still_being_imported_goes_through_the_import_system(monkeypatch):
    half = types.ModuleType("lazy_half_mod")
    half.__spec__ = types.SimpleNamespace(_initializing=True)
    monkeypatch.setitem(sys.modules, "lazy_half_mod", half)
    done = types.ModuleType("lazy_half_mod")
    done.VALUE = 7
    calls = []
    monkeypatch.setattr(importlib, "import_module", lambda name: calls.append(name) or done)
    assert LazyModule("lazy_half_mod").VALUE == 7
    assert calls == ["lazy_half_mod"]
