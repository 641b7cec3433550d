"""The distributed optimizer where Megatron-Core's cannot run: Adam state sharded over the data-parallel ranks.

``policy.megatron_cfg.optimizer.use_distributed_optimizer: true`` asks for ZeRO-1: each data-parallel rank keeps
the FP32 main weights and the two Adam moments (12 bytes per parameter) of its shard only. On a GPU that is
Megatron-Core's ``DistributedOptimizer`` (:func:`megatron_fp8.megatron.step.make_optimizer`); it hard-codes CUDA
(:mod:`megatron_fp8.megatron.optim`), so on CPU :class:`ShardedDDPAdam` shards the same way:

* the model's trainable parameters, in chunk and parameter order, form one flat index space of ``N`` elements,
  cut into ``DP`` equal ranges (``ceil(N / DP)``, the last one shorter), as Megatron-Core's distributed optimizer
  cuts its contiguous grad buffer; rank ``r`` owns range ``r``, which covers pieces of one or more parameters;
* gradients are Megatron-Core DDP's FP32 ``main_grad`` after ``finalize_model_grads`` (an all-reduce: gloo has no
  reduce-scatter); the global gradient norm, clipping and the non-finite skip are :class:`MegatronDDPAdam`'s;
* AdamW updates the rank's pieces (element by element the same arithmetic as the unsharded optimizer), then the
  updated ranges are all-gathered over the data-parallel group into every replica's weights;
* :meth:`ShardedDDPAdam.state_dict` gathers the whole state (collective) in a layout that does not depend on the
  data-parallel size, so a checkpoint resumes at another number of replicas.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_fp8.errors import ConfigError
from megatron_fp8.layout import ceil_div
from megatron_fp8.megatron.optim import AdamConfig, clip_scale, fp32_grads, no_decay

logger = logging.getLogger(__name__)

STATE_FORMAT = "megatron-fp8 sharded adam v1"
"""Tag of :meth:`ShardedDDPAdam.state_dict` (a checkpoint of the unsharded optimizer is refused by name)."""


@dataclass(frozen=True)
class _Piece:
    """The part ``[start, stop)`` of parameter ``index``'s flat elements that this rank owns."""

    index: int
    start: int
    stop: int


def _data_parallel_group() -> tuple[dist.ProcessGroup | None, int, int]:
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return None, 0, 1
    group = parallel_state.get_data_parallel_group()
    return group, dist.get_rank(group), dist.get_world_size(group)


class ShardedDDPAdam:
    """AdamW with FP32 main weights and moments sharded over the data-parallel ranks (module docstring).

    Args:
        model_chunks: the DDP-wrapped model chunks (the same parameters in the same order on every replica).
        config: the hyper-parameters.
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module], config: AdamConfig):
        if config.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {config.lr}")
        self.config = config
        named = [(n, p) for chunk in model_chunks for n, p in chunk.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the model has no trainable parameters")
        self._params = [p for _, p in named]
        self._offsets = [0]
        for p in self._params:
            self._offsets.append(self._offsets[-1] + p.numel())
        self._group, self.dp_rank, self.dp_size = _data_parallel_group()
        total = self._offsets[-1]
        self.shard_size = ceil_div(total, self.dp_size)
        lo, hi = self.dp_rank * self.shard_size, min((self.dp_rank + 1) * self.shard_size, total)
        self._pieces: list[_Piece] = []
        self._mains: list[torch.Tensor] = []
        groups: dict[bool, list[torch.Tensor]] = {False: [], True: []}
        for index, ((name, param), start) in enumerate(zip(named, self._offsets, strict=False)):
            a, b = max(lo, start) - start, min(hi, start + param.numel()) - start
            if a >= b:
                continue
            main = param.detach().reshape(-1)[a:b].float().clone().requires_grad_(True)
            self._pieces.append(_Piece(index, a, b))
            self._mains.append(main)
            groups[no_decay(name, param)].append(main)
        param_groups = [
            {"params": groups[False], "weight_decay": config.weight_decay},
            {"params": groups[True], "weight_decay": 0.0},
        ]
        kept = [g for g in param_groups if g["params"]]
        # a rank whose range is empty (fewer elements than ranks) still takes part in every collective
        dummy = [{"params": [torch.zeros(0, requires_grad=True)], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(kept or dummy, lr=config.lr, betas=config.betas, eps=config.eps)
        logger.info(
            "distributed optimizer: data-parallel rank %d of %d holds %d of %d parameter elements (%d pieces)",
            self.dp_rank,
            self.dp_size,
            hi - lo if hi > lo else 0,
            total,
            len(self._pieces),
        )

    @property
    def param_groups(self) -> list[dict]:
        """The torch optimizer's parameter groups (change ``"lr"`` here to schedule)."""
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the main-piece gradients (the DDP buffer is cleared by ``zero_grad_buffer``)."""
        for main in self._mains:
            main.grad = None
        if set_to_none:
            for param in self._params:
                param.grad = None

    @torch.no_grad()
    def step(self) -> tuple[bool, float, int]:
        """Clip, check and apply one AdamW update to this rank's pieces, then all-gather the weights.

        Returns:
            ``(update_successful, grad_norm, num_zeros_in_grad)`` as :class:`MegatronDDPAdam` returns them.
        """
        grads = fp32_grads(self._params)
        norm, num_zeros, scale = clip_scale(grads, self.config.clip_grad)
        if math.isnan(scale):
            return False, norm, num_zeros
        by_param = {id(p): g for p, g in grads}
        for piece, main in zip(self._pieces, self._mains, strict=True):
            grad = by_param.get(id(self._params[piece.index]))
            if grad is None:
                main.grad = None
                continue
            part = grad.reshape(-1)[piece.start : piece.stop]
            main.grad = part * scale if scale != 1.0 else part.clone()
        self.optimizer.step()
        self._write_weights(self._gather(self._mains))
        return True, norm, num_zeros

    def _gather(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's pieces (in order) -> the whole flat FP32 vector ``[N]`` on every rank (all-gather)."""
        local = torch.zeros(self.shard_size, dtype=torch.float32)
        if pieces:
            flat = torch.cat([p.detach().reshape(-1).float() for p in pieces])
            local[: flat.numel()] = flat
        if self.dp_size == 1:
            return local[: self._offsets[-1]]
        out = [torch.empty_like(local) for _ in range(self.dp_size)]
        dist.all_gather(out, local, group=self._group)
        return torch.cat(out)[: self._offsets[-1]]

    def _write_weights(self, flat: torch.Tensor) -> None:
        for index, param in enumerate(self._params):
            start, stop = self._offsets[index], self._offsets[index + 1]
            param.data.copy_(flat[start:stop].view_as(param))

    def _moment(self, key: str) -> list[torch.Tensor]:
        return [self.optimizer.state.get(main, {}).get(key, torch.zeros_like(main)) for main in self._mains]

    def state_dict(self) -> dict:
        """The whole optimizer state, independent of the data-parallel size (collective over the DP group).

        Returns:
            ``{"format", "step", "main_params", "exp_avg", "exp_avg_sq"}``; the last three are per parameter, in
            parameter order, FP32 in the parameter's shape.
        """
        steps = [float(self.optimizer.state.get(m, {}).get("step", 0.0)) for m in self._mains]
        step = torch.tensor([max(steps, default=0.0)], dtype=torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self._group)
        whole = {key: self._split(self._gather(self._moment(key))) for key in ("exp_avg", "exp_avg_sq")}
        return {
            "format": STATE_FORMAT,
            "step": float(step),
            "main_params": self._split(self._gather(self._mains)),
            **whole,
        }

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[self._offsets[i] : self._offsets[i + 1]].view(p.shape).clone() for i, p in enumerate(self._params)]

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output, at any data-parallel size.

        Raises:
            ConfigError: a state of another optimizer (the unsharded one), or of another model.
        """
        if state.get("format") != STATE_FORMAT:
            raise ConfigError(
                "this checkpoint's optimizer state is not the distributed optimizer's "
                f"({state.get('format', 'the unsharded Adam')!r}); resume with the "
                "policy.megatron_cfg.optimizer.use_distributed_optimizer it was saved with"
            )
        mains = state["main_params"]
        if [tuple(t.shape) for t in mains] != [tuple(p.shape) for p in self._params]:
            raise ConfigError(
                f"optimizer state holds {len(mains)} parameters of other shapes than the model's {len(self._params)}"
            )
        with torch.no_grad():
            for param, saved in zip(self._params, mains, strict=True):
                param.data.copy_(saved)
            for piece, main in zip(self._pieces, self._mains, strict=True):
                part = slice(piece.start, piece.stop)
                main.copy_(mains[piece.index].reshape(-1)[part])
                self.optimizer.state[main] = {
                    "step": torch.tensor(state["step"], dtype=torch.float32),
                    "exp_avg": state["exp_avg"][piece.index].reshape(-1)[part].clone(),
                    "exp_avg_sq": state["exp_avg_sq"][piece.index].reshape(-1)[part].clone(),
                }


class MegatronDistributedState:
    """Megatron-Core's ``DistributedOptimizer`` (GPU) with a whole-state ``state_dict`` for the checkpoints.

    Its own ``state_dict()`` leaves the sharded parameter state out; this adds it, gathered on data-parallel rank 0
    (``get_parameter_state_dp_zero``, collective) and scattered back on load (``load_parameter_state_from_dp_zero``).
    Every other attribute is the wrapped optimizer's.

    Args:
        optimizer: what ``get_megatron_optimizer(OptimizerConfig(use_distributed_optimizer=True), ...)`` returned.
    """

    def __init__(self, optimizer: object):
        self._optimizer = optimizer

    def __getattr__(self, name: str) -> object:
        return getattr(self._optimizer, name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients."""
        self._optimizer.zero_grad(set_to_none)

    def step(self) -> tuple[bool, float | None, int | None]:
        """One update (Megatron-Core's)."""
        return self._optimizer.step()

    def state_dict(self) -> dict:
        """``{"common": its state_dict(), "param_state": the gathered parameter state}`` (collective)."""
        return {"common": self._optimizer.state_dict(), "param_state": self._optimizer.get_parameter_state_dp_zero()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (collective)."""
        self._optimizer.load_state_dict(state["common"])
        self._optimizer.load_parameter_state_from_dp_zero(state["param_state"])
