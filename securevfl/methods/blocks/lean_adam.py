"""Adam with torch's own update, bit for bit, at less Python cost per step.

A party's model is a few small tensors, stepped once a batch; there `torch.optim.Adam.step`
costs more in Python (its wrappers, `_init_group`, the dispatch to `_single_tensor_adam` and
its per-parameter checks) than in arithmetic. `LeanAdam.step` runs the same tensor operations
as `_single_tensor_adam`, in the same order with the same scalars, for the common case: float
learning rate and betas, no amsgrad, maximize, capturable, differentiable, foreach or fused,
dense real gradients, every parameter's state made (by a first step through torch). Anything
else, and a closure, goes through torch's step, unchanged. State dicts are torch's: a
checkpoint written by one loads into the other. `tests/securevfl/test_lean_adam.py` holds it
to torch's results bit for bit, so a torch release that changes its Adam is caught there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import optimizer as _torch_optimizer

_PLAIN = (
    ("amsgrad", False),
    ("maximize", False),
    ("capturable", False),
    ("differentiable", False),
    ("decoupled_weight_decay", False),
)


def _observed(opt: torch.optim.Optimizer) -> bool:
    """Whether a step must run inside torch's wrapper: a step hook (this optimizer's or a
    global one) or a profiler recording; True where this torch keeps them elsewhere."""
    globals_ = (
        getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None),
        getattr(_torch_optimizer, "_global_optimizer_post_hooks", None),
    )
    enabled = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
    if any(g is None for g in globals_) or enabled is None:
        return True
    return bool(
        getattr(opt, "_optimizer_step_pre_hooks", True)
        or getattr(opt, "_optimizer_step_post_hooks", True)
        or globals_[0]
        or globals_[1]
        or enabled()
    )


def _torch_step(opt: torch.optim.Adam, closure: Any) -> Any:
    """`torch.optim.Adam.step` without the profiling/hook wrapper torch may have put on it
    (LeanAdam runs it inside that wrapper already: the hooks run once)."""
    step = torch.optim.Adam.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    return step(opt, closure)


class LeanAdam(torch.optim.Adam):
    """`torch.optim.Adam` (same arguments, state and results) with a short path for a step."""

    def _lean(self, group: dict) -> bool:
        if any(group.get(key, default) != default for key, default in _PLAIN):
            return False
        if group.get("foreach") or group.get("fused"):
            return False
        beta1, beta2 = group["betas"]
        return all(type(v) is float for v in (group["lr"], beta1, beta2, group["eps"]))

    def _short(self) -> bool:
        """Whether this step can take the short path: plain groups, and every parameter with
        a gradient a dense real tensor whose state a first step (torch's) has made."""
        if not all(self._lean(g) for g in self.param_groups):
            return False
        state = self.state
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is not None and (
                    not state.get(p) or grad.is_sparse or p.is_complex() or grad.requires_grad
                ):
                    return False
        return True

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Not wrapped by torch (`hooked` below): with no step hook, global or this
        optimizer's, and no profiler running, the short path runs bare; otherwise the step
        runs inside torch's wrapper (hooks, the profiler's record), as torch's own would."""
        if closure is None:
            if not _observed(self) and self._short():
                return self._short_step()
            return _OBSERVED_STEP(self)  # the hooks see the call's own arguments
        return _OBSERVED_STEP(self, closure)

    step.hooked = True  # type: ignore[attr-defined]  # torch's Optimizer leaves it unwrapped

    def _step(self, closure: Any = None) -> Any:
        if closure is None and self._short():
            return self._short_step()
        return _torch_step(self, closure)

    def _short_step(self) -> None:
        state = self.state
        with torch.no_grad():
            for group in self.param_groups:
                beta1, beta2 = group["betas"]
                lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
                for p in group["params"]:
                    grad = p.grad
                    if grad is None:
                        continue
                    s = state[p]
                    step_t = s["step"]
                    # as torch.optim.adam._single_tensor_adam, operation for operation
                    step_t += 1
                    if weight_decay != 0:
                        grad = grad.add(p, alpha=weight_decay)
                    exp_avg, exp_avg_sq = s["exp_avg"], s["exp_avg_sq"]
                    exp_avg.lerp_(grad, 1 - beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    step = step_t.item()
                    bias_correction1 = 1 - beta1**step
                    bias_correction2 = 1 - beta2**step
                    step_size = lr / bias_correction1
                    bias_correction2_sqrt = bias_correction2**0.5
                    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
                    p.addcdiv_(exp_avg, denom, value=-step_size)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, which for `set_to_none` sets each parameter's grad to None; that is done
        here directly, without its profiler record and per-parameter checks."""
        if not set_to_none:
            return super().zero_grad(set_to_none=False)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        return None


# LeanAdam's step when observed: torch's wrapper (hooks, the profiler's record) around it
_OBSERVED_STEP = torch.optim.Optimizer.profile_hook_step(LeanAdam._step)
