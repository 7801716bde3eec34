"""For tests that compare two runs of one config (plain and mask, in memory and streamed, cpu and
cuda, fused and unfused, a run and its recorded goldens, a resumed run and an uninterrupted one):
every passive party draws its initial weights from a seed of its own, taken from the OS
(`PartyMethod.init_seed`; TabVFL's and TabVFL-LE's guests also their masks, from ``[method]
guest_seed``'s OS-random default). These runs set ``[run] shared_init = true`` and, where the
method declares it, the test-only ``[method] guest_seed``, which make those models reproducible
from the config and not private (each party says so in the ledger). Every other test runs the
parties as deployed."""

from __future__ import annotations

import dataclasses
from typing import Any

from securevfl.methods import method_spec


def fixed_seeds(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with ``[run] shared_init = true``, ``[method] guest_seed`` = the run's seed where
    its method declares that option (a value the test set already is kept), and the policy
    ``config_seeds = true`` by which every party accepts them."""
    run = raw.setdefault("run", {})
    run.setdefault("shared_init", True)
    raw.setdefault("policy", {})["config_seeds"] = True  # which every party must accept
    spec = method_spec(run.get("method", "splitnn"))
    if "guest_seed" in {f.name for f in dataclasses.fields(spec.options)}:
        raw.setdefault("method", {}).setdefault("guest_seed", run.get("seed", 0))
    return raw
