"""Adam for Megatron-Core DDP models where Megatron-Core's own optimizer cannot run (CPU).

Megatron-Core 0.16.1's optimizers do not run without CUDA: ``Float16OptimizerWithFloat16Params``
and ``FP32Optimizer`` allocate ``torch.tensor(..., device='cuda')`` in their constructors
(``optimizer.py`` ``found_inf``, ``_scale_one``, ``_scale``), ``clip_grads.py`` does the same for
the gradient norm, and the BF16 optimizer accepts only ``param.type()`` in
``torch.cuda.{Half,BFloat16,Float}Tensor``. Patching all of that would be a fork of the
optimizer, so on CPU :class:`MegatronDDPAdam` does the same job with the same interface:

* gradients come from Megatron-Core DDP's FP32 grad buffer (``param.main_grad``, filled by
  DDP's backward hooks and reduced by ``finish_grad_sync``);
* BF16 parameters get FP32 main copies (as Megatron's mixed-precision optimizer keeps),
  updated by ``torch.optim.AdamW`` and copied back after each step;
* global gradient-norm clipping counts tensor-parallel duplicates once and all-reduces the
  squared norm over the model-parallel group, as Megatron does;
* a step with non-finite gradients is skipped and reported (``update_successful=False``);
* no weight decay on biases and 1-D parameters (norm weights), Megatron's default;
* FP16 (``policy.precision: float16``, emulated on CPU): Megatron-Core's dynamic loss scale
  (:class:`DynamicLossScaler`, its ``DynamicGradScaler`` rule with its defaults), the loss multiplied by it through
  the model config's ``grad_scale_func`` (the hook Megatron-Core's schedule calls before the backward, set by
  :func:`~megatron_fp8.megatron.step.make_optimizer` as Megatron-Bridge sets ``optimizer.scale_loss``), the
  gradients divided by it before the norm and the clip; a gradient that is not finite *or would not fit in FP16*
  (``|g * scale| > 65504``: the float32 CPU trainer's stand-in for an FP16 backward's overflow, checked on the
  parameters' gradients) skips the step and backs the scale off; after every update the weights are rounded to
  FP16 (FP32 main copies kept), so FP16's range and precision hold for the weights.

``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)`` like Megatron's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatron_fp8.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdamConfig:
    """Hyper-parameters of :class:`MegatronDDPAdam`.

    Attributes:
        lr: learning rate.
        weight_decay: decoupled weight decay (not applied to biases and 1-D parameters).
        betas: Adam ``(beta1, beta2)``.
        eps: Adam epsilon.
        clip_grad: global L2 gradient-norm clip; 0 disables clipping.
        distributed: shard the FP32 main weights and Adam moments over the data-parallel ranks (ZeRO-1:
            Megatron-Core's ``DistributedOptimizer`` on a GPU, :class:`~megatron_fp8.megatron.dist_optim.ShardedDDPAdam`
            on CPU).
        cpu_offload: Adam state and step in host memory (Megatron-Core's HybridDeviceOptimizer on a GPU; the CPU
            optimizers hold it there anyway).
        cpu_offload_fraction: the share of the state ``cpu_offload`` keeps in host memory, in [0, 1].
        fp16: FP16 mixed precision (``policy.precision: float16``): Megatron-Core's FP16 optimizer on a GPU, the
            emulation of :class:`MegatronDDPAdam` on CPU, both with the dynamic loss scale of ``loss_scale``.
        loss_scale: the dynamic loss scale's settings (read with ``fp16`` only).
    """

    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0
    distributed: bool = False
    cpu_offload: bool = False
    cpu_offload_fraction: float = 1.0
    fp16: bool = False
    loss_scale: LossScaleConfig = field(default_factory=lambda: LossScaleConfig())


@dataclass(frozen=True)
class LossScaleConfig:
    """Megatron-Core's dynamic loss scale (``OptimizerConfig`` fields and the factors ``get_megatron_optimizer``
    passes to ``DynamicGradScaler``), with Megatron-Core 0.16.1's defaults, which NeMo-RL's ``precision: float16``
    uses (it sets none of them).

    Attributes:
        initial_scale: the first scale (``initial_loss_scale``, 2**32).
        min_scale: the scale never goes below it (``min_loss_scale``).
        growth_factor: multiplies the scale after ``growth_interval`` steps without overflow.
        backoff_factor: multiplies the scale once ``hysteresis`` overflowing steps were seen.
        growth_interval: clean steps before the scale grows (``loss_scale_window``).
        hysteresis: overflowing steps before the scale backs off (``hysteresis``).
    """

    initial_scale: float = 2.0**32
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2

    def __post_init__(self) -> None:
        if not (0 < self.min_scale <= self.initial_scale) or self.growth_factor <= 1:
            raise ConfigError(f"loss scale: need 0 < min_scale <= initial_scale and growth_factor > 1, got {self}")
        if not 0 < self.backoff_factor < 1 or self.growth_interval < 1 or self.hysteresis < 1:
            raise ConfigError(f"loss scale: need 0 < backoff_factor < 1, growth_interval >= 1, hysteresis >= 1: {self}")


FP16_MAX = 65504.0
"""The largest finite FP16 value: a scaled gradient above it overflows an FP16 backward."""


class DynamicLossScaler:
    """Megatron-Core's ``DynamicGradScaler`` update rule on the CPU (its class allocates ``device='cuda'``).

    The scale is a float32 ``[1]`` tensor, as Megatron's. :meth:`update` after every step: an overflow resets the
    growth count and uses up one unit of hysteresis; with none left the scale is multiplied by ``backoff_factor``
    (not below ``min_scale``), and every further overflow backs it off again until ``growth_interval`` clean steps
    in a row multiply it by ``growth_factor`` and restore the hysteresis.

    Args:
        config: the settings.
    """

    def __init__(self, config: LossScaleConfig):
        self.config = config
        self._scale = torch.tensor([config.initial_scale], dtype=torch.float)
        self._min = torch.tensor([config.min_scale], dtype=torch.float)
        self._growth_tracker = 0
        self._hysteresis_tracker = config.hysteresis
        self.skipped_steps = 0

    @property
    def scale(self) -> torch.Tensor:
        """The loss scale, float32 ``[1]``."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` computed in float64 and rounded to float32, as Megatron's."""
        return self._scale.double().reciprocal().float()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the scale (the model config's ``grad_scale_func``; Megatron's ``optimizer.scale_loss``)."""
        return self._scale.to(loss.device) * loss

    def update(self, found_inf: bool) -> None:
        """Megatron-Core's rule after a step (``found_inf``: its gradients overflowed and it was skipped)."""
        if found_inf:
            self.skipped_steps += 1
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.config.backoff_factor, self._min)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.config.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.config.hysteresis
                self._scale = self._scale * self.config.growth_factor

    def state_dict(self) -> dict:
        """Megatron's keys (``scale``, ``growth_tracker``, ``hysteresis_tracker``) plus ``skipped_steps``."""
        return {
            "scale": self._scale.clone(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output."""
        self._scale = state["scale"].detach().to(torch.float).cpu().clone()
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def fp16_overflow(grads: Sequence[tuple[torch.nn.Parameter, torch.Tensor]]) -> bool:
    """Whether an FP16 backward of these scaled float32 gradients overflows: a value not finite or above
    :data:`FP16_MAX`; agreed (any) over Megatron-Core's model-parallel group, as Megatron's ``found_inf``."""
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    worst = torch.zeros(1, dtype=torch.float32)
    for _, grad in grads:
        if grad.numel():
            worst = torch.maximum(worst, grad.abs().max().reshape(1).float())
    found = torch.tensor([0.0 if math.isfinite(float(worst)) and float(worst) <= FP16_MAX else 1.0])
    if torch.distributed.is_initialized() and parallel_state.get_model_parallel_group().size() > 1:
        group = parallel_state.get_model_parallel_group()
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(found.item())


class StepOptimizer(Protocol):
    """What :func:`megatron_fp8.megatron.step.train_step` needs of an optimizer.

    Met by Megatron-Core's ``MegatronOptimizer`` (``get_megatron_optimizer``) and by
    :class:`MegatronDDPAdam`.
    """

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients."""
        ...

    def step(self) -> tuple[bool, float | None, int | None]:
        """One update: ``(update_successful, grad_norm, num_zeros_in_grad)``."""
        ...


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's default: no weight decay on biases and 1-D parameters (norm weights)."""
    return name.endswith(".bias") or param.dim() == 1


def _is_expert(param: torch.Tensor) -> bool:
    """Megatron-Core marks a routed expert's parameters ``allreduce=False`` (reduced over the expert-DP group)."""
    return getattr(param, "allreduce", True) is False


def _counts_for_norm(param: torch.Tensor) -> bool:
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    if getattr(param, "tensor_model_parallel", False):
        return True
    if _is_expert(param):
        return parallel_state.get_expert_tensor_parallel_rank() == 0
    return parallel_state.get_tensor_model_parallel_rank() == 0


def gradient_norm(grads: Sequence[tuple[torch.nn.Parameter, torch.Tensor]]) -> float:
    """Global L2 norm of the gradients, as Megatron's optimizers count it.

    Tensor-parallel duplicates count once; the dense parameters' squares are all-reduced over Megatron-Core's
    model-parallel group (TP x PP), a routed expert's over the expert group that splits the experts
    (expert-TP x EP x PP): each expert lives on one EP rank, so a rank alone sees only its own experts.

    Args:
        grads: ``(parameter, its FP32 gradient)`` pairs of this rank.
    """
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    dense = torch.zeros(1, dtype=torch.float64)
    expert = torch.zeros(1, dtype=torch.float64)
    for param, grad in grads:
        if _counts_for_norm(param):
            (expert if _is_expert(param) else dense).add_(grad.double().pow(2).sum())
    if torch.distributed.is_initialized():
        if parallel_state.get_model_parallel_group().size() > 1:
            torch.distributed.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        expert_group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
        if any(_is_expert(p) for p, _ in grads) and expert_group.size() > 1:
            torch.distributed.all_reduce(expert, group=expert_group)
    return math.sqrt(float(dense + expert))


def fp32_grads(params: Sequence[torch.nn.Parameter]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Each parameter's FP32 gradient (Megatron-Core DDP's ``main_grad``, else ``.grad``); those without one are left
    out."""
    out = []
    for param in params:
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is not None:
            out.append((param, grad.float()))
    return out


def clip_scale(grads: Sequence[tuple[torch.nn.Parameter, torch.Tensor]], clip_grad: float) -> tuple[float, int, float]:
    """What one update does with ``grads``: ``(grad_norm, num_zeros_in_grad, scale)``.

    ``grad_norm`` is the global norm before clipping (:func:`gradient_norm`); ``scale`` multiplies every gradient
    (``clip_grad / norm`` above the clip, else 1.0), and is NaN when the norm is not finite: skip the step (logged).
    """
    norm = gradient_norm(grads)
    num_zeros = int(sum(int((g == 0).sum()) for _, g in grads))
    if not math.isfinite(norm):
        logger.warning("non-finite gradient norm (%s); optimizer step skipped", norm)
        return norm, num_zeros, float("nan")
    scale = clip_grad / (norm + 1e-6) if clip_grad > 0 and norm > clip_grad else 1.0
    return norm, num_zeros, scale


class MegatronDDPAdam:
    """AdamW over Megatron-Core DDP grad buffers with FP32 main weights (see the module docstring).

    Args:
        model_chunks: the DDP-wrapped model chunks.
        config: the hyper-parameters.
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module], config: AdamConfig):
        if config.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {config.lr}")
        self.config = config
        # FP16: every weight gets a float32 main copy and is held at FP16 values (Megatron's FP16 optimizer)
        self.loss_scaler = DynamicLossScaler(config.loss_scale) if config.fp16 else None
        self._pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        decay: list[torch.Tensor] = []
        undecayed: list[torch.Tensor] = []
        for chunk in model_chunks:
            for name, param in chunk.named_parameters():
                if not param.requires_grad:
                    continue
                if config.fp16:
                    param.data.copy_(param.data.to(torch.float16))
                own = param.dtype == torch.float32 and not config.fp16
                main = param if own else param.detach().float().clone()
                if main is not param:
                    main.requires_grad_(True)
                self._pairs.append((param, main))
                (undecayed if no_decay(name, param) else decay).append(main)
        if not self._pairs:
            raise ConfigError("the model has no trainable parameters")
        groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": undecayed, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=config.lr, betas=config.betas, eps=config.eps
        )

    @property
    def param_groups(self) -> list[dict]:
        """The torch optimizer's parameter groups (change ``"lr"`` here to schedule)."""
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the main-parameter gradients (the DDP buffer is cleared by ``zero_grad_buffer``)."""
        for param, main in self._pairs:
            main.grad = None
            if set_to_none:
                param.grad = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the FP16 loss scale (Megatron's ``optimizer.scale_loss``; 1 without FP16)."""
        return self.loss_scaler.scale_loss(loss) if self.loss_scaler is not None else loss

    def get_loss_scale(self) -> torch.Tensor:
        """The loss scale, float32 ``[1]`` (1.0 without FP16), as Megatron's ``get_loss_scale``."""
        return self.loss_scaler.scale if self.loss_scaler is not None else torch.ones(1)

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        """Unscale (FP16), clip, check and apply one AdamW update.

        Returns:
            ``(update_successful, grad_norm, num_zeros_in_grad)``; ``grad_norm`` is measured
            before clipping; the update is skipped when it is not finite. An FP16 step whose gradients overflow
            is skipped with ``(False, None, None)``, as Megatron's, and the loss scale backs off.
        """
        grads = fp32_grads([param for param, _ in self._pairs])
        if self.loss_scaler is not None:
            found_inf = fp16_overflow(grads)
            scale_was = float(self.loss_scaler.scale)
            self.loss_scaler.update(found_inf)
            if found_inf:
                logger.warning(
                    "FP16: gradients overflow at loss scale %g; step skipped (%d so far), loss scale now %g",
                    scale_was,
                    self.loss_scaler.skipped_steps,
                    float(self.loss_scaler.scale),
                )
                return False, None, None
            inv = self.loss_scaler.inv_scale
            grads = [(param, grad * inv) for param, grad in grads]
            logger.debug("FP16: loss scale %g, %d steps skipped", scale_was, self.loss_scaler.skipped_steps)
        norm, num_zeros, scale = clip_scale(grads, self.config.clip_grad)
        if math.isnan(scale):
            return False, norm, num_zeros
        mains = dict(self._pairs)
        for param, grad in grads:
            mains[param].grad = grad * scale if scale != 1.0 else grad.clone()
        self.optimizer.step()
        for param, main in self._pairs:
            if main is not param:
                param.data.copy_(main.data.to(torch.float16) if self.loss_scaler is not None else main.data)
        return True, norm, num_zeros

    def state_dict(self) -> dict:
        """Optimizer state plus the FP32 main weights, in parameter order (and the FP16 loss scaler's state)."""
        state = {"optimizer": self.optimizer.state_dict(), "main_params": [m.detach().clone() for _, m in self._pairs]}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (same model, same parameter order)."""
        if "optimizer" not in state:
            raise ConfigError(
                f"this optimizer state is not the unsharded Adam's ({state.get('format', 'unknown format')!r}); resume "
                "with the policy.megatron_cfg.optimizer.use_distributed_optimizer it was saved with"
            )
        mains = state["main_params"]
        if len(mains) != len(self._pairs):
            raise ConfigError(f"optimizer state has {len(mains)} main params, the model has {len(self._pairs)}")
        with torch.no_grad():
            for (param, main), saved in zip(self._pairs, mains, strict=True):
                main.copy_(saved)
                if main is not param:
                    param.data.copy_(saved.to(torch.float16) if self.loss_scaler is not None else saved)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.loss_scaler is not None:
            if "loss_scaler" not in state:
                raise ConfigError(
                    "this optimizer state has no FP16 loss scale (saved without policy.precision: float16); resume "
                    "with the policy.precision it was saved with"
                )
            self.loss_scaler.load_state_dict(state["loss_scaler"])
