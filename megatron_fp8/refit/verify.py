"""What a post-refit verification reports, for every applier.

Each applier (:mod:`megatron_fp8.rollout.vllm.applier`,
:mod:`megatron_fp8.rollout.reference.applier`, the vLLM worker extension) reads
back what its engine holds after a commit and returns one :class:`VerifyReport`.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What the post-refit read-back found.

    Attributes:
        version: the refit version verified.
        checked: number of HF tensors compared.
        max_rel_error: largest relative Frobenius error between what the engine holds
            (dequantized for FP8) and what the trainer sent (before quantization when known).
        worst: name of the tensor with the largest error.
    """

    version: int
    checked: int
    max_rel_error: float
    worst: str


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float32 (0-safe denominator)."""
    a, b = a.to(torch.float32), b.to(torch.float32)
    return float((a - b).norm()) / max(float(b.norm()), 1e-30)
