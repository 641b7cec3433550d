"""The quantizing export: HF-named weights, FP8 exactly where vLLM holds FP8.

For every name in the :class:`~bridge_mappings.manifest.Manifest` the stream
carries ``(name, float8_e4m3fn [N, K])`` and ``(name + "_scale_inv", float32
[ceil(N/128), ceil(K/128)])``; every other tensor passes through in BF16.

Checks run before anything is sent (:func:`preflight`): every manifest name is
in the planned stream, every FP8-capable name is either in the manifest or
deliberately BF16, and each TP partition / fused shard divides into 128-blocks.
While streaming (:func:`checked_stream`), an unplanned name or a missing manifest
name raises before the stream ends, so a receiver never commits a partial refit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from bridge_mappings.adapter import quantized_hf_weight_stream
from bridge_mappings.manifest import Manifest
from megatron_fp8.errors import ManifestError
from megatron_fp8.layout import blockable_tp_sizes, tp_splits_blockable
from megatron_fp8.megatron.build import MegatronModel
from megatron_fp8.quant import quantize_blockwise
from megatron_fp8.quant.formats import NonFinitePolicy
from megatron_fp8.refit.inbucket import PendingPart, blockwise_parts
from megatron_fp8.vocab import SCALE_SUFFIX

logger = logging.getLogger(__name__)


ROW_PARALLEL_SUFFIXES: tuple[str, ...] = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "down_proj.weight")
"""Weights Megatron splits along K (row-parallel); all other linear weights split along N."""


@dataclasses.dataclass(frozen=True)
class ExportSettings:
    """How FP8 tensors are produced.

    Attributes:
        scale_format: ``"fp32"`` or ``"ue8m0"`` (pow2 scales for DeepGEMM on Blackwell).
        block_size: ``(rows, cols)`` of a weight block.
        tp_size: tensor-parallel size of the *rollout* engine (divisibility check).
    """

    scale_format: str = "fp32"
    block_size: tuple[int, int] = (128, 128)
    tp_size: int = 1


def check_tp_divisibility(
    shapes: Mapping[str, Sequence[int]], fp8_names: Iterable[str], *, tp_size: int, block: int = 128
) -> None:
    """Each TP partition of an FP8 weight must hold whole 128-blocks along its split axis.

    Args:
        shapes: HF name -> ``[N, K]`` shape.
        fp8_names: the manifest's FP8 names.
        tp_size: tensor-parallel size.

    Raises:
        ManifestError: naming every offending weight, its split and the TP sizes that work.
    """
    problems = []
    for name in sorted(fp8_names):
        shape = shapes.get(name)
        if shape is None or len(shape) != 2:
            continue
        row_parallel = name.endswith(ROW_PARALLEL_SUFFIXES)
        axis, size = ("K", shape[1]) if row_parallel else ("N", shape[0])
        if not tp_splits_blockable(size, tp_size, block):
            ok = blockable_tp_sizes(size, block)
            problems.append(
                f"{name} {tuple(shape)}: {axis}={size} / TP {tp_size} is not a multiple of {block} "
                f"(TP sizes that work: {ok or 'none'})"
            )
    if problems:
        raise ManifestError(
            "blockwise FP8 needs every TP partition to hold whole 128x128 blocks:\n  "
            + "\n  ".join(problems)
            + "\nChoose another tensor_parallel_size or keep these layers in BF16 (ignored_layers)."
        )


def preflight(planned: Mapping[str, Sequence[int]], manifest: Manifest, settings: ExportSettings) -> None:
    """Compare the planned stream with the manifest before anything is sent.

    Args:
        planned: HF name -> shape of every tensor the export will produce.
        manifest: vLLM's answer.
        settings: export settings (TP size for the divisibility check).
    """
    names = set(planned)
    missing = sorted(manifest.fp8_set - names)
    deliberate_bf16 = set(manifest.fp8_capable_bf16)
    capable = names & (manifest.fp8_set | deliberate_bf16)
    unexpected_capable = sorted(deliberate_bf16 - names)
    problems = []
    if missing:
        problems.append(f"{len(missing)} manifest name(s) not in the weight stream: {missing[:6]}")
    if unexpected_capable:
        problems.append(
            f"{len(unexpected_capable)} deliberately-BF16 name(s) not in the stream: {unexpected_capable[:6]}"
        )
    not_in_ckpt = sorted(names - set(manifest.fp8_params) - set(manifest.bf16_params))
    if not_in_ckpt:
        problems.append(f"{len(not_in_ckpt)} stream name(s) vLLM's manifest does not know: {not_in_ckpt[:6]}")
    if problems:
        raise ManifestError(
            "the weight stream and vLLM's FP8 manifest disagree (nothing was sent):\n  "
            + "\n  ".join(problems)
            + "\nAsk vLLM again for this model (megatron-fp8 manifest --refresh) or fix the HF-name mapping."
        )
    check_tp_divisibility(planned, capable & manifest.fp8_set, tp_size=settings.tp_size, block=settings.block_size[0])


def quantize_named(
    name: str, tensor: torch.Tensor, settings: ExportSettings, *, nonfinite: NonFinitePolicy = "raise"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 of one HF weight (NaN/Inf raise, naming the tensor and block; ``"defer"``: a ``+inf`` scale
    for the refit packer to refuse, without a host sync per weight)."""
    return quantize_blockwise(
        tensor, block_size=settings.block_size, scale_format=settings.scale_format, name=name, nonfinite=nonfinite
    )


def in_bucket_parts(name: str, tensor: torch.Tensor, settings: ExportSettings) -> tuple[PendingPart, PendingPart]:
    """Blockwise FP8 of one HF weight, deferred to the refit packer: the ``(codes, scales)`` stand-ins that
    :func:`~megatron_fp8.refit.buckets.pack_buckets` quantizes straight into their bucket (the bytes of
    :func:`quantize_named`; a NaN/Inf weight is refused there, by name and first element)."""
    return blockwise_parts(name, tensor, block_size=settings.block_size, scale_format=settings.scale_format)


def quantized_stream(
    stream: Iterable[tuple[str, torch.Tensor]],
    manifest: Manifest,
    settings: ExportSettings | None = None,
    *,
    nonfinite: NonFinitePolicy = "raise",
    in_bucket: bool = False,
) -> Iterator[tuple[str, torch.Tensor | PendingPart]]:
    """Turn a BF16 HF-named stream into the refit stream (FP8 + scales for manifest names).

    ``nonfinite="defer"`` quantizes without a host sync per weight; a NaN/Inf block then shows as a ``+inf`` block
    scale, which the packer refuses by name and block. ``in_bucket=True`` (what the refit uses) yields each manifest
    weight's codes and scales as :class:`~megatron_fp8.refit.inbucket.PendingPart` s instead: the refit packer
    quantizes every weight of a bucket straight into it, in a few ops per bucket, with the same wire bytes
    (``nonfinite`` then does not apply: the packer always refuses a NaN/Inf weight). Outside a packer, turn a part
    into its tensor with ``PendingPart.materialize()``.
    """
    settings = settings or ExportSettings()
    fp8 = manifest.fp8_set
    for name, tensor in stream:
        if name in fp8:
            if tensor.dtype == torch.float8_e4m3fn:  # already FP8 (fp8_param export)
                yield name, tensor
                continue
            if in_bucket:
                q, s = in_bucket_parts(name, tensor, settings)
            else:
                q, s = quantize_named(name, tensor, settings, nonfinite=nonfinite)
            yield name, q
            yield name + SCALE_SUFFIX, s
        else:
            yield name, tensor


def checked_stream(
    stream: Iterable[tuple[str, torch.Tensor]], manifest: Manifest, *, planned: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass a refit stream through, checking it against the manifest as it goes.

    Raises :class:`ManifestError` on an unplanned name, an FP8 tensor outside the
    manifest, a BF16 tensor for a manifest name, or (at the end, before the
    consumer sees the stream finish) a manifest name that never came.
    """
    planned_set = set(planned) if planned is not None else None
    fp8 = manifest.fp8_set
    seen: set[str] = set()
    for name, tensor in stream:
        base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
        if planned_set is not None and base not in planned_set:
            raise ManifestError(f"{name!r} is not part of the planned weight stream")
        if name == base:
            if base in fp8 and tensor.dtype != torch.float8_e4m3fn:
                raise ManifestError(f"{name!r} is in vLLM's FP8 manifest but arrived as {tensor.dtype}")
            if base not in fp8 and tensor.dtype == torch.float8_e4m3fn:
                raise ManifestError(f"{name!r} is FP8 but vLLM holds it in BF16 (not in the manifest)")
        seen.add(name)
        yield name, tensor
    missing = sorted(n for n in fp8 if n not in seen or n + SCALE_SUFFIX not in seen)
    if missing:
        raise ManifestError(f"the stream ended without {len(missing)} manifest weight(s)/scale(s): {missing[:6]}")


def refit_stream(
    m: MegatronModel,
    manifest: Manifest,
    settings: ExportSettings | None = None,
    *,
    check: bool = True,
    in_bucket: bool = False,
    cpu: bool = True,
) -> Iterator[tuple[str, torch.Tensor | PendingPart]]:
    """The refit stream of a built Megatron model: HF names, FP8 exactly where vLLM holds FP8.

    Args:
        m: a :class:`~megatron_fp8.megatron.MegatronModel`.
        manifest: vLLM's FP8 manifest for this model and quantization config.
        settings: scale format / block size / rollout TP size.
        check: validate the stream against the manifest while it flows
            (:func:`checked_stream`).
        in_bucket: yield each FP8 weight's codes and scales as pending parts the refit packer quantizes straight
            into its bucket (:func:`in_bucket_parts`; what the refit uses), instead of quantizing each weight here
            into tensors of its own (which raises on NaN/Inf with a host sync per weight).
        cpu: copy each exported weight to the host before it is quantized (Megatron-Bridge's ``cpu`` flag);
            ``False`` keeps it on the trainer's device, where it is quantized.
    """
    settings = settings or ExportSettings()
    fp8 = manifest.fp8_set
    stream = quantized_hf_weight_stream(
        m.bridge,
        m.model,
        is_fp8=fp8.__contains__,
        quant_fn=(
            (lambda name, t: in_bucket_parts(name, t, settings))
            if in_bucket
            else (lambda name, t: quantize_named(name, t, settings))
        ),
        cpu=cpu,
    )
    return checked_stream(stream, manifest) if check else stream
