"""Refit: move one version of the weights trainer -> rollout engine, exactly and atomically.

``stream of (hf_name, tensor)`` -> :func:`pack_buckets` (single pass, bounded
memory, validated) -> :class:`Transport` (``inproc`` / ``gloo`` / ``nccl`` /
``cuda_ipc``, every wait with a deadline) -> :class:`RefitReceiver` (stages a
whole version, commits only the exact set the version's trailer announces:
``begin`` / ``stage`` / ``commit`` on a :class:`RefitApplier`, or ``abort`` on
any failure) -> a :class:`RefitOutcome` back to :meth:`RefitSender.send`, which
raises :class:`~megatron_fp8.errors.RefitRefusedError` unless every receiver committed.

Modules: :mod:`.wire` (bucket format, dtype names, versions), :mod:`.checksum`,
:mod:`.finite` (NaN/Inf refusal), :mod:`.buckets` (packer), :mod:`.transport`
(one module per transport plus the registry), :mod:`.sender`, :mod:`.receiver`,
:mod:`.pipeline` (colocated refit), :mod:`.synthetic`, :mod:`.verify`.
"""

from megatron_fp8.refit.applier import CallableApplier, DictApplier, RefitApplier
from megatron_fp8.refit.buckets import default_bucket_bytes, pack_buckets, unpack_bucket
from megatron_fp8.refit.integrity.checksum import payload_checksum
from megatron_fp8.refit.integrity.finite import check_finite
from megatron_fp8.refit.receiver import ReceiveReport, RefitReceiver
from megatron_fp8.refit.sender import PAYLOAD_CLASSES, RefitSender, SendReport, payload_class
from megatron_fp8.refit.transport import (
    FACTORIES,
    CudaIpcTransport,
    InProcTransport,
    TorchDistTransport,
    Transport,
    make_transport,
)
from megatron_fp8.refit.wire import ALIGN, DTYPES, Bucket, RefitOutcome, RefitVersion, TensorMeta, VersionTrailer
from megatron_fp8.vocab import TRANSPORTS

__all__ = [
    "ALIGN",
    "DTYPES",
    "PAYLOAD_CLASSES",
    "FACTORIES",
    "TRANSPORTS",
    "Bucket",
    "CallableApplier",
    "CudaIpcTransport",
    "DictApplier",
    "InProcTransport",
    "ReceiveReport",
    "RefitApplier",
    "RefitOutcome",
    "RefitReceiver",
    "RefitSender",
    "RefitVersion",
    "SendReport",
    "TensorMeta",
    "TorchDistTransport",
    "Transport",
    "VersionTrailer",
    "check_finite",
    "default_bucket_bytes",
    "make_transport",
    "pack_buckets",
    "payload_checksum",
    "payload_class",
    "unpack_bucket",
]
