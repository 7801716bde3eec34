"""TabVFL model pieces: TabNet's pretraining autoencoder split U-shape across guests and host.

Paper: Rashad et al., "TabVFL: Improving Latent Representation in Vertical Federated Learning"
(SRDS 2024); spec: shared/methods/tabvfl.md. This module is pure model code (no transport). The
TabNet blocks are written here, not imported from pytorch-tabnet, so that every weight and every
random mask comes from an explicit ``torch.Generator`` and the package does not depend on it; the
submodule and parameter names follow pytorch-tabnet 4.1.0, so its ``TabNetEncoder`` state dict
loads into :class:`PartialEncoder` (minus ``initial_bn``), and tests compare outputs against it.

Parties and parts (M guests, guest k holds ``d_k`` already one-hot/standardised columns,
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
:class:`TabVFLReference` return the tensors actually exchanged, in this order):

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
Table V: 217 per row for Rice, D = 106, n_d = 5); backward ``D + n_d`` floats per row.

Fine-tuning (one batch; labels never leave the host, the host computes the loss):

====  ========  =============  ==========  ===================================================
fwd   h         guest k->host  d_k         FC_k(BN_k(x_k)), no masking
bwd   grad_h    host->guest k  d_k         dL/dh_k, L = CE(head(z), y) - lambda * M_loss
====  ========  =============  ==========  ===================================================

Summed: forward D floats per row, backward D floats per row. Latent extraction ("encode"): the
guests send h_k (eval mode, no mask), D floats per row, nothing comes back to them; z stays at
the host.

Not here: the transport, the host's per-batch cache for offline guests (spec section 3), early
stopping, TabVFL-LE. The single-process :class:`TabVFLReference`, :class:`LocalTabNets` (LT)
and :func:`central_tabnet` (CT) train in fixed row order (no shuffling, as the paper).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

Phase = Literal["pretrain", "finetune", "encode"]


# --------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class TabNetConfig:
    """TabNet hyperparameters shared by TabVFL, LT and CT.

    Defaults are the TabVFL authors' config (n_d 5, n_a 2, 4 steps, gamma 1.5, one shared and
    one independent GLU layer in encoder and decoder, epsilon 1e-9, pretraining ratio 0.5,
    lambda_sparse 1e-4) except ``momentum``: they pass 0.9 to the ghost BNs, which makes
    eval-mode BN follow the last training batch (spec section 2.4 note); this uses
    pytorch-tabnet's default 0.02.
    """

    n_d: int = 5
    n_a: int = 2
    n_steps: int = 4
    gamma: float = 1.5
    n_independent: int = 1
    n_shared: int = 1
    n_independent_decoder: int = 1
    n_shared_decoder: int = 1
    epsilon: float = 1e-9
    virtual_batch_size: int = 128
    momentum: float = 0.02
    mask_type: Literal["sparsemax", "entmax"] = "sparsemax"
    guest_bn_momentum: float = 0.01
    pretraining_ratio: float = 0.5
    lambda_sparse: float = 1e-4

    def __post_init__(self) -> None:
        if self.n_steps <= 0 or self.n_d <= 0 or self.n_a <= 0:
            raise ValueError("n_steps, n_d and n_a must be positive")
        if self.n_independent == 0 and self.n_shared == 0:
            raise ValueError("n_shared and n_independent cannot both be zero")
        if self.n_independent_decoder == 0 and self.n_shared_decoder == 0:
            raise ValueError("n_shared_decoder and n_independent_decoder cannot both be zero")
        if not 0.0 < self.pretraining_ratio < 1.0:
            raise ValueError("pretraining_ratio must be in (0, 1)")
        if self.mask_type not in ("sparsemax", "entmax"):
            raise ValueError(f"mask_type must be 'sparsemax' or 'entmax', got {self.mask_type!r}")


def decoder_slices(n_d: int, n_guests: int) -> tuple[int, ...]:
    """Widths m_k of the guests' slices of the n_d decoder output: ``n_d // M`` each, one more
    for the first ``n_d % M`` guests. Refuses ``n_d < M`` (a guest would get no column)."""
    if n_guests <= 0:
        raise ValueError("need at least one guest")
    if n_d < n_guests:
        raise ValueError(f"n_d={n_d} < number of guests {n_guests}: every guest needs a slice")
    base, extra = divmod(n_d, n_guests)
    return tuple(base + (1 if k < extra else 0) for k in range(n_guests))


def _generator(seed: int, *names: str | int) -> torch.Generator:
    # one independent stream per (seed, role, purpose); kept local so this file has no
    # dependency on the package's other model modules
    digest = hashlib.sha256(repr((seed, *names)).encode()).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return g


# --------------------------------------------------------------------------------------------
# sparse attention maps


class _Sparsemax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, dim: int) -> torch.Tensor:  # type: ignore[override]
        z = z - z.amax(dim=dim, keepdim=True)
        z_sorted = torch.sort(z, dim=dim, descending=True).values
        cumsum = z_sorted.cumsum(dim) - 1.0
        shape = [1] * z.dim()
        shape[dim] = z.shape[dim]
        rank = torch.arange(1, z.shape[dim] + 1, dtype=z.dtype, device=z.device).view(shape)
        support = (rank * z_sorted > cumsum).sum(dim=dim, keepdim=True)
        tau = cumsum.gather(dim, support - 1) / support.to(z.dtype)
        out = torch.clamp(z - tau, min=0.0)
        ctx.dim = dim
        ctx.save_for_backward(out, support)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        out, support = ctx.saved_tensors
        on = out > 0
        g = torch.where(on, grad, torch.zeros_like(grad))
        mean = g.sum(dim=ctx.dim, keepdim=True) / support.to(g.dtype)
        return torch.where(on, g - mean, torch.zeros_like(g)), None


class _Entmax15(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, dim: int) -> torch.Tensor:  # type: ignore[override]
        z = (z - z.amax(dim=dim, keepdim=True)) / 2.0
        z_sorted = torch.sort(z, dim=dim, descending=True).values
        shape = [1] * z.dim()
        shape[dim] = z.shape[dim]
        rank = torch.arange(1, z.shape[dim] + 1, dtype=z.dtype, device=z.device).view(shape)
        mean = z_sorted.cumsum(dim) / rank
        mean_sq = (z_sorted**2).cumsum(dim) / rank
        spread = rank * (mean_sq - mean**2)
        tau = mean - torch.sqrt(torch.clamp((1.0 - spread) / rank, min=0.0))
        support = (tau <= z_sorted).sum(dim=dim, keepdim=True)
        tau_star = tau.gather(dim, support - 1)
        out = torch.clamp(z - tau_star, min=0.0) ** 2
        ctx.dim = dim
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (out,) = ctx.saved_tensors
        root = out.sqrt()
        scaled = grad * root
        q = scaled.sum(dim=ctx.dim, keepdim=True) / root.sum(dim=ctx.dim, keepdim=True)
        return scaled - q * root, None


def sparsemax(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sparsemax (Martins & Astudillo 2016) along `dim`: the Euclidean projection onto the
    simplex; rows sum to 1 with exact zeros. Does not modify `z`."""
    return _Sparsemax.apply(z, dim)


def entmax15(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """1.5-entmax (Peters et al. 2019) along `dim`, exact sort-based threshold; rows sum to 1.
    Does not modify `z`."""
    return _Entmax15.apply(z, dim)


# --------------------------------------------------------------------------------------------
# TabNet blocks


def _init_glu(fc: nn.Linear, generator: torch.Generator) -> None:
    # TabNet's GLU init: xavier normal with gain sqrt((fan_in + fan_out) / sqrt(fan_in))
    fan_out, fan_in = fc.weight.shape
    gain = math.sqrt((fan_in + fan_out) / math.sqrt(fan_in))
    with torch.no_grad():
        nn.init.xavier_normal_(fc.weight, gain=gain, generator=generator)


def _init_non_glu(fc: nn.Linear, generator: torch.Generator) -> None:
    # TabNet's non-GLU init: xavier normal with gain sqrt((fan_in + fan_out) / sqrt(4 fan_in))
    fan_out, fan_in = fc.weight.shape
    gain = math.sqrt((fan_in + fan_out) / math.sqrt(4 * fan_in))
    with torch.no_grad():
        nn.init.xavier_normal_(fc.weight, gain=gain, generator=generator)


class GBN(nn.Module):
    """Ghost batch norm: BatchNorm1d applied to ``ceil(B / virtual_batch_size)`` equal chunks
    (``Tensor.chunk`` sizes, as pytorch-tabnet, not fixed-size pieces)."""

    def __init__(self, dim: int, virtual_batch_size: int = 128, momentum: float = 0.02) -> None:
        super().__init__()
        self.virtual_batch_size = virtual_batch_size
        self.bn = nn.BatchNorm1d(dim, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_chunks = math.ceil(x.shape[0] / self.virtual_batch_size)
        if n_chunks <= 1:
            return self.bn(x)
        return torch.cat([self.bn(part) for part in x.chunk(n_chunks, 0)], dim=0)


class GLULayer(nn.Module):
    """FC (no bias) -> ghost BN -> gated linear unit: ``a * sigmoid(b)`` of the two halves.
    Takes a shared `fc` as is (initialised once by its owner)."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        *,
        fc: nn.Linear | None,
        virtual_batch_size: int,
        momentum: float,
        generator: torch.Generator,
    ) -> None:
        super().__init__()
        self.out_dim = out_dim
        if fc is None:
            fc = nn.Linear(in_dim, 2 * out_dim, bias=False)
            _init_glu(fc, generator)
        self.fc = fc
        self.bn = GBN(2 * out_dim, virtual_batch_size, momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc(x))
        return h[:, : self.out_dim] * torch.sigmoid(h[:, self.out_dim :])


class GLUBlock(nn.Module):
    """GLU layers with scaled residuals ``(x + glu(x)) * sqrt(0.5)``; when `first`, layer 0 has
    no residual (its input width differs)."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        *,
        n_glu: int,
        first: bool,
        shared_fcs: nn.ModuleList | None,
        virtual_batch_size: int,
        momentum: float,
        generator: torch.Generator,
    ) -> None:
        super().__init__()
        self.first = first
        self.glu_layers = nn.ModuleList()
        for i in range(n_glu):
            fc = shared_fcs[i] if shared_fcs is not None else None
            self.glu_layers.append(
                GLULayer(
                    in_dim if i == 0 else out_dim,
                    out_dim,
                    fc=fc,
                    virtual_batch_size=virtual_batch_size,
                    momentum=momentum,
                    generator=generator,
                )
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = math.sqrt(0.5)
        layers = iter(self.glu_layers)
        if self.first:
            x = next(layers)(x)
        for layer in layers:
            x = (x + layer(x)) * scale
        return x


class FeatTransformer(nn.Module):
    """TabNet feature transformer: the step-shared GLU block (whose FCs are `shared_fcs`, the
    same modules at every step) then a step-specific GLU block of `n_independent` layers."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        *,
        shared_fcs: nn.ModuleList | None,
        n_independent: int,
        virtual_batch_size: int,
        momentum: float,
        generator: torch.Generator,
    ) -> None:
        super().__init__()
        common = {
            "virtual_batch_size": virtual_batch_size,
            "momentum": momentum,
            "generator": generator,
        }
        self.shared: nn.Module
        self.specifics: nn.Module
        if shared_fcs is None or len(shared_fcs) == 0:
            self.shared = nn.Identity()
            first = True
        else:
            self.shared = GLUBlock(
                in_dim, out_dim, n_glu=len(shared_fcs), first=True, shared_fcs=shared_fcs, **common
            )
            first = False
        if n_independent == 0:
            self.specifics = nn.Identity()
        else:
            self.specifics = GLUBlock(
                in_dim if first else out_dim,
                out_dim,
                n_glu=n_independent,
                first=first,
                shared_fcs=None,
                **common,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.specifics(self.shared(x))


class AttentiveTransformer(nn.Module):
    """TabNet attentive transformer: ``select(GBN(FC(att)) * prior)``, select = sparsemax or
    1.5-entmax over the D input columns."""

    def __init__(
        self,
        n_a: int,
        attention_dim: int,
        *,
        virtual_batch_size: int,
        momentum: float,
        mask_type: str,
        generator: torch.Generator,
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(n_a, attention_dim, bias=False)
        _init_non_glu(self.fc, generator)
        self.bn = GBN(attention_dim, virtual_batch_size, momentum)
        self.select: Callable[[torch.Tensor], torch.Tensor] = (
            sparsemax if mask_type == "sparsemax" else entmax15
        )

    def forward(self, prior: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        return self.select(self.bn(self.fc(att)) * prior)


def _shared_fcs(
    in_dim: int, out_dim: int, n_shared: int, generator: torch.Generator
) -> nn.ModuleList | None:
    if n_shared == 0:
        return None
    fcs = nn.ModuleList()
    for i in range(n_shared):
        fc = nn.Linear(in_dim if i == 0 else out_dim, 2 * out_dim, bias=False)
        _init_glu(fc, generator)
        fcs.append(fc)
    return fcs


class PartialEncoder(nn.Module):
    """TabNet's encoder without its initial BatchNorm (TabVFL's PartialEnc, at the host).

    ``forward(x, prior)`` promises, for x of shape (B, D): the list of `n_steps` step outputs
    ``ReLU(d_t)`` of shape (B, n_d) and ``M_loss = mean_t mean_b sum_j M log(M + eps)`` (<= 0).
    The latent is ``sum_t steps[t]``. `prior` defaults to ones; in pretraining it is the
    concatenated ``1 - obf`` of the guests. Refuses inputs whose width is not D.
    """

    def __init__(self, input_dim: int, cfg: TabNetConfig, *, generator: torch.Generator) -> None:
        super().__init__()
        self.input_dim = input_dim
        self.n_d = cfg.n_d
        self.n_steps = cfg.n_steps
        self.gamma = cfg.gamma
        self.epsilon = cfg.epsilon
        width = cfg.n_d + cfg.n_a
        shared = _shared_fcs(input_dim, width, cfg.n_shared, generator)
        common = {
            "shared_fcs": shared,
            "n_independent": cfg.n_independent,
            "virtual_batch_size": cfg.virtual_batch_size,
            "momentum": cfg.momentum,
            "generator": generator,
        }
        self.initial_splitter = FeatTransformer(input_dim, width, **common)
        self.feat_transformers = nn.ModuleList()
        self.att_transformers = nn.ModuleList()
        for _ in range(cfg.n_steps):
            self.feat_transformers.append(FeatTransformer(input_dim, width, **common))
            self.att_transformers.append(
                AttentiveTransformer(
                    cfg.n_a,
                    input_dim,
                    virtual_batch_size=cfg.virtual_batch_size,
                    momentum=cfg.momentum,
                    mask_type=cfg.mask_type,
                    generator=generator,
                )
            )

    def forward(
        self, x: torch.Tensor, prior: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        if x.dim() != 2 or x.shape[1] != self.input_dim:
            raise ValueError(f"expected (B, {self.input_dim}) input, got {tuple(x.shape)}")
        if prior is None:
            prior = torch.ones_like(x)
        att = self.initial_splitter(x)[:, self.n_d :]
        m_loss = x.new_zeros(())
        steps: list[torch.Tensor] = []
        for feat, attn in zip(self.feat_transformers, self.att_transformers, strict=True):
            mask = attn(prior, att)
            m_loss = m_loss + torch.mean(torch.sum(mask * torch.log(mask + self.epsilon), dim=1))
            prior = (self.gamma - mask) * prior
            out = feat(mask * x)
            steps.append(F.relu(out[:, : self.n_d]))
            att = out[:, self.n_d :]
        return steps, m_loss / self.n_steps

    def masks(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The per-step attention masks (B, D) for x, with prior ones (for explanations)."""
        prior = torch.ones_like(x)
        att = self.initial_splitter(x)[:, self.n_d :]
        out_masks = []
        for feat, attn in zip(self.feat_transformers, self.att_transformers, strict=True):
            mask = attn(prior, att)
            out_masks.append(mask)
            prior = (self.gamma - mask) * prior
            att = feat(mask * x)[:, self.n_d :]
        return out_masks


class PartialDecoder(nn.Module):
    """TabNet's decoder without the reconstruction FC (TabVFL's PartialDec, at the host):
    ``r = sum_t FeatTransformer_t(steps[t])``, shape (B, n_d). Refuses a step count other
    than n_steps."""

    def __init__(self, cfg: TabNetConfig, *, generator: torch.Generator) -> None:
        super().__init__()
        self.n_steps = cfg.n_steps
        shared = _shared_fcs(cfg.n_d, cfg.n_d, cfg.n_shared_decoder, generator)
        self.feat_transformers = nn.ModuleList(
            FeatTransformer(
                cfg.n_d,
                cfg.n_d,
                shared_fcs=shared,
                n_independent=cfg.n_independent_decoder,
                virtual_batch_size=cfg.virtual_batch_size,
                momentum=cfg.momentum,
                generator=generator,
            )
            for _ in range(cfg.n_steps)
        )

    def forward(self, steps: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(steps) != self.n_steps:
            raise ValueError(f"expected {self.n_steps} step outputs, got {len(steps)}")
        r = self.feat_transformers[0](steps[0])
        for feat, step in zip(self.feat_transformers[1:], steps[1:], strict=True):
            r = r + feat(step)
        return r


def state_from_pytorch_tabnet(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A pytorch-tabnet 4.1.0 ``TabNetEncoder`` / ``TabNetDecoder`` state dict in the layout of
    :class:`PartialEncoder` / :class:`PartialDecoder`: drops ``initial_bn.*`` (at the guests
    here), ``reconstruction_layer.*`` (split across the guests here) and the duplicate
    ``*.shared_layers.*`` entries (the shared FCs are already under ``*.glu_layers.*.fc``)."""
    return {
        k: v
        for k, v in state.items()
        if not k.startswith(("initial_bn.", "reconstruction_layer.")) and ".shared_layers." not in k
    }


# --------------------------------------------------------------------------------------------
# losses


def unsupervised_loss(
    x_hat: torch.Tensor, x: torch.Tensor, obf: torch.Tensor, eps: float = 1e-9
) -> torch.Tensor:
    """TabNet's masked-reconstruction loss (pytorch-tabnet ``UnsupervisedLoss``).

    Squared errors on the obfuscated entries only, each column divided by its batch variance
    (unbiased; a zero-variance column uses its batch mean, or 1 when that is 0 too), summed per
    row, divided by the row's number of obfuscated entries (+eps), averaged over rows. The
    statistics are those of this batch and these columns only: a guest computes it on its own
    raw (unmasked) columns. Refuses batches of fewer than 2 rows (no variance).
    """
    if x.shape[0] < 2:
        raise ValueError("unsupervised_loss needs at least 2 rows")
    err2 = ((x_hat - x) * obf) ** 2
    mean = x.mean(dim=0)
    mean = torch.where(mean == 0, torch.ones_like(mean), mean)
    var = x.std(dim=0) ** 2
    var = torch.where(var == 0, mean, var)
    per_row = (err2 @ (1.0 / var)) / (obf.sum(dim=1) + eps)
    return per_row.mean()


def finetune_objective(
    logits: torch.Tensor, y: torch.Tensor, m_loss: torch.Tensor, lambda_sparse: float
) -> torch.Tensor:
    """Fine-tuning loss ``CE(logits, y) - lambda_sparse * M_loss`` (M_loss <= 0, so this adds
    lambda times the attention entropy: the sparsity regulariser, pytorch-tabnet's sign)."""
    return F.cross_entropy(logits, y.long()) - lambda_sparse * m_loss


# --------------------------------------------------------------------------------------------
# the split: guest and host parts


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
        _init_non_glu(self.fc, init_generator)
        self.rec = nn.Linear(m_k, d_k, bias=False)
        _init_non_glu(self.rec, init_generator)

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
        _init_non_glu(self.head, generator)

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

    def pretrain_loss(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def finetune_loss(self, xs: Sequence[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def encode_batch(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def pretrain_parameters(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def finetune_parameters(self) -> list[nn.Parameter]:
        raise NotImplementedError

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
        history = []
        self.train()
        for _ in range(epochs):
            total, count = 0.0, 0
            for sl in _batches(blocks[0].shape[0], batch_size):
                opt.zero_grad(set_to_none=True)
                loss = loss_fn([b[sl] for b in blocks], None if labels is None else labels[sl])
                loss.backward()
                opt.step()
                total += float(loss.detach()) * (sl.stop - sl.start)
                count += sl.stop - sl.start
            history.append(total / max(count, 1))
        return history

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
                init_generator=_generator(seed, "tabvfl", "guest", k, "init"),
                mask_generator=_generator(seed, "tabvfl", "guest", k, "mask"),
            )
            for k, (d, m) in enumerate(zip(self.guest_dims, slices, strict=True))
        )
        self.host = TabVFLHost(
            self.guest_dims,
            n_classes,
            self.cfg,
            generator=_generator(seed, "tabvfl", "host", "init"),
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


# --------------------------------------------------------------------------------------------
# baselines: LT (local TabNets) and CT (central TabNet)


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
        _init_non_glu(self.reconstruction_layer, init_generator)

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
                init_generator=_generator(seed, "lt", "guest", k, "init"),
                mask_generator=_generator(seed, "lt", "guest", k, "mask"),
            )
            for k, (d, w) in enumerate(zip(self.guest_dims, widths, strict=True))
        )
        self.head = nn.Linear(self.cfg.n_d, n_classes, bias=False)
        _init_non_glu(self.head, _generator(seed, "lt", "host", "init"))

    def pretrain_loss(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Sum of the independent local losses (no shared parameter: same gradients, and with
        Adam's per-parameter state the same steps, as separate local optimizers)."""
        return torch.stack([a.pretrain_loss(x) for a, x in zip(self.locals, xs, strict=True)]).sum()

    def _latent(self, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [a.latent_and_m_loss(x) for a, x in zip(self.locals, xs, strict=True)]
        return torch.cat([z for z, _ in parts], dim=1), torch.stack([m for _, m in parts]).sum()

    def finetune_loss(self, xs: Sequence[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        z, m_loss = self._latent(xs)
        return finetune_objective(self.head(z), y, m_loss, self.cfg.lambda_sparse)

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
# downstream evaluation of a latent (paper section V-B)


def extract_latent(
    model: TabVFLReference | LocalTabNets, xs: Sequence[np.ndarray | torch.Tensor]
) -> np.ndarray:
    """The (N, n_d) latent of all rows for the downstream evaluation (eval mode, no mask)."""
    return model.encode(xs)


PAPER_CLASSIFIERS = ("logistic", "tree", "forest", "mlp", "svm", "xgboost")


def evaluate_latent(
    z: np.ndarray,
    y: np.ndarray,
    *,
    seed: int,
    classifiers: Sequence[str] = ("logistic",),
    test_fraction: float = 0.3,
) -> dict[str, float]:
    """The paper's latent-quality score: stratified 70/30 re-split of (z, y) with
    ``random_state=seed``, each classifier with sklearn defaults and ``random_state=42``, and
    the mean over classifiers of weighted F1, accuracy and ROC-AUC (positive-class for binary,
    weighted one-vs-rest otherwise). "xgboost" is skipped when xgboost is not installed;
    refuses unknown classifier names."""
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, f1_score, roc_auc_score
    from sklearn.model_selection import train_test_split
    from sklearn.neural_network import MLPClassifier
    from sklearn.svm import LinearSVC
    from sklearn.tree import DecisionTreeClassifier

    def make(name: str) -> object | None:
        if name == "logistic":
            return LogisticRegression(random_state=42, max_iter=1000)
        if name == "tree":
            return DecisionTreeClassifier(random_state=42)
        if name == "forest":
            return RandomForestClassifier(random_state=42)
        if name == "mlp":
            return MLPClassifier(random_state=42)
        if name == "svm":
            return CalibratedClassifierCV(LinearSVC(random_state=42), method="sigmoid")
        if name == "xgboost":
            try:
                from xgboost import XGBClassifier
            except ImportError:
                return None
            return XGBClassifier(random_state=42)
        raise ValueError(f"unknown classifier {name!r}; known: {PAPER_CLASSIFIERS}")

    z = np.asarray(z, dtype=np.float64)
    y = np.asarray(y)
    z_tr, z_te, y_tr, y_te = train_test_split(
        z, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    scores: dict[str, list[float]] = {"f1": [], "accuracy": [], "roc_auc": []}
    binary = len(np.unique(y)) == 2
    for name in classifiers:
        clf = make(name)
        if clf is None:
            continue
        clf.fit(z_tr, y_tr)
        pred = clf.predict(z_te)
        proba = clf.predict_proba(z_te)
        scores["f1"].append(float(f1_score(y_te, pred, average="weighted")))
        scores["accuracy"].append(float(accuracy_score(y_te, pred)))
        if binary:
            scores["roc_auc"].append(float(roc_auc_score(y_te, proba[:, 1])))
        else:
            scores["roc_auc"].append(
                float(roc_auc_score(y_te, proba, multi_class="ovr", average="weighted"))
            )
    return {k: float(np.mean(v)) if v else float("nan") for k, v in scores.items()}
