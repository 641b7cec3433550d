"""Mismatch metrics against hand computations with python math."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.algorithm.correction import ISConfig, compute_is_weights
from megatron_fp8.rl.algorithm.metrics import METRIC_KEYS, mismatch_metrics

TRAIN = [[-1.0, -2.0, -0.5, 0.0], [-0.3, -0.3, 0.0, 0.0]]
ROLL = [[-1.5, -1.0, -0.5, 3.0], [-0.1, -1.1, 0.0, 0.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0]]


def _reference() -> dict[str, float]:
    """Every metric written out over plain python lists."""
    rows_t = [[t for t, m in zip(rt, rm, strict=True) if m] for rt, rm in zip(TRAIN, MASK, strict=True)]
    rows_r = [[r for r, m in zip(rr, rm, strict=True) if m] for rr, rm in zip(ROLL, MASK, strict=True)]
    d = [t - r for rt, rr in zip(rows_t, rows_r, strict=True) for t, r in zip(rt, rr, strict=True)]
    n = len(d)
    r = [math.exp(x) for x in d]
    seq_w = [math.exp(sum(t - q for t, q in zip(rt, rr, strict=True))) for rt, rr in zip(rows_t, rows_r, strict=True)]
    nll_t = -sum(sum(x) for x in rows_t) / n
    nll_r = -sum(sum(x) for x in rows_r) / n
    return {
        "token_mult_prob_error": sum(math.exp(abs(x)) for x in d) / n,
        "gen_kl_k1": sum(-x for x in d) / n,
        "gen_kl_k3": sum(ri - 1 - math.log(ri) for ri in r) / n,
        "policy_kl_k1": sum(ri * math.log(ri) for ri in r) / n,
        "policy_kl_k3": sum(1 - ri + ri * math.log(ri) for ri in r) / n,
        "js_divergence": sum(0.5 * math.log(2 / (1 + ri)) + 0.5 * ri * math.log(2 * ri / (1 + ri)) for ri in r) / n,
        "chi2_token": sum(ri**2 for ri in r) / n - 1,
        "chi2_seq": sum(w**2 for w in seq_w) / len(seq_w) - 1,
        "ess_token": sum(r) ** 2 / (n * sum(ri**2 for ri in r)),
        "ess_seq": sum(seq_w) ** 2 / (len(seq_w) * sum(w**2 for w in seq_w)),
        "ppl_train": math.exp(nll_t),
        "ppl_rollout": math.exp(nll_r),
        "ppl_ratio": math.exp(nll_t) / math.exp(nll_r),
        "logp_abs_diff_mean": sum(abs(x) for x in d) / n,
        "logp_abs_diff_max": max(abs(x) for x in d),
        "tokens": float(n),
        "sequences": 2.0,
    }


def test_every_metric_matches_hand_computation():
    got = mismatch_metrics(
        torch.tensor(TRAIN, dtype=torch.float64), torch.tensor(ROLL, dtype=torch.float64), torch.tensor(MASK)
    )
    ref = _reference()
    assert set(got) == set(METRIC_KEYS) == set(ref)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_is_result_fractions_are_reported():
    res = compute_is_weights(
        torch.tensor(TRAIN), torch.tensor(ROLL), torch.tensor(MASK), config=ISConfig(variant="token_mask")
    )
    got = mismatch_metrics(torch.tensor(TRAIN), torch.tensor(ROLL), torch.tensor(MASK), is_result=res)
    assert got["is_masked_fraction"] == pytest.approx(2 / 5)  # e^-1 and e^0.8 leave [0.5, 2]
    assert got["is_truncated_fraction"] == 0.0
    assert got["is_weight_mean"] == pytest.approx((math.exp(0.5) + 1.0 + math.exp(-0.2)) / 5, rel=1e-6)


def test_identical_inputs_are_neutral():
    logp = torch.tensor(TRAIN)
    got = mismatch_metrics(logp, logp.clone(), torch.tensor(MASK))
    for key in ("gen_kl_k1", "gen_kl_k3", "policy_kl_k1", "policy_kl_k3", "js_divergence", "chi2_token", "chi2_seq"):
        assert got[key] == 0.0, key
    for key in ("ess_token", "ess_seq", "ppl_ratio", "token_mult_prob_error"):
        assert got[key] == 1.0, key
    assert got["ppl_train"] == got["ppl_rollout"] == pytest.approx(math.exp((1.0 + 2.0 + 0.5 + 0.3 + 0.3) / 5))


def test_empty_mask_gives_neutral_finite_values():
    got = mismatch_metrics(torch.tensor(TRAIN), torch.tensor(ROLL), torch.zeros(2, 4))
    assert all(math.isfinite(v) for v in got.values())
    assert got["tokens"] == 0.0 and got["gen_kl_k3"] == 0.0 and got["ess_seq"] == 1.0 and got["ppl_ratio"] == 1.0


def test_padding_junk_is_ignored_and_real_nonfinite_is_an_error():
    train = torch.tensor(TRAIN)
    train[0, 3] = float("nan")
    assert mismatch_metrics(train, torch.tensor(ROLL), torch.tensor(MASK))["tokens"] == 5.0
    train[0, 0] = float("-inf")
    with pytest.raises(ConfigError, match="logp_train"):
        mismatch_metrics(train, torch.tensor(ROLL), torch.tensor(MASK))
    with pytest.raises(ConfigError, match="shape|tokens"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 4))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-2, 2), min_size=6, max_size=6), st.lists(st.floats(-4, -0.01), min_size=6, max_size=6))
def test_divergences_are_nonnegative_and_ess_in_unit_interval(diffs, roll):
    lr = torch.tensor(roll).view(2, 3)
    lt = lr + torch.tensor(diffs).view(2, 3)
    got = mismatch_metrics(lt, lr, torch.ones(2, 3))
    # k3 and JS are non-negative per token; chi2 = mean(w^2) - 1 is only unbiased (E[w] = 1), so it can dip below 0
    for key in ("gen_kl_k3", "policy_kl_k3", "js_divergence"):
        assert got[key] >= -1e-12, key
    # the sampled JS estimate is bounded in expectation only: per token 0.5 log(2/(1+r)) + 0.5 r log(2r/(1+r))
    # <= 0.5 log 2 (1 + r), so the mean is <= 0.5 log 2 (1 + mean r) (it exceeds log 2 when some r is large)
    ratio_mean = float(torch.exp(lt - lr).mean())
    assert got["js_divergence"] <= 0.5 * math.log(2) * (1.0 + ratio_mean) + 1e-9
    assert 0.0 < got["ess_token"] <= 1.0 + 1e-12 and 0.0 < got["ess_seq"] <= 1.0 + 1e-12
    assert got["token_mult_prob_error"] >= 1.0
