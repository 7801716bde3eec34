"""The one secure-sum interface, with backends `plain`, `mask` and `ckks`.

A sum has three stages, each in a different process:

* party stage (`PartySumStage.protect`): turns a party's float tensor into the named arrays it
  sends to the aggregator (plain floats, masked ring elements, or CKKS ciphertext chunks);
* aggregator stage (`AggregatorSumStage.combine`): adds the contributions of exactly the group;
* active stage (`ActiveSumStage.reveal`): turns the combined arrays back into the float sum.

Methods never see which backend runs. Secure backends refuse sums with fewer than `min_group`
passive contributors (a sum over one party *is* that party's representation).
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import combinations
from typing import Any, ClassVar

import numpy as np

from crypto import FixedPointEncoder, MaskedSumAggregator, MaskedSumParty, MaskingKeyPair


class GroupTooSmall(ValueError):
    """A secure sum was asked over fewer contributors than `min_group`."""


class ContributionError(ValueError):
    """A contribution does not fit the sum (wrong names, shapes or dtypes)."""


@dataclass
class SumSession:
    """What a role needs to take part in the secure sums of one session."""

    name: str
    session: bytes
    min_group: int = 2
    frac_bits: int = 20
    bound: float = 2.0**20
    mask_keypair: MaskingKeyPair | None = None
    mask_publics: Mapping[str, bytes] = field(default_factory=dict)
    ckks_public_context: bytes | None = None
    # how a CKKS party makes its encryptions of zero ahead (ZERO_MODES); None: the default.
    # $SECUREVFL_CKKS_ZEROS overrides it.
    ckks_zeros: str | None = None
    # a crypto.ckks_zeros.ZeroSource started before the context was known (`start_zero_helper`),
    # for the helper and process modes to attach instead of starting one
    ckks_zero_helper: Any = None
    # the key holder's release of decrypted sums (crypto.ckks.DecryptionRelease)
    ckks_release: Any = None


def group_allowed(cfg: Any, group: Sequence[str]) -> bool:
    """The min_group rule, in one place: a secure sum needs at least `min_group` distinct passive
    parties among its contributors (the active party and the aggregator never count); plain
    aggregation, a baseline, allows any group."""
    if cfg.aggregation == "plain":
        return True
    return len(set(group) & set(cfg.party_names)) >= cfg.min_group


def check_group(cfg: Any, group: Sequence[str], *, key: str, what: str) -> None:
    """Refuse (`GroupTooSmall`) a secure sum that `group_allowed` refuses; `what` names the
    step that asked for it."""
    if not group_allowed(cfg, group):
        passive = sorted(set(group) & set(cfg.party_names))
        raise GroupTooSmall(
            f"{what}: secure sum {key!r} over {list(group)} has {len(passive)} passive "
            f"contributor(s), fewer than min_group = {cfg.min_group}; a sum over so few parties "
            "reveals their contributions. The method must skip this sum, or set [run] "
            "min_group = 1 to accept unprotected sums explicitly (they are recorded as "
            "unprotected releases)"
        )


@lru_cache(maxsize=4096)
def isolating_set(family: tuple[frozenset[str], ...], min_group: int) -> tuple[str, ...] | None:
    """A set of fewer than `min_group` parties whose summed contribution some linear combination
    of the family's sums isolates, or None. Exact: with A the sums' indicator matrix, the row
    space of A holds a nonzero vector supported on a set T iff rank(A) > rank(A without the
    columns of T); any such T can be grown to min_group - 1 parties."""
    parties = sorted(set().union(*family)) if family else []
    size = min_group - 1
    if size < 1 or not parties:
        return None
    a = np.array([[1.0 if p in g else 0.0 for p in parties] for g in family])
    rank = np.linalg.matrix_rank(a)
    for t in combinations(range(len(parties)), min(size, len(parties))):
        rest = [j for j in range(len(parties)) if j not in t]
        if not rest or np.linalg.matrix_rank(a[:, rest]) < rank:
            return tuple(parties[j] for j in t)
    return None


class PartySumStage(ABC):
    backend: ClassVar[str]

    def __init__(self, s: SumSession) -> None:
        self.s = s

    @abstractmethod
    def protect(
        self,
        x: np.ndarray,
        *,
        round: int,
        group: Sequence[str],
        key: str,
        call: bytes | None = None,
    ) -> dict[str, np.ndarray]:
        """Arrays to send for this party's contribution `x` to sum `key` over `group`. `call`:
        the 32-byte digest of the call being answered (`guard.CallGuard.binding`), to which a
        secure backend binds the contribution, so that a sum whose members were sent different
        calls does not open. mask: cryptographically (`MaskedSumParty.bind`: the sum is random
        ring elements); ckks: the binding travels with the ciphertexts and the aggregator,
        which must not collude with the key holder anyway, adds only a group whose bindings
        are all equal (`CkksAggregator.combine_accepted`). plain cannot."""

    def expect(self, sums: Sequence[tuple[int, Sequence[str], str, int]]) -> None:
        """The sums (round, group, key, number of values) the call now being computed will
        contribute to, announced before its values exist so that value-independent work can
        start on another thread while the method computes (e.g. on a GPU). A guess: a call
        that turns out different only loses the head start. Nothing by default."""
        return None


class AggregatorSumStage(ABC):
    """Validates each contribution as it arrives (`accept`, so one malformed contribution is
    rejected alone and the aggregator keeps serving), then adds exactly the group's."""

    backend: ClassVar[str]

    def __init__(self, s: SumSession) -> None:
        self.s = s

    @abstractmethod
    def accept(self, arrays: Mapping[str, np.ndarray], *, key: str, sender: str) -> Any:
        """Check one contribution to sum `key`; return it in the form `combine_accepted` adds.
        Raises ContributionError naming the sender and the problem."""

    @abstractmethod
    def combine_accepted(
        self, accepted: Mapping[str, Any], *, group: Sequence[str], key: str
    ) -> dict[str, np.ndarray]:
        """Add the accepted contributions of exactly `group`."""

    def combine(
        self,
        contributions: Mapping[str, Mapping[str, np.ndarray]],
        *,
        group: Sequence[str],
        key: str,
    ) -> dict[str, np.ndarray]:
        """Accept then add the contributions (party -> its arrays) of exactly `group`."""
        _check_members(contributions, group, key)
        return self.combine_accepted(
            {p: self.accept(a, key=key, sender=p) for p, a in contributions.items()},
            group=group,
            key=key,
        )


class ActiveSumStage(ABC):
    backend: ClassVar[str]

    def __init__(self, s: SumSession) -> None:
        self.s = s

    @abstractmethod
    def reveal(
        self,
        combined: Mapping[str, np.ndarray],
        *,
        group: Sequence[str],
        key: str,
        shape: tuple[int, ...],
    ) -> np.ndarray:
        """The float64 sum, of `shape`."""

    def waiting(self) -> None:
        """The active party is about to wait for a result: value-independent work for the
        next reveal may be done now. Nothing by default."""
        return None


def _one(arrays: Mapping[str, np.ndarray], key: str, who: str) -> np.ndarray:
    if set(arrays) != {key}:
        raise ContributionError(f"{who} sent tensors {sorted(arrays)} for sum {key!r}")
    return arrays[key]


def _check_members(contributions: Mapping[str, object], group: Sequence[str], key: str) -> None:
    missing = sorted(set(group) - set(contributions))
    extra = sorted(set(contributions) - set(group))
    if missing or extra:
        raise ContributionError(
            f"sum {key!r}: missing contributions from {missing}, unexpected ones from {extra}"
        )


# ---------------------------------------------------------------------------------- plain


class PlainParty(PartySumStage):
    backend = "plain"

    def protect(self, x, *, round, group, key, call=None):
        # exact: a float32 tensor stays float32, anything else travels as float64
        x = np.asarray(x)
        return {key: np.ascontiguousarray(x if x.dtype == np.float32 else x.astype(np.float64))}


class PlainAggregator(AggregatorSumStage):
    backend = "plain"

    def accept(self, arrays, *, key, sender):
        a = _one(arrays, key, sender)
        if a.dtype.kind != "f":
            raise ContributionError(
                f"{sender}: plain contribution to {key!r} is {a.dtype}, not floating point"
            )
        return a

    def combine_accepted(self, accepted, *, group, key):
        _check_members(accepted, group, key)
        shapes = {a.shape for a in accepted.values()}
        if len(shapes) != 1:
            raise ContributionError(f"sum {key!r}: contributions have different shapes {shapes}")
        # in float64, added in order (the bits of np.sum over the stacked copies, without them)
        arrays = iter(accepted.values())
        total = next(arrays).astype(np.float64)
        for a in arrays:
            total += a
        return {key: total}


class PlainActive(ActiveSumStage):
    backend = "plain"

    def reveal(self, combined, *, group, key, shape):
        return np.asarray(_one(combined, key, "aggregator"), dtype=np.float64).reshape(shape)


# ---------------------------------------------------------------------------------- mask


def _encoder(s: SumSession) -> FixedPointEncoder:
    return FixedPointEncoder(frac_bits=s.frac_bits, bound=s.bound)


#: $SECUREVFL_MASK_AHEAD=0 turns off the masks a party makes ahead while it waits
#: (`MaskParty.idle`); on by default. What is sent is bit-identical either way.
MASK_AHEAD_ENV = "SECUREVFL_MASK_AHEAD"


def masks_ahead() -> bool:
    """Whether a masking party makes the next call's masks while it waits for that call."""
    from securevfl.config import env_switch

    return env_switch(MASK_AHEAD_ENV, default=True)


class MaskParty(PartySumStage):
    backend = "mask"

    def __init__(self, s: SumSession) -> None:
        super().__init__(s)
        if s.mask_keypair is None:
            raise ValueError(f"{s.name}: mask aggregation needs this party's masking key pair")
        self.encoder = _encoder(s)
        self.masker = MaskedSumParty(
            name=s.name,
            keypair=s.mask_keypair,
            peer_publics=dict(s.mask_publics),
            session=s.session,
            encoder=self.encoder,
        )
        self.ahead = masks_ahead()
        # the sums of the last two calls that masked: (round, ((group, key, values), ...))
        self._calls: list[tuple[int, list[tuple[tuple[str, ...], str, int]]]] = []
        self.ahead_made = 0
        self.ahead_used = 0
        self._waited_after: int | None = None  # the round of the last masked call before a wait

    def idle(self) -> None:
        """Work ahead while the party waits for its next call (its loop calls this once the
        contribution is sent): the masks of the sums that call will most likely ask for — the
        last call's sums again, its round advanced by the step between the last two calls —
        made now, in this thread, so that the call only encodes and adds (bit-identical
        output). A wrong guess costs only this wait: its masks are dropped unused and their
        domains are never used; nothing is sent."""
        if not self.ahead:
            return
        latest = self._calls[-1][0] if self._calls else None
        if latest == self._waited_after:  # no masked call since the last wait: its guess stands
            return
        self._waited_after = latest
        self.masker.forget_prepared()  # an earlier guess this call did not take
        if len(self._calls) < 2:
            return
        (before, sums_before), (last, sums_last) = self._calls
        if sums_before != sums_last or last <= before:
            return
        for group, key, size in sums_last:
            try:
                self.masker.prepare(
                    round=last + (last - before), group=group, sizes={key: size}, inline=True
                )
            except ValueError:  # e.g. that domain is used already: the call will say why
                return
            self.ahead_made += 1

    def stats(self) -> dict[str, Any]:
        return {"mask_ahead": {"made": self.ahead_made, "used": self.ahead_used}}

    def _note(self, round: int, group: Sequence[str], key: str, size: int) -> None:
        if self._calls and self._calls[-1][0] == round:
            self._calls[-1][1].append((tuple(group), key, size))
            return
        self._calls = [*self._calls[-1:], (round, [(tuple(group), key, size)])]

    def expect(self, sums):
        """The keystreams of the expected sums, generated on the masker's worker thread while
        the method computes; `protect` then only encodes and adds (bit-identical output).
        Preparations of an earlier call that went unused (their sizes differed) are dropped
        first: their domains stay unused."""
        self.masker.forget_prepared()
        for round, group, key, size in sums:
            if len(group) > 1 and size > 0:
                try:
                    self.masker.prepare(round=round, group=group, sizes={key: int(size)})
                except ValueError:  # e.g. a domain already used: `protect` will say why
                    return

    def protect(self, x, *, round, group, key, call=None):
        if len(group) == 1:  # explicit min_group = 1 opt-in: nothing to mask against
            return {key: self.encoder.encode(np.asarray(x, dtype=np.float64))}
        # float32 values are encoded as they are (exactly as their float64 copy would be)
        x = np.asarray(x)
        pending = self.masker.pending
        masked = self.masker.mask(x, round=round, group=group, tensor=key)
        self.ahead_used += self.masker.pending < pending  # it took masks made ahead
        self._note(round, group, key, int(x.size))
        if call is not None:  # the sum opens only if every member was sent this call
            masked = self.masker.bind(  # into the array `mask` just made for this call
                masked, round=round, group=group, tensor=key, call=call, in_place=True
            )
        if self.encoder.ring_dtype(terms=len(group), size=int(x.size)) == np.uint32:
            masked = self.encoder.narrow(masked)  # half the bytes; the masks still cancel
        return {key: masked}


def _ring(encoder: FixedPointEncoder, group: Sequence[str], size: int) -> np.dtype:
    """The ring of a masked sum of ``group`` over ``size`` values (`MaskParty.protect`): a
    group of one is encoded, not masked, and stays in Z_2^64."""
    if len(group) == 1:
        return np.dtype(np.uint64)
    return encoder.ring_dtype(terms=len(group), size=size)


class MaskAggregator(AggregatorSumStage):
    backend = "mask"

    def __init__(self, s: SumSession) -> None:
        super().__init__(s)
        self.encoder = _encoder(s)

    def accept(self, arrays, *, key, sender):
        a = _one(arrays, key, sender)
        if a.dtype != np.uint64 and a.dtype != np.uint32:
            raise ContributionError(
                f"{sender}: masked contribution to {key!r} is {a.dtype}, not uint64 or uint32 "
                "ring elements"
            )
        return a

    def combine_accepted(self, accepted, *, group, key):
        _check_members(accepted, group, key)
        size = next(iter(accepted.values())).size
        ring = _ring(self.encoder, group, size)
        for sender in sorted(accepted):
            if accepted[sender].dtype != ring:
                raise ContributionError(
                    f"{sender}: masked contribution to {key!r} is {accepted[sender].dtype}; a "
                    f"sum of {len(group)} contributions of {size} values with this session's "
                    f"encoding travels as {ring}"
                )
        if len(group) == 1:  # explicit min_group = 1: nothing to add
            return {key: np.array(accepted[group[0]], dtype=np.uint64)}
        return {key: MaskedSumAggregator.add(dict(accepted), group=group, ring=ring)}


class MaskActive(ActiveSumStage):
    backend = "mask"

    def __init__(self, s: SumSession) -> None:
        super().__init__(s)
        self.encoder = _encoder(s)

    def reveal(self, combined, *, group, key, shape):
        total = _one(combined, key, "aggregator")
        ring = _ring(self.encoder, group, int(np.prod(shape)))
        if total.dtype != ring:
            raise ValueError(
                f"the masked sum is {total.dtype}; a sum of {len(group)} contributions of "
                f"{int(np.prod(shape))} values with this session's encoding is {ring}"
            )
        return self.encoder.decode(total, terms=len(group)).reshape(shape)


# ---------------------------------------------------------------------------------- ckks


#: How a CKKS party makes the encryptions of zero its contributions add their values to
#: ($SECUREVFL_CKKS_ZEROS, else the party's `SumSession.ckks_zeros`, else `DEFAULT_ZERO_MODE`;
#: `bench/ckks_overhead.py --ablation` compares them):
#: ``helper`` (a party running as its own process, `securevfl party` / `securevfl run`): a
#: child process at nice 19 under SCHED_IDLE makes them into a pipe (`crypto.ckks_zeros`),
#: from CPU time the federation leaves idle; each wait of the party (`CkksParty.idle`) takes
#: what the pipe holds (a non-blocking read and a checked load, ~0.07 ms each) and makes the
#: rest itself, as ``idle`` does. On a host of its own the helper makes them all; on a busy
#: one the party's own wait does. Falls back to ``idle`` where the child cannot be started.
#: ``idle`` (the default of in-process federations, where a helper process per party would
#: cost more than it saves): in the party's own thread once its contribution is sent and
#: it waits for the next call (`CkksParty.idle`, called by the party's loop),
#: `CKKS_IDLE_DELAY_S` after the send (none by default), as many as the calls since the last
#: wait used.
#: ``thread``: a worker thread woken at the end of each call, which first waits
#: `CKKS_PREP_DELAY_S` so that the contribution is sent before SEAL takes the GIL.
#: ``process``: the helper process alone, started by the party's first wait; a call takes what
#: is ready and encrypts the rest afresh. Falls back to ``thread`` where the child cannot be
#: started.
#: ``fresh``: none prepared; each chunk is encrypted within the call.
#: Side by side on a quiet 2-core machine (Credit, 4 parties) ``idle`` with no delay beat
#: ``thread`` in every repeat, 1.62x plain against 1.72x, and ``helper`` (started with the
#: party) beat ``idle`` in 5 of 6 paired repeats, median epoch 0.577 s against 0.719 s (see the
#: README's CKKS section): the zeros are made while the party would only wait, or by a process
#: that runs only when a core would otherwise be idle.
ZERO_MODES = ("thread", "process", "idle", "fresh", "helper")
ZEROS_ENV = "SECUREVFL_CKKS_ZEROS"
DEFAULT_ZERO_MODE = "idle"
#: what a party running as its own process uses (`securevfl.roles.party`)
PROCESS_ZERO_MODE = "helper"


def start_zero_helper(default: str | None) -> Any:
    """For a party about to set up a CKKS run: the low-priority helper process of the
    ``helper`` / ``process`` modes, started now without its context, so that it imports while
    the run sets up (`SumSession.ckks_zero_helper`); None when the mode that `default` and
    $SECUREVFL_CKKS_ZEROS give uses none, or the helper cannot start. The caller closes it."""
    if _zero_mode(default or DEFAULT_ZERO_MODE) not in ("helper", "process"):
        return None
    from crypto.ckks import CkksError
    from crypto.ckks_zeros import ZeroSource

    try:
        return ZeroSource()
    except CkksError:
        return None


def _zero_mode(default: str = DEFAULT_ZERO_MODE) -> str:
    """$SECUREVFL_CKKS_ZEROS, else `default`; refuses anything but `ZERO_MODES`."""
    text = os.environ.get(ZEROS_ENV, "").strip() or default
    if text not in ZERO_MODES:
        raise ValueError(
            f"{ZEROS_ENV}={text!r} is not one of {', '.join(ZERO_MODES)}; unset it for the "
            f"default ({DEFAULT_ZERO_MODE})."
        )
    return text


def _prep_delay(default: float = 0.002) -> float:
    """How long a party waits after its send before it makes the next call's encryptions of
    zero: $SECUREVFL_CKKS_PREP_DELAY seconds (benchmarks set it to compare), else `default`
    (the ``thread`` mode's worker: 2 ms, as SEAL holds the GIL and, started at once, would
    delay this call's send; the ``idle`` mode: none, its send has gone already)."""
    text = os.environ.get("SECUREVFL_CKKS_PREP_DELAY", "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 10.0:
        raise ValueError(
            f"SECUREVFL_CKKS_PREP_DELAY={text!r} is not a delay in seconds between 0 and 10; "
            f"unset it for the default ({default:g})."
        )
    return value


CKKS_PREP_DELAY_S = _prep_delay()
CKKS_IDLE_DELAY_S = _prep_delay(0.0)
# the most zeros `CkksParty.idle` keeps ready (each ~80 KB at the Credit defaults)
_MAX_IDLE_ZEROS = 64


#: The name, after ``<key>/``, of the binding a CKKS contribution carries next to its
#: ciphertext chunks ``<key>/0``, ``<key>/1``, ...: not a number, so never a chunk's name.
CKKS_BINDING = "call"
#: bytes of a binding: a SHA-256 digest of the call answered (`guard.CallGuard.binding`)
CKKS_BINDING_BYTES = 32
#: The binding of a contribution made without a call (a unit use of the stage, no guard): a
#: value distinct from every call's digest, so it never passes for a bound member's. In a run
#: a party always has its call's (the guard sets it when the call authenticates, before any
#: operation computes; set-up and checkpoint calls have no sums).
CKKS_UNBOUND = bytes(CKKS_BINDING_BYTES)


def _binding_name(key: str) -> str:
    return f"{key}/{CKKS_BINDING}"


def _is_index(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _chunks(arrays: Mapping[str, np.ndarray], key: str, who: str) -> list[bytes]:
    prefix = f"{key}/"
    numbered = [n for n in arrays if n.startswith(prefix) and _is_index(n[len(prefix) :])]
    if not numbered or len(numbered) != len(arrays):
        raise ContributionError(f"{who} sent tensors {sorted(arrays)[:5]} for CKKS sum {key!r}")
    names = sorted(numbered, key=lambda n: int(n[len(prefix) :]))
    if [int(n[len(prefix) :]) for n in names] != list(range(len(names))):
        raise ContributionError(f"{who}: CKKS chunks of {key!r} are not numbered 0..n-1")
    return [arrays[n].tobytes() for n in names]


def _chunk_arrays(key: str, chunks: Sequence[bytes]) -> dict[str, np.ndarray]:
    return {f"{key}/{i}": np.frombuffer(c, dtype=np.uint8) for i, c in enumerate(chunks)}


def _binding_array(call: bytes | None) -> np.ndarray:
    """What a CKKS party sends as the binding of the call it answers (`CKKS_BINDING`)."""
    binding = CKKS_UNBOUND if call is None else bytes(call)
    if len(binding) != CKKS_BINDING_BYTES:
        raise ValueError(
            f"a call binding is {CKKS_BINDING_BYTES} bytes (the call's SHA-256 digest), "
            f"not {len(binding)}"
        )
    return np.frombuffer(binding, dtype=np.uint8)


@dataclass(frozen=True)
class CkksAccepted:
    """One member's checked contribution to a CKKS sum: its loaded ciphertext chunks and the
    binding of the call it answered."""

    chunks: list[Any]
    binding: bytes


class CkksParty(PartySumStage):
    backend = "ckks"

    def __init__(self, s: SumSession, *, zeros: str | None = None) -> None:
        """`zeros`: how encryptions of zero are made ahead (`ZERO_MODES`); None reads
        $SECUREVFL_CKKS_ZEROS, else the session's ``ckks_zeros``, else ``idle``."""
        super().__init__(s)
        from crypto.ckks import CkksPublic

        if s.ckks_public_context is None:
            raise ValueError(f"{s.name}: ckks aggregation needs the key holder's public context")
        self.public = CkksPublic(context_bytes=s.ckks_public_context)
        self.zeros = _zero_mode(s.ckks_zeros or DEFAULT_ZERO_MODE) if zeros is None else zeros
        if self.zeros not in ZERO_MODES:
            raise ValueError(f"zeros={self.zeros!r}: choose one of {', '.join(ZERO_MODES)}")
        # process mode: the crypto.ckks_zeros.ZeroSource, started by the first `idle` (only a
        # party's own loop waits between calls; in-process federations start no helper)
        self.source: Any = None
        self._used = 0  # ciphertext chunks the calls since the last `idle` encrypted
        self._recent: list[int] = []  # the same for the last 4 waits
        self._ahead: Any = None  # thread mode: the encryptions of zero being made
        self._pool: Any = None
        self._wake: Any = None  # set when the next call comes before the worker's delay ran out

    def protect(self, x, *, round, group, key, call=None):
        """The ciphertext chunks ``key/0``, ``key/1``, ... and, as ``key/call``, the binding of
        the call answered (`CKKS_UNBOUND` without one): the aggregator adds the group only if
        every member's is the same. Refuses a `call` that is not 32 bytes."""
        binding = _binding_array(call)  # before any work: a bad binding is the caller's bug
        flat = np.asarray(x, dtype=np.float64).reshape(-1)
        peak = self._check_magnitude(flat, group=group, key=key)
        self._join()  # one thread in the context at a time
        packed = self.public.encrypt(flat, max_abs=peak)
        self._used += len(packed.chunks)
        if self.zeros == "thread":
            self._prepare(flat.size)
        return {**_chunk_arrays(key, packed.chunks), _binding_name(key): binding}

    def _check_magnitude(self, flat: np.ndarray, *, group: Sequence[str], key: str) -> float:
        """Refuse a contribution whose values a sum of ``len(group)`` such contributions could
        carry past what the parameters decrypt (``2**magnitude_bits``): CKKS would not fail
        there, it would decrypt to wrong numbers. Values up to the configured magnitude
        ([secure] ckks.magnitude, or the method's) always pass: the parameters were sized for
        every party's and the active party's value at that bound. Returns ``max |flat|``
        (NaN where a value is NaN: the encryption refuses it)."""
        limit = 2.0**self.public.params.magnitude_bits / max(len(group), 1)
        if flat.size == 0:
            return 0.0
        peak = float(np.max(np.abs(flat)))
        if peak > limit:  # NaN and infinities are refused by the encryption itself
            # a failure of this party (reported to the aggregator, which stops every role)
            raise ValueError(
                f"a value of this party's contribution to the CKKS sum {key!r} is "
                f"{peak:.4g}, beyond {limit:.4g}, the most each of {len(group)} contributions "
                "may carry for the sum to decrypt correctly with this run's parameters (sized "
                "from [secure] ckks.magnitude, or the method's declared magnitude); set a "
                "larger [secure] ckks.magnitude and resume from the last checkpoint"
            )
        return peak

    def _start_source(self) -> None:
        import weakref

        from crypto.ckks import CkksError
        from crypto.ckks_zeros import ZeroSource

        try:
            helper = self.s.ckks_zero_helper
            if helper is not None and helper.alive and not helper.attached:
                helper.attach(self.public, self.s.ckks_public_context)
                self.source = helper
            else:
                self.source = ZeroSource(self.public, self.s.ckks_public_context)
        except CkksError:
            # no helper process here: the party's own wait (helper) or a worker thread makes them
            self.zeros = "idle" if self.zeros == "helper" else "thread"
            return
        self.public.attach_zero_source(self.source)
        weakref.finalize(self, self.source.close)

    def stats(self) -> dict[str, Any]:
        """For the party's run statistics: how its encryptions of zero were made, and how many
        came from the helper process."""
        return {
            "ckks_zeros": self.zeros,
            "ckks_zeros_from_helper": 0 if self.source is None else self.source.taken,
        }

    def close(self) -> None:
        """Stop this party's zero helpers: the worker thread of ``thread`` mode, once its
        pending preparation is done, and the helper process of ``process`` mode (also done at
        exit). A later call starts a worker again."""
        self._join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.source is not None:
            self.public.attach_zero_source(None)
            self.source.close()

    def idle(self) -> None:
        """The party's contribution is sent and it waits for the next call (the party's loop
        calls this after each send). In ``process`` mode the first wait starts the helper
        process (``helper`` too). In ``idle`` mode, make here, in the caller's thread and
        `CKKS_IDLE_DELAY_S` after the send, the encryptions of zero that bring the ready ones
        up to what the calls between two waits used (the most over the last 4 waits, at most
        `_MAX_IDLE_ZEROS`), so the next call of the same shape only encodes, adds and
        serialises: no other thread is woken, and the send has already gone. In ``helper``
        mode take them from the helper's pipe first and make only the rest. Each zero is used
        once (`CkksPublic.encrypt`)."""
        from crypto.ckks import MAX_PREPARED_ZEROS

        self._recent = [*self._recent[-3:], self._used]
        self._used = 0
        if self.zeros in ("process", "helper") and self.source is None:
            self._start_source()  # from now on a helper makes them (falls back without one)
        if self.zeros not in ("idle", "helper"):
            return
        # rounds alternate between calls of different shapes: cover the largest of the last 4
        want = min(max(self._recent), _MAX_IDLE_ZEROS, MAX_PREPARED_ZEROS)
        if self.source is not None:
            self.public.keep_source_zeros(want - self.public.ready_zeros)
        missing = want - self.public.ready_zeros
        if missing > 0:
            if CKKS_IDLE_DELAY_S > 0:
                # the contribution just sent is being summed: leave the cores to the
                # aggregator first (the next call is queued by ZeroMQ meanwhile)
                time.sleep(CKKS_IDLE_DELAY_S)
            self.public.prepare_zeros(missing * self.public.slots)

    def _prepare(self, length: int) -> None:
        """``thread`` mode: encrypt zeros for a next call of the same length (the next batch) on
        a worker thread while this one is on the wire. SEAL holds the GIL, so this overlaps
        with waiting for the network, not with computing; and the worker first waits
        `CKKS_PREP_DELAY_S` (or until the next call), so that the contribution this call
        returns is sent before SEAL takes the GIL. Each prepared zero is used once, by any
        chunk; at most a few calls' worth are kept ready."""
        import threading
        from concurrent.futures import ThreadPoolExecutor

        if self.public.ready_zeros > 4 * (-(-length // self.public.slots)):
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"{self.s.name}-ckks-zeros")
        self._wake = threading.Event()
        self._ahead = self._pool.submit(self._prepare_quietly, length, self._wake)

    def _prepare_quietly(self, length: int, wake: Any) -> None:
        from crypto.ckks import CkksError

        if CKKS_PREP_DELAY_S > 0:
            wake.wait(CKKS_PREP_DELAY_S)  # waiting releases the GIL: the send goes first
        try:
            self.public.prepare_zeros(length)
        except CkksError:
            pass  # the library's cap of ready zeros: the next call encrypts afresh

    def _join(self) -> None:
        if self._ahead is not None:
            self._wake.set()  # the next call is here: prepare now rather than after the delay
            self._ahead.result()
            self._ahead = None


class CkksAggregator(AggregatorSumStage):
    backend = "ckks"

    def __init__(self, s: SumSession) -> None:
        super().__init__(s)
        from crypto.ckks import CkksPublic

        if s.ckks_public_context is None:
            raise ValueError("the aggregator needs the key holder's public CKKS context")
        self.public = CkksPublic(context_bytes=s.ckks_public_context)

    def accept(self, arrays, *, key, sender):
        """Check one contribution: its ciphertext chunks (`CkksPublic.load_contribution`) and
        the binding of the call its sender answered (``key/call``: exactly 32 uint8 values).
        Returns a `CkksAccepted`; raises ContributionError naming the sender."""
        from crypto.ckks import CkksError

        arrays = dict(arrays)
        binding = arrays.pop(_binding_name(key), None)
        if binding is None:
            raise ContributionError(
                f"{sender}: CKKS contribution to {key!r} carries no binding of the call it "
                f"answers ({_binding_name(key)!r})"
            )
        binding = np.asarray(binding)
        if binding.dtype != np.uint8 or binding.shape != (CKKS_BINDING_BYTES,):
            raise ContributionError(
                f"{sender}: the call binding of its CKKS contribution to {key!r} is "
                f"{binding.dtype} of shape {binding.shape}, not {CKKS_BINDING_BYTES} uint8 values"
            )
        try:
            chunks = self.public.load_contribution(_chunks(arrays, key, sender))
        except CkksError as exc:
            raise ContributionError(
                f"{sender}: rejected CKKS contribution to {key!r}: {exc}"
            ) from None
        return CkksAccepted(chunks=chunks, binding=binding.tobytes())

    def combine_accepted(self, accepted, *, group, key):
        """Add the group's contributions, if every member answered the same call (rule 6:
        equal bindings); otherwise refuse (ContributionError naming the sum and who was sent
        which call): nothing is added, so nothing can be forwarded."""
        from crypto.ckks import CkksError

        _check_members(accepted, group, key)
        calls: dict[bytes, list[str]] = {}
        for p in sorted(accepted):
            calls.setdefault(accepted[p].binding, []).append(p)
        if len(calls) > 1:
            views = "; ".join(
                f"{members} call {binding[:4].hex()}..." for binding, members in calls.items()
            )
            raise ContributionError(
                f"sum {key!r}: the active party sent the members of one sum different calls "
                f"({views}): a split view, which can isolate a member's contribution; nothing "
                "is summed or forwarded"
            )
        try:
            total = self.public.add_loaded([accepted[p].chunks for p in sorted(accepted)])
        except CkksError as exc:
            raise ContributionError(f"sum {key!r}: {exc}") from None
        return _chunk_arrays(key, total.chunks)


class CkksActive(ActiveSumStage):
    backend = "ckks"

    def __init__(self, s: SumSession, *, key_holder: object) -> None:
        super().__init__(s)
        self.key_holder = key_holder
        self._last_length = 0  # values of the latest reveal: the next one is likely the same
        self._normals: np.ndarray | None = None  # its flooding noise, made ahead, used once

    def waiting(self) -> None:
        """The flooding noise of the next reveal (the size of the last one), drawn while the
        key holder waits for the sum instead of after it arrives: fresh CSPRNG normals,
        consumed by exactly one release (a reveal of another size draws its own)."""
        if self.s.ckks_release is not None and self._last_length and self._normals is None:
            from crypto.ckks import csprng_normal

            self._normals = csprng_normal((self._last_length,))

    def reveal(self, combined, *, group, key, shape):
        from crypto.ckks import PackedCiphertexts

        length = int(np.prod(shape))
        packed = PackedCiphertexts(chunks=_chunks(combined, key, "aggregator"), length=length)
        normals, self._normals = self._normals, None  # taken whatever its size: never reused
        self._last_length = length
        # flooded and rounded: values derived from it leave the key holder (gradients)
        value = self.key_holder.decrypt_sum(
            packed,
            shape=tuple(shape),
            release=self.s.ckks_release,
            terms=len(group),
            normals=normals,
        )
        return np.asarray(value, dtype=np.float64)


@dataclass(frozen=True)
class SecureSumBackend:
    name: str
    secure: bool
    party: type[PartySumStage]
    aggregator: type[AggregatorSumStage]
    active: type[ActiveSumStage]


BACKENDS: dict[str, SecureSumBackend] = {
    "plain": SecureSumBackend("plain", False, PlainParty, PlainAggregator, PlainActive),
    "mask": SecureSumBackend("mask", True, MaskParty, MaskAggregator, MaskActive),
    "ckks": SecureSumBackend("ckks", True, CkksParty, CkksAggregator, CkksActive),
}


def backend(name: str) -> SecureSumBackend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise KeyError(f"unknown aggregation {name!r}; choose one of {sorted(BACKENDS)}") from None


#: The smallest CKKS degree a run's sizing picks: a batch's sum (256 rows x 16 values on
#: Credit) fills one ciphertext of 4096, where degree 2048 would split it in two chunks for the
#: same bytes and encryption work and twice the per-chunk costs (measured: 0.16 against 0.09 ms
#: for the aggregator's sum of 4 contributions); also the degree every earlier sizing chose.
CKKS_MIN_DEGREE = 4096


def ckks_params(cfg: Any) -> Any:
    """The CKKS parameters of a run (a :class:`crypto.ckks.CkksParams`). Unless the config fixes
    all three of degree, chain and scale, they are sized to the sums by
    :func:`crypto.ckks.choose_params`: released values carry ``[secure] ckks.precision_bits``
    bits after the point after ``flood_bits`` of flooding, for sums of up to every party's
    value bounded by ``[secure] ckks.magnitude`` (default ``[secure] bound``, the bound masked
    sums enforce too), at ``security_bits``. Raises ConfigError when no parameters fit or the
    fixed ones are below 128-bit security."""
    from crypto.ckks import CkksParams, choose_params
    from securevfl.config import ConfigError

    c = cfg.ckks
    if c.poly_modulus_degree is not None:
        params = CkksParams(
            poly_modulus_degree=c.poly_modulus_degree,
            coeff_mod_bit_sizes=tuple(c.coeff_mod_bit_sizes),
            scale_bits=c.scale_bits,
            special_prime=c.special_prime,
        )
        try:
            params.validate()
        except ValueError as exc:
            raise ConfigError("[secure] ckks", str(exc)) from None
        return params
    magnitude = c.magnitude if c.magnitude is not None else cfg.bound
    try:
        sizing = choose_params(
            precision_bits=c.precision_bits,
            magnitude=magnitude,
            terms=len(cfg.party_names) + 1,
            flood_bits=c.flood_bits,
            security_bits=c.security_bits,
            min_degree=CKKS_MIN_DEGREE,
        )
    except ValueError as exc:
        raise ConfigError("[secure] ckks", str(exc)) from None
    return sizing.params


def ckks_context_tag(
    *,
    context: bytes,
    my_keypair: MaskingKeyPair,
    peer: str,
    me: str,
    peer_public: bytes,
    session: bytes,
) -> bytes:
    """End-to-end authentication of the CKKS public context between the key holder and one
    party: HMAC-SHA256 under their pairwise X25519/HKDF key, which the aggregator (who forwards
    the context) cannot compute. Stops an aggregator from substituting a context it can decrypt."""
    import hashlib
    import hmac

    from crypto import pair_key

    key = pair_key(
        my_private=my_keypair.private, peer_public=peer_public, session=session, me=me, peer=peer
    )
    return hmac.new(key, b"securevfl/ckks-context/v1" + context, hashlib.sha256).digest()
