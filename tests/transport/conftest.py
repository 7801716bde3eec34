"""Shared fixtures: keys, hubs and peers on 127.0.0.1 with fast heartbeats, all closed after."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq

from tests.transport.transport_testkit import FAST, HUB_KINDS, PEER_KINDS, ROLES
from transport import Allowlist, CurveKeyPair, Hub, Peer


@dataclass
class Keys:
    hub: CurveKeyPair
    roles: dict[str, CurveKeyPair]
    outsider: CurveKeyPair

    @property
    def allowlist(self) -> Allowlist:
        return Allowlist({name: pair.public for name, pair in self.roles.items()})


@pytest.fixture(scope="session")
def keys() -> Keys:
    return Keys(
        hub=CurveKeyPair.generate(),
        roles={name: CurveKeyPair.generate() for name in ROLES},
        outsider=CurveKeyPair.generate(),
    )


@pytest.fixture
def closer() -> Iterator[Callable[[Any], Any]]:
    """Register anything with a close() (hubs, peers, sockets, contexts) to close at teardown."""
    things: list[Any] = []

    def register(thing: Any) -> Any:
        things.append(thing)
        return thing

    yield register
    for thing in reversed(things):
        if isinstance(thing, zmq.Socket):
            thing.close(linger=0)
        elif isinstance(thing, zmq.Context):
            thing.term()
        else:
            thing.close()


@pytest.fixture
def make_hub(keys: Keys, closer) -> Callable[..., Hub]:
    def make(**overrides: Any) -> Hub:
        options: dict[str, Any] = {
            "bind": "tcp://127.0.0.1:0",
            "keypair": keys.hub,
            "allowlist": keys.allowlist,
            "kinds": HUB_KINDS,
            **FAST,
        }
        options.update(overrides)
        return closer(Hub(**options))

    return make


@pytest.fixture
def make_peer(keys: Keys, closer) -> Callable[..., Peer]:
    def make(name: str, hub: Hub, **overrides: Any) -> Peer:
        options: dict[str, Any] = {
            "name": name,
            "connect": hub.endpoint,
            "keypair": keys.roles.get(name),
            "server_public": keys.hub.public,
            "kinds": PEER_KINDS,
            **FAST,
        }
        options.update(overrides)
        return closer(Peer(**options))

    return make


@pytest.fixture
def raw_dealer(keys: Keys, closer) -> Callable[..., zmq.Socket]:
    """A bare CURVE DEALER, for sending frames a well-behaved Peer never would."""

    def make(hub: Hub, *, keypair: CurveKeyPair, routing_id: str | None) -> zmq.Socket:
        context = closer(zmq.Context())
        sock = context.socket(zmq.DEALER)
        closer(sock)
        sock.linger = 0
        if routing_id is not None:
            sock.routing_id = routing_id.encode()
        sock.curve_serverkey = keys.hub.public
        sock.curve_publickey = keypair.public
        sock.curve_secretkey = keypair.secret
        sock.connect(hub.endpoint)
        return sock

    return make
