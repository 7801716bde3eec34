"""TabNet's building blocks, as TabVFL splits them: the encoder without its initial batch norm
(PartialEnc, at the host), the decoder without its reconstruction layer (PartialDec, at the
host), and TabNet's two losses.

Paper: Rashad et al., "TabVFL: Improving Latent Representation in Vertical Federated Learning"
(SRDS 2024); spec: shared/methods/tabvfl.md. The blocks are written here, not imported from
pytorch-tabnet, so that every weight comes from an explicit ``torch.Generator`` and the package
does not depend on it; submodule and parameter names follow pytorch-tabnet 4.1.0, so its
``TabNetEncoder`` state dict loads into :class:`PartialEncoder` (minus ``initial_bn``), and the
tests compare outputs and gradients against it. Model code: imported by the method's stages
inside their functions, never at registry time.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from securevfl.methods.tabvfl.sparse import entmax15, sparsemax

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


def seeded_generator(seed: int, *names: str | int) -> torch.Generator:
    # one independent stream per (seed, role, purpose); kept local so this file has no
    # dependency on the package's other model modules
    digest = hashlib.sha256(repr((seed, *names)).encode()).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return g


# --------------------------------------------------------------------------------------------
# TabNet blocks


def init_glu(fc: nn.Linear, generator: torch.Generator) -> None:
    # TabNet's GLU init: xavier normal with gain sqrt((fan_in + fan_out) / sqrt(fan_in))
    fan_out, fan_in = fc.weight.shape
    gain = math.sqrt((fan_in + fan_out) / math.sqrt(fan_in))
    with torch.no_grad():
        nn.init.xavier_normal_(fc.weight, gain=gain, generator=generator)


def init_non_glu(fc: nn.Linear, generator: torch.Generator) -> None:
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
            init_glu(fc, generator)
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
        init_non_glu(self.fc, generator)
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
        init_glu(fc, generator)
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


def unsupervised_loss_rows(
    x_hat: torch.Tensor, x: torch.Tensor, obf: torch.Tensor, eps: float = 1e-9
) -> torch.Tensor:
    """The per-row terms of :func:`unsupervised_loss` (shape (B,), their mean is the loss):
    squared errors on the obfuscated entries only, each column divided by its batch variance
    (unbiased; a zero-variance column uses its batch mean, or 1 when that is 0 too), summed per
    row, divided by the row's number of obfuscated entries (+eps). The statistics are those of
    this batch and these columns only: a guest computes it on its own raw (unmasked) columns.
    Refuses batches of fewer than 2 rows (no variance)."""
    if x.shape[0] < 2:
        raise ValueError("unsupervised_loss needs at least 2 rows")
    err2 = ((x_hat - x) * obf) ** 2
    mean = x.mean(dim=0)
    mean = torch.where(mean == 0, torch.ones_like(mean), mean)
    var = x.std(dim=0) ** 2
    var = torch.where(var == 0, mean, var)
    return (err2 @ (1.0 / var)) / (obf.sum(dim=1) + eps)


def unsupervised_loss(
    x_hat: torch.Tensor, x: torch.Tensor, obf: torch.Tensor, eps: float = 1e-9
) -> torch.Tensor:
    """TabNet's masked-reconstruction loss (pytorch-tabnet ``UnsupervisedLoss``): the mean over
    rows of :func:`unsupervised_loss_rows`. Refuses batches of fewer than 2 rows."""
    return unsupervised_loss_rows(x_hat, x, obf, eps).mean()


def finetune_objective(
    logits: torch.Tensor, y: torch.Tensor, m_loss: torch.Tensor, lambda_sparse: float
) -> torch.Tensor:
    """Fine-tuning loss ``CE(logits, y) - lambda_sparse * M_loss`` (M_loss <= 0, so this adds
    lambda times the attention entropy: the sparsity regulariser, pytorch-tabnet's sign)."""
    return F.cross_entropy(logits, y.long()) - lambda_sparse * m_loss
