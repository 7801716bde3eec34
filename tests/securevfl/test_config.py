"""Config validation: every bad value is refused before anything starts, naming the key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from securevfl.config import ConfigError, dump_toml, load_config, parse_config

BASE = {
    "run": {"method": "splitnn", "aggregation": "mask", "seed": 0},
    "data": {"path": "data.csv", "id": "ID", "label": "Y", "task": "binary"},
    "active": {"columns": []},
    "parties": {"a": {"columns": ["X1", "X2"]}, "b": {"columns": ["X3"]}},
    "train": {"epochs": 2, "batch_size": 16, "lr": 0.01},
}


def cfg_with(**changes):
    raw = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        section, _, key = dotted.partition("__")
        if value is None:
            raw[section].pop(key, None)
        else:
            raw.setdefault(section, {})[key] = value
    return raw


def test_valid_config_parses_with_defaults():
    cfg = parse_config(BASE, source=Path("/tmp/x/config.toml"))
    assert cfg.method == "splitnn" and cfg.aggregation == "mask"
    assert cfg.party_names == ("a", "b")
    assert cfg.role_names == ("active", "a", "b")
    assert cfg.data_path == Path("/tmp/x/data.csv")
    # split-NN declares its representation sums' encoding (16 bits after the point, |x| <=
    # 4096: the 32-bit ring); the config's own default is 20 bits and 2^20
    assert cfg.min_group == 2 and (cfg.frac_bits, cfg.bound) == (16, 4096.0)


@pytest.mark.parametrize(
    ("changes", "key", "words"),
    [
        ({"run__method": "magic"}, "[run] method", "unknown value 'magic'"),
        ({"run__aggregation": "paillier"}, "[run] aggregation", "choose one of plain, mask, ckks"),
        ({"train__epochs": "ten"}, "[train] epochs", "must be an integer"),
        ({"train__epochs": 0}, "[train] epochs", "must be >= 1"),
        ({"train__lr": -1}, "[train] lr", "must be > 0"),
        ({"data__task": "ranking"}, "[data] task", "unknown value"),
        ({"data__test_fraction": 1.5}, "[data] test_fraction", "must be <= 0.9"),
        ({"data__path": None}, "[data] path", "is required"),
        ({"train__bogus": 1}, "[train] bogus", "unknown key"),
        ({"run__min_group": 3}, "[run] min_group", "at least 3 passive contributors"),
        ({"secure__frac_bits": 40, "secure__bound": 1e6}, "[secure] bound", "headroom"),
    ],
)
def test_bad_values_name_the_key(changes, key, words):
    with pytest.raises(ConfigError) as info:
        parse_config(cfg_with(**changes))
    assert info.value.key == key
    assert words in str(info.value)


def test_column_owned_twice_is_refused():
    raw = cfg_with()
    raw["parties"]["b"]["columns"] = ["X1"]
    with pytest.raises(ConfigError, match="already held by 'a'"):
        parse_config(raw)


def test_reserved_and_malformed_role_names():
    raw = cfg_with()
    raw["parties"]["aggregator"] = {"columns": ["X9"]}
    with pytest.raises(ConfigError, match="reserved"):
        parse_config(raw)
    raw = cfg_with()
    raw["parties"]["Bad Name"] = {"columns": ["X9"]}
    with pytest.raises(ConfigError, match="lower-case"):
        parse_config(raw)


def test_ckks_with_aggregator_in_active_is_refused_with_the_reason():
    with pytest.raises(ConfigError) as info:
        parse_config(cfg_with(run__aggregation="ckks", network__aggregator_in_active=True))
    assert info.value.key == "[network] aggregator_in_active"
    assert "sees every individual ciphertext" in str(info.value)


def test_dp_tables_validated():
    with pytest.raises(ConfigError, match="noise_multiplier"):
        parse_config(cfg_with(privacy__label_dp={"noise_multiplier": 0, "clip": 1.0}))
    with pytest.raises(ConfigError, match="clip"):
        parse_config(cfg_with(privacy__label_dp={"noise_multiplier": 1.0, "clip": -1}))
    with pytest.raises(ConfigError, match="exactly one"):
        parse_config(cfg_with(privacy__label_dp={"clip": 1.0}))
    cfg = parse_config(cfg_with(privacy__label_dp={"target_epsilon": 2.0, "clip": 1.0}))
    assert cfg.label_dp.target_epsilon == 2.0


def test_missingness_spec_validated():
    cfg = parse_config(cfg_with(missing__train={"kind": "mcar", "p": 0.5}))
    assert cfg.missing_train.kind == "mcar" and cfg.missing_train.get("p") == 0.5
    with pytest.raises(ConfigError, match="unknown kind"):
        parse_config(cfg_with(missing__train={"kind": "weird"}))
    with pytest.raises(ConfigError, match="must be < 1"):
        parse_config(cfg_with(missing__train={"kind": "mcar", "p": 1.0}))


def test_load_config_reports_toml_syntax_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nmethod = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_overrides_replace_file_values(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[run]\naggregation = "mask"\n[data]\npath = "d.csv"\n'
        '[parties.a]\ncolumns = ["X1"]\n[parties.b]\ncolumns = ["X2"]\n'
    )
    plain = {"run.aggregation": "plain", "policy.aggregations": ["plain"]}
    assert load_config(path, overrides=plain).aggregation == "plain"
    with pytest.raises(ConfigError, match=r"\[parties.a.policy\] aggregations"):
        load_config(path, overrides={"run.aggregation": "plain"})  # the parties never agreed


def test_a_party_policy_that_does_not_list_the_method_refuses_the_run(tmp_path):
    """[parties.NAME.policy] methods: a party that accepts only some methods refuses a run of
    another, naming its key and how to agree; a method it lists is accepted."""
    path = tmp_path / "c.toml"
    path.write_text(
        '[run]\nmethod = "splitnn"\naggregation = "mask"\n[data]\npath = "d.csv"\n'
        '[parties.a]\ncolumns = ["X1"]\n[parties.a.policy]\nmethods = ["laser"]\n'
        '[parties.b]\ncolumns = ["X2"]\n'
    )
    with pytest.raises(ConfigError, match=r"\[parties.a.policy\] methods") as info:
        load_config(path)
    assert "accepts methods ['laser'], not 'splitnn'" in str(info.value)
    assert "securevfl methods splitnn" in str(info.value)
    assert load_config(path, overrides={"run.method": "laser"}).method == "laser"


def test_dump_toml_reads_back_as_the_same_dict():
    import tomllib

    raw = {
        "run": {"name": 'q"uote\\d \u00e9', "epochs": 3, "lr": 1e-05, "flag": False},
        "data": {"columns": ["a", "b"], "weights": (1.5, 2)},
        "parties": {
            "bank": {"data": "bank.csv", "policy": {"max_epsilon": 2.0, "ops": ["forward"]}},
            "bureau": {"data": "bureau.csv"},
        },
    }
    back = tomllib.loads(dump_toml(raw))
    raw["data"]["weights"] = [1.5, 2]
    assert back == raw
