"""Held-out metrics per task, as plain floats for metrics.json."""

from __future__ import annotations

import numpy as np


def task_metrics(task: str, *, y_true: np.ndarray, output: np.ndarray) -> dict[str, float]:
    """`output` is the model's raw output: a logit (binary), logits [n, C] (multiclass) or a
    prediction (regression)."""
    from sklearn.metrics import (
        accuracy_score,
        f1_score,
        mean_squared_error,
        r2_score,
        roc_auc_score,
    )

    y_true = np.asarray(y_true)
    if len(y_true) == 0:
        return {}
    if task == "binary":
        score = np.asarray(output, dtype=np.float64).reshape(-1)
        pred = (score > 0).astype(int)
        out = {
            "accuracy": float(accuracy_score(y_true, pred)),
            "f1": float(f1_score(y_true, pred, zero_division=0)),
        }
        if len(np.unique(y_true)) == 2:
            out["roc_auc"] = float(roc_auc_score(y_true, score))
        return out
    if task == "multiclass":
        pred = np.asarray(output).argmax(axis=1)
        return {
            "accuracy": float(accuracy_score(y_true, pred)),
            "macro_f1": float(f1_score(y_true, pred, average="macro", zero_division=0)),
        }
    if task == "regression":
        pred = np.asarray(output, dtype=np.float64).reshape(-1)
        return {
            "rmse": float(np.sqrt(mean_squared_error(y_true, pred))),
            "r2": float(r2_score(y_true, pred)) if len(y_true) > 1 else float("nan"),
        }
    raise ValueError(f"unknown task {task!r}")
