"""The active party of the encoder + head methods over missing blocks: heads (and the active
party's own block models), pattern-homogeneous training, sums per subset of parties, gradients
back through the context, lost parties treated as missing blocks.

A method on this toolkit says which batches it trains on (`trainable`), what one step does
(`train_step`, usually `forward_sums` + a loss + `update`) and how a pattern's rows are
predicted (`predict_rows`); `BlockEvaluation` turns predictions into the metrics.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from securevfl.lazy import nn, torch
from securevfl.methods.base import ActiveContext, ActiveMethod, PartyDropped
from securevfl.methods.blocks.batches import block_names, row_chunks, table_pattern_batches
from securevfl.methods.blocks.evaluation import BlockEvaluation
from securevfl.methods.blocks.nets import (
    Standardizer,
    derived_seed,
    mlp,
    output_dim,
    run_backward,
    scaled_rows,
    table_class_count,
    task_loss,
)
from securevfl.methods.blocks.options import block_optimizer, fit_scaler, lr_at
from securevfl.methods.blocks.sums import SumPlan

Subset = tuple[str, ...]


class BlockActive(BlockEvaluation, ActiveMethod):
    """Training over pattern-homogeneous batches for methods whose parties hold `BlockParty`
    models (one head per block by default)."""

    method_name: ClassVar[str] = "laser"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        cfg = self.config
        self.blocks = block_names(cfg)
        self.own_name = cfg.active_name if cfg.active_columns else None
        self.n_classes = table_class_count(cfg.task, self.table)
        # `two_logit_head`: Linear(d, 2) under softmax cross-entropy, as the paper's code (the
        # same function class as one logit under BCE; Adam moves the two at different speeds)
        two = cfg.task == "binary" and bool(cfg.options.two_logit_head)
        self.loss_task = "multiclass" if two else cfg.task
        self.out_dim = output_dim(self.loss_task, self.n_classes)
        self.dead: list[str] = []
        self.own = None
        self.own_scaler = Standardizer()
        if self.own_name is not None:
            self.own = nn.ModuleDict({m: self._own_model(m) for m in self.own_model_names()}).to(
                self.device
            )
        self.build_heads()
        params = list(self.heads.parameters())
        if self.own is not None:
            params += list(self.own.parameters())
        self.optimizer = block_optimizer(params, cfg)
        self.extra_tests: dict[str, dict[str, Any]] = {}
        self.skipped_tasks_total = 0
        # rows whose forward reached the parties in a round that lost one: the aggregator may
        # hold their sums over the full group, so they are not summed again until every
        # survivor named here has updated its model (a new version: no differencing)
        self.quarantine: dict[int, set[str]] = {}

    # --- what subclasses provide

    def build_heads(self) -> None:
        cfg = self.config
        self.heads = nn.ModuleDict(
            {
                k: mlp(
                    cfg.width,
                    cfg.head_hidden,
                    self.out_dim,
                    seed=derived_seed(cfg.seed, self.method_name, "head", k),
                )
                for k in self.blocks
            }
        ).to(self.device)

    def own_model_names(self) -> list[str]:
        return ["rep"]

    def input_width(self) -> int:
        """What `build_own_model`'s model reads: the active party's columns, with each
        categorical code column ([categorical] embedding) replaced by its embedding."""
        from securevfl.methods.blocks.embedding import input_width

        return input_width(self.table, self.config)

    def _own_model(self, model: str) -> Any:
        """`build_own_model`'s model behind the embeddings of the own code columns (if any)."""
        from securevfl.methods.blocks.embedding import with_embeddings

        cfg = self.config
        seed = derived_seed(cfg.seed, self.method_name, model, cfg.active_name)
        return with_embeddings(self.table, cfg, self.build_own_model(model), seed=seed)

    def build_own_model(self, model: str) -> Any:
        cfg = self.config
        return mlp(
            self.input_width(),
            cfg.hidden,
            cfg.width,
            seed=derived_seed(cfg.seed, self.method_name, model, cfg.active_name),
        )

    def tensor_of(self, subset: Subset) -> str:
        """The party model whose outputs are summed over `subset`."""
        return "rep"

    def trainable(self, present: Subset) -> bool:
        return True

    def batch_keys(self, ids: np.ndarray, present: np.ndarray) -> np.ndarray | None:
        """Rows with different keys never share a batch (besides differing patterns)."""
        return None

    def train_step(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        present: Subset,
        *,
        epoch: int,
        rng: np.random.Generator,
    ) -> tuple[float | None, int]:
        """One update on a batch whose rows all have blocks `present`; returns (loss or None if
        nothing was trained, number of loss terms skipped because their sum was refused). May
        raise `PartyDropped` before anything is updated."""
        raise NotImplementedError

    # --- sums and gradients

    def sum_allowed(self, subset: Iterable[str]) -> bool:
        """Whether the sum over `subset` may be asked for (the active party's own block needs
        no sum; the passive members must form an allowed group)."""
        passive = tuple(b for b in subset if b != self.own_name)
        return not passive or self.group_allowed(passive)

    def group_allowed(self, group: Subset) -> bool:
        from securevfl.secure_sum import group_allowed

        return group_allowed(self.config, group)

    def _own_inputs(self, ids: np.ndarray) -> Any:
        # a streamed table is scaled a batch at a time, never whole
        return torch.from_numpy(scaled_rows(self, ids, scaler=self.own_scaler)).to(self.device)

    def forward_sums(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        subsets: Sequence[Subset],
        *,
        train: bool,
        epoch: int = 0,
    ) -> tuple[dict[Subset, Any], dict[Subset, Any]]:
        """The representation sum of each subset: its passive members' through one call (one
        secure sum per distinct group and model), plus the active party's own block. Returns
        (sums, leaves): the leaves are the decoded secure sums (by passive group), whose
        gradients go back to the parties."""
        plan = SumPlan()
        wanted = {}
        for sub in subsets:
            passive = tuple(b for b in sub if b != self.own_name)
            if passive:
                wanted[sub] = (passive, self.tensor_of(sub))
                plan.add(passive, self.tensor_of(sub))
        got = plan.call(ctx, "forward", ids=ids, args={"train": train, "epoch": epoch})
        leaves = {
            where: torch.tensor(
                np.asarray(value, dtype=np.float32), device=self.device, requires_grad=train
            )
            for where, value in got.items()
        }
        own_x = None
        own_out: dict[str, Any] = {}
        sums: dict[Subset, Any] = {}
        for sub in subsets:
            total = leaves[wanted[sub]] if sub in wanted else None
            if self.own_name in sub:
                tensor = self.tensor_of(sub)
                if tensor not in own_out:
                    if own_x is None:
                        own_x = self._own_inputs(ids)
                    own_out[tensor] = self.own[tensor](own_x)
                total = own_out[tensor] if total is None else total + own_out[tensor]
            sums[sub] = total
        return sums, leaves

    def update(
        self, ctx: ActiveContext, ids: np.ndarray, leaves: Mapping, loss: Any, *, epoch: int
    ) -> None:
        """Backpropagate `loss`, return each party dL/d(its outputs) through the context (label
        DP, ledger), then step the active party's optimizer."""
        self.optimizer.zero_grad(set_to_none=True)
        run_backward(loss)
        updated = self.return_gradients(ctx, ids, leaves, epoch=epoch)
        self.optimizer.step()
        if self.quarantine:
            for row in list(self.quarantine):
                self.quarantine[row] -= updated
                if not self.quarantine[row]:
                    del self.quarantine[row]

    def return_gradients(
        self, ctx: ActiveContext, ids: np.ndarray, leaves: Mapping, *, epoch: int
    ) -> set[str]:
        """Party k's gradient is the sum, over the groups it contributed to, of dL/dS_group;
        parties with the same groups get the same gradients, in one call."""
        per_party: dict[str, dict[str, Any]] = {}
        sources: dict[str, list[Any]] = {}
        for (group, tensor), leaf in leaves.items():
            if leaf.grad is None:
                continue
            for p in group:
                grads = per_party.setdefault(p, {})
                grads[tensor] = leaf.grad if tensor not in grads else grads[tensor] + leaf.grad
                sources.setdefault(p, []).append((group, tensor))
        by_sources: dict[tuple, list[str]] = {}
        for p in per_party:
            by_sources.setdefault(tuple(sources[p]), []).append(p)
        grads = {
            tuple(members): {t: g.cpu().numpy() for t, g in per_party[members[0]].items()}
            for members in by_sources.values()
        }
        ctx.return_gradients(grads, ids=ids, epoch=epoch)
        return {p for p in per_party if p in ctx.parties}  # the parties that updated

    # --- presence and dropouts

    def lose(self, ctx: ActiveContext, party: str) -> None:
        if party not in self.dead:
            self.dead.append(party)
            ctx.log(
                f"{self.method_name}: party {party!r} was lost; its block is treated as "
                "missing from now on (training and test)"
            )

    def sync_dead(self, ctx: ActiveContext) -> None:
        for p in self.config.party_names:
            if p not in ctx.parties:
                self.lose(ctx, p)

    def presence_matrix(self, ctx: ActiveContext, ids: np.ndarray) -> np.ndarray:
        """Boolean [len(ids), len(blocks)]; lost parties' blocks count as missing. A table
        streamed from disk is read `batches.EVAL_BATCH` rows at a time."""
        if getattr(self.table, "streamed", False) and len(ids):
            return np.concatenate([self._presence_rows(ctx, c) for c in row_chunks(ids)])
        return self._presence_rows(ctx, ids)

    def _presence_rows(self, ctx: ActiveContext, ids: np.ndarray) -> np.ndarray:
        pres = np.asarray(ctx.presence(ids), dtype=bool).copy()
        for p in self.dead:
            pres[:, self.config.party_names.index(p)] = False
        if self.own_name is not None:
            own = ~np.all(np.isnan(self.table.rows(ids)), axis=1)
            pres = np.concatenate([pres, own[:, None]], axis=1)
        return pres

    def present_of(self, pattern: np.ndarray) -> Subset:
        return tuple(
            b for b, on in zip(self.blocks, pattern, strict=True) if on and b not in self.dead
        )

    # --- training loop

    def fit(self, ctx: ActiveContext, *, train_ids: np.ndarray) -> None:
        cfg = self.config
        self.sync_dead(ctx)
        if ctx.start_epoch == 0 and self.own_name is not None:
            if getattr(self.table, "streamed", False):  # rows with no own cell add nothing
                self.own_scaler = fit_scaler(self.table.column_summary(train_ids), cfg)
            else:
                own_rows = self.table.rows(train_ids)
                self.own_scaler = fit_scaler(own_rows[~np.all(np.isnan(own_rows), axis=1)], cfg)
            from securevfl.methods.blocks.embedding import keep_codes

            keep_codes(self.own_scaler, self.table)  # categorical codes stay codes
        for epoch in range(ctx.start_epoch, cfg.epochs):
            started = time.perf_counter()
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(cfg, epoch)
            self.heads.train()
            if self.own is not None:
                self.own.train()
            rng = np.random.default_rng([cfg.seed, epoch, 0x7A5C])
            stats = {"loss": 0.0, "rows": 0, "steps": 0, "skipped_tasks": 0, "skipped_batches": 0}
            # a table streamed from disk: one batch at a time, the epoch's order on disk
            batches = table_pattern_batches(
                self.table,
                train_ids,
                lambda ids: self.presence_matrix(ctx, ids),
                batch_size=cfg.batch_size,
                seed=cfg.seed,
                epoch=epoch,
                balanced=bool(cfg.options.balanced),
                keys=self.batch_keys,
            )
            for ids, pattern in batches:
                if self.quarantine:
                    ids = ids[~np.isin(ids, np.fromiter(self.quarantine, dtype=np.int64))]
                    if not len(ids):
                        stats["skipped_batches"] += 1
                        continue
                self.train_batch(ctx, ids, pattern, epoch=epoch, rng=rng, stats=stats)
            self.skipped_tasks_total += stats["skipped_tasks"]
            if stats["skipped_tasks"] or stats["skipped_batches"]:
                ctx.log(
                    f"{self.method_name} epoch {epoch + 1}: skipped {stats['skipped_tasks']} "
                    f"loss terms whose secure sum would have fewer than min_group = "
                    f"{cfg.min_group} contributors, and {stats['skipped_batches']} batches "
                    "with nothing to train"
                )
            elapsed = time.perf_counter() - started
            epoch_stats = {
                "loss": stats["loss"] / max(stats["rows"], 1),
                "rows_per_s": stats["rows"] / max(elapsed, 1e-9),
                "steps": stats["steps"],
                "skipped_tasks": stats["skipped_tasks"],
                "skipped_batches": stats["skipped_batches"],
            }
            for _ in range(len(cfg.party_names) + 1):
                try:
                    ctx.epoch_done(epoch, stats=epoch_stats)
                    break
                except PartyDropped as exc:
                    self.lose(ctx, exc.party)

    def train_batch(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        pattern: np.ndarray,
        *,
        epoch: int,
        rng: np.random.Generator,
        stats: dict[str, Any],
    ) -> None:
        """One batch. If a party drops during its forward and the others had answered, the
        batch is skipped: the aggregator may hold sums of these rows over the full group, and
        a re-run over the survivors would difference to the lost party's values (the parties
        refuse it). If nobody had answered, it is re-run with the survivors."""
        while True:
            self.sync_dead(ctx)
            present = self.present_of(pattern)
            if not present or not self.trainable(present):
                stats["skipped_batches"] += 1
                return
            try:
                loss, skipped = self.train_step(ctx, ids, present, epoch=epoch, rng=rng)
            except PartyDropped as exc:
                self.lose(ctx, exc.party)
                if exc.delivered:
                    survivors = {p for p in present if p in ctx.parties and p != self.own_name}
                    for row in ids.tolist():
                        self.quarantine[row] = set(survivors)
                    stats["skipped_batches"] += 1
                    return
                continue
            stats["skipped_tasks"] += skipped
            if loss is None:
                stats["skipped_batches"] += 1
            else:
                stats["loss"] += loss * len(ids)
                stats["rows"] += len(ids)
                stats["steps"] += 1
            return

    def labels_tensor(self, ids: np.ndarray) -> Any:
        return torch.as_tensor(self.table.label_rows(ids), device=self.device)

    def joint_loss(self, head: str, total: Any, ids: np.ndarray) -> Any:
        """The task loss of head `head` on input `total` for rows `ids` (a batch mean)."""
        return task_loss(self.loss_task, self.heads[head](total), self.labels_tensor(ids))

    # --- state

    def summary(self) -> dict[str, Any]:
        return {"extra_tests": self.extra_tests} if self.extra_tests else {}

    def state_dict(self) -> dict[str, Any]:
        state = {
            "heads": self.heads.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "dead": list(self.dead),
            "skipped_tasks_total": self.skipped_tasks_total,
            "quarantine": {str(r): sorted(ps) for r, ps in self.quarantine.items()},
        }
        if self.own is not None:
            state["own"] = self.own.state_dict()
            state["own_scaler"] = self.own_scaler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.heads.load_state_dict(state["heads"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.dead = list(state.get("dead", []))
        self.skipped_tasks_total = int(state.get("skipped_tasks_total", 0))
        self.quarantine = {int(r): set(ps) for r, ps in state.get("quarantine", {}).items()}
        if self.own is not None:
            self.own.load_state_dict(state["own"])
            self.own_scaler.load_state_dict(state["own_scaler"])


class JointHeadActive(BlockActive):
    """One head over the fusion of the present blocks (`fuse`), for the methods with a single
    joint predictor (Standard VFL, PlugVFL)."""

    def build_heads(self) -> None:
        cfg = self.config
        self.heads = nn.ModuleDict(
            {
                "joint": mlp(
                    cfg.width,
                    cfg.head_hidden,
                    self.out_dim,
                    seed=derived_seed(cfg.seed, self.method_name, "head"),
                )
            }
        ).to(self.device)

    def fuse(self, total: Any, subset: Subset) -> Any:
        """The head's input from the sum over `subset`."""
        raise NotImplementedError

    def joint_step(
        self, ctx: ActiveContext, ids: np.ndarray, subset: Subset, *, epoch: int
    ) -> float:
        """One update of the head and the parties in `subset` on rows `ids`; returns the loss."""
        sums, leaves = self.forward_sums(ctx, ids, [subset], train=True, epoch=epoch)
        loss = self.joint_loss("joint", self.fuse(sums[subset], subset), ids)
        self.update(ctx, ids, leaves, loss, epoch=epoch)
        return float(loss.detach())

    def train_step(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        present: Subset,
        *,
        epoch: int,
        rng: np.random.Generator,
    ) -> tuple[float | None, int]:
        """One joint step over the blocks present, or skipped (counted) when their sum would
        be over fewer than min_group passive parties."""
        if not self.sum_allowed(present):
            return None, 1
        return self.joint_step(ctx, ids, present, epoch=epoch), 0

    def joint_prediction(self, ctx: ActiveContext, ids: np.ndarray, present: Subset) -> Any:
        return self.predict_with(
            ctx, ids, present, lambda s: self.heads["joint"](self.fuse(s, present))
        )
