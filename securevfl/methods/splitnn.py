"""Split-NN baseline: one encoder per party, representations fused by a secure sum, the head and
loss at the active party, which sends back dL/dS (the same for every contributor)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from securevfl.lazy import torch
from securevfl.methods import examples
from securevfl.methods.base import (
    REPRESENTATION_SECURE_DEFAULTS,
    ActiveContext,
    ActiveMethod,
    MethodSpec,
    Operation,
    PartyMethod,
    Release,
    SumSpec,
    UnknownOperation,
)
from securevfl.methods.blocks.batches import count_incomplete, row_chunks
from securevfl.methods.blocks.evaluation import OutputScores
from securevfl.methods.blocks.nets import (
    Standardizer,
    derived_seed,
    make_optimizer,
    mlp,
    output_dim,
    run_backward,
    scaled_rows,
    table_batches,
    table_class_count,
    task_loss,
)

OPERATIONS = (
    Operation(
        "forward",
        "the encoder's output f_k(x_k) on rows `ids` (train: kept for the backward)",
        releases=(Release("rep", why="the representation: only inside the sum over all parties"),),
    ),
    Operation(
        "backward",
        "dL/dS of the training forward of round args.forward; the party steps its encoder",
        inputs=("grad",),
        updates=True,
    ),
)


@dataclass
class PendingForward:
    """A training forward awaiting its backward: its rows, and either its autograd graph
    (pipeline_depth 0: nothing changes the encoder before the backward) or its inputs (the
    encoder will have stepped meanwhile: the backward computes the forward again)."""

    ids: np.ndarray
    out: Any = None
    x: Any = None


class SplitNNParty(PartyMethod):
    """A passive party's encoder f_k."""

    def setup(self, *, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> None:
        from securevfl.methods.blocks.embedding import input_width, keep_codes, with_embeddings
        from securevfl.privacy.runtime import private_training

        train_ids = inputs["train_ids"]
        self.scaler = Standardizer().fit_table(self.table, self.table.held_ids(train_ids))
        keep_codes(self.scaler, self.table)  # categorical codes ([categorical] embedding) as is
        seed = derived_seed(self.init_seed(), "encoder", self.name)
        self.encoder = with_embeddings(
            self.table,
            self.config,
            mlp(
                input_width(self.table, self.config),
                self.config.hidden,
                self.config.width,
                seed=seed,
            ),
            seed=seed,
        ).to(self.device)
        self.optimizer = make_optimizer(self.encoder.parameters(), self.config)
        # DP-SGD ([parties.NAME] dp_sgd) when the role's privacy plan has it; the active party
        # reduces its loss by the mean, so the gradient rows received carry 1/B
        self.training = private_training(
            self, self.encoder, self.optimizer, expected_batch_size=self.config.batch_size
        )
        self.encoder, self.optimizer = self.training.module, self.training.optimizer
        # training forwards awaiting their backward, keyed by the forward's round, oldest
        # first: at most [network] pipeline_depth + 1 (the oldest is dropped beyond that, and a
        # backward for it refused)
        self._pending: dict[int, PendingForward] = {}

    def _inputs(self, ids: np.ndarray) -> Any:
        return torch.from_numpy(scaled_rows(self, ids)).to(self.device)

    def check_call(
        self,
        op: str,
        *,
        ids: np.ndarray,
        args: Mapping[str, Any],
        inputs: Mapping[str, np.ndarray],
        groups: Any,
    ) -> str | None:
        """A backward must name a training forward of this party still awaiting its backward
        (`args.forward`: its round) on the same rows: never one it did not compute, one already
        stepped on (a replay), or other rows."""
        del inputs, groups
        if op != "backward":
            return None
        return self._backward_refusal(ids, args.get("forward"))

    def _backward_refusal(self, ids: np.ndarray, forward: Any) -> str | None:
        pending = getattr(self, "_pending", {})
        if isinstance(forward, bool) or not isinstance(forward, int):
            return (
                f"a backward must name the round of the training forward it belongs to "
                f"(args.forward), not {forward!r}"
            )
        if forward not in pending:
            return (
                f"a backward for the training forward of round {forward}, which this party did "
                f"not compute or has already stepped on (awaiting a backward: rounds "
                f"{sorted(pending)}; it keeps the last [network] pipeline_depth + 1 = "
                f"{self.config.pipeline_depth + 1}: every role must run the same "
                "pipeline_depth); nothing was applied"
            )
        if not np.array_equal(pending[forward].ids, ids):
            return (
                f"a backward for other rows than the training forward of round {forward}; "
                "nothing was applied"
            )
        return None

    def handle(
        self, op: str, *, ids: np.ndarray, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        if op == "forward":
            x = self._inputs(ids)
            if args.get("train", False):
                if not self.encoder.training:  # train() walks every submodule: only on a change
                    self.encoder.train()
                if self.config.pipeline_depth == 0:
                    out = self.training.model(x)
                    self._keep(PendingForward(ids=ids, out=out))
                else:  # pipelined: the encoder steps before the backward comes (recomputed)
                    with torch.no_grad():
                        out = self.training.model(x)
                    self._keep(PendingForward(ids=ids, x=x))
            else:
                self.encoder.eval()
                with torch.no_grad():
                    out = self.encoder(x)
            return {"rep": out.detach().cpu().numpy()}
        if op == "backward":
            reason = self._backward_refusal(ids, args.get("forward"))
            if reason is not None:  # the role refuses it first (check_call); direct callers
                raise RuntimeError(reason)
            pending = self._pending.pop(args["forward"])
            out = pending.out
            if out is None:
                # a stale forward (pipeline_depth > 0): the same rows through the encoder as it
                # is now, so the gradient computed at the stale S steps the current weights
                self.encoder.train()
                out = self.training.model(pending.x)
            grad = torch.tensor(np.asarray(inputs["grad"], dtype=np.float32), device=self.device)
            if grad.shape != out.shape:
                raise ValueError(
                    f"gradient shape {tuple(grad.shape)} != representation {tuple(out.shape)}"
                )
            self.training.zero_grad()
            run_backward(out, grad)
            self.training.step()
            return {}
        raise UnknownOperation("splitnn", op)

    def _keep(self, pending: PendingForward) -> None:
        self._pending[self.call_round] = pending
        while len(self._pending) > self.config.pipeline_depth + 1:
            del self._pending[next(iter(self._pending))]  # the oldest: its backward never came

    def state_dict(self) -> dict[str, Any]:
        return {
            "encoder": self.encoder.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.encoder.load_state_dict(state["encoder"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])


class SplitNNActive(ActiveMethod):
    """The head g (and the active party's own encoder if it holds columns)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        cfg = self.config
        self.n_classes = table_class_count(cfg.task, self.table)
        self.head = mlp(
            cfg.width,
            cfg.head_hidden,
            output_dim(cfg.task, self.n_classes),
            seed=derived_seed(cfg.seed, "head"),
        ).to(self.device)
        self.own = None
        if self.table.columns:
            from securevfl.methods.blocks.embedding import input_width, with_embeddings

            seed = derived_seed(cfg.seed, "encoder", cfg.active_name)
            self.own = with_embeddings(
                self.table,
                cfg,
                mlp(input_width(self.table, cfg), cfg.hidden, cfg.width, seed=seed),
                seed=seed,
            ).to(self.device)
        from securevfl.methods.blocks.modules import Fusion

        self.fusion = Fusion(self.head, self.own)
        self.optimizer = make_optimizer(self.fusion.parameters(), cfg)
        self.scaler = Standardizer()
        self.training = None
        self._step_due = False  # a charged head step not applied yet (`_apply_step`)

    def _apply_step(self) -> None:
        if self._step_due:
            self._step_due = False
            self.training.apply()

    def _sum_spec(self, ctx: ActiveContext) -> list[SumSpec]:
        return [SumSpec(key="S", tensor="rep", group=ctx.parties)]

    def _forward(self, ctx: ActiveContext, ids: np.ndarray, *, train: bool) -> tuple[Any, Any]:
        total = ctx.call("forward", ids=ids, args={"train": train}, sums=self._sum_spec(ctx))["S"]
        return self._head(ids, total, train=train)

    def _training_sums(
        self, ctx: ActiveContext, batches: Iterable[np.ndarray]
    ) -> Iterator[tuple[np.ndarray, np.ndarray, int, tuple[Any, Any]]]:
        """(rows, S, round of their forward, `_local` of the rows) for each training batch in
        order; the active party reads its own rows while the parties compute. With [network]
        pipeline_depth = d > 0 the forwards of the next d batches are in flight while batch t's
        sum is awaited; the backward of batch t (held by `return_gradients`) rides ahead of the
        next forward posted, so a party computes the forward of batch t + k before the updates
        of batches t..t+k-1 reached it (staleness <= d steps, declared: `tolerates_staleness`)."""
        depth = self.config.pipeline_depth
        if depth == 0:  # one at a time: exactly the unpipelined protocol
            for ids in batches:
                ticket = ctx.post(
                    "forward", ids=ids, args={"train": True}, sums=self._sum_spec(ctx)
                )
                self._apply_step()  # the head's last update, while the parties compute
                local = self._local(ids)
                yield ids, ctx.wait(ticket)["S"], ticket.round, local
            return
        window: deque[tuple[np.ndarray, Any]] = deque()
        rows = iter(batches)
        while True:
            while len(window) <= depth and (ids := next(rows, None)) is not None:
                ticket = ctx.post(
                    "forward", ids=ids, args={"train": True}, sums=self._sum_spec(ctx)
                )
                window.append((ids, ticket))
            self._apply_step()
            if not window:
                return
            ids, ticket = window.popleft()
            local = self._local(ids)
            yield ids, ctx.wait(ticket)["S"], ticket.round, local

    def _local(self, ids: np.ndarray) -> tuple[Any, Any]:
        """What the active party reads of its own rows for a training batch: the labels and,
        when it holds columns, its scaled inputs (None otherwise)."""
        y = torch.as_tensor(self.table.label_rows(ids), device=self.device)
        return y, (None if self.own is None else self._own_inputs(ids))

    def _own_inputs(self, ids: np.ndarray) -> Any:
        return torch.from_numpy(scaled_rows(self, ids)).to(self.device)

    def _head(
        self, ids: np.ndarray, total: np.ndarray, *, train: bool, x: Any = None
    ) -> tuple[Any, Any]:
        s = torch.tensor(total, dtype=torch.float32, device=self.device, requires_grad=train)
        model = self.training.model if train and self.training is not None else self.fusion
        if self.own is None:
            return s, model(s)
        return s, model(s, self._own_inputs(ids) if x is None else x)

    def fit(self, ctx: ActiveContext, *, train_ids: np.ndarray) -> None:
        cfg = self.config
        incomplete = count_incomplete(ctx, self.table, train_ids)
        if incomplete:
            from securevfl.errors import DataError

            raise DataError(
                f"splitnn needs every training row at every party, but {incomplete} rows are "
                'missing at some party; use method "standard-vfl" (complete rows only) or '
                '"laser" (any subset of parties)'
            )
        if ctx.start_epoch == 0:
            from securevfl.methods.blocks.embedding import keep_codes

            keep_codes(self.scaler.fit_table(self.table, train_ids), self.table)
        from securevfl.privacy.runtime import private_training

        # DP-SGD on head (+ own encoder) when [active] dp_sgd is set; the loss is a batch mean
        self.training = private_training(
            ctx, self.fusion, self.optimizer, expected_batch_size=cfg.batch_size
        )
        for epoch in range(ctx.start_epoch, cfg.epochs):
            started = time.perf_counter()
            total_loss = 0.0
            self.fusion.train()
            order = table_batches(self.table, train_ids, cfg.batch_size, seed=cfg.seed, epoch=epoch)
            for ids, total, forward, (y, x) in self._training_sums(ctx, order):
                s, out = self._head(ids, total, train=True, x=x)
                loss = task_loss(cfg.task, out, y)
                self.training.zero_grad()
                run_backward(loss)
                # the head's step is charged first (a DP-SGD budget that runs out stops before
                # any release) and applied once the next call is on its way (`_training_sums`):
                # the gradient sent does not depend on it, the next batch's head sees it
                self.training.charge(epoch=epoch)
                self._step_due = True
                ctx.return_gradients(
                    {tuple(ctx.parties): {"grad": s.grad.cpu().numpy()}},
                    ids=ids,
                    epoch=epoch,
                    args={"forward": forward},
                )
                total_loss += float(loss.detach()) * len(ids)
            self._apply_step()
            elapsed = time.perf_counter() - started
            ctx.epoch_done(
                epoch,
                stats={
                    "loss": total_loss / max(len(train_ids), 1),
                    "rows_per_s": len(train_ids) / max(elapsed, 1e-9),
                },
            )

    def _outputs(self, ctx: ActiveContext, ids: np.ndarray) -> Iterator[tuple[np.ndarray, Any]]:
        """(rows, the model's outputs) of `ids`, a chunk of `EVAL_BATCH` rows at a time (the
        pages of a map of a file of ids handed back after each)."""
        self.fusion.eval()
        with torch.no_grad():
            for chunk in row_chunks(ids):
                _, out = self._forward(ctx, chunk, train=False)
                yield chunk, out.cpu().numpy()

    def predict(self, ctx: ActiveContext, *, ids: np.ndarray) -> np.ndarray:
        outs = [out for _, out in self._outputs(ctx, ids)]
        return np.concatenate(outs) if outs else np.empty((0, 1))

    def evaluate(self, ctx: ActiveContext, *, ids: np.ndarray) -> dict[str, Any]:
        """`task_metrics` of the test rows, accumulated a chunk at a time (`OutputScores`): each
        chunk's labels read with its outputs, so no array of every test row's label, and for
        ROC-AUC only each row's score is kept."""
        scores = OutputScores(self.config.task)
        for chunk, out in self._outputs(ctx, ids):
            scores.add(self.table.label_rows(chunk), out)
        return scores.metrics()

    def state_dict(self) -> dict[str, Any]:
        state = {
            "head": self.head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
        }
        if self.own is not None:
            state["own"] = self.own.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        if self.own is not None:
            self.own.load_state_dict(state["own"])


SPEC = MethodSpec(
    name="splitnn",
    active=SplitNNActive,
    party=SplitNNParty,
    operations=OPERATIONS,
    secure_defaults=REPRESENTATION_SECURE_DEFAULTS,  # CKKS sized to representations
    dp_sgd=("parties", "active"),
    encodings=("onehot", "embedding"),
    # a batch's backward rides ahead of the next batch's forward (one round trip per batch)
    fuse=(("backward", "forward"),),
    # [network] pipeline_depth = d: a party's forward may be d updates behind (its backward
    # then steps the current encoder with the gradient computed at that stale representation)
    tolerates_staleness=True,
    description="split-NN baseline: summed party representations, head at the active party",
    example=partial(examples.classification, method="splitnn"),
)
