"""The host of tabvfl-le: PartialDec over the summed step outputs and the head over the
summed latents; everything it receives from the guests is a secure sum
(`securevfl.methods.tabvfl.schedule` runs the phases)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from securevfl.lazy import torch
from securevfl.methods.base import ActiveContext, SumSpec
from securevfl.methods.blocks.nets import make_optimizer
from securevfl.methods.tabvfl.schedule import Schedule, chunks


class LEActive(Schedule):
    """The host of tabvfl-le: PartialDec over the summed step outputs, the head over the
    summed latents. Everything it receives from the guests is a secure sum."""

    name = "tabvfl-le"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from securevfl.methods.tabvfl.split import LEHost
        from securevfl.methods.tabvfl.tabnet import seeded_generator

        self.host = LEHost(
            self.n_classes,
            self.cfg,
            generator=seeded_generator(self.config.seed, "tabvfl-le", "host", "init"),
        ).to(self.device)
        self.optimizers = {
            "pretrain": make_optimizer(self.host.decoder.parameters(), self.config),
            "finetune": make_optimizer(self.host.head.parameters(), self.config),
        }

    def _sum(
        self, ctx: ActiveContext, op: str, ids: np.ndarray, tensors: Sequence[str], **kwargs: Any
    ) -> dict[str, np.ndarray]:
        group = tuple(ctx.parties)
        sums = [SumSpec(key=t, tensor=t, group=group) for t in tensors]
        return ctx.call(op, ids=ids, sums=sums, **kwargs)

    def _train_epoch(self, ctx: ActiveContext, epoch: int) -> dict[str, float]:
        phase = self.phase
        opt = self.optimizers[phase]
        total, count = 0.0, 0
        self.host.train()
        for ids in self.batches:
            m, n = len(ctx.parties), len(ids)
            if phase == "pretrain":
                s = self._t(
                    self._sum(ctx, "pretrain_forward", ids, ["steps"], args={"train": True})[
                        "steps"
                    ],
                    grad=True,
                )
                r = self.host.decode(s)
                r_np = r.detach().cpu().numpy()
                got = self._sum(
                    ctx,
                    "pretrain_reconstruct",
                    ids,
                    ["grad_r", "loss_rows"],
                    args={"train": True},
                    inputs={"r": r_np},
                )
                loss = float(np.mean(got["loss_rows"]))
                opt.zero_grad(set_to_none=True)
                r.backward(self._t(got["grad_r"] / n))  # the guests sent per-sample (x B) gradients
                opt.step()
                grad = s.grad.cpu().numpy()
                ctx.call("pretrain_backward", ids=ids, inputs={"grad": grad}, to=list(ctx.parties))
                up = m * (s.shape[1] + r_np.shape[1] + 1) * n
                self._count(phase, up=up, down=m * (r_np.size + grad.size), rows=n)
            else:
                z = self._t(
                    self._sum(ctx, "forward", ids, ["z"], args={"train": True})["z"], grad=True
                )
                y = torch.as_tensor(self.table.label_rows(ids), device=self.device).long()
                loss_t = torch.nn.functional.cross_entropy(self.host.head(z), y)
                opt.zero_grad(set_to_none=True)
                loss_t.backward()
                opt.step()
                grad = z.grad.cpu().numpy()
                ctx.return_gradients({tuple(ctx.parties): {"grad": grad}}, ids=ids, epoch=epoch)
                self._count(phase, up=m * z.numel(), down=m * grad.size, rows=n)
                loss = float(loss_t.detach())
            total, count = total + loss * n, count + n
        return {"loss": total / max(count, 1)}

    def _valid_loss(self, ctx: ActiveContext) -> float:
        total, rows = 0.0, 0
        self.host.eval()
        for c, ids in enumerate(chunks(self.valid_ids)):
            args = {"train": False, "chunk": c}
            s = self._sum(ctx, "pretrain_forward", ids, ["steps"], args=args)["steps"]
            with torch.no_grad():
                r = self.host.decode(self._t(s)).cpu().numpy()
            got = self._sum(
                ctx, "pretrain_reconstruct", ids, ["loss_rows"], args=args, inputs={"r": r}
            )
            total += float(np.sum(got["loss_rows"]))
            rows += len(ids)
        return total / max(rows, 1)

    def _infer(self, ctx: ActiveContext, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.host.eval()
        logits, latents = [], []
        for ids_c in chunks(np.asarray(ids, dtype=np.int64)):
            z = self._sum(ctx, "forward", ids_c, ["z"], args={"train": False})["z"]
            with torch.no_grad():
                logits.append(self.host.head(self._t(z)).cpu().numpy())
            latents.append(np.asarray(z, dtype=np.float32))
        if not logits:
            return np.zeros((0, self.n_classes)), np.zeros((0, self.cfg.n_d))
        return np.concatenate(logits), np.concatenate(latents)

    def _host_state(self) -> dict[str, Any]:
        return {
            "model": self.host.state_dict(),
            "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
        }

    def _load_host(self, state: Mapping[str, Any]) -> None:
        self.host.load_state_dict(state["model"])
        if "optimizers" in state:
            for k, o in self.optimizers.items():
                o.load_state_dict(state["optimizers"][k])
