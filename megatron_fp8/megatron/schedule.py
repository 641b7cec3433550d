"""Micro-batches through Megatron-Core's forward-backward schedules (pipeline parallelism included).

Every training forward/backward of :func:`megatron_fp8.megatron.step.train_step`, and every scoring forward under
pipeline parallelism, goes through Megatron-Core's ``get_forward_backward_func()``: with one pipeline stage that is
``forward_backward_no_pipelining`` (gradients accumulate over the micro-batches in the DDP buffers), with several it
is the 1F1B schedule ``forward_backward_pipelining_without_interleaving``: each stage runs its own layers,
activations and their gradients travel between stages point to point, and the loss is taken on the last stage.

What this module adds to Megatron-Core:

* the forward step of a GPT model on a ``[b, T]`` micro-batch (explicit causal / padding mask, positions over the
  real tokens) and its loss function on the last stage: the vocab-parallel log-probabilities of the next tokens
  (:func:`megatron_fp8.megatron.logits.local_logprobs`) handed to the caller's loss;
* the loss scaling Megatron-Core's legacy two-value loss contract expects (it divides every micro-batch's loss by
  the number of micro-batches: the caller's shares, which already add up to the batch loss, are multiplied back);
* :func:`from_last_stage`: what the last stage computed (log-probabilities, the loss, statistics) on every stage of
  the pipeline, so every rank of a model replica logs and corrects with the same numbers.

Shapes: the pipeline's point-to-point buffers have one shape per call (``[T, b, hidden]``), so under pipeline
parallelism every micro-batch of one call has the same number of rows (:func:`micro_batches` refuses otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from bridge_mappings.adapter import cpu_schedule_patches
from megatron_fp8.errors import ConfigError
from megatron_fp8.megatron.logits import build_attention_mask, local_logprobs, position_ids_for

if TYPE_CHECKING:  # annotations only (Megatron is optional at import time)
    from megatron_fp8.megatron.build import MegatronModel

T = TypeVar("T")

MicroLoss = Callable[[torch.Tensor, slice], torch.Tensor]
"""``loss(logprobs [b, T-1] float32, rows)`` -> this micro-batch's share of the batch loss (a scalar)."""


def pipeline_size() -> int:
    """Pipeline stages of this process's model (1 outside Megatron-Core's parallel state)."""
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


def is_last_stage() -> bool:
    """Whether this process holds the pipeline's last stage (the output layer, the loss)."""
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    return pipeline_size() == 1 or parallel_state.is_pipeline_last_stage()


def micro_batches(rows: int, size: int | None, *, what: str) -> list[slice]:
    """Row slices of ``size`` rows covering ``rows`` (the whole batch when ``size`` is ``None``).

    Args:
        rows: rows of the batch.
        size: rows per micro-batch (``None``: one micro-batch).
        what: the config key that set ``size``, for the error message.

    Raises:
        ConfigError: ``size < 1``, or under pipeline parallelism a last micro-batch smaller than the others.
    """
    if size is not None and size < 1:
        raise ConfigError(f"{what} must be >= 1 (or unset), got {size}")
    size = max(rows, 1) if size is None else size
    if pipeline_size() > 1 and rows % size:
        raise ConfigError(
            f"{what}={size} does not split the {rows} rows of a batch into equal micro-batches, which pipeline "
            f"parallelism needs (one activation shape per step); choose a divisor of {rows}"
        )
    return [slice(start, min(start + size, rows)) for start in range(0, max(rows, 1), size)]


@dataclass(frozen=True)
class _Micro:
    rows: slice
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None


def run_schedule(
    m: MegatronModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    parts: list[slice],
    *,
    temperature: float,
    loss: MicroLoss | None,
) -> list[torch.Tensor]:
    """One pass of Megatron-Core's schedule over ``parts`` of the batch.

    Args:
        m: the model (one chunk: virtual pipeline stages are not built).
        input_ids: ``[B, T]`` token ids (the same on every stage of the replica).
        attention_mask: optional ``[B, T]`` padding mask.
        parts: the micro-batches' rows (from :func:`micro_batches`).
        temperature: divides the logits before the log-softmax.
        loss: with a loss, a forward-backward pass (gradients accumulate in the DDP buffers, not finalized);
            without one, forward only.

    Returns:
        On the last stage, per micro-batch: the loss share (training) or the ``[b, T-1]`` float32 log-probabilities
        (forward only); on other stages an empty list.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func  # lazy: Megatron-Core is optional

    device = next(m.model[0].parameters()).device
    ids = input_ids.to(device=device, dtype=torch.int64)
    mask = attention_mask.to(device) if attention_mask is not None else None
    micro = [_Micro(p, ids[p], mask[p] if mask is not None else None) for p in parts]
    count = len(micro)

    def forward_step(data: Iterator[_Micro], model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        mb = next(data)
        output = model(
            input_ids=mb.input_ids,
            position_ids=position_ids_for(mb.input_ids, mb.attention_mask),
            attention_mask=build_attention_mask(mb.input_ids, mb.attention_mask),
        )

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            logprobs = local_logprobs(logits, mb.input_ids, vocab_size=m.vocab_size, temperature=temperature)
            if loss is None:
                return logprobs.new_zeros(()), {"out": logprobs.detach()}
            share = loss(logprobs, mb.rows)
            if not isinstance(share, torch.Tensor) or share.numel() != 1:
                raise ConfigError(f"loss_fn must return a scalar tensor, got {getattr(share, 'shape', type(share))}")
            if not torch.isfinite(share.detach()):
                raise ConfigError(f"loss_fn returned a non-finite loss ({float(share)})")
            # Megatron-Core divides a two-value loss by the number of micro-batches; the shares already add up
            return share.reshape(()) * count, {"out": share.detach().reshape(())}

        return output, loss_func

    schedule = get_forward_backward_func()
    grad = torch.enable_grad() if loss is not None else torch.no_grad()
    with grad, cpu_schedule_patches():
        store = schedule(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=m.model,
            num_microbatches=count,
            seq_length=ids.shape[1],
            micro_batch_size=max(p.stop - p.start for p in parts),
            forward_only=loss is None,
        )
    return [entry["out"] for entry in store] if is_last_stage() else []


def from_last_stage(value: T | None) -> T:
    """``value`` as the pipeline's last stage has it, on every stage of this pipeline (pickled broadcast).

    A no-op with one stage. Other stages pass anything (``None``).
    """
    if pipeline_size() == 1:
        return value  # type: ignore[return-value]
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    box = [value]
    dist.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]  # type: ignore[return-value]


def tensor_from_last_stage(value: torch.Tensor | None, *, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor the last stage computed, on every stage (a tensor broadcast over the pipeline group).

    Args:
        value: the tensor on the last stage (ignored elsewhere).
        shape: its shape, known on every stage.
        dtype: its dtype.
    """
    if pipeline_size() == 1:
        if value is None:
            raise ConfigError("tensor_from_last_stage: the last stage passed no tensor")
        return value
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    buffer = value.contiguous() if is_last_stage() and value is not None else torch.empty(shape, dtype=dtype)
    dist.broadcast(
        buffer,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return buffer
