"""Bad configs never crash: any document (mutated TOML bytes, or any structure of tables, lists
and scalars where the schema expects something else) ends in a `ConfigError` naming the key, or
a valid config. The long run is bench/fuzz_config.py."""

from __future__ import annotations

import copy
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from securevfl.config import load_config, parse_config
from securevfl.errors import ConfigError
from tests.securevfl.conftest import BASE_RAW, permissive_policy, write_toml

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=8).map(lambda b: b.decode("latin-1")),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


def paths(raw, prefix=()):
    for k, v in raw.items():
        yield (*prefix, k)
        if isinstance(v, dict):
            yield from paths(v, (*prefix, k))


BASE = permissive_policy(copy.deepcopy(BASE_RAW))
PATHS = list(paths(BASE)) + [("run",), ("policy",), ("parties",), ("method",), ("extra",)]


def accept_or_config_error(raw, source=Path("/tmp/fuzz/config.toml")):
    try:
        parse_config(raw, source=source)
    except ConfigError as exc:
        assert str(exc) and exc.key


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(where=st.sampled_from(PATHS), value=VALUES)
def test_any_value_anywhere_is_a_config_error_or_valid(where, value):
    raw = copy.deepcopy(BASE)
    node = raw
    for key in where[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[where[-1]] = value
    accept_or_config_error(raw)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_toml_bytes_are_a_config_error_or_valid(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("fuzz")
    text = write_toml(copy.deepcopy(BASE), d / "config.toml").read_bytes()
    pos = data.draw(st.integers(min_value=0, max_value=len(text) - 1))
    action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
    blob = data.draw(st.binary(min_size=1, max_size=6))
    if action == "flip":
        text = text[:pos] + bytes([text[pos] ^ blob[0]]) + text[pos + 1 :]
    elif action == "cut":
        text = text[:pos]
    else:
        text = text[:pos] + blob + text[pos:]
    (d / "config.toml").write_bytes(text)
    try:
        load_config(d / "config.toml")
    except ConfigError as exc:
        assert exc.key


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(key=st.text(max_size=20), value=VALUES)
def test_set_overrides_are_a_config_error_or_valid(tmp_path_factory, key, value):
    d = tmp_path_factory.mktemp("set")
    path = write_toml(copy.deepcopy(BASE), d / "config.toml")
    try:
        load_config(path, overrides={key: value})
    except ConfigError as exc:
        assert exc.key
