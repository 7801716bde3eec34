"""Sparse attention maps of TabNet: sparsemax and 1.5-entmax, with their exact backward passes.

Written here (not imported from pytorch-tabnet) so the package does not depend on it; tests
compare outputs and gradients against pytorch-tabnet 4.1.0.
"""

from __future__ import annotations

import torch


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
    """Sparsemax (Martins et al., ICML 2016) along `dim`: the Euclidean projection onto the
    simplex; rows sum to 1 with exact zeros. Does not modify `z`."""
    return _Sparsemax.apply(z, dim)


def entmax15(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """1.5-entmax (Peters et al. 2019) along `dim`, exact sort-based threshold; rows sum to 1.
    Does not modify `z`."""
    return _Entmax15.apply(z, dim)
