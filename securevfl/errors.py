"""Every error a user can meet, each with the exit status a role or command ends with.

One table, `EXIT_STATUSES`, is the source of the README's "Exit statuses" table (a test compares
them). An exception's `exit_code` says how a command that fails with it ends; the CLI maps any
exception through `exit_code_for`. Nothing here imports anything beyond the standard library, so
every layer may raise these.
"""

from __future__ import annotations

from typing import ClassVar

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_BUDGET = 3
EXIT_PEER_LOST = 4
EXIT_REFUSED = 5
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE, as a command killed by its closed pipe ends

# status -> meaning, as the README's table says it
EXIT_STATUSES: dict[int, str] = {
    EXIT_OK: "finished",
    EXIT_ERROR: "an internal error (the role's log has the traceback)",
    EXIT_USAGE: "bad input: config, data, keys, checkpoint — the message names the key and the fix",
    EXIT_BUDGET: "a privacy budget ran out (`max_epsilon`); the run stopped before exceeding it",
    EXIT_PEER_LOST: "a role was lost (no heartbeat within `peer_timeout`); restart it and "
    "`--resume`",
    EXIT_REFUSED: "a party refused a call its release policy does not allow (its log and the "
    "ledger name the rule); nothing was released",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C); continue later with `--resume`",
    EXIT_PIPE_CLOSED: "the reader of the output went away (piped into `head`) before the command "
    "finished; nothing more was printed (a training run's checkpoints stand: `--resume`)",
}


class SecureVFLError(Exception):
    """Base of securevfl's errors; `exit_code` is the status a command that fails with it ends
    with."""

    exit_code: ClassVar[int] = EXIT_ERROR


class ConfigError(SecureVFLError, ValueError):
    """A configuration value is wrong; `key` names it (``[section] key``)."""

    exit_code = EXIT_USAGE

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class DataError(SecureVFLError, ValueError):
    """The data do not match the config (missing column, bad id, non-numeric value)."""

    exit_code = EXIT_USAGE


class KeyMaterialError(SecureVFLError, ValueError):
    """Key material is missing or inconsistent; the message says which file and how to fix it."""

    exit_code = EXIT_USAGE


class CheckpointError(SecureVFLError, RuntimeError):
    """A checkpoint cannot be read or does not fit this run."""

    exit_code = EXIT_USAGE


class AuditError(SecureVFLError, ValueError):
    """The run directory cannot be audited as asked; the message says what is missing."""

    exit_code = EXIT_USAGE


class LedgerError(SecureVFLError, ValueError):
    """A ledger file or event that cannot be trusted; the message names the file and line."""

    exit_code = EXIT_USAGE


class MethodInputError(SecureVFLError, ValueError):
    """A method cannot fit the data it was given (a constant or collinear column, too few
    rows); the message names the party and the column."""

    exit_code = EXIT_USAGE


class BudgetExceeded(SecureVFLError, RuntimeError):
    """The next release would spend more than the budget allows; nothing was released.

    Attributes: role, mechanism, max_epsilon, epsilon (what the release would reach), delta,
    epoch and step (where training stopped; None when unknown).
    """

    exit_code = EXIT_BUDGET

    def __init__(
        self,
        *,
        role: str,
        mechanism: str,
        max_epsilon: float,
        epsilon: float,
        delta: float,
        epoch: int | None = None,
        step: int | None = None,
    ) -> None:
        self.role = role
        self.mechanism = mechanism
        self.max_epsilon = max_epsilon
        self.epsilon = epsilon
        self.delta = delta
        self.epoch = epoch
        self.step = step
        where = ", ".join(
            part
            for part in (
                f"epoch {epoch}" if epoch is not None else "",
                f"step {step}" if step is not None else "",
            )
            if part
        )
        super().__init__(
            f"privacy budget exhausted for role {role!r}, mechanism {mechanism!r}"
            f"{' at ' + where if where else ''}: the next release would reach epsilon "
            f"{epsilon:.4g} > max_epsilon {max_epsilon:.4g} (delta={delta:g}); it was not made. "
            "Stop here (the last checkpoint is within budget), or raise max_epsilon / the noise "
            "multiplier for a new run"
        )


class RunAborted(SecureVFLError, RuntimeError):
    """The federation stopped because a role was lost, failed or refused; `.lost` names a lost
    or failed role, `.refused` marks a stop on a party's release policy, `.budget` a stop on
    a role's privacy budget and `.usage` a stop on bad input (a config or data mistake found
    while the run was under way), so every role ends with the status of the stop's cause."""

    def __init__(
        self,
        message: str,
        *,
        lost: str | None = None,
        refused: bool = False,
        budget: bool = False,
        usage: bool = False,
    ) -> None:
        super().__init__(message)
        self.lost = lost
        self.refused = refused
        self.budget = budget
        self.usage = usage

    @property
    def exit_code(self) -> int:  # type: ignore[override]
        if self.refused:
            return EXIT_REFUSED
        if self.budget:
            return EXIT_BUDGET
        if self.usage:
            return EXIT_USAGE
        return EXIT_PEER_LOST if self.lost else EXIT_ERROR


class PolicyRefusal(SecureVFLError, RuntimeError):
    """A passive party refused a call: it breaks the method's declared operations or the party's
    own release policy. `rule` names the broken rule; nothing was released."""

    exit_code = EXIT_REFUSED

    def __init__(self, party: str, rule: str, detail: str) -> None:
        super().__init__(f"party {party!r} refused the call ({rule}): {detail}")
        self.party = party
        self.rule = rule
        self.detail = detail


def exit_code_for(exc: BaseException) -> int:
    """The exit status a command that failed with `exc` ends with."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    code = getattr(exc, "exit_code", EXIT_ERROR)
    return code if isinstance(code, int) else EXIT_ERROR
