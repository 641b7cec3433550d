"""Private: every patch megatron-fp8 applies to Megatron-Bridge (and the TE import it needs), version-gated.

Applied only by :func:`bridge_mappings.adapter.import_bridge`, the one entry point
to ``megatron.bridge``; nothing else imports this module (tests excepted).
Each patch names the versions it serves, why it exists and the upstream code it
works around; on a Megatron-Bridge outside :data:`PATCHED_VERSIONS` none is
applied and :func:`apply` says so. Patches 3 and 4 (Megatron-Core on a CPU-only
machine) are scoped or explicit calls, exposed by the adapter as
:func:`~bridge_mappings.adapter.cpu_device_patches`,
:func:`~bridge_mappings.adapter.use_cpu_rng_tracker` and
:func:`~bridge_mappings.adapter.reset_rng_tracker`.

Patch 1: TransformerEngine import stand-ins (only when TE is not importable)
----------------------------------------------------------------------------
megatron-bridge 0.3.1 imports TransformerEngine (TE) at import time, even on code
paths that never run TE: ``megatron/bridge/peft/lora_layers.py`` and
``megatron/bridge/peft/lora.py`` do ``import transformer_engine.pytorch as te``,
subclass ``te.Linear`` and annotate methods with ``te.ops.Sequential``; both are
reached from ``import megatron.bridge`` (AutoBridge -> model_bridge -> peft_bridge
-> canonical_lora -> lora_layers). TE has no CPU build, so without help the
bridge cannot even be imported on a CPU-only machine.

:func:`install_te_standins` registers stand-in ``transformer_engine`` /
``transformer_engine.pytorch`` / ``transformer_engine.pytorch.ops`` modules holding
only the attributes those import-time statements touch (``Linear``,
``LayerNormLinear``, ``ops.Sequential``), and nothing else. Every stand-in class
raises :class:`~megatron_fp8.errors.TransformerEngineMissingError` when
instantiated, so any code path that would use TE for real math fails loudly.
Deeper imports (``from transformer_engine.pytorch import fp8_autocast``,
``import transformer_engine_torch``) still raise ``ImportError`` as before, so the
libraries' own ``try/except ImportError`` fallbacks keep working.

Megatron-Core probes ``import transformer_engine`` in many modules and caches
``HAVE_TE`` at import. The Megatron-Core modules the bridge pulls in are therefore
imported *before* the stand-ins are registered, so they keep ``HAVE_TE = False``
and choose their local (non-TE) paths; :func:`mcore_modules_that_saw_the_shim`
lists any that did not (the tests check it is empty). Never active when a real TE
is importable; idempotent.

Part of the same patch: Megatron-Core 0.16.x ``megatron/core/transformer/moe/moe_utils.py``
binds ``te_general_gemm`` only when its TE import succeeds, yet
``RouterGatingLinearFunction.forward`` reads the name unguarded
(``if te_general_gemm is not None``); :func:`install_te_standins` binds it to ``None``,
the value the module means by "not available".

Patch 2: ``SequentialMLP`` expert export (megatron-bridge 0.3.x)
----------------------------------------------------------------
Upstream: ``megatron/bridge/models/conversion/param_mapping.py``,
``MegatronParamMapping.gather_from_ep_ranks`` derives global expert ids from a
``.weight{N}`` suffix that only TE's grouped-GEMM experts have; the per-expert
``SequentialMLP`` layout (``...local_experts.{i}.linear_fc1.weight``, what MoE
models use without TE) raises there. :func:`fix_sequential_expert_export` wraps
it: for ``local_experts.{i}`` parameters the global ids are
``i % per_rank + per_rank * ep_rank`` and the tensors are all-gathered over the EP
group; every other parameter goes to the original method. Applied only on
:data:`PATCHED_VERSIONS`: another release may have fixed or moved the method.
The same release's ``model_bridge._megatron_local_name_to_global`` renumbers experts from the EP
rank's local ids to global ids only for the grouped-GEMM ``.weight{N}`` names; for
``local_experts.{i}`` it keeps ``i``, so under expert parallelism every EP rank would load experts
``0 .. per_rank-1`` from the checkpoint. :func:`fix_sequential_expert_export` also wraps that function:
``local_experts.{i}`` becomes ``local_experts.{per_rank x ep_rank + i}`` when the EP group has more than
one rank (load and export resolve HF names through it).

Patch 3: ``torch.cuda.current_device()`` on a CPU-only machine (scoped)
-----------------------------------------------------------------------
Megatron-Core (0.16.x) places tensors with ``torch.cuda.current_device()`` even
when ``use_cpu_initialization=True``: e.g. ``RotaryEmbedding.get_emb`` moves
``inv_freq`` there on the first forward
(``megatron/core/models/common/embeddings/rotary_pos_embedding.py``), and DDP /
optimizer buffers are allocated there. On CPU-only torch the call raises, and the
index ``0`` would mean ``cuda:0``. :func:`cpu_device_patches` answers the CPU
device while it is active, only when torch has no usable CUDA.

Patch 4: Megatron's RNG tracker without CUDA (explicit)
-------------------------------------------------------
``megatron/core/tensor_parallel/random.py`` forks CUDA RNG states;
:func:`use_cpu_rng_tracker` installs its inference (no-op-fork) tracker when CUDA
is unavailable, :func:`reset_rng_tracker` drops it between model builds. Activation recompute
(``CheckpointFunction`` in the same file) saves and restores the CUDA RNG state through
``_get_cuda_rng_state`` / ``_set_cuda_rng_state``, which call ``torch.cuda``: while the CPU tracker is
installed they answer "no CUDA state" (the CPU RNG state, saved beside it, is what dropout on CPU
draws from), and :func:`reset_rng_tracker` puts Megatron's functions back.

Patch 5: ``device="cuda"`` in Megatron-Core's schedules on a CPU-only machine (scoped)
--------------------------------------------------------------------------------------
``megatron/core/pipeline_parallel/schedules.py`` (0.16.x) counts tokens in
``torch.zeros([], dtype=torch.int, device="cuda")`` in every
``forward_backward_*`` function, which raises on CPU-only torch.
:func:`cpu_schedule_patches` (a ``TorchFunctionMode``) answers a factory call that names the CUDA
device with a CPU tensor while the schedule runs, only when torch has no usable CUDA; every other
call passes through unchanged.

Patch 6: packed sequences through the local (non-TE) attention (scoped)
-----------------------------------------------------------------------
Megatron-Core 0.16's ``Attention.forward`` (``megatron/core/transformer/attention.py``) handles a THD micro-batch
(``PackedSeqParams(qkv_format="thd")``) itself: the rotary embedding restarts at every ``cu_seqlens`` boundary, and
q/k/v are squeezed to ``[t, heads, dim]``; the core attention then must keep the sequences apart. TE's
``TEDotProductAttention`` does (``cu_seqlens``); the local ``DotProductAttention``
(``megatron/core/transformer/dot_product_attention.py``), the only one without TE, asserts
``packed_seq_params is None``. :func:`packed_local_attention` lets it run such a micro-batch as TE does, each
sequence of ``cu_seqlens`` alone: q/k/v rows ``[start, stop)`` as a ``[n, 1, heads, dim]`` batch of one with a causal
``[1, 1, n, n]`` mask, the outputs concatenated back to ``[t, 1, hidden]`` (``sum n^2`` attention scores, not the
``t^2`` a block-diagonal mask over the whole micro-batch would compute); every other call passes through unchanged.
The same packed micro-batch thus runs through Megatron-Core's packed path on a CPU, only the attention kernel
differing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import itertools
import logging
import re
import sys
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from megatron_fp8.errors import MegatronFP8Error, TransformerEngineMissingError

if TYPE_CHECKING:  # the patched class, for annotations only
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

logger = logging.getLogger(__name__)

PATCHED_VERSIONS: tuple[str, ...] = ("0.3.",)
"""Megatron-Bridge version prefixes these patches were written and tested against."""

SHIM_MARKER = "__megatron_fp8_te_shim__"
"""Attribute set to ``True`` on every stand-in module."""

REMEDY = "TransformerEngine is not installed; this code path needs a GPU build — use the image from `make image`"
"""Text of the error raised whenever a stand-in is used for real work."""

_STANDIN_MODULES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops")

# Megatron-Core modules that probe `import transformer_engine` and that megatron-bridge
# (or our model build) imports; importing them before the stand-ins exist keeps HAVE_TE False.
_MCORE_PREIMPORTS = (
    "megatron.core.utils",
    "megatron.core.fp8_utils",
    "megatron.core.fp4_utils",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.random",
    "megatron.core.extensions.transformer_engine",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.mlp",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.heterogeneous.linear_replacements",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
    "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs",
    "megatron.core.models.multimodal.llava_model",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.post_training.modelopt.layers",
)


_PRELOADED: set[str] = set()
"""Megatron-Core modules already imported when the stand-ins were registered."""


def _standin_class(qualname: str) -> type:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TransformerEngineMissingError(f"{qualname} was constructed, but {REMEDY}")

    return type(
        qualname.rsplit(".", 1)[-1],
        (torch.nn.Module,),
        {"__init__": __init__, "__module__": qualname.rsplit(".", 1)[0], "__doc__": f"Stand-in for {qualname}."},
    )


def _standin_getattr(module_name: str) -> Callable[[str], object]:
    def __getattr__(name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{module_name}.{name} is not available: {REMEDY}")

    return __getattr__


def real_te_available() -> bool:
    """Whether a real TransformerEngine install is importable (the shim never counts)."""
    mod = sys.modules.get("transformer_engine")
    if mod is not None:
        return not getattr(mod, SHIM_MARKER, False)
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def te_standins_installed() -> bool:
    """Whether the stand-in modules are currently registered in ``sys.modules``."""
    return getattr(sys.modules.get("transformer_engine"), SHIM_MARKER, False) is True


def _build_standins() -> dict[str, types.ModuleType]:
    te = types.ModuleType("transformer_engine", "megatron-fp8 stand-in: TransformerEngine is not installed.")
    pt = types.ModuleType("transformer_engine.pytorch", "megatron-fp8 stand-in for transformer_engine.pytorch.")
    ops = types.ModuleType(
        "transformer_engine.pytorch.ops", "megatron-fp8 stand-in for transformer_engine.pytorch.ops."
    )
    for mod in (te, pt, ops):
        setattr(mod, SHIM_MARKER, True)
        mod.__getattr__ = _standin_getattr(mod.__name__)  # type: ignore[attr-defined]
    # Exactly what megatron-bridge 0.3.1 touches at import time (peft/lora_layers.py, peft/lora.py).
    pt.Linear = _standin_class("transformer_engine.pytorch.Linear")  # type: ignore[attr-defined]
    pt.LayerNormLinear = _standin_class("transformer_engine.pytorch.LayerNormLinear")  # type: ignore[attr-defined]
    ops.Sequential = _standin_class("transformer_engine.pytorch.ops.Sequential")  # type: ignore[attr-defined]
    te.pytorch = pt  # type: ignore[attr-defined]
    pt.ops = ops  # type: ignore[attr-defined]
    return {m.__name__: m for m in (te, pt, ops)}


def install_te_standins() -> bool:
    """Register the TransformerEngine stand-ins when TE is not importable.

    Imports the Megatron-Core modules that probe TE first (so they keep
    ``HAVE_TE = False``), then registers the stand-ins. Idempotent.

    Returns:
        ``True`` when the stand-ins are registered (now or already), ``False`` when a
        real TransformerEngine is importable and nothing was changed.
    """
    if te_standins_installed():
        return True
    if real_te_available():
        logger.debug("real TransformerEngine found; TE shim not installed")
        return False
    for name in _MCORE_PREIMPORTS:
        importlib.import_module(name)
    _bind_missing_mcore_names()
    _PRELOADED.update(n for n in sys.modules if n.startswith("megatron.core"))
    sys.modules.update(_build_standins())
    logger.debug("TransformerEngine not installed: registered import-time stand-ins (bridge_mappings._patches)")
    return True


def _bind_missing_mcore_names() -> None:
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if "te_general_gemm" not in moe_utils.__dict__:
        moe_utils.te_general_gemm = None  # read unguarded by RouterGatingLinearFunction.forward


def uninstall_te_standins() -> None:
    """Remove the stand-ins from ``sys.modules`` (modules that already imported them keep their references)."""
    if not te_standins_installed():
        return
    for name in _STANDIN_MODULES:
        sys.modules.pop(name, None)


def mcore_modules_that_saw_the_shim() -> list[str]:
    """Megatron-Core modules imported after the stand-ins were registered that cached ``HAVE_TE = True``.

    Modules imported before :func:`install_te_standins` cannot have seen the stand-ins (some set
    ``HAVE_TE = True`` for reasons unrelated to the TE import and are not listed).

    Returns:
        Sorted module names; empty when the shim is not installed or no module was affected.
    """
    if not te_standins_installed():
        return []
    return sorted(
        name
        for name, mod in list(sys.modules.items())
        if name.startswith("megatron.core")
        and name not in _PRELOADED
        and isinstance(mod, types.ModuleType)
        and mod.__dict__.get("HAVE_TE") is True
    )


_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_HF_EXPERT = re.compile(r"experts\.(\d+)")


def _gather_local_experts(
    mapping: MegatronParamMapping,
    megatron_weights: torch.Tensor | None,
    megatron_module: torch.nn.Module | None,
    hf_param_name: str | None,
) -> dict[str, torch.Tensor]:
    if megatron_module is None:
        per_rank = mapping.broadcast_obj_from_pp_rank(None, "num_experts_per_rank")
    else:
        per_rank = mapping._get_config(megatron_module).num_moe_experts // mapping.ep_size
        per_rank = mapping.broadcast_obj_from_pp_rank(per_rank, "num_experts_per_rank")
    match = _LOCAL_EXPERT.search(mapping.megatron_param)
    local = int(match.group(1)) % per_rank
    names = [_HF_EXPERT.sub(f"experts.{local + per_rank * i}", str(hf_param_name)) for i in range(mapping.ep_size)]
    if str(hf_param_name) not in names:
        raise MegatronFP8Error(
            f"HF name {hf_param_name!r} does not match expert ids {names} of {mapping.megatron_param!r}"
        )
    if mapping.ep_size == 1:
        return {names[0]: megatron_weights}
    gathered = [torch.empty_like(megatron_weights) for _ in range(mapping.ep_size)]
    torch.distributed.all_gather(gathered, megatron_weights, group=mapping.ep_group)
    return dict(zip(names, gathered, strict=True))


def _fix_local_expert_numbering() -> None:
    """``local_experts.{i}`` -> its global expert id in Megatron-Bridge's name resolution (patch 2, EP > 1)."""
    model_bridge = importlib.import_module("megatron.bridge.models.conversion.model_bridge")
    original = model_bridge._megatron_local_name_to_global
    if getattr(original, SHIM_MARKER, False):
        return

    @functools.wraps(original)
    def local_name_to_global(models: object, config: object, param_name: str, vp_stage: int | None = None) -> str:
        name = original(models, config, param_name, vp_stage)
        match = _LOCAL_EXPERT.search(name)
        ep_group = model_bridge.parallel_state.get_expert_model_parallel_group()
        if match is None or ".adapter." in name or ep_group.size() == 1:
            return name
        per_rank = config.num_moe_experts // ep_group.size()
        number = per_rank * ep_group.rank() + int(match.group(1))
        return name[: match.start()] + f".local_experts.{number}." + name[match.end() :]

    setattr(local_name_to_global, SHIM_MARKER, True)
    model_bridge._megatron_local_name_to_global = local_name_to_global


def fix_sequential_expert_export() -> bool:
    """Let megatron-bridge 0.3.x load and export ``SequentialMLP`` expert weights under expert parallelism (patch 2
    of the module docstring). Idempotent.

    Returns:
        ``True`` when the wrapper is in place (now or already).
    """
    param_mapping = importlib.import_module("megatron.bridge.models.conversion.param_mapping")
    MegatronParamMapping = param_mapping.MegatronParamMapping

    _fix_local_expert_numbering()
    original = MegatronParamMapping.gather_from_ep_ranks
    if getattr(original, SHIM_MARKER, False):
        return True

    @functools.wraps(original)
    def gather_from_ep_ranks(
        self: MegatronParamMapping,
        megatron_weights: torch.Tensor | None,
        megatron_module: torch.nn.Module | None,
        hf_param_name: str | None,
    ) -> dict[str, torch.Tensor]:
        if _LOCAL_EXPERT.search(str(self.megatron_param or "")):
            return _gather_local_experts(self, megatron_weights, megatron_module, hf_param_name)
        return original(self, megatron_weights, megatron_module, hf_param_name)

    setattr(gather_from_ep_ranks, SHIM_MARKER, True)
    MegatronParamMapping.gather_from_ep_ranks = gather_from_ep_ranks
    return True


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


class _CudaFactoriesOnCpu(torch.overrides.TorchFunctionMode):
    """Rewrites ``device="cuda"`` (a string or ``torch.device``) of a torch call to the CPU (patch 5)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if isinstance(device, str | torch.device) and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": torch.device("cpu")}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_schedule_patches() -> Iterator[bool]:
    """Patches 3 and 5 while Megatron-Core's forward-backward schedule runs, without CUDA only.

    Yields:
        ``True`` when the patches are active, ``False`` when CUDA is available and nothing was patched.
    """
    if _torch_has_cuda():
        yield False
        return
    with cpu_device_patches(), _CudaFactoriesOnCpu():
        yield True


@contextlib.contextmanager
def packed_local_attention() -> Iterator[None]:
    """Patch 6: the local ``DotProductAttention`` takes a THD (packed) micro-batch while active."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention  # lazy: optional

    original = DotProductAttention.forward

    @functools.wraps(original)
    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is None:
            return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias)
        if query.dim() != 3:
            raise MegatronFP8Error(
                f"a packed micro-batch through the local attention needs [t, heads, dim] q/k/v, got {tuple(query.shape)}"
            )
        cu = packed_seq_params.cu_seqlens_q_padded
        bounds = (cu if cu is not None else packed_seq_params.cu_seqlens_q).tolist()  # CPU only: no device sync
        parts = []
        for start, stop in itertools.pairwise(bounds):  # each sequence alone: sum n^2 scores, not t^2
            n = stop - start
            causal = torch.ones(n, n, dtype=torch.bool, device=query.device).triu(1)[None, None]
            rows = slice(start, stop)
            parts.append(
                original(
                    self,
                    query[rows].unsqueeze(1),
                    key[rows].unsqueeze(1),
                    value[rows].unsqueeze(1),
                    causal,
                    attn_mask_type,
                    attention_bias,
                )
            )
        return torch.cat(parts, dim=0)

    DotProductAttention.forward = forward
    try:
        yield
    finally:
        DotProductAttention.forward = original


def use_cpu_rng_tracker() -> bool:
    """Install Megatron's no-op-fork RNG tracker when CUDA is unavailable (see the module docstring).

    Returns:
        ``True`` when the CPU tracker was installed, ``False`` when CUDA is available
        (the caller should use ``model_parallel_cuda_manual_seed`` instead).
    """
    if _torch_has_cuda():
        return False
    from megatron.core.tensor_parallel import random as mp_random  # lazy: Megatron-Core is optional

    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if not hasattr(mp_random, _SAVED_CUDA_RNG):  # activation recompute saves and restores the CUDA RNG state
        setattr(mp_random, _SAVED_CUDA_RNG, (mp_random._get_cuda_rng_state, mp_random._set_cuda_rng_state))
        mp_random._get_cuda_rng_state = _no_cuda_rng_state
        mp_random._set_cuda_rng_state = _set_no_cuda_rng_state
    return True


_SAVED_CUDA_RNG = "__megatron_fp8_saved_cuda_rng__"


def _no_cuda_rng_state(device: object = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Patch 4: the CUDA RNG state of a machine without CUDA (nothing to save; the CPU state is saved beside it)."""
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    """Patch 4: restoring :func:`_no_cuda_rng_state`'s state is nothing to do."""


def reset_rng_tracker() -> None:
    """Drop Megatron's RNG tracker so the next model build starts from a fresh one."""
    from megatron.core.tensor_parallel import random as mp_random  # lazy: Megatron-Core is optional

    mp_random.initialize_rng_tracker(force_reset=True)
    mp_random._CUDA_RNG_STATE_TRACKER = None
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    saved = mp_random.__dict__.pop(_SAVED_CUDA_RNG, None)
    if saved is not None:
        mp_random._get_cuda_rng_state, mp_random._set_cuda_rng_state = saved


def apply(version: str | None) -> None:
    """Apply the patches the installed Megatron-Bridge needs (see the module docstring). Idempotent.

    Patch 1 runs whenever TE is not importable (whatever the version: it only adds
    import-time stand-ins); patch 2 only on :data:`PATCHED_VERSIONS`.

    Args:
        version: the installed megatron-bridge version (``None``: unknown).
    """
    install_te_standins()
    if version is not None and version.startswith(PATCHED_VERSIONS):
        fix_sequential_expert_export()
    else:
        logger.warning(
            "megatron-bridge %s is not a version megatron-fp8 was tested with (%s): the SequentialMLP expert "
            "export fix (patch 2) is not applied; MoE export without TransformerEngine may fail",
            version,
            ", ".join(v + "x" for v in PATCHED_VERSIONS),
        )
