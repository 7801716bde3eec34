"""DP-SGD through Opacus in the VFL loop: backward from a gradient another party supplied."""

from __future__ import annotations

import copy

import pytest
import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from securevfl.privacy.dpsgd import make_private_model
from securevfl.privacy.mechanisms import DPSGD

B, D_IN, WIDTH = 16, 5, 3


def encoder() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, 8), nn.ReLU(), nn.Linear(8, WIDTH))


def received_gradient(seed: int = 1) -> torch.Tensor:
    """dL/dS as the active party sends it for a mean-reduced loss (rows carry 1/B)."""
    return torch.randn(B, WIDTH, generator=torch.Generator().manual_seed(seed)) * 5 / B


def per_sample_gradients(model: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    """Reference per-sample gradients of l_i, one backward per row (B * grad undoes 1/B)."""
    out = []
    for i in range(len(x)):
        m = copy.deepcopy(model)
        m(x[i : i + 1]).backward(grad[i : i + 1] * len(x))
        out.append([p.grad.clone() for p in m.parameters()])
    return out


def test_manual_loop_computes_per_sample_grads_clips_them_and_adds_noise():
    sigma, clip = 0.7, 0.5
    model = encoder()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gsm, dp_opt = make_private_model(
        model,
        optimizer,
        noise_multiplier=sigma,
        max_grad_norm=clip,
        expected_batch_size=B,
        generator=torch.Generator().manual_seed(2),
    )
    assert isinstance(gsm, GradSampleModule) and isinstance(dp_opt, DPOptimizer)
    x = torch.randn(B, D_IN)
    grad = received_gradient()
    before = [p.detach().clone() for p in gsm.parameters()]

    out = gsm(x)  # the party sends `out` away ...
    out.backward(grad)  # ... and later backpropagates the gradient it received

    expected = per_sample_gradients(reference, x, grad)
    for j, p in enumerate(gsm.parameters()):
        assert p.grad_sample.shape == (B, *p.shape)
        torch.testing.assert_close(p.grad_sample, torch.stack([e[j] for e in expected]))
    norms = torch.stack([torch.cat([g.flatten() for g in e]).norm() for e in expected])
    assert (norms > clip).sum() >= B // 2, "the test must exercise clipping"

    dp_opt.step()

    factors = torch.clamp(clip / (norms + 1e-6), max=1.0)
    clipped_norms = norms * factors
    assert (clipped_norms <= clip + 1e-6).all()
    noise = []
    for j, p in enumerate(gsm.parameters()):
        summed = sum(f * e[j] for f, e in zip(factors, expected, strict=True))
        torch.testing.assert_close(p.summed_grad, summed, atol=1e-5, rtol=1e-4)
        noise.append((p.grad * B - p.summed_grad).flatten())  # mean reduction: noised sum / B
    noise = torch.cat(noise)
    assert noise.std().item() == pytest.approx(sigma * clip, rel=0.25)
    assert all(not torch.equal(a, b) for a, b in zip(before, gsm.parameters(), strict=True))

    dp_opt.zero_grad()
    assert all(p.grad_sample is None for p in gsm.parameters())


def test_several_steps_train_and_the_mechanism_wraps_too():
    model = encoder()
    gsm, dp_opt = DPSGD(noise_multiplier=1.0, clip=1.0).wrap(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), expected_batch_size=B
    )
    start = [p.detach().clone() for p in gsm.parameters()]
    for step in range(3):
        out = gsm(torch.randn(B, D_IN))
        out.backward(received_gradient(step))
        dp_opt.step()
        dp_opt.zero_grad()
    assert all(not torch.equal(a, b) for a, b in zip(start, gsm.parameters(), strict=True))


def test_batchnorm_is_replaced_in_a_copy_and_the_optimizer_rebuilt():
    model = nn.Sequential(nn.Linear(D_IN, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, WIDTH))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gsm, dp_opt = make_private_model(
        model, optimizer, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=B
    )
    assert isinstance(model[1], nn.BatchNorm1d), "the caller's model is left unchanged"
    assert isinstance(gsm._module[1], nn.GroupNorm)
    wrapped = {id(p) for g in dp_opt.param_groups for p in g["params"]}
    assert wrapped == {id(p) for p in gsm.parameters()}
    assert dp_opt.param_groups[0]["lr"] == 0.05 and dp_opt.param_groups[0]["momentum"] == 0.9
    gsm(torch.randn(B, D_IN)).backward(received_gradient())
    dp_opt.step()

    with pytest.raises(ValueError, match="BatchNorm"):
        make_private_model(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            expected_batch_size=B,
            fix_invalid=False,
        )


def test_refusals():
    model = encoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=B)
    with pytest.raises(ValueError, match="noise_multiplier"):
        make_private_model(model, opt, **{**kw, "noise_multiplier": 0.0})
    with pytest.raises(ValueError, match="max_grad_norm"):
        make_private_model(model, opt, **{**kw, "max_grad_norm": -1.0})
    with pytest.raises(ValueError, match="expected_batch_size"):
        make_private_model(model, opt, **{**kw, "expected_batch_size": 0})
    with pytest.raises(ValueError, match="loss_reduction"):
        make_private_model(model, opt, **kw, loss_reduction="max")
    other = torch.optim.SGD(encoder().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="do not belong"):
        make_private_model(model, other, **kw)
    gsm, _ = make_private_model(model, opt, **kw)
    with pytest.raises(ValueError, match="already a GradSampleModule"):
        make_private_model(gsm, opt, **kw)
