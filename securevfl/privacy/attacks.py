"""Label inference from the gradients a passive party received: measured leakage next to epsilon.

A passive party receives, per row, the gradient of the loss with respect to the sum it
contributed to. For binary classification with a sigmoid output, that gradient is
``(p_i - y_i) * J_i`` where J_i depends on the head: positives and negatives point in opposite
directions, and when positives are rare (p small for most rows) positives have the larger
norm (Li et al., "Label Leakage and Protection in Two-party Split Learning", 2022).

Two label-free attacker rules are implemented; each gives a score per row where *higher means
"the attacker believes this row is positive"*:

- `norm_scores`: the L2 norm of the row.
- `direction_scores`: the cosine similarity to a reference direction. Without a reference the
  attacker takes the top principal direction of the (uncentred) gradients, i.e. the axis the
  two classes spread along, and orients it so that the *minority* side (fewer rows with a
  positive cosine) is called positive: the attacker's prior is that positives are rare.

`attack_auc` reports the ROC-AUC of the stated rule, unflipped: an AUC below 0.5 means the
rule is wrong for this data, and flipping it would need the labels. `best_of_both_auc`
(``max(auc, 1 - auc)``) is an oracle upper bound that uses the labels to orient the rule;
report it as such, not as an attack an honest-but-curious party can run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from sklearn.metrics import roc_auc_score

__all__ = [
    "LeakageMeasurement",
    "attack_auc",
    "best_of_both_auc",
    "direction_scores",
    "measure_grouped_leakage",
    "measure_label_leakage",
    "norm_scores",
    "reference_direction",
]


def _as_rows(grads: Any) -> np.ndarray:
    if hasattr(grads, "detach"):  # a torch tensor, without importing torch here
        grads = grads.detach().cpu().numpy()
    g = np.asarray(grads, dtype=np.float64)
    if g.ndim == 0:
        raise ValueError("grads must have one row per sample, got a scalar")
    if g.shape[0] == 0:
        raise ValueError("grads has no rows")
    g = g.reshape(g.shape[0], -1)
    if not np.isfinite(g).all():
        raise ValueError("grads contains NaN or infinite values")
    return g


def norm_scores(grads: np.ndarray) -> np.ndarray:
    """Per-row L2 norm of ``grads`` ([rows, ...]); rows of a rare positive class tend to have
    the larger gradient norm. Refuses empty or non-finite input."""
    return np.linalg.norm(_as_rows(grads), axis=1)


def reference_direction(grads: np.ndarray) -> np.ndarray:
    """The unit direction a label-free attacker compares rows against: the top eigenvector of
    ``G^T G`` (uncentred principal direction), signed so that fewer rows have a positive
    cosine with it than a negative one (the minority side is called positive).

    Refuses (ValueError) gradients that are all zero.
    """
    g = _as_rows(grads)
    _, vecs = np.linalg.eigh(g.T @ g)
    v = vecs[:, -1]
    if not np.any(g @ v):
        raise ValueError("every gradient row is zero: there is no direction to attack")
    proj = g @ v
    if np.count_nonzero(proj > 0) > np.count_nonzero(proj < 0):
        v = -v
    return v / np.linalg.norm(v)


def direction_scores(grads: np.ndarray, *, reference: np.ndarray | None = None) -> np.ndarray:
    """Per-row cosine similarity between ``grads`` and ``reference``.

    Without ``reference`` the attacker's label-free choice `reference_direction` is used. A
    known-label attacker may pass the gradient of one row whose label it knows (positive).
    Zero rows score 0.
    """
    g = _as_rows(grads)
    if reference is None:
        ref = reference_direction(g)
    else:
        ref = np.asarray(reference, dtype=np.float64).reshape(-1)
        if ref.shape[0] != g.shape[1]:
            raise ValueError(
                f"reference has {ref.shape[0]} entries but each gradient row has {g.shape[1]}"
            )
        if not np.isfinite(ref).all() or not np.any(ref):
            raise ValueError("reference must be a finite, non-zero vector")
        ref = ref / np.linalg.norm(ref)
    norms = np.linalg.norm(g, axis=1)
    dots = g @ ref
    return np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)


def _binary_labels(labels: Any, n: int) -> np.ndarray:
    y = np.asarray(labels).reshape(-1)
    if y.shape[0] != n:
        raise ValueError(f"got {n} scores but {y.shape[0]} labels")
    values = set(np.unique(y).tolist())
    if not values <= {0, 1}:
        raise ValueError(f"labels must be binary (0/1 or bool), got values {sorted(values)[:5]}")
    if len(values) < 2:
        raise ValueError("labels contain a single class: the AUC is undefined")
    return y.astype(np.int64)


def attack_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC-AUC of the attacker's rule "higher score means positive" against the true labels.

    Not flipped: 0.5 is chance, 1.0 perfect inference, below 0.5 a rule that points the wrong
    way (the attacker cannot know that without labels). Refuses non-finite scores, length
    mismatches, non-binary or single-class labels.
    """
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if not np.isfinite(s).all():
        raise ValueError("scores contains NaN or infinite values")
    y = _binary_labels(labels, s.shape[0])
    return float(roc_auc_score(y, s))


def best_of_both_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """``max(auc, 1 - auc)``: the rule or its opposite, whichever fits the labels better.

    An oracle upper bound (the orientation is chosen with the labels), not an attack a party
    can run; useful as a worst case next to `attack_auc`.
    """
    auc = attack_auc(scores, labels)
    return max(auc, 1.0 - auc)


@dataclass(frozen=True)
class LeakageMeasurement:
    """Label-inference AUCs measured on the gradients one party received."""

    norm_auc: float
    direction_auc: float
    rows: int
    positive_rate: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def measure_label_leakage(*, grads: np.ndarray, labels: np.ndarray) -> LeakageMeasurement:
    """Run both label-free attacks on ``grads`` ([rows, ...]) and score them against ``labels``
    (binary, one per row). See `attack_auc` for what the AUCs mean."""
    g = _as_rows(grads)
    y = _binary_labels(labels, g.shape[0])
    return LeakageMeasurement(
        norm_auc=attack_auc(norm_scores(g), y),
        direction_auc=attack_auc(direction_scores(g), y),
        rows=int(g.shape[0]),
        positive_rate=float(y.mean()),
    )


def _ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = (np.arange(len(values)) + 0.5) / len(values)
    return ranks


def measure_grouped_leakage(
    *, grads: np.ndarray, labels: np.ndarray, groups: np.ndarray
) -> LeakageMeasurement:
    """Both attacks on gradients received over a whole training run, scored group by group.

    ``groups`` (one per row, e.g. the epoch) splits the rows into stretches in which the model
    barely moved: the direction attack takes its reference direction per group, and the norm
    attack ranks norms within each group (the gradient scale drifts as training goes on).
    Both are label-free transformations an honest-but-curious party can make, since it knows
    when it received each row. The per-group scores are then pooled into one ROC-AUC each.
    """
    g = _as_rows(grads)
    y = _binary_labels(labels, g.shape[0])
    groups = np.asarray(groups).reshape(-1)
    if groups.shape[0] != g.shape[0]:
        raise ValueError(f"got {g.shape[0]} gradient rows but {groups.shape[0]} group labels")
    norm = np.zeros(g.shape[0])
    direction = np.zeros(g.shape[0])
    for value in np.unique(groups):
        rows = np.flatnonzero(groups == value)
        norm[rows] = _ranks(norm_scores(g[rows]))
        if np.any(g[rows]):
            direction[rows] = direction_scores(g[rows])
    return LeakageMeasurement(
        norm_auc=attack_auc(norm, y),
        direction_auc=attack_auc(direction, y),
        rows=int(g.shape[0]),
        positive_rate=float(y.mean()),
    )
