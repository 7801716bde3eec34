"""Label DP and embedding DP: per-row (joint) clipping, noise of the right size, refusals."""

from __future__ import annotations

import pytest
import torch

from securevfl.privacy.mechanisms import (
    DPSGD,
    MECHANISMS,
    EmbeddingDP,
    LabelGradientDP,
    NoiseSource,
    create_mechanism,
)


def seeded(seed: int = 0) -> NoiseSource:
    return NoiseSource(seed=seed)  # reproducible, not private: tests only


def test_registry_names_the_three_mechanisms_and_their_amplification():
    assert MECHANISMS["label_dp"] is LabelGradientDP
    assert MECHANISMS["embedding_dp"] is EmbeddingDP
    assert MECHANISMS["dp_sgd"] is DPSGD
    assert not LabelGradientDP.amplified and not EmbeddingDP.amplified and DPSGD.amplified
    m = create_mechanism("label_dp", noise_multiplier=2.0, clip=0.5)
    assert isinstance(m, LabelGradientDP) and m.noise_std == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unknown DP mechanism"):
        create_mechanism("laplace", noise_multiplier=1.0, clip=1.0)


@pytest.mark.parametrize("cls", [LabelGradientDP, EmbeddingDP, DPSGD])
@pytest.mark.parametrize(
    ("sigma", "clip", "named"),
    [
        (0.0, 1.0, "noise_multiplier"),
        (-1.0, 1.0, "noise_multiplier"),
        (1.0, 0.0, "clip"),
        (1.0, -2.0, "clip"),
        (float("nan"), 1.0, "noise_multiplier"),
        (1.0, float("inf"), "clip"),
    ],
)
def test_refuses_non_positive_sigma_or_clip_naming_the_parameter(cls, sigma, clip, named):
    with pytest.raises(ValueError, match=named):
        cls(noise_multiplier=sigma, clip=clip)


@pytest.mark.parametrize("cls", [LabelGradientDP, EmbeddingDP])
def test_huge_sigma_gives_noise_std_sigma_times_clip(cls):
    sigma, clip = 1000.0, 0.5
    mech = cls(noise_multiplier=sigma, clip=clip, generator=seeded(1))
    values = torch.randn(2000, 64)
    out = mech.apply(values)
    noise = out - values * torch.clamp(clip / values.norm(dim=1, keepdim=True), max=1.0)
    assert noise.mean().abs().item() < 0.01 * sigma * clip
    assert noise.std().item() == pytest.approx(sigma * clip, rel=0.02)


@pytest.mark.parametrize("cls", [LabelGradientDP, EmbeddingDP])
def test_tiny_sigma_rows_are_clipped_to_norm_c_and_small_rows_kept(cls):
    clip = 1.0
    mech = cls(noise_multiplier=1e-9, clip=clip, generator=seeded(2))
    values = torch.randn(500, 16) * torch.logspace(-2, 2, 500).unsqueeze(1)
    out = mech.apply(values)
    norms = out.norm(dim=1)
    assert (norms <= clip + 1e-5).all()
    small = values.norm(dim=1) < clip
    assert small.any() and (~small).any()
    torch.testing.assert_close(out[small], values[small], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(norms[~small], torch.ones_like(norms[~small]), atol=1e-5, rtol=0)
    # clipping scales a row, it never turns it
    cos = torch.nn.functional.cosine_similarity(out, values, dim=1)
    assert (cos > 1 - 1e-5).all()


def test_label_dp_clips_rows_jointly_across_tensors():
    clip = 1.0
    mech = LabelGradientDP(noise_multiplier=1e-9, clip=clip, generator=seeded(3))
    # each tensor alone is within the clip (0.8), the row together is not (sqrt(1.28))
    a = torch.full((4, 4), 0.4)
    b = torch.full((4, 1), 0.8)
    out = mech.apply({"group_a": a, "group_b": b})
    assert list(out) == ["group_a", "group_b"]
    joint = torch.cat([out["group_a"], out["group_b"]], dim=1).norm(dim=1)
    torch.testing.assert_close(joint, torch.ones(4), atol=1e-5, rtol=0)
    # one factor per row, shared by every tensor
    factor_a = out["group_a"] / a
    factor_b = out["group_b"] / b
    torch.testing.assert_close(factor_a, factor_b.expand_as(factor_a), atol=1e-6, rtol=0)
    assert factor_b.max() < 0.9


def test_label_dp_noise_on_every_tensor_and_inputs_untouched():
    mech = LabelGradientDP(noise_multiplier=1.0, clip=1.0, generator=seeded(4))
    g = {"x": torch.zeros(3, 2), "y": torch.zeros(3, 5, 2)}
    before = {k: v.clone() for k, v in g.items()}
    out = mech.apply(g)
    assert out["y"].shape == (3, 5, 2)
    assert all((out[k] != 0).all() for k in g)
    assert all(torch.equal(g[k], before[k]) for k in g)


def test_same_generator_seed_same_noise_and_unseeded_mechanisms_differ():
    x = torch.randn(8, 3)
    a = LabelGradientDP(noise_multiplier=1.0, clip=1.0, generator=seeded(7)).apply(x)
    b = LabelGradientDP(noise_multiplier=1.0, clip=1.0, generator=seeded(7)).apply(x)
    assert torch.equal(a, b)
    torch.manual_seed(0)
    c = LabelGradientDP(noise_multiplier=1.0, clip=1.0).apply(x)
    torch.manual_seed(0)
    d = LabelGradientDP(noise_multiplier=1.0, clip=1.0).apply(x)
    assert not torch.equal(c, d), "default noise must not follow the global torch seed"


def test_refuses_inputs_that_would_defeat_the_clip():
    mech = LabelGradientDP(noise_multiplier=1.0, clip=1.0)
    with pytest.raises(ValueError, match="same number of rows"):
        mech.apply({"a": torch.zeros(3, 2), "b": torch.zeros(4, 2)})
    with pytest.raises(ValueError, match="NaN"):
        mech.apply(torch.tensor([[float("nan"), 0.0]]))
    with pytest.raises(ValueError, match="nothing to release"):
        mech.apply({})
    with pytest.raises(TypeError, match="floating"):
        mech.apply(torch.ones(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="row dimension"):
        mech.apply(torch.tensor(1.0))
    with pytest.raises(TypeError, match="tensor or a mapping"):
        EmbeddingDP(noise_multiplier=1.0, clip=1.0).apply([torch.zeros(2, 2)])


def test_embedding_dp_lets_backward_through_the_clip():
    mech = EmbeddingDP(noise_multiplier=0.5, clip=1.0, generator=seeded(5))
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(6, 4) * 10
    rep = x @ w
    released = mech.apply(rep)
    released.backward(torch.ones_like(released))
    assert w.grad is not None and torch.isfinite(w.grad).all()
    # the gradient is that of the clipped map: zero noise and autograd agree with the formula
    w.grad = None
    rep = x @ w
    norms = rep.norm(dim=1, keepdim=True)
    (rep * torch.clamp(1.0 / norms, max=1.0)).sum().backward()
    expected = w.grad.clone()
    w.grad = None
    mech2 = EmbeddingDP(noise_multiplier=1e-12, clip=1.0, generator=seeded(5))
    mech2.apply(x @ w).sum().backward()
    torch.testing.assert_close(w.grad, expected, atol=1e-5, rtol=1e-4)


def test_an_empty_batch_releases_nothing_and_huge_rows_clip_exactly():
    mech = LabelGradientDP(noise_multiplier=1e-9, clip=1.0, generator=seeded(6))
    out = mech.apply({"a": torch.zeros(0, 3), "b": torch.zeros(0, 2, 2)})
    assert out["a"].shape == (0, 3) and out["b"].shape == (0, 2, 2)
    big = torch.full((2, 4), 1e30)  # its squared norm overflows float32
    assert mech.apply(big).norm(dim=1).tolist() == pytest.approx([1.0, 1.0], abs=1e-5)


def test_release_noise_is_float64_from_a_csprng_seeded_source_and_snapped():
    """Label and embedding DP draw float64 noise from a source seeded by the OS CSPRNG (fresh
    per source), never torch's default generator; the release is snapped to a grid of
    2^-12 noise standard deviations, so its low bits do not depend on the exact value."""
    import math

    from securevfl.privacy.mechanisms import SNAP_BITS

    a = LabelGradientDP(noise_multiplier=1.0, clip=1.0)
    b = LabelGradientDP(noise_multiplier=1.0, clip=1.0)
    assert a.noise_source.private and b.noise_source.private
    x = torch.zeros(64, 8, dtype=torch.float64)
    ra, rb = a.apply(x), b.apply(x)
    assert not torch.equal(ra, rb)  # independent sources
    grid = 2.0 ** (math.floor(math.log2(a.noise_std)) - SNAP_BITS)
    assert torch.equal(torch.round(ra / grid) * grid, ra)
    assert ra.std().item() == pytest.approx(1.0, rel=0.2)
    with pytest.raises(TypeError, match="NoiseSource"):
        LabelGradientDP(noise_multiplier=1.0, clip=1.0, generator=torch.Generator()).apply(x)
    seeded_a = LabelGradientDP(noise_multiplier=1.0, clip=1.0, generator=NoiseSource(seed=3))
    seeded_b = LabelGradientDP(noise_multiplier=1.0, clip=1.0, generator=NoiseSource(seed=3))
    assert torch.equal(seeded_a.apply(x), seeded_b.apply(x))
    assert not seeded_a.noise_source.private


def test_a_seeded_noise_config_is_marked_not_private_in_the_ledger(tmp_path):
    from securevfl.config import parse_config
    from securevfl.privacy.ledger import PrivacyLedger
    from securevfl.privacy.runtime import RolePrivacy, plan_role
    from tests.securevfl.conftest import BASE_RAW, permissive_policy

    raw = permissive_policy(dict(BASE_RAW))
    raw["privacy"] = {"label_dp": {"noise_multiplier": 1.0, "clip": 1.0}, "noise_seed": 7}
    cfg = parse_config(raw, source=tmp_path / "c.toml")
    ledger = PrivacyLedger(tmp_path / "ledger.jsonl")
    RolePrivacy(plan=plan_role(cfg, role="active", n_train=1000), ledger=ledger)
    marks = [e for e in ledger.events if isinstance(e, dict) and "noise_seed" in e["reason"]]
    assert marks and marks[0]["what"] == "label_dp noise"
