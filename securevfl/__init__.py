"""securevfl: privacy-hardened vertical federated learning.

``securevfl.load(run_dir)`` loads a trained run for in-process scoring; everything else is the
``securevfl`` command (`securevfl.cli`)."""

from __future__ import annotations

from typing import Any

__version__ = "0.2.0"


def load(run_dir: Any, *, config: Any = None) -> Any:
    """A trained run (`securevfl.direct.TrainedModel`): ``.predict(table_path)`` scores rows."""
    from securevfl.direct import load as _load

    return _load(run_dir, config=config)
