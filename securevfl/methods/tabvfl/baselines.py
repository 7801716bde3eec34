"""The paper's baselines in one process: LT (local TabNets: each guest pretrains its own TabNet
on its columns, latents concatenated) and CT (one TabNet on all columns, centralised).

CT is centralised by definition, and LT's pretraining involves no communication at all; its
fine-tuning (the guests' latents concatenated under one head at the host) is simulated here in
one autograd graph, which is exactly what the split protocol computes. The benchmark runs both
with :func:`fit_early_stopping`, the paper's schedule in one process.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from securevfl.methods.tabvfl.reference import _as_tensor, _check_blocks, _Trainable
from securevfl.methods.tabvfl.tabnet import (
    PartialDecoder,
    PartialEncoder,
    TabNetConfig,
    decoder_slices,
    finetune_objective,
    init_non_glu,
    seeded_generator,
    unsupervised_loss,
)


class TabNetAutoencoder(nn.Module):
    """A complete TabNet pretraining autoencoder on one party's columns: initial BN, encoder,
    decoder, reconstruction FC (d -> d via n_d), and its own obfuscator. Used by LT (one per
    guest) and CT (one on all columns)."""

    def __init__(
        self,
        d: int,
        cfg: TabNetConfig,
        *,
        init_generator: torch.Generator,
        mask_generator: torch.Generator,
    ) -> None:
        super().__init__()
        self.d = d
        self.cfg = cfg
        self.mask_generator = mask_generator
        self.initial_bn = nn.BatchNorm1d(d, momentum=cfg.guest_bn_momentum)
        self.encoder = PartialEncoder(d, cfg, generator=init_generator)
        self.decoder = PartialDecoder(cfg, generator=init_generator)
        self.reconstruction_layer = nn.Linear(cfg.n_d, d, bias=False)
        init_non_glu(self.reconstruction_layer, init_generator)

    def pretrain_loss(self, x: torch.Tensor, obf: torch.Tensor | None = None) -> torch.Tensor:
        """TabNet pretraining loss on x, as pytorch-tabnet's TabNetPretraining in training mode:
        mask (drawn here unless given) before the initial BN, prior 1 - obf, target the raw x."""
        if obf is None:
            p = torch.full(x.shape, self.cfg.pretraining_ratio)
            obf = torch.bernoulli(p, generator=self.mask_generator)
        steps, _ = self.encoder(self.initial_bn((1.0 - obf) * x), prior=1.0 - obf)
        x_hat = self.reconstruction_layer(self.decoder(steps))
        return unsupervised_loss(x_hat, x, obf, self.cfg.epsilon)

    def latent_and_m_loss(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        steps, m_loss = self.encoder(self.initial_bn(x))
        return torch.stack(steps).sum(dim=0), m_loss

    def finetune_parameters(self) -> list[nn.Parameter]:
        return [*self.initial_bn.parameters(), *self.encoder.parameters()]


class LocalTabNets(_Trainable):
    """LT, the prior-work design: guest k pretrains its own TabNet (latent width m_k from
    :func:`decoder_slices`) on its columns alone; in fine-tuning each guest sends z_k (B, m_k)
    and M_loss_k, and the host trains Linear(n_d, C) on ``concat_k z_k`` with
    ``CE - lambda * sum_k M_loss_k``, gradients flowing back into the guests' encoders. The
    latent is ``concat_k z_k``. With one block holding all columns this is CT."""

    def __init__(
        self,
        guest_dims: Sequence[int],
        n_classes: int,
        cfg: TabNetConfig | None = None,
        *,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.cfg = cfg or TabNetConfig()
        self.guest_dims = tuple(int(d) for d in guest_dims)
        widths = decoder_slices(self.cfg.n_d, len(self.guest_dims))
        self.locals = nn.ModuleList(
            TabNetAutoencoder(
                d,
                _replace_n_d(self.cfg, w),
                init_generator=seeded_generator(seed, "lt", "guest", k, "init"),
                mask_generator=seeded_generator(seed, "lt", "guest", k, "mask"),
            )
            for k, (d, w) in enumerate(zip(self.guest_dims, widths, strict=True))
        )
        self.head = nn.Linear(self.cfg.n_d, n_classes, bias=False)
        init_non_glu(self.head, seeded_generator(seed, "lt", "host", "init"))

    def pretrain_loss(
        self, xs: Sequence[torch.Tensor], obfs: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Sum of the independent local losses (no shared parameter: same gradients, and with
        Adam's per-parameter state the same steps, as separate local optimizers); each guest
        draws its masks unless `obfs` are given."""
        masks = list(obfs) if obfs is not None else [None] * len(self.locals)
        losses = [a.pretrain_loss(x, o) for a, x, o in zip(self.locals, xs, masks, strict=True)]
        return torch.stack(losses).sum()

    def _latent(self, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [a.latent_and_m_loss(x) for a, x in zip(self.locals, xs, strict=True)]
        return torch.cat([z for z, _ in parts], dim=1), torch.stack([m for _, m in parts]).sum()

    def finetune_loss(self, xs: Sequence[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        z, m_loss = self._latent(xs)
        return finetune_objective(self.head(z), y, m_loss, self.cfg.lambda_sparse)

    def logits_batch(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.head(self._latent(xs)[0])

    def encode_batch(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        return self._latent(xs)[0]

    def pretrain_parameters(self) -> list[nn.Parameter]:
        return list(self.locals.parameters())

    def finetune_parameters(self) -> list[nn.Parameter]:
        return [*(p for a in self.locals for p in a.finetune_parameters()), *self.head.parameters()]


def _replace_n_d(cfg: TabNetConfig, n_d: int) -> TabNetConfig:
    return replace(cfg, n_d=n_d)


def central_tabnet(
    d_total: int, n_classes: int, cfg: TabNetConfig | None = None, *, seed: int = 0
) -> LocalTabNets:
    """CT: one TabNet on all D columns (call its methods with a single block, the guests'
    blocks concatenated)."""
    return LocalTabNets([d_total], n_classes, cfg, seed=seed)


# --------------------------------------------------------------------------------------------
# the paper's schedule, in one process (the benchmark's LT and CT)


def _validation_masks(model: _Trainable, rows: int, seed: int) -> list[torch.Tensor]:
    # the same masks every epoch, from a stream of their own: epochs compare like with like
    g = seeded_generator(seed, "valid-masks")
    p = model.cfg.pretraining_ratio
    return [torch.bernoulli(torch.full((rows, d), p), generator=g) for d in model.guest_dims]


def _weighted_f1(logits: torch.Tensor, y: np.ndarray) -> float:
    from sklearn.metrics import f1_score

    pred = logits.argmax(dim=1).numpy()
    return float(f1_score(np.asarray(y), pred, average="weighted", zero_division=0))


def fit_early_stopping(
    model: _Trainable,
    fit: Sequence[np.ndarray],
    y_fit: np.ndarray,
    valid: Sequence[np.ndarray],
    y_valid: np.ndarray,
    *,
    pretrain_epochs: int,
    epochs: int,
    patience: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    restore_best: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Pretraining (at most `pretrain_epochs`, stopped after `patience` epochs without a lower
    validation reconstruction loss, masks fixed across epochs) then fine-tuning (at most
    `epochs`, stopped after `patience` epochs without a higher validation weighted F1), each
    with a fresh Adam, rows in the given order; with `restore_best` the best epoch's weights are
    kept at the end of each phase (pytorch-tabnet's behaviour, which the paper's CT and LT
    pretraining use). ``patience = 0`` trains every epoch and keeps the last weights. Returns
    ``{"pretrain": [(train loss, valid loss)], "finetune": [(train loss, valid F1)],
    "best": {...}}``. Refuses blocks that are not row-aligned or of the wrong widths."""
    _check_blocks(fit, model.guest_dims)
    _check_blocks(valid, model.guest_dims)
    xf = [_as_tensor(x) for x in fit]
    xv = [_as_tensor(x) for x in valid]
    yf = torch.as_tensor(np.asarray(y_fit)).long()
    masks = _validation_masks(model, xv[0].shape[0], seed)
    out: dict[str, Any] = {"pretrain": [], "finetune": [], "best": {}}

    def phase(
        name: str,
        n_epochs: int,
        params: list[nn.Parameter],
        loss_fn: Callable[[list[torch.Tensor], torch.Tensor | None], torch.Tensor],
        score: Callable[[], float],
        higher_is_better: bool,
    ) -> None:
        opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
        best, best_state, bad = None, None, 0
        for epoch in range(n_epochs):
            train_loss = model._epoch(opt, loss_fn, xf, yf, batch_size)
            if patience <= 0:
                out[name].append((train_loss, float("nan")))
                continue
            model.eval()
            with torch.no_grad():
                value = score()
            out[name].append((train_loss, value))
            better = best is None or (value > best if higher_is_better else value < best)
            if better:
                best, bad = value, 0
                best_state = copy.deepcopy(model.state_dict()) if restore_best else None
                out["best"][name] = {"epoch": epoch, "value": value}
            else:
                bad += 1
                if bad >= patience:
                    break
        if best_state is not None:
            model.load_state_dict(best_state)

    phase(
        "pretrain",
        pretrain_epochs,
        model.pretrain_parameters(),
        lambda b, _y: model.pretrain_loss(b),
        lambda: float(model.pretrain_loss(xv, masks)),
        higher_is_better=False,
    )
    phase(
        "finetune",
        epochs,
        model.finetune_parameters(),
        lambda b, yb: model.finetune_loss(b, yb),
        lambda: _weighted_f1(model.logits_batch(xv), y_valid),
        higher_is_better=True,
    )
    model.train()
    return out
