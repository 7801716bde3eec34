"""`SumPlan`: the secure sums one call asks for, several tensors per group and several groups per
call, built once and read back by (group, tensor)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from securevfl.methods.base import ActiveContext, SumSpec


class SumPlan:
    """Collects (group, tensor) sums for one party call: one `SumSpec` each (deduplicated), and
    which tensors each party must compute (``models`` in the call's args)."""

    def __init__(self) -> None:
        self.specs: list[SumSpec] = []
        self._keys: dict[tuple[tuple[str, ...], str], str] = {}
        self.models: dict[str, list[str]] = {}

    def add(self, group: Sequence[str], tensor: str) -> str:
        """Ask for the sum of `tensor` over `group` (in that order); returns its result key."""
        group = tuple(group)
        where = (group, tensor)
        if where not in self._keys:
            key = f"S{len(self.specs)}"
            self._keys[where] = key
            self.specs.append(SumSpec(key=key, tensor=tensor, group=group))
            for p in group:
                if tensor not in self.models.setdefault(p, []):
                    self.models[p].append(tensor)
        return self._keys[where]

    def __bool__(self) -> bool:
        return bool(self.specs)

    def call(
        self, ctx: ActiveContext, op: str, *, ids: np.ndarray, args: Mapping[str, Any]
    ) -> dict[tuple[tuple[str, ...], str], np.ndarray]:
        """Run `op` with every sum of the plan; returns (group, tensor) -> decoded sum."""
        if not self.specs:
            return {}
        got = ctx.call(op, ids=ids, args={**args, "models": self.models}, sums=self.specs)
        return {where: got[key] for where, key in self._keys.items()}
