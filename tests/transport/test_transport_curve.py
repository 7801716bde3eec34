"""CURVE key pairs, the allowlist and the ZAP authenticator's rules."""

from __future__ import annotations

import json
import logging

import pytest
import zmq

from transport import Allowlist, CurveKeyPair, TransportError, start_authenticator


def test_key_pair_round_trips_through_json_and_hides_its_secret():
    pair = CurveKeyPair.generate()
    assert len(pair.public) == 40 and len(pair.secret) == 40
    data = json.loads(json.dumps(pair.to_json()))
    assert CurveKeyPair.from_json(data) == pair
    assert pair.secret.decode() not in repr(pair)


def test_key_pair_refuses_a_public_key_of_another_secret():
    a, b = CurveKeyPair.generate(), CurveKeyPair.generate()
    with pytest.raises(ValueError, match="does not match"):
        CurveKeyPair(public=a.public, secret=b.secret)
    with pytest.raises(ValueError, match="z85"):
        CurveKeyPair(public=b"short", secret=a.secret)
    with pytest.raises(ValueError, match="'public' and 'secret'"):
        CurveKeyPair.from_json({"public": a.public.decode()})


def test_allowlist_maps_names_to_keys_both_ways():
    a, b = CurveKeyPair.generate(), CurveKeyPair.generate()
    allow = Allowlist({"active": a.public, "party1": b.public.decode()})  # bytes or str
    assert allow["party1"] == b.public
    assert allow.name_of(a.public) == "active"
    assert allow.name_of(b.public.decode()) == "party1"
    assert allow.name_of(CurveKeyPair.generate().public) is None
    assert Allowlist.from_json(json.loads(json.dumps(allow.to_json()))).to_json() == allow.to_json()


def test_allowlist_refuses_a_key_shared_by_two_roles():
    a = CurveKeyPair.generate()
    with pytest.raises(ValueError, match="'x' and 'y' have the same CURVE public key"):
        Allowlist({"x": a.public, "y": a.public})


@pytest.mark.parametrize("name", ["", "a/hb", "has space", "é", "x" * 201])
def test_allowlist_refuses_names_that_cannot_be_routing_ids(name):
    with pytest.raises(ValueError, match="role name"):
        Allowlist({name: CurveKeyPair.generate().public})


def test_authenticator_admits_allowlisted_keys_and_names_the_user(caplog):
    a = CurveKeyPair.generate()
    outsider = CurveKeyPair.generate()
    logger = logging.getLogger("transport.test")
    context = zmq.Context()
    auth = start_authenticator(context, Allowlist({"party1": a.public}), logger=logger)
    try:
        assert auth.callback("*", a.public) is True
        assert auth.curve_user_id(zmq.utils.z85.decode(a.public)) == "party1"
        with caplog.at_level(logging.WARNING, logger="transport.test"):
            assert auth.callback("*", outsider.public) is False
            assert auth.callback("*", outsider.public) is False  # repeat: logged at DEBUG
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert outsider.public.decode() in warnings[0].getMessage()
        assert "not in the federation allowlist" in warnings[0].getMessage()
        assert auth.refused == 2
        with pytest.raises(TransportError, match="already runs a ZAP authenticator"):
            start_authenticator(context, Allowlist({}), logger=logger)
    finally:
        auth.stop()
        context.term()
