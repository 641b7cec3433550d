"""Token-level GRPO batches: prompt + response rows for the trainer, group advantages, decoding.

The layout the trainer scores: row ``i`` is prompt ``i`` followed by its response, padded on
the right; position ``t`` of the ``[B, T-1]`` log-probabilities scores token ``t + 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.rollout.engines import Rollout

ADVANTAGE_EPS = 1e-6
"""Added to the group's reward standard deviation before dividing."""


class Tokenizer(Protocol):
    """What GRPO needs of a Hugging Face tokenizer (``transformers`` is optional, so not its class)."""

    eos_token_id: int | None
    pad_token_id: int | None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``."""
        ...

    def __len__(self) -> int:
        """Vocabulary size (ids ``>=`` this are not the tokenizer's)."""
        ...


@dataclass(frozen=True)
class Batch:
    """Prompt + response rows for the trainer.

    Attributes:
        input_ids: int64 ``[B, T]``, right-padded with the pad id.
        attention_mask: int64 ``[B, T]``, 1 on prompt and response tokens.
        response_mask: bool ``[B, T-1]``: position ``t`` scores token ``t + 1``, true where that is a response token.
        logp_rollout: float32 ``[B, T-1]``, the engine's log-probabilities (nats) of the response
            tokens, 0 off the response.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    logp_rollout: torch.Tensor


def make_batch(prompts: Sequence[Sequence[int]], rollout: Rollout, pad_id: int) -> Batch:
    """Lay out ``prompts[i] + rollout.token_ids[i]`` rows with the rollout's log-probabilities aligned.

    Args:
        prompts: per row, the prompt token ids (at least one token).
        rollout: one response per prompt, in the same order.
        pad_id: id used for right padding.

    Returns:
        The :class:`Batch`.
    """
    seqs = [list(p) + list(r) for p, r in zip(prompts, rollout.token_ids, strict=True)]
    b, t = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((b, t), pad_id, dtype=torch.int64)
    attention = torch.zeros((b, t), dtype=torch.int64)
    mask = torch.zeros((b, t - 1), dtype=torch.bool)
    logp = torch.zeros((b, t - 1), dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, rollout.token_ids, rollout.logprobs, strict=True)):
        n = len(p) + len(r)
        input_ids[i, :n] = torch.tensor(seqs[i], dtype=torch.int64)
        attention[i, :n] = 1
        start = len(p) - 1
        mask[i, start : start + len(r)] = True
        logp[i, start : start + len(r)] = lp
    return Batch(input_ids=input_ids, attention_mask=attention, response_mask=mask, logp_rollout=logp)


def group_advantages(rewards: torch.Tensor, *, leave_one_out: bool = False, normalize: bool = True) -> torch.Tensor:
    """GRPO advantages within each group, with NeMo-RL's meaning of its two switches.

    Per response ``i`` of a group of ``n``: the baseline ``b_i`` is the mean reward of the group, or with
    ``leave_one_out`` of the other ``n - 1`` responses (RLOO); ``s_i`` is the sample standard deviation
    (Bessel-corrected) over the same responses, 0 where it is undefined (one response left). The advantage is
    ``r_i - b_i``, divided by ``s_i + 1e-6`` when ``normalize`` and ``s_i > 0`` (a group without variation is not
    sharpened). This is ``grpo.normalize_rewards`` / ``grpo.use_leave_one_out_baseline`` as NeMo-RL computes them
    (``calculate_baseline_and_std_per_prompt`` and its GRPO estimator), every response valid.

    Args:
        rewards: float ``[num_prompts, num_generations]``.
        leave_one_out: baseline and deviation over the group without the response itself.
        normalize: divide by the deviation.

    Returns:
        float32 ``[num_prompts * num_generations]`` (row-major: prompt-major), 0 for groups whose
        rewards are all equal.

    Raises:
        ConfigError: not ``[prompts, generations >= 2]``.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ConfigError(f"group_advantages needs [prompts, generations >= 2] rewards, got {tuple(rewards.shape)}")
    r = rewards.to(torch.float64)  # sums of squares below: float64 keeps the deviation exact for 0/1 rewards
    n = r.shape[1]
    total, total_sq = r.sum(dim=1, keepdim=True), (r * r).sum(dim=1, keepdim=True)
    if leave_one_out:
        count = n - 1
        mean, mean_sq = (total - r) / count, (total_sq - r * r) / count
    else:
        count = n
        mean, mean_sq = total / count, total_sq / count
    adv = r - mean
    if normalize:
        var = (mean_sq - mean * mean).clamp(min=0.0) * (count / (count - 1) if count > 1 else 0.0)
        std = var.sqrt()
        adv = torch.where(std > 0, adv / (std + ADVANTAGE_EPS), adv)
    return adv.to(torch.float32).reshape(-1)


def decode_response(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """Text of response tokens, one token at a time (ids beyond the tokenizer become U+FFFD)."""
    size = len(tokenizer)
    return "".join(tokenizer.decode([i], skip_special_tokens=True) if i < size else "\ufffd" for i in ids)


def eos_and_pad(tokenizer: Tokenizer, *, where: object) -> tuple[int, int]:
    """``(eos id, pad id)``; the pad id falls back to EOS.

    Raises:
        ConfigError: the tokenizer has no EOS (``where`` names the model in the message).
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(f"the tokenizer of {where} has no eos_token_id; GRPO needs one to stop responses")
    return eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos


def pad_to_length(batch: Batch, length: int, pad_id: int) -> Batch:
    """``batch`` right-padded to ``length`` tokens (padding masked out of attention, the loss and the metrics).

    Expert parallelism all-gathers every rank's tokens (Megatron-Core's allgather token dispatcher), so the ranks of
    an expert group need batches of one shape; right padding leaves the real tokens' log-probabilities alone (causal
    attention never looks right, and padded keys are masked).

    Raises:
        ValueError: ``length`` is shorter than the batch.
    """
    extra = length - batch.input_ids.shape[1]
    if extra < 0:
        raise ValueError(f"cannot pad a batch of {batch.input_ids.shape[1]} tokens to {length}")
    if extra == 0:
        return batch
    return Batch(
        input_ids=torch.nn.functional.pad(batch.input_ids, (0, extra), value=pad_id),
        attention_mask=torch.nn.functional.pad(batch.attention_mask, (0, extra), value=0),
        response_mask=torch.nn.functional.pad(batch.response_mask, (0, extra), value=False),
        logp_rollout=torch.nn.functional.pad(batch.logp_rollout, (0, extra), value=0.0),
    )
