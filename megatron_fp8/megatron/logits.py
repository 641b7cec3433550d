"""Masks, positions and next-token log-probabilities of a Megatron-Core GPT model's logits.

Masks: Megatron-Core's GPT model takes a boolean ``[B, 1, T, T]`` mask where ``True`` means "masked out".
:func:`build_attention_mask` makes it explicit (causal, plus padded keys when an ``attention_mask`` is given), and
:func:`position_ids_for` numbers the real tokens of each row from 0 (left padding does not shift the positions),
which is what vLLM sees for an unpadded prompt.

Tensor parallelism: the output layer is vocab-parallel, so each TP rank holds logits for its slice of the
vocabulary. :func:`local_logprobs` never gathers them: it applies the temperature, masks Megatron's vocabulary
padding and takes ``-log p(target)`` from Megatron-Core's ``tensor_parallel.vocab_parallel_cross_entropy``
(float32), which all-reduces only the per-token max and sum over the TP group.
"""

from __future__ import annotations

import torch

from megatron_fp8.errors import ConfigError


def build_attention_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Megatron-Core attention mask: ``True`` where attention is NOT allowed.

    Args:
        input_ids: ``[B, T]`` token ids (only the shape and device are used).
        attention_mask: optional ``[B, T]`` with 1 / ``True`` for real tokens and 0 for padding.

    Returns:
        Boolean ``[B, 1, T, T]``: causal mask, plus padded keys masked when ``attention_mask`` is given.
        Every query keeps at least itself unmasked so the softmax stays finite on padding rows.
    """
    b, t = input_ids.shape
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=input_ids.device), diagonal=1)
    mask = causal.expand(b, 1, t, t).clone()
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ConfigError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}"
            )
        pad_key = ~attention_mask.to(torch.bool)
        mask |= pad_key[:, None, None, :]
        eye = torch.eye(t, dtype=torch.bool, device=input_ids.device)
        mask &= ~eye
    return mask


def position_ids_for(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Position ids ``[B, T]`` int64: ``0..T-1``, or numbered over real tokens when padding is given."""
    b, t = input_ids.shape
    if attention_mask is None:
        return torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)
    keep = attention_mask.to(torch.int64)
    return (keep.cumsum(dim=1) - 1).clamp(min=0)


def tensor_parallel_place() -> tuple[int, int]:
    """``(tp_rank, tp_size)`` of this process (``(0, 1)`` outside Megatron-Core's parallel state)."""
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _vocab_parallel_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, *, vocab_size: int, temperature: float
) -> torch.Tensor:
    """Next-token log-probabilities from this TP rank's vocabulary shard ``[B, T, V/tp]`` (no gather).

    Columns past ``vocab_size`` (Megatron's padding of the vocabulary) get no probability.
    """
    from megatron.core import tensor_parallel  # lazy: Megatron-Core is optional

    tp_rank, _ = tensor_parallel_place()
    scaled = logits[:, :-1].float() / temperature
    shard = scaled.shape[-1]
    columns = torch.arange(tp_rank * shard, (tp_rank + 1) * shard, device=scaled.device)
    if int(columns[-1]) >= vocab_size:
        scaled = scaled.masked_fill(columns >= vocab_size, float("-inf"))
    targets = input_ids[:, 1:].to(device=logits.device, dtype=torch.int64)
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, targets)


def logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each next token.

    Args:
        logits: ``[B, T, V]`` float logits.
        input_ids: ``[B, T]`` token ids.
        temperature: sampling temperature the logits are divided by (> 0).

    Returns:
        ``[B, T-1]`` float32: entry ``[b, t]`` is ``log p(input_ids[b, t+1] | input_ids[b, :t+1])``.
    """
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    scaled = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:].to(device=logits.device, dtype=torch.int64).unsqueeze(-1)
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets).squeeze(-1)


def local_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, *, vocab_size: int, temperature: float
) -> torch.Tensor:
    """Next-token log-probabilities from this rank's logits, without gathering the vocabulary.

    Args:
        logits: ``[B, T, V_local]`` logits of this TP rank (the whole padded vocabulary without TP).
        input_ids: ``[B, T]`` token ids.
        vocab_size: the Hugging Face vocabulary size (columns past it are Megatron's padding).
        temperature: divides the logits first (> 0).

    Returns:
        ``[B, T-1]`` float32, the same on every TP rank.
    """
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    if tensor_parallel_place()[1] == 1:
        return logprobs_from_logits(logits[..., :vocab_size], input_ids, temperature=temperature)
    return _vocab_parallel_logprobs(logits, input_ids, vocab_size=vocab_size, temperature=temperature)
