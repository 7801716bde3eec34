"""Privacy budgets: refuse a release before it would push epsilon past ``max_epsilon``.

A budget belongs to one (role, mechanism). Before each release the training loop asks
`PrivacyBudget.check_next` with the history spent so far and the step it is about to take;
`BudgetExceeded` is raised before anything leaves the party, so the loop can checkpoint and
stop cleanly. `PrivacyBudget.allows_one_step` lets config validation reject a budget that
cannot pay for a single release, before anything starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from securevfl.errors import BudgetExceeded
from securevfl.privacy.accounting import (
    epsilon,
    validate_accountant,
    validate_delta,
    validate_history,
)
from securevfl.privacy.ledger import PrivacyLedger
from securevfl.privacy.mechanisms import MECHANISMS

__all__ = ["BudgetExceeded", "PrivacyBudget"]

Step = tuple[float, float, int]


def _extend(history: Sequence[Step], step: Step) -> list[Step]:
    """``history + [step]``, merged into the last entry when sigma and q match (as Opacus does),
    so that PRV sees the same history a ledger read back would give."""
    out = [tuple(h) for h in history]
    sigma, q, steps = step
    if out and out[-1][0] == sigma and out[-1][1] == q:
        out[-1] = (sigma, q, out[-1][2] + steps)
    else:
        out.append((sigma, q, steps))
    return out  # type: ignore[return-value]


class PrivacyBudget:
    """A cap ``max_epsilon`` at ``delta`` on one role's use of one mechanism."""

    def __init__(
        self,
        *,
        role: str,
        mechanism: str,
        max_epsilon: float,
        delta: float,
        accountant: str = "rdp",
    ) -> None:
        """Refuses (ValueError) an empty role, an unknown mechanism, ``max_epsilon <= 0``,
        delta outside (0, 1) and an unknown accountant."""
        if not isinstance(role, str) or not role:
            raise ValueError(f"role must be a non-empty string, got {role!r}")
        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown mechanism {mechanism!r}; known: {sorted(MECHANISMS)}")
        if isinstance(max_epsilon, bool) or not (
            isinstance(max_epsilon, int | float) and 0 < max_epsilon < math.inf
        ):
            raise ValueError(f"max_epsilon must be a positive finite number, got {max_epsilon!r}")
        self.role = role
        self.mechanism = mechanism
        self.max_epsilon = float(max_epsilon)
        self.delta = validate_delta(delta)
        self.accountant = validate_accountant(accountant)

    def __repr__(self) -> str:
        return (
            f"PrivacyBudget(role={self.role!r}, mechanism={self.mechanism!r}, "
            f"max_epsilon={self.max_epsilon}, delta={self.delta}, accountant={self.accountant!r})"
        )

    def spent(self, *, history: Sequence[Step]) -> float:
        """Epsilon of ``history`` at this budget's delta and accountant."""
        return epsilon(history=history, delta=self.delta, accountant=self.accountant)

    def epsilon_after(self, *, history_so_far: Sequence[Step], next_step: Step) -> float:
        """Epsilon that ``history_so_far`` followed by ``next_step`` would reach."""
        validate_history([next_step])
        return self.spent(history=_extend(history_so_far, next_step))

    def check_next(
        self,
        *,
        history_so_far: Sequence[Step],
        next_step: Step,
        epoch: int | None = None,
        step: int | None = None,
    ) -> float:
        """Allow the release ``next_step = (noise_multiplier, sample_rate, steps)`` or refuse it.

        Returns the epsilon the release brings the total to when it fits. Raises
        `BudgetExceeded` (naming role, mechanism, max_epsilon, the epsilon it would reach,
        and ``epoch``/``step`` when given) when it would exceed ``max_epsilon``: call this
        before the release, so that a refused release never leaves the party.
        """
        eps = self.epsilon_after(history_so_far=history_so_far, next_step=next_step)
        if eps > self.max_epsilon:
            raise BudgetExceeded(
                role=self.role,
                mechanism=self.mechanism,
                max_epsilon=self.max_epsilon,
                epsilon=eps,
                delta=self.delta,
                epoch=epoch,
                step=step,
            )
        return eps

    def check_next_from_ledger(
        self,
        ledger: PrivacyLedger,
        *,
        next_step: Step,
        epoch: int | None = None,
        step: int | None = None,
    ) -> float:
        """`check_next` with the history this budget's (role, mechanism) has in ``ledger``."""
        history = ledger.history(role=self.role, mechanism=self.mechanism)
        return self.check_next(history_so_far=history, next_step=next_step, epoch=epoch, step=step)

    def steps_that_fit(
        self,
        *,
        noise_multiplier: float,
        sample_rate: float,
        history_so_far: Sequence[Step] = (),
        max_steps: int = 1_000_000,
    ) -> int:
        """The largest k <= ``max_steps`` such that ``history_so_far`` plus k steps of
        ``(noise_multiplier, sample_rate)`` stays within ``max_epsilon`` (0 if none fits).

        Epsilon grows with the number of steps, so an exponential then binary search finds k
        with O(log k) accountant calls.
        """
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0:
            raise ValueError(f"max_steps must be an int >= 0, got {max_steps!r}")
        validate_history([(noise_multiplier, sample_rate, 1)])

        def fits(k: int) -> bool:
            if k == 0:
                return self.spent(history=history_so_far) <= self.max_epsilon
            step = (float(noise_multiplier), float(sample_rate), k)
            return self.epsilon_after(history_so_far=history_so_far, next_step=step) <= (
                self.max_epsilon
            )

        if max_steps == 0 or not fits(1):
            return 0
        lo, hi = 1, 2  # invariant: fits(lo); hi is unknown or does not fit
        while hi <= max_steps and fits(hi):
            lo, hi = hi, hi * 2
        if hi > max_steps:
            if fits(max_steps):
                return max_steps
            hi = max_steps
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def allows_one_step(
        self,
        *,
        noise_multiplier: float,
        sample_rate: float = 1.0,
        steps_per_release: int = 1,
        history_so_far: Sequence[Step] = (),
    ) -> bool:
        """Whether a single release of ``steps_per_release`` steps fits the budget: a config
        whose budget cannot pay for one release should be refused before training starts."""
        step = (float(noise_multiplier), float(sample_rate), steps_per_release)
        eps = self.epsilon_after(history_so_far=history_so_far, next_step=step)
        return eps <= self.max_epsilon
