"""Split-NN baseline: one encoder per party, representations fused by a secure sum, the head and
loss at the active party, which sends back dL/dS (the same for every contributor)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np

from securevfl.lazy import torch
from securevfl.methods import examples
from securevfl.methods.base import (
    ActiveContext,
    ActiveMethod,
    MethodSpec,
    Operation,
    PartyMethod,
    Release,
    SumSpec,
    UnknownOperation,
)
from securevfl.methods.blocks.batches import chunks
from securevfl.methods.blocks.nets import (
    Standardizer,
    batches,
    class_count,
    derived_seed,
    make_optimizer,
    mlp,
    output_dim,
    task_loss,
)
from securevfl.metrics import task_metrics

OPERATIONS = (
    Operation(
        "forward",
        "the encoder's output f_k(x_k) on rows `ids` (train: kept for the backward)",
        releases=(Release("rep", why="the representation: only inside the sum over all parties"),),
    ),
    Operation(
        "backward",
        "dL/dS of the last training forward; the party steps its encoder",
        inputs=("grad",),
        updates=True,
    ),
)


class SplitNNParty(PartyMethod):
    """A passive party's encoder f_k."""

    def setup(self, *, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> None:
        from securevfl.methods.blocks.embedding import input_width, keep_codes, with_embeddings
        from securevfl.privacy.runtime import private_training

        train_ids = inputs["train_ids"]
        self.scaler = Standardizer().fit(self.table.rows(train_ids[self.table.has(train_ids)]))
        keep_codes(self.scaler, self.table)  # categorical codes ([categorical] embedding) as is
        seed = derived_seed(self.config.seed, "encoder", self.name)
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
        self._pending: tuple[np.ndarray, Any] | None = None

    def _inputs(self, ids: np.ndarray) -> Any:
        return torch.from_numpy(self.scaler.transform(self.table.rows(ids))).to(self.device)

    def handle(
        self, op: str, *, ids: np.ndarray, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        if op == "forward":
            x = self._inputs(ids)
            if args.get("train", False):
                self.encoder.train()
                out = self.training.model(x)
                self._pending = (ids, out)
            else:
                self.encoder.eval()
                with torch.no_grad():
                    out = self.encoder(x)
            return {"rep": out.detach().cpu().numpy()}
        if op == "backward":
            if self._pending is None or not np.array_equal(self._pending[0], ids):
                raise RuntimeError("backward for rows that were not the last training forward")
            _, out = self._pending
            grad = torch.tensor(np.asarray(inputs["grad"], dtype=np.float32), device=self.device)
            if grad.shape != out.shape:
                raise ValueError(
                    f"gradient shape {tuple(grad.shape)} != representation {tuple(out.shape)}"
                )
            self.training.zero_grad()
            out.backward(grad)
            self.training.step()
            self._pending = None
            return {}
        raise UnknownOperation("splitnn", op)

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
        self.n_classes = class_count(cfg.task, self.table.labels)
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

    def _sum_spec(self, ctx: ActiveContext) -> list[SumSpec]:
        return [SumSpec(key="S", tensor="rep", group=ctx.parties)]

    def _forward(self, ctx: ActiveContext, ids: np.ndarray, *, train: bool) -> tuple[Any, Any]:
        total = ctx.call("forward", ids=ids, args={"train": train}, sums=self._sum_spec(ctx))["S"]
        s = torch.tensor(total, dtype=torch.float32, device=self.device, requires_grad=train)
        model = self.training.model if train and self.training is not None else self.fusion
        if self.own is None:
            return s, model(s)
        x = torch.from_numpy(self.scaler.transform(self.table.rows(ids))).to(self.device)
        return s, model(s, x)

    def fit(self, ctx: ActiveContext, *, train_ids: np.ndarray) -> None:
        cfg = self.config
        incomplete = int((~ctx.presence(train_ids).all(axis=1)).sum())
        if incomplete:
            raise ValueError(
                f"splitnn needs every training row at every party, but {incomplete} rows are "
                'missing at some party; use method "standard-vfl" (complete rows only) or '
                '"laser" (any subset of parties)'
            )
        if ctx.start_epoch == 0:
            from securevfl.methods.blocks.embedding import keep_codes

            keep_codes(self.scaler.fit(self.table.rows(train_ids)), self.table)
        from securevfl.privacy.runtime import private_training

        # DP-SGD on head (+ own encoder) when [active] dp_sgd is set; the loss is a batch mean
        self.training = private_training(
            ctx, self.fusion, self.optimizer, expected_batch_size=cfg.batch_size
        )
        for epoch in range(ctx.start_epoch, cfg.epochs):
            started = time.perf_counter()
            total_loss = 0.0
            self.fusion.train()
            for ids in batches(train_ids, cfg.batch_size, seed=cfg.seed, epoch=epoch):
                s, out = self._forward(ctx, ids, train=True)
                y = torch.as_tensor(self.table.label_rows(ids), device=self.device)
                loss = task_loss(cfg.task, out, y)
                self.training.zero_grad()
                loss.backward()
                # the head steps first: a DP-SGD budget that runs out stops before any release
                self.training.step(epoch=epoch)
                ctx.return_gradients(
                    {tuple(ctx.parties): {"grad": s.grad.cpu().numpy()}}, ids=ids, epoch=epoch
                )
                total_loss += float(loss.detach()) * len(ids)
            elapsed = time.perf_counter() - started
            ctx.epoch_done(
                epoch,
                stats={
                    "loss": total_loss / max(len(train_ids), 1),
                    "rows_per_s": len(train_ids) / max(elapsed, 1e-9),
                },
            )

    def predict(self, ctx: ActiveContext, *, ids: np.ndarray) -> np.ndarray:
        self.fusion.eval()
        outs = []
        with torch.no_grad():
            for chunk in chunks(ids):
                _, out = self._forward(ctx, chunk, train=False)
                outs.append(out.cpu().numpy())
        return np.concatenate(outs) if outs else np.empty((0, 1))

    def evaluate(self, ctx: ActiveContext, *, ids: np.ndarray) -> dict[str, Any]:
        output = self.predict(ctx, ids=ids)
        return task_metrics(self.config.task, y_true=self.table.label_rows(ids), output=output)

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
    dp_sgd=("parties", "active"),
    encodings=("onehot", "embedding"),
    # a batch's backward rides ahead of the next batch's forward (one round trip per batch)
    fuse=(("backward", "forward"),),
    description="split-NN baseline: summed party representations, head at the active party",
    example=partial(examples.classification, method="splitnn"),
)
