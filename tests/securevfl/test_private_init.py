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
from securevfl.config import ConfigError, parse_config
from securevfl.data.table import load_party_table, role_data_path
from securevfl.direct import DirectFederation
from securevfl.methods import method_names, method_spec
from securevfl.methods.blocks.nets import derived_seed, mlp
from securevfl.roles import protocol as P
from tests.securevfl.conftest import permissive_policy
from tests.securevfl.fixed_seeds import fixed_seeds
from tests.securevfl.test_hostile_roles import PARTIES, Attacker, everything

WIDTH = 6  # the columns of all three parties together


def linear_encoders(raw: dict, *, shared: bool) -> None:
    raw["model"] = {"hidden": [], "width": WIDTH}
    if shared:
        raw["run"]["shared_init"] = True
        raw["policy"]["config_seeds"] = True  # which each party must accept


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


@pytest.mark.multiprocess
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


# methods whose passive parties hold no weights drawn at random (a linear model that starts at
# zero, as VFEM and the OLS family do: the README's residual risks)
NO_RANDOM_MODEL = {"vfem", "cc-ols", "impute-ols", "single-ols", "ridge"}
RANDOM_MODEL = [n for n in method_names() if n not in NO_RANDOM_MODEL]


def party_draws(fed: DirectFederation) -> dict[tuple[str, str], np.ndarray]:
    """Every passive party's weights and generator states after set-up: (party, name) -> values."""
    import torch

    out = {}
    for party, method in fed.party_methods.items():
        for attr, value in vars(method).items():
            modules = value.values() if isinstance(value, dict) else [value]
            for i, module in enumerate(modules):
                if not isinstance(module, torch.nn.Module):
                    continue
                for name, t in module.state_dict().items():
                    out[(party, f"{attr}.{i}.{name}")] = t.detach().double().numpy().copy()
                for sub_name, sub in module.named_modules():
                    for k, v in vars(sub).items():
                        if isinstance(v, torch.Generator):
                            key = (party, f"{attr}.{i}.{sub_name}.{k}")
                            out[key] = v.get_state().numpy().copy()
    return out


def set_up(name: str, directory, *, shared: bool) -> dict:
    directory.mkdir(parents=True)
    raw = method_spec(name).example(directory)
    raw["run"].update(aggregation="plain", min_group=1, transport="inproc")
    if shared:
        fixed_seeds(raw)  # [run] shared_init, and TabVFL's [method] guest_seed
    cfg = parse_config(permissive_policy(raw), source=directory / "config.toml")
    return party_draws(DirectFederation(cfg, run_dir=directory / "run", record=False))


@pytest.mark.parametrize("name", RANDOM_MODEL)
def test_every_party_of_every_method_draws_its_own_model(tmp_path, name):
    """Two set-ups of one config: every party's weights (and noise generators) differ, tensor by
    tensor, wherever they are random at all; with the config's seeds (`fixed_seeds`) they are
    equal, bit for bit (so the comparison would see a party still drawing from the config)."""
    first = set_up(name, tmp_path / "a", shared=False)
    again = set_up(name, tmp_path / "b", shared=False)
    assert first and first.keys() == again.keys()
    drawn = [k for k, v in first.items() if v.size > 1 and np.ptp(v) > 0]  # not all one value
    assert {party for party, _ in drawn} == {party for party, _ in first}, "a party draws nothing"
    same = [k for k in drawn if np.array_equal(first[k], again[k])]
    assert not same, f"drawn from the config: {same}"
    shared = set_up(name, tmp_path / "c", shared=True)
    shared_again = set_up(name, tmp_path / "d", shared=True)
    assert all(np.array_equal(shared[k], shared_again[k]) for k in drawn)


SEEDED = {
    "shared_init": lambda raw: raw["run"].update(shared_init=True),
    "noise_seed": lambda raw: (
        raw.setdefault("privacy", {}).update(noise_seed=5),
        raw["parties"]["p1"].update(embedding_dp={"noise_multiplier": 1.0, "clip": 1.0}),
    ),
    "guest_seed": lambda raw: (
        raw["run"].update(method="tabvfl", aggregation="plain"),
        raw["policy"].update(aggregations=["plain"], clear_releases=["*.*"]),
        raw.setdefault("method", {}).update(guest_seed=1),
    ),
}


@pytest.mark.parametrize("setting", sorted(SEEDED))
def test_a_party_s_policy_refuses_what_it_would_draw_from_the_config(tmp_path, setting):
    """A party accepts a run that has it draw from a seed in the config (its initial weights,
    its embedding-DP noise, a TabVFL guest's model) only if its own policy says
    `config_seeds = true`: the config is every role's, so such draws protect nothing."""
    from tests.securevfl.conftest import synthetic_csv

    synthetic_csv(tmp_path / "data.csv", n=60)
    raw = {
        "run": {"method": "splitnn", "aggregation": "mask", "seed": 0},
        "data": {"path": "data.csv", "test_fraction": 0.25},
        "active": {"columns": []},
        "parties": {"p1": {"columns": ["X1", "X2"]}, "p2": {"columns": ["X3", "X4"]}},
        "policy": {},
    }
    SEEDED[setting](raw)
    with pytest.raises(ConfigError) as refused:
        parse_config(raw, source=tmp_path / "config.toml")
    assert "config_seeds" in str(refused.value) and setting in str(refused.value)
    assert "[parties.p1.policy] config_seeds" in str(refused.value)
    raw["policy"]["config_seeds"] = True
    cfg = parse_config(raw, source=tmp_path / "config.toml")
    assert cfg.party("p1").policy.config_seeds
