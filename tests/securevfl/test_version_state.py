"""The model version of a method without torch modules (VFEM, the OLS comparators, ridge): a
modified active party must not clear a party's differencing record with an update that leaves
what the party releases unchanged. Before `PartyMethod.version_state`, every declared update
of such a method started a new version, so a `revert` that changed nothing (or an M-step at
step size 0) let the sums {a,b,c} and {b,c} of one E-step be released, whose difference is
party a's per-row predictor."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from securevfl.config import parse_config
from securevfl.data.table import write_csv
from securevfl.direct import DirectFederation
from securevfl.errors import PolicyRefusal
from securevfl.methods import SumSpec
from securevfl.roles.guard import model_digest
from tests.securevfl.conftest import permissive_policy

COLS = [f"X{i + 1}" for i in range(6)]
PARTIES = ("a", "b", "c")
RAW = {
    "run": {"method": "vfem", "aggregation": "mask", "seed": 0},
    "data": {"path": "data.csv", "task": "regression", "test_fraction": 0.0},
    "parties": {
        "a": {"columns": COLS[:2]},
        "b": {"columns": COLS[2:4]},
        "c": {"columns": COLS[4:]},
    },
    "secure": {"frac_bits": 40, "bound": 2.0**18},
}


def vfem_federation(tmp_path, *, n: int, missing=None):
    """A VFEM federation (mask, parties a, b, c) on `n` rows of a linear model; `missing`
    blanks cells of the table first; prepared on its training rows."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, len(COLS)))
    y = x @ rng.normal(size=len(COLS)) + 0.1 * rng.normal(size=n)
    if missing is not None:
        missing(x)
    write_csv(
        tmp_path / "data.csv",
        id_column="ID",
        ids=np.arange(1, n + 1),
        columns=COLS,
        values=x,
        label="Y",
        labels=y,
    )
    cfg = parse_config(permissive_policy(copy.deepcopy(RAW)), source=tmp_path / "config.toml")
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    ids = np.sort(fed.train_ids)
    fed.call("prepare", ids=ids, args={"intercept": True, "standardize": True}, to=list(PARTIES))
    return fed, ids


def stepped_federation(tmp_path):
    """A VFEM federation after set-up, a design and two M-steps and a revert, driven by a
    modified active party (its real keys, any call it likes)."""
    fed, ids = vfem_federation(tmp_path, n=60)
    rng = np.random.default_rng(0)
    fed.call(
        "design",
        ids=ids,
        args={"kind": "complete", "reset": True},
        to=list(PARTIES),
        collect=["spectrum"],
    )
    e = rng.normal(size=len(ids))
    for _ in range(2):
        for p in PARTIES:
            fed.call("mstep", ids=ids, args={"sigma2": 1.0, "eta": 0.1}, inputs={"e": e}, to=[p])
    fed.call("revert", ids=ids, to=list(PARTIES))
    return fed, ids


def estep_sum(fed, ids, group):
    return fed.call("estep", ids=ids, sums=[SumSpec(key="m", tensor="m", group=group)])["m"]


def test_a_revert_that_changes_nothing_keeps_the_version_and_the_rule_refuses(tmp_path):
    fed, ids = stepped_federation(tmp_path)
    beta = fed.party_methods["b"].block.params.beta.copy()
    estep_sum(fed, ids, PARTIES)
    fed.call("revert", ids=ids, to=["b", "c"])  # params = previous already: a no-op
    assert np.array_equal(fed.party_methods["b"].block.params.beta, beta)
    with pytest.raises(PolicyRefusal, match="differencing"):
        estep_sum(fed, ids, ("b", "c"))


def test_an_m_step_of_size_zero_keeps_the_version(tmp_path):
    fed, ids = stepped_federation(tmp_path)
    estep_sum(fed, ids, PARTIES)
    for p in ("b", "c"):
        fed.call(
            "mstep",
            ids=ids,
            args={"sigma2": 1.0, "eta": 0.0},
            inputs={"e": np.zeros(len(ids))},
            to=[p],
        )
    with pytest.raises(PolicyRefusal, match="differencing"):
        estep_sum(fed, ids, ("b", "c"))


def test_a_real_step_is_a_new_version_and_a_revert_brings_back_the_old_ones_sums(tmp_path):
    """The honest protocol still runs: after a real M-step the sums are of a new version; a
    revert to the weights of an earlier version is held to that version's sums."""
    fed, ids = stepped_federation(tmp_path)
    estep_sum(fed, ids, PARTIES)
    e = np.random.default_rng(1).normal(size=len(ids))
    for p in PARTIES:
        fed.call("mstep", ids=ids, args={"sigma2": 1.0, "eta": 0.05}, inputs={"e": e}, to=[p])
    estep_sum(fed, ids, ("b", "c"))  # a new beta everywhere: a new version
    fed.call("revert", ids=ids, to=list(PARTIES))  # back to the first version
    with pytest.raises(PolicyRefusal, match="differencing"):
        estep_sum(fed, ids, ("b", "c"))


def test_the_digest_of_a_declared_version_follows_its_values_only():
    from securevfl.methods.ridge import RidgeParty

    party = object.__new__(RidgeParty)
    assert model_digest(party) == model_digest(object.__new__(RidgeParty))  # before set-up
    party.beta = np.zeros(3)
    party.mean, party.sd = np.zeros(3), np.ones(3)
    first = model_digest(party)
    party.mean = np.ones(3)  # another standardisation (a set-up on other rows): what the
    assert model_digest(party) != first  # party releases changes, so the version does
    party.mean = np.zeros(3)
    assert model_digest(party) == first
    party.beta = np.array([0.0, 1e-300, 0.0])
    assert model_digest(party) != first
    party.beta = np.zeros(3)
    assert model_digest(party) == first
    party.beta = np.zeros(3, dtype=np.float32)  # the same numbers at another dtype
    assert model_digest(party) != first


def test_a_method_with_no_model_and_no_declared_version_is_one_version():
    class Stateless:
        pass

    a, b = Stateless(), Stateless()
    a.counter = 1
    b.counter = 2
    assert model_digest(a) == model_digest(b) is not None


def test_a_tensor_not_per_row_is_checked_across_the_rows_calls_name(tmp_path):
    """VFEM's `shift` ((center/scale)'beta_k, one number a party) does not depend on the rows
    of the call: its sums over {a,b,c} on some rows and {b,c} on others difference to party
    a's share. The rule files such a tensor's sums under one row whatever rows a call names."""
    fed, ids = stepped_federation(tmp_path)
    half = len(ids) // 2

    def shift_sum(rows, group):
        fed.call(
            "design",
            ids=rows,
            args={"kind": "complete", "reset": False},
            to=list(PARTIES),
            collect=["spectrum"],
        )
        return fed.call("shift", ids=rows, sums=[SumSpec(key="s", tensor="shift", group=group)])

    shift_sum(ids[:half], PARTIES)
    with pytest.raises(PolicyRefusal, match="differencing"):
        shift_sum(ids[half:], ("b", "c"))


def test_rows_a_party_lacks_are_one_row_to_the_rule(tmp_path):
    """On a row a party lacks, VFEM's E-step terms are one constant per version (mu_k'beta_k,
    beta_k'Sigma_k beta_k). Two E-steps at one version over different rows that no party
    holds, {a,b,c} then {a,b}, used to pass (each row was seen once) and difference to c's
    constants; the rule files every row a party lacks as one."""

    def blank(x):
        x[[0, 1], :] = np.nan  # two rows with the response only: every block missing
        x[10:20, 4:] = np.nan  # c lacks some rows

    fed, ids = vfem_federation(tmp_path, n=80, missing=blank)
    rng = np.random.default_rng(1)
    assert {1, 2} <= set(ids.tolist())
    design = {"kind": "blocks", "reset": True}
    fed.call("design", ids=ids, args=design, to=list(PARTIES), collect=["spectrum"])
    for _ in range(3):
        e = rng.normal(size=len(ids))
        fed.call(
            "mstep", ids=ids, args={"sigma2": 1.0, "eta": 0.3}, inputs={"e": e}, to=list(PARTIES)
        )
    held = ids[ids > 2]
    d1 = np.sort(np.concatenate([[1], held[: len(held) // 2]]))
    d2 = np.sort(np.concatenate([[2], held[len(held) // 2 :]]))

    def estep(rows, group):
        fed.call(
            "design",
            ids=rows,
            args={"kind": "blocks", "reset": False},
            to=list(PARTIES),
            collect=["spectrum"],
        )
        sums = [
            SumSpec(key="m", tensor="m", group=group),
            SumSpec(key="q", tensor="q", group=group),
        ]
        return fed.call("estep", ids=rows, sums=sums)

    estep(d1, PARTIES)
    with pytest.raises(PolicyRefusal, match="differencing"):
        estep(d2, ("a", "b"))
