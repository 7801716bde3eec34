"""The pairwise-masked sum (secure aggregation), as a party stage and an aggregator stage.

Stage 1, at each party u of a group: ``MaskedSumParty.mask`` encodes its value in Z_2^64 and,
for every other member v, adds the keystream of the pair (u, v) for this sum if ``u < v`` and
subtracts it otherwise: AES-128-CTR under the pair's mask key (``crypto.prg.mask_key`` of the
pair key) from the nonce of the sum's domain (``crypto.prg.stream_nonce``), computed as CTR on
one reusable AES context per pair (``crypto.prg.CounterStreams``) or, for a range longer than
``CTR_WORDS_PER_STREAM`` words a pair, by one OpenSSL CTR context per pair and range
(``crypto.prg.ctr_stream``): the same bytes either way. Stage 2, at the aggregator:
``MaskedSumAggregator.add`` adds the contributions; every pairwise mask appears once with each
sign, so the masks cancel and only the sum remains.
Stage 3, at the receiver: ``decode_sum``. Masks are derived for the exact group, so a sum over
any subset of parties cancels, and a sum missing a contributor decodes to an error, not garbage.

A call that masks several tensors for one group (``MaskedSumParty.mask_many``) uses one keystream
per pair for all of them (``MaskCallDomain``: the tensors' names and sizes are part of the nonce,
each tensor's mask is the segment at its offset). Encoding and masking are fused chunk by chunk
in preallocated buffers, and the masks of a future call can be prepared on a background thread
(``MaskedSumParty.prepare``); every path gives the bits of ``crypto.reference.reference_mask``.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from crypto.fixedpoint import FixedPointEncoder
from crypto.keys import MaskingKeyPair, length_prefixed, pair_key
from crypto.prg import (
    MAX_FILL_WORDS,
    MAX_STREAM_WORDS,
    SLACK_WORDS,
    ZERO_BYTES,
    CounterStreams,
    counter_blocks,
    ctr_stream,
    mask_key,
    stream_nonce,
)

__all__ = [
    "MASK_CALL_PREFIX",
    "MASK_CHUNK_WORDS",
    "MASK_DOMAIN_PREFIX",
    "MAX_PREPARED",
    "MaskCallDomain",
    "MaskDomain",
    "MaskedSumAggregator",
    "MaskedSumParty",
    "MissingContributorError",
    "decode_sum",
]

MASK_DOMAIN_PREFIX = b"securevfl/mask-domain/v1"
MASK_CALL_PREFIX = b"securevfl/mask-call/v1"
MASK_BIND_PREFIX = b"securevfl/mask-bind/v1"
# One fused chunk: input, output and a keystream chunk stay in L2 cache together.
MASK_CHUNK_WORDS = 1 << 15
# Above this many words per pair, a range's keystreams come from one CTR context per pair
# (`crypto.prg.ctr_stream`) rather than from counter blocks made for every chunk.
CTR_WORDS_PER_STREAM = 1 << 14
# Each pending preparation holds 8 bytes per value of the call it prepares.
MAX_PREPARED = 8
# rounds of a session whose masked domains the replay guard remembers (older ones are refused)
REPLAY_WINDOW = 1024
# the domains of the latest calls, kept resolved (checked, encoded, digested): a party masks
# the same sums every batch, one round on
_RESOLVED_DOMAINS = 16
assert MASK_CHUNK_WORDS <= MAX_FILL_WORDS and MASK_CHUNK_WORDS % 2 == 0


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
        _check_domain_fields(self)
        if not isinstance(self.tensor, str) or not self.tensor:
            raise ValueError(f"tensor must be a non-empty name, got {self.tensor!r}")

    def encode(self) -> bytes:
        """Unambiguous bytes: prefix, then length-prefixed session, round, sorted group, tensor."""
        parts = [MASK_DOMAIN_PREFIX, *_group_fields(self), length_prefixed(self.tensor.encode())]
        return b"".join(parts)


def _check_domain_fields(domain: MaskDomain | MaskCallDomain) -> None:
    """Check session, round and group of a domain; normalise round to int, group to sorted."""
    if not isinstance(domain.session, bytes) or not domain.session:
        raise ValueError("session must be non-empty bytes")
    if isinstance(domain.round, bool) or not isinstance(domain.round, int | np.integer):
        raise TypeError(f"round must be an int, got {type(domain.round).__name__}")
    if not 0 <= domain.round < 2**64:
        raise ValueError(f"round must be in [0, 2**64), got {domain.round}")
    members = _check_group(domain.group)
    if not members:
        raise ValueError("group must name at least one party")
    object.__setattr__(domain, "round", int(domain.round))
    object.__setattr__(domain, "group", tuple(sorted(members)))


def _round_at(domain: MaskDomain | MaskCallDomain) -> int:
    """Where a domain's encoding holds its round (8 bytes): after the class's prefix and the
    length-prefixed session, the first of `_group_fields`."""
    prefix = MASK_DOMAIN_PREFIX if isinstance(domain, MaskDomain) else MASK_CALL_PREFIX
    return len(prefix) + len(length_prefixed(domain.session))


def _keep_latest(cache: dict, key: Any, value: Any) -> None:
    """``cache[key] = value``, the oldest entry dropped first once it holds
    `_RESOLVED_DOMAINS`."""
    if len(cache) >= _RESOLVED_DOMAINS:
        del cache[next(iter(cache))]
    cache[key] = value


def _group_fields(domain: MaskDomain | MaskCallDomain) -> list[bytes]:
    return [
        length_prefixed(domain.session),
        domain.round.to_bytes(8, "big"),
        len(domain.group).to_bytes(4, "big"),
        *(length_prefixed(member.encode()) for member in domain.group),
    ]


@dataclass(frozen=True)
class MaskCallDomain:
    """What the masks of one call over several tensors are for: (session, round, group,
    tensors), ``tensors`` being (name, number of values) pairs, kept sorted by name.

    One keystream per pair covers the tensors back to back in that order; a tensor's mask is
    the segment at its offset. The names and sizes are part of the nonce, so each segment is
    bound to its tensor, and masks cancel only among members that masked the same call.
    Refuses fewer than two tensors (one tensor is a :class:`MaskDomain`), empty or duplicate
    names, negative sizes, and what :class:`MaskDomain` refuses for session, round and group.
    """

    session: bytes
    round: int
    group: tuple[str, ...]
    tensors: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        _check_domain_fields(self)
        tensors = tuple(self.tensors)
        if len(tensors) < 2:
            raise ValueError("a call domain covers at least 2 tensors; use MaskDomain for one")
        for entry in tensors:
            name, size = entry
            if not isinstance(name, str) or not name:
                raise ValueError(f"tensor must be a non-empty name, got {name!r}")
            if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 0:
                raise ValueError(f"size of tensor {name!r} must be a non-negative int")
        names = [name for name, _ in tensors]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"the call names a tensor more than once: {duplicates}")
        object.__setattr__(
            self, "tensors", tuple(sorted((name, int(size)) for name, size in tensors))
        )

    def encode(self) -> bytes:
        """Unambiguous bytes: prefix, session, round, sorted group, then each (name, size)."""
        parts = [
            MASK_CALL_PREFIX,
            *_group_fields(self),
            len(self.tensors).to_bytes(4, "big"),
        ]
        for name, size in self.tensors:
            parts += [length_prefixed(name.encode()), size.to_bytes(8, "big")]
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
    and (in :meth:`mask` / :meth:`mask_many`) to mask twice under the same domain, which would
    reuse a keystream and reveal the difference of the two inputs to the aggregator.

    Speed. Encoding and masking are fused: each chunk of the output is encoded in place and
    receives every pair's keystream while it is in cache, with no temporaries. ``threads > 1``
    splits a large call into ranges masked concurrently (AES and NumPy release the GIL; each
    range opens the keystreams at its own offset). :meth:`prepare` computes the masks of a
    future call on a background thread, so that call only encodes and adds. Results are bit
    for bit those of :func:`crypto.reference.reference_mask` whatever the path. One object
    serves one caller thread at a time.
    """

    def __init__(
        self,
        *,
        name: str,
        keypair: MaskingKeyPair,
        peer_publics: Mapping[str, bytes],
        session: bytes,
        encoder: FixedPointEncoder,
        threads: int = 1,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if not isinstance(keypair, MaskingKeyPair):
            raise TypeError(f"keypair must be a MaskingKeyPair, got {type(keypair).__name__}")
        if not isinstance(session, bytes) or not session:
            raise ValueError("session must be non-empty bytes (the federation's session id)")
        if not isinstance(encoder, FixedPointEncoder):
            raise TypeError(f"encoder must be a FixedPointEncoder, got {type(encoder).__name__}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive int, got {threads!r}")
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
        self.threads = threads
        self._keypair = keypair
        self._peer_publics = peers
        self._pair_keys: dict[str, bytes] = {}
        self._mask_keys: dict[str, bytes] = {}  # peer -> the pair's AES key (`mask_key`)
        # one reusable AES context per pair key and thread: no cipher set up per round
        self._ciphers = CounterStreams()
        # (round, group, sizes) -> (domain, its encoding, its digest, its nonce) of the latest
        # calls
        self._resolved: dict[tuple, _Resolved] = {}
        # (group, sizes) -> (a checked domain of those sums, its encoding before and after the
        # round): the domain of the same sums in any other round without checking them again
        self._templates: dict[tuple, tuple[MaskDomain | MaskCallDomain, tuple[bytes, bytes]]] = {}
        # sorted group -> the (mask key, add?) of this party's two ring neighbours (`bind`)
        self._bind_streams: dict[tuple[str, ...], list[tuple[bytes, bool]]] = {}
        # replay guard: session -> round -> digests of the domains masked in that round. Only
        # the latest REPLAY_WINDOW rounds of a session are kept; an older round is refused
        # outright (its floor), so the guard stays bounded over a run of any length
        self._used: dict[bytes, dict[int, set[bytes]]] = {}
        self._floor: dict[bytes, int] = {}
        # domain digest -> (buffer of the prepared masks, the job filling it)
        self._prepared: dict[bytes, tuple[np.ndarray, Future[None]]] = {}
        self._prefetch_pool: ThreadPoolExecutor | None = None
        self._split_pool: ThreadPoolExecutor | None = None

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

    def _mask_key(self, peer: str) -> bytes:
        key = self._mask_keys.get(peer)
        if key is None:
            key = self._mask_keys[peer] = mask_key(self._pair_key(peer))
        return key

    def _members(self, group: Sequence[str]) -> tuple[str, ...]:
        """The group, after checking that this party may contribute to a masked sum over it."""
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
        return members

    def domain(self, *, round: int, group: Sequence[str], tensor: str) -> MaskDomain:
        """The mask domain of one contribution, after checking that this party may send it."""
        members = self._members(group)
        return MaskDomain(session=self.session, round=round, group=members, tensor=tensor)

    def call_domain(
        self, *, round: int, group: Sequence[str], sizes: Mapping[str, int]
    ) -> MaskDomain | MaskCallDomain:
        """The domain of a call masking the tensors ``sizes`` (name -> number of values).

        One tensor: its :class:`MaskDomain` (so a one-tensor call is exactly :meth:`mask`).
        Several: a :class:`MaskCallDomain`. Refuses what :meth:`domain` refuses, no tensors,
        and what the domain classes refuse.
        """
        members = self._members(group)
        if not isinstance(sizes, Mapping) or not sizes:
            raise ValueError("a masking call needs at least one named tensor")
        if len(sizes) == 1:
            (tensor,) = sizes
            return MaskDomain(session=self.session, round=round, group=members, tensor=tensor)
        return MaskCallDomain(
            session=self.session, round=round, group=members, tensors=tuple(sizes.items())
        )

    def _resolve(self, round: int, group: Sequence[str], sizes: Mapping[str, int]) -> _Resolved:
        """The call's domain (after every check of :meth:`call_domain` and the encoder's
        ``check_terms``), its encoding, its digest and its keystreams' nonce. The latest ones
        are kept, so the same sums one round on are not checked, encoded and digested again in
        :meth:`prepare` and then in :meth:`mask_many`."""
        memo = template = None
        if type(round) is int and isinstance(group, tuple | list) and isinstance(sizes, dict):
            memo = (round, tuple(group), tuple(sizes.items()))
            found = self._resolved.get(memo)
            if found is not None:
                return found
            template = self._templates.get(memo[1:])
        if template is not None and 0 <= round < 2**64:
            # the same sums in another round: only the round differs, in the domain and at a
            # fixed place of its encoding (`_round_at`); everything else was checked
            first, head = template
            domain = object.__new__(type(first))
            domain.__dict__.update(first.__dict__)
            domain.__dict__["round"] = round
            domain_bytes = head[0] + round.to_bytes(8, "big") + head[1]
        else:
            domain = self.call_domain(round=round, group=group, sizes=sizes)
            self.encoder.check_terms(len(domain.group))
            total = sum(int(size) for size in sizes.values() if isinstance(size, int | np.integer))
            if total > MAX_STREAM_WORDS:
                raise ValueError(
                    f"a masked call of {total} values is beyond one keystream's "
                    f"{MAX_STREAM_WORDS}; split it into several calls"
                )
            domain_bytes = domain.encode()
            if memo is not None:  # the encoding before and after the round
                cut = _round_at(domain)
                assert domain_bytes[cut : cut + 8] == domain.round.to_bytes(8, "big")
                around = (domain_bytes[:cut], domain_bytes[cut + 8 :])
                _keep_latest(self._templates, memo[1:], (domain, around))
        resolved = (
            domain,
            domain_bytes,
            hashlib.blake2b(domain_bytes, digest_size=16).digest(),
            stream_nonce(domain_bytes),
        )
        if memo is not None:
            _keep_latest(self._resolved, memo, resolved)
        return resolved

    def _streams(self, domain: MaskDomain | MaskCallDomain) -> list[tuple[bytes, bool]]:
        """(the pair's mask key, add?) per other member: add if this party's name sorts
        first. Each pair's keystream of the call is that key's stream of the domain's nonce."""
        return [
            (self._mask_key(peer), self.name < peer) for peer in domain.group if peer != self.name
        ]

    def _mark_used(self, domain: MaskDomain | MaskCallDomain, digest: bytes) -> None:
        rounds = self._used.setdefault(domain.session, {})
        rounds.setdefault(domain.round, set()).add(digest)
        if len(rounds) > 2 * REPLAY_WINDOW:  # amortised: prune once per REPLAY_WINDOW rounds
            floor = max(rounds) - REPLAY_WINDOW + 1
            for r in [r for r in rounds if r < floor]:
                del rounds[r]
            self._floor[domain.session] = floor

    def _check_unused(self, domain: MaskDomain | MaskCallDomain, digest: bytes) -> None:
        floor = self._floor.get(domain.session, 0)
        if domain.round < floor:
            raise ValueError(
                f"party {self.name!r} cannot mask for round {domain.round}: this session has "
                f"masked up to round {floor + REPLAY_WINDOW - 1} and tracks only the last "
                f"{REPLAY_WINDOW} rounds, so an older round's masks may already be used; use a "
                "fresh round"
            )
        if digest in self._used.get(domain.session, {}).get(domain.round, ()):
            what = (
                f"tensor {domain.tensor!r}"
                if isinstance(domain, MaskDomain)
                else f"tensors {[name for name, _ in domain.tensors]}"
            )
            raise ValueError(
                f"party {self.name!r} already masked a contribution for round {domain.round}, "
                f"group {list(domain.group)}, {what}: masking again would reuse the "
                "keystream and reveal the difference of the two inputs; resend the first "
                "masked array or use a fresh round"
            )

    def mask(
        self,
        x: np.ndarray,
        *,
        round: int,
        group: Sequence[str],
        tensor: str,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Encode ``x`` and add this party's pairwise masks for ``group``; uint64 of ``x.shape``.

        For every other member v: add the AES-128-CTR keystream of mask_key(pair_key(self, v))
        from the nonce stream_nonce(domain) if
        ``self.name < v`` (string order), else subtract it. The result alone is uniformly random
        in Z_2^64; the sum over the whole group is the encoded sum of the inputs. ``out`` (a
        C-contiguous uint64 array of ``x.size`` elements) receives the result. Refuses: this
        party not in the group, a member with no pinned key, duplicate names, a group of one,
        a group too large for the encoder's ring (``max_terms``), inputs the encoder refuses
        (``out`` is then zeroed), and a domain this object already masked under (keystream
        reuse; a restarted party must resend its stored contribution rather than mask again).
        Masks made ahead for exactly this call are taken by :meth:`mask_prepared`.
        """
        if out is None:
            masked = self.mask_prepared(x, round=round, group=group, tensor=tensor)
            if masked is not None:
                return masked
        return self.mask_many({tensor: x}, round=round, group=group, out=out)[tensor]

    def bind(
        self,
        masked: np.ndarray,
        *,
        round: int,
        group: Sequence[str],
        tensor: str,
        call: bytes,
        in_place: bool = False,
    ) -> np.ndarray:
        """Bind a masked contribution (:meth:`mask`'s output for ``round``, ``group``,
        ``tensor``) to the call it answers: add, for each of this party's two neighbours in
        the sorted group taken as a ring (its one other member in a group of two), the pair's
        keystream from a nonce of the domain and ``call`` (a digest of the whole call this
        party was sent), added if this party's name sorts first, else subtracted. Returns a
        new uint64 array of ``masked``'s shape.

        Members sent the same call add streams that cancel in the sum, which stays the sum of
        the inputs. A member sent another call (another digest) leaves, on each ring edge
        between members with different digests (there are at least two), the difference of
        two independent keystreams: the sum is uniformly random in Z_2^64 and tells nothing.
        So an active party cannot hand the members of one sum different calls (other ids,
        inputs or arguments for each) and still read the sum. Refuses what :meth:`domain`
        refuses and a ``call`` that is not 32 bytes. ``in_place``: add the streams into
        ``masked`` itself (a writeable C-contiguous uint64 array the caller owns, e.g. what
        :meth:`mask` returned) and return it: the same bits, no new array."""
        if not isinstance(call, bytes) or len(call) != 32:
            raise ValueError("call must be the 32-byte digest of the call being answered")
        masked = np.asarray(masked, dtype=np.uint64)
        if in_place and not (masked.flags.c_contiguous and masked.flags.writeable):
            raise ValueError("bind in place needs a writeable C-contiguous uint64 array")
        # the domain `mask` used (one tensor: a `MaskDomain`), checked and encoded then
        domain, domain_bytes, _, _ = self._resolve(round, group, {tensor: int(masked.size)})
        streams = self._bind_streams.get(domain.group)
        if streams is None:
            ring = domain.group  # sorted
            at = ring.index(self.name)
            neighbours = dict.fromkeys((ring[at - 1], ring[(at + 1) % len(ring)]))
            streams = [(self._mask_key(peer), self.name < peer) for peer in neighbours]
            _keep_latest(self._bind_streams, domain.group, streams)
        nonce = stream_nonce(MASK_BIND_PREFIX + length_prefixed(domain_bytes) + call)
        if in_place:
            _add_streams(masked.reshape(-1), streams, nonce, self._ciphers)
            return masked
        net = np.empty(masked.size, dtype=np.uint64)  # the new array returned
        _net_mask(net, streams, nonce, self._ciphers, np.uint64(0))
        np.add(net, masked.reshape(-1), out=net)
        return net.reshape(masked.shape)

    def mask_prepared(
        self, x: np.ndarray, *, round: int, group: Sequence[str], tensor: str
    ) -> np.ndarray | None:
        """:meth:`mask` (which tries this first) for a call whose masks :meth:`prepare` made
        inline (one tensor, the same round, group and size): its checks, encoding and addition
        only, the same bits. None (nothing used up) when no such masks wait (none, another
        size, or made on the worker thread) or the encoder refuses ``x``: :meth:`mask_many`
        then does the call, or says why not."""
        x = self.encoder.check_dtype(x)
        if type(round) is not int or not isinstance(group, tuple | list):
            return None
        resolved = self._resolved.get((round, tuple(group), ((tensor, x.size),)))
        if resolved is None:
            return None
        domain, _, digest, _ = resolved
        prepared = self._prepared.get(digest)
        if prepared is None or prepared[1] is not _DONE or prepared[0].size != x.size:
            return None
        self._check_unused(domain, digest)
        encoded = np.empty(x.size, dtype=np.uint64)
        if not self.encoder.encode_shifted(x.reshape(-1), encoded):
            return None
        net = self._prepared.pop(digest)[0]
        np.add(net, encoded, out=net)
        self._mark_used(domain, digest)
        return net.reshape(x.shape)

    def mask_many(
        self,
        xs: Mapping[str, np.ndarray],
        *,
        round: int,
        group: Sequence[str],
        out: np.ndarray | None = None,
    ) -> dict[str, np.ndarray]:
        """Mask several tensors of one call for one group: name -> uint64 array of its shape.

        One keystream per pair covers all the tensors (:class:`MaskCallDomain`: sorted by name,
        back to back), so the call pays one stream set-up per pair, not one per tensor; each
        tensor's mask is the segment at its offset. The results are views into one buffer of
        ``sum(sizes)`` words (``out`` when given: C-contiguous uint64 of that size). Every
        member must mask the same names and sizes for the masks to cancel. One tensor gives
        exactly :meth:`mask`. Refuses what :meth:`mask` refuses, for any tensor (naming it).
        """
        if not isinstance(xs, Mapping):
            raise TypeError(f"xs must map tensor names to arrays, got {type(xs).__name__}")
        arrays = {tensor: self.encoder.check_dtype(x) for tensor, x in xs.items()}
        domain, _, digest, nonce = self._resolve(
            round, group, {tensor: x.size for tensor, x in arrays.items()}
        )
        self._check_unused(domain, digest)
        names = sorted(arrays)
        inputs = [arrays[tensor].reshape(-1) for tensor in names]
        offsets = [0, *itertools.accumulate(x.size for x in inputs)]
        total = offsets[-1]
        if out is not None and not (
            isinstance(out, np.ndarray)
            and out.dtype == np.uint64
            and out.size == total
            and out.flags.c_contiguous
        ):
            raise ValueError(f"out must be a C-contiguous uint64 array of {total} elements")
        prepared = self._prepared.pop(digest, None)
        net = _prepared_masks(prepared, total)
        # Prepared masks become the output: the encodings are added into them in place.
        in_place = out is None and net is not None
        if out is None:
            out = net if net is not None else np.empty(total, dtype=np.uint64)
        flat_out = out.reshape(-1)
        streams = [] if net is not None else self._streams(domain)
        refused = self._run_fused(inputs, offsets, flat_out, streams, nonce, net, in_place)
        if refused >= 0:
            flat_out.fill(0)  # no partly masked data may escape; the domain stays usable
            if prepared is not None and net is not None and not in_place:
                self._prepared[digest] = prepared
            error = self.encoder.refusal(inputs[refused])
            if len(names) > 1:
                error = type(error)(f"tensor {names[refused]!r}: {error}")
            raise error
        self._mark_used(domain, digest)
        return {
            tensor: flat_out[offsets[i] : offsets[i + 1]].reshape(arrays[tensor].shape)
            for i, tensor in enumerate(names)
        }

    def _run_fused(
        self,
        inputs: list[np.ndarray],
        offsets: list[int],
        out: np.ndarray,
        streams: list[tuple[bytes, bool]],
        nonce: bytes,
        net: np.ndarray | None,
        in_place: bool,
    ) -> int:
        """Mask ``out`` in one or several ranges; -1, or the index of a refused tensor."""
        total = offsets[-1]
        parts = min(self.threads, total // MASK_CHUNK_WORDS)
        # Range edges on chunk multiples: even word offsets, whole chunks per thread.
        edges = [
            (total * i // max(parts, 1)) // MASK_CHUNK_WORDS * MASK_CHUNK_WORDS
            for i in range(max(parts, 1))
        ] + [total]
        jobs = [
            (
                self.encoder.encode_shifted,
                inputs,
                offsets,
                out,
                start,
                stop,
                streams,
                nonce,
                self._ciphers,
                net,
                in_place,
                self.encoder.shift,
            )
            for start, stop in itertools.pairwise(edges)
        ]
        if len(jobs) == 1:
            return _mask_range(*jobs[0])
        if self._split_pool is None:
            self._split_pool = ThreadPoolExecutor(
                max_workers=self.threads - 1, thread_name_prefix="mask-split"
            )
        futures = [self._split_pool.submit(_mask_range, *job) for job in jobs[1:]]
        results = [_mask_range(*jobs[0]), *(future.result() for future in futures)]
        refused = [index for index in results if index >= 0]
        return min(refused) if refused else -1

    def prepare(
        self,
        *,
        round: int,
        group: Sequence[str],
        sizes: Mapping[str, int],
        inline: bool = False,
    ) -> Future[None]:
        """Start computing, on a background thread, the masks of a future call; returns the job
        (done when the masks are ready; waiting on it is never required). ``inline``: compute
        them now, in the calling thread (e.g. while its caller would only wait for a message),
        and return the finished job.

        ``sizes`` maps each tensor of that call to its number of values. A later :meth:`mask`
        or :meth:`mask_many` with the same round, group, names and sizes then only encodes and
        adds (bit-identical results); a call that differs ignores the prepared masks. Nothing
        is sent and the domain is not used up. Refuses what :meth:`call_domain` refuses,
        negative sizes, a domain already masked under, and more than
        :data:`MAX_PREPARED` pending preparations (each holds ``8 * sum(sizes)`` bytes).
        """
        domain, _, digest, nonce = self._resolve(round, group, sizes)
        total = 0
        for tensor, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 0:
                raise ValueError(f"size of tensor {tensor!r} must be a non-negative int")
            total += int(size)
        self._check_unused(domain, digest)
        stale = self._prepared.pop(digest, None)
        if stale is not None:
            if stale[0].size == total:
                self._prepared[digest] = stale
                return stale[1]
            stale[1].cancel()  # same domain, other size: the new preparation replaces it
        if len(self._prepared) >= MAX_PREPARED:
            raise ValueError(
                f"{MAX_PREPARED} preparations are already pending; mask or close() first"
            )
        streams = self._streams(domain)  # keys derived here: the worker only reads
        net = np.empty(total, dtype=np.uint64)
        if inline:
            _net_mask(net, streams, nonce, self._ciphers, self.encoder.shift)
            future = _DONE
        else:
            if self._prefetch_pool is None:
                self._prefetch_pool = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="mask-prep"
                )
            future = self._prefetch_pool.submit(
                _net_mask, net, streams, nonce, self._ciphers, self.encoder.shift
            )
        self._prepared[digest] = (net, future)
        return future

    @property
    def pending(self) -> int:
        """How many prepared masks wait for their call."""
        return len(self._prepared)

    def forget_prepared(self) -> int:
        """Cancel every pending preparation (e.g. one whose sizes did not match the call it
        was made for: its domain is never masked under, so it would wait forever); the domains
        stay unused and the worker threads stay up. Returns how many were dropped."""
        dropped = len(self._prepared)
        for _, future in self._prepared.values():
            future.cancel()
        self._prepared.clear()
        return dropped

    def close(self) -> None:
        """Drop pending preparations and stop the worker threads; the object stays usable."""
        for _, future in self._prepared.values():
            future.cancel()
        self._prepared.clear()
        for pool in (self._prefetch_pool, self._split_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._prefetch_pool = self._split_pool = None
        self._ciphers.clear()


# what `_resolve` gives: (domain, its encoding, its digest, its keystreams' nonce)
_Resolved = tuple[MaskDomain | MaskCallDomain, bytes, bytes, bytes]
# the job of masks prepared inline: finished, never cancelled, shared (it holds no result)
_DONE: Future[None] = Future()
_DONE.set_result(None)


def _prepared_masks(
    prepared: tuple[np.ndarray, Future[None]] | None, total: int
) -> np.ndarray | None:
    """The prepared masks (waiting for them) if they fit this call and were computed."""
    if prepared is None:
        return None
    net, future = prepared
    if future is _DONE and net.size == total:  # made inline: done, never cancelled
        return net
    if net.size != total:
        future.cancel()
        return None
    # A preparation that failed or was cancelled leaves the work to the call itself.
    if future.cancelled() or future.exception() is not None:
        return None
    return net


def _mask_range(
    encode: Callable[[np.ndarray, np.ndarray], bool],
    inputs: Sequence[np.ndarray],
    offsets: Sequence[int],
    out: np.ndarray,
    start: int,
    stop: int,
    streams: Sequence[tuple[bytes, bool]],
    nonce: bytes,
    ciphers: CounterStreams,
    net: np.ndarray | None,
    in_place: bool,
    shift: np.uint64,
) -> int:
    """Encode and mask words ``[start, stop)`` of the concatenated tensors into ``out``.

    Chunk by chunk, while it is in cache: the encoder writes ``encoding + shift``, then either
    the prepared masks ``net`` (which include ``-shift``) are added, or every pair's keystream
    (from word ``start``, an even offset: a whole block) and ``-shift`` are. ``in_place``
    (``net`` is ``out``): the encodings go to a scratch chunk and are added into it. Returns
    -1, or the index of the first tensor the encoder refused (``out`` is then partly
    written).
    """
    if start >= stop:
        return -1
    chunk_words = min(MASK_CHUNK_WORDS, stop - start)
    scratch, blocks = _keystream_buffers(
        chunk_words if net is None or in_place else 0, chunk_words if net is None else 0
    )
    scratch_bytes = scratch.view(np.uint8)
    # a long range: one CTR context per pair (its set-up once) instead of the counter blocks
    # of every chunk under the pair's reusable ECB context; the same keystream bytes
    ctr = stop - start > CTR_WORDS_PER_STREAM * len(streams)
    fills = [
        (
            ctr_stream(key, nonce, start // 2) if ctr else ciphers.encryptor(key),
            np.add if add else np.subtract,
        )
        for key, add in (streams if net is None else ())
    ]
    tensor = bisect.bisect_right(offsets, start) - 1
    for chunk_start in range(start, stop, MASK_CHUNK_WORDS):
        chunk_stop = min(chunk_start + MASK_CHUNK_WORDS, stop)
        words = chunk_stop - chunk_start
        chunk = out[chunk_start:chunk_stop]
        encoded = scratch[:words] if in_place else chunk
        position = chunk_start
        while position < chunk_stop:
            while offsets[tensor + 1] <= position:  # skips empty tensors too
                tensor += 1
            segment_stop = min(chunk_stop, offsets[tensor + 1])
            base = offsets[tensor]
            if not encode(
                inputs[tensor][position - base : segment_stop - base],
                encoded[position - chunk_start : segment_stop - chunk_start],
            ):
                return tensor
            position = segment_stop
        if net is not None:
            np.add(chunk, encoded if in_place else net[chunk_start:chunk_stop], out=chunk)
            continue
        if fills:
            counters = _stream_input(ctr, nonce, chunk_start, words, blocks)
            keystream = scratch[:words]
            for fill, combine in fills:
                fill(counters, scratch_bytes)
                combine(chunk, keystream, out=chunk)
        if shift:
            np.subtract(chunk, shift, out=chunk)
    return -1


def _stream_input(ctr: bool, nonce: bytes, start: int, words: int, blocks: np.ndarray) -> Any:
    """What a chunk of ``words`` keystream words from word ``start`` (even) is encrypted from:
    zeros for CTR contexts (each continues where its last chunk ended), else the chunk's
    counter blocks for the pairs' ECB contexts, made in ``blocks``."""
    if ctr:
        return ZERO_BYTES[: 16 * ((words + 1) // 2)]
    return counter_blocks(nonce, start // 2, (words + 1) // 2, blocks)


def _keystream_buffers(words: int, block_words: int) -> tuple[np.ndarray, np.ndarray]:
    """A uint64 scratch for ``words`` keystream words, with ECB's slack past its last whole
    block, and a uint8 buffer for the counter blocks of ``block_words`` words."""
    scratch = np.empty(words + (words & 1) + SLACK_WORDS, dtype=np.uint64)
    return scratch, np.empty(16 * ((block_words + 1) // 2), dtype=np.uint8)


def _add_streams(
    out: np.ndarray, streams: Sequence[tuple[bytes, bool]], nonce: bytes, ciphers: CounterStreams
) -> None:
    """Add (or subtract) each stream's keystream of ``nonce`` into ``out`` (flat uint64),
    chunk by chunk while it is in cache."""
    total = out.size
    if total == 0 or not streams:
        return
    ctr = total > CTR_WORDS_PER_STREAM * len(streams)  # as in `_mask_range`
    fills = [
        (
            ctr_stream(key, nonce, 0) if ctr else ciphers.encryptor(key),
            np.add if add else np.subtract,
        )
        for key, add in streams
    ]
    chunk_words = min(MASK_CHUNK_WORDS, total)
    keystream, blocks = _keystream_buffers(chunk_words, chunk_words)
    keystream_bytes = keystream.view(np.uint8)
    for start in range(0, total, MASK_CHUNK_WORDS):
        stop = min(start + MASK_CHUNK_WORDS, total)
        words = stop - start
        chunk = out[start:stop]
        counters = _stream_input(ctr, nonce, start, words, blocks)
        for fill, combine in fills:
            fill(counters, keystream_bytes)
            combine(chunk, keystream[:words], out=chunk)


def _net_mask(
    net: np.ndarray,
    streams: Sequence[tuple[bytes, bool]],
    nonce: bytes,
    ciphers: CounterStreams,
    shift: np.uint64,
) -> None:
    """Write this party's whole mask minus ``shift`` (the sum of +-keystreams) into ``net``."""
    if net.size == 0:
        return
    net.fill(np.uint64((-int(shift)) % (1 << 64)))
    _add_streams(net, streams, nonce, ciphers)


class MaskedSumAggregator:
    """Aggregator-side stage: holds no keys; adds masked contributions in Z_2^64 (or in
    Z_2^32, for sums whose contributions were narrowed: `FixedPointEncoder.ring_dtype`)."""

    @staticmethod
    def add(
        contributions: Mapping[str, np.ndarray],
        *,
        group: Sequence[str],
        ring: np.dtype | type = np.uint64,
    ) -> np.ndarray:
        """Sum the masked contributions of exactly ``group`` in the ring of ``ring`` (uint64,
        or uint32 for Z_2^32); a new array of that dtype.

        Refuses (:class:`MissingContributorError`) contributions whose senders are not exactly
        the group, naming who is missing and who is unexpected; refuses (ValueError, naming the
        sender) a contribution that is not an array of ``ring``'s dtype or whose shape differs
        from the others; refuses duplicate names and a group of one.
        """
        ring = np.dtype(ring)
        if ring not in (np.dtype(np.uint64), np.dtype(np.uint32)):
            raise ValueError(f"ring must be uint64 or uint32, got {ring}")
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
            if not isinstance(contribution, np.ndarray) or contribution.dtype != ring:
                got = getattr(contribution, "dtype", type(contribution).__name__)
                raise ValueError(
                    f"the contribution from {sender!r} is not a {ring} masked array (got {got})"
                )
            if reference_shape is None:
                reference_shape = contribution.shape
            elif contribution.shape != reference_shape:
                raise ValueError(
                    f"the contribution from {sender!r} has shape {contribution.shape}, but the "
                    f"one from {reference_name!r} has shape {reference_shape}"
                )
        total = np.array(contributions[reference_name], dtype=ring, order="C", copy=True)
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
