"""DP-SGD on a party's own model (encoder or head) through Opacus, for a manual VFL loop.

In VFL a party never sees a loss: it runs ``out = model(x)``, sends ``out`` (protected) away,
later receives ``grad = dL/d out`` and calls ``out.backward(grad)``, then ``optimizer.step()``.
Opacus's `GradSampleModule` hooks compute per-sample gradients from exactly that backward
pass, and `DPOptimizer` clips each sample's gradient to ``max_grad_norm``, adds Gaussian noise
``noise_multiplier * max_grad_norm`` to the sum and averages. There is no DataLoader (the
active party picks batches by sample id), so Opacus's accountant is not attached here: record
one ledger event per step with sample rate ``expected_batch_size / N``.

Caveat for accounting: Opacus's accountants analyse Poisson subsampling; batches drawn as a
shuffled partition of the rows are the usual approximation, not an exact match.
"""

from __future__ import annotations

import secrets
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # Opacus is imported on first use: a second of start-up a role without DP-SGD
    from opacus import GradSampleModule  # never needs
    from opacus.optimizers import DPOptimizer

__all__ = ["make_private_model"]


def _silence_backward_hook_warning() -> None:
    # torch warns on backward through Opacus's full backward hook on a first layer whose input
    # does not require grad: the normal case here (inputs are data), and harmless
    warnings.filterwarnings(
        "ignore",
        message=r"Full backward hook is firing when gradients are computed with respect to "
        r"module outputs since no inputs require gradients",
        category=UserWarning,
    )


_silence_backward_hook_warning()

LOSS_REDUCTIONS = ("mean", "sum")


def _rebuild_optimizer(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter]
) -> torch.optim.Optimizer:
    if len(optimizer.param_groups) != 1 or optimizer.state:
        raise ValueError(
            "the model needed Opacus fixes (e.g. BatchNorm -> GroupNorm), which replace its "
            "parameters, but the optimizer has several parameter groups or existing state and "
            "cannot be rebuilt safely; call opacus.validators.ModuleValidator.fix(model) "
            "before creating the optimizer"
        )
    group = optimizer.param_groups[0]
    settings = {k: group[k] for k in optimizer.defaults if k in group}
    return type(optimizer)(params, **settings)


def make_private_model(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: int,
    loss_reduction: str = "mean",
    generator: torch.Generator | None = None,
    fix_invalid: bool = True,
) -> tuple[GradSampleModule, DPOptimizer]:
    """Wrap ``model`` and ``optimizer`` for DP-SGD in a loop whose backward is
    ``out.backward(grad)`` with ``grad`` supplied by another party.

    Use the returned module and optimizer (never the originals) for training:
    ``out = gsm(x)``; ``out.backward(grad)``; ``dp_opt.step()``; ``dp_opt.zero_grad()``.
    Call ``backward`` once per step (sum the gradients of several sums first).

    ``loss_reduction`` must say how the active party reduced its loss over the batch:
    ``"mean"`` (the usual case; the gradient rows carry a 1/B factor, undone per sample) or
    ``"sum"``. With ``"mean"`` the noised sum is divided by ``expected_batch_size``.

    The model is checked with Opacus's ``ModuleValidator``. With ``fix_invalid`` (default),
    layers Opacus can replace (BatchNorm -> GroupNorm, ...) are replaced in a copy and the
    optimizer is rebuilt for the copy's parameters (only if it has one parameter group and no
    state yet); the originals are left unchanged.

    Without a ``generator``, noise comes from a torch generator seeded from the OS entropy pool.

    Refuses (ValueError): ``noise_multiplier <= 0`` or ``max_grad_norm <= 0`` (no accountable
    guarantee), ``expected_batch_size < 1``, an unknown ``loss_reduction``, a model that is
    already a GradSampleModule, a model that stays invalid for Opacus (the error lists each
    offending layer), and an optimizer holding parameters that are not the model's.
    """
    if not noise_multiplier > 0:
        raise ValueError(f"noise_multiplier must be > 0 for DP-SGD, got {noise_multiplier!r}")
    if not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm!r}")
    if not isinstance(expected_batch_size, int) or expected_batch_size < 1:
        raise ValueError(f"expected_batch_size must be an int >= 1, got {expected_batch_size!r}")
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    from opacus.validators import ModuleValidator

    if isinstance(model, GradSampleModule):
        raise ValueError("model is already a GradSampleModule; pass the plain nn.Module")
    if isinstance(optimizer, DPOptimizer):
        raise ValueError("optimizer is already a DPOptimizer; pass the plain torch optimizer")

    model_params = {id(p) for p in model.parameters()}
    foreign = [
        p for group in optimizer.param_groups for p in group["params"] if id(p) not in model_params
    ]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that do not belong to the model; "
            "build the optimizer from model.parameters()"
        )

    errors = ModuleValidator.validate(model, strict=False)
    if errors and fix_invalid:
        fixed = ModuleValidator.fix(model)
        errors = ModuleValidator.validate(fixed, strict=False)
        if not errors:
            optimizer = _rebuild_optimizer(optimizer, list(fixed.parameters()))
            model = fixed
    if errors:
        listed = "; ".join(str(e) for e in errors)
        raise ValueError(
            f"the model cannot be trained with DP-SGD as is ({len(errors)} problem(s)): {listed}"
        )

    if generator is None:
        # an unpredictable seed: DP noise must not be reproducible from the run's global seed
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        generator = torch.Generator(device=device)
        generator.manual_seed(secrets.randbits(63))
    _silence_backward_hook_warning()  # again: test runners reset import-time filters
    gsm = GradSampleModule(model, loss_reduction=loss_reduction)
    dp_optimizer = DPOptimizer(
        optimizer,
        noise_multiplier=float(noise_multiplier),
        max_grad_norm=float(max_grad_norm),
        expected_batch_size=expected_batch_size,
        loss_reduction=loss_reduction,
        generator=generator,
    )
    return gsm, dp_optimizer
