"""NeMo-RL's own ``ClippedPGLossFn`` (its code, run unchanged: ``data/nemo_rl/README.md``) against megatron-fp8's
train-step loss, on the same random inputs and the same ``loss_fn`` keys.

megatron-fp8's side is what a step computes: the config loaded from a NeMo-RL-style file (its arms follow the rollout
precision and ``loss_fn.use_importance_sampling_correction``), the IS weights the arm puts in its loss
(:func:`megatron_fp8.rl.driver.train_settings.correction_weights`, as ``phases.train_phase``) and
:func:`megatron_fp8.rl.algorithm.correction.ppo_loss`. Issue 38: the correction switch decides in both directions
(on with a BF16 rollout: corrected; off with an FP8 rollout: not), and an omitted truncation type is NeMo-RL's
untruncated weight.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from _nemo_rl_code import exec_excerpt, stand_in

from megatron_fp8.config import load_config
from megatron_fp8.config.schema import RunConfig
from megatron_fp8.rl.algorithm.correction import ppo_loss
from megatron_fp8.rl.driver.train_settings import correction_weights, ratio_inputs

_PACKAGES = (
    "nemo_rl",
    "nemo_rl.algorithms",
    "nemo_rl.algorithms.loss",
    "nemo_rl.algorithms.x_token",
    "nemo_rl.distributed",
    "nemo_rl.models",
    "nemo_rl.models.dtensor",
)
_UNUSED = (  # imported by loss_functions.py for its other losses; ClippedPGLossFn does not use them
    "nemo_rl.algorithms.x_token.loss_utils",
    "nemo_rl.distributed.model_utils",
    "nemo_rl.models.dtensor.parallelize",
)
_KEY = "use_importance_sampling_correction"


@pytest.fixture(scope="module")
def nemo_rl_loss() -> types.ModuleType:
    """NeMo-RL's ``nemo_rl.algorithms.loss.loss_functions`` (the ClippedPG excerpt), ``sys.modules`` left as found."""
    with mock.patch.dict(sys.modules):
        for name in _PACKAGES:
            sys.modules[name] = stand_in(name, package=True)
        for name in _UNUSED:
            sys.modules[name] = stand_in(name)
        batched = sys.modules["nemo_rl.distributed.batched_data_dict"] = stand_in(
            "nemo_rl.distributed.batched_data_dict"
        )
        batched.BatchedDataDict = dict  # the loss reads it with [] and .get
        exec_excerpt("nemo_rl.algorithms.utils", "utils_kl_mean.py.txt")
        exec_excerpt("nemo_rl.algorithms.loss.interfaces", "interfaces.py.txt")
        return exec_excerpt("nemo_rl.algorithms.loss.loss_functions", "loss_functions_clipped_pg.py.txt")


@dataclass(frozen=True)
class _Inputs:
    logp_new: torch.Tensor  # [B, T] the policy being trained (requires grad)
    logp_old: torch.Tensor  # [B, T] the trainer's scores of the rollout (NeMo-RL's prev_logprobs)
    logp_gen: torch.Tensor  # [B, T] the rollout engine's (generation_logprobs)
    advantages: torch.Tensor  # [B] one per sequence
    mask: torch.Tensor  # [B, T] bool, real response tokens


def _inputs(seed: int, *, batch: int = 6, length: int = 9, mismatch: float = 0.6) -> _Inputs:
    """A rollout whose engine disagrees with the trainer enough that some token weights pass 2 (the cap matters)."""
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(batch, length, generator=g) * 3.0 - 0.05
    logp_gen = logp_old + mismatch * torch.randn(batch, length, generator=g)
    logp_new = logp_old + 0.3 * torch.randn(batch, length, generator=g)
    lengths = torch.randint(2, length + 1, (batch,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    advantages = torch.randn(batch, generator=g)
    return _Inputs(logp_new.requires_grad_(), logp_old, logp_gen, advantages, mask)


def _nemo_rl(module: types.ModuleType, loss_keys: dict, x: _Inputs) -> float:
    """NeMo-RL's loss: its data dict carries a leading position that the loss drops (``[:, 1:]``)."""
    cfg = module.ClippedPGLossConfig(reference_policy_kl_penalty=0.0, **loss_keys)
    fn = module.ClippedPGLossFn(cfg)

    def shifted(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros_like(t[:, :1]), t], dim=1)

    mask = x.mask.float()
    data = {
        "token_mask": shifted(mask),
        "sample_mask": torch.ones(mask.shape[0]),
        "advantages": shifted(x.advantages[:, None].expand_as(mask).clone()),
        "prev_logprobs": shifted(x.logp_old),
        "generation_logprobs": shifted(x.logp_gen),
    }
    loss, _ = fn(x.logp_new, data, global_valid_seqs=torch.tensor(float(mask.shape[0])), global_valid_toks=mask.sum())
    return float(loss.detach())


def _ours(cfg: RunConfig, x: _Inputs) -> float:
    """megatron-fp8's loss for the config's one arm, as the train step computes it."""
    (arm,) = cfg.grpo.arms
    _, weights = correction_weights(cfg, arm, x.logp_old, x.logp_gen, x.mask)
    loss, _ = ppo_loss(
        x.logp_new,
        x.logp_old,
        x.advantages,
        x.mask,
        clip_low=cfg.loss_fn.ratio_clip_min,
        clip_high=cfg.loss_fn.ratio_clip_max,
        is_weights=weights,
        aggregation=cfg.loss_fn.aggregation,
        log_ratio_clamp=cfg.loss_fn.log_ratio_clamp,
        dual_clip=cfg.loss_fn.ratio_clip_c,
    )
    return float(loss.detach())


def _config(tmp_path: Path, precision: str, loss_keys: dict) -> RunConfig:
    """A NeMo-RL-style file: no ``grpo.arms``, the rollout precision and the ``loss_fn`` keys."""
    text = {
        "policy": {"generation": {"vllm_cfg": {"precision": precision}}},
        "loss_fn": {"reference_policy_kl_penalty": 0.0, **loss_keys},
    }
    path = tmp_path / "nemo_rl_style.yaml"
    path.write_text(yaml.safe_dump(text))
    return load_config(path)


_TIS2 = {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0}
_NULLS = {"truncated_importance_sampling_type": None, "truncated_importance_sampling_ratio": None}
_ICEPOP = {
    "truncated_importance_sampling_type": "icepop",
    "truncated_importance_sampling_ratio": 2.0,
    "truncated_importance_sampling_ratio_min": 0.5,
}


@pytest.mark.parametrize(
    ("precision", "loss_keys", "arm", "corrected"),
    [
        ("bf16", {_KEY: True}, "bf16", True),  # on with a BF16 rollout: NeMo-RL corrects (weights near 1)
        ("bf16", {_KEY: False}, "bf16", False),
        ("fp8", {_KEY: False}, "fp8", False),  # off with an FP8 rollout: no TIS C=2
        ("fp8", {_KEY: True}, "fp8_tis", True),  # the type omitted: the untruncated weight
        ("fp8", {_KEY: True, **_NULLS}, "fp8_tis", True),  # the type written null, as NeMo-RL's files do
        ("fp8", {_KEY: True, **_TIS2}, "fp8_tis", True),
        ("fp8", {_KEY: True, **_ICEPOP}, "fp8_tis", True),
        ("fp8", {_KEY: True, "token_level_loss": False}, "fp8_tis", True),
        ("bf16", {_KEY: True, **_TIS2}, "bf16", True),
        ("fp8", {_KEY: True, **_TIS2, "ratio_clip_c": 1.5}, "fp8_tis", True),  # dual clip (DAPO recipes: 10)
        ("bf16", {_KEY: False, "ratio_clip_c": 1.2, "token_level_loss": False}, "bf16", False),
    ],
    ids=[
        "on-bf16",
        "off-bf16",
        "off-fp8",
        "on-fp8-type-omitted",
        "on-fp8-type-null",
        "on-fp8-tis2",
        "on-fp8-icepop",
        "on-fp8-seq-mean",
        "on-bf16-tis2",
        "on-fp8-tis2-dual-clip",
        "off-bf16-seq-mean-dual-clip",
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_nemo_rls_loss_and_ours_agree(nemo_rl_loss, tmp_path, precision, loss_keys, arm, corrected, seed):
    """The same inputs and keys give the same loss; the arm is the one the key names."""
    cfg = _config(tmp_path, precision, loss_keys)
    assert cfg.grpo.arms == (arm,)
    assert cfg.loss_fn.arm_corrects(arm) is corrected
    x = _inputs(seed)
    theirs, ours = _nemo_rl(nemo_rl_loss, loss_keys, x), _ours(cfg, x)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)


def test_the_switch_and_the_truncation_change_the_loss(nemo_rl_loss):
    """The inputs are such that each case above is a different loss (the agreement is not vacuous)."""
    x = _inputs(0)
    losses = [
        _nemo_rl(nemo_rl_loss, keys, x) for keys in ({_KEY: False}, {_KEY: True}, {_KEY: True, **_TIS2})
    ]  # off, untruncated, TIS C=2
    assert len({round(v, 6) for v in losses}) == 3, losses
    dual = _nemo_rl(nemo_rl_loss, {_KEY: True, **_TIS2, "ratio_clip_c": 1.5}, x)
    assert round(dual, 6) not in {round(v, 6) for v in losses}, (dual, losses)  # the dual clip binds on these inputs


@pytest.mark.parametrize(
    "loss_keys", [{_KEY: True, **_TIS2}, {_KEY: True}, {_KEY: False}], ids=["tis2", "untruncated", "uncorrected"]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_force_on_policy_ratio_as_nemo_rl_defines_it(nemo_rl_loss, tmp_path, loss_keys, seed):
    """``loss_fn.force_on_policy_ratio`` (NeMo-RL's async recipes set it): the ratio's old policy is the training
    forward itself, and the IS weights compare it with the generating policy; megatron-fp8's micro-batch loss inputs
    (:func:`~megatron_fp8.rl.driver.train_settings.ratio_inputs`, what ``train_phase`` calls) give NeMo-RL's loss."""
    keys = {**loss_keys, "force_on_policy_ratio": True}
    cfg = _config(tmp_path, "fp8", keys)
    assert cfg.loss_fn.force_on_policy_ratio
    (arm,) = cfg.grpo.arms
    x = _inputs(seed)
    _, weights = correction_weights(cfg, arm, x.logp_old, x.logp_gen, x.mask)
    step_weights = weights.weights if weights is not None else None
    old, is_weights = ratio_inputs(cfg, arm, x.logp_new, x.logp_old, x.logp_gen, x.mask, step_weights)
    loss, _ = ppo_loss(
        x.logp_new,
        old,
        x.advantages,
        x.mask,
        clip_low=cfg.loss_fn.ratio_clip_min,
        clip_high=cfg.loss_fn.ratio_clip_max,
        is_weights=is_weights,
        aggregation=cfg.loss_fn.aggregation,
        log_ratio_clamp=cfg.loss_fn.log_ratio_clamp,
    )
    theirs = _nemo_rl(nemo_rl_loss, keys, x)
    assert float(loss.detach()) == pytest.approx(theirs, rel=1e-5, abs=1e-6)
    assert theirs != pytest.approx(_nemo_rl(nemo_rl_loss, loss_keys, x), rel=1e-3)  # the switch changes the loss
