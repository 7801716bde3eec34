"""The passive party of the encoder + head methods over missing blocks: its representation
models, trained on the gradients the active party returns.

Operations (what the party serves, and what each releases):

* ``forward`` (args: train, epoch, models = {party: [model names]}): each requested model's
  output on rows `ids`, only ever inside a secure sum over the call's group; a training forward
  is kept for the backward.
* ``backward`` (inputs: model name -> dL/d output): updates the models (a new model version).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from securevfl.lazy import nn, torch
from securevfl.methods.base import Operation, PartyMethod, Release, UnknownOperation
from securevfl.methods.blocks.nets import derived_seed, mlp, run_backward, scaled_rows
from securevfl.methods.blocks.options import block_optimizer, fit_scaler, lr_at

if TYPE_CHECKING:
    from securevfl.privacy.runtime import PrivateTraining

BLOCK_OPERATIONS = (
    Operation(
        "forward",
        "the outputs of the requested representation models on rows `ids`",
        releases=(
            Release(
                "rep*",
                why="a representation f_k(x_k) per row: only inside a secure sum over the "
                "call's group",
            ),
        ),
    ),
    Operation(
        "backward",
        "dL/d(output) of the last training forward; the party steps its models",
        inputs=("rep*",),
        updates=True,
    ),
)


class BlockParty(PartyMethod):
    """A passive party's representation models for the methods over missing blocks.

    ``forward`` (args: train, epoch, models = {party: [model names]}) returns each requested
    model's output on rows `ids`; ``backward`` (inputs: model name -> dL/d output) updates them.
    LASER has one model, ``rep`` = f_k."""

    method_name: ClassVar[str] = "laser"

    def model_names(self) -> list[str]:
        return ["rep"]

    def build_model(self, model: str) -> nn.Module:
        cfg = self.config
        return mlp(
            self.input_width(),
            cfg.hidden,
            cfg.width,
            seed=derived_seed(self.init_seed(), self.method_name, model, self.name),
        )

    def input_width(self) -> int:
        """What `build_model`'s model reads: the table's columns, with each categorical code
        column ([categorical] embedding) replaced by its embedding."""
        from securevfl.methods.blocks.embedding import input_width

        return input_width(self.table, self.config)

    def _model(self, model: str) -> nn.Module:
        """`build_model`'s model behind the embeddings of the table's code columns (if any)."""
        from securevfl.methods.blocks.embedding import with_embeddings

        seed = derived_seed(self.init_seed(), self.method_name, model, self.name)
        return with_embeddings(self.table, self.config, self.build_model(model), seed=seed)

    def setup(self, *, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> None:
        train_ids = np.asarray(inputs["train_ids"])
        held = self.table.held_ids(train_ids)
        streamed = getattr(self.table, "streamed", False)
        # a table streamed from disk is summarised block by block and scaled batch by batch
        self.scaler = fit_scaler(
            self.table.column_summary(held) if streamed else self.table.rows(held), self.config
        )
        from securevfl.methods.blocks.embedding import keep_codes

        keep_codes(self.scaler, self.table)  # categorical codes stay codes
        self.models = nn.ModuleDict({m: self._model(m) for m in self.model_names()}).to(self.device)
        # DP-SGD ([parties.NAME] dp_sgd) when the role's privacy plan has it: one Opacus
        # optimizer per model (a batch may train only some of a party's models), each step
        # charged to the ledger; the active party's loss is a batch mean. Without it, one
        # optimizer (Adam and SGD are per parameter, so this is the same update).
        from securevfl.privacy.runtime import private_training

        privacy = getattr(self, "privacy", None)
        self.trainings: dict[str, PrivateTraining] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self._epoch = 0  # of the last training forward: DP-SGD steps are charged to it
        if privacy is not None and privacy.plan.dp_sgd is not None:
            self.trainings = {
                m: private_training(
                    self,
                    self.models[m],
                    block_optimizer(self.models[m].parameters(), self.config),
                    expected_batch_size=self.config.batch_size,
                )
                for m in self.model_names()
            }
        else:
            self.optimizer = block_optimizer(self.models.parameters(), self.config)
        self._pending: tuple[np.ndarray, dict[str, torch.Tensor]] | None = None

    @property
    def private(self) -> bool:
        """Whether the models train with DP-SGD (one `PrivateTraining` per model)."""
        return bool(self.trainings)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        if self.private:
            return [t.optimizer for t in self.trainings.values()]
        return [self.optimizer]

    def _inputs(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(scaled_rows(self, ids)).to(self.device)

    def handle(
        self, op: str, *, ids: np.ndarray, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        if op == "forward":
            wanted = dict(args.get("models") or {}).get(self.name, self.model_names())
            unknown = [m for m in wanted if m not in self.models]
            if unknown:
                raise ValueError(f"{self.method_name} party {self.name!r} has no models {unknown}")
            x = self._inputs(ids)
            train = bool(args.get("train", False))
            if train:
                self._epoch = int(args.get("epoch", 0))
                for optimizer in self._optimizers():
                    for group in optimizer.param_groups:
                        group["lr"] = lr_at(self.config, self._epoch)
                self.models.train()
                if self.private:  # through Opacus's GradSampleModule (per-sample gradients)
                    outs = {m: self.trainings[m].model(x) for m in wanted}
                else:
                    outs = {m: self.models[m](x) for m in wanted}
                self._pending = (np.array(ids, copy=True), outs)
            else:
                self.models.eval()
                with torch.no_grad():
                    outs = {m: self.models[m](x) for m in wanted}
            return {m: o.detach().cpu().numpy() for m, o in outs.items()}
        if op == "backward":
            if self._pending is None or not np.array_equal(self._pending[0], ids):
                raise RuntimeError("backward for rows that were not the last training forward")
            outs = self._pending[1]
            grads: dict[str, torch.Tensor] = {}
            for m, g in inputs.items():
                if m not in outs:
                    raise ValueError(f"gradient for {m!r}, which the last forward did not compute")
                grad = torch.tensor(np.asarray(g, dtype=np.float32), device=self.device)
                if grad.shape != outs[m].shape:
                    raise ValueError(
                        f"gradient shape {tuple(grad.shape)} != output "
                        f"{tuple(outs[m].shape)} of {m!r}"
                    )
                grads[m] = grad
            self._pending = None
            if self.private:  # each model clips, noises and charges its own step
                for m, grad in grads.items():
                    training = self.trainings[m]
                    training.zero_grad()
                    run_backward(outs[m], grad)
                    training.step(epoch=self._epoch)
            elif grads:
                self.optimizer.zero_grad(set_to_none=True)
                torch.autograd.backward([outs[m] for m in grads], list(grads.values()))
                self.optimizer.step()
            return {}
        raise UnknownOperation(self.method_name, op)

    def state_dict(self) -> dict[str, Any]:
        return {
            "models": self.models.state_dict(),
            "optimizers": [o.state_dict() for o in self._optimizers()],
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.models.load_state_dict(state["models"])
        saved = state["optimizers"]
        if len(saved) != len(self._optimizers()):
            raise ValueError(
                f"the checkpoint has {len(saved)} optimizers, this run {len(self._optimizers())}: "
                "was [parties] dp_sgd changed? Resume with the run's own config"
            )
        for optimizer, sd in zip(self._optimizers(), saved, strict=True):
            optimizer.load_state_dict(sd)
        self.scaler.load_state_dict(state["scaler"])  # `scaled_rows` sees the new statistics
