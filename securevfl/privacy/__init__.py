"""Differential privacy for securevfl: mechanisms, the ledger, accounting, budgets, audit.

- `mechanisms`: label DP on returned gradients, embedding DP on contributions, DP-SGD (a
  registry, `MECHANISMS`, keyed by the name written in the ledger).
- `ledger`: the append-only, fsynced JSON-lines record of every release.
- `accounting`: epsilon from a history and sigma from a target, via Opacus's accountants.
- `budget`: `PrivacyBudget` refuses a release before it would exceed ``max_epsilon``.
- `dpsgd`: Opacus wrapping for a party's own model in a manual VFL loop.
- `attacks`, `audit`: measured label leakage, and the audit report built from a ledger.

Releases to other parties (label DP, embedding DP) are accounted without subsampling
amplification, because every party learns which rows are in each batch; only DP-SGD on a
model that leaves the party may claim it.
"""

from securevfl.privacy.accounting import (
    ACCOUNTANTS,
    AccountingWarning,
    calibrate_noise,
    default_delta,
    epsilon,
    epsilon_by_role,
    histories_by_role,
)
from securevfl.privacy.attacks import (
    LeakageMeasurement,
    attack_auc,
    best_of_both_auc,
    direction_scores,
    measure_label_leakage,
    norm_scores,
)
from securevfl.privacy.audit import (
    NO_GUARANTEE,
    AuditReport,
    AuditRow,
    UnprotectedRelease,
    audit,
    format_report,
)
from securevfl.privacy.budget import BudgetExceeded, PrivacyBudget
from securevfl.privacy.dpsgd import make_private_model
from securevfl.privacy.ledger import (
    LEDGER_FILENAME,
    LedgerError,
    LedgerEvent,
    PrivacyLedger,
)
from securevfl.privacy.mechanisms import (
    DPSGD,
    MECHANISMS,
    EmbeddingDP,
    LabelGradientDP,
    Mechanism,
    ReleaseMechanism,
    create_mechanism,
    register_mechanism,
)

__all__ = [
    "ACCOUNTANTS",
    "DPSGD",
    "LEDGER_FILENAME",
    "MECHANISMS",
    "NO_GUARANTEE",
    "AccountingWarning",
    "AuditReport",
    "AuditRow",
    "BudgetExceeded",
    "EmbeddingDP",
    "LabelGradientDP",
    "LeakageMeasurement",
    "LedgerError",
    "LedgerEvent",
    "Mechanism",
    "PrivacyBudget",
    "PrivacyLedger",
    "ReleaseMechanism",
    "UnprotectedRelease",
    "attack_auc",
    "audit",
    "best_of_both_auc",
    "calibrate_noise",
    "create_mechanism",
    "default_delta",
    "direction_scores",
    "epsilon",
    "epsilon_by_role",
    "format_report",
    "histories_by_role",
    "make_private_model",
    "measure_label_leakage",
    "norm_scores",
    "register_mechanism",
]
