"""FALSE-VFL (Hong, Park & Hwang, arXiv 2505.11035): the model and its math, cut along the
secure-sum boundary. Imported only inside functions (it imports torch at import time).

The model is a two-layer hierarchical VAE ``z -> h -> x^k`` (one Gaussian decoder per party) with a
discriminator ``y | h``; FALSE-VFL-II adds a per-party self-masking Bernoulli model
``p(m^k = 1 | x^k)``.

* `FalseVFLParty` (one per party k) sees only its block ``x^k`` and its presence mask. Every tensor
  it computes for the other side is a *contribution to a sum over parties* (rows it lacks
  contribute exactly 0, or, for FALSE-VFL-II, the mask log-likelihood of a decoder sample).
* `FalseVFLActive` (labels, global encoder ``q(z|h)``, global decoder ``p(h|z)``, discriminator
  ``p(y|h)``) only ever reads those sums.
* `securevfl.methods.false_vfl.reference` runs both in one process with an in-memory sum; the
  federated stages are `party.py` and `active.py`.

What crosses the boundary, per row i of a batch (S = kappa in training, L at prediction):

round 1, summed over parties (the posterior); a_k = 1 if party k holds row i:
    "poe" (default):  "prec_mu" [d_h] = sum_k a_k exp(-logvar_k) mu_k,  "prec" [d_h] = sum_k a_k
                      exp(-logvar_k)
    "mean" (Eq. 1):   "mu" [d_h] = sum_k a_k mu_k,  "prec"
    (and "count" [] = sum_k a_k, which the federation does not sum: the active party knows it)
active -> parties: h [S, d_h] (the same tensor for every party)
round 2, summed over parties:
    "loglik" [S] = sum_k c_k(h_j),  with c_k = a_k log p(x^k | h_j)
        + (FALSE-VFL-II only) a_k log Bern(0; psi_k(x^k)) + (1 - a_k) log Bern(1; psi_k(x_hat_j^k)),
        x_hat_j^k ~ p(x^k | h_j) reparameterised
    "dloglik_dh" [S, d_h] = sum_k d c_k(h_j) / d h_j       (stage 1 only)
backward, active -> parties (stage 1 only): d loss / d each summed tensor.

Posterior aggregation. "poe" is the product of Gaussian experts with the prior N(0, I) as one
more expert: precision ``P = 1 + sum_k P_k``, mean ``P^{-1} sum_k P_k mu_k``. "mean" is the
paper's Eq. (1) as written: the plain average of the observed parties' means with the summed
precisions and no prior expert (the drawing in Fig. 1, a sum without 1/|obs|, is an erratum);
a row no party holds gets q(h) = N(0, I) under it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from securevfl.methods.blocks.nets import derived_seed, mlp, torch_generator

AGGREGATIONS = ("poe", "mean")
SUM_MU = "mu"
SUM_PREC_MU = "prec_mu"
SUM_PREC = "prec"
SUM_COUNT = "count"
SUM_LOGLIK = "loglik"
SUM_DLOGLIK_DH = "dloglik_dh"
_LOG_2PI = math.log(2.0 * math.pi)


def _noise_of(
    module: nn.Module, generator: torch.Generator, shape: tuple[int, ...]
) -> torch.Tensor:
    """Standard-normal noise drawn from `generator` (on the CPU, so a run draws the same numbers
    on any device), on the device of `module`'s parameters."""
    noise = torch.randn(*shape, generator=generator)
    return noise.to(next(module.parameters()).device)


@dataclass(frozen=True)
class FalseVFLConfig:
    """Sizes and switches of the model. Defaults follow the notes' section 2.4 tabular sizes and
    Table 10 (Isolet/HAPT); scale them down for CPU tests. Refuses unknown aggregation rules,
    sizes below 1 and empty log-variance ranges."""

    d_h: int = 128
    d_z: int = 64
    hidden: tuple[int, ...] = (256, 256)  # party encoders/decoders and the global encoder/decoder
    mask_hidden: tuple[int, ...] = (256, 256)  # psi_k: a 3-layer MLP
    disc_hidden: tuple[int, ...] = (256,)  # phi: a 2-layer MLP
    kappa: int = 10  # importance samples in both bounds
    n_predict: int = 50  # L, importance samples at prediction
    aggregation: str = "poe"
    mnar: bool = False  # FALSE-VFL-II
    logvar_min: float = -8.0
    logvar_max: float = 8.0
    decoder_logvar_min: float = -6.0  # variance floor of p(x^k | h): stops variance collapse

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        for name in ("d_h", "d_z", "kappa", "n_predict"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.logvar_min < self.logvar_max or self.decoder_logvar_min >= self.logvar_max:
            raise ValueError("log-variance bounds must satisfy min < max")


def config_from_options(opts: object) -> FalseVFLConfig:
    """The model configuration of a run's `[method]` options (`FalseVFLOptions`)."""
    return FalseVFLConfig(
        d_h=opts.d_h,
        d_z=opts.d_z,
        hidden=tuple(opts.hidden),
        mask_hidden=tuple(opts.mask_hidden),
        disc_hidden=tuple(opts.disc_hidden),
        kappa=opts.kappa,
        n_predict=opts.n_predict,
        aggregation=opts.aggregation,
        mnar=opts.variant == "mnar",
    )


def posterior_sum_keys(aggregation: str) -> tuple[str, str, str]:
    """Names of the round-1 sums for an aggregation rule (refuses unknown rules)."""
    if aggregation == "mean":
        return (SUM_MU, SUM_PREC, SUM_COUNT)
    if aggregation == "poe":
        return (SUM_PREC_MU, SUM_PREC, SUM_COUNT)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def gaussian_log_density(v: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """log N(v; mu, diag(exp(logvar))), summed over the last dimension (broadcasts)."""
    return -0.5 * (_LOG_2PI + logvar + (v - mu) ** 2 * torch.exp(-logvar)).sum(-1)


def _split_gaussian(out: torch.Tensor, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    mu, logvar = out.chunk(2, dim=-1)
    return mu, logvar.clamp(lo, hi)


def _batch_mlp(net: nn.Module, v: torch.Tensor) -> torch.Tensor:
    """Apply a row-wise MLP to a tensor with any leading dimensions."""
    lead = v.shape[:-1]
    return net(v.reshape(-1, v.shape[-1])).reshape(*lead, -1)


def _check_rows(x: torch.Tensor, present: torch.Tensor, d_in: int) -> None:
    if x.dim() != 2 or x.shape[1] != d_in:
        raise ValueError(f"x must be [n, {d_in}], got {tuple(x.shape)}")
    if present.dtype != torch.bool or tuple(present.shape) != (x.shape[0],):
        raise ValueError(f"present must be a bool [n={x.shape[0]}] tensor")


# --------------------------------------------------------------------------------------------
# Party side
# --------------------------------------------------------------------------------------------


class FalseVFLParty(nn.Module):
    """Party k: Gaussian encoder q(h | x^k), Gaussian decoder p(x^k | h) and, for FALSE-VFL-II,
    the mask model psi_k (logit of P(m^k = 1 | x^k)). Sees only x^k [n, d_in] and its presence
    mask [n] (bool, True = the party holds the row); values on rows it lacks are never read.
    Stateless: the callers (the federated party, the reference) keep the graphs between calls."""

    def __init__(self, d_in: int, cfg: FalseVFLConfig, *, seed: int, name: str = "party") -> None:
        super().__init__()
        if d_in < 1:
            raise ValueError(f"d_in must be >= 1, got {d_in}")
        self.d_in = d_in
        self.cfg = cfg
        self.name = name
        self.encoder = mlp(d_in, cfg.hidden, 2 * cfg.d_h, seed=derived_seed(seed, name, "enc"))
        self.decoder = mlp(cfg.d_h, cfg.hidden, 2 * d_in, seed=derived_seed(seed, name, "dec"))
        self.mask_model = (
            mlp(d_in, cfg.mask_hidden, 1, seed=derived_seed(seed, name, "psi"))
            if cfg.mnar
            else None
        )
        self.generator = torch_generator(seed, name, "noise")

    # ---- the math (differentiable, stateless) ----------------------------------------------

    def _noise(self, *shape: int) -> torch.Tensor:
        return _noise_of(self, self.generator, shape)

    def encode(self, x: torch.Tensor, present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu_k, logvar_k), each [n, d_h], logvar clamped to [logvar_min, logvar_max]. Rows the
        party lacks are encoded from zeros (finite, and masked out by every caller)."""
        _check_rows(x, present, self.d_in)
        x0 = torch.where(present[:, None], x, torch.zeros_like(x))
        return _split_gaussian(self.encoder(x0), self.cfg.logvar_min, self.cfg.logvar_max)

    def posterior_contributions(
        self, x: torch.Tensor, present: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """This party's round-1 terms, exactly 0 on rows it lacks: "mu" (or "prec_mu" under
        "poe") [n, d_h], "prec" = exp(-logvar_k) [n, d_h], "count" [n]."""
        mu, logvar = self.encode(x, present)
        prec = torch.exp(-logvar)
        a = present[:, None]
        zero = torch.zeros_like(mu)
        first = mu if self.cfg.aggregation == "mean" else prec * mu
        key = SUM_MU if self.cfg.aggregation == "mean" else SUM_PREC_MU
        return {
            key: torch.where(a, first, zero),
            SUM_PREC: torch.where(a, prec, zero),
            SUM_COUNT: present.to(mu.dtype),
        }

    def decode(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Parameters of p(x^k | h): (mean, logvar), each [..., d_in], for h [..., d_h]."""
        return _split_gaussian(
            _batch_mlp(self.decoder, h), self.cfg.decoder_logvar_min, self.cfg.logvar_max
        )

    def sample_noise(self, n: int, n_samples: int) -> torch.Tensor | None:
        """Standard-normal noise [n, S, d_in] for the decoder samples x_hat (FALSE-VFL-II only;
        None otherwise), drawn from this party's own generator."""
        if self.mask_model is None:
            return None
        return self._noise(n, n_samples, self.d_in)

    def mask_logits(self, v: torch.Tensor) -> torch.Tensor:
        """logit P(m^k = 1 | x^k = v) for v [..., d_in] -> [...]. Refuses without a mask model."""
        if self.mask_model is None:
            raise RuntimeError("mask_logits needs cfg.mnar=True (FALSE-VFL-II)")
        return _batch_mlp(self.mask_model, v).squeeze(-1)

    def loglik_terms(
        self,
        x: torch.Tensor,
        present: torch.Tensor,
        h: torch.Tensor,
        eps_x: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-row, per-sample terms [n, S] for h [n, S, d_h]: "decoder" = log p(x^k | h_j) on held
        rows (0 elsewhere); for FALSE-VFL-II also "mask" = log Bern(0; psi_k(x^k)) on held rows and
        log Bern(1; psi_k(x_hat_j)) on missing rows, x_hat_j = mean + std * eps_x (eps_x
        [n, S, d_in], drawn from this party's generator when None)."""
        _check_rows(x, present, self.d_in)
        if h.dim() != 3 or h.shape[0] != x.shape[0] or h.shape[2] != self.cfg.d_h:
            raise ValueError(f"h must be [n={x.shape[0]}, S, {self.cfg.d_h}], got {tuple(h.shape)}")
        x0 = torch.where(present[:, None], x, torch.zeros_like(x))
        mean, logvar = self.decode(h)
        ll = gaussian_log_density(x0[:, None, :], mean, logvar)
        a = present[:, None]
        terms = {"decoder": torch.where(a, ll, torch.zeros_like(ll))}
        if self.mask_model is not None:
            if eps_x is None:
                eps_x = self.sample_noise(h.shape[0], h.shape[1])
            x_hat = mean + torch.exp(0.5 * logvar) * eps_x
            held = -F.softplus(self.mask_logits(x0))[:, None].expand_as(ll)  # log(1 - p)
            missing = F.logsigmoid(self.mask_logits(x_hat))  # log p
            terms["mask"] = torch.where(a, held, missing)
        return terms

    def loglik(
        self,
        x: torch.Tensor,
        present: torch.Tensor,
        h: torch.Tensor,
        eps_x: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This party's round-2 term c_k [n, S]: decoder log-likelihood plus (FALSE-VFL-II) the
        mask log-likelihood, as `loglik_terms` defines them."""
        return sum(self.loglik_terms(x, present, h, eps_x).values())


# --------------------------------------------------------------------------------------------
# Active side
# --------------------------------------------------------------------------------------------


class FalseVFLActive(nn.Module):
    """The active party's modules: global encoder q(z | h), global decoder p(h | z), the prior
    p(z) = N(0, I) and the discriminator p(y | h) = Cat(softmax(phi(h))). Reads party data only
    through the sums named in the module docstring."""

    def __init__(self, n_classes: int, cfg: FalseVFLConfig, *, seed: int) -> None:
        super().__init__()
        if n_classes < 2:
            raise ValueError(f"n_classes must be >= 2, got {n_classes}")
        self.cfg = cfg
        self.n_classes = n_classes
        self.global_encoder = mlp(cfg.d_h, cfg.hidden, 2 * cfg.d_z, seed=derived_seed(seed, "ge"))
        self.global_decoder = mlp(cfg.d_z, cfg.hidden, 2 * cfg.d_h, seed=derived_seed(seed, "gd"))
        self.discriminator = mlp(cfg.d_h, cfg.disc_hidden, n_classes, seed=derived_seed(seed, "d"))
        self.generator = torch_generator(seed, "active", "noise")
        self._state: dict[str, torch.Tensor] | None = None

    def _noise(self, *shape: int) -> torch.Tensor:
        return _noise_of(self, self.generator, shape)

    def generative_parameters(self) -> list[nn.Parameter]:
        """gamma_s and theta_s (stage 1); the discriminator phi is excluded."""
        return [*self.global_encoder.parameters(), *self.global_decoder.parameters()]

    # ---- the math --------------------------------------------------------------------------

    def aggregate(self, sums: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """q(h | x^obs) = N(mu_q, diag(exp(logvar_q))) [n, d_h] each, from the round-1 sums.
        "mean" (Eq. (1)): mu_q = sum mu / count, precision = sum prec; "poe": precision
        = 1 + sum prec, mu_q = sum prec_mu / precision. A row with count 0 gets N(0, I).
        Summed precisions below the smallest a party can send (possible only once embedding DP
        noised them) are raised to it. Refuses sums that lack the rule's names."""
        count = sums[SUM_COUNT]
        if self.cfg.aggregation == "poe":
            total = 1.0 + sums[SUM_PREC].clamp(min=0.0)  # exact sums are >= 0, noised ones not
            return sums[SUM_PREC_MU] / total, -torch.log(total)
        held = (count > 0)[:, None]
        # safe denominators: a where() over a 0-division would still give NaN gradients
        mu = sums[SUM_MU] / count.clamp(min=1.0)[:, None]
        prec = sums[SUM_PREC].clamp(min=math.exp(-self.cfg.logvar_max))
        total = torch.where(held, prec, torch.ones_like(prec))
        return torch.where(held, mu, torch.zeros_like(mu)), -torch.log(total)

    def sample_noise(self, n: int, n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(eps_h [n, S, d_h], eps_z [n, S, d_z]) from the active party's own generator."""
        return (
            self._noise(n, n_samples, self.cfg.d_h),
            self._noise(n, n_samples, self.cfg.d_z),
        )

    @staticmethod
    def sample_h(mu_q: torch.Tensor, logvar_q: torch.Tensor, eps_h: torch.Tensor) -> torch.Tensor:
        """Reparameterised h = mu_q + sigma_q * eps_h, [n, S, d_h]."""
        return mu_q[:, None, :] + torch.exp(0.5 * logvar_q)[:, None, :] * eps_h

    def latent_log_ratio(self, h: torch.Tensor, eps_z: torch.Tensor) -> torch.Tensor:
        """log p(h | z) + log p(z) - log q(z | h) [n, S] with z = mu_z(h) + sigma_z(h) * eps_z."""
        lo, hi = self.cfg.logvar_min, self.cfg.logvar_max
        mu_z, logvar_z = _split_gaussian(_batch_mlp(self.global_encoder, h), lo, hi)
        z = mu_z + torch.exp(0.5 * logvar_z) * eps_z
        mu_h, logvar_h = _split_gaussian(_batch_mlp(self.global_decoder, z), lo, hi)
        log_p_h = gaussian_log_density(h, mu_h, logvar_h)
        log_p_z = gaussian_log_density(z, torch.zeros_like(z), torch.zeros_like(z))
        return log_p_h + log_p_z - gaussian_log_density(z, mu_z, logvar_z)

    def log_weights(
        self,
        sum_loglik: torch.Tensor,
        h: torch.Tensor,
        mu_q: torch.Tensor,
        logvar_q: torch.Tensor,
        eps_z: torch.Tensor,
    ) -> torch.Tensor:
        """log w [n, S] = sum_k c_k + log p(h|z) + log p(z) - log q(h|x^obs) - log q(z|h)."""
        log_q_h = gaussian_log_density(h, mu_q[:, None, :], logvar_q[:, None, :])
        return sum_loglik + self.latent_log_ratio(h, eps_z) - log_q_h

    @staticmethod
    def iwae_bound(log_w: torch.Tensor) -> torch.Tensor:
        """log R_S per row [n] = logsumexp_j log w_j - log S (the per-row L_kappa estimate)."""
        return torch.logsumexp(log_w, dim=1) - math.log(log_w.shape[1])

    def class_log_probs(self, h: torch.Tensor) -> torch.Tensor:
        """log p_phi(y | h_j) for every class, [n, S, C]."""
        return torch.log_softmax(_batch_mlp(self.discriminator, h), dim=-1)

    def conditional_bound(
        self, log_w: torch.Tensor, h: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """Per-row estimate of L'_kappa [n]: logsumexp_j(log p_phi(y|h_j) + log w_j) - log S. Only
        phi receives gradients (log_w and h are detached here: Theta_g is frozen in stage 2)."""
        log_py = self.class_log_probs(h.detach()).gather(
            -1, y.long()[:, None, None].expand(-1, h.shape[1], 1)
        )
        return self.iwae_bound(log_py.squeeze(-1) + log_w.detach())

    def predict_proba(self, log_w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Self-normalised importance sampling: sum_l softmax_l(log w)_l p_phi(y | h_l), [n, C]."""
        w = torch.softmax(log_w, dim=1)
        return (w[..., None] * self.class_log_probs(h).exp()).sum(1)

    def prior_predictive(self, n_samples: int) -> torch.Tensor:
        """The model's p(y) [C] without any party's data: the mean of p_phi(y | h_l) over h_l ~
        p(h) = int p(h | z) p(z) dz (ancestral samples from the active party's generator)."""
        lo, hi = self.cfg.logvar_min, self.cfg.logvar_max
        with torch.no_grad():
            z = self._noise(n_samples, self.cfg.d_z)
            mu_h, logvar_h = _split_gaussian(self.global_decoder(z), lo, hi)
            eps = self._noise(n_samples, self.cfg.d_h)
            h = mu_h + torch.exp(0.5 * logvar_h) * eps
            return torch.softmax(self.discriminator(h), dim=-1).mean(0)

    # ---- the protocol ----------------------------------------------------------------------

    def begin(
        self,
        sums: Mapping[str, torch.Tensor],
        n_samples: int,
        *,
        train: bool = False,
        eps_h: torch.Tensor | None = None,
        eps_z: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Take the round-1 sums, draw S samples of h and return them detached, [n, S, d_h] (sent
        to every party). With `train`, the sums become leaves whose gradients `finish_stage1`
        returns."""
        n = sums[SUM_COUNT].shape[0]
        if eps_h is None or eps_z is None:
            eps_h, eps_z = self.sample_noise(n, n_samples)
        with torch.set_grad_enabled(train):
            leaves = {
                k: (v.detach().requires_grad_(k != SUM_COUNT) if train else v.detach())
                for k, v in sums.items()
            }
            mu_q, logvar_q = self.aggregate(leaves)
            h = self.sample_h(mu_q, logvar_q, eps_h)
        self._state = {"mu_q": mu_q, "logvar_q": logvar_q, "h": h, "eps_z": eps_z, **leaves}
        return h.detach()

    def _log_weights_from_state(self, sum_loglik: torch.Tensor) -> torch.Tensor:
        if self._state is None:
            raise RuntimeError("log weights before begin()")
        s = self._state
        return self.log_weights(sum_loglik, s["h"], s["mu_q"], s["logvar_q"], s["eps_z"])

    def finish_stage1(
        self, sum_loglik: torch.Tensor, sum_dloglik_dh: torch.Tensor, *, weight: float = 1.0
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Stage 1 after round 2: loss = -mean_i L_kappa estimate; accumulates .grad of the global
        encoder/decoder and returns (loss, backward message) where the message is d loss / d
        each differentiable round-1 sum ([n, d_h]) and d loss / d "loglik" ([n, S]). The
        dependence of sum_k c_k on h enters through sum_dloglik_dh. Gradients (not the returned
        loss) are of `weight` times the loss: a batch's share of a larger step. Refuses without
        begin(train=True)."""
        if self._state is None or not self._state["h"].requires_grad:
            raise RuntimeError("finish_stage1 needs begin(..., train=True)")
        h = self._state["h"]
        ll_leaf = sum_loglik.detach().requires_grad_(True)
        # value sum_loglik, gradient w.r.t. h equal to sum_dloglik_dh times d loss / d loglik
        ll = ll_leaf + ((h - h.detach()) * sum_dloglik_dh.detach()).sum(-1)
        loss = -self.iwae_bound(self._log_weights_from_state(ll)).mean()
        (weight * loss).backward()
        grads = {
            k: v.grad
            for k, v in self._state.items()
            if k in (SUM_MU, SUM_PREC_MU, SUM_PREC) and v.grad is not None
        }
        grads[SUM_LOGLIK] = ll_leaf.grad
        self._state = None
        return loss.detach(), grads

    def finish_log_weights(self, sum_loglik: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log w [n, S], h [n, S, d_h]) without gradients, for stage 2, bounds and prediction."""
        with torch.no_grad():
            log_w = self._log_weights_from_state(sum_loglik)
        assert self._state is not None
        h = self._state["h"].detach()
        self._state = None
        return log_w, h
