"""securevfl: privacy-hardened vertical federated learning.

``securevfl.load(run_dir)`` loads a trained run for in-process scoring; everything else is the
``securevfl`` command (`securevfl.cli`)."""

from __future__ import annotations

from typing import Any

__version__ = "0.2.0"


def _check_sibling_packages() -> None:
    """securevfl ships two top-level packages, `crypto` and `transport` (the design's layout);
    refuse to run with another distribution's package of the same name shadowing either."""
    import importlib.util
    from pathlib import Path

    home = Path(__file__).resolve().parent.parent
    for name in ("crypto", "transport"):
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin).resolve().parent.parent if spec and spec.origin else None
        if origin != home or not (home / name / "__init__.py").exists():
            raise ImportError(
                f"the top-level package {name!r} found first on sys.path "
                f"({spec.origin if spec else 'none'}) is not securevfl's (expected "
                f"{home / name}); another installed distribution also provides {name!r}: "
                "install securevfl in its own virtual environment"
            )


_check_sibling_packages()


def load(run_dir: Any, *, config: Any = None) -> Any:
    """A trained run (`securevfl.direct.TrainedModel`): ``.predict(table_path)`` scores rows."""
    from securevfl.direct import load as _load

    return _load(run_dir, config=config)
