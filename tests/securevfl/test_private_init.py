"""A passive party's initial weights are its own secret, tested from the attacker's side.

Three real `securevfl party` processes face a modified active party that also plays the
aggregator (`test_hostile_roles.Attacker`). Their split-NN encoders are linear (no hidden
layer) and as wide as the federation's six columns, so the sum of their first forward is an
invertible linear map of each row. An attacker that knows the encoders inverts it: with
`[run] shared_init = true` it rebuilds them from the config, as every role can, and reads back
every party's standardised columns; with the default, each party drew its own seed, and the
same rebuild gives numbers unrelated to any column.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from crypto import FixedPointEncoder
from securevfl.data.table import load_party_table, role_data_path
from securevfl.methods.blocks.nets import derived_seed, mlp
from securevfl.roles import protocol as P
from tests.securevfl.test_hostile_roles import PARTIES, Attacker, everything

pytestmark = pytest.mark.multiprocess

WIDTH = 6  # the columns of all three parties together


def linear_encoders(raw: dict, *, shared: bool) -> None:
    raw["model"] = {"hidden": [], "width": WIDTH}
    if shared:
        raw["run"]["shared_init"] = True


def first_sum(attacker: Attacker) -> np.ndarray:
    """The sum of the three encoders' outputs on all rows, as the attacker opens it."""
    replies = attacker.setup()
    assert all(r.kind == P.CONTRIB for r in replies.values()), replies
    replies = attacker.call("forward", ids=attacker.ids, args={"train": False}, sums=everything([]))
    assert all(r.kind == P.CONTRIB for r in replies.values()), replies
    total = sum(r.tensors["S"] for r in replies.values())  # uint64 wraps: ring addition
    cfg = attacker.cfg
    encoder = FixedPointEncoder(frac_bits=cfg.frac_bits, bound=cfg.bound)
    return encoder.decode(total, terms=len(PARTIES)).reshape(len(attacker.ids), WIDTH)


def rebuilt_inverse(attacker: Attacker, s: np.ndarray) -> np.ndarray:
    """The rows' standardised columns, solved from `s` with the encoders rebuilt from the
    config as `SplitNNParty.setup` builds them from `[run] seed`."""
    weights, bias = [], np.zeros(WIDTH)
    for p in PARTIES:
        seed = derived_seed(attacker.cfg.seed, "encoder", p)
        (layer,) = mlp(2, [], WIDTH, seed=seed)
        weights.append(layer.weight.detach().double().numpy())
        bias += layer.bias.detach().double().numpy()
    a = np.concatenate(weights, axis=1)  # WIDTH x 6
    return np.linalg.solve(a, (s - bias).T).T


def true_columns(attacker: Attacker) -> np.ndarray:
    cols = []
    for p in PARTIES:
        table = load_party_table(role_data_path(attacker.run_dir, p), attacker.cfg, p)
        cols.append(table.rows(attacker.ids))
    return np.concatenate(cols, axis=1)


def column_correlations(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.array([abs(np.corrcoef(a[:, j], b[:, j])[0, 1]) for j in range(a.shape[1])])


@pytest.mark.parametrize("shared", [True, False], ids=["shared_init", "own_seeds"])
def test_the_active_party_cannot_rebuild_a_party_s_first_model(tmp_path, shared):
    a = Attacker(tmp_path, edit=lambda raw: linear_encoders(raw, shared=shared))
    try:
        guess = rebuilt_inverse(a, first_sum(a))
        corr = column_correlations(guess, true_columns(a))
    finally:
        a.close()
    events = [json.loads(line) for line in (a.run_dir / "ledger.jsonl").open()]
    unprotected = {e["what"] for e in events if e["kind"] == "unprotected"}
    if shared:
        # the attack works: every party's every column comes back (standardised)
        assert corr.min() > 0.9999, corr
        assert {f"{p} initial model" for p in PARTIES} <= unprotected, unprotected
    else:
        # each party drew its own weights: what the attacker solves mixes columns at random
        assert corr.min() < 0.99, corr
        assert not unprotected, unprotected
