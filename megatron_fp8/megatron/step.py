"""Forward, log-probabilities, optimizer and one training step on a Megatron-Core model.

These are the trainer-side primitives of one RL step. They work on a
:class:`~megatron_fp8.megatron.build.MegatronModel` (DDP-wrapped, ``Float16Module``
for BF16) and are written for a single pipeline stage (``pp=1``).

Tensor parallelism: the output layer is vocab-parallel, so each TP rank holds logits for its
slice of the vocabulary. :func:`token_logprobs` never gathers them: it applies the temperature,
masks Megatron's vocabulary padding and takes ``-log p(target)`` from Megatron-Core's
``tensor_parallel.vocab_parallel_cross_entropy`` (float32), which all-reduces only the per-token
max and sum over the TP group. :func:`forward_logits` gathers the full vocabulary for callers that
want every logit.

Masks: Megatron-Core's GPT model takes a boolean ``[B, 1, T, T]`` mask where
``True`` means "masked out". :func:`build_attention_mask` makes it explicit
(causal, plus padded keys when an ``attention_mask`` is given), and
:func:`position_ids_for` numbers the real tokens of each row from 0 (left padding
does not shift the positions), which is what vLLM sees for an unpadded prompt.

Optimizer: :func:`make_optimizer` uses Megatron-Core's own ``get_megatron_optimizer``
with ``OptimizerConfig(optimizer="adam", use_distributed_optimizer=False)`` when CUDA
is available. That optimizer cannot run on CPU (it hard-codes ``device='cuda'``
tensors and CUDA tensor types; tried first, see :mod:`megatron_fp8.megatron.optim`),
so on CPU the default backend is :class:`~megatron_fp8.megatron.optim.MegatronDDPAdam`:
AdamW with FP32 main weights over the same Megatron-Core DDP grad buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bridge_mappings.adapter import cpu_device_patches
from megatron_fp8.errors import ConfigError
from megatron_fp8.megatron.build import MegatronModel
from megatron_fp8.megatron.optim import AdamConfig, MegatronDDPAdam, StepOptimizer

if TYPE_CHECKING:  # Megatron-Core's optimizer, for annotations only (Megatron is optional at import time)
    from megatron.core.optimizer import MegatronOptimizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    """Outcome of :func:`train_step`.

    Attributes:
        loss: the loss value returned by ``loss_fn`` (before the update).
        grad_norm: global L2 norm of the gradients (before clipping).
        update_successful: ``False`` when the optimizer skipped the step (non-finite gradients).
        num_zeros_in_grad: zero gradient elements, when the optimizer counts them, else ``None``.
    """

    loss: float
    grad_norm: float
    update_successful: bool = True
    num_zeros_in_grad: int | None = None


def _check_ids(input_ids: torch.Tensor, m: MegatronModel) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ConfigError(f"input_ids must be a [B, T] tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ConfigError(f"input_ids must be int64 (or int32), got {input_ids.dtype}")
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= m.vocab_size):
        raise ConfigError(
            f"input_ids hold ids outside [0, {m.vocab_size}) (min {int(input_ids.min())}, max {int(input_ids.max())})"
        )


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


def _tensor_parallel() -> tuple[int, int]:
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

    tp_rank, _ = _tensor_parallel()
    scaled = logits[:, :-1].float() / temperature
    shard = scaled.shape[-1]
    columns = torch.arange(tp_rank * shard, (tp_rank + 1) * shard, device=scaled.device)
    if int(columns[-1]) >= vocab_size:
        scaled = scaled.masked_fill(columns >= vocab_size, float("-inf"))
    targets = input_ids[:, 1:].to(device=logits.device, dtype=torch.int64)
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, targets)


def _forward(m: MegatronModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """This rank's logits ``[B, T, V_local]`` in the model's dtype (the vocabulary shard under TP)."""
    if len(m.model) != 1:
        raise ConfigError(f"forward_logits supports one model chunk (pp=1, no virtual pipeline), got {len(m.model)}")
    _check_ids(input_ids, m)
    device = next(m.model[0].parameters()).device
    ids = input_ids.to(device=device, dtype=torch.int64)
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
    with cpu_device_patches():
        logits = m.model[0](
            input_ids=ids,
            position_ids=position_ids_for(ids, attention_mask),
            attention_mask=build_attention_mask(ids, attention_mask),
        )
    return logits


def forward_logits(
    m: MegatronModel, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits of every position.

    Runs with gradients enabled when the caller has them enabled (``train_step`` relies on it);
    wrap in ``torch.no_grad()`` for inference.

    Args:
        m: the model.
        input_ids: ``[B, T]`` int64 token ids.
        attention_mask: optional ``[B, T]`` padding mask (1 = real token).

    Returns:
        ``[B, T, V]`` float32 logits, ``V`` = the Hugging Face vocabulary size (gathered over the TP group).
    """
    logits = _forward(m, input_ids, attention_mask)
    if _tensor_parallel()[1] > 1:
        from megatron.core import tensor_parallel  # lazy: Megatron-Core is optional

        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits[..., : m.vocab_size].float()


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


def token_logprobs(
    m: MegatronModel,
    input_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probability of each next token under the model.

    Args:
        m: the model.
        input_ids: ``[B, T]`` int64 token ids.
        temperature: sampling temperature (> 0), as used by the rollout engine.
        attention_mask: optional ``[B, T]`` padding mask (1 = real token).

    Returns:
        ``[B, T-1]`` float32 log-probabilities (see :func:`logprobs_from_logits`); under tensor parallelism
        from the vocabulary shards without gathering them, the same on every TP rank.
    """
    if _tensor_parallel()[1] == 1:
        logits = forward_logits(m, input_ids, attention_mask=attention_mask)
        return logprobs_from_logits(logits, input_ids, temperature=temperature)
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    logits = _forward(m, input_ids, attention_mask)
    return _vocab_parallel_logprobs(logits, input_ids, vocab_size=m.vocab_size, temperature=temperature)


def _megatron_optimizer(m: MegatronModel, config: AdamConfig) -> MegatronOptimizer:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # lazy: Megatron-Core is optional

    if not torch.cuda.is_available():
        raise ConfigError(
            "Megatron-Core's optimizer needs CUDA (it allocates device='cuda' tensors); "
            "use make_optimizer(..., backend='torch') or backend='auto' on CPU"
        )
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        min_lr=config.lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.betas[0],
        adam_beta2=config.betas[1],
        adam_eps=config.eps,
        clip_grad=config.clip_grad,
        bf16=m.dtype == torch.bfloat16,
        params_dtype=m.dtype,
        use_distributed_optimizer=False,
    )
    return get_megatron_optimizer(opt_config, m.model)


def _torch_optimizer(m: MegatronModel, config: AdamConfig) -> MegatronDDPAdam:
    return MegatronDDPAdam(m.model, config)


OPTIMIZER_BACKENDS: dict[str, Callable[[MegatronModel, AdamConfig], StepOptimizer]] = {
    "megatron": _megatron_optimizer,
    "torch": _torch_optimizer,
}
"""Optimizer builders: Megatron-Core's ``get_megatron_optimizer`` (CUDA) or :class:`MegatronDDPAdam`."""


def make_optimizer(
    m: MegatronModel,
    *,
    lr: float,
    weight_decay: float = 0.0,
    clip_grad: float = 1.0,
    adam_eps: float = 1e-8,
    backend: str = "auto",
) -> StepOptimizer:
    """Adam for the model.

    Args:
        m: the model.
        lr: learning rate.
        weight_decay: decoupled weight decay (not on biases / 1-D parameters).
        clip_grad: global gradient-norm clip (0 disables clipping).
        adam_eps: Adam epsilon.
        backend: ``"megatron"`` (Megatron-Core's ``get_megatron_optimizer`` with
            ``OptimizerConfig(optimizer="adam", use_distributed_optimizer=False)``; needs CUDA),
            ``"torch"`` (:class:`~megatron_fp8.megatron.optim.MegatronDDPAdam`, runs anywhere), or
            ``"auto"``: ``"megatron"`` when CUDA is available, else ``"torch"``.

    Returns:
        An optimizer whose ``zero_grad()`` clears gradients and whose ``step()`` returns
        ``(update_successful, grad_norm, num_zeros_in_grad)``.

    Raises:
        ConfigError: unknown backend (the message lists the valid ones), bad hyper-parameters,
            or ``"megatron"`` without CUDA.
    """
    if backend == "auto":
        backend = "megatron" if torch.cuda.is_available() else "torch"
    try:
        builder = OPTIMIZER_BACKENDS[backend]
    except KeyError:
        raise ConfigError(
            f"unknown optimizer backend {backend!r}; valid: auto, {', '.join(OPTIMIZER_BACKENDS)}"
        ) from None
    if lr <= 0:
        raise ConfigError(f"lr must be > 0, got {lr}")
    config = AdamConfig(lr=lr, weight_decay=weight_decay, eps=adam_eps, clip_grad=clip_grad)
    with cpu_device_patches():
        optimizer = builder(m, config)
    logger.debug("made %s (backend %s, lr %g, weight decay %g)", type(optimizer).__name__, backend, lr, weight_decay)
    return optimizer


def _unpack_batch(batch: torch.Tensor | Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, Mapping) and "input_ids" in batch:
        return batch["input_ids"], batch.get("attention_mask")
    raise ConfigError("batch must be a [B, T] input_ids tensor or a mapping with 'input_ids' (and 'attention_mask')")


def finalize_model_grads(chunks: list[torch.nn.Module]) -> None:
    """Megatron-Core's ``finalize_model_grads``: the DP gradient all-reduce, plus the TP all-reduce of replicated
    parameters that see only their rank's heads (``q_layernorm`` / ``k_layernorm``, sequence-parallel norms) and
    the tied-embedding all-reduce across pipeline stages."""
    from megatron.core.distributed import finalize_model_grads as megatron_finalize  # lazy: Megatron is optional

    megatron_finalize(list(chunks))


def train_step(
    m: MegatronModel,
    optimizer: StepOptimizer,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    batch: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    micro_batch_size: int | None = None,
) -> StepResult:
    """Forward, backward and one optimizer step, over micro-batches when asked.

    Args:
        m: the model.
        optimizer: from :func:`make_optimizer`.
        loss_fn: without micro-batches, maps the ``[B, T-1]`` float32 token log-probabilities (with grad) to
            a scalar loss. With ``micro_batch_size``, it is called once per micro-batch as
            ``loss_fn(logprobs, rows)`` with that micro-batch's ``[b, T-1]`` log-probabilities and its
            ``rows`` slice of the batch, and returns the micro-batch's share of the batch loss (the shares
            add up to the batch loss; e.g. a token mean over the whole batch divides by every token of it).
        batch: ``[B, T]`` int64 input ids, or a mapping with ``"input_ids"`` and optional
            ``"attention_mask"``.
        temperature: temperature applied to the logits before the log-softmax.
        micro_batch_size: rows per forward/backward (gradients accumulate in Megatron-Core's DDP buffers
            and are finalized once); ``None``: the whole batch at once.

    Returns:
        :class:`StepResult` with the batch loss before the update and the gradient norm.

    Raises:
        ConfigError: bad batch or micro-batch size, or a loss that is not a finite scalar.
    """
    input_ids, attention_mask = _unpack_batch(batch)
    rows = input_ids.shape[0]
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be >= 1 (or None), got {micro_batch_size}")
    size = rows if micro_batch_size is None else micro_batch_size
    for chunk in m.model:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    with cpu_device_patches():
        for start in range(0, max(rows, 1), size):
            part = slice(start, min(start + size, rows))
            mask = attention_mask[part] if attention_mask is not None else None
            logprobs = token_logprobs(m, input_ids[part], temperature=temperature, attention_mask=mask)
            loss = loss_fn(logprobs) if micro_batch_size is None else loss_fn(logprobs, part)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ConfigError(f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', type(loss))}")
            if not torch.isfinite(loss.detach()):
                raise ConfigError(f"loss_fn returned a non-finite loss ({float(loss)})")
            loss.backward()
            total += loss.detach().double()
        finalize_model_grads(m.model)
        update_successful, grad_norm, num_zeros = optimizer.step()
    for chunk in m.model:
        chunk.eval()
    return StepResult(
        loss=float(total),
        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        update_successful=bool(update_successful),
        num_zeros_in_grad=int(num_zeros) if num_zeros is not None else None,
    )
