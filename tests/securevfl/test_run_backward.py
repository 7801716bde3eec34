"""`run_backward` is `out.backward(grad)`: the same gradients bit for bit (a representation's
gradient from another party, a scalar loss), module backward hooks still fire, and what its
short path does not cover goes through torch (so torch's own errors reach the caller)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from securevfl.methods.blocks.nets import run_backward


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))


def _grads(backward, *, scalar: bool) -> list[torch.Tensor]:
    model = _model()
    x = torch.randn(256, 6, generator=torch.Generator().manual_seed(1))
    out = model(x)
    if scalar:
        backward(torch.nn.functional.mse_loss(out, torch.zeros_like(out)), None)
    else:
        backward(out, torch.randn(256, 16, generator=torch.Generator().manual_seed(2)))
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("scalar", [False, True], ids=["representation", "loss"])
def test_the_same_gradients_as_torchs_backward_bit_for_bit(scalar):
    expected = _grads(lambda out, g: out.backward(g), scalar=scalar)
    with mock.patch.object(torch.Tensor, "backward", side_effect=AssertionError("slow path")):
        got = _grads(run_backward, scalar=scalar)  # the engine, not Tensor.backward
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_module_backward_hooks_fire():
    model = _model()
    seen = []
    model[2].register_full_backward_hook(lambda m, gi, go: seen.append(go[0].shape))
    run_backward(model(torch.randn(8, 6)), torch.ones(8, 16))
    assert seen == [torch.Size([8, 16])]


def test_what_it_does_not_cover_is_torchs_backward_with_torchs_errors():
    out = _model()(torch.randn(8, 6))
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        run_backward(out, torch.ones(8, 15))
    with pytest.raises(RuntimeError, match="implicitly created only for scalar outputs"):
        run_backward(out)
    with pytest.raises(RuntimeError, match="does not require grad"):
        run_backward(torch.ones(3), torch.ones(3))
    double = _model().double()(torch.randn(8, 6, dtype=torch.float64))
    with mock.patch.object(torch.Tensor, "backward", autospec=True) as slow:
        run_backward(double, torch.ones(8, 16))  # another dtype: torch decides
    slow.assert_called_once()
