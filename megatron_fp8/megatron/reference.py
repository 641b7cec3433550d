"""The reference policy of the KL penalty: the arm's initial weights, swapped into the training model to score.

NeMo-RL's ``loss_fn.reference_policy_kl_penalty`` compares the policy with the model training started from. A
second model would double the trainer's GPU memory; like NeMo-RL's Megatron worker, megatron-fp8 keeps one
copy of this rank's parameter shards in host memory (pinned where CUDA is used) and, for the reference forward,
copies them into the training model's parameters and the current values back afterwards. Every rank holds only
its own tensor-, pipeline- and expert-parallel shard, so the swap needs no communication and works at any layout.

Cost per step: three copies of this rank's parameters (current -> host, reference -> model, host -> model); host
memory: two copies of them. The values the model holds after the swap are the same bytes as before it (the
optimizer's FP32 main weights and moments are never touched).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_fp8.megatron.build import MegatronModel

logger = logging.getLogger(__name__)


def _parameters(model: MegatronModel) -> list[tuple[str, torch.Tensor]]:
    """Every parameter of every model chunk, in a fixed order (``chunk{i}.`` + its name)."""
    return [
        (f"chunk{i}.{name}", param) for i, chunk in enumerate(model.model) for name, param in chunk.named_parameters()
    ]


def _host_copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors`` (pinned when they live on a GPU, so the copies back run at full speed)."""
    out = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        host.copy_(t.detach(), non_blocking=t.is_cuda)
        out.append(host)
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()
    return out


@dataclass(frozen=True)
class ReferenceWeights:
    """This rank's shard of the reference policy's parameters, in host memory.

    Attributes:
        names: ``chunk{i}.{parameter name}`` of each tensor, in the order :meth:`swapped_in` pairs them.
        tensors: host copies (same shapes and dtypes as the model's parameters).
    """

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]

    @classmethod
    def capture(cls, model: MegatronModel) -> ReferenceWeights:
        """Copy the model's current parameters (call it right after the model is built, before any resume)."""
        named = _parameters(model)
        odd = [n for n, p in named if type(p.data) is not torch.Tensor]
        if odd:
            raise RuntimeError(
                f"the reference policy copies plain parameter tensors; {odd[0]} is a {type(dict(named)[odd[0]].data).__name__} "
                "(FP8 primary weights?): set policy.megatron_cfg.fp8_cfg.fp8_param false or reference_policy_kl_penalty 0"
            )
        tensors = _host_copy([p for _, p in named])
        ref = cls(tuple(n for n, _ in named), tuple(tensors))
        logger.info(
            "reference policy for the KL penalty: %.1f MiB of parameters kept in host memory", ref.nbytes / 2**20
        )
        return ref

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @contextlib.contextmanager
    def swapped_in(self, model: MegatronModel) -> Iterator[None]:
        """Inside: ``model``'s parameters hold the reference values; on exit (also after an exception) the exact
        values they held before.

        Raises:
            RuntimeError: the model's parameters are not the ones captured (names, shapes or dtypes differ).
        """
        named = _parameters(model)
        if tuple(n for n, _ in named) != self.names or any(
            p.shape != t.shape or p.dtype != t.dtype for (_, p), t in zip(named, self.tensors, strict=True)
        ):
            raise RuntimeError(
                "the reference policy was captured from another model layout than the one it is swapped into; "
                "capture it again from this model"
            )
        params = [p for _, p in named]
        current = _host_copy(params)
        with torch.no_grad():
            for p, ref in zip(params, self.tensors, strict=True):
                p.copy_(ref, non_blocking=p.is_cuda)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, cur in zip(params, current, strict=True):
                    p.copy_(cur, non_blocking=p.is_cuda)
            if any(p.is_cuda for p in params):
                torch.cuda.synchronize()
