"""LeanAdam is torch's Adam bit for bit: the same weights and state after many steps (with and
without weight decay, parameters without a gradient, a learning rate changed between steps),
state dicts that load across the two, torch's own step for what its short path does not cover,
hooks that still run once, and zero_grad as torch's."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from securevfl.methods.blocks.lean_adam import LeanAdam


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))


def _train(opt_class, steps: int, *, state=None, skip_bias_at=(), lr_at=None, **kw):
    model = _model()
    opt = opt_class(model.parameters(), **kw)
    if state is not None:  # a copy: torch's load keeps the tensors and steps them in place
        model.load_state_dict(copy.deepcopy(state[0]))
        opt.load_state_dict(copy.deepcopy(state[1]))
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        if lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = lr_at(i)
        opt.zero_grad()
        x = torch.randn(256, 6, generator=gen)
        g = torch.randn(256, 16, generator=gen)
        model(x).backward(g)
        if i in skip_bias_at:  # a parameter that got no gradient this step
            model[2].bias.grad = None
        opt.step()
    return model, opt


def _same(a, b) -> None:
    (ma, oa), (mb, ob) = a, b
    for pa, pb in zip(ma.parameters(), mb.parameters(), strict=True):
        assert torch.equal(pa, pb)
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa["state"][k][name], sb["state"][k][name]), (k, name)


@pytest.mark.parametrize(
    "kw",
    [
        {"lr": 1e-3},
        {"lr": 3e-2, "weight_decay": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6},
    ],
)
def test_the_same_weights_and_state_as_torch_bit_for_bit(kw):
    _same(
        _train(torch.optim.Adam, 120, skip_bias_at={3, 50}, **kw),
        _train(LeanAdam, 120, skip_bias_at={3, 50}, **kw),
    )


def test_a_learning_rate_changed_between_steps_is_used():
    def lr_at(i):
        return 1e-3 * (1 + (i % 7))

    _same(
        _train(torch.optim.Adam, 40, lr_at=lr_at, lr=1e-3),
        _train(LeanAdam, 40, lr_at=lr_at, lr=1e-3),
    )


def test_state_dicts_load_across_the_two():
    first = _train(torch.optim.Adam, 30, lr=1e-3)
    state = (first[0].state_dict(), first[1].state_dict())
    _same(
        _train(torch.optim.Adam, 30, state=state, lr=1e-3),
        _train(LeanAdam, 30, state=state, lr=1e-3),
    )


@pytest.mark.parametrize("kw", [{"amsgrad": True}, {"maximize": True}, {"foreach": True}])
def test_what_the_short_path_does_not_cover_is_torchs_own_step(kw):
    _same(_train(torch.optim.Adam, 30, lr=1e-3, **kw), _train(LeanAdam, 30, lr=1e-3, **kw))


def test_a_tensor_learning_rate_is_torchs_own_step():
    _same(
        _train(torch.optim.Adam, 10, lr=torch.tensor(1e-3)),
        _train(LeanAdam, 10, lr=torch.tensor(1e-3)),
    )


def test_step_hooks_run_once_a_step():
    model = _model()
    opt = LeanAdam(model.parameters(), lr=1e-3)
    torch.optim.Adam(_model().parameters())  # torch's own class may be hooked too
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    for _ in range(3):  # the first step is torch's (it makes the state), then the short path
        opt.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
    assert calls == ["pre", "post"] * 3


def test_zero_grad_clears_or_zeros_as_torchs():
    model = _model()
    opt = LeanAdam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 6)).sum().backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_a_closure_is_evaluated_by_torchs_step():
    model = _model()
    opt = LeanAdam(model.parameters(), lr=1e-3)
    x = torch.randn(4, 6)

    def closure():
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    assert opt.step(closure) is not None


def _stepped(opt, model, steps: int = 3) -> None:
    for _ in range(steps):  # the first step is torch's (it makes the state), then the short path
        opt.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        opt.step()


def test_a_global_step_hook_runs_once_a_step_and_sees_the_calls_arguments():
    model = _model()
    opt = LeanAdam(model.parameters(), lr=1e-3)
    seen = []
    handles = [
        register_optimizer_step_pre_hook(
            lambda o, args, kwargs: seen.append(("pre", o is opt, len(args)))
        ),
        register_optimizer_step_post_hook(
            lambda o, args, kwargs: seen.append(("post", o is opt, len(args)))
        ),
    ]
    try:
        _stepped(opt, model)
    finally:
        for h in handles:
            h.remove()
    assert seen == [("pre", True, 1), ("post", True, 1)] * 3


def test_unobserved_steps_skip_torchs_wrapper_and_a_profiler_sees_them():
    model = _model()
    opt = LeanAdam(model.parameters(), lr=1e-3)
    _stepped(opt, model, 1)  # state made
    with mock.patch.object(
        torch.autograd.profiler, "record_function", wraps=torch.autograd.profiler.record_function
    ) as record:
        _stepped(opt, model, 2)
    assert record.call_count == 0  # no hook, no profiler: the bare short path
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _stepped(opt, model, 2)
    names = [e.name for e in prof.events()]
    assert names.count("Optimizer.step#LeanAdam.step") == 2
