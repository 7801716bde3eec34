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

_PLAIN = (
    ("amsgrad", False),
    ("maximize", False),
    ("capturable", False),
    ("differentiable", False),
    ("decoupled_weight_decay", False),
)


def _torch_step(opt: torch.optim.Adam, closure: Any) -> Any:
    """`torch.optim.Adam.step` without the profiling/hook wrapper torch may have put on it
    (our own class's step carries that wrapper already: the hooks run once)."""
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

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if closure is not None or not all(self._lean(g) for g in self.param_groups):
            return _torch_step(self, closure)
        state = self.state
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is not None and (
                    not state.get(p) or grad.is_sparse or p.is_complex() or grad.requires_grad
                ):
                    return _torch_step(self, closure)  # a first step, or an unusual tensor
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
