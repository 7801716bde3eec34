"""The paper's latent-quality evaluation (section V-B): the latent of every row, re-split
70/30, downstream scikit-learn classifiers, their accuracy, weighted F1 and ROC-AUC averaged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from securevfl.methods.tabvfl.reference import _Trainable


def extract_latent(model: _Trainable, xs: Sequence[np.ndarray]) -> np.ndarray:
    """The (N, n_d) latent of all rows for the downstream evaluation (eval mode, no mask)."""
    return model.encode(xs)


PAPER_CLASSIFIERS = ("logistic", "tree", "forest", "mlp", "svm", "xgboost")


def evaluate_latent(
    z: np.ndarray,
    y: np.ndarray,
    *,
    seed: int,
    classifiers: Sequence[str] = ("logistic",),
    test_fraction: float = 0.3,
) -> dict[str, float]:
    """The paper's latent-quality score: stratified 70/30 re-split of (z, y) with
    ``random_state=seed``, each classifier with sklearn defaults and ``random_state=42``, and
    the mean over classifiers of weighted F1, accuracy and ROC-AUC (positive-class for binary,
    weighted one-vs-rest otherwise). "xgboost" is skipped when xgboost is not installed;
    refuses unknown classifier names."""
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, f1_score, roc_auc_score
    from sklearn.model_selection import train_test_split
    from sklearn.neural_network import MLPClassifier
    from sklearn.svm import LinearSVC
    from sklearn.tree import DecisionTreeClassifier

    def make(name: str) -> object | None:
        if name == "logistic":
            return LogisticRegression(random_state=42, max_iter=1000)
        if name == "tree":
            return DecisionTreeClassifier(random_state=42)
        if name == "forest":
            return RandomForestClassifier(random_state=42)
        if name == "mlp":
            return MLPClassifier(random_state=42)
        if name == "svm":
            return CalibratedClassifierCV(LinearSVC(random_state=42), method="sigmoid")
        if name == "xgboost":
            try:
                from xgboost import XGBClassifier
            except ImportError:
                return None
            return XGBClassifier(random_state=42)
        raise ValueError(f"unknown classifier {name!r}; known: {PAPER_CLASSIFIERS}")

    z = np.asarray(z, dtype=np.float64)
    y = np.asarray(y)
    z_tr, z_te, y_tr, y_te = train_test_split(
        z, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    scores: dict[str, list[float]] = {"f1": [], "accuracy": [], "roc_auc": []}
    binary = len(np.unique(y)) == 2
    for name in classifiers:
        clf = make(name)
        if clf is None:
            continue
        clf.fit(z_tr, y_tr)
        pred = clf.predict(z_te)
        proba = clf.predict_proba(z_te)
        scores["f1"].append(float(f1_score(y_te, pred, average="weighted")))
        scores["accuracy"].append(float(accuracy_score(y_te, pred)))
        if binary:
            scores["roc_auc"].append(float(roc_auc_score(y_te, proba[:, 1])))
        else:
            scores["roc_auc"].append(
                float(roc_auc_score(y_te, proba, multi_class="ovr", average="weighted"))
            )
    return {k: float(np.mean(v)) if v else float("nan") for k, v in scores.items()}
