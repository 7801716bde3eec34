"""Evaluation of the encoder + head methods over missing blocks: every test pattern's rows
predicted once (`predict_rows`), accuracy averaged over each row's predictors and F1 averaged
over predictors (LASER-VFL's App. D), random classes where no predictor may run."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from securevfl.config import MissingSpec
from securevfl.lazy import torch
from securevfl.methods.base import ActiveContext, PartyDropped
from securevfl.methods.blocks.batches import chunks, pattern_codes, subset_code

Subset = tuple[str, ...]


@dataclass
class Prediction:
    """Class predictions of a pattern's rows, per predictor (a head, or "joint"); `fallback`
    marks random classes given because no predictor was available (or allowed)."""

    classes: dict[str, np.ndarray]
    fallback: bool = False


class BlockEvaluation:
    """Metrics from `predict_rows` (mixed into `BlockActive`)."""

    def predict_rows(
        self, ctx: ActiveContext, ids: np.ndarray, present: Subset
    ) -> Prediction | None:
        """Predictions for rows that all have blocks `present`; None leaves them out of the
        metrics."""
        raise NotImplementedError

    def classes_of(self, output: Any) -> np.ndarray:
        out = output.detach().cpu().numpy()
        if self.loss_task == "binary":
            return (out.reshape(-1) > 0).astype(np.int64)
        return out.argmax(axis=1).astype(np.int64)

    def random_classes(self, n: int, present: Subset) -> np.ndarray:
        rng = np.random.default_rng(
            [self.config.seed, 0xFA11, subset_code(present, self.blocks), n]
        )
        return rng.integers(0, self.n_classes, size=n)

    def predict_with(
        self, ctx: ActiveContext, ids: np.ndarray, subset: Subset, head: Callable[[Any], Any]
    ) -> Prediction:
        """The "joint" prediction of `head` applied to the sum over `subset`, in chunks."""
        parts = []
        for chunk in chunks(ids):
            sums, _ = self.forward_sums(ctx, chunk, [subset], train=False)
            parts.append(self.classes_of(head(sums[subset])))
        return Prediction({"joint": np.concatenate(parts)})

    def evaluate(self, ctx: ActiveContext, *, ids: np.ndarray) -> dict[str, Any]:
        """Test metrics: accuracy averaged over the predictors of each row (the paper's
        per-client average), F1 of the positive class (binary; macro F1 for multiclass)
        averaged over predictors. With `[method] eval_test_missing`, the same model is also
        evaluated with each extra MCAR test rate (drawn as the data split would); see
        `summary()`."""
        self.sync_dead(ctx)
        self.heads.eval()
        if self.own is not None:
            self.own.eval()
        pres = self.presence_matrix(ctx, ids)
        metrics = self.evaluate_presence(ctx, ids, pres)
        cfg = self.config
        for rate in cfg.options.eval_test_missing:
            from securevfl.data.missing import presence

            extra = presence(
                MissingSpec(kind="mcar", params=(("p", float(rate)),)),
                parties=cfg.party_names,
                n_rows=len(ids),
                seed=cfg.seed,
                split="test",
            )
            if self.own_name is not None:
                extra = np.concatenate([extra, np.ones((len(ids), 1), dtype=bool)], axis=1)
            self.extra_tests[f"p_test={float(rate):g}"] = self.evaluate_presence(
                ctx, ids, pres & extra
            )
        return metrics

    def predict(self, ctx: ActiveContext, *, ids: np.ndarray) -> np.ndarray:
        """One class per row: the majority of its predictors (ties to the lowest class); -1
        for a row no present block can predict."""
        self.sync_dead(ctx)
        self.heads.eval()
        if self.own is not None:
            self.own.eval()
        pres = self.presence_matrix(ctx, ids)
        out = np.full(len(ids), -1, dtype=np.int64)
        codes = pattern_codes(pres)
        with torch.no_grad():
            for code in np.unique(codes[pres.any(axis=1)]):
                rows = np.flatnonzero(codes == code)
                pred = self.predict_rows(ctx, ids[rows], self.present_of(pres[rows[0]]))
                if pred is None:
                    continue
                votes = np.zeros((len(rows), self.n_classes))
                for classes in pred.classes.values():
                    votes[np.arange(len(rows)), classes] += 1
                out[rows] = votes.argmax(axis=1)
        return out

    def evaluate_presence(
        self, ctx: ActiveContext, ids: np.ndarray, pres: np.ndarray
    ) -> dict[str, Any]:
        keep = pres.any(axis=1)
        ids, pres = ids[keep], pres[keep]
        y = self.table.label_rows(ids).astype(np.int64)
        codes = pattern_codes(pres)
        preds: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        n_fallback = n_excluded = 0
        with torch.no_grad():
            for code in np.unique(codes):
                rows = np.flatnonzero(codes == code)
                pattern = pres[rows[0]]
                while True:
                    self.sync_dead(ctx)
                    present = self.present_of(pattern)
                    if not present:
                        pred = Prediction(
                            {"joint": self.random_classes(len(rows), present)}, fallback=True
                        )
                        break
                    try:
                        pred = self.predict_rows(ctx, ids[rows], present)
                        break
                    except PartyDropped as exc:
                        self.lose(ctx, exc.party)
                        if exc.delivered:  # summed over the full group already: no re-run
                            guess = self.random_classes(len(rows), present)
                            pred = Prediction({"joint": guess}, fallback=True)
                            break
                if pred is None:
                    n_excluded += len(rows)
                    continue
                n_fallback += len(rows) if pred.fallback else 0
                for name, classes in pred.classes.items():
                    preds.setdefault(name, []).append((rows, classes))
        return self.metrics_from(y, preds, n_fallback=n_fallback, n_excluded=n_excluded)

    def metrics_from(
        self,
        y: np.ndarray,
        preds: Mapping[str, list[tuple[np.ndarray, np.ndarray]]],
        *,
        n_fallback: int,
        n_excluded: int,
    ) -> dict[str, Any]:
        from sklearn.metrics import f1_score

        correct = np.zeros(len(y))
        votes = np.zeros(len(y))
        f1s = {}
        binary = self.config.task == "binary"
        for name, parts in preds.items():
            rows = np.concatenate([r for r, _ in parts])
            classes = np.concatenate([c for _, c in parts])
            np.add.at(correct, rows, classes == y[rows])
            np.add.at(votes, rows, 1)
            f1s[name] = float(
                f1_score(y[rows], classes, zero_division=0, average="binary" if binary else "macro")
            )
        scored = votes > 0
        out: dict[str, Any] = {
            "accuracy": float(np.mean(correct[scored] / votes[scored])) if scored.any() else 0.0,
            "f1" if binary else "macro_f1": float(np.mean(list(f1s.values()))) if f1s else 0.0,
            "n_eval": int(scored.sum()),
            "n_fallback": int(n_fallback),
            "n_excluded": int(n_excluded),
        }
        if len(f1s) > 1:
            out["f1_per_predictor"] = f1s
        return out

    # --- state
