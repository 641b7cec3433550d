"""Micro-batches through Megatron-Core's forward-backward schedules (pipeline parallelism included).

Every training forward/backward of :func:`megatron_fp8.megatron.step.train_step`, and every scoring forward under
pipeline parallelism, goes through Megatron-Core's ``get_forward_backward_func()``: with one pipeline stage that is
``forward_backward_no_pipelining`` (gradients accumulate over the micro-batches in the DDP buffers), with several it
is the 1F1B schedule ``forward_backward_pipelining_without_interleaving``: each stage runs its own layers,
activations and their gradients travel between stages point to point, and the loss is taken on the last stage.

What this module adds to Megatron-Core:

* the forward step of a GPT model on a micro-batch (:class:`~megatron_fp8.megatron.microbatch.MicroBatch`: rows
  with an explicit causal / padding mask and positions over the real tokens, or packed sequences in Megatron-Core's
  THD form) and its loss function on the last stage: the vocab-parallel log-probabilities of the next tokens
  (:func:`megatron_fp8.megatron.logits.local_logprobs`), mapped back to the batch's rows, handed to the caller's loss;
* the loss scaling Megatron-Core's legacy two-value loss contract expects (it divides every micro-batch's loss by
  the number of micro-batches: the caller's shares, which already add up to the batch loss, are multiplied back);
* :func:`from_last_stage`: what the last stage computed (log-probabilities, the loss, statistics) on every stage of
  the pipeline, so every rank of a model replica logs and corrects with the same numbers.

Shapes: the pipeline's point-to-point buffers have one shape per call (``[T, b, hidden]``), so under pipeline
parallelism every micro-batch of one call has one shape (:func:`~megatron_fp8.megatron.microbatch.plan_micro_batches`
makes it so, or refuses).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from bridge_mappings.adapter import cpu_schedule_patches, packed_attention_scope
from megatron_fp8.errors import ConfigError
from megatron_fp8.megatron.logits import local_logprobs
from megatron_fp8.megatron.microbatch import MicroBatch

if TYPE_CHECKING:  # annotations only (Megatron is optional at import time)
    from megatron_fp8.megatron.build import MegatronModel

T = TypeVar("T")

MicroLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss(logprobs [n, T-1] float32, rows int64 [n])`` -> this micro-batch's share of the batch loss (a scalar)."""


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


def model_inputs(mb: MicroBatch, device: torch.device) -> dict[str, object]:
    """The GPT model's keyword inputs for one micro-batch on ``device``: rows with their causal / padding mask, or
    packed sequences in Megatron-Core's THD form (``packed_seq_params``, no mask: the attention keeps the sequences
    apart by ``cu_seqlens``, TransformerEngine's or the local one in :func:`packing_scope`)."""
    packed = mb.packed_seq_params(device)
    inputs: dict[str, object] = {
        "input_ids": mb.input_ids.to(device=device, dtype=torch.int64),
        "position_ids": mb.position_ids.to(device),
        "attention_mask": mb.attention_mask().to(device) if packed is None else None,
    }
    if packed is not None:
        inputs["packed_seq_params"] = packed
    return inputs


def packing_scope(m: MegatronModel, micro: list[MicroBatch]) -> contextlib.AbstractContextManager:
    """The scope a pass over ``micro`` runs in: the model's packed-sequence scope when a micro-batch is packed."""
    if not any(mb.cu_seqlens is not None for mb in micro):
        return contextlib.nullcontext()
    return packed_attention_scope(m.model[0])


def run_schedule(
    m: MegatronModel,
    micro: list[MicroBatch],
    *,
    temperature: float,
    loss: MicroLoss | None,
) -> list[tuple[MicroBatch, torch.Tensor]]:
    """One pass of Megatron-Core's schedule over the micro-batches of a batch.

    Args:
        m: the model (one chunk: virtual pipeline stages are not built).
        micro: the micro-batches (:func:`~megatron_fp8.megatron.microbatch.plan_micro_batches`, the same on every
            stage of the replica).
        temperature: divides the logits before the log-softmax.
        loss: with a loss, a forward-backward pass (gradients accumulate in the DDP buffers, not finalized);
            without one, forward only.

    Returns:
        On the last stage, per micro-batch: the loss share (training) or its rows' ``[n, T-1]`` float32
        log-probabilities (forward only); on other stages an empty list.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func  # lazy: Megatron-Core is optional

    device = next(m.model[0].parameters()).device
    count = len(micro)
    scope = packing_scope(m, micro)

    def forward_step(data: Iterator[MicroBatch], model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        mb = next(data)
        inputs = model_inputs(mb, device)
        output = model(**inputs)

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            scored = local_logprobs(logits, inputs["input_ids"], vocab_size=m.vocab_size, temperature=temperature)
            rows = mb.to_rows(scored)
            if loss is None:
                return rows.new_zeros(()), {"out": rows.detach()}
            share = loss(rows, mb.rows)
            if not isinstance(share, torch.Tensor) or share.numel() != 1:
                raise ConfigError(f"loss_fn must return a scalar tensor, got {getattr(share, 'shape', type(share))}")
            if not torch.isfinite(share.detach()):
                raise ConfigError(f"loss_fn returned a non-finite loss ({float(share)})")
            # Megatron-Core divides a two-value loss by the number of micro-batches; the shares already add up
            return share.reshape(()) * count, {"out": share.detach().reshape(())}

        return output, loss_func

    schedule = get_forward_backward_func()
    grad = torch.enable_grad() if loss is not None else torch.no_grad()
    with grad, cpu_schedule_patches(), scope:
        store = schedule(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=m.model,
            num_microbatches=count,
            seq_length=max(mb.input_ids.shape[1] for mb in micro),
            micro_batch_size=max(mb.input_ids.shape[0] for mb in micro),
            forward_only=loss is None,
        )
    return list(zip(micro, (entry["out"] for entry in store), strict=True)) if is_last_stage() else []


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
