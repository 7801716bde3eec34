"""The pairwise-masked sum (secure aggregation), as a party stage and an aggregator stage.

Stage 1, at each party u of a group: ``MaskedSumParty.mask`` encodes its value in Z_2^64 and,
for every other member v, adds the keystream of the pair key (u, v) if ``u < v`` and subtracts
it otherwise. Stage 2, at the aggregator: ``MaskedSumAggregator.add`` adds the contributions;
every pairwise mask appears once with each sign, so the masks cancel and only the sum remains.
Stage 3, at the receiver: ``decode_sum``. Masks are derived for the exact group, so a sum over
any subset of parties cancels, and a sum missing a contributor decodes to an error, not garbage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from crypto.fixedpoint import FixedPointEncoder
from crypto.keys import MaskingKeyPair, length_prefixed, pair_key
from crypto.prg import KEYSTREAM_CHUNK_WORDS, Keystream, stream_key

__all__ = [
    "MASK_DOMAIN_PREFIX",
    "MaskDomain",
    "MaskedSumAggregator",
    "MaskedSumParty",
    "MissingContributorError",
    "decode_sum",
]

MASK_DOMAIN_PREFIX = b"securevfl/mask-domain/v1"


def _check_group(group: Sequence[str]) -> tuple[str, ...]:
    if isinstance(group, str | bytes):
        raise TypeError("group must be a sequence of party names, not a single string")
    members = tuple(group)
    for member in members:
        if not isinstance(member, str) or not member:
            raise ValueError(f"group members must be non-empty strings, got {member!r}")
    duplicates = sorted({m for m in members if members.count(m) > 1})
    if duplicates:
        raise ValueError(f"group names a party more than once: {duplicates}")
    return members


@dataclass(frozen=True)
class MaskDomain:
    """What one set of masks is for: (session, round, group, tensor). The group is kept sorted.

    Every mask keystream is keyed by its pair key and this domain, so masks for different
    rounds, groups, tensors or sessions are independent. Refuses an empty session or tensor
    name, a round outside [0, 2**64), and an empty or duplicated group.
    """

    session: bytes
    round: int
    group: tuple[str, ...]
    tensor: str

    def __post_init__(self) -> None:
        if not isinstance(self.session, bytes) or not self.session:
            raise ValueError("session must be non-empty bytes")
        if isinstance(self.round, bool) or not isinstance(self.round, int | np.integer):
            raise TypeError(f"round must be an int, got {type(self.round).__name__}")
        if not 0 <= self.round < 2**64:
            raise ValueError(f"round must be in [0, 2**64), got {self.round}")
        if not isinstance(self.tensor, str) or not self.tensor:
            raise ValueError(f"tensor must be a non-empty name, got {self.tensor!r}")
        members = _check_group(self.group)
        if not members:
            raise ValueError("group must name at least one party")
        object.__setattr__(self, "round", int(self.round))
        object.__setattr__(self, "group", tuple(sorted(members)))

    def encode(self) -> bytes:
        """Unambiguous bytes: prefix, then length-prefixed session, round, sorted group, tensor."""
        parts = [
            MASK_DOMAIN_PREFIX,
            length_prefixed(self.session),
            self.round.to_bytes(8, "big"),
            len(self.group).to_bytes(4, "big"),
            *(length_prefixed(member.encode()) for member in self.group),
            length_prefixed(self.tensor.encode()),
        ]
        return b"".join(parts)


class MissingContributorError(ValueError):
    """The contributions to a sum are not exactly its group: names who is missing or unexpected."""

    def __init__(self, *, missing: Sequence[str], unexpected: Sequence[str]) -> None:
        self.missing = tuple(sorted(missing))
        self.unexpected = tuple(sorted(unexpected))
        parts = []
        if self.missing:
            parts.append(f"missing contributions from {list(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected contributions from {list(self.unexpected)}")
        super().__init__(
            "; ".join(parts) + ": the masks only cancel over the exact group; re-run the sum "
            "with the surviving parties as a new group"
        )


class MaskedSumParty:
    """Party-side stage of the pairwise-masked sum.

    Holds one party's X25519 masking key and the pinned public keys of the others. Pair keys
    are derived lazily and cached. Refuses a pinned key for itself that differs from its own,
    and (in :meth:`mask`) to mask twice under the same domain, which would reuse a keystream and
    reveal the difference of the two inputs to the aggregator.
    """

    def __init__(
        self,
        *,
        name: str,
        keypair: MaskingKeyPair,
        peer_publics: Mapping[str, bytes],
        session: bytes,
        encoder: FixedPointEncoder,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if not isinstance(keypair, MaskingKeyPair):
            raise TypeError(f"keypair must be a MaskingKeyPair, got {type(keypair).__name__}")
        if not isinstance(session, bytes) or not session:
            raise ValueError("session must be non-empty bytes (the federation's session id)")
        if not isinstance(encoder, FixedPointEncoder):
            raise TypeError(f"encoder must be a FixedPointEncoder, got {type(encoder).__name__}")
        peers: dict[str, bytes] = {}
        for peer, public in peer_publics.items():
            if not isinstance(public, bytes) or len(public) != 32:
                raise ValueError(f"the public key pinned for {peer!r} is not 32 raw bytes")
            if peer == name:
                if public != keypair.public:
                    raise ValueError(
                        f"the public key pinned for {name!r} (this party) is not this party's "
                        "masking key: the wrong key pair was loaded or the config is stale"
                    )
                continue
            peers[peer] = public
        self.name = name
        self.session = session
        self.encoder = encoder
        self._keypair = keypair
        self._peer_publics = peers
        self._pair_keys: dict[str, bytes] = {}
        self._used_domains: set[bytes] = set()

    def __repr__(self) -> str:
        return f"MaskedSumParty(name={self.name!r}, peers={sorted(self._peer_publics)})"

    def _pair_key(self, peer: str) -> bytes:
        key = self._pair_keys.get(peer)
        if key is None:
            key = pair_key(
                my_private=self._keypair.private,
                peer_public=self._peer_publics[peer],
                session=self.session,
                me=self.name,
                peer=peer,
            )
            self._pair_keys[peer] = key
        return key

    def domain(self, *, round: int, group: Sequence[str], tensor: str) -> MaskDomain:
        """The mask domain of one contribution, after checking that this party may send it."""
        members = _check_group(group)
        if self.name not in members:
            raise ValueError(f"party {self.name!r} is not in the group {list(members)}")
        if len(members) < 2:
            raise ValueError(
                f"a masked sum needs at least 2 contributors, got only {self.name!r}: the "
                "'sum' would be this party's value itself, which masking cannot hide"
            )
        unpinned = sorted(m for m in members if m != self.name and m not in self._peer_publics)
        if unpinned:
            raise ValueError(
                f"no pinned masking public key for group member(s) {unpinned}; add them to the "
                "federation config"
            )
        return MaskDomain(session=self.session, round=round, group=members, tensor=tensor)

    def mask(self, x: np.ndarray, *, round: int, group: Sequence[str], tensor: str) -> np.ndarray:
        """Encode ``x`` and add this party's pairwise masks for ``group``; uint64 of ``x.shape``.

        For every other member v: add the keystream of stream_key(pair_key(self, v), domain) if
        ``self.name < v`` (string order), else subtract it. The result alone is uniformly random
        in Z_2^64; the sum over the whole group is the encoded sum of the inputs. Refuses: this
        party not in the group, a member with no pinned key, duplicate names, a group of one,
        a group too large for the encoder's ring (``max_terms``), inputs the encoder refuses,
        and a domain this object already masked under (keystream reuse; a restarted party must
        resend its stored contribution rather than mask again).
        """
        domain = self.domain(round=round, group=group, tensor=tensor)
        self.encoder.check_terms(len(domain.group))
        domain_bytes = domain.encode()
        domain_digest = hashlib.blake2b(domain_bytes, digest_size=16).digest()
        if domain_digest in self._used_domains:
            raise ValueError(
                f"party {self.name!r} already masked a contribution for round {domain.round}, "
                f"group {list(domain.group)}, tensor {tensor!r}: masking again would reuse the "
                "keystream and reveal the difference of the two inputs; resend the first "
                "masked array or use a fresh round"
            )
        masked = self.encoder.encode(x)
        self._used_domains.add(domain_digest)
        streams = [
            (
                Keystream(stream_key(pair_key=self._pair_key(peer), domain=domain_bytes)),
                np.add if self.name < peer else np.subtract,
            )
            for peer in domain.group
            if peer != self.name
        ]
        flat = masked.reshape(-1)
        keystream_buffer = np.empty(min(KEYSTREAM_CHUNK_WORDS, flat.size), dtype=np.uint64)
        for start in range(0, flat.size, KEYSTREAM_CHUNK_WORDS):
            chunk = flat[start : start + KEYSTREAM_CHUNK_WORDS]
            keystream = keystream_buffer[: chunk.size]
            for stream, combine in streams:
                stream.fill(keystream)
                combine(chunk, keystream, out=chunk)
        return masked


class MaskedSumAggregator:
    """Aggregator-side stage: holds no keys; adds masked contributions in Z_2^64."""

    @staticmethod
    def add(contributions: Mapping[str, np.ndarray], *, group: Sequence[str]) -> np.ndarray:
        """Sum the masked contributions of exactly ``group``; a new uint64 array.

        Refuses (:class:`MissingContributorError`) contributions whose senders are not exactly
        the group, naming who is missing and who is unexpected; refuses (ValueError, naming the
        sender) a contribution that is not a uint64 array or whose shape differs from the
        others; refuses duplicate names and a group of one.
        """
        members = _check_group(group)
        if len(members) < 2:
            raise ValueError(
                f"a masked sum needs at least 2 contributors, got {list(members)}: a sum over "
                "one party is that party's value"
            )
        senders = set(contributions)
        if senders != set(members):
            raise MissingContributorError(
                missing=set(members) - senders, unexpected=senders - set(members)
            )
        ordered = sorted(members)
        reference_name = ordered[0]
        reference_shape: tuple[int, ...] | None = None
        for sender in ordered:
            contribution = contributions[sender]
            if not isinstance(contribution, np.ndarray) or contribution.dtype != np.uint64:
                got = getattr(contribution, "dtype", type(contribution).__name__)
                raise ValueError(
                    f"the contribution from {sender!r} is not a uint64 masked array (got {got})"
                )
            if reference_shape is None:
                reference_shape = contribution.shape
            elif contribution.shape != reference_shape:
                raise ValueError(
                    f"the contribution from {sender!r} has shape {contribution.shape}, but the "
                    f"one from {reference_name!r} has shape {reference_shape}"
                )
        total = np.array(contributions[reference_name], dtype=np.uint64, order="C", copy=True)
        for sender in ordered[1:]:
            np.add(total, contributions[sender], out=total)
        return total


def decode_sum(total: np.ndarray, *, encoder: FixedPointEncoder, terms: int) -> np.ndarray:
    """Decode a masked sum of ``terms`` contributions: ``encoder.decode(total, terms=terms)``.

    Raises :class:`~crypto.fixedpoint.SumDidNotCancel` when the masks did not cancel. The check
    is probabilistic but sharp: an uncancelled mask is uniform in Z_2^64, so one element passes
    it with probability about ``2 * terms * bound * 2**frac_bits / 2**64`` (2**-21 for 4 terms
    at the defaults), and a whole array only if every element does.
    """
    return encoder.decode(total, terms=terms)
