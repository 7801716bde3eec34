"""Evaluation of the encoder + head methods over missing blocks: every test pattern's rows
predicted once (`predict_rows`), accuracy averaged over each row's predictors and F1 averaged
over predictors (LASER-VFL's App. D), random classes where no predictor may run.

A table streamed from disk is evaluated without a per-row array in memory: each test row's
pattern is read a chunk at a time into files of the row cache (one per pattern), each pattern's
rows are predicted a chunk at a time (the chunks `predict_rows` cuts in memory, and its random
draws from one generator per pattern, so the predictions are the same), and the metrics are
accumulated (confusion counts per predictor, the sum of the rows' accuracies); so are the extra
MCAR test rates of `[method] eval_test_missing` (their presence drawn a chunk at a time). Scoring
(`predict`) likewise: each pattern's rows predicted a chunk at a time, each chunk's classes
written into a file of the row cache."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from securevfl.config import MissingSpec
from securevfl.lazy import torch
from securevfl.methods.base import ActiveContext, PartyDropped
from securevfl.methods.blocks.batches import chunks, pattern_codes, row_chunks, subset_code

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

    # set while a streamed evaluation predicts one pattern's rows chunk by chunk
    _pattern_total: int | None = None
    _pattern_rngs: dict[tuple[int, int], np.random.Generator]

    def pattern_rng(self, tag: int, present: Subset, n: int) -> np.random.Generator:
        """The generator of the random draws (`tag`) over `n` rows of pattern `present`, seeded
        by the rows' count; while a streamed evaluation predicts a pattern's rows a chunk at a
        time, one generator seeded by their total, so the chunks draw what one call would."""
        code = subset_code(present, self.blocks)
        if self._pattern_total is None:
            return np.random.default_rng([self.config.seed, tag, code, n])
        if (tag, code) not in self._pattern_rngs:
            seed = [self.config.seed, tag, code, self._pattern_total]
            self._pattern_rngs[(tag, code)] = np.random.default_rng(seed)
        return self._pattern_rngs[(tag, code)]

    def random_classes(self, n: int, present: Subset) -> np.ndarray:
        return self.pattern_rng(0xFA11, present, n).integers(0, self.n_classes, size=n)

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
        cfg = self.config
        if getattr(self.table, "streamed", False):
            metrics = self.evaluate_streamed(ctx, ids)
            for rate in cfg.options.eval_test_missing:
                extra = self.extra_test_presence(float(rate), ids)
                self.extra_tests[f"p_test={float(rate):g}"] = self.evaluate_streamed(
                    ctx, ids, extra=extra
                )
            return metrics
        pres = self.presence_matrix(ctx, ids)
        metrics = self.evaluate_presence(ctx, ids, pres)
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
        if getattr(self.table, "streamed", False):
            return self.predict_streamed(ctx, ids)
        pres = self.presence_matrix(ctx, ids)
        out = np.full(len(ids), -1, dtype=np.int64)
        codes = pattern_codes(pres)
        with torch.no_grad():
            for code in np.unique(codes[pres.any(axis=1)]):
                rows = np.flatnonzero(codes == code)
                pred = self.predict_rows(ctx, ids[rows], self.present_of(pres[rows[0]]))
                if pred is None:
                    continue
                out[rows] = self.majority(pred, len(rows))
        return out

    def majority(self, pred: Prediction, n: int) -> np.ndarray:
        """Each of `n` rows' class voted by its predictors (ties to the lowest class)."""
        votes = np.zeros((n, self.n_classes))
        for classes in pred.classes.values():
            votes[np.arange(n), classes] += 1
        return votes.argmax(axis=1)

    def predict_streamed(self, ctx: ActiveContext, ids: np.ndarray) -> np.ndarray:
        """`predict(ctx, ids=ids)` for a table streamed from disk: the rows of each pattern in
        a file of the row cache, predicted a chunk at a time (the chunks and random draws
        `predict_rows` makes in memory, so the classes are the same), each chunk's classes
        written at once into a file-backed array of the row cache (returned, mapped)."""
        from securevfl.data.rowarrays import take

        arrays = self.table.rowstore.arrays()
        spools = self._pattern_spools(ctx, ids, arrays)
        filled = arrays.spool("predictions", np.int64)
        for block in row_chunks(ids):
            filled.write(np.full(len(block), -1, dtype=np.int64))
        out = filled.array(writable=True)
        width = len(self.blocks)
        try:
            with torch.no_grad():
                for code in sorted(spools):
                    positions = spools.pop(code).array()
                    present = self.present_of(((code >> np.arange(width)) & 1).astype(bool))
                    self._pattern_total, self._pattern_rngs = len(positions), {}
                    for part in chunks(positions):  # the chunks `predict_rows` cuts in memory
                        part = np.asarray(part, dtype=np.int64)
                        pred = self.predict_rows(ctx, take(ids, part), present)
                        if pred is None:
                            break
                        out[part] = self.majority(pred, len(part))
        finally:
            self._pattern_total = None
        if isinstance(out, np.memmap):
            out.flush()
        return out

    def _pattern_spools(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        arrays: Any,
        *,
        extra: Iterator[np.ndarray] | None = None,
    ) -> dict[int, Any]:
        """Per presence pattern (its code; none for rows with no present block) a file of
        `arrays` with the positions in `ids` of its rows, presence read a chunk at a time (and
        masked by the chunk's `extra`)."""
        spools: dict[int, Any] = {}
        start = 0
        for block in row_chunks(ids):
            pres = self.presence_matrix(ctx, block)
            if extra is not None:
                pres = pres & next(extra)
            codes = pattern_codes(pres)
            for code in np.unique(codes).tolist():
                if code == 0:  # no present block: left out, as in memory
                    continue
                if code not in spools:
                    spools[code] = arrays.spool(f"eval-pattern-{code}", np.int64)
                spools[code].write(start + np.flatnonzero(codes == code))
            start += len(block)
        return spools

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

    def extra_test_presence(self, rate: float, ids: np.ndarray) -> Iterator[np.ndarray]:
        """The extra MCAR test presence of `eval_test_missing` (what `missing.presence` draws
        for the test rows at `rate`, with the active party's block always present), one
        `row_chunks(ids)` chunk at a time: the same generator drawn in order gives the same
        rows."""
        from securevfl.data.missing import mcar

        cfg = self.config
        rng = np.random.default_rng([cfg.seed, 0x3155, 1])  # `missing.presence`'s, split "test"
        for block in row_chunks(ids):
            extra = mcar(parties=cfg.party_names, n_rows=len(block), rng=rng, p=rate)
            if self.own_name is not None:
                extra = np.concatenate([extra, np.ones((len(block), 1), dtype=bool)], axis=1)
            yield extra

    def evaluate_streamed(
        self, ctx: ActiveContext, ids: np.ndarray, *, extra: Iterator[np.ndarray] | None = None
    ) -> dict[str, Any]:
        """`evaluate_presence(ctx, ids, presence_matrix(ctx, ids) [& extra])` for a table
        streamed from disk: the rows of each pattern in a file of its row cache, predicted and
        scored a chunk at a time (`extra`: a presence mask per `row_chunks(ids)` chunk). Equal
        to it up to the order of the accuracy's sum."""
        spools = self._pattern_spools(ctx, ids, self.table.rowstore.arrays(), extra=extra)
        scores = _Scores(self.n_classes)
        n_fallback = n_excluded = 0
        width = len(self.blocks)
        with torch.no_grad():
            for code in sorted(spools):
                positions = spools.pop(code).array()
                pattern = ((code >> np.arange(width)) & 1).astype(bool)
                got = self._score_pattern(ctx, ids, positions, pattern)
                if got is None:
                    n_excluded += len(positions)
                    continue
                n_fallback += len(positions) if got[1] else 0
                scores.merge(got[0])
        return scores.metrics(
            binary=self.config.task == "binary", n_fallback=n_fallback, n_excluded=n_excluded
        )

    def _score_pattern(
        self, ctx: ActiveContext, ids: np.ndarray, positions: np.ndarray, pattern: np.ndarray
    ) -> tuple[_Scores, bool] | None:
        """The scores of the rows at `positions` of `ids` (pattern `pattern`) and whether they
        were guessed; None if the method leaves them out. A party lost on the way: the pattern
        again over the survivors, or (its sums delivered already) guessed, as in memory."""
        from securevfl.data.rowarrays import take

        def run(present: Subset, *, guess: bool) -> tuple[_Scores, bool] | None:
            self._pattern_total, self._pattern_rngs = len(positions), {}
            scores, fallback = _Scores(self.n_classes), False
            for part in chunks(positions):  # the chunks `predict_rows` cuts in memory
                rows = take(ids, np.asarray(part, dtype=np.int64))
                if guess:
                    pred = Prediction(
                        {"joint": self.random_classes(len(rows), present)}, fallback=True
                    )
                else:
                    pred = self.predict_rows(ctx, rows, present)
                if pred is None:
                    return None
                fallback = pred.fallback
                scores.add(self.table.label_rows(rows).astype(np.int64), pred.classes)
            return scores, fallback

        try:
            while True:
                self.sync_dead(ctx)
                present = self.present_of(pattern)
                if not present:
                    return run(present, guess=True)
                try:
                    return run(present, guess=False)
                except PartyDropped as exc:
                    self.lose(ctx, exc.party)
                    if exc.delivered:  # summed over the full group already: no re-run
                        return run(present, guess=True)
        finally:
            self._pattern_total = None

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


def _summed(had: np.ndarray | None, counts: np.ndarray) -> np.ndarray:
    """Two square confusion matrices added, the smaller padded to the larger's classes."""
    if had is None:
        return counts
    size = max(had.shape[0], counts.shape[0])
    return np.pad(had, (0, size - had.shape[0])) + np.pad(counts, (0, size - counts.shape[0]))


class _Scores:
    """What `metrics_from` needs, accumulated a chunk at a time: per predictor the confusion
    counts, and the rows' accuracies (each row's share of correct predictors) summed."""

    def __init__(self, n_classes: int) -> None:
        self.n_classes = n_classes
        self.confusion: dict[str, np.ndarray] = {}
        self.accuracy = 0.0
        self.rows = 0

    def add(self, y: np.ndarray, classes: Mapping[str, np.ndarray]) -> None:
        if not classes:
            return
        correct = np.zeros(len(y))
        size = max(self.n_classes, int(y.max(initial=0)) + 1)
        for name, c in classes.items():
            c = np.asarray(c, dtype=np.int64)
            correct += c == y
            counts = np.bincount(y * size + c, minlength=size * size).reshape(size, size)
            self._count(name, counts)
        self.accuracy += float(np.sum(correct / len(classes)))
        self.rows += len(y)

    def _count(self, name: str, counts: np.ndarray) -> None:
        self.confusion[name] = _summed(self.confusion.get(name), counts)

    def merge(self, other: _Scores) -> None:
        for name, counts in other.confusion.items():
            self._count(name, counts)
        self.accuracy += other.accuracy
        self.rows += other.rows

    def metrics(self, *, binary: bool, n_fallback: int, n_excluded: int) -> dict[str, Any]:
        f1s = {name: _f1(m, binary=binary) for name, m in self.confusion.items()}
        out: dict[str, Any] = {
            "accuracy": self.accuracy / self.rows if self.rows else 0.0,
            "f1" if binary else "macro_f1": float(np.mean(list(f1s.values()))) if f1s else 0.0,
            "n_eval": int(self.rows),
            "n_fallback": int(n_fallback),
            "n_excluded": int(n_excluded),
        }
        if len(f1s) > 1:
            out["f1_per_predictor"] = f1s
        return out


def _f1(confusion: np.ndarray, *, binary: bool) -> float:
    """scikit-learn's `f1_score` (zero_division 0; binary: of class 1, else macro over the
    classes seen) from confusion counts [true, predicted]: 2 tp / (true + predicted)."""
    tp = np.diag(confusion).astype(np.float64)
    true, pred = confusion.sum(axis=1), confusion.sum(axis=0)
    denom = (true + pred).astype(np.float64)
    f = np.divide(2 * tp, denom, out=np.zeros_like(tp), where=denom > 0)
    if binary:
        return float(f[1]) if len(f) > 1 else 0.0
    seen = denom > 0
    return float(np.mean(f[seen])) if seen.any() else 0.0


class OutputScores:
    """`securevfl.metrics.task_metrics` of raw outputs (a logit, logits [n, C], a prediction),
    accumulated a chunk of rows at a time (`add`), so that a held-out evaluation or a scoring
    run never reads every label at once: binary keeps the confusion counts and, for ROC-AUC,
    each row's score (the one per-row hold that an exact ROC-AUC needs: the output's own dtype,
    4 bytes a row for float32), split by class; multiclass keeps the confusion counts;
    regression the squared errors' sum and the labels' count, mean and sum of squared
    deviations (merged chunk by chunk). `metrics()` equals `task_metrics` over every row at
    once to float rounding (ROC-AUC as the Mann-Whitney statistic, ties counted one half)."""

    def __init__(self, task: str) -> None:
        if task not in ("binary", "multiclass", "regression"):
            raise ValueError(f"unknown task {task!r}")
        self.task = task
        self.rows = 0
        self.confusion = np.zeros((0, 0), dtype=np.int64)
        self._scores: dict[int, list[np.ndarray]] = {0: [], 1: []}
        self._sse = 0.0
        self._mean = 0.0
        self._m2 = 0.0

    def add(self, y: np.ndarray, output: np.ndarray) -> None:
        """The labels `y` (float, NaN refused) and raw outputs of one chunk of rows."""
        y = np.asarray(y, dtype=np.float64).reshape(-1)
        output = np.asarray(output)
        if len(output) != len(y):
            raise ValueError(f"{len(output)} outputs for {len(y)} labels")
        if np.isnan(y).any():
            raise ValueError("Input y_true contains NaN: every scored row needs a label")
        if not len(y):
            return
        if self.task == "regression":
            self._add_regression(y, output.reshape(len(y), -1)[:, 0].astype(np.float64))
        else:
            if self.task == "binary":
                score = output.reshape(-1)
                pred = (score > 0).astype(np.int64)
                if not np.isin(y, (0.0, 1.0)).all():
                    raise ValueError("binary labels must be 0 or 1")
                for c in (0, 1):
                    kept = score[y == c]
                    if len(kept):
                        self._scores[c].append(np.array(kept))
            else:
                pred = output.argmax(axis=1).astype(np.int64)
            self._count(y.astype(np.int64), pred)
        self.rows += len(y)

    def _count(self, y: np.ndarray, pred: np.ndarray) -> None:
        size = max(int(y.max()) + 1, int(pred.max()) + 1, 2)
        counts = np.bincount(y * size + pred, minlength=size * size).reshape(size, size)
        self.confusion = _summed(self.confusion, counts)

    def _add_regression(self, y: np.ndarray, pred: np.ndarray) -> None:
        self._sse += float(np.sum((y - pred) ** 2))
        n, mean = len(y), float(np.mean(y))
        m2 = float(np.sum((y - mean) ** 2))
        total = self.rows + n  # Chan et al.'s merge of (count, mean, M2)
        delta = mean - self._mean
        self._m2 += m2 + delta * delta * self.rows * n / total
        self._mean += delta * n / total

    def metrics(self) -> dict[str, float]:
        """`task_metrics` of every row added ({} when none was)."""
        if not self.rows:
            return {}
        if self.task == "regression":
            r2 = float("nan")
            if self.rows > 1:  # scikit-learn's r2_score (force_finite)
                if self._m2 > 0:
                    r2 = 1.0 - self._sse / self._m2
                else:
                    r2 = 1.0 if self._sse == 0 else 0.0
            return {"rmse": float(np.sqrt(self._sse / self.rows)), "r2": r2}
        accuracy = float(np.trace(self.confusion) / self.rows)
        if self.task == "multiclass":
            return {"accuracy": accuracy, "macro_f1": _f1(self.confusion, binary=False)}
        out = {"accuracy": accuracy, "f1": _f1(self.confusion, binary=True)}
        if all(self._scores.values()):  # both classes among the labels
            out["roc_auc"] = self._roc_auc()
        return out

    def _roc_auc(self) -> float:
        """P(score of a positive > score of a negative) + P(equal) / 2: each class's scores
        sorted, the negatives below (and equal to) each positive counted a chunk at a time."""
        neg = np.concatenate(self._scores[0])
        self._scores[0] = [neg]
        neg.sort()
        below = ties = 0
        for part in self._scores[1]:
            lo = np.searchsorted(neg, part, side="left")
            hi = np.searchsorted(neg, part, side="right")
            below += int(lo.sum())
            ties += int((hi - lo).sum())
        n_pos = sum(len(p) for p in self._scores[1])
        return (below + 0.5 * ties) / (n_pos * len(neg))
