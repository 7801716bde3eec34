"""A role's connection to the aggregator: CURVE keys, the session handshake, and receive errors
turned into `RunAborted` with the name of whoever was lost."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

from securevfl.config import RunConfig
from securevfl.keys import AGGREGATOR, FederationPublicKeys, RoleSecrets, load_public, load_secrets
from securevfl.roles import protocol as P
from transport import Envelope, HandshakeFailed, KeyRefused, Peer, PeerLost, ReceiveTimeout


class RoleConnection:
    def __init__(
        self,
        *,
        cfg: RunConfig,
        name: str,
        peer: Peer,
        secrets: RoleSecrets,
        public: FederationPublicKeys,
        logger: logging.Logger,
        nonce: str,
    ) -> None:
        self.cfg = cfg
        self.name = name
        self.peer = peer
        self.secrets = secrets
        self.public = public
        self.logger = logger
        self.nonce = nonce
        self.session_hex: str | None = None

    @classmethod
    def connect(
        cls,
        *,
        cfg: RunConfig,
        name: str,
        keys_dir: Path,
        address: str,
        logger: logging.Logger,
        nonce: str,
        context: Any = None,
    ) -> RoleConnection:
        public = load_public(keys_dir)
        secrets = load_secrets(keys_dir, name)
        if public.curve.get(name) != secrets.curve.public:
            raise ValueError(
                f"the secret key file of {name!r} does not match public.json; both must come "
                "from the same `securevfl keys` run"
            )
        peer = Peer(
            name=name,
            connect=address,
            keypair=secrets.curve,
            server_public=public.curve_public(AGGREGATOR),
            kinds=P.KINDS,
            heartbeat_interval=cfg.heartbeat_interval,
            peer_timeout=cfg.peer_timeout,
            logger=logger,
            context=context,
            # inproc:// (threads of one process, the experiment fast path) has no CURVE in libzmq
            curve=not address.startswith("inproc://"),
        )
        logger.info("connecting to the aggregator at %s", address)
        return cls(
            cfg=cfg,
            name=name,
            peer=peer,
            secrets=secrets,
            public=public,
            logger=logger,
            nonce=nonce,
        )

    def handshake(self) -> bytes:
        """Say hello with a fresh nonce; return the session id agreed from everyone's nonces."""
        self.send(Envelope(kind=P.HELLO, sender=self.name, meta={"nonce": self.nonce}))
        env = self.recv(timeout=self.cfg.startup_timeout, waiting_for="the federation to assemble")
        if env.kind != P.WELCOME:
            raise P.RunAborted(f"expected a welcome from the aggregator, got {env.kind!r}")
        nonces = env.meta.get("nonces", {})
        session = env.meta.get("session")
        if nonces.get(self.name) != self.nonce or P.session_id(nonces) != session:
            raise P.RunAborted(
                "the aggregator's session id does not include this role's fresh nonce; "
                "refusing a possibly replayed session"
            )
        self.session_hex = session
        self.peer.session = session
        self.logger.info("joined session %s with roles %s", session, sorted(nonces))
        return bytes.fromhex(session)

    def recv(self, *, timeout: float, waiting_for: str) -> Envelope:
        try:
            env = self.peer.recv(timeout=timeout)
        except PeerLost as exc:
            raise P.RunAborted(
                f"lost the aggregator ({exc}); restart the federation with --resume",
                lost=AGGREGATOR,
            ) from None
        except HandshakeFailed as exc:
            raise self._wrong_hub(exc) from None
        except KeyRefused:
            raise self._refused() from None
        except ReceiveTimeout:
            raise P.RunAborted(
                f"nothing arrived within {timeout:.0f} s while waiting for {waiting_for}; "
                "check that every role is running and reachable, or raise [network] timeouts"
            ) from None
        if env.kind == P.ABORT:
            lost = env.meta.get("lost")
            raise P.RunAborted(
                env.meta.get("reason", f"the run was aborted ({lost} lost)"),
                lost=lost,
                refused=env.meta.get("refused") is True,
            )
        if env.kind == P.ERROR:
            raise P.RunAborted(
                env.meta.get("reason", "a role failed"),
                lost=env.meta.get("role"),
                refused=env.meta.get("refused") is True,
            )
        return env

    def send(self, env: Envelope) -> None:
        env.sender = self.name
        try:
            self.peer.send(env)
        except HandshakeFailed as exc:
            raise self._wrong_hub(exc) from None
        except KeyRefused:
            raise self._refused() from None

    def _wrong_hub(self, exc: Exception) -> P.RunAborted:
        return P.RunAborted(
            f"{self.name!r} could not complete the CURVE handshake with the aggregator: {exc}; "
            "check [network] aggregator_address and that this role holds this federation's "
            "public keys (`securevfl keys`), not another run's"
        )

    def _refused(self) -> P.RunAborted:
        return P.RunAborted(
            f"the aggregator refused the CURVE key of {self.name!r}: it is not in the "
            "federation's allowlist; use this role's key from the federation's keys "
            "directory (`securevfl keys`), or ask the operator to add it"
        )

    def stats(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "bytes_sent": int(self.peer.bytes_sent),
            "bytes_received": int(self.peer.bytes_received),
        }

    def close(self) -> None:
        self.peer.close()
