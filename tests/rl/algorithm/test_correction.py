"""IS weights for every variant and the PPO loss, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.algorithm.correction import (
    IS_VARIANTS,
    LOSS_AGGREGATIONS,
    ISConfig,
    ISResult,
    compute_is_weights,
    ppo_loss,
)

# Two sequences; row 0 has 3 real tokens, row 1 has 2. Padding holds junk on purpose.
LOGP_OLD = [[-1.0, -2.0, -0.5, float("nan")], [-0.3, -0.3, 0.0, 0.0]]
LOGP_ROLL = [[-1.5, -1.0, -0.5, 9.0], [-0.1, -1.0, float("-inf"), 0.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0]]
# log ratios on real tokens: row 0: 0.5, -1.0, 0.0 (sum -0.5); row 1: -0.2, 0.7 (sum 0.5)
D = [[0.5, -1.0, 0.0], [-0.2, 0.7]]


def _run(**cfg) -> ISResult:
    return compute_is_weights(
        torch.tensor(LOGP_OLD), torch.tensor(LOGP_ROLL), torch.tensor(MASK, dtype=torch.bool), config=ISConfig(**cfg)
    )


def _expect(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([r + [0.0] * (4 - len(r)) for r in rows], dtype=torch.float32)


def _check(res: ISResult, rows: list[list[float]], kept: list[list[int]], truncated: float, masked: float) -> None:
    assert res.weights.dtype == torch.float32 and res.weights.shape == (2, 4)
    assert res.mask.dtype == torch.bool
    torch.testing.assert_close(res.weights, _expect(rows), rtol=1e-6, atol=1e-7)
    assert res.mask.tolist() == [[bool(x) for x in r] + [False] * (4 - len(r)) for r in kept]
    assert res.truncated_fraction == pytest.approx(truncated)
    assert res.masked_fraction == pytest.approx(masked)


E = math.exp


def test_none():
    _check(_run(variant="none"), [[1, 1, 1], [1, 1]], [[1, 1, 1], [1, 1]], 0.0, 0.0)


def test_token_tis_caps_at_c():
    # w = e^0.5, e^-1, 1 | e^-0.2, e^0.7 = 2.0138 > 2 -> 2
    res = _run(variant="token_tis", cap=2.0)
    _check(res, [[E(0.5), E(-1.0), 1.0], [E(-0.2), 2.0]], [[1, 1, 1], [1, 1]], 1 / 5, 0.0)
    assert not res.weights.requires_grad


def test_seq_is_is_the_product_and_truncates():
    _check(_run(variant="seq_is", cap=2.0), [[E(-0.5)] * 3, [E(0.5)] * 2], [[1, 1, 1], [1, 1]], 0.0, 0.0)
    _check(_run(variant="seq_is", cap=1.5), [[E(-0.5)] * 3, [1.5] * 2], [[1, 1, 1], [1, 1]], 2 / 5, 0.0)
    _check(_run(variant="seq_is", cap=None), [[E(-0.5)] * 3, [E(0.5)] * 2], [[1, 1, 1], [1, 1]], 0.0, 0.0)


@pytest.mark.parametrize("variant", ["token_mask", "icepop"])
def test_token_band_masks(variant):
    # band [0.5, 2]: e^-1 = 0.37 and e^0.7 = 2.01 fall outside
    _check(_run(variant=variant, lo=0.5, hi=2.0), [[E(0.5), 0.0, 1.0], [E(-0.2), 0.0]], [[1, 0, 1], [1, 0]], 0.0, 2 / 5)


def test_seq_mask_sum_uses_the_sum():
    # log 0.7 = -0.357: row 0 (S=-0.5) rejected, row 1 (S=0.5 <= log 2) kept, weight 1
    _check(_run(variant="seq_mask_sum", lo=0.7, hi=2.0), [[0, 0, 0], [1, 1]], [[0, 0, 0], [1, 1]], 0.0, 3 / 5)


def test_seq_mask_geo_uses_the_mean():
    # geometric means: row 0 exp(-0.5/3)=0.846, row 1 exp(0.25)=1.284
    _check(_run(variant="seq_mask_geo", lo=0.7, hi=2.0), [[1, 1, 1], [1, 1]], [[1, 1, 1], [1, 1]], 0.0, 0.0)
    _check(_run(variant="seq_mask_geo", lo=0.7, hi=1.2), [[1, 1, 1], [0, 0]], [[1, 1, 1], [0, 0]], 0.0, 2 / 5)
    _check(_run(variant="seq_mask_geo", lo=0.9, hi=2.0), [[0, 0, 0], [1, 1]], [[0, 0, 0], [1, 1]], 0.0, 3 / 5)


def test_seq_mask_tis_combines_geo_mask_and_token_tis():
    _check(
        _run(variant="seq_mask_tis", lo=0.5, hi=1.2, cap=2.0),
        [[E(0.5), E(-1.0), 1.0], [0.0, 0.0]],
        [[1, 1, 1], [0, 0]],
        0.0,
        2 / 5,
    )
    _check(
        _run(variant="seq_mask_tis", lo=0.5, hi=2.0, cap=2.0),
        [[E(0.5), E(-1.0), 1.0], [E(-0.2), 2.0]],
        [[1, 1, 1], [1, 1]],
        1 / 5,
        0.0,
    )


def test_every_registered_variant_is_tested():
    assert set(IS_VARIANTS) == {
        "none",
        "token_tis",
        "seq_is",
        "token_mask",
        "icepop",
        "seq_mask_sum",
        "seq_mask_geo",
        "seq_mask_tis",
    }


def test_log_ratio_clamp_keeps_weights_finite():
    old = torch.tensor([[0.0, 0.0]])
    roll = torch.tensor([[-30.0, -1000.0]])
    res = compute_is_weights(old, roll, torch.ones(1, 2), config=ISConfig(variant="seq_is", cap=None))
    assert res.log_ratio.tolist() == [[20.0, 20.0]]
    # sum 40 is clamped to 20 as well before exp
    torch.testing.assert_close(res.weights, torch.full((1, 2), E(20.0)), rtol=1e-6, atol=0)
    res = compute_is_weights(old, roll, torch.ones(1, 2), config=ISConfig(variant="token_tis", log_ratio_clamp=5.0))
    assert res.weights.tolist() == [[2.0, 2.0]] and res.truncated_fraction == 1.0


@pytest.mark.parametrize("variant", sorted(IS_VARIANTS))
def test_all_masked_gives_finite_zeros(variant):
    cap = None if variant == "seq_is" else 2.0
    res = compute_is_weights(
        torch.tensor(LOGP_OLD), torch.tensor(LOGP_ROLL), torch.zeros(2, 4), config=ISConfig(variant=variant, cap=cap)
    )
    assert torch.equal(res.weights, torch.zeros(2, 4))
    assert not res.mask.any()
    assert res.truncated_fraction == 0.0 and res.masked_fraction == 0.0


def test_config_errors_name_the_valid_choices():
    with pytest.raises(ConfigError, match="token_tis"):
        ISConfig(variant="tis")
    with pytest.raises(ConfigError, match="cap"):
        ISConfig(variant="token_tis", cap=-1.0)
    assert ISConfig(variant="token_tis", cap=None).cap is None  # no truncation: NeMo-RL's plain token IS
    with pytest.raises(ConfigError, match="lo < hi"):
        ISConfig(variant="token_mask", lo=2.0, hi=1.0)
    with pytest.raises(ConfigError, match="same"):
        compute_is_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 4))
    with pytest.raises(ConfigError, match="NaN"):
        compute_is_weights(torch.tensor([[float("nan")]]), torch.zeros(1, 1), torch.ones(1, 1))


# --------------------------------------------------------------------------- PPO loss


def _ppo_reference(r: float, a: float, w: float, lo: float = 0.2, hi: float = 0.2) -> tuple[float, float]:
    """(loss, d loss / d logp_new) for one token, straight from the PPO definition."""
    unclipped = -a * r
    clipped = -a * min(max(r, 1 - lo), 1 + hi)
    if unclipped >= clipped:  # the unclipped branch is the max: gradient flows through r
        return w * unclipped, w * (-a * r)
    return w * clipped, 0.0


def test_ppo_token_mean_values_and_gradient():
    ratios = [1.5, 1.1, 0.5, 1.5]
    advs = [1.0, 1.0, -1.0, -1.0]
    weights = [2.0, 0.5, 1.0, 1.0]
    old = torch.tensor([[-1.0, -2.0, -0.7, -0.2, 0.0]])
    new = (old + torch.log(torch.tensor([[*ratios, 1.0]]))).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    loss, stats = ppo_loss(new, old, torch.tensor([[*advs, 5.0]]), mask, is_weights=torch.tensor([[*weights, 9.0]]))
    ref = [_ppo_reference(r, a, w) for r, a, w in zip(ratios, advs, weights, strict=True)]
    assert loss.item() == pytest.approx(sum(x[0] for x in ref) / 4, rel=1e-6)
    loss.backward()
    expected_grad = [g / 4 for _, g in ref] + [0.0]
    torch.testing.assert_close(new.grad, torch.tensor([expected_grad]), rtol=1e-5, atol=1e-7)
    # direction: positive advantage inside the clip range pushes logp up (negative gradient);
    # negative advantage above the range pushes it down; clipped tokens get no gradient.
    assert new.grad[0, 1] < 0 and new.grad[0, 3] > 0 and new.grad[0, 0] == 0 and new.grad[0, 2] == 0
    s = stats.as_floats()
    assert s["clip_fraction"] == pytest.approx(2 / 4)
    assert s["tokens"] == 4.0
    assert s["is_weight_mean"] == pytest.approx(sum(weights) / 4)
    assert s["ratio_mean"] == pytest.approx(sum(ratios) / 4, rel=1e-6)
    assert s["approx_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 4, rel=1e-5)


def test_ppo_seq_mean_token_mean():
    # row 0: two tokens r=1 with A=1 and A=3 -> losses -1, -3 -> mean -2
    # row 1: one token r=1.1, A=-2 -> loss 2.2 ; row 2: no tokens (excluded)
    old = torch.zeros(3, 2)
    new = torch.log(torch.tensor([[1.0, 1.0], [1.1, 1.0], [1.0, 1.0]]))
    adv = torch.tensor([[1.0, 3.0], [-2.0, 0.0], [7.0, 7.0]])
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=torch.bool)
    loss, _ = ppo_loss(new, old, adv, mask, aggregation="seq-mean-token-mean")
    assert loss.item() == pytest.approx((-2.0 + 2.2) / 2, rel=1e-6)
    loss_tok, _ = ppo_loss(new, old, adv, mask, aggregation="token-mean")
    assert loss_tok.item() == pytest.approx((-1.0 - 3.0 + 2.2) / 3, rel=1e-6)


def test_ppo_accepts_is_result_and_sequence_advantages():
    res = _run(variant="token_mask", lo=0.5, hi=2.0)
    new = torch.zeros(2, 4, requires_grad=True)
    loss, stats = ppo_loss(new, torch.zeros(2, 4), torch.tensor([1.0, -1.0]), torch.tensor(MASK), is_weights=res)
    # r = 1 everywhere: loss_t = -A w_t; kept weights row 0: e^0.5, 1 ; row 1: e^-0.2
    assert loss.item() == pytest.approx((-(E(0.5) + 1.0) + E(-0.2)) / 5, rel=1e-6)
    loss.backward()
    assert new.grad[0, 1] == 0 and new.grad[1, 1] == 0  # rejected tokens do not train
    assert stats.as_floats()["tokens"] == 5.0


@pytest.mark.parametrize("aggregation", sorted(LOSS_AGGREGATIONS))
def test_ppo_all_masked_is_a_finite_zero(aggregation):
    new = torch.full((2, 3), float("-inf"), requires_grad=True)
    old = torch.full((2, 3), float("nan"))
    loss, stats = ppo_loss(new, old, torch.ones(2, 3), torch.zeros(2, 3), aggregation=aggregation)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(new.grad, torch.zeros(2, 3))
    assert all(math.isfinite(v) for v in stats.as_floats().values())


def test_ppo_errors():
    z = torch.zeros(1, 2)
    with pytest.raises(ConfigError, match="token-mean"):
        ppo_loss(z, z, z, z, aggregation="mean")
    with pytest.raises(ConfigError, match="advantages"):
        ppo_loss(z, z, torch.zeros(3), z)
    with pytest.raises(ConfigError, match="clip_low"):
        ppo_loss(z, z, z, z, clip_low=1.5)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-3, 3), min_size=6, max_size=6),
    st.lists(st.booleans(), min_size=6, max_size=6),
    st.sampled_from(sorted(IS_VARIANTS)),
)
def test_weights_respect_cap_band_and_mask(diffs, mask_bits, variant):
    d = torch.tensor(diffs).view(2, 3)
    mask = torch.tensor(mask_bits).view(2, 3)
    res = compute_is_weights(d, torch.zeros(2, 3), mask, config=ISConfig(variant=variant, cap=2.0, lo=0.5, hi=2.0))
    assert torch.isfinite(res.weights).all() and (res.weights >= 0).all()
    assert (res.weights[~mask] == 0).all() and not res.mask[~mask].any()
    assert (res.weights[~res.mask] == 0).all()
    if variant in ("token_tis", "seq_is", "seq_mask_tis"):
        assert (res.weights <= 2.0).all()
    if variant in ("token_mask", "icepop"):
        kept = res.weights[res.mask]
        assert ((kept >= 0.5 * (1 - 1e-6)) & (kept <= 2.0 * (1 + 1e-6))).all()
    assert 0.0 <= res.truncated_fraction <= 1.0 and 0.0 <= res.masked_fraction <= 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(IS_VARIANTS))
def test_cuda_matches_cpu(variant):
    cap = None if variant == "seq_is" else 2.0
    cfg = ISConfig(variant=variant, cap=cap, lo=0.7, hi=1.5)
    args = (torch.tensor(LOGP_OLD), torch.tensor(LOGP_ROLL), torch.tensor(MASK, dtype=torch.bool))
    cpu = compute_is_weights(*args, config=cfg)
    gpu = compute_is_weights(*(t.cuda() for t in args), config=cfg)
    torch.testing.assert_close(gpu.weights.cpu(), cpu.weights, rtol=1e-6, atol=1e-7)
    assert torch.equal(gpu.mask.cpu(), cpu.mask)
    assert gpu.masked_fraction == cpu.masked_fraction and gpu.truncated_fraction == cpu.truncated_fraction
    new = torch.zeros(2, 4, device="cuda", requires_grad=True)
    loss, _ = ppo_loss(
        new, torch.zeros(2, 4, device="cuda"), torch.ones(2, 4, device="cuda"), args[2].cuda(), is_weights=gpu
    )
    ref, _ = ppo_loss(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4), args[2], is_weights=cpu)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
