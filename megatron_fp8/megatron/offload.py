"""The trainer's optimizer state and gradient buffers out of device memory while a colocated engine generates.

NeMo-RL's colocated mode moves the policy's optimizer state and gradients to host memory before the engine wakes
(``offload_before_refit``) and back before training (``prepare_for_training``); megatron-fp8 does the same with
:class:`TrainerOffload`:

* **optimizer state**: every tensor the optimizer keeps besides the model's own weights: the FP32 main weights
  and the Adam moments of :class:`~megatron_fp8.megatron.optim.MegatronDDPAdam`, of the distributed optimizer's
  shards (:class:`~megatron_fp8.megatron.dist_optim.ShardedDDPAdam`; Megatron-Core's ``DistributedOptimizer``
  through its inner torch optimizer) alike. :meth:`TrainerOffload.offload` copies each into a pinned host buffer
  (allocated once, reused every step; pinned where CUDA is present) on a side stream, waits for the copies, and
  rebinds the optimizer's tensors to the host copies (``.data`` of a main weight, the entry of a state dict), so the
  device memory is freed with its last reference and a checkpoint taken meanwhile reads the same values. :meth:`TrainerOffload.onload` copies them back asynchronously: the host returns
  at once, the current stream waits on the copies' event before the step's kernels;
* **gradient buffers**: Megatron-Core DDP's contiguous grad buffers (``param.main_grad`` are views of them): their
  storage is released (``resize_(0)``; the views stay valid) and re-allocated zeroed on :meth:`onload`, not copied:
  :func:`~megatron_fp8.megatron.step.train_step` zeroes them (``zero_grad_buffer``) before every backward anyway;
* ``policy.megatron_cfg.optimizer.optimizer_cpu_offload``: the optimizer state lives in host memory already
  (Megatron-Core's HybridDeviceOptimizer on a GPU): tensors already on the host are left where they are.

On a CPU-only machine the "device" is host memory too: the copies and releases happen all the same (what the CPU
tests check: the state comes back bit for bit, the grad buffers are released and zeroed, training continues as
without offload), without pinning.

:func:`empty_unused_memory` is Megatron's ``empty_unused_memory_level`` (``torch.cuda.empty_cache()`` after the
forward / backward at level >= 1, after the optimizer step at level 2).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megatron_fp8.errors import ConfigError

logger = logging.getLogger(__name__)

EMPTY_UNUSED_MEMORY_LEVELS = (0, 1, 2)
"""Megatron's ``empty_unused_memory_level`` values: none, after forward/backward, also after the optimizer step."""


def empty_unused_memory(level: int, *, point: int) -> bool:
    """``torch.cuda.empty_cache()`` when ``level >= point`` and CUDA is present; whether it ran.

    Args:
        level: ``policy.megatron_cfg.empty_unused_memory_level`` (0, 1 or 2).
        point: 1 after a forward / backward, 2 after an optimizer step.
    """
    if level not in EMPTY_UNUSED_MEMORY_LEVELS:
        raise ConfigError(f"empty_unused_memory_level must be one of {EMPTY_UNUSED_MEMORY_LEVELS}, got {level!r}")
    if level >= point and torch.cuda.is_available():
        torch.cuda.empty_cache()
        return True
    return False


def _inner_optimizers(optimizer: object) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside ``optimizer`` (ours: ``.optimizer``; Megatron-Core's chained ones:
    ``.chained_optimizers``; its ``DistributedOptimizer`` / mixed-precision ones: ``.optimizer``)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer
        return
    for inner in getattr(optimizer, "chained_optimizers", None) or ():
        yield from _inner_optimizers(inner)
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer:
        yield from _inner_optimizers(inner)


@dataclass(frozen=True)
class OffloadReport:
    """What one :meth:`TrainerOffload.offload` moved.

    Attributes:
        optimizer_bytes: optimizer-state bytes copied to host memory.
        grad_bytes: gradient-buffer bytes released.
        tensors: optimizer tensors moved.
    """

    optimizer_bytes: int
    grad_bytes: int
    tensors: int


class TrainerOffload:
    """Moves a trainer's optimizer state and gradient buffers out of device memory and back (module docstring).

    Args:
        model_chunks: the DDP-wrapped model chunks (their weights stay; their grad buffers are released).
        optimizer: the trainer's optimizer (:func:`~megatron_fp8.megatron.step.make_optimizer`'s).
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module], optimizer: object):
        self._chunks = list(model_chunks)
        self._optimizer = optimizer
        self._weights = {id(p) for chunk in self._chunks for p in chunk.parameters()}
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # (slot, key) -> reused host buffer
        self._where: dict[tuple[int, str], torch.device] = {}  # the device of each tensor while offloaded
        self._grad_sizes: list[tuple[torch.Tensor, int]] = []
        self.offloaded = False

    def _slots(self) -> Iterator[tuple[tuple[int, str], object, str | None]]:
        """``(key, holder, entry)``: a main weight (``holder`` the tensor, ``entry`` None) or a state entry
        (``holder`` the state dict of a parameter, ``entry`` its key), in a fixed order."""
        for o, opt in enumerate(_inner_optimizers(self._optimizer)):
            index = 0
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in self._weights:  # an FP32 main copy, not the model's weight itself
                        yield (index, f"{o}.main"), p, None
                    for k, v in sorted(opt.state.get(p, {}).items()):
                        if isinstance(v, torch.Tensor) and v.numel() > 1:
                            yield (index, f"{o}.{k}"), opt.state[p], k
                    index += 1

    def _grad_buffers(self) -> Iterator[torch.Tensor]:
        for chunk in self._chunks:
            for buffer in [*getattr(chunk, "buffers", ()), *getattr(chunk, "expert_parallel_buffers", ())]:
                grad = getattr(buffer, "grad_data", None)
                if isinstance(grad, torch.Tensor):
                    yield grad

    @staticmethod
    def _get(holder: object, entry: str | None) -> torch.Tensor:
        return holder if entry is None else holder[entry]

    @staticmethod
    def _put(holder: object, entry: str | None, value: torch.Tensor) -> None:
        if entry is None:
            holder.data = value
        else:
            holder[entry] = value

    def offload(self) -> OffloadReport:
        """Optimizer state to (pinned) host memory, grad buffers and the optimizer's ``.grad`` copies released, the
        freed device memory returned to the driver (``torch.cuda.empty_cache()``: a vLLM engine waking up allocates
        outside torch's caching allocator); idempotent."""
        if self.offloaded:
            return OffloadReport(optimizer_bytes=0, grad_bytes=0, tensors=0)
        for opt in _inner_optimizers(self._optimizer):  # the step's gradient copies; zero_grad() drops them anyway
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = None
        cuda = torch.cuda.is_available()
        stream = torch.cuda.Stream() if cuda else None
        moved: list[tuple[tuple[int, str], object, str | None, torch.Tensor]] = []
        opt_bytes = 0
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
            for key, holder, entry in self._slots():
                t = self._get(holder, entry)
                if cuda and t.device.type == "cpu":  # already in host memory (optimizer_cpu_offload)
                    continue
                host = self._host.get(key)
                if host is None or host.shape != t.shape or host.dtype != t.dtype:
                    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda)
                    self._host[key] = host
                host.copy_(t.detach(), non_blocking=cuda)
                moved.append((key, holder, entry, host))
                opt_bytes += t.numel() * t.element_size()
        if stream is not None:
            stream.synchronize()  # the host copies are complete before the device tensors are let go
        for key, holder, entry, host in moved:  # the device tensors are freed with their last reference
            self._where[key] = self._get(holder, entry).device
            self._put(holder, entry, host)
        grad_bytes = 0
        self._grad_sizes = []
        for grad in self._grad_buffers():
            storage = grad.untyped_storage()
            self._grad_sizes.append((grad, storage.nbytes()))
            grad_bytes += storage.nbytes()
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.offloaded = True
        logger.debug("trainer offload: %d optimizer tensors (%d B) to host, %d B of gradient buffers released",
                     len(moved), opt_bytes, grad_bytes)  # fmt: skip
        return OffloadReport(optimizer_bytes=opt_bytes, grad_bytes=grad_bytes, tensors=len(moved))

    def onload(self) -> None:
        """Optimizer state back to the device (asynchronous H2D copies the current stream waits on), grad buffers
        re-allocated zeroed; idempotent."""
        if not self.offloaded:
            return
        for grad, nbytes in self._grad_sizes:
            grad.untyped_storage().resize_(nbytes)
            grad.zero_()
        self._grad_sizes = []
        cuda = torch.cuda.is_available()
        stream = torch.cuda.Stream() if cuda else None
        slots = list(self._slots())
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())  # the re-allocations come first
            for key, holder, entry in slots:
                where = self._where.pop(key, None)
                if where is None:
                    continue
                host = self._get(holder, entry)
                device = torch.empty(host.shape, dtype=host.dtype, device=where)
                device.copy_(host, non_blocking=cuda)
                self._put(holder, entry, device)
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)  # the step's kernels run after the copies; no host sync
        self.offloaded = False
