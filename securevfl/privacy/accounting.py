"""Privacy accounting with Opacus's accountants: epsilon from a history, sigma from a target.

A history is a list of ``(noise_multiplier, sample_rate, steps)`` entries, exactly Opacus's
``IAccountant.history``; epsilon is what ``RDPAccountant`` (default) or ``PRVAccountant``
returns for it. Mechanisms that release to other parties are recorded with sample rate 1
(no amplification); see `securevfl.privacy.ledger`.

Two Opacus behaviours are handled here rather than left to leak into logs:

- ``PRVAccountant`` at sample rate 1 evaluates ``log(1 - q) = log(0)``: numpy emits thousands
  of harmless "divide by zero" RuntimeWarnings per call; they are silenced.
- The RDP conversion warns when the optimal order is the largest or smallest default alpha.
  The bound is still valid (only possibly loose); the warning is logged at INFO instead.

PRV limits: its discretisation domain grows with epsilon, so for very large epsilon (tiny
sigma at sample rate 1) it becomes slow (minutes), returns ``inf`` or raises "Discrete mean
differs significantly from continuous mean". When the RDP epsilon of a history exceeds
`PRV_MAX_EPSILON`, or PRV fails or returns a non-finite value, `epsilon` returns the RDP
epsilon (also a valid upper bound) and emits an `AccountingWarning` saying so.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from securevfl.privacy.ledger import LedgerEvent, merge_history

__all__ = [
    "ACCOUNTANTS",
    "PRV_MAX_EPSILON",
    "AccountingWarning",
    "calibrate_noise",
    "default_delta",
    "epsilon",
    "epsilon_by_role",
    "histories_by_role",
    "validate_accountant",
    "validate_delta",
    "validate_history",
]

logger = logging.getLogger(__name__)

ACCOUNTANTS = ("rdp", "prv")
# above this RDP epsilon PRV is slow or numerically unstable, and the number is meaningless
PRV_MAX_EPSILON = 100.0

History = list[tuple[float, float, int]]


class AccountingWarning(UserWarning):
    """The requested accountant could not be used; the reported epsilon came from another."""


@contextmanager
def _quiet_opacus() -> Iterator[None]:
    with (
        warnings.catch_warnings(record=True) as caught,
        np.errstate(divide="ignore", invalid="ignore", over="ignore"),
    ):
        warnings.simplefilter("always")
        yield
    seen: set[str] = set()
    for w in caught:
        text = str(w.message)
        if text.startswith("Optimal order is the"):
            if text not in seen:
                logger.info("Opacus RDP conversion: %s (the epsilon is still an upper bound)", text)
                seen.add(text)
        elif issubclass(w.category, RuntimeWarning) and "encountered in" in text:
            continue  # numpy noise from PRV at sample rate 1 (log(1 - q) with q = 1)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def validate_delta(delta: Any) -> float:
    """``delta`` as a float; refuses (ValueError) anything outside (0, 1)."""
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be a number in (0, 1), got {delta!r}")
    return float(delta)


def validate_accountant(accountant: str) -> str:
    """``accountant``; refuses (ValueError) a name not in `ACCOUNTANTS`."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    return accountant


def validate_history(history: Iterable[Sequence[float]]) -> History:
    """``history`` as float/int tuples without zero-step entries; refuses (ValueError) an
    entry that is not ``(noise_multiplier > 0, 0 < sample_rate <= 1, steps >= 0)``."""
    out: History = []
    for i, entry in enumerate(history):
        try:
            sigma, q, steps = entry
        except (TypeError, ValueError):
            raise ValueError(
                f"history entry {i} must be (noise_multiplier, sample_rate, steps), got {entry!r}"
            ) from None
        if isinstance(sigma, bool) or not (isinstance(sigma, int | float) and sigma > 0):
            raise ValueError(f"history entry {i}: noise_multiplier must be > 0, got {sigma!r}")
        if not math.isfinite(sigma):
            raise ValueError(f"history entry {i}: noise_multiplier must be finite, got {sigma!r}")
        if isinstance(q, bool) or not (isinstance(q, int | float) and 0.0 < q <= 1.0):
            raise ValueError(f"history entry {i}: sample_rate must be in (0, 1], got {q!r}")
        if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 0:
            raise ValueError(f"history entry {i}: steps must be an int >= 0, got {steps!r}")
        if steps > 0:
            out.append((float(sigma), float(q), int(steps)))
    return out


# Opacus is imported where an accountant is first used (about a second of start-up, with
# torch.distributed and sympy, that a role without DP never needs)


def _rdp(history: History, delta: float) -> float:
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = list(history)
    with _quiet_opacus():
        return float(acc.get_epsilon(delta=delta))


def _prv(history: History, delta: float) -> float:
    from opacus.accountants import PRVAccountant

    acc = PRVAccountant()
    acc.history = list(history)
    with _quiet_opacus():
        return float(acc.get_epsilon(delta=delta))


def epsilon(
    *, history: Sequence[tuple[float, float, int]], delta: float, accountant: str = "rdp"
) -> float:
    """Epsilon at ``delta`` after composing every ``(noise_multiplier, sample_rate, steps)``
    entry of ``history``, by Opacus's RDP (default) or PRV accountant. 0.0 for no steps.

    With ``accountant="prv"`` the PRV value is returned unless PRV cannot give one (see the
    module docstring): then the RDP value is returned with an `AccountingWarning`.
    Refuses (ValueError) malformed entries, delta outside (0, 1), an unknown accountant.
    """
    validate_accountant(accountant)
    delta = validate_delta(delta)
    entries = validate_history(history)
    if not entries:
        return 0.0
    rdp = _rdp(entries, delta)
    if accountant == "rdp":
        return rdp
    if rdp > PRV_MAX_EPSILON:
        warnings.warn(
            f"PRV accounting skipped: the RDP epsilon is {rdp:.4g} > {PRV_MAX_EPSILON}, where "
            "the PRV accountant is slow and unstable; reporting the RDP epsilon",
            AccountingWarning,
            stacklevel=2,
        )
        return rdp
    try:
        prv = _prv(entries, delta)
    except (RuntimeError, ValueError, FloatingPointError, OverflowError) as exc:
        warnings.warn(
            f"PRV accounting failed ({exc}); reporting the RDP epsilon {rdp:.4g}",
            AccountingWarning,
            stacklevel=2,
        )
        return rdp
    if not math.isfinite(prv):
        warnings.warn(
            f"PRV accounting returned {prv}; reporting the RDP epsilon {rdp:.4g}",
            AccountingWarning,
            stacklevel=2,
        )
        return rdp
    return prv


def calibrate_noise(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    epsilon_tolerance: float = 0.01,
) -> float:
    """The noise multiplier that spends at most ``target_epsilon`` at ``delta`` over ``steps``
    uses at ``sample_rate`` (Opacus ``get_noise_multiplier``: a binary search that returns a
    sigma whose epsilon is <= target and within ``epsilon_tolerance`` of it).

    For label DP or embedding DP pass ``sample_rate=1.0`` and ``steps`` = uses of each row
    (epochs). Refuses (ValueError) a non-positive target, delta outside (0, 1), a sample rate
    outside (0, 1], ``steps < 1``, and a target so small that sigma would exceed 1e6.
    """
    validate_accountant(accountant)
    delta = validate_delta(delta)
    if isinstance(target_epsilon, bool) or not (
        isinstance(target_epsilon, int | float) and 0 < target_epsilon < math.inf
    ):
        raise ValueError(f"target_epsilon must be a positive number, got {target_epsilon!r}")
    validate_history([(1.0, sample_rate, steps)])
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps!r}")
    from opacus.accountants.utils import get_noise_multiplier

    try:
        with _quiet_opacus():
            sigma = get_noise_multiplier(
                target_epsilon=float(target_epsilon),
                target_delta=delta,
                sample_rate=float(sample_rate),
                steps=int(steps),
                accountant=accountant,
                epsilon_tolerance=epsilon_tolerance,
            )
    except ValueError as exc:
        raise ValueError(
            f"cannot reach epsilon={target_epsilon} at delta={delta} over {steps} steps at "
            f"sample rate {sample_rate}: {exc} Raise the target epsilon or reduce the steps"
        ) from exc
    except RuntimeError as exc:
        raise ValueError(
            f"the {accountant} accountant failed while calibrating sigma for "
            f"epsilon={target_epsilon} ({exc}); try accountant='rdp'"
        ) from exc
    return float(sigma)


def default_delta(n_train: int) -> float:
    """The default delta for ``n_train`` training rows: 1/N rounded down to a power of ten,
    made strictly smaller than 1/N (10^-k with k the number of digits of N).

    E.g. N = 24000 -> 1e-5, N = 500 -> 1e-3, N = 1000 -> 1e-4 (1e-3 would equal 1/N).
    Refuses (ValueError) anything but an int >= 1.
    """
    if isinstance(n_train, bool) or not isinstance(n_train, int | np.integer) or n_train < 1:
        raise ValueError(f"n_train must be an int >= 1, got {n_train!r}")
    return float(f"1e-{len(str(int(n_train)))}")


def histories_by_role(
    events: Iterable[LedgerEvent | dict],
) -> dict[tuple[str, str], History]:
    """Merged accountant histories per (role, mechanism), in first-seen order.

    Unprotected records (dicts) are skipped: they have no guarantee to account.
    """
    grouped: dict[tuple[str, str], list[LedgerEvent]] = {}
    for e in events:
        if isinstance(e, LedgerEvent):
            grouped.setdefault((e.role, e.mechanism), []).append(e)
    return {key: merge_history(evs) for key, evs in grouped.items()}


def epsilon_by_role(
    events: Iterable[LedgerEvent | dict],
    *,
    delta: float | None = None,
    accountant: str = "rdp",
) -> dict[tuple[str, str], float]:
    """Epsilon per (role, mechanism) from ledger events.

    Consecutive events of one (role, mechanism) with the same sigma and sample rate are merged
    into one history entry. With ``delta=None`` each group uses the smallest delta its events
    recorded (the strictest reading).
    """
    events = list(events)
    deltas: dict[tuple[str, str], float] = {}
    for e in events:
        if isinstance(e, LedgerEvent):
            key = (e.role, e.mechanism)
            deltas[key] = min(deltas.get(key, e.delta), e.delta)
    return {
        key: epsilon(
            history=history,
            delta=deltas[key] if delta is None else delta,
            accountant=accountant,
        )
        for key, history in histories_by_role(events).items()
    }
