"""Differential-privacy mechanisms: one interface, a registry.

Every mechanism is a Gaussian mechanism with an L2 clip ``clip`` (the sensitivity bound C)
and a noise multiplier ``noise_multiplier`` (sigma): noise of standard deviation sigma*C is
added to clipped values. The registry `MECHANISMS` maps the name written in the ledger to the
class, so the ledger and the audit know, per name, whether subsampling amplification may be
claimed (`Mechanism.amplified`).

Noise of the releases to other parties (label DP, embedding DP) is drawn in float64 from a
`NoiseSource`: NumPy's PCG64DXSM seeded with 256 bits from the operating system's CSPRNG, fresh
per source, never from torch's default Mersenne Twister in float32. The clipped value plus
noise is computed in float64 and snapped to a grid of 2^-12 noise standard deviations before it
is cast back, so the low-order bits of a release do not depend on the exact value (the
floating-point attack on naive samplers, Mironov 2012). ``NoiseSource(seed=...)`` is a
reproducible mode for tests: it is not private, and a role using it says so in the ledger.
DP-SGD's noise is Opacus's.
"""

from __future__ import annotations

import math
import secrets
from abc import ABC
from collections.abc import Mapping
from typing import ClassVar, TypeVar, overload

import numpy as np
import torch
from torch import nn

from securevfl.privacy.dpsgd import make_private_model

__all__ = [
    "MECHANISMS",
    "DPSGD",
    "NoiseSource",
    "EmbeddingDP",
    "LabelGradientDP",
    "Mechanism",
    "ReleaseMechanism",
    "create_mechanism",
    "register_mechanism",
]

MECHANISMS: dict[str, type[Mechanism]] = {}

M = TypeVar("M", bound="type[Mechanism]")


def register_mechanism(cls: M) -> M:
    """Class decorator: add a mechanism to `MECHANISMS` under ``cls.name``.

    Refuses (ValueError) a class without a ``name`` or a name already taken by another class.
    """
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} must define a non-empty class attribute `name`")
    if name in MECHANISMS and MECHANISMS[name] is not cls:
        raise ValueError(
            f"mechanism name {name!r} is already registered by {MECHANISMS[name].__name__}"
        )
    MECHANISMS[name] = cls
    return cls


def create_mechanism(name: str, /, **kwargs: object) -> Mechanism:
    """Build a registered mechanism by its ledger name (``"label_dp"``, ``"embedding_dp"``, ...).

    Refuses (ValueError) an unknown name, listing the known ones.
    """
    try:
        cls = MECHANISMS[name]
    except KeyError:
        raise ValueError(
            f"unknown DP mechanism {name!r}; known mechanisms are {sorted(MECHANISMS)}"
        ) from None
    return cls(**kwargs)  # type: ignore[arg-type]


def _positive_finite(value: float, parameter: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{parameter} must be a positive number, got {value!r}") from None
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{parameter} must be a positive finite number, got {value!r}")
    return v


# releases are snapped to a grid of noise_std * 2^-SNAP_BITS (a power of two)
SNAP_BITS = 12


class NoiseSource:
    """Gaussian noise for releases, float64. Seeded from the OS CSPRNG (256 bits) unless a
    `seed` is given, which makes it reproducible and not private (`private` is False)."""

    def __init__(self, *, seed: int | None = None) -> None:
        self.private = seed is None
        entropy = secrets.randbits(256) if seed is None else int(seed)
        self._seed = None if seed is None else int(seed)
        self._epoch: int | None = None
        self._rng = np.random.Generator(np.random.PCG64DXSM(entropy))

    def at_epoch(self, epoch: int) -> None:
        """A seeded source draws each epoch's noise from its own stream, (seed, epoch), so a
        run resumed from a checkpoint draws the noise an uninterrupted run would have drawn. A
        private (CSPRNG) source ignores this: a resumed run draws fresh noise."""
        if self._seed is None or epoch == self._epoch:
            return
        self._epoch = int(epoch)
        self._rng = np.random.Generator(np.random.PCG64DXSM([self._seed, 0x5EED, int(epoch)]))

    def normal(self, shape: tuple[int, ...], std: float) -> np.ndarray:
        return self._rng.normal(0.0, std, size=shape)


class Mechanism(ABC):
    """A Gaussian mechanism with L2 clip ``clip`` and noise standard deviation
    ``noise_multiplier * clip``.

    Class attributes:
        name: the name written in the ledger and used in the registry.
        amplified: whether the ledger may account this mechanism with a sample rate below 1
            (privacy amplification by subsampling). False for every release to another party,
            because in VFL every party learns which rows are in each batch.
    """

    name: ClassVar[str]
    amplified: ClassVar[bool]

    def __init__(
        self,
        *,
        noise_multiplier: float,
        clip: float,
        generator: torch.Generator | None = None,
    ) -> None:
        """Refuses (ValueError, naming the parameter) ``noise_multiplier <= 0`` or ``clip <= 0``
        and non-finite values: a mechanism without noise has no guarantee to account.
        Refuses (TypeError) a class without a ``name``: only registered mechanisms are built."""
        if not isinstance(getattr(type(self), "name", None), str):
            raise TypeError(f"{type(self).__name__} is abstract: it has no mechanism name")
        self.noise_multiplier = _positive_finite(noise_multiplier, "noise_multiplier")
        self.clip = _positive_finite(clip, "clip")
        self.generator = generator

    @property
    def noise_std(self) -> float:
        """Standard deviation of the added Gaussian noise, sigma * C."""
        return self.noise_multiplier * self.clip

    def __repr__(self) -> str:
        return f"{type(self).__name__}(noise_multiplier={self.noise_multiplier}, clip={self.clip})"


class ReleaseMechanism(Mechanism):
    """A mechanism applied to values that leave the party: per-row joint clip, then noise.

    Rows are dimension 0 of every tensor. Autograd flows through the clip (the noise is a
    constant), so a party may call ``backward`` on the released tensor.
    """

    amplified: ClassVar[bool] = False

    @property
    def noise_source(self) -> NoiseSource:
        if self.generator is None:
            self.generator = NoiseSource()
        if not isinstance(self.generator, NoiseSource):
            raise TypeError(
                f"{self.name} draws its noise from a NoiseSource (float64, CSPRNG-seeded), "
                f"not a {type(self.generator).__name__}"
            )
        return self.generator

    def _release(self, clipped: torch.Tensor) -> torch.Tensor:
        """clipped + N(0, (sigma C)^2) in float64, snapped to the grid, in the input dtype."""
        noise = torch.from_numpy(self.noise_source.normal(tuple(clipped.shape), self.noise_std))
        grid = 2.0 ** (math.floor(math.log2(self.noise_std)) - SNAP_BITS)
        noisy = clipped.double() + noise.to(clipped.device)
        # snap (straight-through for autograd: the rounding is part of the noise)
        snapped = noisy + (torch.round(noisy.detach() / grid) * grid - noisy.detach())
        return snapped.to(clipped.dtype)

    def _clip_rows_and_noise(self, tensors: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        if not tensors:
            raise ValueError(f"{self.name}: nothing to release (no tensors given)")
        rows = None
        for key, t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{self.name}: {key} must be a torch.Tensor, got {type(t)}")
            if t.dim() < 1:
                raise ValueError(f"{self.name}: {key} must have a row dimension, got a scalar")
            if not t.is_floating_point():
                raise TypeError(f"{self.name}: {key} must be floating point, got {t.dtype}")
            if rows is None:
                rows = t.shape[0]
            elif t.shape[0] != rows:
                raise ValueError(
                    f"{self.name}: every tensor must have the same number of rows (dim 0); "
                    f"{tensors[0][0]} has {rows}, {key} has {t.shape[0]}"
                )
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{self.name}: {key} contains NaN or infinite values")

        def row_sq(t: torch.Tensor) -> torch.Tensor:  # float64: no overflow for large rows
            return t.reshape(t.shape[0], math.prod(t.shape[1:])).double().pow(2).sum(dim=1)

        norms = sum(row_sq(t.detach()) for _, t in tensors).sqrt()
        # the clip factor carries autograd so that backward through a released tensor is exact
        sq_live = sum(row_sq(t) for _, t in tensors)
        safe = torch.where(norms > self.clip, sq_live, torch.ones_like(sq_live))
        factor = torch.where(norms > self.clip, self.clip / safe.sqrt(), torch.ones_like(safe))
        out = []
        for _, t in tensors:
            f = factor.to(t.dtype).reshape((rows,) + (1,) * (t.dim() - 1))
            out.append(self._release(t * f))
        return out

    @overload
    def apply(self, values: torch.Tensor) -> torch.Tensor: ...
    @overload
    def apply(self, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def apply(
        self, values: torch.Tensor | Mapping[str, torch.Tensor]
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Clip each row jointly over all tensors to L2 norm ``clip``, then add N(0, (sigma C)^2)
        to every entry. Returns new tensors with the same structure; inputs are not modified.

        A mapping is clipped jointly: row i of every tensor is concatenated for the norm, so
        the whole row's release has sensitivity C. Refuses an empty mapping, tensors whose row
        counts differ, non-floating dtypes and NaN/inf values (they would defeat the clip).
        """
        if isinstance(values, torch.Tensor):
            return self._clip_rows_and_noise([("tensor", values)])[0]
        if isinstance(values, Mapping):
            items = list(values.items())
            released = self._clip_rows_and_noise([(str(k), v) for k, v in items])
            return {k: r for (k, _), r in zip(items, released, strict=True)}
        raise TypeError(
            f"{self.name}.apply takes a tensor or a mapping of tensors, got {type(values)}"
        )


@register_mechanism
class LabelGradientDP(ReleaseMechanism):
    """Label DP on the gradients the active party returns (d loss / d sum).

    Per sample row, everything that leaves the active party for that row (one gradient
    matrix, or one per group: pass them as a mapping) is clipped jointly to L2 norm C, and
    Gaussian noise sigma*C is added to every entry before the gradients leave the party.
    Accounted without amplification: one full Gaussian mechanism per release of a row.
    """

    name: ClassVar[str] = "label_dp"


@register_mechanism
class EmbeddingDP(ReleaseMechanism):
    """Embedding DP on a passive party's contribution, before masking or encryption.

    Each row is clipped to L2 norm C_e and Gaussian noise sigma_e*C_e is added to every entry.
    Accounted without amplification. The noised tensor may then feed several sums (one per
    group) at no further cost (post-processing). Several tensors of one call passed together as
    a mapping are clipped jointly per row, so they are one release of each row, like label DP;
    tensors released separately are one release each.
    """

    name: ClassVar[str] = "embedding_dp"


@register_mechanism
class DPSGD(Mechanism):
    """DP-SGD (Opacus) on a party's own model: per-sample gradient clip ``clip`` and noise
    sigma*C on the summed gradient, protecting the model's parameters.

    The only mechanism that may claim amplification by subsampling (sample rate = batch / N),
    and only for a model whose parameters leave the party towards someone who does not know
    the batch schedule; otherwise record it with sample rate 1.
    """

    name: ClassVar[str] = "dp_sgd"
    amplified: ClassVar[bool] = True

    def wrap(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        expected_batch_size: int,
        loss_reduction: str = "mean",
    ):
        """Wrap ``model`` and ``optimizer`` for DP-SGD; see `securevfl.privacy.dpsgd`."""
        return make_private_model(
            model,
            optimizer,
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.clip,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=self.generator,
        )
