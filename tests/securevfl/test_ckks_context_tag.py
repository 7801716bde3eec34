"""The CKKS public context's own end-to-end tag: a party encrypts only under a context the
active party (the key holder) tagged for it with their pairwise key, which the aggregator that
forwards the context cannot compute. (The whole set-up call is authenticated as well; this
second check holds even for a call that passes the first. The aggregator's swap of the context
against real parties: `test_hostile_roles.py`.)"""

from __future__ import annotations

import copy

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
