"""Messages that no honest role sends, met by the real role code from the attacker's side:
a passive party's end-of-run stats (the aggregator takes its own entry only, plain bounded
JSON only), a modified aggregator's WELCOME (the role's handshake) and RESULT (the active
party's `ActiveRound._settle`). Each is refused with a clear `RunAborted` or dropped with one
logged warning, never a bare exception, and the run's metrics survive."""

from __future__ import annotations

import copy
import io
import json
import logging
import secrets

import numpy as np
import pytest

from securevfl.config import parse_config
from securevfl.direct import DirectFederation
from securevfl.errors import RunAborted
from securevfl.inproc import run_federation
from securevfl.methods import SumSpec
from securevfl.roles import protocol as P
from securevfl.roles.aggregator import Aggregator
from securevfl.roles.connection import RoleConnection
from securevfl.roles.protocol import STATS_MAX_STRING, STATS_MAX_VALUES
from tests.securevfl.conftest import BASE_RAW, permissive_policy, synthetic_csv
from transport import Envelope, ReceiveTimeout

PARTIES = ("alpha", "beta", "gamma")
HONEST = {"pid": 7, "host": "h", "cpus": [0, 1], "bytes_sent": 10, "gc": {"enabled": True}}


def config(tmp_path):
    return parse_config(permissive_policy(copy.deepcopy(BASE_RAW)), source=tmp_path / "c.toml")


# ------------------------------------------------------------------ a party's end-of-run stats


class ScriptedHub:
    """Just what `Aggregator` calls; `script` is the messages it receives, in order."""

    def __init__(self, script):
        self.script = list(script)
        self.sent: list[tuple[str, Envelope]] = []
        self.session = None
        self.bytes_sent = self.bytes_received = self.rejected = 0

    def recv(self, *, timeout):
        if not self.script:
            raise ReceiveTimeout("script exhausted")
        return self.script.pop(0)

    def send(self, to, env):
        self.sent.append((to, env))

    def connected(self):
        return {"active", *PARTIES}

    def forget(self, name):
        pass

    def queued(self):
        return []


def finish(tmp_path, caplog, *replies):
    """Run the aggregator through the handshake and the active party's bye, the parties
    answering with `replies`; the stats it sends the active party, and its warnings."""
    hellos = [
        Envelope(kind=P.HELLO, sender=r, meta={"nonce": secrets.token_hex(16)})
        for r in ("active", *PARTIES)
    ]
    bye = Envelope(kind=P.BYE, sender="active", round=1)
    hub = ScriptedHub([*hellos, bye, *replies])
    logger = logging.getLogger("test.hostile.aggregator")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        code = Aggregator(cfg=config(tmp_path), hub=hub, logger=logger).run()
    assert code == P.EXIT_OK
    assert not hub.script, "the aggregator stopped reading before every party's stats came"
    final = [e for to, e in hub.sent if to == "active" and e.kind == P.STATS][-1].meta["stats"]
    json.dumps(final, allow_nan=False)  # metrics.json can always be written
    warnings = [r.getMessage() for r in caplog.records if r.name == logger.name]
    return final, warnings


def stats_from(party, stats):
    return Envelope(kind=P.STATS, sender=party, meta={"stats": stats})


def honest(party):
    return stats_from(party, {party: dict(HONEST)})


@pytest.mark.parametrize("stats", [["x"], 7, "ab", None, {"alpha": ["x"]}])
def test_malformed_stats_are_dropped_with_one_warning_and_the_run_ends_well(
    tmp_path, caplog, stats
):
    final, warnings = finish(
        tmp_path, caplog, stats_from("alpha", stats), *map(honest, PARTIES[1:])
    )
    assert final["alpha"] == {}
    assert final["beta"] == final["gamma"] == HONEST
    assert len(warnings) == 1 and "stats alpha sent" in warnings[0]


def test_a_party_cannot_speak_for_another_party(tmp_path, caplog):
    forged = {
        "alpha": {"bytes_sent": 1},
        "beta": {"lost": True, "bytes_sent": 0},
        "gamma": {"lost": True, "bytes_sent": 0},
        "aggregator": {"rejected_messages": 0},
    }
    final, warnings = finish(
        tmp_path, caplog, stats_from("alpha", forged), *map(honest, PARTIES[1:])
    )
    # the aggregator waited for beta and gamma and forwarded their own stats, and its own
    assert final["alpha"] == {"bytes_sent": 1}
    assert final["beta"] == final["gamma"] == HONEST
    assert final["aggregator"]["pid"] != 0 and "rejected_messages" in final["aggregator"]
    assert len(warnings) == 1
    assert "alpha" in warnings[0] and "other roles ('beta', 'gamma', 'aggregator')" in warnings[0]


def test_a_second_stats_message_cannot_replace_the_first(tmp_path, caplog):
    final, _ = finish(
        tmp_path,
        caplog,
        honest("alpha"),
        stats_from("alpha", {"alpha": {"bytes_sent": 0}}),
        *map(honest, PARTIES[1:]),
    )
    assert final["alpha"] == HONEST


def test_only_plain_bounded_json_data_is_kept(tmp_path, caplog):
    deep: dict = {"v": 1}
    for _ in range(5):
        deep = {"d": deep}
    entry = {
        **HONEST,
        "note": b"\x00",
        "nan": float("nan"),
        "huge": 2**70,
        "long": "x" * (STATS_MAX_STRING + 1),
        "deep": deep,
        "keys": {1: "int key"},
        "set": {1, 2},
        "many": list(range(STATS_MAX_VALUES + 1)),
        "fine": {"nested": [1, 2.5, None, True, "ok"]},
    }
    final, warnings = finish(
        tmp_path, caplog, stats_from("alpha", {"alpha": entry}), *map(honest, PARTIES[1:])
    )
    assert final["alpha"] == {**HONEST, "fine": {"nested": [1, 2.5, None, True, "ok"]}}
    assert len(warnings) == 1
    line = warnings[0]
    assert "'note' (a bytes value)" in line and "'nan' (a non-finite number" in line
    assert "plain JSON data only" in line and line.isascii() and line.isprintable()


def test_a_bytes_value_in_a_partys_stats_cannot_cost_the_run_its_metrics(tmp_path, monkeypatch):
    synthetic_csv(tmp_path / "data.csv", n=200)
    raw = permissive_policy(copy.deepcopy(BASE_RAW))
    raw["run"]["transport"] = "inproc"
    raw["train"]["epochs"] = 1
    cfg = parse_config(raw, source=tmp_path / "config.toml")
    real_stats = RoleConnection.stats

    def stats(self):  # the modified party: only alpha lies
        out = real_stats(self)
        if self.name == "alpha":
            out["note"] = b"\x00"  # plain msgpack data: the transport accepts it
        return out

    monkeypatch.setattr(RoleConnection, "stats", stats)
    status, _ = run_federation(cfg, out=tmp_path / "run", stdout=io.StringIO())
    assert status == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    alpha = metrics["roles"]["alpha"]
    assert "note" not in alpha and alpha["bytes_sent"] > 0
    log = (tmp_path / "run" / "logs" / "aggregator.log").read_text()
    assert "dropped from the stats alpha sent: the field 'note' (a bytes value)" in log


# ------------------------------------------------------------------ the aggregator's welcome


NONCE = "ab" * 16


class WelcomingPeer:
    """Just what `RoleConnection.handshake` calls: it answers the hello with `welcome`."""

    def __init__(self, welcome):
        self.welcome = welcome
        self.session = None
        self.endpoint = "inproc://fake"

    def waiting(self):
        return False

    def send(self, env):
        pass

    def recv(self, *, timeout):
        return self.welcome


def handshake(tmp_path, meta):
    welcome = Envelope(kind=P.WELCOME, sender="aggregator", meta=meta)
    conn = RoleConnection(
        cfg=config(tmp_path),
        name="alpha",
        peer=WelcomingPeer(welcome),
        secrets=None,
        public=None,
        logger=logging.getLogger("test.hostile.welcome"),
        nonce=NONCE,
    )
    return conn.handshake()


MALFORMED_WELCOMES = {
    "nonces is a list": ({"nonces": [NONCE], "session": "00"}, "'nonces' is of type list"),
    "a nonce not hex": (
        {"nonces": {"alpha": NONCE, "beta": "zz"}, "session": "00"},
        "the nonce of role 'beta' is 'zz', not 32 hex digits",
    ),
    "a nonce an int": (
        {"nonces": {"alpha": NONCE, "beta": 5}, "session": "00"},
        "the nonce of role 'beta' is 5",
    ),
    "32 characters, not hex": (
        {"nonces": {"alpha": NONCE, "beta": "z" * 32}, "session": "00"},
        "not 32 hex digits",
    ),
    "a role not a name": ({"nonces": {"alpha": NONCE, 3: NONCE}, "session": "00"}, "the key 3"),
    "session an int": ({"nonces": {"alpha": NONCE}, "session": 5}, "'session' is of type int"),
}


@pytest.mark.parametrize("case", list(MALFORMED_WELCOMES))
def test_a_malformed_welcome_is_a_clear_refusal(tmp_path, case):
    meta, named = MALFORMED_WELCOMES[case]
    with pytest.raises(RunAborted, match="the aggregator's welcome is malformed") as info:
        handshake(tmp_path, meta)
    assert named in str(info.value)
    # the check refuses nothing an honest aggregator sends
    nonces = {"alpha": NONCE, "beta": "cd" * 16}
    session = P.session_id(nonces)
    assert handshake(tmp_path, {"nonces": nonces, "session": session}) == bytes.fromhex(session)


# ------------------------------------------------------------------ the aggregator's result


GROUP = ("alpha", "beta", "gamma")


class TamperingAggregator(DirectFederation):
    """The direct federation, with the aggregator's RESULT of each forward passed through
    `tamper` before the active party settles it."""

    tamper = None

    def _exchange(self, env):
        result = super()._exchange(env)
        if self.tamper is not None and env.meta.get("op") == "forward":
            self.tamper(result)
        return result


@pytest.fixture
def federation(tmp_path):
    synthetic_csv(tmp_path / "data.csv", n=120)
    return TamperingAggregator(config(tmp_path), run_dir=tmp_path / "run")


def forward(f):
    sums = [SumSpec(key="rep", tensor="rep", group=GROUP)]
    return f.call("forward", ids=f.train_ids[:8], args={"train": False}, sums=sums)["rep"]


def setter(field, value):
    return lambda r: r.meta.__setitem__(field, value)


TAMPERED_RESULTS = {
    "no shapes": (lambda r: r.meta.pop("shapes"), "carries no 'shapes'"),
    "shapes a list": (setter("shapes", [[8, 4]]), "'shapes' is [[8, 4]]"),
    "a shape an int": (setter("shapes", {"rep": 32}), "shape of sum 'rep' is 32"),
    "a shape of -1": (setter("shapes", {"rep": [-1]}), "shape of sum 'rep' is [-1]"),
    "a shape with -1": (setter("shapes", {"rep": [-1, 4]}), "is [-1, 4]"),
    "a shape of floats": (setter("shapes", {"rep": [8.0, 4]}), "is [8.0, 4]"),
    "a shape of bools": (setter("shapes", {"rep": [True, 32]}), "is [True, 32]"),
    "the wrong size": (setter("shapes", {"rep": [5, 5]}), "32 values but its shape [5, 5]"),
    "no shape for the sum": (setter("shapes", {}), "shape of sum 'rep' is None"),
    "lost an int": (setter("lost", 7), "'lost' is 7, not a list of roles"),
    "lost not names": (setter("lost", [7]), "'lost' is [7]"),
    "late a string": (setter("late", "beta"), "'late' is 'beta'"),
    "no sum tensor": (lambda r: r.tensors.clear(), "no tensor for sum 'rep'"),
    "the sum split in two": (
        lambda r: r.tensors.update({"rep/0": r.tensors["rep"]}),
        "sent tensors ['rep', 'rep/0']",
    ),
    "the sum not ring elements": (
        lambda r: r.tensors.update(rep=r.tensors["rep"].astype(np.float64)),
        "uint64",
    ),
}


@pytest.mark.parametrize("case", list(TAMPERED_RESULTS))
def test_a_tampered_result_is_a_clear_refusal(federation, case):
    tamper, named = TAMPERED_RESULTS[case]
    assert forward(federation).shape == (8, 4)  # the check refuses no honest result
    federation.tamper = tamper
    with pytest.raises(RunAborted, match="the aggregator sent a malformed result for forward"):
        try:
            forward(federation)
        except RunAborted as exc:
            assert named in str(exc)
            raise


def test_the_active_party_keeps_only_plain_stats_of_known_roles_from_the_aggregator(caplog):
    """A modified aggregator's final stats cannot break the active party's metrics.json: only
    the federation's roles are kept, and of each only plain JSON data within the bounds."""
    import json
    import logging

    from securevfl.roles.active import relayed_stats

    logger = logging.getLogger("test.active")
    meta = {
        "stats": {
            "alpha": {"rounds": 3, "blob": b"\x00"},
            "beta": {"lost": True},
            "mallory": {"rounds": 1},
            "aggregator": {"seconds": float("nan"), "rounds": 9},
        }
    }
    with caplog.at_level(logging.WARNING, logger="test.active"):
        kept = relayed_stats(meta, roles=("alpha", "beta", "gamma", "aggregator"), logger=logger)
    assert kept == {"alpha": {"rounds": 3}, "beta": {"lost": True}, "aggregator": {"rounds": 9}}
    json.dumps(kept, allow_nan=False)
    assert any("alpha" in r.message and "blob" in r.message for r in caplog.records)
    assert relayed_stats({"stats": ["x"]}, roles=("alpha",), logger=logger) == {}
    assert relayed_stats({}, roles=("alpha",), logger=logger) == {}
