"""Forward, log-probabilities, optimizer and one training step on a Megatron-Core model.

These are the trainer-side primitives of one RL step. They work on a
:class:`~megatron_fp8.megatron.build.MegatronModel` (DDP-wrapped, ``Float16Module`` for BF16) at any layout
Megatron-Core's ``parallel_state`` holds: tensor parallelism (vocab-parallel logits, never gathered for
log-probabilities: :mod:`megatron_fp8.megatron.logits`), pipeline parallelism and micro-batches (every training
forward-backward goes through Megatron-Core's ``get_forward_backward_func``: :mod:`megatron_fp8.megatron.schedule`),
data parallelism (Megatron-Core's DDP and ``finalize_model_grads``).

:func:`token_logprobs` scores a batch in one forward with one pipeline stage; :func:`sequence_logprobs` scores it
in micro-batches through the schedule, the log-probabilities coming from the last stage to every stage.
:func:`forward_logits` gathers the full vocabulary for callers that want every logit (one pipeline stage).

Optimizer: :func:`make_optimizer` uses Megatron-Core's own ``get_megatron_optimizer`` with
``OptimizerConfig(optimizer="adam")`` when CUDA is available (``use_distributed_optimizer`` as asked). That
optimizer cannot run on CPU (it hard-codes ``device='cuda'`` tensors and CUDA tensor types; tried first, see
:mod:`megatron_fp8.megatron.optim`), so on CPU the default backend is
:class:`~megatron_fp8.megatron.optim.MegatronDDPAdam`: AdamW with FP32 main weights over the same Megatron-Core DDP
grad buffers, or with ``distributed`` :class:`~megatron_fp8.megatron.dist_optim.ShardedDDPAdam`, the same state
sharded over the data-parallel ranks.
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
from megatron_fp8.megatron.dist_optim import MegatronDistributedState, ShardedDDPAdam
from megatron_fp8.megatron.logits import (
    build_attention_mask,
    local_logprobs,
    position_ids_for,
    tensor_parallel_place,
)
from megatron_fp8.megatron.microbatch import BatchLayout, MicroBatch, TokenTally, plan_micro_batches
from megatron_fp8.megatron.offload import empty_unused_memory
from megatron_fp8.megatron.optim import AdamConfig, LossScaleConfig, MegatronDDPAdam, StepOptimizer
from megatron_fp8.megatron.schedule import (
    from_last_stage,
    model_inputs,
    packing_scope,
    pipeline_size,
    run_schedule,
    tensor_from_last_stage,
)

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


def _forward(m: MegatronModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """This rank's logits ``[B, T, V_local]`` in the model's dtype (the vocabulary shard under TP)."""
    if len(m.model) != 1 or pipeline_size() > 1:
        raise ConfigError(
            f"a plain forward needs the whole model on this rank (one pipeline stage, one chunk; got "
            f"{pipeline_size()} stages, {len(m.model)} chunks): score through sequence_logprobs, which runs "
            "Megatron-Core's pipeline schedule"
        )
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
    if tensor_parallel_place()[1] > 1:
        from megatron.core import tensor_parallel  # lazy: Megatron-Core is optional

        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits[..., : m.vocab_size].float()


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
    logits = _forward(m, input_ids, attention_mask)
    return local_logprobs(logits, input_ids, vocab_size=m.vocab_size, temperature=temperature)


def _plan_pass(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layout: BatchLayout | None,
    rows: int | None,
    *,
    key: str,
    tally: TokenTally | None,
    pad_id: int,
) -> list[MicroBatch]:
    """One pass's micro-batches: ``layout``, or rows of ``rows`` each (``None``: the whole batch) named by ``key``;
    counted into ``tally``."""
    plan = plan_micro_batches(
        input_ids,
        attention_mask,
        layout if layout is not None else BatchLayout(kind="rows", rows=rows, key=key),
        pipeline_stages=pipeline_size(),
        pad_id=pad_id,
    )
    if tally is not None:
        tally.add(plan)
    return plan


def sequence_logprobs(
    m: MegatronModel,
    input_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    attention_mask: torch.Tensor | None = None,
    batch_size: int | None = None,
    layout: BatchLayout | None = None,
    tally: TokenTally | None = None,
    pad_id: int = 0,
) -> torch.Tensor:
    """Log-probability of each next token, one micro-batch per forward, at any pipeline layout.

    With one pipeline stage a forward per micro-batch; with several, Megatron-Core's forward-only pipeline schedule,
    the log-probabilities taken on the last stage and broadcast to every stage. Call it under ``torch.no_grad()``.

    Args:
        m: the model.
        input_ids: ``[B, T]`` int64 token ids, right-padded.
        temperature: sampling temperature (> 0).
        attention_mask: optional ``[B, T]`` padding mask (1 = real token).
        batch_size: rows per forward (``policy.logprob_batch_size``); ``None``: the whole batch.
        layout: the micro-batches (dynamic or packed, :mod:`~megatron_fp8.megatron.microbatch`); supersedes
            ``batch_size``.
        tally: counts the real and computed tokens of the pass.
        pad_id: token id of packed micro-batches' fill.

    Returns:
        ``[B, T-1]`` float32 on every rank of the model replica (0 past each row's real tokens with a dynamic or
        packed layout).
    """
    _check_ids(input_ids, m)
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    rows, width = input_ids.shape[0], input_ids.shape[1] - 1
    plan = _plan_pass(
        input_ids, attention_mask, layout, batch_size, key="policy.logprob_batch_size", tally=tally, pad_id=pad_id
    )
    if pipeline_size() == 1:
        device = next(m.model[0].parameters()).device
        scope = packing_scope(m, plan)
        parts = []
        with cpu_device_patches(), scope:
            for mb in plan:
                inputs = model_inputs(mb, device)
                logits = m.model[0](**inputs)
                scored = local_logprobs(logits, inputs["input_ids"], vocab_size=m.vocab_size, temperature=temperature)
                parts.append((mb, mb.to_rows(scored)))
        return _in_batch_order(parts, rows, width)
    outs = run_schedule(m, plan, temperature=temperature, loss=None)
    local = _in_batch_order(outs, rows, width) if outs else None
    return tensor_from_last_stage(local, shape=(rows, width), dtype=torch.float32)


def _in_batch_order(parts: list[tuple[MicroBatch, torch.Tensor]], rows: int, width: int) -> torch.Tensor:
    """The micro-batches' ``[n, T-1]`` rows put back in the batch's row order."""
    if len(parts) == 1 and parts[0][0].rows.tolist() == list(range(rows)):
        return parts[0][1]
    out = parts[0][1].new_zeros(rows, width)
    for mb, values in parts:
        out[mb.rows.to(out.device)] = values
    return out


def megatron_optimizer_fields(config: AdamConfig, dtype: torch.dtype) -> dict[str, object]:
    """The ``OptimizerConfig`` fields :func:`make_optimizer` gives Megatron-Core for a model of ``dtype`` (pure).

    BF16: ``bf16=True``, no loss scale. FP16 (``policy.precision: float16``): ``fp16=True`` and
    ``loss_scale=None``, so ``get_megatron_optimizer`` builds its ``DynamicGradScaler`` from ``initial_loss_scale``,
    ``min_loss_scale``, ``loss_scale_window`` and ``hysteresis`` (:class:`~megatron_fp8.megatron.optim.LossScaleConfig`;
    its growth and backoff factors are Megatron's fixed 2 and 0.5). float32: neither (Megatron's FP32 optimizer).
    """
    if dtype == torch.float16 and (config.loss_scale.growth_factor, config.loss_scale.backoff_factor) != (2.0, 0.5):
        raise ConfigError("Megatron-Core's FP16 optimizer grows the loss scale by 2 and backs it off by 0.5 only")
    fields: dict[str, object] = {
        "optimizer": "adam",
        "lr": config.lr,
        "min_lr": config.lr,
        "weight_decay": config.weight_decay,
        "adam_beta1": config.betas[0],
        "adam_beta2": config.betas[1],
        "adam_eps": config.eps,
        "clip_grad": config.clip_grad,
        "bf16": dtype == torch.bfloat16,
        "params_dtype": dtype,
        "use_distributed_optimizer": config.distributed,
        "optimizer_cpu_offload": config.cpu_offload,  # HybridDeviceOptimizer: state and step in host memory
        "optimizer_offload_fraction": config.cpu_offload_fraction if config.cpu_offload else 0.0,
    }
    if dtype == torch.float16:
        fields |= {
            "fp16": True,
            "loss_scale": None,  # dynamic
            "initial_loss_scale": config.loss_scale.initial_scale,
            "min_loss_scale": config.loss_scale.min_scale,
            "loss_scale_window": config.loss_scale.growth_interval,
            "hysteresis": config.loss_scale.hysteresis,
        }
    return fields


def _megatron_optimizer(m: MegatronModel, config: AdamConfig) -> MegatronOptimizer:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # lazy: Megatron-Core is optional

    if not torch.cuda.is_available():
        raise ConfigError(
            "Megatron-Core's optimizer needs CUDA (it allocates device='cuda' tensors); "
            "use make_optimizer(..., backend='torch') or backend='auto' on CPU"
        )
    opt_config = OptimizerConfig(**megatron_optimizer_fields(config, m.dtype))
    if config.distributed != m.ddp_config.use_distributed_optimizer:
        raise ConfigError(
            f"use_distributed_optimizer={config.distributed} but the model's DDP buffers were built with "
            f"{m.ddp_config.use_distributed_optimizer}: pass the same value to build_megatron_model"
        )
    optimizer = get_megatron_optimizer(opt_config, m.model)
    return MegatronDistributedState(optimizer) if config.distributed else optimizer


def _torch_optimizer(m: MegatronModel, config: AdamConfig) -> MegatronDDPAdam | ShardedDDPAdam:
    if config.distributed and config.fp16:
        raise ConfigError(
            "policy.precision: float16 with policy.megatron_cfg.optimizer.use_distributed_optimizer: true runs on a "
            "GPU only (Megatron-Core's DistributedOptimizer); the CPU trainer's sharded Adam has no loss scale: set "
            "use_distributed_optimizer: false, or policy.precision: bfloat16"
        )
    return ShardedDDPAdam(m.model, config) if config.distributed else MegatronDDPAdam(m.model, config)


def set_grad_scale_func(m: MegatronModel, optimizer: StepOptimizer, *, scaled: bool) -> None:
    """Point the model config's ``grad_scale_func`` at the optimizer's ``scale_loss`` when it scales the loss (FP16),
    as Megatron-Bridge's ``setup`` does: Megatron-Core's schedule multiplies every micro-batch's loss by it before
    the backward (``backward_step``), on a GPU and in the CPU trainer alike. BF16 / float32: left unset (scale 1)."""
    from megatron.core.utils import get_model_config  # lazy: Megatron-Core is optional

    for chunk in m.model:
        get_model_config(chunk).grad_scale_func = optimizer.scale_loss if scaled else None


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
    betas: tuple[float, float] = (0.9, 0.999),
    backend: str = "auto",
    distributed: bool = False,
    cpu_offload: bool = False,
    cpu_offload_fraction: float = 1.0,
    loss_scale: LossScaleConfig | None = None,
) -> StepOptimizer:
    """Adam for the model.

    Args:
        m: the model.
        lr: learning rate.
        weight_decay: decoupled weight decay (not on biases / 1-D parameters).
        clip_grad: global gradient-norm clip (0 disables clipping).
        adam_eps: Adam epsilon.
        betas: Adam ``(beta1, beta2)``.
        backend: ``"megatron"`` (Megatron-Core's ``get_megatron_optimizer`` with
            ``OptimizerConfig(optimizer="adam")``; needs CUDA),
            ``"torch"`` (:class:`~megatron_fp8.megatron.optim.MegatronDDPAdam`, runs anywhere), or
            ``"auto"``: ``"megatron"`` when CUDA is available, else ``"torch"``.
        distributed: shard the optimizer state over the data-parallel ranks
            (``policy.megatron_cfg.optimizer.use_distributed_optimizer``): Megatron-Core's ``DistributedOptimizer``
            (the model built with ``use_distributed_optimizer=True``), or on CPU
            :class:`~megatron_fp8.megatron.dist_optim.ShardedDDPAdam`.
        cpu_offload: the Adam state and step in host memory (``optimizer_cpu_offload``): Megatron-Core's
            HybridDeviceOptimizer (GPU; needs ``distributed``); the torch backend keeps its state in host memory anyway.
        cpu_offload_fraction: the share of the state ``cpu_offload`` keeps in host memory (``optimizer_offload_fraction``).
        loss_scale: the dynamic loss scale of an FP16 model (``m.dtype`` or ``m.round_to`` float16:
            ``policy.precision: float16``); ``None``: Megatron-Core's defaults. The model config's
            ``grad_scale_func`` is set to the optimizer's ``scale_loss`` (:func:`set_grad_scale_func`).

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
    config = AdamConfig(
        lr=lr,
        weight_decay=weight_decay,
        betas=betas,
        eps=adam_eps,
        clip_grad=clip_grad,
        distributed=distributed,
        cpu_offload=cpu_offload,
        cpu_offload_fraction=cpu_offload_fraction,
        fp16=torch.float16 in (m.dtype, m.round_to),
        loss_scale=loss_scale if loss_scale is not None else LossScaleConfig(),
    )
    with cpu_device_patches():
        optimizer = builder(m, config)
    set_grad_scale_func(m, optimizer, scaled=config.fp16)
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
    layout: BatchLayout | None = None,
    tally: TokenTally | None = None,
    pad_id: int = 0,
    empty_unused_memory_level: int = 0,
) -> StepResult:
    """Forward, backward and one optimizer step, over micro-batches when asked.

    Args:
        m: the model.
        optimizer: from :func:`make_optimizer`.
        loss_fn: without micro-batches, maps the ``[B, T-1]`` float32 token log-probabilities (with grad) to
            a scalar loss. With ``micro_batch_size`` or a ``layout``, it is called once per micro-batch as
            ``loss_fn(logprobs, rows)`` with that micro-batch's rows' ``[n, T-1]`` log-probabilities and their
            int64 ``[n]`` indices in the batch, and returns the micro-batch's share of the batch loss (the shares
            add up to the batch loss; e.g. a token mean over the whole batch divides by every token of it).
        batch: ``[B, T]`` int64 input ids, or a mapping with ``"input_ids"`` and optional
            ``"attention_mask"``.
        temperature: temperature applied to the logits before the log-softmax.
        micro_batch_size: rows per forward/backward (gradients accumulate in Megatron-Core's DDP buffers
            and are finalized once); ``None``: the whole batch at once.
        layout: dynamic or packed micro-batches (:mod:`~megatron_fp8.megatron.microbatch`); supersedes
            ``micro_batch_size``.
        tally: counts the real and computed tokens of the pass.
        pad_id: token id of packed micro-batches' fill.
        empty_unused_memory_level: Megatron's ``torch.cuda.empty_cache()`` after the forward / backward (1) and after
            the optimizer step too (2) (:func:`~megatron_fp8.megatron.offload.empty_unused_memory`; 0: never).

    Returns:
        :class:`StepResult` with the batch loss before the update and the gradient norm.

    Raises:
        ConfigError: bad batch or micro-batch size, or a loss that is not a finite scalar.
    """
    input_ids, attention_mask = _unpack_batch(batch)
    _check_ids(input_ids, m)
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    plan = _plan_pass(
        input_ids,
        attention_mask,
        layout,
        micro_batch_size,
        key="policy.train_micro_batch_size",
        tally=tally,
        pad_id=pad_id,
    )
    whole = layout is None and micro_batch_size is None

    def share(logprobs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return loss_fn(logprobs) if whole else loss_fn(logprobs, rows)

    for chunk in m.model:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    with cpu_device_patches():
        shares = [value for _, value in run_schedule(m, plan, temperature=temperature, loss=share)]
        total = from_last_stage(float(torch.stack(shares).double().sum()) if shares else None)  # one host sync
        finalize_model_grads(m.model)
        empty_unused_memory(empty_unused_memory_level, point=1)
        update_successful, grad_norm, num_zeros = optimizer.step()
        empty_unused_memory(empty_unused_memory_level, point=2)
    for chunk in m.model:
        chunk.eval()
    return StepResult(
        loss=float(total),
        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        update_successful=bool(update_successful),
        num_zeros_in_grad=int(num_zeros) if num_zeros is not None else None,
    )
