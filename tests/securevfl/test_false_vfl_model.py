"""FALSE-VFL model and math, single process (securevfl.methods.false_vfl.model and .reference):
the IWAE property, the posterior aggregation, the split computation through the party sums
against one autograd graph, the MNAR mask likelihood, and a learning check on scikit-learn's
digits."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from securevfl.methods.false_vfl.digits import (
    DigitsSettings,
    digits_data,
    digits_experiment,
    missing_mask,
)
from securevfl.methods.false_vfl.model import (
    SUM_COUNT,
    SUM_DLOGLIK_DH,
    SUM_LOGLIK,
    SUM_MU,
    SUM_PREC,
    SUM_PREC_MU,
    FalseVFLActive,
    FalseVFLConfig,
    FalseVFLParty,
    gaussian_log_density,
)
from securevfl.methods.false_vfl.reference import (
    FalseVFLReference,
    Noise,
    ReferenceParty,
    TrainSchedule,
    secure_sum,
)

SMALL = FalseVFLConfig(
    d_h=6, d_z=3, hidden=(16,), mask_hidden=(12, 12), disc_hidden=(12,), kappa=5, n_predict=7
)
D_PARTS = (3, 2, 4)


def _data(n: int, *, seed: int, dtype=torch.float32):
    """Blocks [n, d_k] and a presence mask with every pattern the tests need: row 0 fully held,
    row 1 held by the first party only, row 2 by none, the rest random."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, d, generator=g, dtype=dtype) for d in D_PARTS]
    present = torch.rand(n, len(D_PARTS), generator=g) < 0.6
    present[0] = True
    present[1] = torch.tensor([True, False, False])
    present[2] = False
    # the parties must never read their missing rows
    for k, x in enumerate(xs):
        x[~present[:, k]] = float("nan")
    return xs, present


def _model(cfg: FalseVFLConfig = SMALL, seed: int = 0, dtype=torch.float32) -> FalseVFLReference:
    ref = FalseVFLReference(D_PARTS, 4, cfg, seed=seed)
    for module in (*ref.parties, ref.active):
        module.to(dtype)
    return ref


# ---- (1) IWAE property ------------------------------------------------------------------------


@pytest.mark.parametrize("mnar", [False, True])
def test_bound_non_decreasing_in_kappa(mnar):
    ref = _model(replace(SMALL, mnar=mnar), seed=1)
    xs, present = _data(48, seed=2)
    n_draws = 40
    # independent draws as repeated rows of one batch (each row gets its own noise)
    xs_rep, present_rep = [x.repeat(n_draws, 1) for x in xs], present.repeat(n_draws, 1)
    kappas = (1, 2, 5, 20, 80)
    means, ses = [], []
    for kappa in kappas:
        draws = ref.bound(xs_rep, present_rep, kappa).reshape(n_draws, -1)  # [draws, n]
        assert torch.isfinite(draws).all()
        means.append(float(draws.mean()))
        ses.append(float(draws.mean(1).std()) / math.sqrt(draws.shape[0]))
    for i in range(len(kappas) - 1):
        slack = 3.0 * math.hypot(ses[i], ses[i + 1])
        assert means[i + 1] >= means[i] - slack, (kappas, means, ses)
    assert means[-1] > means[0] + 3.0 * math.hypot(ses[0], ses[-1]), (means, ses)


# ---- (2) posterior aggregation ----------------------------------------------------------------


def _encodings(ref: FalseVFLReference, xs, present):
    mus, precs = [], []
    for k, (p, x) in enumerate(zip(ref.parties, xs, strict=True)):
        with torch.no_grad():
            mu, logvar = p.encode(x, present[:, k])
        mus.append(mu.double().numpy())
        precs.append(np.exp(-logvar.double().numpy()))
    return np.stack(mus, 1), np.stack(precs, 1)  # [n, K, d_h]


@pytest.mark.parametrize("aggregation", ["poe", "mean"])
def test_aggregated_posterior_matches_closed_form(aggregation):
    ref = _model(replace(SMALL, aggregation=aggregation), seed=3)
    xs, present = _data(12, seed=4)
    contributions = [
        p.forward_posterior(x, present[:, k])
        for k, (p, x) in enumerate(zip(ref.parties, xs, strict=True))
    ]
    for k, c in enumerate(contributions):
        missing = ~present[:, k]
        for key, value in c.items():
            assert torch.isfinite(value).all(), key
            assert (value[missing] == 0).all(), key
    sums = secure_sum(contributions)
    assert set(sums) == {SUM_MU if aggregation == "mean" else SUM_PREC_MU, SUM_PREC, SUM_COUNT}
    assert torch.equal(sums[SUM_COUNT], present.sum(1).float())
    mu_q, logvar_q = ref.active.aggregate(sums)
    mu_q, var_q = mu_q.double().numpy(), np.exp(logvar_q.double().numpy())

    mus, precs = _encodings(ref, xs, present)
    a = present.numpy()[:, :, None]
    if aggregation == "poe":
        # product of the observed experts and the prior N(0, I)
        precision = 1.0 + (a * precs).sum(1)
        mean = (a * precs * mus).sum(1) / precision
    else:
        # Eq. (1): average of the observed means, summed precisions; none held -> N(0, I)
        count = a.sum(1)
        held = count > 0
        precision = np.where(held, (a * precs).sum(1), 1.0)
        mean = np.where(held, (a * mus).sum(1) / np.maximum(count, 1), 0.0)
    np.testing.assert_allclose(var_q, 1.0 / precision, rtol=1e-5)
    np.testing.assert_allclose(mu_q, mean, rtol=1e-4, atol=1e-5)
    # the row no party holds is exactly the prior N(0, I)
    np.testing.assert_array_equal(mu_q[2], 0.0)
    np.testing.assert_allclose(var_q[2], 1.0)
    # the single-party row is that party's own Gaussian (times the prior under "poe")
    own = 1.0 + precs[1, 0] if aggregation == "poe" else precs[1, 0]
    np.testing.assert_allclose(var_q[1], 1.0 / own, rtol=1e-5)

    if aggregation == "poe":
        # as densities: log q(h) - [sum_obs log N(h; mu_k, 1/P_k) + log N(h; 0, I)] is one
        # constant per row (the normaliser of the product), whatever h is
        rng = np.random.default_rng(0)
        for i in range(len(mean)):
            obs = np.flatnonzero(present[i].numpy())
            diffs = []
            for _ in range(5):
                h = rng.normal(size=mean.shape[1]) * 2.0
                log_q = _log_normal(h, mean[i], 1.0 / precision[i])
                log_prod = _log_normal(h, 0.0, 1.0) + sum(
                    _log_normal(h, mus[i, k], 1.0 / precs[i, k]) for k in obs
                )
                diffs.append(log_q - log_prod)
            np.testing.assert_allclose(diffs, diffs[0], rtol=1e-6, atol=1e-6)


def _log_normal(h, mu, var):
    return float(-0.5 * np.sum(np.log(2 * np.pi * var) + (h - mu) ** 2 / var))


# ---- (3) split computation == one autograd graph ----------------------------------------------


@pytest.mark.parametrize(
    "aggregation, mnar", [("mean", False), ("poe", False), ("mean", True), ("poe", True)]
)
def test_split_through_sums_equals_joint_autograd(aggregation, mnar):
    cfg = replace(SMALL, aggregation=aggregation, mnar=mnar)
    ref = _model(cfg, seed=5, dtype=torch.float64)
    xs, present = _data(20, seed=6, dtype=torch.float64)
    noise = ref.draw_noise(20, cfg.kappa)
    noise = Noise(
        noise.eps_h.double(),
        noise.eps_z.double(),
        [None if e is None else e.double() for e in noise.eps_x],
    )
    params = dict(
        [(f"p{k}.{n}", q) for k, p in enumerate(ref.parties) for n, q in p.named_parameters()]
        + [(f"a.{n}", q) for n, q in ref.active.named_parameters()]
    )

    def grads():
        out = {n: (None if q.grad is None else q.grad.clone()) for n, q in params.items()}
        for q in params.values():
            q.grad = None
        return out

    loss_split = ref.stage1_split(xs, present, noise)
    g_split = grads()
    loss_joint = ref.joint_stage1_loss(xs, present, noise)
    loss_joint.backward()
    g_joint = grads()

    assert torch.isfinite(loss_split)
    torch.testing.assert_close(loss_split, loss_joint.detach(), rtol=1e-10, atol=1e-10)
    for name in params:
        if name.startswith("a.discriminator"):
            # stage 1 never touches phi
            assert g_split[name] is None and g_joint[name] is None, name
            continue
        assert g_split[name] is not None, name
        torch.testing.assert_close(g_split[name], g_joint[name], rtol=1e-9, atol=1e-10)
    if mnar:
        # the mask models are trained by stage 1
        assert any(g_split[n].abs().sum() > 0 for n in params if "mask_model" in n)


def test_backward_message_shapes_and_identity():
    cfg = replace(SMALL, mnar=True)
    ref = _model(cfg, seed=7)
    xs, present = _data(9, seed=8)
    sums1 = secure_sum(
        [
            p.forward_posterior(x, present[:, k], train=True)
            for k, (p, x) in enumerate(zip(ref.parties, xs, strict=True))
        ]
    )
    h = ref.active.begin(sums1, cfg.kappa, train=True)
    assert h.shape == (9, cfg.kappa, cfg.d_h) and not h.requires_grad
    sums2 = secure_sum([p.forward_loglik(h, train=True) for p in ref.parties])
    assert sums2[SUM_LOGLIK].shape == (9, cfg.kappa)
    assert sums2[SUM_DLOGLIK_DH].shape == (9, cfg.kappa, cfg.d_h)
    loss, message = ref.active.finish_stage1(sums2[SUM_LOGLIK], sums2[SUM_DLOGLIK_DH])
    first = SUM_PREC_MU if cfg.aggregation == "poe" else SUM_MU
    assert set(message) == {first, SUM_PREC, SUM_LOGLIK}
    assert message[first].shape == message[SUM_PREC].shape == (9, cfg.d_h)
    assert message[SUM_LOGLIK].shape == (9, cfg.kappa)
    # d loss / d loglik_ij = -softmax_j(log w_i) / n: a probability vector per row
    torch.testing.assert_close(message[SUM_LOGLIK].sum(1), torch.full((9,), -1.0 / 9))
    for p in ref.parties:
        p.backward(message)  # one message, sent unchanged to every party
    with pytest.raises(RuntimeError):
        ref.parties[0].backward(message)  # graph consumed
    assert torch.isfinite(loss)


# ---- stage 2 and prediction -------------------------------------------------------------------


def test_stage2_updates_phi_only_and_prediction_is_a_distribution():
    ref = _model(seed=9)
    xs, present = _data(16, seed=10)
    y = torch.arange(16) % 4
    loss = ref.stage2_loss(xs, present, y)
    loss.backward()
    for p in ref.parties:
        assert all(q.grad is None for q in p.parameters())
        assert p._posterior is None and p._loglik is None  # nothing kept for a backward
    assert all(q.grad is None for q in ref.active.generative_parameters())
    assert all(q.grad is not None for q in ref.active.discriminator.parameters())
    proba = ref.predict_proba(xs, present, batch=5)
    assert proba.shape == (16, 4)
    torch.testing.assert_close(proba.sum(1), torch.ones(16))


def test_conditional_bound_is_weighted_mixture_plus_marginal_bound():
    active = FalseVFLActive(3, SMALL, seed=0)
    g = torch.Generator().manual_seed(0)
    log_w = torch.randn(5, 4, generator=g) * 3
    h = torch.randn(5, 4, SMALL.d_h, generator=g)
    y = torch.tensor([0, 1, 2, 0, 1])
    got = active.conditional_bound(log_w, h, y)
    mix = active.predict_proba(log_w, h).gather(1, y[:, None]).squeeze(1)
    torch.testing.assert_close(got, torch.log(mix) + FalseVFLActive.iwae_bound(log_w))


# ---- (4) the MNAR mask likelihood -------------------------------------------------------------


def test_mnar_mask_likelihood_has_the_paper_form():
    cfg = replace(SMALL, mnar=True)
    party = FalseVFLParty(4, cfg, seed=11)
    g = torch.Generator().manual_seed(12)
    n, s = 10, 6
    x = torch.randn(n, 4, generator=g)
    present = torch.rand(n, generator=g) < 0.5
    present[:2] = torch.tensor([True, False])
    x[~present] = float("nan")
    h = torch.randn(n, s, cfg.d_h, generator=g)
    eps = torch.randn(n, s, 4, generator=g)
    terms = party.loglik_terms(x, present, h, eps)

    # direct formula, from the raw networks
    out = party.decoder(h.reshape(-1, cfg.d_h)).reshape(n, s, 8)
    mean, logvar = out[..., :4], out[..., 4:].clamp(cfg.decoder_logvar_min, cfg.logvar_max)
    x_hat = mean + torch.exp(0.5 * logvar) * eps
    p_hat = torch.sigmoid(party.mask_model(x_hat.reshape(-1, 4)).reshape(n, s))
    x0 = torch.nan_to_num(x)
    p_obs = torch.sigmoid(party.mask_model(x0).reshape(n, 1))
    log_bern0 = torch.log(1 - p_obs).expand(n, s)  # log Bern(m = 0; psi(x^k)) on held rows
    log_bern1 = torch.log(p_hat)  # log Bern(m = 1; psi(x_hat)) on missing rows
    expected_mask = torch.where(present[:, None], log_bern0, log_bern1)
    torch.testing.assert_close(terms["mask"], expected_mask, rtol=1e-5, atol=1e-5)
    # held-row mask term is the same for every importance sample
    assert torch.allclose(terms["mask"][0], terms["mask"][0, :1].expand(s))
    gauss = -0.5 * (math.log(2 * math.pi) + logvar + (x0[:, None] - mean) ** 2 / logvar.exp())
    expected_dec = torch.where(present[:, None], gauss.sum(-1), torch.zeros(n, s))
    torch.testing.assert_close(terms["decoder"], expected_dec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(party.loglik(x, present, h, eps), expected_dec + expected_mask)
    # x_hat is reparameterised: the missing rows' mask term trains the decoder
    terms["mask"][~present].sum().backward()
    assert any(q.grad is not None and q.grad.abs().sum() > 0 for q in party.decoder.parameters())


def test_gaussian_log_density_matches_torch():
    g = torch.Generator().manual_seed(0)
    v, mu, lv = (torch.randn(3, 5, generator=g) for _ in range(3))
    ref = torch.distributions.Normal(mu, torch.exp(0.5 * lv)).log_prob(v).sum(-1)
    torch.testing.assert_close(gaussian_log_density(v, mu, lv), ref)


# ---- refusals ---------------------------------------------------------------------------------


def test_refusals():
    with pytest.raises(ValueError):
        FalseVFLConfig(aggregation="sum")
    with pytest.raises(ValueError):
        FalseVFLConfig(kappa=0)
    with pytest.raises(ValueError):
        secure_sum([])
    with pytest.raises(ValueError):
        secure_sum([{"a": torch.zeros(2)}, {"b": torch.zeros(2)}])
    party = ReferenceParty(3, SMALL, seed=0)
    with pytest.raises(RuntimeError):
        party.forward_loglik(torch.zeros(2, 1, SMALL.d_h))
    with pytest.raises(RuntimeError):
        party.mask_logits(torch.zeros(2, 3))
    with pytest.raises(ValueError):
        party.encode(torch.zeros(2, 4), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError):
        missing_mask("mcar9", [np.zeros((2, 3))], np.random.default_rng(0))


def test_missingness_mechanisms_keep_one_block():
    data = digits_data(train_mechanism="mnar7", test_mechanisms=("mcar5", "mar1", "mar2"))
    assert data.train_present.any(1).all()
    assert data.train_present[data.labeled][:100].all()
    assert data.aligned.sum() >= 100
    for present in data.test_present.values():
        assert present.any(1).all()
    # MNAR 7 drops negative-mean pieces more often
    means = np.stack([b.mean(1) for b in data.train_x], 1)[100:]
    drop = ~data.train_present[100:]
    assert drop[means < 0].mean() > drop[means >= 0].mean() + 0.2


# ---- (5) learning on digits -------------------------------------------------------------------


# ~7 s of one core (1297 training rows, 500 test rows); the full setting is DigitsSettings()
FAST = DigitsSettings(
    cfg=FalseVFLConfig(
        d_h=16, d_z=8, hidden=(32,), mask_hidden=(32, 32), disc_hidden=(64,), kappa=5, n_predict=20
    ),
    schedule=TrainSchedule(
        stage1_epochs=60,
        stage1_lr=3e-3,
        stage1_batch=128,
        stage2_epochs=20,
        stage2_lr=3e-3,
        stage2_batch=100,
    ),
    vanilla_epochs=100,
)


# a quality experiment (20-30 s on 2 cores): `make test-slow`; in CI the fixed-seed results of
# every method's example are held by tests/securevfl/test_example_goldens.py
@pytest.mark.slow
def test_digits_quick_false_vfl_beats_vanilla_under_mcar5(one_torch_thread):
    res = digits_experiment(
        train_mechanism="mcar5",
        test_mechanisms=("mcar0", "mcar5"),
        methods=("vanilla", "false1"),
        settings=FAST,
    )
    acc = res["accuracy"]
    assert res["settings"]["n_aligned_labeled"] >= 100
    assert acc["false1"]["mcar5"] > 50.0, acc
    # measured at seed 0 (poe): FALSE-VFL-I 84.4 / 71.2, vanilla 89.6 / 65.2 (MCAR 0 / MCAR 5)
    assert acc["false1"]["mcar5"] >= acc["vanilla"]["mcar5"] + 3.0, acc
    gap0 = acc["false1"]["mcar0"] - acc["vanilla"]["mcar0"]
    gap5 = acc["false1"]["mcar5"] - acc["vanilla"]["mcar5"]
    assert gap5 > gap0, acc


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_digits_issue_floor_mcar5(one_torch_thread):
    """The issue's floor, single process, full setting: trained under MCAR 5, FALSE-VFL-I beats
    vanilla VFL by >= 5 points at test MCAR 5, and its gap grows from test MCAR 0 to MCAR 5
    (measured at seed 0 with aggregation "mean": FALSE-VFL-I 90.6 / 77.8, vanilla 90.2 / 66.4;
    ~4 min of one core)."""
    acc = digits_experiment(
        train_mechanism="mcar5", test_mechanisms=("mcar0", "mcar5"), methods=("vanilla", "false1")
    )["accuracy"]
    assert acc["false1"]["mcar5"] >= acc["vanilla"]["mcar5"] + 5.0, acc
    gap0 = acc["false1"]["mcar0"] - acc["vanilla"]["mcar0"]
    assert acc["false1"]["mcar5"] - acc["vanilla"]["mcar5"] > gap0, acc


@pytest.mark.slow
@pytest.mark.timeout(5400)
def test_digits_issue_floor_mnar7(one_torch_thread):
    """Under MNAR 7 training and test, FALSE-VFL-II >= FALSE-VFL-I - 1 point, averaged over the
    eight seeds the issue was judged on (0-7, fixed before they ran). One seed's II - I spreads
    over several points either way (2026-11-25, this computation: -3.4, -2.6, +1.6, +1.8, -0.6,
    +2.0, +1.2, 0.0 at seeds 0-7, mean 0.0), so three seeds (as this test had) failed the floor
    with a mean of -1.47 while the eight hold it (~40 min of one core)."""
    diffs = []
    for seed in range(8):
        acc = digits_experiment(
            train_mechanism="mnar7",
            test_mechanisms=("mnar7",),
            methods=("false1", "false2"),
            seed=seed,
        )["accuracy"]
        diffs.append(acc["false2"]["mnar7"] - acc["false1"]["mnar7"])
    assert sum(diffs) / len(diffs) >= -1.0, diffs
