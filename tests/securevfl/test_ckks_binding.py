"""Rule 6 under `ckks`: every CKKS contribution carries the binding of the call its party
answered (``<key>/call``, the 32-byte `CallGuard.binding`), and the aggregator adds a sum only if
all its members' bindings are equal. A modified active party that gives the members of one sum
different signed calls ("split view", which can isolate a member: `test_split_view.py`) gets
no sum: the aggregator stops the run with an error naming the sum and who was sent which call,
and forwards nothing of it. (Under `mask` the same binding is cryptographic:
`MaskedSumParty.bind`; the ckks aggregator sees every ciphertext and must not collude with the
key holder, so it can enforce it.)"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
from collections import deque

import numpy as np
import pytest

from crypto.ckks import CkksKeyHolder, choose_params
from securevfl import secure_sum
from securevfl.direct import DirectFederation
from securevfl.errors import EXIT_OK, PolicyRefusal
from securevfl.methods import SumSpec, method_spec
from securevfl.privacy.ledger import PrivacyLedger
from securevfl.roles import protocol as P
from securevfl.roles.aggregator import Aggregator
from securevfl.roles.guard import auth_key, call_tags, run_terms
from securevfl.roles.rounds import Call, PartyRound
from securevfl.secure_sum import (
    CkksActive,
    CkksAggregator,
    CkksParty,
    ContributionError,
    SumSession,
    ckks_context_tag,
    ckks_params,
)
from tests.securevfl.conftest import BASE_RAW, make_config, synthetic_csv
from transport import Envelope, ReceiveTimeout

GROUP = ("a", "b", "c")


def digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


@pytest.fixture(scope="module")
def stages():
    params = choose_params(precision_bits=12, magnitude=2.0**10, terms=4).params
    holder = CkksKeyHolder(params=params)
    ctx = holder.public_context_bytes()
    parties = {
        n: CkksParty(SumSession(name=n, session=b"s" * 16, ckks_public_context=ctx), zeros="fresh")
        for n in GROUP
    }
    agg = CkksAggregator(SumSession(name="aggregator", session=b"s" * 16, ckks_public_context=ctx))
    active = CkksActive(SumSession(name="active", session=b"s" * 16), key_holder=holder)
    return parties, agg, active


def contributions(parties, xs, calls, key="S"):
    return {
        n: parties[n].protect(xs[n], round=1, group=GROUP, key=key, call=calls[n]) for n in GROUP
    }


# ------------------------------------------------------------------------------ the sum stage


def test_members_bound_to_one_call_get_the_sum_of_their_inputs(stages):
    parties, agg, active = stages
    rng = np.random.default_rng(0)
    xs = {n: rng.normal(size=(30, 4)) for n in GROUP}
    sent = contributions(parties, xs, dict.fromkeys(GROUP, digest("the call")))
    for arrays in sent.values():  # the chunks, and the binding of the call: 32 bytes more
        binding = arrays["S/call"]
        assert binding.dtype == np.uint8 and binding.tobytes() == digest("the call")
        assert set(arrays) == {"S/0", "S/call"}
    combined = agg.combine(sent, group=GROUP, key="S")
    assert set(combined) == {"S/0"}  # the binding is checked, not forwarded
    total = active.reveal(combined, group=GROUP, key="S", shape=(30, 4))
    np.testing.assert_allclose(total, sum(xs.values()), atol=1e-3)


def test_members_bound_to_different_calls_are_not_summed(stages):
    parties, agg, _ = stages
    xs = {n: np.ones(8) for n in GROUP}
    calls = {"a": digest("rows 1-8"), "b": digest("rows 1-8"), "c": digest("rows 9-16")}
    accepted = {
        n: agg.accept(a, key="S", sender=n) for n, a in contributions(parties, xs, calls).items()
    }
    with pytest.raises(ContributionError) as refused:
        agg.combine_accepted(accepted, group=GROUP, key="S")
    message = str(refused.value)
    assert "sum 'S'" in message and "different calls" in message
    assert "['a', 'b'] call" in message and "['c'] call" in message
    assert "nothing is summed or forwarded" in message


def test_a_contribution_made_without_a_call_never_passes_for_a_bound_one(stages):
    """Without a call (a unit use, no guard) a party sends `CKKS_UNBOUND`: a sum of bound and
    unbound members is refused like any split view."""
    parties, agg, _ = stages
    xs = {n: np.ones(8) for n in GROUP}
    calls = {"a": digest("the call"), "b": digest("the call"), "c": None}
    sent = contributions(parties, xs, calls)
    assert sent["c"]["S/call"].tobytes() == secure_sum.CKKS_UNBOUND
    with pytest.raises(ContributionError, match=r"\['c'\] call 00000000"):
        agg.combine(sent, group=GROUP, key="S")
    with pytest.raises(ValueError, match="32 bytes"):  # a party never sends a truncated digest
        parties["a"].protect(np.ones(3), round=1, group=GROUP, key="S", call=b"short")


@pytest.mark.parametrize(
    "binding",
    [
        None,  # missing
        np.zeros(31, dtype=np.uint8),  # too short
        np.zeros(33, dtype=np.uint8),  # too long
        np.zeros(4, dtype=np.uint64),  # 32 bytes, but not uint8
        np.zeros((2, 16), dtype=np.uint8),  # 32 uint8 values, not one vector
    ],
    ids=["missing", "short", "long", "uint64", "2-d"],
)
def test_a_missing_or_malformed_binding_is_rejected_naming_the_sender(stages, binding):
    parties, agg, _ = stages
    arrays = parties["b"].protect(np.ones(5), round=1, group=GROUP, key="S", call=digest("c"))
    arrays = {k: v for k, v in arrays.items() if k != "S/call"}
    if binding is not None:
        arrays["S/call"] = binding
    with pytest.raises(ContributionError, match=r"^b: .*binding"):
        agg.accept(arrays, key="S", sender="b")


def test_a_tensor_named_like_neither_a_chunk_nor_the_binding_is_rejected(stages):
    parties, agg, _ = stages
    arrays = parties["b"].protect(np.ones(5), round=1, group=GROUP, key="S", call=digest("c"))
    with pytest.raises(ContributionError, match="^b sent tensors"):
        agg.accept({**arrays, "S/extra": np.zeros(3, dtype=np.uint8)}, key="S", sender="b")


# ----------------------------------------------- through the aggregator, from real parties

PARTIES = ("alpha", "beta", "gamma")
NONCES = {role: f"{i:02x}" * 16 for i, role in enumerate(("active", *PARTIES))}


class ScriptedHub:
    """The aggregator's hub, in memory: the active party sends the next envelope of `script`
    once it has the result of its last call, and each call the aggregator relays is answered at
    once by the real `PartyRound`s. `split`
    (round -> party -> envelope) hands a party its own signed call for a round instead of the
    one the aggregator relays: how a split view reaches the members (the aggregator itself
    relays one envelope to all, so only a path around it could)."""

    def __init__(self, party_rounds, script, split=None) -> None:
        self.party_rounds = party_rounds
        self.inbox = deque(
            Envelope(kind=P.HELLO, sender=role, meta={"nonce": nonce})
            for role, nonce in NONCES.items()
        )
        self.script = deque(script)
        self.inbox.append(self.script.popleft())
        self.split = split or {}
        self.session = None
        self.sent: list[tuple[str, Envelope]] = []
        self.replies: dict[int, dict[str, Envelope]] = {}

    def recv(self, timeout=None):
        if not self.inbox:
            raise ReceiveTimeout("nothing queued")
        return self.inbox.popleft()

    def send(self, to, env):
        self.sent.append((to, env))
        if to == "active" and env.kind == P.RESULT and self.script:
            self.inbox.append(self.script.popleft())

    def send_each(self, parties, env):
        for p in parties:
            call = self.split.get(env.round, {}).get(p, env)
            try:
                reply = self.party_rounds[p].answer(call)
            except PolicyRefusal as exc:
                meta = {"reason": str(exc)}
                reply = Envelope(
                    kind=P.REFUSED, sender=p, session=env.session, round=env.round, meta=meta
                )
            self.replies.setdefault(env.round, {})[p] = reply
            self.inbox.append(reply)
        return {}

    def connected(self):
        return ["active", *PARTIES]

    def queued(self):
        return []

    def forget(self, peer):
        pass

    def to_active(self):
        return [env for to, env in self.sent if to == "active"]


@pytest.fixture
def ckks_federation(tmp_path):
    """A ckks config, its key holder, the real `PartyRound` of each party (guard, method, CKKS
    stage) in the session the aggregator will derive from `NONCES`, and the active party's
    signing of a call. (Every role in one process: a test, never a deployment.)"""
    import torch

    synthetic_csv(tmp_path / "data.csv", n=120)
    raw = copy.deepcopy(BASE_RAW)
    raw["train"]["epochs"] = 1
    fed = DirectFederation(make_config(raw, tmp_path), run_dir=tmp_path / "run")  # keys, tables
    cfg = dataclasses.replace(fed.config, aggregation="ckks")
    session = bytes.fromhex(P.session_id(NONCES))
    keys = {
        p: auth_key(
            keypair=fed.mask_keypair,
            me=cfg.active_name,
            peer=p,
            peer_public=fed.mask_publics[p],
            session=session,
        )
        for p in PARTIES
    }
    rounds = {
        p: PartyRound(
            cfg=cfg,
            name=p,
            method=method_spec(cfg.method).party_class()(
                name=p, table=fed.tables[p], config=cfg, device=torch.device("cpu")
            ),
            run_dir=tmp_path / "ckks-run",
            ledger=PrivacyLedger(tmp_path / "ckks-ledger.jsonl"),
            logger=logging.getLogger("test.ckks_binding"),
            session=session,
            mask_keypair=fed.party_rounds[p].mask_keypair,
            mask_publics=fed.mask_publics,
            ckks_zeros="fresh",
        )
        for p in PARTIES
    }
    values = {}
    for p, r in rounds.items():
        r.observe = lambda spec, value, p=p: values.__setitem__(p, np.asarray(value, np.float64))
    holder = CkksKeyHolder(params=ckks_params(cfg))

    def signed(call: Call) -> Envelope:
        env = call.envelope(sender=cfg.active_name)
        env.meta["auth"] = call_tags(
            env.meta, session=session, round=env.round, tensors=env.tensors, keys=keys
        )
        return env

    context = holder.public_context_bytes()
    tags = {
        p: ckks_context_tag(
            context=context,
            my_keypair=fed.mask_keypair,
            me=cfg.active_name,
            peer=p,
            peer_public=fed.mask_publics[p],
            session=session,
        ).hex()
        for p in PARTIES
    }
    setup = signed(
        Call(
            op="setup",
            round=1,
            session=session.hex(),
            ids=np.empty(0, dtype=np.int64),
            args={"resume_epoch": -1, "run": run_terms(cfg), "ckks_tags": tags},
            inputs={
                "train_ids": fed.train_ids,
                "all_ids": fed.train_ids,
                "ckks_context": np.frombuffer(context, dtype=np.uint8),
            },
            to=PARTIES,
            collect=("present",),
        )
    )

    def forward(ids, args=None) -> Envelope:
        return signed(
            Call(
                op="forward",
                round=2,
                session=session.hex(),
                ids=np.asarray(ids, dtype=np.int64),
                args=args or {"train": False},
                sums=(SumSpec(key="S", tensor="rep", group=PARTIES),),
                to=PARTIES,
            )
        )

    return cfg, rounds, holder, setup, forward, values, np.sort(fed.train_ids)


def serve(cfg, hub):
    return Aggregator(cfg=cfg, hub=hub, logger=logging.getLogger("test.ckks_binding.agg")).run()


def test_members_sent_one_call_through_the_aggregator_get_their_sum(ckks_federation):
    """The control: the same roles, every member sent the call the aggregator relays: each
    contribution carries the binding its guard computed, and the sum is forwarded and opens."""
    cfg, rounds, holder, setup, forward, values, ids = ckks_federation
    call = forward(ids[:10])
    hub = ScriptedHub(rounds, [setup, call])
    serve(cfg, hub)  # until the script ends (then nothing more arrives)
    replies = hub.replies[2]
    assert all(r.kind == P.CONTRIB for r in replies.values())
    bindings = {p: r.tensors["S/call"].tobytes() for p, r in replies.items()}
    assert set(bindings.values()) == {rounds["alpha"].guard.binding}
    (result,) = [env for env in hub.to_active() if env.kind == P.RESULT and env.round == 2]
    shape = tuple(result.meta["shapes"]["S"])
    revealed = CkksActive(SumSession(name="active", session=b""), key_holder=holder).reveal(
        result.tensors, group=PARTIES, key="S", shape=shape
    )
    np.testing.assert_allclose(revealed, sum(values.values()), atol=1e-3)


def test_a_split_view_through_the_aggregator_stops_the_run_and_forwards_nothing(
    ckks_federation, caplog
):
    """A modified active party signs two calls for round 2: alpha and beta are asked for rows
    1-10, gamma for rows 11-20. Every guard admits its own call and each real party answers
    with a real CKKS contribution; the aggregator finds the bindings differ, adds nothing, and
    stops the run: the active party gets an abort that names the sum and the members, never a
    result for the round (which would have mixed gamma's rows with the others')."""
    cfg, rounds, holder, setup, forward, values, ids = ckks_federation
    told, other = forward(ids[:10]), forward(ids[10:20])
    hub = ScriptedHub(rounds, [setup, told], split={2: {"gamma": other}})
    with caplog.at_level(logging.ERROR, logger="test.ckks_binding.agg"):
        code = serve(cfg, hub)
    replies = hub.replies[2]
    assert all(r.kind == P.CONTRIB for r in replies.values())  # every guard admitted its call
    to_active = hub.to_active()
    assert not [env for env in to_active if env.round == 2 and env.kind == P.RESULT]
    assert not [env for env in to_active if env.round == 2 and env.tensors]  # nothing of it
    assert code != EXIT_OK
    bindings = {p: r.tensors["S/call"].tobytes() for p, r in replies.items()}
    assert bindings["alpha"] == bindings["beta"] != bindings["gamma"]
    (abort,) = [env for env in to_active if env.kind == P.ABORT]
    reason = abort.meta["reason"]
    assert "round 2" in reason and "sum 'S'" in reason
    assert "the active party sent the members of one sum different calls" in reason
    assert "['alpha', 'beta'] call" in reason and "['gamma'] call" in reason
    assert "different calls" in caplog.text  # and the aggregator's log says why it stopped


def test_a_split_view_on_the_arguments_alone_is_stopped_too(ckks_federation):
    """The same rows, inputs and sums for every member, and gamma alone told other arguments
    (as FALSE-VFL's per-party `observed` would be): the binding covers the whole call, so the
    aggregator forwards nothing of the round."""
    cfg, rounds, holder, setup, forward, values, ids = ckks_federation
    told = forward(ids[:10], {"train": False})
    other = forward(ids[:10], {"train": False, "epoch": 7})
    hub = ScriptedHub(rounds, [setup, told], split={2: {"gamma": other}})
    code = serve(cfg, hub)
    replies = hub.replies[2]
    assert all(r.kind == P.CONTRIB for r in replies.values())  # every guard admitted its call
    bindings = {p: r.tensors["S/call"].tobytes() for p, r in replies.items()}
    assert bindings["alpha"] == bindings["beta"] != bindings["gamma"]
    assert not [e for e in hub.to_active() if e.round == 2 and e.kind == P.RESULT]
    assert code != EXIT_OK
