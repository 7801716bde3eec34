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

Names are imported from their submodule on first use (PEP 562): a role that only appends to
the ledger does not load Opacus, scikit-learn and their dependencies (~2 s of start-up on a
small machine).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_SOURCE = {
    "ACCOUNTANTS": "accounting",
    "AccountingWarning": "accounting",
    "AuditReport": "audit",
    "AuditRow": "audit",
    "BudgetExceeded": "budget",
    "DPSGD": "mechanisms",
    "EmbeddingDP": "mechanisms",
    "LEDGER_FILENAME": "ledger",
    "LabelGradientDP": "mechanisms",
    "LeakageMeasurement": "attacks",
    "LedgerError": "ledger",
    "LedgerEvent": "ledger",
    "MECHANISMS": "mechanisms",
    "Mechanism": "mechanisms",
    "NO_GUARANTEE": "audit",
    "PrivacyBudget": "budget",
    "PrivacyLedger": "ledger",
    "ReleaseMechanism": "mechanisms",
    "UnprotectedRelease": "audit",
    "attack_auc": "attacks",
    "audit": "audit",
    "best_of_both_auc": "attacks",
    "calibrate_noise": "accounting",
    "create_mechanism": "mechanisms",
    "default_delta": "accounting",
    "direction_scores": "attacks",
    "epsilon": "accounting",
    "epsilon_by_role": "accounting",
    "format_report": "audit",
    "histories_by_role": "accounting",
    "make_private_model": "dpsgd",
    "measure_label_leakage": "attacks",
    "norm_scores": "attacks",
    "register_mechanism": "mechanisms",
}


def __getattr__(name: str) -> Any:
    module = _SOURCE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """`securevfl.privacy.audit` is the function (as the eager imports made it), whichever was
    imported first: importing the submodule `securevfl.privacy.audit` binds the package's
    attribute to the module, which this setter ignores."""

    @property
    def audit(self) -> Any:
        from securevfl.privacy.audit import audit

        return audit

    @audit.setter
    def audit(self, value: Any) -> None:
        pass


sys.modules[__name__].__class__ = _Package


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
