"""TabVFL in one process: the reference the federated method is checked against, and the
single-process training loops shared with the LT and CT baselines.

:class:`TabVFLReference` holds every guest and the host in one module. A batch runs either as
one autograd graph (``pretrain_loss`` / ``finetune_loss``) or as the split protocol
(``pretrain_step_split`` / ``finetune_step_split``), each party on detached copies of what it
received, returning the messages that crossed; both leave identical gradients (tests check
it). :func:`~securevfl.methods.tabvfl.baselines.fit_early_stopping` runs the paper's schedule on
any of these models. Rows are visited in the order given (no shuffling between
epochs, as the paper).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from securevfl.methods.tabvfl.split import Message, Phase, TabVFLGuest, TabVFLHost
from securevfl.methods.tabvfl.tabnet import (
    TabNetConfig,
    decoder_slices,
    finetune_objective,
    seeded_generator,
)

# --------------------------------------------------------------------------------------------
# single-process training utilities


def _as_tensor(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).float()


def _batches(n_rows: int, batch_size: int) -> Iterator[slice]:
    # fixed row order (the paper disables shuffling); BN cannot train on a 1-row batch
    for start in range(0, n_rows, batch_size):
        stop = min(start + batch_size, n_rows)
        if stop - start >= 2:
            yield slice(start, stop)


def _check_blocks(xs: Sequence[np.ndarray | torch.Tensor], dims: Sequence[int]) -> None:
    if len(xs) != len(dims):
        raise ValueError(f"expected {len(dims)} guest blocks, got {len(xs)}")
    rows = {int(x.shape[0]) for x in xs}
    if len(rows) != 1:
        raise ValueError(f"guest blocks are not row-aligned: row counts {sorted(rows)}")
    for k, (x, d) in enumerate(zip(xs, dims, strict=True)):
        if x.shape[1] != d:
            raise ValueError(f"guest {k} block has {x.shape[1]} columns, expected {d}")


class _Trainable(nn.Module):
    """Shared single-process loops over row-aligned per-guest blocks, fixed order."""

    guest_dims: tuple[int, ...]
    cfg: TabNetConfig

    def pretrain_loss(
        self, xs: Sequence[torch.Tensor], obfs: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def finetune_loss(self, xs: Sequence[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def logits_batch(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def encode_batch(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def pretrain_parameters(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def finetune_parameters(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def _epoch(
        self,
        opt: torch.optim.Optimizer,
        loss_fn: Callable[[list[torch.Tensor], torch.Tensor | None], torch.Tensor],
        blocks: Sequence[torch.Tensor],
        labels: torch.Tensor | None,
        batch_size: int,
    ) -> float:
        """One pass in the given row order; returns the row-weighted mean training loss."""
        self.train()
        total, count = 0.0, 0
        for sl in _batches(blocks[0].shape[0], batch_size):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn([b[sl] for b in blocks], None if labels is None else labels[sl])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * (sl.stop - sl.start)
            count += sl.stop - sl.start
        return total / max(count, 1)

    def _fit(
        self,
        loss_fn: Callable[[list[torch.Tensor], torch.Tensor | None], torch.Tensor],
        params: list[nn.Parameter],
        xs: Sequence[np.ndarray | torch.Tensor],
        y: np.ndarray | torch.Tensor | None,
        epochs: int,
        batch_size: int,
        lr: float,
        weight_decay: float,
    ) -> list[float]:
        _check_blocks(xs, self.guest_dims)
        blocks = [_as_tensor(x) for x in xs]
        labels = None if y is None else torch.as_tensor(np.asarray(y)).long()
        opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
        return [self._epoch(opt, loss_fn, blocks, labels, batch_size) for _ in range(epochs)]

    def fit_pretrain(
        self,
        xs: Sequence[np.ndarray | torch.Tensor],
        *,
        epochs: int,
        batch_size: int = 64,
        lr: float = 2e-2,
        weight_decay: float = 1e-4,
    ) -> list[float]:
        """Pretrains with a fresh Adam over the pretraining parameters, fixed row order; returns
        the row-weighted mean training loss of each epoch. lr defaults to pytorch-tabnet's 2e-2
        (the authors' 1e-3 needs the paper's 300 epochs of 35K rows; spec section 8.2)."""
        return self._fit(
            lambda b, _y: self.pretrain_loss(b),
            self.pretrain_parameters(),
            xs,
            None,
            epochs,
            batch_size,
            lr,
            weight_decay,
        )

    def fit_finetune(
        self,
        xs: Sequence[np.ndarray | torch.Tensor],
        y: np.ndarray | torch.Tensor,
        *,
        epochs: int,
        batch_size: int = 64,
        lr: float = 2e-2,
        weight_decay: float = 1e-4,
    ) -> list[float]:
        """Fine-tunes with a fresh Adam over the fine-tuning parameters (CE - lambda M_loss);
        returns the per-epoch mean training loss. Labels must be 0..C-1."""
        return self._fit(
            lambda b, yb: self.finetune_loss(b, yb),
            self.finetune_parameters(),
            xs,
            y,
            epochs,
            batch_size,
            lr,
            weight_decay,
        )

    @torch.no_grad()
    def encode(
        self, xs: Sequence[np.ndarray | torch.Tensor], *, batch_size: int = 4096
    ) -> np.ndarray:
        """The latent (N, n_d) in eval mode (running BN statistics, no masking), as float32
        numpy; restores the previous train/eval mode."""
        _check_blocks(xs, self.guest_dims)
        blocks = [_as_tensor(x) for x in xs]
        was_training = self.training
        self.eval()
        try:
            n = blocks[0].shape[0]
            parts = [
                self.encode_batch([b[i : i + batch_size] for b in blocks])
                for i in range(0, n, batch_size)
            ]
        finally:
            self.train(was_training)
        return torch.cat(parts).numpy() if parts else np.zeros((0, self.cfg.n_d), np.float32)


# --------------------------------------------------------------------------------------------
# TabVFL, single process


class TabVFLReference(_Trainable):
    """Guests + host of TabVFL on one machine.

    Two ways to run a batch: ``pretrain_loss`` / ``finetune_loss`` build one autograd graph
    (the unsplit computation), and ``pretrain_step_split`` / ``finetune_step_split`` run the
    split protocol, each party on detached copies of what it received, returning the messages
    (:class:`Message`) in :func:`crossing_spec` order; both leave identical ``.grad``s.
    Seeds: guest k's weights and masks, and the host's weights, each from their own generator
    derived from `seed`.
    """

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
        if n_classes < 2:
            raise ValueError("n_classes must be >= 2")
        slices = decoder_slices(self.cfg.n_d, len(self.guest_dims))
        self.guests = nn.ModuleList(
            TabVFLGuest(
                d,
                m,
                self.cfg,
                init_generator=seeded_generator(seed, "tabvfl", "guest", k, "init"),
                mask_generator=seeded_generator(seed, "tabvfl", "guest", k, "mask"),
            )
            for k, (d, m) in enumerate(zip(self.guest_dims, slices, strict=True))
        )
        self.host = TabVFLHost(
            self.guest_dims,
            n_classes,
            self.cfg,
            generator=seeded_generator(seed, "tabvfl", "host", "init"),
        )

    # -- unsplit (one graph)

    def pretrain_loss(
        self, xs: Sequence[torch.Tensor], obfs: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """L = sum_k L_k for one batch in one graph; the guests draw masks unless `obfs`, in
        eval mode too (the authors' validation loss is masked; pytorch-tabnet's is not)."""
        if obfs is None:
            obfs = [g.obfuscation_mask(x.shape[0]) for g, x in zip(self.guests, xs, strict=True)]
        hs = [g.embed(x, o) for g, x, o in zip(self.guests, xs, obfs, strict=True)]
        rs = self.host.pretrain_forward(hs, [1.0 - o for o in obfs])
        losses = [
            g.reconstruction_loss(r, x, o)
            for g, r, x, o in zip(self.guests, rs, xs, obfs, strict=True)
        ]
        return torch.stack(losses).sum()

    def finetune_loss(self, xs: Sequence[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        """CE(head(z), y) - lambda_sparse * M_loss for one batch in one graph."""
        logits, m_loss = self.host.finetune_forward(
            [g.embed(x) for g, x in zip(self.guests, xs, strict=True)]
        )
        return finetune_objective(logits, y, m_loss, self.cfg.lambda_sparse)

    def logits_batch(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        logits, _ = self.host.finetune_forward(
            [g.embed(x) for g, x in zip(self.guests, xs, strict=True)]
        )
        return logits

    def encode_batch(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        z, _ = self.host.latent_and_m_loss(
            [g.embed(x) for g, x in zip(self.guests, xs, strict=True)]
        )
        return z

    def pretrain_parameters(self) -> list[nn.Parameter]:
        """Guests' BN, FC, Rec; host's PartialEnc and PartialDec (not the head)."""
        return [*(p for g in self.guests for p in g.parameters()), *self.host.pretrain_parameters()]

    def finetune_parameters(self) -> list[nn.Parameter]:
        """Guests' BN and FC; host's PartialEnc and head (not Rec, not PartialDec)."""
        return [
            *(p for g in self.guests for p in g.finetune_parameters()),
            *self.host.finetune_parameters(),
        ]

    # -- split protocol (what the federation does), no optimizer step

    def pretrain_step_split(
        self, xs: Sequence[torch.Tensor], obfs: Sequence[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, list[Message]]:
        """One pretraining batch as message passing: forward and backward, gradients left in
        ``.grad`` (accumulated, as ``backward``). Returns (L = sum_k L_k, messages)."""
        ph: Phase = "pretrain"
        log: list[Message] = []
        m = len(self.guests)
        # guests: mask, embed, send h and prior
        if obfs is None:
            sent = [g.pretrain_send(x) for g, x in zip(self.guests, xs, strict=True)]
        else:
            sent = [
                (g.embed(x, o), 1.0 - o, o) for g, x, o in zip(self.guests, xs, obfs, strict=True)
            ]
        for k, (h, prior, _) in enumerate(sent):
            log.append(Message(ph, "forward", "h", "guest", "host", k, h.detach().clone()))
            log.append(Message(ph, "forward", "prior", "guest", "host", k, prior.detach().clone()))
        # host: what it received has no graph behind it
        h_in = [h.detach().clone().requires_grad_(True) for h, _, _ in sent]
        rs = self.host.pretrain_forward(h_in, [p.detach().clone() for _, p, _ in sent])
        for k, r in enumerate(rs):
            log.append(Message(ph, "forward", "r", "host", "guest", k, r.detach().clone()))
        # guests: reconstruct, loss, local backward into Rec_k and r_k
        r_in = [r.detach().clone().requires_grad_(True) for r in rs]
        losses = []
        for k in range(m):
            loss_k = self.guests[k].reconstruction_loss(r_in[k], xs[k], sent[k][2])
            loss_k.backward()
            losses.append(loss_k.detach())
        for k in range(m):
            log.append(Message(ph, "forward", "loss", "guest", "host", k, losses[k].clone()))
        grad_r = [r.grad.detach().clone() for r in r_in]  # type: ignore[union-attr]
        for k in range(m):
            log.append(Message(ph, "backward", "grad_r", "guest", "host", k, grad_r[k]))
        # host: backward through PartialDec and PartialEnc
        torch.autograd.backward(rs, grad_r)
        grad_h = [h.grad.detach().clone() for h in h_in]  # type: ignore[union-attr]
        for k in range(m):
            log.append(Message(ph, "backward", "grad_h", "host", "guest", k, grad_h[k]))
        # guests: backward through FC_k and BN_k
        for (h, _, _), g in zip(sent, grad_h, strict=True):
            h.backward(g)
        return torch.stack(losses).sum(), log

    def finetune_step_split(
        self, xs: Sequence[torch.Tensor], y: torch.Tensor
    ) -> tuple[torch.Tensor, list[Message]]:
        """One fine-tuning batch as message passing; gradients left in ``.grad``. Returns
        (loss, messages)."""
        ph: Phase = "finetune"
        log: list[Message] = []
        hs = [g.embed(x) for g, x in zip(self.guests, xs, strict=True)]
        for k, h in enumerate(hs):
            log.append(Message(ph, "forward", "h", "guest", "host", k, h.detach().clone()))
        h_in = [h.detach().clone().requires_grad_(True) for h in hs]
        logits, m_loss = self.host.finetune_forward(h_in)
        loss = finetune_objective(logits, y, m_loss, self.cfg.lambda_sparse)
        loss.backward()
        for k, h in enumerate(h_in):
            g = h.grad.detach().clone()  # type: ignore[union-attr]
            log.append(Message(ph, "backward", "grad_h", "host", "guest", k, g))
            hs[k].backward(g)
        return loss.detach(), log
