"""The party protects itself, tested from the attacker's side: three real `securevfl party`
processes (CURVE over loopback TCP) face a test that plays a modified aggregator and a modified
active party. The active party holds its real keys (it is a curious member of the federation);
the aggregator holds only its own. Every attack is refused with a named rule in the party's log
and ledger, the attacker receives no contribution for it, and honest calls are still served.

The parties run with ``on_refusal = "skip"`` so one set of processes meets every attack; the
default ("stop") is tested at the end.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from securevfl.config import load_config
from securevfl.data.table import role_data_path, split_federation
from securevfl.keys import generate_keys, load_public, load_secrets
from securevfl.methods import SumSpec
from securevfl.roles import protocol as P
from securevfl.roles.guard import auth_key, call_tags, run_terms
from securevfl.roles.rounds import Call
from securevfl.secure_sum import ckks_context_tag, ckks_params
from tests.securevfl.conftest import synthetic_csv, write_toml
from transport import Allowlist, Envelope, Hub, ReceiveTimeout

pytestmark = pytest.mark.multiprocess

PARTIES = ("p1", "p2", "p3")


def federation_raw(on_refusal: str = "skip") -> dict:
    return {
        "run": {"method": "splitnn", "aggregation": "mask", "seed": 0},
        "data": {"path": "data.csv", "test_fraction": 0.25},
        "active": {"columns": []},
        "parties": {
            "p1": {"columns": ["X1", "X2"]},
            "p2": {"columns": ["X3", "X4"]},
            "p3": {"columns": ["X5", "X6"]},
        },
        "train": {"epochs": 1, "batch_size": 32},
        "model": {"hidden": [8], "width": 4},
        "network": {"heartbeat_interval": 0.3, "peer_timeout": 20.0, "round_timeout": 60.0},
        "policy": {"on_refusal": on_refusal},
    }


class Attacker:
    """A modified aggregator (the hub every party connects to) that can also speak for a
    modified active party (with the active party's real masking key)."""

    def __init__(
        self,
        root: Path,
        on_refusal: str = "skip",
        *,
        again: bool = False,
        welcome=None,
        edit=None,
        score: bool = False,
        party_data=None,
    ) -> None:
        """`again`: a new session of the federation set up in `root` before (same data, keys
        and run directory: the parties' own disks); `welcome(party, meta)`: the WELCOME meta a
        modified aggregator sends that party instead; `edit(raw)`: changes the federation's
        config (every role's) before it is written; `score`: the parties are started to score
        rows with their trained models (`--score`, as `securevfl predict` starts them), from
        `party_data` (party -> file; default: their training files)."""
        if not again:
            synthetic_csv(root / "data.csv", n=200)
        raw = federation_raw(on_refusal)
        if edit is not None:
            edit(raw)
        config = write_toml(raw, root / "config.toml", strict=True)
        self.cfg = load_config(config)
        self.run_dir = root / "run"
        keys = self.keys_dir = root / "keys"
        if not again:
            split_federation(self.cfg, self.run_dir)
            generate_keys(self.cfg.role_names, keys)
        public = load_public(keys)
        agg = load_secrets(keys, "aggregator")
        self.active = load_secrets(keys, "active")
        self.hub = Hub(
            name="aggregator",
            bind="tcp://127.0.0.1:*",
            keypair=agg.curve,
            allowlist=Allowlist({r: public.curve_public(r) for r in self.cfg.role_names}),
            kinds=P.KINDS,
            heartbeat_interval=0.3,
            peer_timeout=20.0,
        )
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.procs = {
            p: subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "securevfl",
                    "party",
                    "--config",
                    str(config),
                    "--name",
                    p,
                    "--out",
                    str(self.run_dir),
                    "--keys",
                    str(keys),
                    "--data",
                    str((party_data or {}).get(p, role_data_path(self.run_dir, p))),
                    "--address",
                    self.hub.endpoint,
                    *(["--score"] if score else []),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for p in PARTIES
        }
        nonces = {"active": secrets.token_hex(16)}
        deadline = time.monotonic() + 90
        while len(nonces) < 1 + len(PARTIES):
            assert time.monotonic() < deadline, "parties did not join"
            try:
                hello = self.hub.recv(timeout=1.0)
            except ReceiveTimeout:
                continue
            nonces[hello.sender] = hello.meta["nonce"]
        session = P.session_id(nonces)
        self.hub.session = session
        self.session = bytes.fromhex(session)
        for p in PARTIES:
            meta = {"session": session, "nonces": dict(nonces)}
            self.hub.send(
                p,
                Envelope(
                    kind=P.WELCOME,
                    sender="aggregator",
                    session=session,
                    meta=meta if welcome is None else welcome(p, meta),
                ),
            )
        self.keys = {
            p: auth_key(
                keypair=self.active.mask,
                me="active",
                peer=p,
                peer_public=public.mask[p],
                session=self.session,
            )
            for p in PARTIES
        }
        self.round = 0
        self.ids = np.arange(1, 201, dtype=np.int64)

    def call(
        self,
        op,
        *,
        ids=None,
        sums=(),
        to=PARTIES,
        args=None,
        inputs=None,
        collect=(),
        tamper=None,
        sign=True,
        round=None,
        kept=None,
    ):
        """Sign a call as the active party would (unless `sign` is False), let `tamper` change
        the envelope as a modified aggregator would, send it, and return each party's reply
        (`kept`: a list the sent envelope is appended to, as an aggregator keeps one to replay
        later)."""
        self.round = self.round + 1 if round is None else round
        call = Call(
            op=op,
            round=self.round,
            session=self.session.hex(),
            ids=self.ids[:40] if ids is None else ids,
            args=dict(args or {}),
            inputs=dict(inputs or {}),
            sums=tuple(sums),
            to=tuple(to),
            collect=tuple(collect),
        )
        env = call.envelope(sender="aggregator")
        if sign:
            env.meta["auth"] = call_tags(
                env.meta, session=self.session, round=env.round, tensors=env.tensors, keys=self.keys
            )
        if tamper is not None:
            tamper(env)
        if kept is not None:
            kept.append(env)
        return self.send(env, to)

    def send(self, env, to):
        for p in to:
            self.hub.send(p, env)
        replies = {}
        deadline = time.monotonic() + 60
        while len(replies) < len(to):
            assert time.monotonic() < deadline, f"no answer from {set(to) - set(replies)}"
            if all(self.procs[p].poll() is not None for p in set(to) - set(replies)):
                break  # the others stopped instead of answering (their exit says why)
            try:
                reply = self.hub.recv(timeout=1.0)
            except ReceiveTimeout:
                continue
            if reply.round == env.round:
                replies[reply.sender] = reply
        return replies

    def setup(self, *, args=None, inputs=None, tamper=None):
        """The active party's set-up call (`args`, `inputs`: added to or replacing its own;
        `tamper`: as in `call`)."""
        return self.call(
            "setup",
            ids=np.empty(0, dtype=np.int64),
            args={"run": run_terms(self.cfg), **(args or {})},
            inputs={"train_ids": self.ids, "all_ids": self.ids, **(inputs or {})},
            collect=("present",),
            tamper=tamper,
        )

    def ckks_setup(self, context: bytes):
        """The args and inputs by which the active party (the key holder) hands each party the
        public `context`, with its end-to-end tag for that party."""
        public = load_public(self.keys_dir)
        tags = {
            p: ckks_context_tag(
                context=context,
                my_keypair=self.active.mask,
                me="active",
                peer=p,
                peer_public=public.mask[p],
                session=self.session,
            ).hex()
            for p in PARTIES
        }
        return {"ckks_tags": tags}, {"ckks_context": np.frombuffer(context, dtype=np.uint8)}

    def close(self):
        for p in PARTIES:
            if self.procs[p].poll() is None:
                try:
                    self.hub.send(
                        p,
                        Envelope(
                            kind=P.BYE,
                            sender="aggregator",
                            session=self.hub.session,
                            round=self.round + 1,
                        ),
                    )
                except Exception:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.hub.close()


@pytest.fixture(scope="module")
def attacker(tmp_path_factory):
    a = Attacker(tmp_path_factory.mktemp("hostile"))
    try:
        replies = a.setup()
        assert all(r.kind == P.CONTRIB for r in replies.values()), replies
        yield a
    finally:
        a.close()


def refused(replies, rule, parties=PARTIES):
    for p in parties:
        r = replies[p]
        assert r.kind == P.REFUSED, f"{p} answered {r.kind} with {sorted(r.tensors)}"
        assert not r.tensors, "a refusal carries nothing"
        assert r.meta["rule"] == rule, r.meta


def everything(sums):
    return [SumSpec(key="S", tensor="rep", group=PARTIES), *sums]


def test_asking_for_a_representation_in_the_clear_is_refused(attacker):
    replies = attacker.call("forward", args={"train": False}, collect=("rep",), sums=everything([]))
    refused(replies, "clear release")


def test_overlapping_groups_in_one_call_are_refused(attacker):
    """{p1,p2,p3} and {p1,p2} over the same rows differ by p3's representation: p1 and p2
    refuse, and so does p3, which checks the call's {p1,p2} together with its own sum."""
    sums = everything([SumSpec(key="T", tensor="rep", group=("p1", "p2"))])
    replies = attacker.call("forward", args={"train": False}, sums=sums)
    refused(replies, "differencing")


def test_overlapping_groups_across_calls_of_one_model_version_are_refused(attacker):
    ids = attacker.ids[40:80]
    first = attacker.call("forward", ids=ids, args={"train": False}, sums=everything([]))
    assert all(r.kind == P.CONTRIB for r in first.values())
    second = attacker.call(
        "forward",
        ids=ids,
        args={"train": False},
        to=("p1", "p2"),
        sums=[SumSpec(key="S", tensor="rep", group=("p1", "p2"))],
    )
    refused(second, "differencing", parties=("p1", "p2"))


@pytest.mark.parametrize("member", ["active", "aggregator"])
def test_the_active_party_or_the_aggregator_is_no_group_member(attacker, member):
    replies = attacker.call(
        "forward",
        to=("p1",),
        args={"train": False},
        sums=[SumSpec(key="S", tensor="rep", group=("p1", member))],
    )
    refused(replies, "group", parties=("p1",))


def test_a_sum_over_one_party_is_refused(attacker):
    replies = attacker.call(
        "forward",
        to=("p1",),
        args={"train": False},
        sums=[SumSpec(key="S", tensor="rep", group=("p1",))],
    )
    refused(replies, "min_group", parties=("p1",))


def test_undeclared_operations_inputs_and_tensors_are_refused(attacker):
    refused(attacker.call("dump_table"), "undeclared operation")
    refused(attacker.call("backward", inputs={"labels": np.zeros(40)}), "undeclared input")
    sums = [SumSpec(key="S", tensor="raw_rows", group=PARTIES)]
    refused(attacker.call("forward", args={"train": False}, sums=sums), "undeclared sum")


def test_a_call_the_aggregator_rewrote_is_refused(attacker):
    def other_rows(env):
        env.tensors["ids"] = attacker.ids[100:140]

    def smaller_group(env):
        env.meta["sums"] = [["S", "rep", ["p1", "p2"]]]

    for tamper in (other_rows, smaller_group):
        replies = attacker.call(
            "forward", args={"train": False}, sums=everything([]), tamper=tamper
        )
        refused(replies, "authentication")


def test_invented_and_replayed_calls_are_refused(attacker):
    refused(
        attacker.call("forward", args={"train": False}, sums=everything([]), sign=False),
        "authentication",
    )
    honest = attacker.call(
        "forward", ids=attacker.ids[140:180], args={"train": False}, sums=everything([])
    )
    assert all(r.kind == P.CONTRIB for r in honest.values())
    replay = attacker.call(
        "forward",
        ids=attacker.ids[140:180],
        args={"train": False},
        sums=everything([]),
        round=attacker.round,
    )  # same round again
    refused(replay, "replay")

    # a new round number breaks the tag the active party computed for the old one
    def bump(env):
        env.round = attacker.round + 50

    refused(
        attacker.call(
            "forward",
            ids=attacker.ids[140:180],
            args={"train": False},
            sums=everything([]),
            tamper=bump,
        ),
        "authentication",
    )


def test_honest_calls_are_still_served_and_only_sums_are_revealed(attacker):
    replies = attacker.call(
        "forward", ids=attacker.ids[180:200], args={"train": False}, sums=everything([])
    )
    assert all(r.kind == P.CONTRIB for r in replies.values())
    # each contribution alone is uniformly random ring elements; their sum decodes
    from crypto import FixedPointEncoder

    total = sum(r.tensors["S"] for r in replies.values())  # uint64 wraps: ring addition
    values = FixedPointEncoder(frac_bits=20, bound=2.0**20).decode(total, terms=3)
    assert values.shape == (20, 4) and np.all(np.abs(values) < 100)


def test_pairwise_groups_of_one_call_that_isolate_a_party_are_refused(attacker):
    """{p1,p2}, {p1,p3}, {p2,p3}: no party is in all three, yet p3 = (S13 + S23 - S12) / 2.
    Each party checks the call's sums of a tensor together, those it is not in too."""
    sums = [
        SumSpec(key="A", tensor="rep", group=("p1", "p2")),
        SumSpec(key="B", tensor="rep", group=("p1", "p3")),
        SumSpec(key="C", tensor="rep", group=("p2", "p3")),
    ]
    replies = attacker.call("forward", ids=attacker.ids[80:100], args={"train": False}, sums=sums)
    refused(replies, "differencing")


def test_members_sent_different_calls_give_a_sum_that_opens_to_nothing(attacker):
    """A split view: each party gets its own signed call for one round (here p3 other rows
    than p1 and p2). Every guard admits its call, but each masked contribution is bound to
    the call its party was sent, so the sum is random ring elements, not p3's rows' values."""
    from crypto import FixedPointEncoder

    attacker.round += 1
    replies = {}
    for party, ids in zip(
        PARTIES, (attacker.ids[100:110],) * 2 + (attacker.ids[110:120],), strict=True
    ):
        env = Call(
            op="forward",
            round=attacker.round,
            session=attacker.session.hex(),
            ids=ids,
            args={"train": False},
            sums=tuple(everything([])),
            to=PARTIES,
        ).envelope(sender="aggregator")
        env.meta["auth"] = call_tags(
            env.meta,
            session=attacker.session,
            round=env.round,
            tensors=env.tensors,
            keys=attacker.keys,
        )
        replies.update(attacker.send(env, (party,)))
    assert all(r.kind == P.CONTRIB for r in replies.values())
    total = sum(r.tensors["S"] for r in replies.values())  # uint64 wraps: ring addition
    with pytest.raises(ValueError):
        FixedPointEncoder(frac_bits=20, bound=2.0**20).decode(total, terms=3)


def test_every_refusal_is_in_the_parties_logs_and_the_ledger(attacker):
    events = [json.loads(line) for line in (attacker.run_dir / "ledger.jsonl").open()]
    rules = {(e["role"], e["rule"]) for e in events if e["kind"] == "refusal"}
    for rule in (
        "clear release",
        "differencing",
        "group",
        "min_group",
        "undeclared operation",
        "authentication",
        "replay",
    ):
        assert ("p1", rule) in rules, rule
    log = (attacker.run_dir / "logs" / "p1.log").read_text()
    assert "refused round" in log and "differencing" in log and "authentication" in log
    assert not [e for e in events if e["kind"] == "unprotected"], "nothing left in the clear"
    from securevfl.privacy.audit import audit, format_report

    report = audit(attacker.run_dir / "ledger.jsonl")
    assert {("p1", "differencing"), ("p2", "authentication")} <= {
        (r["role"], r["rule"]) for r in report.refusals
    }
    text = format_report(report)
    assert "Calls refused by a party's release policy" in text and "differencing" in text


def test_a_party_stops_on_a_refusal_by_default(tmp_path):
    a = Attacker(tmp_path, on_refusal="stop")
    try:
        assert all(r.kind == P.CONTRIB for r in a.setup().values())
        for p in PARTIES:
            a.hub.send(
                p,
                Call(
                    op="forward",
                    round=a.round + 1,
                    session=a.session.hex(),
                    ids=a.ids[:10],
                    collect=("rep",),
                    to=PARTIES,
                ).envelope(sender="aggregator"),
            )
        codes = {p: a.procs[p].wait(timeout=60) for p in PARTIES}
        assert codes == dict.fromkeys(PARTIES, 5), codes  # exit 5: refused, nothing released
        for p in PARTIES:
            assert "authentication" in a.procs[p].stderr.read()
    finally:
        a.close()


def test_a_forged_loss_notice_makes_the_honest_active_party_isolate_nobody(tmp_path):
    """A modified aggregator tells the (honest) active party that p1 was lost after every party,
    p1 included, answered a training forward: it holds the sums of those rows over the full
    group. LASER-VFL must not sum those rows again over the survivors before they update (the
    difference would be p1's representation): it quarantines them, and the run ends without a
    single refusal from the parties' guards (which run in this path too)."""
    from securevfl.direct import DirectFederation
    from tests.securevfl.test_laser import block_config

    cfg = block_config(tmp_path, aggregation="mask", p_train=0.2, epochs=2, n=300)

    class ForgingAggregator(DirectFederation):
        forged_at = None

        def _exchange(self, env):
            result = super()._exchange(env)
            if env.meta.get("op") == "forward" and self.forged_at is None and env.round > 5:
                to = env.meta["to"]
                if "p1" in to and len(to) > 2:
                    self.forged_at = env.round
                    call = self.aggregator.open(env)
                    return self.aggregator.lost(call, ["p1"], delivered=True)
            return result

    fed = ForgingAggregator(cfg, run_dir=tmp_path / "run")
    metrics = fed.run()  # a PolicyRefusal from any party would raise here
    assert fed.forged_at is not None and fed.method.dead == ["p1"]
    later = [c for c in fed.calls if c[0] == "forward" and "p1" in c[1]]
    assert all(i <= fed.forged_at for i, c in enumerate(fed.calls, 1) if c in later)
    assert metrics["n_eval"] > 0


def test_a_checkpoint_of_an_epoch_the_run_never_reached_is_refused_and_deletes_nothing(attacker):
    """A checkpoint call names the epoch the file is saved as, and saving prunes all but the
    newest two: an epoch far ahead would stand as the newest and delete the real ones. Each
    party holds the number to its own state (not before its last commit, at most one epoch
    per call served since, plus one) before it touches a file."""
    from securevfl.roles.checkpoint import epochs

    none = np.empty(0, dtype=np.int64)
    first = attacker.call("checkpoint", ids=none, args={"epoch": 0})
    assert all(r.kind == P.CONTRIB for r in first.values()), first
    for hostile in (10**9, 2, -3, "1", 1.0, True, None):
        refused(attacker.call("checkpoint", ids=none, args={"epoch": hostile}), "checkpoint epoch")
    for p in PARTIES:
        assert epochs(attacker.run_dir, p) == [0]
    following = attacker.call("checkpoint", ids=none, args={"epoch": 1})
    assert all(r.kind == P.CONTRIB for r in following.values()), following
    for p in PARTIES:
        assert epochs(attacker.run_dir, p) == [0, 1]
    log = (attacker.run_dir / "logs" / "p1.log").read_text()
    assert "a checkpoint of epoch 1000000000" in log and "nothing was written" in log


def test_an_abort_reason_from_the_hub_cannot_forge_log_lines(attacker):
    """The parties stop on an abort; its reason and lost role are the hub's text: they reach
    the party's log and stderr escaped (one line) and bounded. (Run last: the parties end.)"""
    forged = "2030-01-01 00:00:00,000 p1 INFO forged line"
    reason = f"stopping\n{forged}\x1b[2J" + "A" * 5000
    for p in PARTIES:
        attacker.hub.send(
            p,
            Envelope(
                kind=P.ABORT,
                sender="aggregator",
                session=attacker.hub.session,
                meta={"reason": reason, "lost": "p9\nforged", "refused": False},
            ),
        )
    for p in PARTIES:
        assert attacker.procs[p].wait(timeout=60) == P.EXIT_PEER_LOST
    err = attacker.procs["p1"].stderr.read()
    last = err.strip().splitlines()[-1]
    assert last.startswith("securevfl p1: stopping\\n2030") and "\x1b" not in err, last
    assert len(last) < 1200
    log = (attacker.run_dir / "logs" / "p1.log").read_text()
    assert "stopping\\n" in log
    assert not [line for line in log.splitlines() if line.startswith(forged)]


# The tests below start their own parties; they come after every test of the module's shared
# `attacker`, whose parties would take its silent hub for lost (peer_timeout) while they run.


def test_model_versions_and_sessions_hold_against_a_modified_active_party(tmp_path):
    """Two sessions of one federation (one set of parties' disks), the second a fresh start
    with the same seed and `[run] shared_init = true`, so its model starts at the first one's
    initial weights (by default each session's parties draw their own: another version).

    1. A backward with a zero gradient (Adam's first step then moves nothing) is no new model
       version: the same rows over fewer parties would difference to p3's representation
       exactly, and are refused. After an update that changes the weights, a sum over another
       group is a new version's (the README's residual risk across versions).
    2. The second session at the first one's initial weights is held to the sums released at
       them before (kept on each party's disk): the same rows over fewer parties are refused,
       other rows are served.
    3. A signed call captured in the first session and sent in the second with its session id
       and round fails authentication (its tags were made under the old session's keys)."""
    rows = np.arange(1, 41, dtype=np.int64)
    pair = [SumSpec(key="S", tensor="rep", group=("p1", "p2"))]

    def shared(raw):
        raw["run"]["shared_init"] = True
        raw["policy"]["config_seeds"] = True

    first = Attacker(tmp_path, edit=shared)
    try:
        assert all(r.kind == P.CONTRIB for r in first.setup().values())
        kept: list = []
        served = first.call(
            "forward", ids=rows + 100, args={"train": False}, sums=everything([]), kept=kept
        )
        assert all(r.kind == P.CONTRIB for r in served.values()), served
        forward = first.call("forward", ids=rows, args={"train": True}, sums=everything([]))
        assert all(r.kind == P.CONTRIB for r in forward.values()), forward
        zero = np.zeros((len(rows), 4), dtype=np.float32)
        step = first.call(
            "backward", ids=rows, args={"forward": first.round}, inputs={"grad": zero}
        )
        assert all(r.kind == P.CONTRIB for r in step.values()), step
        subset = first.call("forward", ids=rows, args={"train": False}, to=("p1", "p2"), sums=pair)
        refused(subset, "differencing", parties=("p1", "p2"))
        others = rows + 50
        forward = first.call("forward", ids=others, args={"train": True}, sums=everything([]))
        grad = np.random.default_rng(0).normal(size=(len(rows), 4)).astype(np.float32)
        step = first.call(
            "backward", ids=others, args={"forward": first.round}, inputs={"grad": grad}
        )
        assert all(r.kind == P.CONTRIB for r in step.values()), step
        after = first.call("forward", ids=others, args={"train": False}, to=("p1", "p2"), sums=pair)
        assert all(r.kind == P.CONTRIB for r in after.values()), after
    finally:
        first.close()
    second = Attacker(tmp_path, again=True, edit=shared)
    try:
        assert second.session != first.session
        assert all(r.kind == P.CONTRIB for r in second.setup().values())
        subset = second.call("forward", ids=rows, args={"train": False}, to=("p1", "p2"), sums=pair)
        refused(subset, "differencing", parties=("p1", "p2"))
        fresh = second.call(
            "forward", ids=rows + 150, args={"train": False}, to=("p1", "p2"), sums=pair
        )
        assert all(r.kind == P.CONTRIB for r in fresh.values()), fresh
        second.round += 1
        (captured,) = kept
        captured.session, captured.round = second.session.hex(), second.round
        refused(second.send(captured, PARTIES), "authentication")
    finally:
        second.close()


def test_a_session_without_the_partys_fresh_nonce_is_refused(tmp_path):
    """A modified aggregator replays an old session to p1 (a session id built from nonces that
    do not include the one p1 just sent): p1 refuses to join and stops, naming why; the
    parties welcomed honestly are still there."""

    def replayed(party, meta):
        if party != "p1":
            return meta
        nonces = {**meta["nonces"], "p1": "00" * 16}  # p1's nonce of an earlier session
        return {"session": P.session_id(nonces), "nonces": nonces}

    a = Attacker(tmp_path, welcome=replayed)
    try:
        code = a.procs["p1"].wait(timeout=60)
        assert code != 0
        assert "does not include this role's fresh nonce" in a.procs["p1"].stderr.read()
        assert a.procs["p2"].poll() is None and a.procs["p3"].poll() is None  # they joined
    finally:
        a.close()


def test_a_ckks_party_refuses_a_swapped_context_a_resume_it_lacks_and_calls_past_its_budget(
    tmp_path,
):
    """CKKS parties with embedding DP and a privacy budget, against a modified aggregator and a
    modified active party (one set of processes, the attacks in order):

    1. A set-up resuming from an epoch of which the party has no checkpoint: refused (rule
       `resume epoch`); nothing is loaded.
    2. The aggregator swaps the active party's public context for one whose secret key it
       holds (it would then decrypt every contribution): refused (the call no longer matches
       the active party's tag). The context's own end-to-end tag, checked after, is tested in
       `test_ckks_context_tag.py`.
    3. The honest set-up is served; then the modified active party asks for the same rows
       again and again: each forward spends embedding-DP budget, and the one that would pass
       `max_epsilon` is refused before anything is released (the parties stop, exit 3); the
       ledger's spend stays within the budget."""
    from crypto.ckks import CkksKeyHolder

    def ckks_with_budget(raw):
        raw["run"]["aggregation"] = "ckks"
        for p in PARTIES:
            raw["parties"][p]["embedding_dp"] = {"noise_multiplier": 2.0, "clip": 1.0}
            raw["parties"][p]["max_epsilon"] = 3.0

    a = Attacker(tmp_path, edit=ckks_with_budget)
    rows = np.arange(1, 41, dtype=np.int64)
    try:
        args, inputs = a.ckks_setup(CkksKeyHolder(params=ckks_params(a.cfg)).public_context_bytes())
        refused(a.setup(args={**args, "resume_epoch": 3}, inputs=inputs), "resume epoch")
        swapped = CkksKeyHolder(params=ckks_params(a.cfg)).public_context_bytes()

        def swap(env):
            env.tensors["ckks_context"] = np.frombuffer(swapped, dtype=np.uint8)

        refused(a.setup(args=args, inputs=inputs, tamper=swap), "authentication")
        assert all(r.kind == P.CONTRIB for r in a.setup(args=args, inputs=inputs).values())
        served = 0
        while True:
            replies = a.call("forward", ids=rows, args={"train": False}, sums=everything([]))
            if len(replies) < len(PARTIES) or any(r.kind != P.CONTRIB for r in replies.values()):
                break
            served += 1
            assert served < 100, "the budget never ran out"
        assert served >= 1  # the budget paid for some calls, then refused
        assert not [p for p, r in replies.items() if r.kind == P.CONTRIB], replies
        for p in PARTIES:
            assert a.procs[p].wait(timeout=60) == P.EXIT_BUDGET
            assert "privacy budget exhausted" in a.procs[p].stderr.read()
    finally:
        a.close()
    from securevfl.privacy.audit import audit

    report = audit(a.run_dir / "ledger.jsonl")
    spent = {(row.role, row.mechanism): row.epsilon for row in report.rows if row.epsilon}
    assert {p for p, m in spent if m == "embedding_dp"} == set(PARTIES), spent
    assert all(eps <= 3.0 for (_, m), eps in spent.items() if m == "embedding_dp"), spent
