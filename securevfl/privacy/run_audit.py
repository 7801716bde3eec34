"""`securevfl audit RUN_DIR`: the privacy spent in a run, from its ledger alone, and optionally
the label leakage measured on what the passive parties received.

A run directory holds:

- ``ledger.jsonl``: every DP release and every release with no formal guarantee;
- ``privacy.json`` (the manifest the active party writes at start): the active party's name,
  the id and label columns, the task, the run's delta and accountant, N;
- ``received/<party>.npz``: with ``[privacy] record_received = true``, the gradient rows each
  passive party received, with their sample ids (`ReceivedGradients`).

Epsilon is recomputed from the ledger only; the manifest gives defaults (the accountant) and,
for ``--attack``, where the labels are. The attack is label-free, but *scoring* it needs the
true training labels, which only the active party holds (``RUN_DIR/data/<active>.csv``, or
``labels=``): an auditor needs the active party's cooperation for that part.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from securevfl.errors import AuditError
from securevfl.privacy.attacks import LeakageMeasurement, measure_grouped_leakage
from securevfl.privacy.audit import AuditReport, audit
from securevfl.privacy.ledger import LEDGER_FILENAME, LedgerError
from securevfl.privacy.runtime import ReceivedGradients

__all__ = [
    "MANIFEST_FILENAME",
    "RECEIVED_DIR",
    "AuditError",
    "audit_run",
    "epsilon_summary",
    "read_labels",
    "read_manifest",
    "received_leakage",
    "write_manifest",
]

MANIFEST_FILENAME = "privacy.json"
RECEIVED_DIR = "received"


def write_manifest(run_dir: Path, **fields: Any) -> Path:
    """Write ``RUN_DIR/privacy.json`` atomically (the active party does, at start)."""
    path = Path(run_dir) / MANIFEST_FILENAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(run_dir: Path) -> dict[str, Any]:
    """The manifest's content, or {} when the run has none (a passive party's own run dir)."""
    path = Path(run_dir) / MANIFEST_FILENAME
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise AuditError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise AuditError(f"{path} must hold a JSON object")
    return data


def read_labels(path: Path, *, id_column: str, label: str) -> tuple[np.ndarray, np.ndarray]:
    """(sorted ids, labels) from a CSV with at least the id and label columns."""
    if not Path(path).exists():
        raise AuditError(
            f"no label file at {path}: the attack is scored against the active party's labels; "
            "pass --labels with the active party's CSV"
        )
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, [])
        if id_column not in header or label not in header:
            raise AuditError(
                f"{path} needs the columns {id_column!r} and {label!r}; it has {header[:20]}"
            )
        i, j = header.index(id_column), header.index(label)
        rows = [(int(r[i]), float(r[j])) for r in reader if r]
    ids = np.array([r[0] for r in rows], dtype=np.int64)
    labels = np.array([r[1] for r in rows], dtype=np.float64)
    order = np.argsort(ids)
    return ids[order], labels[order]


def received_leakage(
    received: dict[str, dict[str, np.ndarray]], *, ids: np.ndarray, labels: np.ndarray
) -> dict[str, LeakageMeasurement]:
    """Label-inference AUCs per received tensor (see `measure_grouped_leakage`).

    Each row is scaled by its batch size first: a mean loss gives rows a 1/B factor, which the
    receiving party can undo because it knows every batch's rows. Rows are grouped by epoch.
    """
    out: dict[str, LeakageMeasurement] = {}
    for name, block in received.items():
        pos = np.minimum(np.searchsorted(ids, block["ids"]), len(ids) - 1)
        if len(ids) == 0 or not np.array_equal(ids[pos], block["ids"]):
            raise AuditError(f"received tensor {name!r} has rows whose id has no label")
        y = labels[pos]
        grads = block["grads"].astype(np.float64) * block["batch"][:, None]
        out[name] = measure_grouped_leakage(grads=grads, labels=y, groups=block["epoch"])
    return out


def audit_run(
    run_dir: Path,
    *,
    accountant: str | None = None,
    delta: float | None = None,
    attack: bool = False,
    labels: Path | None = None,
) -> AuditReport:
    """Audit a run directory: epsilon per (role, mechanism) from ``ledger.jsonl`` (at the
    recorded delta unless ``delta``; with the run's accountant unless ``accountant``), the
    releases with no formal guarantee, and with ``attack`` the label leakage measured on
    ``received/*.npz``. Raises `AuditError` for a missing ledger, or for an attack that
    cannot be run (no received gradients, not a binary task, no labels)."""
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    path = run_dir / LEDGER_FILENAME if run_dir.is_dir() else run_dir
    if not path.exists():
        raise AuditError(f"no privacy ledger at {path}: is {run_dir} a securevfl run directory?")
    try:
        report = audit(
            path,
            delta=delta,
            tolerate_torn_tail=True,
            accountant=accountant or manifest.get("accountant", "rdp"),
        )
    except LedgerError as exc:
        raise AuditError(str(exc)) from None
    if not attack:
        return report
    task = manifest.get("task", "binary")
    if task != "binary":
        raise AuditError(
            f"--attack scores label inference on binary tasks; this run's task is {task!r}"
        )
    files = sorted((run_dir / RECEIVED_DIR).glob("*.npz"))
    if not files:
        raise AuditError(
            f"no received gradients in {run_dir / RECEIVED_DIR}: run with [privacy] "
            "record_received = true to let the passive parties keep what they receive"
        )
    active = manifest.get("active", "active")
    label_file = Path(labels) if labels is not None else run_dir / "data" / f"{active}.csv"
    ids, y = read_labels(
        label_file, id_column=manifest.get("id_column", "ID"), label=manifest.get("label", "Y")
    )
    for f in files:
        received = ReceivedGradients.load(f)
        for name, m in received_leakage(received, ids=ids, labels=y).items():
            report.leakage[f.stem if len(received) == 1 else f"{f.stem}/{name}"] = m
    report.leakage_labels = str(label_file)
    return report


def epsilon_summary(report: AuditReport) -> dict[str, Any]:
    """The ``privacy`` entry of metrics.json: epsilon per role and mechanism, and what was
    released with no formal guarantee."""
    return {
        "accountant": report.accountant,
        "epsilon": {
            f"{r.role}/{r.mechanism}": (r.epsilon if math.isfinite(r.epsilon) else None)
            for r in report.rows
        },
        "delta": {f"{r.role}/{r.mechanism}": r.delta for r in report.rows},
        "steps": {f"{r.role}/{r.mechanism}": r.steps for r in report.rows},
        "unprotected": [
            {"role": u.role, "what": u.what, "count": u.count} for u in report.unprotected
        ],
    }
