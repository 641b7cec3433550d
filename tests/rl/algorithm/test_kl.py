"""The KL penalty to the reference policy and the advantage baselines, with NeMo-RL's meaning of their keys."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.algorithm.batch import group_advantages
from megatron_fp8.rl.algorithm.correction import ppo_loss
from megatron_fp8.rl.algorithm.kl import KLSettings, per_token_kl


def _pair():
    logp = torch.tensor([[-1.0, -2.0, -0.5, float("-inf")], [-0.3, -4.0, float("nan"), 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -2.0], [-0.3, -30.0, -1.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    return logp, ref, mask


@pytest.mark.parametrize(
    ("kind", "rule"),
    [
        ("k1", lambda lr: -lr),
        ("k2", lambda lr: lr * lr / 2),
        ("k3", lambda lr: math.exp(lr) - 1 - lr),
    ],
)
def test_each_estimator_by_hand_with_clamps_and_zero_padding(kind, rule):
    logp, ref, mask = _pair()
    settings = KLSettings(coef=0.1, kind=kind, input_clamp=20.0, output_clamp=10.0)
    kl = per_token_kl(logp, ref, settings, mask=mask)
    for (b, t), real in zip(
        ((0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)), mask.flatten().tolist(), strict=True
    ):
        if not real:
            assert kl[b, t] == 0.0  # padding, whatever it holds (-inf, NaN)
            continue
        log_r = max(-20.0, min(20.0, float(ref[b, t] - logp[b, t])))
        assert float(kl[b, t]) == pytest.approx(max(-10.0, min(10.0, rule(log_r))), rel=1e-6, abs=1e-7)
    # (1, 1): log(pi_ref / pi) = -26 is clamped to -20 before the estimator
    if kind == "k2":
        assert float(kl[1, 1]) == 10.0  # 200 clamped on output


def test_the_gradient_is_nemo_rls_on_policy_estimate():
    """With weight exp(logp - sg(logp)) (value 1), d/dlogp [w * k3] = k3 + (1 - pi_ref / pi) = logp - logp_ref: the
    gradient of the true KL's score-function estimate, not only the estimator's own derivative."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    kl = per_token_kl(logp, ref, KLSettings(coef=1.0, kind="k3", input_clamp=None, output_clamp=None), mask=mask)
    kl.sum().backward()
    torch.testing.assert_close(logp.grad, (logp - ref).detach(), rtol=1e-6, atol=1e-6)


def test_an_input_clamp_stops_the_gradient_of_the_weight_and_padding_gets_none():
    logp = torch.tensor([[-1.0, -40.0, float("-inf")]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False]])
    kl = per_token_kl(logp, ref, KLSettings(coef=1.0, kind="k1", input_clamp=20.0, output_clamp=None), mask=mask)
    kl.sum().backward()
    assert float(kl[0, 1]) == -20.0
    assert logp.grad.tolist() == [[1.0, 0.0, 0.0]]  # clamped: no gradient at all; padding: 0, not NaN


def test_on_policy_approximation_weights_by_the_rollout_ratio():
    logp, ref, mask = _pair()
    rollout = logp.clone()
    rollout[0, 0] = -2.0  # pi / pi_rollout = e at that token
    base = per_token_kl(logp, ref, KLSettings(coef=1.0), mask=mask)
    weighted = per_token_kl(
        logp, ref, KLSettings(coef=1.0, on_policy_approximation=True), mask=mask, logp_rollout=rollout
    )
    assert float(weighted[0, 0]) == pytest.approx(math.e * float(base[0, 0]), rel=1e-6)
    torch.testing.assert_close(weighted[:, 1:], base[:, 1:])
    with pytest.raises(ConfigError, match="rollout log-probs"):
        per_token_kl(logp, ref, KLSettings(coef=1.0, on_policy_approximation=True), mask=mask)


@pytest.mark.parametrize("bad", [{"kind": "k4"}, {"coef": -0.1}, {"input_clamp": 0.0}, {"output_clamp": -1.0}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        KLSettings(**({"coef": 0.1} | bad))


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_the_penalty_is_aggregated_like_the_policy_gradient_and_added(aggregation):
    logp, ref, mask = _pair()
    logp = torch.where(mask, logp, torch.zeros_like(logp))
    adv = torch.tensor([1.0, -0.5])
    plain, _ = ppo_loss(logp, logp, adv, mask, aggregation=aggregation)
    penalty = 0.05 * per_token_kl(logp, ref, KLSettings(coef=0.05), mask=mask)
    total, stats = ppo_loss(logp, logp, adv, mask, aggregation=aggregation, penalty=penalty)
    if aggregation == "token-mean":
        want = float(penalty[mask].sum() / mask.sum())
    else:
        want = float(sum(penalty[i][mask[i]].mean() for i in range(2)) / 2)
    assert float(stats.kl_penalty) == pytest.approx(want, rel=1e-6)
    assert float(total) == pytest.approx(float(plain) + want, rel=1e-6)


def test_grpo_advantages_with_and_without_nemo_rls_switches():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # whole group: mean 1/2, sample std sqrt(1/3)
    h = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(group_advantages(r), torch.tensor([h, -h, -h, h]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(group_advantages(r, normalize=False), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    # leave one out: r=1 -> others (0, 0, 1): mean 1/3, sample std sqrt(1/3); r=0 -> others (0, 1, 1): mean 2/3
    loo = (2 / 3) / math.sqrt(1 / 3)
    torch.testing.assert_close(
        group_advantages(r, leave_one_out=True), torch.tensor([loo, -loo, -loo, loo]), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        group_advantages(r, leave_one_out=True, normalize=False), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    )
    # two responses, leave one out: the other one is the baseline and its deviation is undefined (not divided)
    torch.testing.assert_close(
        group_advantages(torch.tensor([[1.0, 0.0]]), leave_one_out=True), torch.tensor([1.0, -1.0])
    )
    # a group without variation is never sharpened
    assert group_advantages(torch.full((1, 5), 0.7), leave_one_out=True).abs().max() < 1e-6


def test_leave_one_out_matches_the_definition_on_random_groups():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(6, 8, generator=g)
    got = group_advantages(r, leave_one_out=True).view(6, 8)
    for p in range(6):
        for i in range(8):
            others = torch.cat([r[p, :i], r[p, i + 1 :]]).double()
            want = (r[p, i] - others.mean()) / (others.std(unbiased=True) + 1e-6)
            assert float(got[p, i]) == pytest.approx(float(want), rel=1e-5)
