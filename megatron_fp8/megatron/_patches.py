"""Private: the patches Megatron-Core needs to run on a CPU-only machine, applied by the megatron room.

Megatron-Core (0.16.x) places tensors with ``torch.cuda.current_device()`` even
when ``use_cpu_initialization=True``: e.g. ``RotaryEmbedding.get_emb`` moves
``inv_freq`` there on the first forward
(``megatron/core/models/common/embeddings/rotary_pos_embedding.py``), and DDP /
optimizer buffers are allocated there. On CPU-only torch the call raises, and the
index ``0`` would mean ``cuda:0``. :func:`cpu_device_patches` answers the CPU
device while it is active, only when torch has no usable CUDA.

Megatron's tensor-parallel RNG tracker (``megatron/core/tensor_parallel/random.py``)
forks CUDA RNG states; :func:`use_cpu_rng_tracker` installs its inference
(no-op-fork) tracker when CUDA is unavailable. Used by
:mod:`megatron_fp8.megatron.build`, :mod:`~megatron_fp8.megatron.step`,
:mod:`~megatron_fp8.megatron.parallel` and the bridge adapter's export.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _torch_has_cuda() -> bool:
    return torch.version.cuda is not None and torch.cuda.is_available()


@contextlib.contextmanager
def cpu_device_patches() -> Iterator[bool]:
    """Answer ``torch.cuda.current_device()`` with the CPU device while active, without CUDA only.

    Yields:
        ``True`` when the patch is active, ``False`` when CUDA is available and nothing
        was patched.
    """
    if _torch_has_cuda():
        yield False
        return
    original = torch.cuda.current_device

    def current_device() -> torch.device:
        return torch.device("cpu")

    torch.cuda.current_device = current_device
    try:
        yield True
    finally:
        torch.cuda.current_device = original


def use_cpu_rng_tracker() -> bool:
    """Install Megatron's no-op-fork RNG tracker when CUDA is unavailable (see the module docstring).

    Returns:
        ``True`` when the CPU tracker was installed, ``False`` when CUDA is available
        (the caller should use ``model_parallel_cuda_manual_seed`` instead).
    """
    if _torch_has_cuda():
        return False
    # lazy: Megatron-Core is optional (a GPU box with torch only imports this package to skip tests)
    from megatron.core.tensor_parallel import random as mp_random

    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return True


def reset_rng_tracker() -> None:
    """Drop Megatron's RNG tracker so the next model build starts from a fresh one."""
    from megatron.core.tensor_parallel import random as mp_random  # lazy: Megatron-Core is optional

    mp_random.initialize_rng_tracker(force_reset=True)
    mp_random._CUDA_RNG_STATE_TRACKER = None
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
