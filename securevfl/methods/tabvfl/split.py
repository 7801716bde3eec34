"""TabVFL's split: the guest and host parts of TabNet's pretraining autoencoder, the guest and
host parts of TabVFL-LE, and exactly what crosses between them.

Parties and parts (M guests, guest k holds ``d_k`` one-hot/standardised columns,
``D = sum_k d_k``, latent width ``n_d``, decoder slices ``m_k`` with ``sum_k m_k = n_d``):

* guest k (:class:`TabVFLGuest`): ``bn`` = BatchNorm1d(d_k, momentum 0.01); ``fc`` = the secret
  privacy layer Linear(d_k, d_k, bias=False) (output width d_k, as the paper and the authors'
  code: the host's attention and prior are per incoming column, so D stays the attention width);
  ``rec`` = its slice of TabNet's reconstruction layer, Linear(m_k, d_k, bias=False); and the
  pretraining obfuscator. **The guest draws its own mask** ``obf_k ~ Bernoulli(p)^(B x d_k)``
  from its own generator, masks its columns ``(1 - obf_k) * x_k`` before BN+FC, keeps ``obf_k``
  for its loss and sends ``prior_k = 1 - obf_k`` to the host (the host never draws masks: it
  must use the guest's, which stay paired with the guest's h_k, spec section 2.1).
* host (:class:`TabVFLHost`): ``encoder`` = :class:`PartialEncoder`, TabNet's encoder without
  the initial BN, over ``H = concat_k h_k`` of width D; ``decoder`` = :class:`PartialDecoder`,
  TabNet's decoder without the reconstruction FC, output r of width n_d, split by
  :func:`decoder_slices` into ``r_k`` of width m_k; ``head`` = Linear(n_d, C, bias=False).

What crosses guest <-> host, per batch of B rows (widths per row; :func:`crossing_spec` returns
this table, :func:`crossing_floats` counts it, and the ``*_step_split`` methods of
:class:`~securevfl.methods.tabvfl.reference.TabVFLReference` return the tensors actually
exchanged, in this order; the federated method sends the same tensors as float32):

Pretraining (one batch):

====  ========  =============  ==========  ===================================================
pass  name      direction      width       what
====  ========  =============  ==========  ===================================================
fwd   h         guest k->host  d_k         FC_k(BN_k((1 - obf_k) * x_k)), float
fwd   prior     guest k->host  d_k         1 - obf_k, binary (the mask; sent as floats here)
fwd   r         host->guest k  m_k         guest k's slice of PartialDec output
fwd   loss      guest k->host  1 per batch L_k, the guest's reconstruction loss (scalar)
bwd   grad_r    guest k->host  m_k         dL/dr_k (L = sum_k L_k, so dL/dr_k = dL_k/dr_k)
bwd   grad_h    host->guest k  d_k         dL/dh_k
====  ========  =============  ==========  ===================================================

Summed over guests: forward ``2D + n_d`` floats per row plus M scalars per batch (the paper's
Table V: 217 per row for Rice, D = 106, n_d = 5); backward ``D + n_d`` floats per row. What a
guest *sends* per row is ``2 d_k + m_k`` (h, prior, grad_r), so all guests send ``2D + n_d``.

Fine-tuning (one batch; labels never leave the host, the host computes the loss):

====  ========  =============  ==========  ===================================================
fwd   h         guest k->host  d_k         FC_k(BN_k(x_k)), no masking
bwd   grad_h    host->guest k  d_k         dL/dh_k, L = CE(head(z), y) - lambda * M_loss
====  ========  =============  ==========  ===================================================

Summed: forward D floats per row, backward D floats per row. Latent extraction ("encode"): the
guests send h_k (eval mode, no mask), D floats per row, nothing comes back to them; z stays at
the host.

TabVFL-LE (:class:`LEGuest`, :class:`LEHost`): every guest holds a complete TabNet encoder
(initial BN, all steps, width n_d) and no privacy FC; the host holds only PartialDec and the
head. Guests send their n_steps step outputs, which the host needs only summed step by step
over the guests (so they go through a secure sum); the host broadcasts r (B, n_d) and receives
the sum of the guests' dL_k/dr. Unlike the paper, which cuts r into slices m_k, guest k
reconstructs its columns from all of r (``Linear(n_d, d_k)``, its rows of TabNet's
reconstruction layer): with disjoint slices the "sum" of the gradients would be their
concatenation, each guest's part readable from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from securevfl.methods.tabvfl.tabnet import (
    PartialDecoder,
    PartialEncoder,
    TabNetConfig,
    decoder_slices,
    init_non_glu,
    unsupervised_loss,
    unsupervised_loss_rows,
)

Phase = Literal["pretrain", "finetune", "encode"]


class TabVFLGuest(nn.Module):
    """Guest k's bottom model: BN_k -> privacy FC_k (d_k -> d_k), the reconstruction slice
    Rec_k (m_k -> d_k) and the obfuscator.

    Weights come from `init_generator`; masks from `mask_generator`, which the guest owns and
    nobody else draws from. Refuses inputs whose width is not d_k.
    """

    def __init__(
        self,
        d_k: int,
        m_k: int,
        cfg: TabNetConfig,
        *,
        init_generator: torch.Generator,
        mask_generator: torch.Generator,
    ) -> None:
        super().__init__()
        if d_k <= 0 or m_k <= 0:
            raise ValueError(f"guest needs d_k > 0 and m_k > 0, got {d_k}, {m_k}")
        self.d_k = d_k
        self.m_k = m_k
        self.pretraining_ratio = cfg.pretraining_ratio
        self.epsilon = cfg.epsilon
        self.mask_generator = mask_generator
        self.bn = nn.BatchNorm1d(d_k, momentum=cfg.guest_bn_momentum)
        self.fc = nn.Linear(d_k, d_k, bias=False)
        init_non_glu(self.fc, init_generator)
        self.rec = nn.Linear(m_k, d_k, bias=False)
        init_non_glu(self.rec, init_generator)

    def _check(self, x: torch.Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.d_k:
            raise ValueError(f"guest expects (B, {self.d_k}) input, got {tuple(x.shape)}")

    def obfuscation_mask(self, rows: int) -> torch.Tensor:
        """A fresh mask obf (rows, d_k): 1 = hidden, i.i.d. Bernoulli(pretraining_ratio)."""
        p = torch.full((rows, self.d_k), self.pretraining_ratio)
        return torch.bernoulli(p, generator=self.mask_generator)

    def embed(self, x: torch.Tensor, obf: torch.Tensor | None = None) -> torch.Tensor:
        """h_k = FC_k(BN_k(x_k)), or of ``(1 - obf) * x_k`` when a mask is given: what the
        guest sends the host."""
        self._check(x)
        if obf is not None:
            x = (1.0 - obf) * x
        return self.fc(self.bn(x))

    def pretrain_send(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draws the mask and returns (h_k, prior_k, obf_k); h_k and prior_k go to the host,
        obf_k stays here for the loss."""
        obf = self.obfuscation_mask(x.shape[0])
        return self.embed(x, obf), 1.0 - obf, obf

    def reconstruct(self, r_k: torch.Tensor) -> torch.Tensor:
        """x_hat_k = Rec_k(r_k), shape (B, d_k)."""
        return self.rec(r_k)

    def reconstruction_loss(
        self, r_k: torch.Tensor, x: torch.Tensor, obf: torch.Tensor
    ) -> torch.Tensor:
        """L_k: TabNet's unsupervised loss of Rec_k(r_k) against the unmasked x_k on the
        entries hidden by obf."""
        self._check(x)
        return unsupervised_loss(self.reconstruct(r_k), x, obf, self.epsilon)

    def finetune_parameters(self) -> list[nn.Parameter]:
        """BN_k and FC_k (Rec_k is pretraining-only)."""
        return [*self.bn.parameters(), *self.fc.parameters()]


class TabVFLHost(nn.Module):
    """The host's top model: PartialEnc over D = sum d_k columns, PartialDec, and the
    fine-tuning head Linear(n_d, n_classes). Refuses guest inputs of the wrong widths."""

    def __init__(
        self,
        guest_dims: Sequence[int],
        n_classes: int,
        cfg: TabNetConfig,
        *,
        generator: torch.Generator,
    ) -> None:
        super().__init__()
        self.guest_dims = tuple(int(d) for d in guest_dims)
        self.slices = decoder_slices(cfg.n_d, len(self.guest_dims))
        self.n_d = cfg.n_d
        self.encoder = PartialEncoder(sum(self.guest_dims), cfg, generator=generator)
        self.decoder = PartialDecoder(cfg, generator=generator)
        self.head = nn.Linear(cfg.n_d, n_classes, bias=False)
        init_non_glu(self.head, generator)

    def _concat(self, parts: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        widths = tuple(p.shape[1] for p in parts)
        if widths != self.guest_dims:
            raise ValueError(f"{what} widths {widths} != guest widths {self.guest_dims}")
        return torch.cat(list(parts), dim=1)

    def pretrain_forward(
        self, hs: Sequence[torch.Tensor], priors: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Decoder slices r_k (B, m_k), one per guest, from the guests' h_k and prior_k."""
        steps, _ = self.encoder(self._concat(hs, "h"), self._concat(priors, "prior"))
        return list(torch.split(self.decoder(steps), self.slices, dim=1))

    def latent_and_m_loss(self, hs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The joint latent z = sum_t steps_t (B, n_d) and M_loss, prior ones (no masking)."""
        steps, m_loss = self.encoder(self._concat(hs, "h"))
        return torch.stack(steps).sum(dim=0), m_loss

    def finetune_forward(self, hs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (B, C), M_loss)."""
        z, m_loss = self.latent_and_m_loss(hs)
        return self.head(z), m_loss

    def pretrain_parameters(self) -> list[nn.Parameter]:
        return [*self.encoder.parameters(), *self.decoder.parameters()]

    def finetune_parameters(self) -> list[nn.Parameter]:
        return [*self.encoder.parameters(), *self.head.parameters()]


# --------------------------------------------------------------------------------------------
# what crosses


@dataclass(frozen=True)
class Crossing:
    """One message of one batch: `width` floats per row plus `per_batch` scalars."""

    phase: Phase
    direction: Literal["forward", "backward"]
    name: str
    sender: str  # "guest" or "host"
    receiver: str
    guest: int
    width: int
    per_batch: int = 0


def crossing_spec(phase: Phase, guest_dims: Sequence[int], n_d: int) -> list[Crossing]:
    """The guest<->host messages of one batch in `phase` (see the module docstring), in the
    order they are sent: forward h (and prior) of every guest, r to every guest, the losses,
    then backward grad_r and grad_h. Refuses an unknown phase."""
    dims = [int(d) for d in guest_dims]
    slices = decoder_slices(n_d, len(dims))
    out: list[Crossing] = []
    if phase == "pretrain":
        for k, d in enumerate(dims):
            out.append(Crossing(phase, "forward", "h", "guest", "host", k, d))
            out.append(Crossing(phase, "forward", "prior", "guest", "host", k, d))
        out += [
            Crossing(phase, "forward", "r", "host", "guest", k, m) for k, m in enumerate(slices)
        ]
        out += [
            Crossing(phase, "forward", "loss", "guest", "host", k, 0, 1) for k in range(len(dims))
        ]
        out += [
            Crossing(phase, "backward", "grad_r", "guest", "host", k, m)
            for k, m in enumerate(slices)
        ]
        out += [
            Crossing(phase, "backward", "grad_h", "host", "guest", k, d) for k, d in enumerate(dims)
        ]
    elif phase == "finetune":
        out += [Crossing(phase, "forward", "h", "guest", "host", k, d) for k, d in enumerate(dims)]
        out += [
            Crossing(phase, "backward", "grad_h", "host", "guest", k, d) for k, d in enumerate(dims)
        ]
    elif phase == "encode":
        out += [Crossing(phase, "forward", "h", "guest", "host", k, d) for k, d in enumerate(dims)]
    else:
        raise ValueError(f"unknown phase {phase!r}")
    return out


def crossing_floats(spec: Sequence[Crossing], rows: int, direction: str | None = None) -> int:
    """Floats crossing for a batch of `rows` rows (optionally one direction only)."""
    return sum(
        c.width * rows + c.per_batch for c in spec if direction is None or c.direction == direction
    )


@dataclass
class Message:
    """A tensor that crossed guest<->host in a ``*_step_split`` call (detached copy)."""

    phase: Phase
    direction: Literal["forward", "backward"]
    name: str
    sender: str
    receiver: str
    guest: int
    tensor: torch.Tensor


# --------------------------------------------------------------------------------------------
# TabVFL-LE: guest-side encoders, step outputs summed at the host


class LEGuest(nn.Module):
    """Guest k of TabVFL-LE: a complete TabNet encoder on its columns (initial BN + every step,
    latent width n_d), its obfuscator, and its rows of TabNet's reconstruction layer,
    Linear(n_d, d_k), applied to the whole decoder output r. Refuses inputs of the wrong width.
    """

    def __init__(
        self,
        d_k: int,
        cfg: TabNetConfig,
        *,
        init_generator: torch.Generator,
        mask_generator: torch.Generator,
    ) -> None:
        super().__init__()
        if d_k <= 0:
            raise ValueError(f"guest needs d_k > 0, got {d_k}")
        self.d_k = d_k
        self.cfg = cfg
        self.mask_generator = mask_generator
        self.initial_bn = nn.BatchNorm1d(d_k, momentum=cfg.guest_bn_momentum)
        self.encoder = PartialEncoder(d_k, cfg, generator=init_generator)
        self.rec = nn.Linear(cfg.n_d, d_k, bias=False)
        init_non_glu(self.rec, init_generator)

    def _check(self, x: torch.Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.d_k:
            raise ValueError(f"guest expects (B, {self.d_k}) input, got {tuple(x.shape)}")

    def obfuscation_mask(self, rows: int) -> torch.Tensor:
        """A fresh mask obf (rows, d_k): 1 = hidden, i.i.d. Bernoulli(pretraining_ratio)."""
        p = torch.full((rows, self.d_k), self.cfg.pretraining_ratio)
        return torch.bernoulli(p, generator=self.mask_generator)

    def pretrain_steps(self, x: torch.Tensor, obf: torch.Tensor) -> torch.Tensor:
        """The step outputs of the masked input, concatenated: (B, n_steps * n_d). The mask
        stays here: it is this guest's own encoder's prior."""
        self._check(x)
        steps, _ = self.encoder(self.initial_bn((1.0 - obf) * x), prior=1.0 - obf)
        return torch.cat(steps, dim=1)

    def latent_and_m_loss(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z_k = sum_t steps_t (B, n_d) and this encoder's M_loss (no masking)."""
        self._check(x)
        steps, m_loss = self.encoder(self.initial_bn(x))
        return torch.stack(steps).sum(dim=0), m_loss

    def reconstruction_rows(
        self, r: torch.Tensor, x: torch.Tensor, obf: torch.Tensor
    ) -> torch.Tensor:
        """Per-row terms of L_k = UnsupervisedLoss(Rec_k(r), x_k, obf_k) (their mean is L_k)."""
        self._check(x)
        return unsupervised_loss_rows(self.rec(r), x, obf, self.cfg.epsilon)

    def finetune_parameters(self) -> list[nn.Parameter]:
        """Initial BN and encoder (Rec_k is pretraining-only)."""
        return [*self.initial_bn.parameters(), *self.encoder.parameters()]


class LEHost(nn.Module):
    """The host of TabVFL-LE: PartialDec over the summed step outputs and the head
    Linear(n_d, C) over the summed latents."""

    def __init__(self, n_classes: int, cfg: TabNetConfig, *, generator: torch.Generator) -> None:
        super().__init__()
        self.n_steps = cfg.n_steps
        self.n_d = cfg.n_d
        self.decoder = PartialDecoder(cfg, generator=generator)
        self.head = nn.Linear(cfg.n_d, n_classes, bias=False)
        init_non_glu(self.head, generator)

    def decode(self, summed_steps: torch.Tensor) -> torch.Tensor:
        """r (B, n_d) from the step-wise sums, given as (B, n_steps * n_d)."""
        if summed_steps.dim() != 2 or summed_steps.shape[1] != self.n_steps * self.n_d:
            raise ValueError(
                f"expected (B, {self.n_steps * self.n_d}) summed steps, got "
                f"{tuple(summed_steps.shape)}"
            )
        return self.decoder(list(torch.split(summed_steps, self.n_d, dim=1)))
