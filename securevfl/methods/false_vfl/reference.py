"""FALSE-VFL in one process: K parties and the active side with an in-memory sum (`secure_sum`),
which is exactly what the federation's secure sum delivers. Used to check the split math against
one autograd graph (`joint_stage1_loss`) and as the single-process baseline of the federated
method (`securevfl.methods.false_vfl.digits`). Imports torch at import time.

`ReferenceParty` adds to the party's math the stateful protocol of one batch: round 1
(`forward_posterior`), round 2 (`forward_loglik`) and `backward`, each handing out detached
tensors only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from securevfl.methods.blocks.nets import derived_seed
from securevfl.methods.false_vfl.model import (
    SUM_COUNT,
    SUM_DLOGLIK_DH,
    SUM_LOGLIK,
    FalseVFLActive,
    FalseVFLConfig,
    FalseVFLParty,
)


def secure_sum(contributions: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The in-memory stand-in for the federation's secure sum: the element-wise sum of every
    party's tensor under each name. Refuses an empty list and parties that disagree on names or
    shapes. Differentiable (the joint reference backpropagates through it)."""
    if not contributions:
        raise ValueError("secure_sum needs at least one contribution")
    keys = set(contributions[0])
    out: dict[str, torch.Tensor] = {}
    for c in contributions:
        if set(c) != keys:
            raise ValueError(f"contributions disagree on names: {sorted(keys)} vs {sorted(c)}")
    for key in sorted(keys):
        shapes = {tuple(c[key].shape) for c in contributions}
        if len(shapes) != 1:
            raise ValueError(f"contributions to {key!r} disagree on shape: {sorted(shapes)}")
        out[key] = torch.stack([c[key] for c in contributions]).sum(0)
    return out


class ReferenceParty(FalseVFLParty):
    """`FalseVFLParty` with the protocol of one batch: the graph of the current batch is kept
    between calls; only detached tensors are handed out."""

    def __init__(self, d_in: int, cfg: FalseVFLConfig, *, seed: int, name: str = "party") -> None:
        super().__init__(d_in, cfg, seed=seed, name=name)
        self._x: torch.Tensor | None = None
        self._present: torch.Tensor | None = None
        self._posterior: dict[str, torch.Tensor] | None = None
        self._loglik: torch.Tensor | None = None

    def forward_posterior(
        self, x: torch.Tensor, present: torch.Tensor, *, train: bool = False
    ) -> dict[str, torch.Tensor]:
        """Round 1: remembers the batch and returns detached `posterior_contributions`. With
        `train`, keeps the encoder graph for `backward`."""
        self._x, self._present, self._loglik = x, present, None
        with torch.set_grad_enabled(train):
            contrib = self.posterior_contributions(x, present)
        self._posterior = contrib if train else None
        return {k: v.detach() for k, v in contrib.items()}

    def forward_loglik(
        self, h: torch.Tensor, *, train: bool = False, eps_x: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Round 2 for the batch of the last `forward_posterior`: {"loglik": c_k [n, S]} and, with
        `train`, {"dloglik_dh": d c_k / d h [n, S, d_h]} (c_k of row i, sample j depends on
        h[i, j] only, so this is the full Jacobian). Refuses without a round 1."""
        if self._x is None or self._present is None:
            raise RuntimeError("forward_loglik before forward_posterior")
        if not train:
            with torch.no_grad():
                return {SUM_LOGLIK: self.loglik(self._x, self._present, h, eps_x)}
        h_leaf = h.detach().requires_grad_(True)
        c = self.loglik(self._x, self._present, h_leaf, eps_x)
        (dc_dh,) = torch.autograd.grad(c.sum(), h_leaf, retain_graph=True, allow_unused=True)
        self._loglik = c
        dc_dh = torch.zeros_like(h_leaf) if dc_dh is None else dc_dh
        return {SUM_LOGLIK: c.detach(), SUM_DLOGLIK_DH: dc_dh.detach()}

    def backward(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Accumulate .grad of this party's parameters from the gradients of the loss w.r.t. the
        summed quantities (the same message for every party): d loss / d "mu" or "prec_mu"
        [n, d_h], d "prec" [n, d_h], d "loglik" [n, S]. Because the sums are linear in each
        contribution, these are exactly the gradients w.r.t. this party's own terms. Refuses
        without a `train` forward of both rounds; frees the kept graph."""
        if self._posterior is None or self._loglik is None:
            raise RuntimeError(
                "backward needs forward_posterior and forward_loglik with train=True"
            )
        tensors, grad_outputs = [], []
        for key, value in self._posterior.items():
            if key == SUM_COUNT:
                continue  # a count, not a function of parameters
            tensors.append(value)
            grad_outputs.append(grads[key])
        tensors.append(self._loglik)
        grad_outputs.append(grads[SUM_LOGLIK])
        torch.autograd.backward(tensors, grad_outputs)
        self._posterior, self._loglik = None, None


@dataclass
class Noise:
    """All randomness of one forward: eps_h [n, S, d_h], eps_z [n, S, d_z] (active party) and per
    party eps_x [n, S, d_k] or None (FALSE-VFL-II decoder samples)."""

    eps_h: torch.Tensor
    eps_z: torch.Tensor
    eps_x: list[torch.Tensor | None] = field(default_factory=list)


@dataclass(frozen=True)
class TrainSchedule:
    """Optimisation settings for `FalseVFLReference.fit` (notes section 11 for digits)."""

    stage1_epochs: int = 200
    stage1_lr: float = 1e-3
    stage1_batch: int = 256
    stage2_epochs: int = 200
    stage2_lr: float = 1e-3
    stage2_batch: int = 64
    weight_decay: float = 1e-4


class FalseVFLReference:
    """K `ReferenceParty` objects and one `FalseVFLActive`, run in one process; every cross-party
    quantity goes through `secure_sum` (in memory), so the math here is what the federation runs
    once that sum is secure. xs is a list of K tensors [n, d_k]; present is bool [n, K].
    `names` (default party0, party1, ...) seed each party's models as the federation's parties of
    those names are seeded (with the same `seed`, they start from the same weights)."""

    def __init__(
        self,
        d_parts: Sequence[int],
        n_classes: int,
        cfg: FalseVFLConfig,
        *,
        seed: int,
        names: Sequence[str] | None = None,
    ) -> None:
        if len(d_parts) < 1:
            raise ValueError("need at least one party")
        names = [f"party{k}" for k in range(len(d_parts))] if names is None else list(names)
        if len(names) != len(d_parts) or len(set(names)) != len(names):
            raise ValueError(f"names must be {len(d_parts)} distinct names, got {names}")
        self.cfg = cfg
        self.seed = seed
        self.parties = [
            ReferenceParty(d, cfg, seed=seed, name=name)
            for d, name in zip(d_parts, names, strict=True)
        ]
        self.active = FalseVFLActive(n_classes, cfg, seed=seed)

    def _check(self, xs: Sequence[torch.Tensor], present: torch.Tensor) -> None:
        if len(xs) != len(self.parties):
            raise ValueError(f"expected {len(self.parties)} blocks, got {len(xs)}")
        if present.dtype != torch.bool or tuple(present.shape) != (xs[0].shape[0], len(xs)):
            raise ValueError(f"present must be bool [n, {len(xs)}], got {tuple(present.shape)}")

    def draw_noise(self, n: int, n_samples: int) -> Noise:
        """The noise each role would draw from its own generator for one forward."""
        eps_h, eps_z = self.active.sample_noise(n, n_samples)
        return Noise(eps_h, eps_z, [p.sample_noise(n, n_samples) for p in self.parties])

    # ---- split computation through the sums ------------------------------------------------

    def _forward(
        self,
        xs: Sequence[torch.Tensor],
        present: torch.Tensor,
        n_samples: int,
        *,
        train: bool,
        noise: Noise | None,
    ) -> dict[str, torch.Tensor]:
        self._check(xs, present)
        sums1 = secure_sum(
            [p.forward_posterior(x, present[:, k], train=train) for k, (p, x) in self._zip(xs)]
        )
        eps_h = noise.eps_h if noise else None
        eps_z = noise.eps_z if noise else None
        h = self.active.begin(sums1, n_samples, train=train, eps_h=eps_h, eps_z=eps_z)
        eps_x = noise.eps_x if noise and noise.eps_x else [None] * len(self.parties)
        return secure_sum(
            [
                p.forward_loglik(h, train=train, eps_x=e)
                for p, e in zip(self.parties, eps_x, strict=True)
            ]
        )

    def _zip(self, xs: Sequence[torch.Tensor]):
        return enumerate(zip(self.parties, xs, strict=True))

    def stage1_split(
        self, xs: Sequence[torch.Tensor], present: torch.Tensor, noise: Noise | None = None
    ) -> torch.Tensor:
        """One stage-1 forward/backward through the sums: accumulates .grad on every party's
        encoder/decoder/mask model and on the global encoder/decoder (never on phi) and returns
        the loss -mean_i L_kappa (detached)."""
        sums2 = self._forward(xs, present, self.cfg.kappa, train=True, noise=noise)
        loss, grads = self.active.finish_stage1(sums2[SUM_LOGLIK], sums2[SUM_DLOGLIK_DH])
        for p in self.parties:
            p.backward(grads)
        return loss

    def log_weights(
        self,
        xs: Sequence[torch.Tensor],
        present: torch.Tensor,
        n_samples: int,
        noise: Noise | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log w [n, S], h [n, S, d_h]) through the sums, without gradients."""
        sums2 = self._forward(xs, present, n_samples, train=False, noise=noise)
        return self.active.finish_log_weights(sums2[SUM_LOGLIK])

    def bound(
        self,
        xs: Sequence[torch.Tensor],
        present: torch.Tensor,
        n_samples: int,
        noise: Noise | None = None,
    ) -> torch.Tensor:
        """One draw of the per-row IWAE bound log R_S(x^obs) [n] (FALSE-VFL-II: of (x^obs, m))."""
        log_w, _ = self.log_weights(xs, present, n_samples, noise)
        return FalseVFLActive.iwae_bound(log_w)

    def stage2_loss(
        self, xs: Sequence[torch.Tensor], present: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """-mean_i L'_kappa on labeled rows; its graph reaches phi only (parties send no gradient
        and receive none)."""
        log_w, h = self.log_weights(xs, present, self.cfg.kappa)
        return -self.active.conditional_bound(log_w, h, y).mean()

    def predict_proba(
        self, xs: Sequence[torch.Tensor], present: torch.Tensor, *, batch: int = 512
    ) -> torch.Tensor:
        """p(y | x^obs) [n, C] by self-normalised importance sampling with L = cfg.n_predict."""
        out = []
        for i in range(0, xs[0].shape[0], batch):
            sl = slice(i, i + batch)
            log_w, h = self.log_weights([x[sl] for x in xs], present[sl], self.cfg.n_predict)
            with torch.no_grad():
                out.append(self.active.predict_proba(log_w, h))
        return torch.cat(out)

    # ---- the same math as one autograd graph -----------------------------------------------

    def joint_stage1_loss(
        self, xs: Sequence[torch.Tensor], present: torch.Tensor, noise: Noise
    ) -> torch.Tensor:
        """-mean_i L_kappa as one autograd graph over every module (no detached messages), for
        checking the split computation. Uses the given noise (S = noise.eps_h.shape[1])."""
        self._check(xs, present)
        sums1 = secure_sum(
            [p.posterior_contributions(x, present[:, k]) for k, (p, x) in self._zip(xs)]
        )
        mu_q, logvar_q = self.active.aggregate(sums1)
        h = self.active.sample_h(mu_q, logvar_q, noise.eps_h)
        eps_x = noise.eps_x or [None] * len(self.parties)
        sum_ll = secure_sum(
            [
                {SUM_LOGLIK: p.loglik(x, present[:, k], h, e)}
                for k, ((p, x), e) in enumerate(
                    zip(zip(self.parties, xs, strict=True), eps_x, strict=True)
                )
            ]
        )[SUM_LOGLIK]
        log_w = self.active.log_weights(sum_ll, h, mu_q, logvar_q, noise.eps_z)
        return -FalseVFLActive.iwae_bound(log_w).mean()

    # ---- training --------------------------------------------------------------------------

    def generative_parameters(self) -> list[nn.Parameter]:
        """Theta_g (and psi for FALSE-VFL-II): everything but phi."""
        params = [q for p in self.parties for q in p.parameters()]
        return params + self.active.generative_parameters()

    def fit(
        self,
        xs: Sequence[torch.Tensor],
        present: torch.Tensor,
        labeled: torch.Tensor,
        y: torch.Tensor,
        schedule: TrainSchedule,
        *,
        rng: np.random.Generator | None = None,
    ) -> dict[str, list[float]]:
        """Stage 1 on every row (labeled or not), then stage 2 on the rows where `labeled` (bool
        [n]) is True, using y [n] there only. Each role steps its own Adam optimiser (one per
        party, one for gamma_s/theta_s, one for phi). Batches are shuffled with a numpy
        Generator seeded from the reference seed (`rng` overrides). Returns per-epoch mean
        losses {"stage1": [...], "stage2": [...]}."""
        self._check(xs, present)
        gen = rng if rng is not None else np.random.default_rng(derived_seed(self.seed, "batches"))
        wd = schedule.weight_decay
        party_opts = [
            torch.optim.Adam(p.parameters(), lr=schedule.stage1_lr, weight_decay=wd)
            for p in self.parties
        ]
        active_opt = torch.optim.Adam(
            self.active.generative_parameters(), lr=schedule.stage1_lr, weight_decay=wd
        )
        history: dict[str, list[float]] = {"stage1": [], "stage2": []}
        n = xs[0].shape[0]
        for _ in range(schedule.stage1_epochs):
            losses = []
            for idx in np.array_split(gen.permutation(n), max(1, -(-n // schedule.stage1_batch))):
                ii = torch.as_tensor(idx)
                for opt in (*party_opts, active_opt):
                    opt.zero_grad(set_to_none=True)
                losses.append(float(self.stage1_split([x[ii] for x in xs], present[ii])))
                for opt in (*party_opts, active_opt):
                    opt.step()
            history["stage1"].append(sum(losses) / len(losses))
        lab = torch.nonzero(labeled, as_tuple=False).reshape(-1).numpy()
        if len(lab) == 0:
            return history
        phi_opt = torch.optim.Adam(
            self.active.discriminator.parameters(), lr=schedule.stage2_lr, weight_decay=wd
        )
        for _ in range(schedule.stage2_epochs):
            losses = []
            perm = gen.permutation(lab)
            for idx in np.array_split(perm, max(1, -(-len(lab) // schedule.stage2_batch))):
                ii = torch.as_tensor(idx)
                phi_opt.zero_grad(set_to_none=True)
                loss = self.stage2_loss([x[ii] for x in xs], present[ii], y[ii])
                loss.backward()
                phi_opt.step()
                losses.append(float(loss.detach()))
            history["stage2"].append(sum(losses) / len(losses))
        return history
