"""For tests that compare two runs of one config (plain and mask, in memory and streamed, cpu and
cuda, a run and its recorded goldens): a method whose parties draw their models from their own
OS-random seeds (TabVFL's and TabVFL-LE's guests) declares a test-only ``[method] guest_seed``;
these runs set it, which makes those models reproducible and not private (each guest says so in
the ledger). Every other test runs the guests as deployed."""

from __future__ import annotations

import dataclasses
from typing import Any

from securevfl.methods import method_spec


def fixed_guest_seeds(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with ``[method] guest_seed`` = the run's seed where its method declares that
    option (unchanged otherwise, and where the test set one already)."""
    spec = method_spec(raw.get("run", {}).get("method", "splitnn"))
    if "guest_seed" in {f.name for f in dataclasses.fields(spec.options)}:
        raw.setdefault("method", {}).setdefault("guest_seed", raw["run"].get("seed", 0))
    return raw
