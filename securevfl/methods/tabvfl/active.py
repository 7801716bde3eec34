"""The host of tabvfl: PartialEnc, PartialDec and the head over the guests' clear outputs,
and the failure cache (`securevfl.methods.tabvfl.schedule` runs the phases).

Failures: the host keeps each guest's latest output per (phase, batch position) — (h, prior)
in pretraining, h in fine-tuning. A guest offline for an epoch (simulated, `failure_p`, drawn
per guest and epoch from each phase's second epoch, the same draws for the cache and zeros
fills) or lost for good (the aggregator drops it: from then on it is offline) is served from
that cache (`failure_fill = "cache"`) or zeros; it computes no loss and gets no gradient, as in
the paper. Rows outside the batch positions (validation, evaluation) of a lost guest get the
mean of its cached fine-tuning outputs (zeros for the zeros fill).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from securevfl.lazy import torch
from securevfl.methods.base import ActiveContext, PartyDropped
from securevfl.methods.blocks.nets import make_optimizer
from securevfl.methods.tabvfl.schedule import PHASES, Schedule, chunks


class FailureCache:
    """The host's copy of each guest's latest output per (phase, batch position); numpy
    arrays in memory, tensors in checkpoints."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, dict[int, dict[str, np.ndarray]]]] = {}

    def put(self, phase: str, guest: str, position: int, tensors: Mapping[str, np.ndarray]):
        """Replace the entry (copies: the cache never aliases a live array)."""
        slot = self.entries.setdefault(phase, {}).setdefault(guest, {})
        slot[position] = {k: np.array(v, copy=True) for k, v in tensors.items()}

    def get(self, phase: str, guest: str, position: int) -> dict[str, np.ndarray] | None:
        return self.entries.get(phase, {}).get(guest, {}).get(position)

    def mean(self, guest: str, name: str) -> np.ndarray | None:
        """Per-column mean of `name` over the guest's cached batches (fine-tuning first)."""
        for phase in ("finetune", "pretrain"):
            found = [e[name] for e in self.entries.get(phase, {}).get(guest, {}).values()]
            if found:
                return np.concatenate(found).mean(axis=0)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {
            ph: {
                g: {b: {k: torch.from_numpy(v) for k, v in e.items()} for b, e in slots.items()}
                for g, slots in guests.items()
            }
            for ph, guests in self.entries.items()
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.entries = {
            ph: {
                g: {int(b): {k: np.asarray(v) for k, v in e.items()} for b, e in slots.items()}
                for g, slots in guests.items()
            }
            for ph, guests in state.items()
        }


# --------------------------------------------------------------------------------------------
# TabVFL


class TabVFLActive(Schedule):
    """The host of tabvfl: PartialEnc, PartialDec and the head over the guests' clear h_k,
    the failure cache."""

    name = "tabvfl"
    tolerates_dropout = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.guests = list(self.config.party_names)  # the split's order (decoder slices)
        self.host: Any = None
        self.guest_dims: list[int] | None = None
        self.cache = FailureCache()
        self.tally["offline"] = {p: 0 for p in PHASES}  # guest-epochs served by the fill
        # guest-batches of training served by each fill (simulated offline or lost for good)
        self.tally["filled"] = {p: {"cache": 0, "zeros": 0} for p in PHASES}
        # per guest: rounds of clear outputs it missed the deadline of (it stayed in the run)
        self.tally["late"] = {}

    def _build(self, dims: Sequence[int]) -> None:
        from securevfl.methods.tabvfl.split import TabVFLHost
        from securevfl.methods.tabvfl.tabnet import seeded_generator

        self.guest_dims = [int(d) for d in dims]
        self.host = TabVFLHost(
            self.guest_dims,
            self.n_classes,
            self.cfg,
            generator=seeded_generator(self.config.seed, "tabvfl", "host", "init"),
        ).to(self.device)
        self.optimizers = {
            "pretrain": make_optimizer(self.host.pretrain_parameters(), self.config),
            "finetune": make_optimizer(self.host.finetune_parameters(), self.config),
        }

    def _online(self, ctx: ActiveContext) -> list[str]:
        """The guests that answer this epoch: alive, and not drawn offline (simulation)."""
        alive = [p for p in self.guests if p in ctx.parties]
        p_fail = self.opts.failure_p
        if p_fail <= 0 or self.phase_epoch == 0:  # the first epoch of a phase fills the cache
            return alive
        draws = np.random.default_rng(
            [self.config.seed, 0xFA11, PHASES.index(self.phase), self.phase_epoch]
        ).random(len(self.guests))
        online = [p for p, u in zip(self.guests, draws, strict=True) if u >= p_fail and p in alive]
        self.tally["offline"][self.phase] += len(alive) - len(online)
        return online

    def _collect(
        self, ctx: ActiveContext, op: str, ids: np.ndarray, to: Sequence[str], args: dict
    ) -> dict[str, dict[str, np.ndarray]]:
        """Each guest's clear tensors of `op`; a guest lost meanwhile is left out (the others
        run the forward again: it changes nothing they keep), and so is one that missed the
        round's deadline, for this call only: it stays in `ctx.parties` and is called again
        from the next batch on (the aggregator drops its late reply by round id)."""
        names = ["h", "prior"] if op == "pretrain_forward" else ["h"]
        late: set[str] = set()
        while True:
            live = [p for p in to if p in ctx.parties and p not in late]
            if not live:
                return {}
            try:
                got = ctx.call(op, ids=ids, args=args, to=live, collect=names)
            except PartyDropped as exc:
                late.update(self._late(ctx, exc))
                continue
            return {p: {n: got[f"{n}@{p}"] for n in names} for p in live}

    def _late(self, ctx: ActiveContext, exc: PartyDropped) -> list[str]:
        """The guests that missed a round's deadline but stay in the run (`parties` of
        `roles.active_round.PartyLate`; a lost guest has left ctx.parties already), counted."""
        late = [p for p in getattr(exc, "parties", ()) if p in ctx.parties]
        counts = self.tally.setdefault("late", {})
        for p in late:
            counts[p] = counts.get(p, 0) + 1
        return late

    def _call_one(
        self, ctx: ActiveContext, op: str, ids: np.ndarray, guest: str, **kwargs: Any
    ) -> dict[str, np.ndarray] | None:
        if guest not in ctx.parties:
            return None
        try:
            got = ctx.call(op, ids=ids, to=[guest], **kwargs)
        except PartyDropped as exc:
            self._late(ctx, exc)
            return None
        return {k.rsplit("@", 1)[0]: v for k, v in got.items()}

    def _inputs(
        self,
        phase: str,
        got: Mapping[str, Mapping[str, np.ndarray]],
        position: int | None,
        rows: int,
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Every guest's h (and prior) for a batch: received, or the fill for an absent one."""
        hs, priors = [], []
        for p, d in zip(self.guests, self.guest_dims, strict=True):
            if p in got:
                hs.append(got[p]["h"])
                priors.append(got[p].get("prior", np.ones((rows, d), np.float32)))
                continue
            cached = None
            if self.opts.failure_fill == "cache":
                if position is not None:
                    cached = self.cache.get(phase, p, position)
                elif (mean := self.cache.mean(p, "h")) is not None:
                    cached = {"h": np.tile(mean.astype(np.float32), (rows, 1))}
            served = cached is not None and cached["h"].shape[0] == rows
            if served:
                hs.append(cached["h"])
                priors.append(cached.get("prior", np.ones((rows, d), np.float32)))
            else:  # zeros: and in pretraining every column of the guest counts as hidden
                hs.append(np.zeros((rows, d), np.float32))
                priors.append(np.zeros((rows, d), np.float32))
            if position is not None:
                filled = self.tally.setdefault("filled", {}).setdefault(
                    phase, {"cache": 0, "zeros": 0}
                )
                filled["cache" if served else "zeros"] += 1
        return hs, priors

    def _ensure_host(self, got: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        if self.host is not None:
            return
        missing = [p for p in self.guests if p not in got]
        if missing:
            raise RuntimeError(
                f"tabvfl learns each guest's width from its first answer; {missing} gave none"
            )
        self._build([got[p]["h"].shape[1] for p in self.guests])

    def _train_epoch(self, ctx: ActiveContext, epoch: int) -> dict[str, float]:
        phase = self.phase
        online = self._online(ctx)
        total, count = 0.0, 0
        keep = self.opts.failure_fill == "cache"
        for b, ids in enumerate(self.batches):
            op = "pretrain_forward" if phase == "pretrain" else "forward"
            got = self._collect(ctx, op, ids, online, {"train": True}) if online else {}
            self._ensure_host(got)
            if not got and phase == "pretrain":
                continue  # every guest offline: no pretraining step (the paper's code)
            for p, tensors in got.items():
                self._count(phase, up=sum(v.size for v in tensors.values()))
                if keep:
                    self.cache.put(phase, p, b, tensors)
            self._count(phase, rows=len(ids))
            hs, priors = self._inputs(phase, got, b, len(ids))
            h_in = [self._t(h, grad=p in got) for p, h in zip(self.guests, hs, strict=True)]
            self.host.train()
            opt = self.optimizers[phase]
            if phase == "pretrain":
                loss = self._pretrain_batch(ctx, ids, got, h_in, [self._t(p) for p in priors], opt)
            else:
                loss = self._finetune_batch(ctx, ids, got, h_in, opt, epoch)
            if loss is not None:
                total, count = total + loss * len(ids), count + len(ids)
        return {"loss": total / max(count, 1)}

    def _pretrain_batch(
        self, ctx: ActiveContext, ids: np.ndarray, got: Mapping, h_in: list, priors: list, opt: Any
    ) -> float | None:
        rs = self.host.pretrain_forward(h_in, priors)
        live, grads, loss = [], [], 0.0
        for k, p in enumerate(self.guests):
            if p not in got:
                continue  # an offline guest computes no loss (its slice of r goes unused)
            r = rs[k].detach().cpu().numpy()
            out = self._call_one(
                ctx,
                "pretrain_reconstruct",
                ids,
                p,
                args={"train": True},
                inputs={"r": r},
                collect=["loss", "grad_r"],
            )
            self._count("pretrain", down=r.size)
            if out is None:
                continue
            self._count("pretrain", up=out["grad_r"].size + out["loss"].size)
            live.append(k)
            grads.append(self._t(out["grad_r"]))
            loss += float(out["loss"][0])
        if not live:
            return None
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward([rs[k] for k in live], grads)
        opt.step()
        for k in live:
            grad = h_in[k].grad.cpu().numpy()
            self._count("pretrain", down=grad.size)
            self._call_one(ctx, "pretrain_backward", ids, self.guests[k], inputs={"grad": grad})
        return loss

    def _finetune_batch(
        self, ctx: ActiveContext, ids: np.ndarray, got: Mapping, h_in: list, opt: Any, epoch: int
    ) -> float:
        from securevfl.methods.tabvfl.tabnet import finetune_objective

        y = torch.as_tensor(self.table.label_rows(ids), device=self.device).long()
        logits, m_loss = self.host.finetune_forward(h_in)
        loss = finetune_objective(logits, y, m_loss, self.cfg.lambda_sparse)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()  # the host steps first: a label-DP budget that runs out stops before release
        grads = {
            (p,): {"grad": h.grad.cpu().numpy()}
            for p, h in zip(self.guests, h_in, strict=True)
            if p in got and p in ctx.parties
        }
        if grads:
            self._count("finetune", down=sum(g["grad"].size for g in grads.values()))
            ctx.return_gradients(grads, ids=ids, epoch=epoch, op="backward")
        return float(loss.detach())

    def _valid_loss(self, ctx: ActiveContext) -> float:
        total, rows = 0.0, 0
        self.host.eval()
        for c, ids in enumerate(chunks(self.valid_ids)):
            alive = [p for p in self.guests if p in ctx.parties]
            got = self._collect(ctx, "pretrain_forward", ids, alive, {"train": False, "chunk": c})
            hs, priors = self._inputs("pretrain", got, None, len(ids))
            with torch.no_grad():
                rs = self.host.pretrain_forward(
                    [self._t(h) for h in hs], [self._t(p) for p in priors]
                )
            for k, p in enumerate(self.guests):
                if p in got:
                    out = self._call_one(
                        ctx,
                        "pretrain_reconstruct",
                        ids,
                        p,
                        args={"train": False},
                        inputs={"r": rs[k].cpu().numpy()},
                        collect=["loss"],
                    )
                    total += 0.0 if out is None else float(out["loss"][0]) * len(ids)
            rows += len(ids)
        return total / max(rows, 1)

    def _infer(self, ctx: ActiveContext, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, latents = [], []
        if self.host is not None:
            self.host.eval()
        for ids_c in chunks(np.asarray(ids, dtype=np.int64)):
            alive = [p for p in self.guests if p in ctx.parties]
            got = self._collect(ctx, "forward", ids_c, alive, {"train": False})
            self._ensure_host(got)
            self.host.eval()
            hs, _ = self._inputs("finetune", got, None, len(ids_c))
            with torch.no_grad():
                z, _ = self.host.latent_and_m_loss([self._t(h) for h in hs])
                logits.append(self.host.head(z).cpu().numpy())
                latents.append(z.cpu().numpy())
        if not logits:
            return np.zeros((0, self.n_classes)), np.zeros((0, self.cfg.n_d))
        return np.concatenate(logits), np.concatenate(latents)

    def _host_state(self) -> dict[str, Any]:
        if self.host is None:
            return {}
        return {
            "dims": list(self.guest_dims or []),
            "model": self.host.state_dict(),
            "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
        }

    def _load_host(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        if self.host is None:
            self._build(state["dims"])
        self.host.load_state_dict(state["model"])
        if "optimizers" in state:
            for k, o in self.optimizers.items():
                o.load_state_dict(state["optimizers"][k])

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "cache": self.cache.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.cache.load_state_dict(state["cache"])

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out[self.name]["guest_dims"] = list(self.guest_dims or [])
        out[self.name]["failure"] = {"p": self.opts.failure_p, "fill": self.opts.failure_fill}
        return out
