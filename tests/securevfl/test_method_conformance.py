"""The checks every registered method is held to, on its declared example (`MethodSpec.example`),
so that a new method inherits them (scikit-learn's `check_estimator` in spirit):

* mask decodes what plain computes (same schedule: min_group = 1 for both), within fixed point;
* every call a party serves is one the method declared: a declared operation, sums only over
  tensors it declared as summed, clear tensors only those declared clear, declared inputs;
* every role's checkpoint round-trips through the on-disk format (torch's weights_only load);
* label DP (and embedding DP where contributions are per row) reach the ledger.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from securevfl.config import ConfigError, DPConfig, parse_config
from securevfl.direct import DirectFederation
from securevfl.methods import method_names, method_spec
from securevfl.roles.checkpoint import load_checkpoint, save_checkpoint
from tests.securevfl.conftest import permissive_policy
from tests.securevfl.fixed_seeds import fixed_seeds

NAMES = [n for n in method_names() if method_spec(n).example is not None]


def example_config(name, directory, *, reproducible=False, **run):
    directory.mkdir(parents=True, exist_ok=True)
    raw = method_spec(name).example(directory)
    if reproducible:  # two runs compared: every party's model from the run's seed (tests only)
        fixed_seeds(raw)
    raw.setdefault("run", {}).update(run)
    return parse_config(permissive_policy(raw), source=directory / "config.toml")


def _flat(metrics):
    return {k: v for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v)}


@pytest.mark.parametrize("name", NAMES)
def test_mask_decodes_what_plain_computes(name, tmp_path):
    runs = {}
    try:
        example_config(name, tmp_path / "probe", aggregation="mask", min_group=1)
    except ConfigError as exc:
        # a method whose releases cannot be summed (TabVFL) refuses secure aggregation at load,
        # naming the setting and why; it never runs on mask pretending to be protected
        assert "aggregation" in str(exc) and "clear" in str(exc), exc
        return
    for aggregation in ("plain", "mask"):
        cfg = example_config(
            name, tmp_path / aggregation, reproducible=True, aggregation=aggregation, min_group=1
        )
        fed = DirectFederation(cfg, run_dir=tmp_path / aggregation / "run")
        stats = [
            {k: v for k, v in h.items() if k not in ("rows_per_s", "beta_change")}
            for h in fed.history
        ]
        runs[aggregation] = (fed.run(), stats, fed)
    (m_plain, l_plain, _), (m_mask, l_mask, fed) = runs["plain"], runs["mask"]
    for spec, plain, decoded in fed.sums:  # every sum decodes to the plaintext sum
        assert np.allclose(decoded, plain, atol=len(spec.group) * 2.0**-fed.config.frac_bits)
    assert len(l_plain) == len(l_mask)
    for a, b in zip(l_plain, l_mask, strict=True):
        assert b == pytest.approx(a, rel=1e-3, abs=1e-4)
    p, m = _flat(m_plain), _flat(m_mask)
    assert set(p) == set(m)
    for k in p:
        assert m[k] == pytest.approx(p[k], rel=0.02, abs=0.02), k


@pytest.mark.parametrize("name", NAMES)
def test_parties_serve_only_what_the_method_declared(name, tmp_path):
    cfg = example_config(name, tmp_path, aggregation="plain", min_group=1)
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    fed.run()
    spec = method_spec(name)
    served = [c for c in fed.calls if c[0] not in ("setup", "checkpoint")]
    assert served, "the example made no party call"
    for op_name, _, sums, _ in served:
        op = spec.operation(op_name)
        assert op is not None, f"{name}: undeclared operation {op_name!r}"
        for s in sums:
            release = op.release_of(s.tensor)
            assert release is not None and release.to == "sum", (op_name, s.tensor)
    for op in spec.operations:
        for release in op.releases:
            assert release.to in ("sum", "clear")


@pytest.mark.parametrize("name", NAMES)
def test_checkpoints_round_trip(name, tmp_path):
    cfg = example_config(name, tmp_path, aggregation="plain", min_group=1)
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    fed.run()
    stages = {**fed.party_methods, cfg.active_name: fed.method}
    for role, stage in stages.items():
        state = stage.state_dict()
        save_checkpoint(tmp_path / "ck", role, 0, state)
        loaded = load_checkpoint(tmp_path / "ck", role, 0)  # weights_only: no code on load
        stage.load_state_dict(loaded)
        again = stage.state_dict()
        assert _equal(state, again), role


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "shape"):
        return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("name", NAMES)
def test_dp_releases_reach_the_ledger(name, tmp_path):
    cfg = example_config(name, tmp_path, aggregation="plain", min_group=1)
    per_row = all(
        r.per_row for op in method_spec(name).operations for r in op.releases if r.to == "sum"
    )
    dp = DPConfig(clip=1.0, noise_multiplier=4.0)
    cfg = dataclasses.replace(
        cfg,
        label_dp=dp,
        delta=1e-5,
        parties=tuple(
            dataclasses.replace(p, embedding_dp=dp if per_row else None) for p in cfg.parties
        ),
    )
    try:
        method_spec(name).validate_config(cfg)
    except ConfigError as exc:  # a method may refuse a mechanism it cannot apply, naming it
        assert "label_dp" in exc.key or "embedding_dp" in exc.key, exc
        return
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    fed.run()
    events = [json.loads(line) for line in (tmp_path / "run" / "ledger.jsonl").open()]
    mechanisms = {(e["role"], e.get("mechanism")) for e in events if e["kind"] == "dp"}
    if any(c[0] in ("backward", "step", "mstep") for c in fed.calls) and fed.released:
        assert (cfg.active_name, "label_dp") in mechanisms, mechanisms
    if per_row:
        assert all((p, "embedding_dp") in mechanisms for p in cfg.party_names), mechanisms
