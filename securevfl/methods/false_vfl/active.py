"""FALSE-VFL's active party: the global encoder q(z | h), the global decoder p(h | z), the
discriminator p(y | h) and the schedule.

Stage 1 (epochs ``0 .. stage1_epochs - 1``) maximises the importance-weighted bound of
log p(x^obs) on every training row; a step is one mixed batch (`batching = "mixed"`: one encode
and one decode over every party, which add zeros on rows they lack; `mixed_batches`) or several
pattern-homogeneous batches (`"pattern"`: each summed over the parties holding its rows), and
one backward. Stage 2 freezes everything but the
discriminator and maximises the conditional bound on the labeled rows only: since the parties'
models no longer change, the importance samples (h, log w) of every epoch are drawn up front, in
one encode and one decode per batch for up to `BANK_FLOATS` of them (the same distribution as
drawing them each epoch, without summing the same rows again every epoch), and the epochs then
run at the active party alone. Prediction is self-normalised importance sampling with
``n_predict`` samples.

Small groups. In secure modes a row whose present passive parties are fewer than ``min_group``
cannot be summed: it is skipped in training (counted per epoch as ``skipped_rows``) and predicted
at test time from the model's p(y) without any party's data (counted as ``n_fallback``). Plain
aggregation sums any group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from securevfl.lazy import torch
from securevfl.methods.base import ActiveContext, ActiveMethod, SumSpec
from securevfl.methods.blocks.batches import chunks, pattern_codes, table_pattern_batches
from securevfl.methods.blocks.nets import derived_seed, float_tensors, table_class_count
from securevfl.metrics import task_metrics

Group = tuple[str, ...]
Batch = tuple[np.ndarray, np.ndarray, Group]  # row ids, presence [n, K] (party_names), group
EVAL_ROWS = 512  # rows per sampling call: h is [rows, samples, d_h]
PRIOR_SAMPLES = 1000
BANK_FLOATS = 2**24  # stage 2 draws at most this many h values at a time (64 MiB)


class FalseVFLActiveMethod(ActiveMethod):
    """The active party of FALSE-VFL (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from securevfl.methods.false_vfl.model import FalseVFLActive, config_from_options

        cfg, opts = self.config, self.config.options
        self.n_classes = table_class_count(cfg.task, self.table)
        self.model_cfg = config_from_options(opts)
        self.model = FalseVFLActive(
            self.n_classes, self.model_cfg, seed=derived_seed(cfg.seed, "false-vfl")
        ).to(self.device)
        wd = opts.weight_decay
        self.gen_opt = torch.optim.Adam(
            self.model.generative_parameters(), lr=opts.stage1_lr, weight_decay=wd
        )
        self.phi_opt = torch.optim.Adam(
            self.model.discriminator.parameters(), lr=opts.stage2_lr, weight_decay=wd
        )
        self.first = "prec_mu" if self.model_cfg.aggregation == "poe" else "mu"
        self.mixed = opts.batching == "mixed"
        self.totals = {"skipped_rows": 0, "n_fallback": 0}
        # stage 2's importance samples: (first epoch, epochs, row ids, h, log w)
        self._bank: tuple[int, int, np.ndarray, Any, Any] | None = None

    @property
    def progress_total(self) -> int:
        opts = self.config.options
        return opts.stage1_epochs + opts.stage2_epochs

    # --- batches and sums

    def _groups(self, ctx: ActiveContext, ids: np.ndarray) -> tuple[np.ndarray, list[str]]:
        names = list(self.config.party_names)
        return np.asarray(ctx.presence(ids), dtype=bool), names

    def _allowed(self, ctx: ActiveContext, group: Group) -> bool:
        """Whether rows whose present parties are `group` may be summed: their posterior sum
        and (mnar, or mixed batches) the decode sum over every party."""
        everyone = tuple(ctx.parties)
        decode = everyone if self.model_cfg.mnar or self.mixed else group
        return bool(group) and ctx.sum_allowed(group) and ctx.sum_allowed(decode)

    def _rows_allowed(self, ctx: ActiveContext, pres: np.ndarray, names: list[str]) -> np.ndarray:
        """bool [n]: the rows (presence `pres`) whose present parties may be summed."""
        codes = pattern_codes(pres)
        ok = np.zeros(len(pres), dtype=bool)
        for code in np.unique(codes):
            rows = codes == code
            first = pres[np.argmax(rows)]
            ok[rows] = self._allowed(
                ctx, tuple(n for n, on in zip(names, first, strict=True) if on)
            )
        return ok

    def _steps(
        self, ctx: ActiveContext, ids: np.ndarray, batch_size: int, epoch: int
    ) -> tuple[Iterable[list[Batch]], Callable[[], int]]:
        """The epoch's steps, each a list of batches (ids, presence [n, K], group) of about
        `batch_size` rows in all, and (once they are run through) the number of rows left out
        because their present parties may not be summed. Reproducible from (seed, epoch). Mixed:
        one batch per step, a shuffled slice of the allowed rows (`mixed_batches`), summed over
        every party; pattern: pattern-homogeneous batches, each over the parties holding its
        rows. A table in memory makes the list up front; one streamed from disk gives the same
        steps one at a time from orders kept in files of its row cache."""
        if getattr(self.table, "streamed", False):
            tally = {"skipped": 0}
            if self.mixed:
                steps = self._streamed_mixed_steps(ctx, ids, batch_size, epoch, tally)
            else:
                steps = self._pattern_steps(ctx, ids, batch_size, epoch, tally)
            return steps, lambda: tally["skipped"]
        pres, names = self._groups(ctx, ids)
        if self.mixed:
            ok = self._rows_allowed(ctx, pres, names)
            steps = [
                [(ids[ok][part], pres[ok][part], tuple(names))]
                for part in mixed_batches(int(ok.sum()), batch_size, self.config.seed, epoch)
            ]
            skipped = int((~ok).sum())
            return steps, lambda: skipped
        tally = {"skipped": 0}
        made = list(self._pattern_steps(ctx, ids, batch_size, epoch, tally, pres=pres))
        return made, lambda: tally["skipped"]

    def _pattern_steps(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        batch_size: int,
        epoch: int,
        tally: dict[str, int],
        *,
        pres: np.ndarray | None = None,
    ) -> Iterator[list[Batch]]:
        """Pattern-homogeneous batches grouped into steps of about `batch_size` rows (rows
        whose group may not be summed counted in `tally`)."""
        names = list(self.config.party_names)
        step: list[Batch] = []
        size = 0
        for rows, pattern in table_pattern_batches(
            self.table,
            ids,
            (lambda b: self._groups(ctx, b)[0]) if pres is None else (lambda b: pres),
            batch_size=batch_size,
            seed=self.config.seed,
            epoch=epoch,
        ):
            group = tuple(n for n, on in zip(names, pattern, strict=True) if on)
            if not self._allowed(ctx, group):
                tally["skipped"] += len(rows)
                continue
            if size and size + len(rows) > batch_size:
                yield step
                step, size = [], 0
            step.append((rows, np.tile(np.asarray(pattern, bool), (len(rows), 1)), group))
            size += len(rows)
        if step:
            yield step

    def _streamed_mixed_steps(
        self, ctx: ActiveContext, ids: np.ndarray, batch_size: int, epoch: int, tally: dict
    ) -> Iterator[list[Batch]]:
        """`mixed_batches` of a table streamed from disk: the allowed rows and their shuffle in
        files of its row cache, each batch's rows read from there."""
        from securevfl.data.rowarrays import filter_ids, permutation, take

        names = list(self.config.party_names)
        arrays = self.table.rowstore.arrays()
        allowed = filter_ids(
            arrays,
            ids,
            lambda b: self._rows_allowed(ctx, self._groups(ctx, b)[0], names),
            "false-vfl.allowed",
        )
        n = len(allowed)
        tally["skipped"] = len(ids) - n
        if n == 0:
            return
        rng = np.random.default_rng([self.config.seed, epoch, 0x3F15])
        perm = permutation(rng, n, arrays)
        parts = -(-n // batch_size)
        size, extra = divmod(n, parts)  # np.array_split's sizes: the first `extra` one longer
        start = 0
        for k in range(parts):
            end = start + size + (k < extra)
            rows = take(allowed, take(perm, np.arange(start, end)))
            yield [(rows, self._groups(ctx, rows)[0], tuple(names))]
            start = end

    def _call_inputs(self, pres: np.ndarray) -> dict[str, np.ndarray]:
        """Mixed calls carry the rows' presence (every party checks its own column)."""
        return {"present": pres.astype(np.uint8)} if self.mixed else {}

    def _posterior(
        self, ctx: ActiveContext, batch: Batch, *, train: bool, epoch: int
    ) -> dict[str, Any]:
        """The round-1 sums of a batch (over its group: every party when mixed, where absent
        parties add zeros) and the count of present parties, which the active party knows."""
        from securevfl.methods.false_vfl.model import SUM_COUNT

        ids, pres, group = batch
        got = ctx.call(
            "encode",
            ids=ids,
            args={"train": train, "epoch": epoch},
            inputs=self._call_inputs(pres),
            sums=[SumSpec(k, k, group) for k in (self.first, "prec")],
        )
        sums = float_tensors(got, self.device)
        sums[SUM_COUNT] = torch.as_tensor(pres.sum(1), dtype=torch.float32, device=self.device)
        return sums

    def _loglik(
        self, ctx: ActiveContext, batch: Batch, h: Any, *, train: bool, epoch: int
    ) -> tuple[dict[str, Any], Group]:
        """The round-2 sums at samples h: over the batch's group (mar, pattern) or every party
        (mnar, or mixed: absent parties add zeros, mnar their mask terms)."""
        ids, pres, group = batch
        over = tuple(ctx.parties) if self.model_cfg.mnar or self.mixed else group
        tensors = ("loglik", "dloglik_dh") if train else ("loglik",)
        args: dict[str, Any] = {"train": train, "epoch": epoch}
        if not self.mixed:
            args["observed"] = list(group)
        got = ctx.call(
            "decode",
            ids=ids,
            args=args,
            inputs={"h": h.cpu().numpy(), **self._call_inputs(pres)},
            sums=[SumSpec(t, t, over) for t in tensors],
        )
        return float_tensors(got, self.device), over

    def _log_weights(self, ctx: ActiveContext, batch: Batch, n_samples: int):
        """(log w [n, S], h [n, S, d_h]) of the current (frozen) model, without gradients."""
        sums = self._posterior(ctx, batch, train=False, epoch=0)
        h = self.model.begin(sums, n_samples)
        ll, _ = self._loglik(ctx, batch, h, train=False, epoch=0)
        return self.model.finish_log_weights(ll["loglik"])

    def _samples(self, ctx: ActiveContext, ids: np.ndarray, n_samples: int) -> Iterator[tuple]:
        """(positions in `ids`, log w, h) per chunk of rows (mixed: up to `EVAL_ROWS` allowed rows
        in order; pattern: of one presence pattern), or (positions, None, None) for rows whose
        present parties may not be summed."""
        pres, names = self._groups(ctx, ids)
        if self.mixed:
            ok = self._rows_allowed(ctx, pres, names)
            if not ok.all():
                yield np.flatnonzero(~ok), None, None
            for part in chunks(np.flatnonzero(ok), EVAL_ROWS):
                batch = (ids[part], pres[part], tuple(names))
                yield (part, *self._log_weights(ctx, batch, n_samples))
            return
        codes = pattern_codes(pres)
        for code in np.unique(codes):
            rows = np.flatnonzero(codes == code)
            group = tuple(n for n, on in zip(names, pres[rows[0]], strict=True) if on)
            if not self._allowed(ctx, group):
                yield rows, None, None
                continue
            for part in chunks(rows, EVAL_ROWS):
                yield (part, *self._log_weights(ctx, (ids[part], pres[part], group), n_samples))

    # --- training

    def fit(self, ctx: ActiveContext, *, train_ids: np.ndarray) -> None:
        opts = self.config.options
        if getattr(self.table, "streamed", False):
            from securevfl.data.rowarrays import filter_ids

            labeled = filter_ids(
                self.table.rowstore.arrays(), train_ids, self.table.labeled, "false-vfl.labeled"
            )
            if opts.stage2_epochs:
                ctx.log(
                    f"false-vfl: stage 2 holds the importance samples of its {len(labeled)} "
                    "labeled training rows in memory (its sample bank: h and log w of every "
                    "row, drawn once for all its epochs), and evaluation the class "
                    "probabilities of every test row; stage 1 streams a batch at a time"
                )
        else:
            labeled = train_ids[self.table.labeled(train_ids)]
        for epoch in range(ctx.start_epoch, opts.stage1_epochs + opts.stage2_epochs):
            if epoch < opts.stage1_epochs:
                stats = self._stage1_epoch(ctx, train_ids, epoch)
            else:
                stats = self._stage2_epoch(ctx, labeled, epoch)
            if stats["skipped_rows"]:
                ctx.log(
                    f"false-vfl epoch {epoch + 1}: skipped {stats['skipped_rows']} rows whose "
                    f"present passive parties are fewer than min_group = {self.config.min_group}"
                )
            self.totals["skipped_rows"] += int(stats["skipped_rows"])
            ctx.epoch_done(epoch, stats=stats)

    def _stage1_epoch(self, ctx: ActiveContext, ids: np.ndarray, epoch: int) -> dict[str, float]:
        batch = self.config.options.stage1_batch
        steps, skipped = self._steps(ctx, ids, batch, epoch)
        loss_sum, rows, n_steps, n_batches = 0.0, 0, 0, 0
        for step in steps:
            n = sum(len(b[0]) for b in step)
            loss_sum += self._stage1_step(ctx, step, epoch) * n
            rows += n
            n_steps += 1
            n_batches += len(step)
        return {
            "stage": 1.0,
            "loss": loss_sum / max(rows, 1),
            "rows": float(rows),
            "steps": float(n_steps),
            "batches": float(n_batches),
            "skipped_rows": float(skipped()),
        }

    def _stage1_step(self, ctx: ActiveContext, step: list[Batch], epoch: int) -> float:
        """One step of -L_kappa (the marginal bound) on the rows of `step`'s batches: every
        model but the discriminator. Returns the step's mean loss."""
        ids = np.concatenate([b[0] for b in step])
        n, kappa = len(ids), self.model_cfg.kappa
        names = list(self.config.party_names)
        self.gen_opt.zero_grad(set_to_none=True)
        self.model.train()
        # d loss / d each sum, per party, on the step's rows: 0 on rows whose sum it did not
        # contribute data to (mnar: its mask terms count, on every row)
        message: dict[str, dict[str, np.ndarray]] = {}
        loss_sum, start = 0.0, 0
        for batch in step:
            b_ids, pres, group = batch
            rows = np.arange(start, start + len(b_ids))
            start += len(b_ids)
            sums = self._posterior(ctx, batch, train=True, epoch=epoch)
            h = self.model.begin(sums, kappa, train=True)
            ll, over = self._loglik(ctx, batch, h, train=True, epoch=epoch)
            loss, grads = self.model.finish_stage1(
                ll["loglik"], ll["dloglik_dh"], weight=len(b_ids) / n
            )
            loss_sum += float(loss) * len(b_ids)
            for party in over:
                held = pres[:, names.index(party)]
                keys = {"loglik": np.ones_like(held) if self.model_cfg.mnar else held}
                if party in group:
                    keys.update({self.first: held, "prec": held})
                mine = message.setdefault(party, {})
                for key, where in keys.items():
                    g = grads[key].cpu().numpy()
                    full = mine.setdefault(f"d_{key}", np.zeros((n, *g.shape[1:]), np.float32))
                    full[rows[where]] = g[where]
        # parties with the same message get one call; label-free (stage 1 never reads y), but
        # sent through the context like every gradient the active party returns
        by_content: dict[tuple, list[str]] = {}
        for party, tensors in message.items():
            key = tuple((k, v.tobytes()) for k, v in sorted(tensors.items()))
            by_content.setdefault(key, []).append(party)
        ctx.return_gradients(
            {tuple(ps): message[ps[0]] for ps in by_content.values()}, ids=ids, epoch=epoch
        )
        self.gen_opt.step()
        return loss_sum / n

    def _draw_bank(self, ctx: ActiveContext, ids: np.ndarray, epoch: int) -> int:
        """Draw the importance samples of stage-2 epochs `epoch`.. for rows `ids` (as many epochs
        as `BANK_FLOATS` allows); returns the number of batches summed."""
        opts, kappa = self.config.options, self.model_cfg.kappa
        left = opts.stage1_epochs + opts.stage2_epochs - epoch
        per_epoch = max(1, len(ids) * kappa * self.model_cfg.d_h)
        epochs = max(1, min(left, BANK_FLOATS // per_epoch))
        keep, parts, calls = [], [], 0
        for rows, log_w, h in self._samples(ctx, ids, epochs * kappa):
            if log_w is not None:
                keep.append(rows)
                parts.append((log_w, h))
                calls += 1
        order = np.concatenate(keep) if keep else np.empty(0, dtype=np.int64)
        empty = {"device": self.device}
        log_w = (
            torch.cat([w for w, _ in parts]) if parts else torch.zeros(0, epochs * kappa, **empty)
        )
        h = (
            torch.cat([v for _, v in parts])
            if parts
            else torch.zeros(0, epochs * kappa, 1, **empty)
        )
        self._bank = (epoch, epochs, ids[order], h, log_w)
        return calls

    def _stage2_epoch(self, ctx: ActiveContext, ids: np.ndarray, epoch: int) -> dict[str, float]:
        """One epoch of -L'_kappa (the conditional bound) on the labeled rows `ids`: the
        discriminator only, from this epoch's slice of the sample bank; parties receive h (when
        the bank is drawn) and nothing else."""
        opts, kappa = self.config.options, self.model_cfg.kappa
        calls = 0
        bank = self._bank
        if bank is None or not bank[0] <= epoch < bank[0] + bank[1]:
            calls = self._draw_bank(ctx, ids, epoch)
            bank = self._bank
        first, _, rows, h_all, lw_all = bank
        cut = slice((epoch - first) * kappa, (epoch - first + 1) * kappa)
        y_all = torch.as_tensor(self.table.label_rows(rows), device=self.device).long()
        rng = np.random.default_rng([self.config.seed, epoch, 0x57A2])
        perm = rng.permutation(len(rows))
        self.model.train()
        loss_sum, steps = 0.0, 0
        for start in range(0, len(perm), opts.stage2_batch):
            b = torch.as_tensor(perm[start : start + opts.stage2_batch], device=self.device)
            self.phi_opt.zero_grad(set_to_none=True)
            loss = -self.model.conditional_bound(lw_all[b, cut], h_all[b, cut], y_all[b]).mean()
            loss.backward()
            self.phi_opt.step()
            loss_sum += float(loss.detach()) * len(b)
            steps += 1
        return {
            "stage": 2.0,
            "loss": loss_sum / max(len(rows), 1),
            "rows": float(len(rows)),
            "steps": float(steps),
            "batches": float(calls),
            "skipped_rows": float(len(ids) - len(rows)),
        }

    # --- prediction

    def predict_proba(self, ctx: ActiveContext, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(p(y | x^obs) [n, C], fallback [n] bool): rows whose group may not be summed get the
        model's p(y) from no party's data."""
        proba = np.zeros((len(ids), self.n_classes))
        fallback = np.zeros(len(ids), dtype=bool)
        self.model.eval()
        with torch.no_grad():
            for rows, log_w, h in self._samples(ctx, ids, self.model_cfg.n_predict):
                if log_w is None:
                    proba[rows] = self.model.prior_predictive(PRIOR_SAMPLES).cpu().numpy()
                    fallback[rows] = True
                else:
                    proba[rows] = self.model.predict_proba(log_w, h).cpu().numpy()
        return proba, fallback

    def evaluate(self, ctx: ActiveContext, *, ids: np.ndarray) -> dict[str, Any]:
        proba, fallback = self.predict_proba(ctx, ids)
        log_p = np.log(np.clip(proba, 1e-12, 1.0))
        task = self.config.task
        output = log_p[:, 1] - log_p[:, 0] if task == "binary" else log_p
        metrics: dict[str, Any] = task_metrics(
            task, y_true=self.table.label_rows(ids), output=output
        )
        self.totals["n_fallback"] = int(fallback.sum())
        metrics.update(n_eval=len(ids), n_fallback=int(fallback.sum()))
        return metrics

    # --- state

    def summary(self) -> dict[str, Any]:
        opts = self.config.options
        return {
            "false_vfl": {
                "variant": opts.variant,
                "aggregation": opts.aggregation,
                "skipped_train_rows_total": self.totals["skipped_rows"],
                "n_fallback": self.totals["n_fallback"],
            }
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "gen_opt": self.gen_opt.state_dict(),
            "phi_opt": self.phi_opt.state_dict(),
            "generator": self.model.generator.get_state(),
            "totals": dict(self.totals),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.gen_opt.load_state_dict(state["gen_opt"])
        self.phi_opt.load_state_dict(state["phi_opt"])
        self.model.generator.set_state(state["generator"])
        self.totals = {k: int(v) for k, v in state["totals"].items()}


def mixed_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    """Stage 1's mixed batches of an epoch: positions 0..n-1 shuffled by (seed, epoch) and cut
    into ceil(n / batch_size) near-equal parts (as `FalseVFLReference.fit` cuts its epochs)."""
    if n == 0:
        return []
    perm = np.random.default_rng([seed, epoch, 0x3F15]).permutation(n)
    return [p for p in np.array_split(perm, -(-n // batch_size)) if len(p)]
