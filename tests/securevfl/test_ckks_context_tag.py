"""The CKKS public context's own end-to-end tag: a party encrypts only under a context the
active party (the key holder) tagged for it with their pairwise key, which the aggregator that
forwards the context cannot compute. (The whole set-up call is authenticated as well; this
second check holds even for a call that passes the first. The aggregator's swap of the context
against real parties: `test_hostile_roles.py`.)"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from securevfl.direct import DirectFederation
from securevfl.errors import RunAborted
from securevfl.secure_sum import ckks_context_tag
from tests.securevfl.conftest import BASE_RAW, make_config, synthetic_csv


@pytest.fixture
def federation(tmp_path):
    synthetic_csv(tmp_path / "data.csv", n=120)
    raw = copy.deepcopy(BASE_RAW)
    raw["train"]["epochs"] = 1
    return DirectFederation(make_config(raw, tmp_path), run_dir=tmp_path / "run")


def tag_for(fed, party: str, context: bytes, *, me: str | None = None, keypair=None) -> str:
    return ckks_context_tag(
        context=context,
        my_keypair=keypair or fed.mask_keypair,
        me=me or fed.config.active_name,
        peer=party,
        peer_public=fed.mask_publics[party],
        session=fed.session,
    ).hex()


def test_a_party_accepts_only_the_context_the_active_party_tagged_for_it(federation):
    fed, context = federation, b"a public context, as the key holder serialised it"
    party = fed.party_rounds["alpha"]
    party._check_context_tag(context, {"alpha": tag_for(fed, "alpha", context)})  # accepted
    swapped = b"the aggregator's own context, whose secret key it holds"
    hostile = {
        "another context's tag": {"alpha": tag_for(fed, "alpha", swapped)},
        "another party's tag": {"alpha": tag_for(fed, "beta", context)},
        "no tag": {},
        "not hex": {"alpha": "zz" * 32},
        "not text": {"alpha": 7},
        "no table": ["alpha"],
    }
    for tags in hostile.values():
        with pytest.raises(RunAborted, match="failed authentication"):
            party._check_context_tag(context, tags)


def test_set_up_checks_the_context_tag_before_it_builds_a_ckks_stage(federation, tmp_path):
    """The check's place in set-up: a CKKS set-up call signed by the active party (it passes
    the call's own authentication) whose context tag is not this party's is stopped before the
    party builds anything to encrypt with; the same call with the right tag sets it up."""
    import dataclasses
    import logging

    from crypto.ckks import CkksKeyHolder
    from securevfl.methods import method_spec
    from securevfl.privacy.ledger import PrivacyLedger
    from securevfl.roles.guard import call_tags, run_terms
    from securevfl.roles.rounds import Call, PartyRound, fuse
    from securevfl.secure_sum import ckks_params

    fed = federation
    cfg = dataclasses.replace(fed.config, aggregation="ckks")
    context = CkksKeyHolder(params=ckks_params(cfg)).public_context_bytes()
    other = CkksKeyHolder(params=ckks_params(cfg)).public_context_bytes()

    def party_round():
        table = fed.party_methods["alpha"].table
        return PartyRound(
            cfg=cfg,
            name="alpha",
            method=method_spec(cfg.method).party_class()(
                name="alpha", table=table, config=cfg, device=__import__("torch").device("cpu")
            ),
            run_dir=tmp_path / "ckks-run",
            ledger=PrivacyLedger(tmp_path / "ckks-ledger.jsonl"),
            logger=logging.getLogger("test"),
            session=fed.session,
            mask_keypair=fed.party_rounds["alpha"].mask_keypair,
            mask_publics=fed.mask_publics,
        )

    def setup_call(tag_context: bytes):
        call = Call(
            op="setup",
            round=1,
            session=fed.session_hex,
            ids=np.empty(0, dtype=np.int64),
            args={
                "resume_epoch": -1,
                "run": run_terms(cfg),
                "ckks_tags": {"alpha": tag_for(fed, "alpha", tag_context)},
            },
            inputs={
                "train_ids": fed.train_ids,
                "all_ids": fed.train_ids,
                "ckks_context": np.frombuffer(context, dtype=np.uint8),
            },
            to=("alpha",),
            collect=("present",),
        )
        env = fuse([call], sender="active")
        env.meta["auth"] = call_tags(
            env.meta,
            session=fed.session,
            round=env.round,
            tensors=env.tensors,
            keys={"alpha": fed._auth_keys["alpha"]},
        )
        return env

    refusing = party_round()
    with pytest.raises(RunAborted, match="failed authentication"):
        refusing.answer(setup_call(other))  # signed, but the tag is for another context
    assert refusing.stage is None
    accepting = party_round()
    accepting.answer(setup_call(context))
    assert accepting.stage is not None
