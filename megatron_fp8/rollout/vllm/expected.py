"""What a vLLM engine expects of a refit version, read from the live model, and the whole-version validation.

:func:`expected_refit_set` lists every checkpoint-format (Hugging Face) tensor a built vLLM
model loads, with the shape the checkpoint holds (before TP sharding and before vLLM fuses
``q/k/v`` into ``qkv_proj`` or ``gate/up`` into ``gate_up_proj``) and the dtypes the engine
accepts: every linear shard and bias, every routed-expert weight, every other parameter
(norms, embeddings with their unpadded vocabulary), the FP8 manifest's ``*_scale_inv`` on
their block grid, and the KV-cache scales only when the engine has an FP8 KV cache.

:func:`validate_version` checks a whole version against that set before anything is
written: names (unknown / missing / extra / duplicated), shapes, dtypes, scale grids and
scale values (zero, negative, NaN), non-finite weights. It raises
:class:`~megatron_fp8.errors.WeightStreamError` naming the tensor, the expected and the
received layout, and what to check. :func:`validate_metas` is the same check on metadata
only (the trainer-side applier runs it at ``begin``).

A version must be complete unless the caller opts into ``partial=True``; a partial version
still has to carry every shard of a fused module it touches (vLLM processes a fused
``qkv_proj`` / ``gate_up_proj`` as one layer, so a lone ``q_proj`` would leave ``k``/``v``
rows undefined).

:func:`engine_shard_plan` is what one TP rank of an engine takes of that set (a
:class:`~megatron_fp8.layout.ShardPlan`): an engine sharded over trainer ranks is sent only
these parts, and :func:`local_refit_set` is the set with their shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import torch

from megatron_fp8.errors import WeightStreamError
from megatron_fp8.layout import ShardPlan, ShardSlice, block_scale_shape
from megatron_fp8.refit.integrity.finite import FLOAT_DTYPES, has_nonfinite
from megatron_fp8.rollout.vllm import layers, layouts
from megatron_fp8.vocab import FP8_DTYPE_NAME, KV_SCALE_KINDS, SCALE_SUFFIX, is_kv_scale_name

MAX_LISTED = 8
"""How many offending names an error lists before ``...``."""


@dataclasses.dataclass(frozen=True)
class ExpectedTensor:
    """One tensor the engine expects in a refit, in checkpoint format.

    Attributes:
        name: the HF name, e.g. ``model.layers.0.self_attn.q_proj.weight``.
        shape: the full checkpoint shape (all TP ranks, unfused).
        dtypes: torch dtype names the engine accepts for it (first: what it holds).
        kind: ``"weight"`` (a linear / expert weight), ``"scale"`` (FP8 block scale),
            ``"kv_scale"``, or ``"other"`` (norms, embeddings, biases).
        group: the vLLM module that loads it (fused shards share one), for partial refits.
        required: part of a complete version (a scale is required only when its weight
            arrives in FP8; see :func:`validate_version`).
    """

    name: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    kind: str
    group: str
    required: bool = True


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _linear_shard_rows(module: torch.nn.Module, packed: dict[str, list[str]]) -> list[tuple[str, int]]:
    """``[(hf_prefix, full_rows)]`` of a linear module's checkpoint shards."""
    head, _, last = module.prefix.rpartition(".")
    shards = packed.get(last)
    if shards and hasattr(module, "num_kv_head_replicas"):  # QKVParallelLinear
        v_head = getattr(module, "v_head_size", module.head_size)
        rows = (
            module.total_num_heads * module.head_size,
            module.total_num_kv_heads * module.head_size,
            module.total_num_kv_heads * v_head,
        )
        return [(f"{head}.{s}", r) for s, r in zip(shards, rows, strict=True)]
    if shards:  # MergedColumnParallelLinear: output_sizes are full sizes
        return [(f"{head}.{s}", int(r)) for s, r in zip(shards, module.output_sizes, strict=True)]
    return [(module.prefix, int(module.output_size))]


def expected_refit_set(
    model: torch.nn.Module,
    *,
    fp8_names: Iterable[str] | None,
    block_size: tuple[int, int],
    kv_cache_dtype: str,
) -> dict[str, ExpectedTensor]:
    """Every tensor a refit of ``model`` carries, by HF name (see the module docstring).

    Args:
        model: the built vLLM model (``worker.model_runner.model``).
        fp8_names: the FP8 manifest (HF weight names held in FP8), or ``None`` (no FP8 weights).
        block_size: ``(rows, cols)`` of one FP8 weight block.
        kv_cache_dtype: the engine's ``cache_config.cache_dtype`` (``"auto"``, ``"fp8"``, ...).
    """
    fp8 = frozenset(fp8_names or ())
    packed = {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {}) or {}).items()}
    linear_cls, experts_cls = layers.linear_base_cls(), layers.routed_experts_cls()
    out: dict[str, ExpectedTensor] = {}
    owned: set[str] = set()

    def add_weight(name: str, shape: tuple[int, ...], dtype: torch.dtype, group: str) -> None:
        if name in fp8:
            out[name] = ExpectedTensor(name, shape, (FP8_DTYPE_NAME, _dtype_name(dtype)), "weight", group)
            scale = name + SCALE_SUFFIX
            out[scale] = ExpectedTensor(scale, block_scale_shape(shape, block_size), ("float32",), "scale", group)
        else:
            out[name] = ExpectedTensor(name, shape, (_dtype_name(dtype),), "weight", group)

    for _, module in model.named_modules():
        if isinstance(module, linear_cls):
            dtype = getattr(module, "params_dtype", torch.bfloat16)
            in_size = int(module.input_size)
            for hf, rows in _linear_shard_rows(module, packed):
                add_weight(f"{hf}.weight", (rows, in_size), dtype, module.prefix)
                if getattr(module, "bias", None) is not None:
                    out[f"{hf}.bias"] = ExpectedTensor(
                        f"{hf}.bias", (rows,), (_dtype_name(module.bias.dtype),), "other", module.prefix
                    )
            owned.add(module.prefix)
        elif isinstance(module, experts_cls):
            prefix = layers.experts_prefix(module)
            moe = getattr(module, "moe_config", None)
            inter = int(getattr(moe, "intermediate_size", 0) or module.intermediate_size_per_partition)
            hidden = int(module.hidden_size)
            dtype = getattr(moe, "in_dtype", None) or torch.bfloat16
            for hf in layers.expert_hf_weights(module):
                shape = (hidden, inter) if ".down_proj." in hf or ".w2." in hf else (inter, hidden)
                add_weight(hf, shape, dtype, prefix)
            owned.add(prefix)
    embedding_cls = layers.vocab_embedding_cls()
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        if any(name.startswith(m + ".") for m in owned) or is_kv_scale_name(name):
            continue
        module = modules.get(module_name)
        shape = tuple(param.shape)
        if isinstance(module, embedding_cls) and leaf == "weight":
            shape = (int(module.org_vocab_size), int(module.embedding_dim))
        out[name] = ExpectedTensor(name, shape, (_dtype_name(param.dtype),), "other", module_name)
    if kv_cache_dtype.startswith("fp8"):
        for prefix in layers.attention_prefixes(model):
            for kind in KV_SCALE_KINDS:
                name = f"{prefix}.{kind}_scale"
                out[name] = ExpectedTensor(name, (), ("float32",), "kv_scale", prefix)
    return out


def _linear_kind(module: torch.nn.Module) -> str:
    """``column``, ``row`` or ``replicated``: how a vLLM linear module splits its weight over TP ranks."""
    name = type(module).__name__
    if name == "RowParallelLinear":
        return "row"
    return "replicated" if name in ("ReplicatedLinear", "GateLinear") else "column"


def engine_shard_plan(
    model: torch.nn.Module, expected: Mapping[str, ExpectedTensor], *, block_size: tuple[int, int]
) -> ShardPlan:
    """This TP rank's part of every tensor of the refit set ``expected`` (full checkpoint shapes), read from the live
    layers: column-parallel linears by rows (``q``/``k``/``v`` by this rank's heads, KV heads shared by
    ``num_kv_head_replicas`` ranks; gate/up by their own rows; biases with them), row-parallel ones by columns, the
    vocabulary of embeddings and ``lm_head`` by rows; FP8 block scales on the matching part of their grid; norms, a
    row-parallel bias and KV scales whole.

    Raises:
        ValueError: a layer whose part cannot be sent alone: routed experts split over TP or EP ranks, a linear whose
            FP8 layout the in-place load does not write, a split that is not on whole FP8 blocks. The caller then
            sends full tensors.
    """
    packed = {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {}) or {}).items()}
    linear_cls, experts_cls, embedding_cls = (
        layers.linear_base_cls(),
        layers.routed_experts_cls(),
        layers.vocab_embedding_cls(),
    )
    slices: dict[str, ShardSlice] = {}
    rank, size = 0, 1

    def put(name: str, part: ShardSlice) -> None:
        if name not in expected:
            return
        slices[name] = part
        scale = name + SCALE_SUFFIX
        if scale in expected:
            try:
                slices[scale] = part.scaled(block_size[part.dim])
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None

    for mod_name, module in model.named_modules():
        tp_size = int(getattr(module, "tp_size", 1) or 1)
        if isinstance(module, experts_cls):
            if tp_size > 1 or int(getattr(module, "ep_size", 1) or 1) > 1:
                raise ValueError(f"{layers.experts_prefix(module)}: routed experts split over TP/EP ranks")
            continue
        if tp_size == 1:
            continue
        rank, size = int(module.tp_rank), tp_size
        if isinstance(module, embedding_cls):
            idx = module.shard_indices
            lo, hi = int(idx.org_vocab_start_index), int(idx.org_vocab_end_index)
            put(f"{mod_name}.weight", ShardSlice(0, lo, hi - lo, int(module.org_vocab_size)))
            continue
        if not isinstance(module, linear_cls) or (kind := _linear_kind(module)) == "replicated":
            continue
        try:
            layout = layouts.linear_layout(module, block=block_size)
        except layouts.UnknownLayoutError as exc:
            raise ValueError(str(exc)) from None
        if layout.kind not in ("bf16", "checkpoint", "rowmajor", "transposed", "ue8m0"):
            raise ValueError(f"{module.prefix}: FP8 layout {layout.kind!r}")
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"{module.prefix}: its weight is not a readable matrix (repacked for a CPU kernel)")
        shards = _linear_shard_rows(module, packed)
        head, _, last = module.prefix.rpartition(".")
        keys: list[str | int | None] = [None]
        if packed.get(last):
            keys = list("qkv") if hasattr(module, "num_kv_head_replicas") else list(range(len(shards)))
        for key, (hf, rows) in zip(keys, shards, strict=True):
            if kind == "row":
                cols = int(module.input_size_per_partition)
                put(f"{hf}.weight", ShardSlice(1, rank * cols, cols, int(module.input_size)))
                continue
            try:
                _, src, full = layouts.column_slices(module, key, rows, 1)
            except layouts.RefitTargetError as exc:
                raise ValueError(str(exc)) from None
            part = ShardSlice(0, src.start, src.stop - src.start, full)
            put(f"{hf}.weight", part)
            put(f"{hf}.bias", part)
    return ShardPlan(rank=rank, size=size, slices=slices)


def local_refit_set(expected: Mapping[str, ExpectedTensor], plan: ShardPlan) -> dict[str, ExpectedTensor]:
    """``expected`` with every shape cut to ``plan``'s part (what an engine rank sent its parts validates against)."""
    return {n: dataclasses.replace(e, shape=plan.local_shape(n, e.shape)) for n, e in expected.items()}


def _similar(name: str, known: Iterable[str]) -> list[str]:
    tail = name.rsplit(".", 2)[-2:]
    return [k for k in known if k.rsplit(".", 2)[-2:] == tail][:3]


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (f", ... ({len(names)} in all)" if len(names) > MAX_LISTED else "")


def _unknown_reason(name: str, expected: Mapping[str, ExpectedTensor]) -> str:
    if is_kv_scale_name(name):
        return (
            f"{name!r}: this engine has no KV-cache scale parameters (it was built without an FP8 KV cache); "
            "build it with kv_cache_dtype='fp8' or stop sending KV scales"
        )
    if name.endswith(SCALE_SUFFIX):
        base = name[: -len(SCALE_SUFFIX)]
        return (
            f"{name!r}: a block scale for {base!r}, which this engine does not hold in FP8 (not in the FP8 "
            "manifest); check the manifest the trainer quantizes with"
        )
    return (
        f"{name!r} is not a parameter of this vLLM model; similar names: {_similar(name, expected)}. "
        "Check the HF-name mapping (bridge_mappings) and the model"
    )


def _check_layout(name: str, shape: tuple[int, ...], dtype: str, spec: ExpectedTensor) -> str | None:
    if tuple(shape) != spec.shape:
        return (
            f"{name!r}: received shape {list(shape)}, the engine expects {list(spec.shape)} ({dtype}); "
            "check the trainer's model config (hidden/vocab/head sizes) and the HF-name mapping"
        )
    if dtype not in spec.dtypes:
        return (
            f"{name!r}: received dtype {dtype}, the engine accepts {list(spec.dtypes)} for it; "
            "check the FP8 manifest and the export precision"
        )
    return None


def _check_completeness(
    present: Mapping[str, str], expected: Mapping[str, ExpectedTensor], *, partial: bool
) -> list[str]:
    """Problems of the name set: missing tensors, scales without (or for BF16) weights, torn fused groups."""
    problems: list[str] = []
    fp8_weights = {n for n, d in present.items() if d == FP8_DTYPE_NAME}
    for n in sorted(fp8_weights):
        if n + SCALE_SUFFIX not in present:
            problems.append(f"{n!r} arrived in FP8 without its scale {n + SCALE_SUFFIX!r}; send both")
    for n in sorted(present):
        if n.endswith(SCALE_SUFFIX) and n in expected and n[: -len(SCALE_SUFFIX)] not in fp8_weights:
            problems.append(f"{n!r} arrived but its weight did not arrive in FP8; send the FP8 weight with it")
    needed = [
        s.name
        for s in expected.values()
        if s.required and not (s.kind == "scale" and s.name[: -len(SCALE_SUFFIX)] not in fp8_weights)
    ]
    missing = [n for n in needed if n not in present and not n.endswith(SCALE_SUFFIX)]
    if not partial:
        if missing:
            problems.append(
                f"the version is incomplete: {len(missing)} tensor(s) the engine expects are missing: "
                f"{_listed(missing)}; the sender must send every tensor (or opt into partial=True)"
            )
        return problems
    touched = {expected[n].group for n in present if n in expected}
    torn = [n for n in missing if expected[n].group in touched and expected[n].kind == "weight"]
    if torn:
        problems.append(
            f"a partial version must carry every shard of a fused module it touches; missing: {_listed(torn)}"
        )
    return problems


def validate_metas(
    metas: Iterable[tuple[str, tuple[int, ...], str]], expected: Mapping[str, ExpectedTensor], *, partial: bool
) -> None:
    """Check a version's ``(name, shape, dtype_name)`` list against ``expected`` (no values).

    Raises:
        WeightStreamError: naming every offending tensor (up to :data:`MAX_LISTED`) and what to check.
    """
    problems: list[str] = []
    present: dict[str, str] = {}
    first: str | None = None
    for name, shape, dtype in metas:
        if name in present:
            problems.append(f"{name!r} appears twice in one version")
        present[name] = dtype
        spec = expected.get(name)
        msg = _unknown_reason(name, expected) if spec is None else _check_layout(name, tuple(shape), dtype, spec)
        if msg:
            problems.append(msg)
            first = first or name
    problems += _check_completeness(present, expected, partial=partial)
    if problems:
        raise WeightStreamError(
            f"refit refused before any write ({len(problems)} problem(s)): " + " | ".join(problems[:MAX_LISTED]),
            name=first,
        )


def _bad_scale_values(t: torch.Tensor) -> str | None:
    # a UE8M0 scale (not in FLOAT_DTYPES) holds no zero and no negative: only its NaN code can be bad
    if has_nonfinite(t):
        return "NaN or Inf"
    if t.numel() and t.dtype in FLOAT_DTYPES and float(t.amin()) <= 0:
        return f"{int((t <= 0).sum())} zero or negative value(s)"
    return None


def validate_version(
    items: Sequence[tuple[str, torch.Tensor]],
    expected: Mapping[str, ExpectedTensor],
    *,
    partial: bool,
    values: bool = True,
) -> None:
    """Check a whole version (names, shapes, dtypes, completeness, values) before anything is written.

    Args:
        items: ``(name, tensor)`` of the version.
        expected: the engine's refit set.
        partial: a partial version is allowed.
        values: read every weight for NaN/Inf (``False``: the caller checked them where they arrived); scales are
            checked (finite, > 0) either way.

    Raises:
        WeightStreamError: naming the offending tensor(s), the expected and the received layout.
    """
    validate_metas(((n, tuple(t.shape), _dtype_name(t.dtype)) for n, t in items), expected, partial=partial)
    for name, tensor in items:
        kind = expected[name].kind
        if kind in ("scale", "kv_scale"):
            bad = _bad_scale_values(tensor)
            if bad:
                raise WeightStreamError(
                    f"refit refused before any write: scale {name!r} holds {bad}; scales must be finite and "
                    "positive (check the amax -> scale rule and the KV calibration)",
                    name=name,
                )
        elif values and has_nonfinite(tensor):  # one read per tensor at memory speed (host-staged: on a CPU)
            raise WeightStreamError(
                f"refit refused before any write: {name!r} holds NaN or Inf; check the training step that produced it",
                name=name,
            )
