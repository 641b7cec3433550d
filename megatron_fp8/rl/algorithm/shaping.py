"""What a step's rewards become before the advantages: NeMo-RL's reward scaling and DAPO's reward shaping.

In NeMo-RL's order (``grpo.py``: ``scale_rewards``, then ``apply_reward_shaping`` when enabled):

* :func:`scale_rewards` (``grpo.reward_scaling``): each reward clamped to ``[source_min, source_max]`` and mapped
  linearly onto ``[target_min, target_max]``;
* :func:`shape_rewards` (``grpo.reward_shaping``): DAPO's overlong penalty, a response longer than
  ``max_response_length - overlong_buffer_length`` tokens losing ``overlong_buffer_penalty`` x its excess over the
  buffer (linear, from 0 at the buffer's start); or, with ``stop_properly_penalty_coef``, a truncated response's
  reward multiplied by it (the overlong keys then unused, as NeMo-RL does).

``tests/rl/algorithm/test_shaping_oracle.py`` runs NeMo-RL's own ``scale_rewards`` and ``apply_reward_shaping`` on the
same rewards, lengths and truncation flags.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_fp8.config.data_schema import RewardScalingConfig, RewardShapingConfig


def scale_rewards(rewards: torch.Tensor, cfg: RewardScalingConfig) -> torch.Tensor:
    """``grpo.reward_scaling``: rewards clamped to the source range and mapped onto the target range.

    Args:
        rewards: float ``[N]``, one per response.
        cfg: the section (``enabled: false``: the rewards unchanged).

    Returns:
        float ``[N]`` (the same tensor when disabled).
    """
    if not cfg.enabled:
        return rewards
    r = rewards.clamp(min=float(cfg.source_min), max=float(cfg.source_max))
    span = float(cfg.source_max) - float(cfg.source_min)
    return float(cfg.target_min) + (r - float(cfg.source_min)) / span * (float(cfg.target_max) - float(cfg.target_min))


def shape_rewards(
    rewards: torch.Tensor, response_lengths: Sequence[int], truncated: Sequence[bool], cfg: RewardShapingConfig
) -> torch.Tensor:
    """``grpo.reward_shaping``: DAPO's overlong penalty, or the truncated responses' coefficient.

    Args:
        rewards: float ``[N]``, one per response (after :func:`scale_rewards`).
        response_lengths: tokens of each response (its EOS included, as the engine returned it).
        truncated: whether each response stopped at the length limit.
        cfg: the section (``enabled: false``: the rewards unchanged).

    Returns:
        float ``[N]``.
    """
    if not cfg.enabled:
        return rewards
    if cfg.stop_properly_penalty_coef is not None:
        cut = torch.tensor(list(truncated), dtype=torch.bool, device=rewards.device)
        return torch.where(cut, rewards * cfg.stop_properly_penalty_coef, rewards)
    assert cfg.overlong_buffer_length is not None and cfg.overlong_buffer_penalty is not None  # config rule
    assert cfg.max_response_length is not None
    expected = cfg.max_response_length - cfg.overlong_buffer_length
    out = torch.zeros_like(rewards)
    for i, length in enumerate(response_lengths):  # NeMo-RL's arithmetic, element by element (same rounding)
        penalty = min(-(length - expected) / cfg.overlong_buffer_length * cfg.overlong_buffer_penalty, 0)
        out[i] = rewards[i] + penalty
    return out
