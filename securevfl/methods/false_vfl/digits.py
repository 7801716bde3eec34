"""FALSE-VFL on scikit-learn's digits in one process (notes section 11, experiment A, with the
issue's label budget), the baseline the federated method is compared with: K = 8 parties, party
k holds pixel row k of each 8x8 image. Imports torch at import time.

`digits_experiment` trains FALSE-VFL-I / FALSE-VFL-II (`FalseVFLReference`, every cross-party
quantity through the in-memory secure sum) and a vanilla VFL baseline (per-party MLP extractors and
a fusion head, trained on the fully aligned labeled rows only, zero-filled at test time), and
reports test accuracy under each test missingness mechanism. No download: the data ship with
scikit-learn. All randomness comes from explicit numpy / torch Generators.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
from torch import nn

from securevfl.methods.blocks.nets import derived_seed, mlp, torch_generator
from securevfl.methods.false_vfl.model import FalseVFLConfig
from securevfl.methods.false_vfl.reference import FalseVFLReference, TrainSchedule

MECHANISMS = ("mcar0", "mcar2", "mcar5", "mar1", "mar2", "mnar7", "mnar9")
METHODS = ("vanilla", "false1", "false2")


def _force_one(present: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Rows with no block held get one random block back (notes section 12, item 9)."""
    empty = ~present.any(1)
    present[np.flatnonzero(empty), rng.integers(0, present.shape[1], size=int(empty.sum()))] = True
    return present


def _mar1(v: np.ndarray, rng: np.random.Generator, t: float = 1.1, d: float = 0.15) -> np.ndarray:
    obs = np.zeros(len(v), bool)
    for k in rng.permutation(len(v)):
        obs[k] = True
        if v[k] > t:
            break
        t -= d
    return obs


def _mar2(
    v: np.ndarray, rng: np.random.Generator, t: float = 0.5, b: float = 0.7, d: float = 0.15
) -> np.ndarray:
    obs = np.zeros(len(v), bool)
    for k in rng.permutation(len(v)):
        obs[k] = True
        b -= max(v[k] - t, 0.0)
        if b <= 0:
            break
        t -= d
    return obs


def missing_mask(
    mechanism: str, blocks: Sequence[np.ndarray], rng: np.random.Generator
) -> np.ndarray:
    """present [n, K] (True = held) under one of `MECHANISMS` (paper section 5.1 / App. D.3) for
    normalised blocks [n, d_k]; every row keeps at least one block. Refuses unknown names."""
    n, k = blocks[0].shape[0], len(blocks)
    if mechanism.startswith("mcar"):
        p = {"mcar0": 0.0, "mcar2": 0.2, "mcar5": 0.5}.get(mechanism)
        if p is None:
            raise ValueError(f"unknown mechanism {mechanism!r}; known: {MECHANISMS}")
        return _force_one(rng.random((n, k)) >= p, rng)
    if mechanism in ("mnar7", "mnar9"):
        p = 0.7 if mechanism == "mnar7" else 0.9
        means = np.stack([b.mean(1) for b in blocks], 1)
        return _force_one(rng.random((n, k)) >= np.where(means < 0, p, 1 - p), rng)
    if mechanism in ("mar1", "mar2"):
        var = np.stack([b.var(1) for b in blocks], 1)
        rule = _mar1 if mechanism == "mar1" else _mar2
        return np.stack([rule(var[i], rng) for i in range(n)])
    raise ValueError(f"unknown mechanism {mechanism!r}; known: {MECHANISMS}")


@dataclass(frozen=True)
class DigitsData:
    """Normalised party blocks and masks: train_x/test_x are K arrays [n, 8]; train_present
    [n_train, K]; labeled/aligned [n_train] bool; test_present maps mechanism -> [n_test, K]."""

    train_x: list[np.ndarray]
    train_y: np.ndarray
    train_present: np.ndarray
    labeled: np.ndarray
    aligned: np.ndarray
    test_x: list[np.ndarray]
    test_y: np.ndarray
    test_present: dict[str, np.ndarray]


def digits_data(
    *,
    train_mechanism: str,
    test_mechanisms: Sequence[str],
    n_test: int = 500,
    n_labeled: int = 500,
    n_aligned: int = 100,
    seed: int = 0,
) -> DigitsData:
    """Split digits (1797 rows) into n_test test rows and the rest for training; of the training
    rows n_labeled carry labels, n_aligned of those are reserved fully aligned, and every other
    training row (unlabeled included) is masked by `train_mechanism`. Pixels are z-scored with
    training-set statistics (constant pixels become 0)."""
    from sklearn.datasets import load_digits

    if not 0 <= n_aligned <= n_labeled:
        raise ValueError("need 0 <= n_aligned <= n_labeled")
    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(derived_seed(seed, "digits-split"))
    perm = rng.permutation(len(y))
    te, tr = perm[:n_test], perm[n_test:]
    if n_labeled > len(tr):
        raise ValueError(f"n_labeled {n_labeled} > {len(tr)} training rows")
    mean, std = x[tr].mean(0), x[tr].std(0)
    z = ((x - mean) / np.where(std > 1e-12, std, 1.0)).astype(np.float32)
    train_x = [z[tr, 8 * k : 8 * k + 8] for k in range(8)]
    test_x = [z[te, 8 * k : 8 * k + 8] for k in range(8)]
    mrng = np.random.default_rng(derived_seed(seed, "digits-train-mask", train_mechanism))
    present = missing_mask(train_mechanism, train_x, mrng)
    labeled = np.zeros(len(tr), bool)
    labeled[:n_labeled] = True
    present[:n_aligned] = True
    aligned = labeled & present.all(1)
    test_present = {
        m: missing_mask(m, test_x, np.random.default_rng(derived_seed(seed, "digits-test-mask", m)))
        for m in test_mechanisms
    }
    return DigitsData(
        train_x, y[tr].astype(np.int64), present, labeled, aligned, test_x, y[te], test_present
    )


class VanillaVFL(nn.Module):
    """Split-NN baseline: per-party MLP extractors, concatenated embeddings, an MLP fusion head.
    Missing blocks are zero-filled (the training mean after z-scoring)."""

    def __init__(
        self, d_parts: Sequence[int], n_classes: int, *, hidden: int, emb: int, seed: int
    ) -> None:
        super().__init__()
        self.extractors = nn.ModuleList(
            mlp(d, [hidden], emb, seed=derived_seed(seed, "vanilla", k))
            for k, d in enumerate(d_parts)
        )
        self.head = mlp(
            emb * len(d_parts), [hidden], n_classes, seed=derived_seed(seed, "vanilla-h")
        )

    def forward(self, xs: Sequence[torch.Tensor], present: torch.Tensor) -> torch.Tensor:
        parts = [
            f(torch.where(present[:, k : k + 1], x, torch.zeros_like(x)))
            for k, (f, x) in enumerate(zip(self.extractors, xs, strict=True))
        ]
        return self.head(torch.relu(torch.cat(parts, 1)))


def _fit_vanilla(
    model: VanillaVFL,
    xs: list[torch.Tensor],
    y: torch.Tensor,
    *,
    epochs: int,
    lr: float,
    weight_decay: float,
    batch: int,
    seed: int,
) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    g = torch_generator(seed, "vanilla-batches")
    full = torch.ones(len(y), len(xs), dtype=torch.bool)
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), batch):
            ii = perm[i : i + batch]
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model([x[ii] for x in xs], full[ii]), y[ii])
            loss.backward()
            opt.step()


def _accuracy(
    predict: Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor], data: DigitsData
) -> dict[str, float]:
    xs = [torch.as_tensor(x) for x in data.test_x]
    y = torch.as_tensor(data.test_y)
    out = {}
    for mech, present in data.test_present.items():
        with torch.no_grad():
            pred = predict(xs, torch.as_tensor(present)).argmax(1)
        out[mech] = float((pred == y).float().mean()) * 100.0
    return out


@dataclass(frozen=True)
class DigitsSettings:
    """Everything `digits_experiment` varies; defaults are the measured "full" setting."""

    # aggregation "mean": the setting the slow tests' numbers were measured with
    cfg: FalseVFLConfig = FalseVFLConfig(
        d_h=32,
        d_z=16,
        hidden=(128, 128),
        mask_hidden=(64, 64),
        disc_hidden=(128,),
        aggregation="mean",
    )
    schedule: TrainSchedule = TrainSchedule(stage1_epochs=300, stage2_epochs=100)
    vanilla_hidden: int = 64
    vanilla_emb: int = 16
    vanilla_epochs: int = 200
    vanilla_batch: int = 32


def digits_experiment(
    *,
    train_mechanism: str = "mcar5",
    test_mechanisms: Sequence[str] = ("mcar0", "mcar5"),
    methods: Sequence[str] = ("vanilla", "false1"),
    n_test: int = 500,
    n_labeled: int = 500,
    n_aligned: int = 100,
    settings: DigitsSettings | None = None,
    seed: int = 0,
) -> dict:
    """Train each of `methods` ("vanilla", "false1" = FALSE-VFL-I, "false2" = FALSE-VFL-II) on the
    digits split of `digits_data` and return {"accuracy": {method: {mechanism: %}}, "seconds":
    {method: s}, "settings": {...}}. FALSE-VFL uses every training row in stage 1 and the
    labeled rows in stage 2; vanilla uses the fully aligned labeled rows only. Refuses unknown
    methods or mechanisms."""
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; known: {METHODS}")
    s = settings or DigitsSettings()
    data = digits_data(
        train_mechanism=train_mechanism,
        test_mechanisms=test_mechanisms,
        n_test=n_test,
        n_labeled=n_labeled,
        n_aligned=n_aligned,
        seed=seed,
    )
    xs = [torch.as_tensor(x) for x in data.train_x]
    y = torch.as_tensor(data.train_y)
    d_parts = [x.shape[1] for x in xs]
    acc: dict[str, dict[str, float]] = {}
    secs: dict[str, float] = {}
    for method in methods:
        t0 = time.perf_counter()
        if method == "vanilla":
            al = torch.as_tensor(np.flatnonzero(data.aligned))
            model = VanillaVFL(d_parts, 10, hidden=s.vanilla_hidden, emb=s.vanilla_emb, seed=seed)
            _fit_vanilla(
                model,
                [x[al] for x in xs],
                y[al],
                epochs=s.vanilla_epochs,
                lr=s.schedule.stage2_lr,
                weight_decay=s.schedule.weight_decay,
                batch=s.vanilla_batch,
                seed=seed,
            )
            model.eval()
            acc[method] = _accuracy(lambda a, p, m=model: torch.softmax(m(a, p), 1), data)
        else:
            cfg = replace(s.cfg, mnar=method == "false2")
            ref = FalseVFLReference(d_parts, 10, cfg, seed=seed)
            ref.fit(
                xs,
                torch.as_tensor(data.train_present),
                torch.as_tensor(data.labeled),
                y,
                s.schedule,
            )
            acc[method] = _accuracy(ref.predict_proba, data)
        secs[method] = time.perf_counter() - t0
    return {
        "accuracy": acc,
        "seconds": secs,
        "settings": {
            "train_mechanism": train_mechanism,
            "n_train": len(y),
            "n_labeled": int(data.labeled.sum()),
            "n_aligned_labeled": int(data.aligned.sum()),
            "seed": seed,
            **{k: str(v) for k, v in asdict(s).items()},
        },
    }


if __name__ == "__main__":  # pragma: no cover - manual measurement entry point
    import json
    import sys

    mech = sys.argv[1] if len(sys.argv) > 1 else "mcar5"
    res = digits_experiment(
        train_mechanism=mech,
        test_mechanisms=MECHANISMS,
        methods=("vanilla", "false1", "false2"),
    )
    print(json.dumps(res, indent=1))
