"""The privacy audit: recompute epsilon from a ledger, list releases with no guarantee.

`audit` reads a ledger (validating every line), groups DP events per (role, mechanism),
recomputes epsilon with Opacus's accountant from the recorded sigma, sample rate and steps,
and lists every unprotected release as "no formal guarantee". Measured label leakage
(`securevfl.privacy.attacks.measure_label_leakage`) can be attached per receiving role so
that it stands next to the epsilons.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from securevfl.privacy.accounting import (
    AccountingWarning,
    epsilon,
    histories_by_role,
    validate_accountant,
    validate_delta,
)
from securevfl.privacy.attacks import LeakageMeasurement
from securevfl.privacy.ledger import LEDGER_FILENAME, LedgerEvent, PrivacyLedger

__all__ = [
    "NO_GUARANTEE",
    "AuditReport",
    "AuditRow",
    "UnprotectedRelease",
    "audit",
    "format_report",
]

NO_GUARANTEE = "no formal guarantee"


@dataclass(frozen=True)
class AuditRow:
    """The privacy spent by one role through one mechanism.

    ``noise_multipliers``, ``clips`` and ``sample_rates`` list the distinct values recorded,
    in first-seen order; ``steps`` is the total composed; ``amplified`` is True when any event
    claimed subsampling amplification. ``accountant`` says which accountant produced epsilon.
    """

    role: str
    mechanism: str
    epsilon: float
    delta: float
    noise_multipliers: tuple[float, ...]
    clips: tuple[float, ...]
    sample_rates: tuple[float, ...]
    steps: int
    events: int
    amplified: bool
    accountant: str
    first_epoch: int | None = None
    last_epoch: int | None = None
    note: str = ""
    # label_dp / embedding_dp only: epsilon when neighbouring data sets differ in one row's
    # *value* (a flipped label, a changed feature row) rather than in its presence. The clipped
    # release of that row can move by 2C, not C: the same history at sigma / 2.
    epsilon_replace_one: float | None = None


# mechanisms whose guarantee is per row release (no amplification), for the replace-one epsilon
REPLACE_ONE = ("label_dp", "embedding_dp")


@dataclass(frozen=True)
class UnprotectedRelease:
    """Releases of one kind with no formal guarantee, aggregated over the ledger."""

    role: str
    what: str
    reason: str
    count: int
    first_epoch: int | None = None
    last_epoch: int | None = None
    guarantee: str = NO_GUARANTEE


@dataclass
class AuditReport:
    """Everything `format_report` prints; `to_json` gives the same as plain data.

    ``role_totals`` composes every mechanism of a role (epsilon, delta): a conservative upper
    bound that treats all of a role's releases as being about the same data.
    """

    ledger_path: Path
    accountant: str
    rows: list[AuditRow]
    unprotected: list[UnprotectedRelease]
    refusals: list[dict[str, Any]] = field(default_factory=list)
    role_totals: dict[str, tuple[float, float]] = field(default_factory=dict)
    leakage: dict[str, LeakageMeasurement] = field(default_factory=dict)
    # where the true labels that scored the attacks came from (only the active party has them)
    leakage_labels: str = ""
    # notes about the run that are not releases (a forced resume, a torn line repaired)
    notes: list[dict[str, Any]] = field(default_factory=list)

    def row(self, role: str, mechanism: str) -> AuditRow:
        """The row of (role, mechanism); KeyError if the ledger has no such events."""
        for r in self.rows:
            if r.role == role and r.mechanism == mechanism:
                return r
        raise KeyError(f"the ledger has no {mechanism!r} events for role {role!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "ledger": str(self.ledger_path),
            "accountant": self.accountant,
            "mechanisms": [asdict(r) for r in self.rows],
            "role_totals": {
                role: {"epsilon": eps, "delta": d} for role, (eps, d) in self.role_totals.items()
            },
            "unprotected": [asdict(u) for u in self.unprotected],
            "refusals": list(self.refusals),
            "leakage": {role: m.to_json() for role, m in self.leakage.items()},
            "leakage_labels": self.leakage_labels,
            "notes": list(self.notes),
        }


def _distinct(values: list[float]) -> tuple[float, ...]:
    return tuple(dict.fromkeys(values))


def _epsilon_noting_fallback(history, delta: float, accountant: str) -> tuple[float, str, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AccountingWarning)
        eps = epsilon(history=history, delta=delta, accountant=accountant)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, AccountingWarning)]
    for w in caught:
        if not issubclass(w.category, AccountingWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if fallbacks:
        return eps, "rdp", fallbacks[0]
    return eps, accountant, ""


def _epochs(epochs: list[int | None]) -> tuple[int | None, int | None]:
    known = [e for e in epochs if e is not None]
    return (min(known), max(known)) if known else (None, None)


def audit(
    ledger_path: Path,
    *,
    delta: float | None = None,
    accountant: str = "rdp",
    leakage: Mapping[str, LeakageMeasurement] | None = None,
    tolerate_torn_tail: bool = False,
) -> AuditReport:
    """Recompute the privacy spent in a run from its ledger.

    ``ledger_path`` is the ledger file or a run directory holding ``ledger.jsonl``.
    With ``delta=None`` each (role, mechanism) is reported at the smallest delta its events
    recorded; otherwise at ``delta``. ``leakage`` maps a receiving role to label-inference
    AUCs measured on the gradients it received. Refuses (`LedgerError`) a corrupt ledger,
    naming the line; see `PrivacyLedger.read` for ``tolerate_torn_tail``.
    """
    validate_accountant(accountant)
    if delta is not None:
        delta = validate_delta(delta)
    path = Path(ledger_path)
    if path.is_dir():
        path = path / LEDGER_FILENAME
    events = PrivacyLedger.read(path, tolerate_torn_tail=tolerate_torn_tail)

    grouped: dict[tuple[str, str], list[LedgerEvent]] = {}
    unprotected: dict[tuple[str, str, str], list[dict]] = {}
    refusals: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, LedgerEvent):
            grouped.setdefault((e.role, e.mechanism), []).append(e)
        elif e["kind"] == "refusal":
            refusals.append({k: e[k] for k in ("role", "rule", "detail", "round")})
        elif e["kind"] == "note":
            notes.append({k: e[k] for k in ("role", "what", "detail")})
        else:
            unprotected.setdefault((e["role"], e["what"], e["reason"]), []).append(e)

    histories = histories_by_role(events)
    rows: list[AuditRow] = []
    for (role, mechanism), evs in grouped.items():
        d = delta if delta is not None else min(e.delta for e in evs)
        eps, used, note = _epsilon_noting_fallback(histories[(role, mechanism)], d, accountant)
        replace_one = None
        if mechanism in REPLACE_ONE:
            halved = [(sigma / 2, q, n) for sigma, q, n in histories[(role, mechanism)]]
            replace_one, _, _ = _epsilon_noting_fallback(halved, d, accountant)
        first, last = _epochs([e.epoch for e in evs])
        rows.append(
            AuditRow(
                role=role,
                mechanism=mechanism,
                epsilon=eps,
                delta=d,
                noise_multipliers=_distinct([e.noise_multiplier for e in evs]),
                clips=_distinct([e.clip for e in evs]),
                sample_rates=_distinct([e.sample_rate for e in evs]),
                steps=sum(e.steps for e in evs),
                events=len(evs),
                amplified=any(e.amplified for e in evs),
                accountant=used,
                first_epoch=first,
                last_epoch=last,
                note=note,
                epsilon_replace_one=replace_one,
            )
        )

    role_totals: dict[str, tuple[float, float]] = {}
    for role in dict.fromkeys(r.role for r in rows):
        mine = [r for r in rows if r.role == role]
        if len(mine) == 1:
            role_totals[role] = (mine[0].epsilon, mine[0].delta)
            continue
        history = [h for (r, _), hs in histories.items() if r == role for h in hs]
        d = min(r.delta for r in mine)
        eps, _, _ = _epsilon_noting_fallback(history, d, accountant)
        role_totals[role] = (eps, d)

    releases = []
    for (role, what, reason), recs in unprotected.items():
        first, last = _epochs([r["epoch"] for r in recs])
        releases.append(
            UnprotectedRelease(
                role=role,
                what=what,
                reason=reason,
                count=len(recs),
                first_epoch=first,
                last_epoch=last,
            )
        )

    return AuditReport(
        ledger_path=path,
        accountant=accountant,
        rows=rows,
        unprotected=releases,
        refusals=refusals,
        role_totals=role_totals,
        leakage=dict(leakage or {}),
        notes=notes,
    )


def _fmt_values(values: tuple[float, ...]) -> str:
    return ", ".join(f"{v:.4g}" for v in values)


def _fmt_epochs(first: int | None, last: int | None) -> str:
    # the ledger counts epochs from 0; the report counts from 1, like the progress lines
    if first is None:
        return "-"
    return str(first + 1) if first == last else f"{first + 1}-{last + 1}"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in body:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return lines


def format_report(report: AuditReport) -> str:
    """A plain-text report: one row per (role, mechanism), role totals where a role used
    several mechanisms, releases with no formal guarantee, and measured label leakage."""
    out = [f"Privacy audit of {report.ledger_path} (accountant: {report.accountant})", ""]
    if report.rows:
        header = [
            "role",
            "mechanism",
            "epsilon",
            "delta",
            "sigma",
            "clip",
            "sample rate",
            "steps",
            "amplified",
            "epochs",
        ]
        body = [
            [
                r.role,
                r.mechanism,
                f"{r.epsilon:.4g}",
                f"{r.delta:.3g}",
                _fmt_values(r.noise_multipliers),
                _fmt_values(r.clips),
                _fmt_values(r.sample_rates),
                str(r.steps),
                "yes" if r.amplified else "no",
                _fmt_epochs(r.first_epoch, r.last_epoch),
            ]
            for r in report.rows
        ]
        out += _table(header, body)
        flips = [r for r in report.rows if r.epsilon_replace_one is not None]
        if flips:
            out += [
                "",
                "epsilon above: one row's release present or absent. If one row's value changes",
                "instead (a flipped label, an edited feature row), the same releases give:",
                *(
                    f"  {r.role}/{r.mechanism}: epsilon {r.epsilon_replace_one:.4g} "
                    f"at delta {r.delta:.3g} (replace-one: sigma / 2)"
                    for r in flips
                ),
            ]
        notes = [f"  {r.role}/{r.mechanism}: {r.note}" for r in report.rows if r.note]
        if notes:
            out += ["", "Notes:", *notes]
    else:
        out.append("No differentially private releases recorded.")
    multi = [role for role in report.role_totals if sum(r.role == role for r in report.rows) > 1]
    if multi:
        out += ["", "Per role, all mechanisms composed (conservative upper bound):"]
        for role in multi:
            eps, d = report.role_totals[role]
            out.append(f"  {role}: epsilon {eps:.4g} at delta {d:.3g}")
    out += [""]
    if report.unprotected:
        out.append(f"Releases with {NO_GUARANTEE}:")
        out += _table(
            ["role", "release", "count", "epochs", "guarantee", "reason"],
            [
                [
                    u.role,
                    u.what,
                    str(u.count),
                    _fmt_epochs(u.first_epoch, u.last_epoch),
                    u.guarantee,
                    u.reason,
                ]
                for u in report.unprotected
            ],
        )
    else:
        out.append(f"Releases with {NO_GUARANTEE}: none recorded.")
    if report.refusals:
        out += ["", "Calls refused by a party's release policy (nothing was released):"]
        out += _table(
            ["role", "round", "rule", "what was asked"],
            [[r["role"], str(r["round"]), r["rule"], r["detail"]] for r in report.refusals],
        )
    else:
        out.append("Calls refused by a party's release policy: none.")
    if report.notes:
        out += ["", "Notes on the run (not releases):"]
        out += [f"  {n['role']}: {n['what']}: {n['detail']}" for n in report.notes]
    if report.leakage:
        out += ["", "Measured label inference from received gradients (ROC-AUC, 0.5 = chance):"]
        out += _table(
            ["role", "norm attack", "direction attack", "rows", "positive rate"],
            [
                [
                    role,
                    f"{m.norm_auc:.3f}",
                    f"{m.direction_auc:.3f}",
                    str(m.rows),
                    f"{m.positive_rate:.3f}",
                ]
                for role, m in report.leakage.items()
            ],
        )
        out += [
            "",
            "The attacks are label-free (what each party can run on what it received); scoring",
            "them needs the true training labels, which only the active party holds, so this",
            "evaluation needs the active party's cooperation"
            + (f" (labels read from {report.leakage_labels})." if report.leakage_labels else "."),
        ]
    return "\n".join(out) + "\n"
