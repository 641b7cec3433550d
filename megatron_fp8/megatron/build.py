"""Build a Megatron-Core GPT model from a Hugging Face checkpoint through Megatron-Bridge.

:func:`build_megatron_model` is the one place where a trainer model is made:

1. ``AutoBridge.from_hf_pretrained(path)`` reads the checkpoint;
2. ``bridge.to_megatron_provider(load_weights=False)`` gives the model provider
   (a Megatron-Core ``TransformerConfig`` subclass) describing the architecture;
3. the provider is set up for the machine: on CPU the local (non-TE) layer spec
   (``get_gpt_layer_local_spec`` with ``qk_layernorm`` for Qwen3 and the MoE
   arguments for Qwen3-MoE), every fusion off, ``use_cpu_initialization=True``,
   ``perform_initialization=False`` (the weights are loaded next), and for MoE the
   ``allgather`` token dispatcher with per-expert ``SequentialMLP`` (the
   ``alltoall`` dispatcher creates CUDA streams, grouped GEMM needs TE);
4. the FP8 recipe is applied with :func:`megatron_fp8.recipes.apply_recipe_with_report`;
5. the model is created (``Float16Module``-wrapped for BF16) and wrapped in
   Megatron-Core's ``DistributedDataParallel`` (needed by ``get_megatron_optimizer``);
6. the Hugging Face weights are loaded through ``bridge.load_hf_weights``.

FP8 on CPU: without a GPU, every FP8 recipe is applied in ``"bf16-emulated"``
mode (see :mod:`megatron_fp8.recipes.apply`): the FP8 fields are validated and
recorded in :attr:`MegatronModel.recipe_application` (whose ``config`` carries
them), but the model is built from the provider *without* them, because
Megatron-Core would otherwise enter TransformerEngine's ``fp8_autocast`` in every
forward. On a GPU with TE (``math == "fp8"`` or ``"unchecked"``) the model is
built from the recipe's config and the TE layer spec, and the GEMMs run in FP8.

Must be called inside :func:`megatron_fp8.megatron.parallel.megatron_parallel`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bridge_mappings import adapter as bridge_adapter
from megatron_fp8.errors import ConfigError
from megatron_fp8.quant.formats import PARAM_DTYPES
from megatron_fp8.recipes import RecipeApplication, apply_recipe_with_report
from megatron_fp8.recipes.precision import math_label, precision_sentence

if TYPE_CHECKING:  # Megatron types, for annotations only (Megatron is optional at import time)
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec

    from bridge_mappings.adapter import AutoBridge, GPTModelProvider

logger = logging.getLogger(__name__)

FUSIONS_OFF: tuple[str, ...] = (
    "gradient_accumulation_fusion",
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "apply_rope_fusion",
    "bias_dropout_fusion",
    "cross_entropy_loss_fusion",
    "moe_permute_fusion",
    "moe_router_fusion",
)
"""Provider fields set to ``False`` for CPU builds: each selects an Apex / TE / CUDA kernel."""

DTYPES: dict[str, torch.dtype] = PARAM_DTYPES
"""Parameter dtypes :func:`build_megatron_model` supports, by short name."""

_RECIPES_BUILT_WITH_FP8_FIELDS = frozenset({"fp8", "unchecked"})


@dataclass(frozen=True)
class MegatronModel:
    """A Megatron-Core model built from a Hugging Face checkpoint.

    Attributes:
        bridge: the Megatron-Bridge ``AutoBridge`` (knows the HF <-> Megatron name mappings).
        model: the model chunks as Megatron-Bridge returns them (one per virtual pipeline
            stage; DDP-wrapped, and ``Float16Module``-wrapped for BF16).
        provider: the ``GPTModelProvider`` the model was built from.
        transformer_config: the config the modules hold (``model[0].config``).
        recipe_application: :class:`megatron_fp8.recipes.RecipeApplication` describing the
            recipe: fields, environment, and ``math`` (``"bf16"``, ``"bf16-emulated"``,
            ``"fp8"``, ``"unchecked"``).
        hf_path: the checkpoint folder.
        dtype: parameter dtype (``torch.bfloat16``, ``torch.float16`` or ``torch.float32``).
        vocab_size: the Hugging Face vocabulary size (logits are cut to it).
        ddp_config: the Megatron-Core ``DistributedDataParallelConfig`` used for wrapping.
        round_to: the dtype float32 weights are held to (rounded at the build and by the optimizer after every
            update: ``torch.float16`` emulates ``policy.precision: float16`` on a CPU); ``None``: not rounded.
    """

    bridge: AutoBridge
    model: list[torch.nn.Module]
    provider: GPTModelProvider
    transformer_config: TransformerConfig
    recipe_application: RecipeApplication
    hf_path: Path
    dtype: torch.dtype
    vocab_size: int
    ddp_config: DistributedDataParallelConfig
    round_to: torch.dtype | None = None

    @property
    def is_moe(self) -> bool:
        """Whether the model has routed experts."""
        return bool(getattr(self.transformer_config, "num_moe_experts", None))

    def modules(self) -> list[torch.nn.Module]:
        """The model chunks (alias of :attr:`model`)."""
        return self.model


@dataclass(frozen=True)
class RecomputeSettings:
    """Megatron-Core's activation recompute (NeMo-RL's ``policy.megatron_cfg.activation_checkpointing``).

    Attributes:
        granularity: ``"full"``: every transformer layer's input is kept and the layer recomputed in the backward
            pass (``recompute_method="uniform"``, ``recompute_num_layers=1``, as NeMo-RL sets them);
            ``"selective"``: only ``modules`` are recomputed.
        modules: Megatron-Core's ``recompute_modules`` for ``"selective"`` (``None``: ``["core_attn"]``).
    """

    granularity: str = "full"
    modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.granularity not in ("full", "selective"):
            raise ConfigError(f"recompute granularity must be 'full' or 'selective', got {self.granularity!r}")

    @property
    def selected_modules(self) -> list[str]:
        """The modules a ``"selective"`` recompute reruns (``modules``, else Megatron-Core's ``core_attn``)."""
        return list(self.modules or ("core_attn",))

    def describe(self) -> str:
        """One line: what is recomputed."""
        if self.granularity == "full":
            return "full (every layer's input kept, the layer recomputed in the backward pass)"
        return f"selective ({', '.join(self.selected_modules)})"

    def apply(self, provider: GPTModelProvider) -> None:
        """Write the settings into the provider (a Megatron-Core ``TransformerConfig``) before it is finalized."""
        provider.recompute_granularity = self.granularity
        if self.granularity == "full":
            provider.recompute_method, provider.recompute_num_layers = "uniform", 1
        else:
            provider.recompute_modules = self.selected_modules


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        try:
            return DTYPES[dtype]
        except KeyError:
            raise ConfigError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}") from None
    if dtype not in DTYPES.values():
        raise ConfigError(f"dtype {dtype} is not supported; valid: {', '.join(str(d) for d in DTYPES.values())}")
    return dtype


def _local_layer_spec(provider: GPTModelProvider) -> ModuleSpec:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # lazy: Megatron-Core is optional

    return get_gpt_layer_local_spec(
        num_experts=provider.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=bool(provider.qk_layernorm),
        normalization=provider.normalization,
    )


def _configure_for_cpu(provider: GPTModelProvider) -> None:
    """Local layer spec, fusions off, CPU init; every change is a documented provider field."""
    provider.transformer_layer_spec = _local_layer_spec(provider)
    for name in FUSIONS_OFF:
        if hasattr(provider, name):
            setattr(provider, name, False)
    if provider.num_moe_experts:
        provider.moe_grouped_gemm = False
        provider.moe_token_dispatcher_type = "allgather"
    provider.use_cpu_initialization = True
    provider.batch_p2p_comm = False  # batched pipeline sends synchronize CUDA; gloo's isend/irecv need not


def _set_parallel_sizes(provider: GPTModelProvider) -> None:
    """The provider's model-parallel sizes from Megatron-Core's ``parallel_state`` (the one source of the layout).

    Megatron-Core builds a pipeline stage's layers from ``config.pipeline_model_parallel_size``
    (``get_num_layers_to_build``) and checks the other sizes against the process groups, so a provider left at the
    checkpoint's defaults would build every layer on every stage.
    """
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional

    provider.tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
    provider.pipeline_model_parallel_size = parallel_state.get_pipeline_model_parallel_world_size()
    provider.expert_model_parallel_size = parallel_state.get_expert_model_parallel_world_size()
    provider.context_parallel_size = parallel_state.get_context_parallel_world_size()
    if provider.pipeline_model_parallel_size > 1 and provider.num_layers % provider.pipeline_model_parallel_size:
        raise ConfigError(
            f"the model's {provider.num_layers} layers do not split evenly into "
            f"pipeline_model_parallel_size={provider.pipeline_model_parallel_size} stages; choose a divisor of "
            f"{provider.num_layers}"
        )


def _set_dtype(provider: GPTModelProvider, dtype: torch.dtype) -> None:
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = dtype == torch.float16
    provider.params_dtype = dtype
    provider.pipeline_dtype = dtype
    if hasattr(provider, "autocast_dtype"):
        provider.autocast_dtype = dtype


def _wrap_ddp(model: list[torch.nn.Module], ddp_config: DistributedDataParallelConfig) -> list[torch.nn.Module]:
    """Megatron-Core DDP around each chunk.

    Megatron-Bridge's own ``_ddp_wrap`` builds the wrappers on a ``torch.cuda.Stream`` (for
    CUDA graphs), which does not exist on CPU; this is the same construction without the stream.
    """
    from megatron.core.distributed import DistributedDataParallel  # lazy: Megatron-Core is optional
    from megatron.core.process_groups_config import ProcessGroupCollection  # lazy: Megatron-Core is optional
    from megatron.core.utils import get_model_config  # lazy: Megatron-Core is optional

    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    wrapped = [
        DistributedDataParallel(
            config=get_model_config(chunk),
            ddp_config=ddp_config,
            module=chunk,
            disable_bucketing=index > 0,
            pg_collection=pg_collection,
        )
        for index, chunk in enumerate(model)
    ]
    for chunk in wrapped:
        chunk.broadcast_params()
    return wrapped


def build_megatron_model(
    hf_path: str | Path,
    *,
    recipe: str = "bf16",
    num_first_layers_in_bf16: int = 0,
    num_last_layers_in_bf16: int = 0,
    dtype: torch.dtype | str = torch.bfloat16,
    check_capability: bool = True,
    configure: Callable[[GPTModelProvider], None] | None = None,
    fp8_format: str | None = None,
    use_distributed_optimizer: bool = False,
    recompute: RecomputeSettings | None = None,
    round_to: torch.dtype | None = None,
) -> MegatronModel:
    """Build a Megatron-Core model from a Hugging Face checkpoint and load its weights.

    Args:
        hf_path: Hugging Face checkpoint folder (e.g. from
            :func:`megatron_fp8.models.resolve_model`).
        recipe: FP8 recipe name from :data:`megatron_fp8.recipes.RECIPES` (``"bf16"``,
            ``"tensorwise"``, ``"blockwise"``, ``"fp8_param"``, ...).
        num_first_layers_in_bf16: transformer layers at the start kept in BF16 by the recipe.
        num_last_layers_in_bf16: transformer layers at the end kept in BF16 by the recipe.
        dtype: parameter / compute dtype, ``torch.bfloat16`` (default, as in training), ``torch.float16``
            (``policy.precision: float16``: Megatron-Core's FP16 mixed precision) or ``torch.float32`` (exact
            comparisons on CPU); the strings ``"bf16"`` / ``"fp16"`` / ``"fp32"`` are accepted.
        check_capability: check the recipe against this machine (see :mod:`megatron_fp8.recipes`).
        configure: optional callback run on the provider after every other setting and before
            the model is created (e.g. to change ``moe_aux_loss_coeff``).
        fp8_format: the FP8 format of an FP8 recipe (``"e4m3"`` or ``"hybrid"``; config key
            ``policy.megatron_cfg.fp8_cfg.fp8``); ``None`` = the recipe's own.
        use_distributed_optimizer: build the DDP grad buffers for Megatron-Core's ``DistributedOptimizer``
            (reduce-scatter) where that optimizer runs (CUDA); on CPU the buffers stay all-reduced and
            :class:`~megatron_fp8.megatron.dist_optim.ShardedDDPAdam` shards the optimizer state.
        recompute: Megatron-Core's activation recompute (``None``: off).
        round_to: with float32 ``dtype``, hold the weights to this dtype's values (``torch.float16``: FP16 emulated
            on a CPU; the optimizer rounds them after every update, :mod:`~megatron_fp8.megatron.optim`).

    Returns:
        The :class:`MegatronModel`.

    Raises:
        ConfigError: not inside ``megatron_parallel()``, unknown recipe or dtype, or a
            checkpoint the bridge cannot handle.
        megatron_fp8.errors.RecipeUnsupportedError: an FP8 recipe this GPU cannot run.
    """
    from megatron.core import parallel_state  # lazy: Megatron-Core is optional
    from megatron.core.distributed import DistributedDataParallelConfig  # lazy: Megatron-Core is optional

    if not parallel_state.model_parallel_is_initialized():
        raise ConfigError(
            "Megatron-Core parallel state is not initialised; call build_megatron_model inside "
            "`with megatron_fp8.megatron.parallel.megatron_parallel():`"
        )
    dtype = _resolve_dtype(dtype)
    hf_path = Path(hf_path)
    bridge = bridge_adapter.load_bridge(hf_path, dtype=dtype)
    provider = bridge.to_megatron_provider(load_weights=False)
    on_cpu = not torch.cuda.is_available() or not bridge_adapter.transformer_engine_available()
    if on_cpu:
        _configure_for_cpu(provider)
    _set_dtype(provider, dtype)
    _set_parallel_sizes(provider)
    provider.perform_initialization = False

    application = apply_recipe_with_report(
        provider,
        recipe,
        num_first_layers_in_bf16=num_first_layers_in_bf16,
        num_last_layers_in_bf16=num_last_layers_in_bf16,
        fp8_format=fp8_format,
        check_capability=check_capability,
    )
    if application.math in _RECIPES_BUILT_WITH_FP8_FIELDS:
        if on_cpu:
            raise ConfigError(
                f"recipe {recipe!r} would run FP8 GEMMs (math={application.math!r}) but TransformerEngine or CUDA "
                "is missing; keep check_capability=True on CPU so the recipe is recorded and runs without FP8 GEMMs"
            )
        provider = application.config
    else:
        logger.debug("recipe %r: %s; building the model without FP8 fields", recipe, application.math_note)
    if recompute is not None:
        recompute.apply(provider)
        logger.info("activation recompute: %s", recompute.describe())
    if configure is not None:
        configure(provider)
    if hasattr(provider, "finalize"):
        provider.finalize()

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=use_distributed_optimizer and torch.cuda.is_available(),
        check_for_nan_in_grad=True,
    )
    with bridge_adapter.cpu_device_patches():
        model = provider.provide_distributed_model(
            wrap_with_ddp=False,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            use_cpu_initialization=on_cpu,
            pre_wrap_hook=[],
        )
        _mark_tensor_parallel_weights(model)
        model = _wrap_ddp(model, ddp_config)
        bridge.load_hf_weights(model)
    if round_to is not None:
        _round_weights(model, dtype, round_to)
    for chunk in model:
        chunk.eval()
    config = model[0].config if hasattr(model[0], "config") else provider
    hf_config = bridge.hf_pretrained.config
    rounded = str(round_to) if round_to is not None else None
    sentence = precision_sentence(
        recipe=application.recipe, label=math_label(application.math, str(dtype), rounded=rounded)
    )
    logger.info("built %s from %s: %s", type(model[0]).__name__, hf_path, sentence)
    return MegatronModel(
        bridge=bridge,
        model=model,
        provider=provider,
        transformer_config=config,
        recipe_application=application,
        hf_path=hf_path,
        dtype=dtype,
        vocab_size=int(hf_config.vocab_size),
        ddp_config=ddp_config,
        round_to=round_to,
    )


def _round_weights(chunks: list[torch.nn.Module], dtype: torch.dtype, round_to: torch.dtype) -> None:
    """Round float32 weights to ``round_to``'s values in place (as a ``round_to`` model loads them)."""
    if dtype != torch.float32 or round_to not in DTYPES.values():
        raise ConfigError(f"round_to={round_to} needs float32 weights and a dtype of {', '.join(DTYPES)}; got {dtype}")
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                param.data.copy_(param.data.to(round_to))


def _mark_tensor_parallel_weights(chunks: list[torch.nn.Module]) -> None:
    """Give the weights of Megatron-Core's tensor-parallel layers their ``tensor_model_parallel`` attributes.

    Megatron-Core sets them while it initialises a weight (``tensor_parallel/layers.py``:
    ``_initialize_affine_weight_cpu`` / ``_gpu``), which a model whose weights are loaded from a checkpoint skips
    (``perform_initialization=False``). Without them the gradient norm (Megatron's
    ``param_is_not_tensor_parallel_duplicate``, :mod:`megatron_fp8.megatron.optim`) counts TP rank 0's shard only.
    Column-parallel layers and the vocab-parallel embedding split dim 0, row-parallel layers dim 1.
    """
    from megatron.core import tensor_parallel  # lazy: Megatron-Core is optional

    split_dims = (
        (tensor_parallel.ColumnParallelLinear, 0),
        (tensor_parallel.VocabParallelEmbedding, 0),
        (tensor_parallel.RowParallelLinear, 1),
    )
    for chunk in chunks:
        for module in chunk.modules():
            dim = next((d for cls, d in split_dims if isinstance(module, cls)), None)
            weight = getattr(module, "weight", None)
            if dim is None or not isinstance(weight, torch.nn.Parameter):
                continue
            if not getattr(weight, "tensor_model_parallel", False):  # unset, or Megatron's defaults (False, -1, 1)
                weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, dim, 1


def export_hf_weights(m: MegatronModel, *, cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the model's weights under Hugging Face names (see :func:`bridge_mappings.adapter.export_hf_weights`).

    Collective over the model-parallel group: every rank must iterate the whole stream.

    Args:
        m: the model.
        cpu: move each tensor to CPU before yielding it.

    Yields:
        ``(hf_name, tensor)`` with HF shapes (e.g. ``q_proj.weight`` ``[N_out, K_in]``) in the
        model's parameter dtype.
    """
    return bridge_adapter.export_hf_weights(m.bridge, m.model, cpu=cpu)
