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
* no weight decay on biases and 1-D parameters (norm weights), Megatron's default.

``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)`` like Megatron's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
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
    """

    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0
    distributed: bool = False
    cpu_offload: bool = False
    cpu_offload_fraction: float = 1.0


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
        self._pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        decay: list[torch.Tensor] = []
        undecayed: list[torch.Tensor] = []
        for chunk in model_chunks:
            for name, param in chunk.named_parameters():
                if not param.requires_grad:
                    continue
                main = param if param.dtype == torch.float32 else param.detach().float().clone()
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

    @torch.no_grad()
    def step(self) -> tuple[bool, float, int]:
        """Clip, check and apply one AdamW update.

        Returns:
            ``(update_successful, grad_norm, num_zeros_in_grad)``; ``grad_norm`` is measured
            before clipping; the update is skipped when it is not finite.
        """
        grads = fp32_grads([param for param, _ in self._pairs])
        norm, num_zeros, scale = clip_scale(grads, self.config.clip_grad)
        if math.isnan(scale):
            return False, norm, num_zeros
        mains = dict(self._pairs)
        for param, grad in grads:
            mains[param].grad = grad * scale if scale != 1.0 else grad.clone()
        self.optimizer.step()
        for param, main in self._pairs:
            if main is not param:
                param.data.copy_(main.data)
        return True, norm, num_zeros

    def state_dict(self) -> dict:
        """Optimizer state plus the FP32 main weights, in parameter order."""
        return {"optimizer": self.optimizer.state_dict(), "main_params": [m.detach().clone() for _, m in self._pairs]}

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
                    param.data.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
