"""Refit: move one version of the weights trainer -> rollout engine, exactly and atomically.

``stream of (hf_name, tensor)`` -> :func:`pack_buckets` (single pass, bounded
memory, validated) -> :class:`Transport` (``inproc`` / ``gloo`` / ``nccl`` /
``cuda_ipc``, every wait with a deadline) -> :class:`RefitReceiver` (stages a
whole version, commits only the exact set the version's trailer announces:
``begin`` / ``stage`` / ``commit`` on a :class:`RefitApplier`, or ``abort`` on
any failure) -> a :class:`RefitOutcome` back to :meth:`RefitSender.send`, which
raises :class:`~megatron_fp8.errors.RefitRefusedError` unless every receiver committed.

Modules: :mod:`.wire` (bucket format, dtype names, versions), :mod:`.integrity`
(the checksum, NaN/Inf refusal), :mod:`.buckets` (packer), :mod:`.transport`
(one module per transport plus the registry), :mod:`.sender`, :mod:`.receiver`,
:mod:`.pipeline` (colocated refit), :mod:`.synthetic`, :mod:`.verify`.
"""

from megatron_fp8.exports import lazy_exports

_EXPORTS = {  # exported name -> the module that defines it (resolved on first use: megatron_fp8.exports)
    "CallableApplier": "megatron_fp8.refit.applier",
    "DictApplier": "megatron_fp8.refit.applier",
    "RefitApplier": "megatron_fp8.refit.applier",
    "default_bucket_bytes": "megatron_fp8.refit.buckets",
    "pack_buckets": "megatron_fp8.refit.buckets",
    "unpack_bucket": "megatron_fp8.refit.buckets",
    "payload_checksum": "megatron_fp8.refit.integrity.checksum",
    "check_finite": "megatron_fp8.refit.integrity.finite",
    "ReceiveReport": "megatron_fp8.refit.receiver",
    "RefitReceiver": "megatron_fp8.refit.receiver",
    "PAYLOAD_CLASSES": "megatron_fp8.refit.sender",
    "RefitSender": "megatron_fp8.refit.sender",
    "SendReport": "megatron_fp8.refit.sender",
    "payload_class": "megatron_fp8.refit.sender",
    "FACTORIES": "megatron_fp8.refit.transport",
    "CudaIpcTransport": "megatron_fp8.refit.transport",
    "InProcTransport": "megatron_fp8.refit.transport",
    "TorchDistTransport": "megatron_fp8.refit.transport",
    "Transport": "megatron_fp8.refit.transport",
    "make_transport": "megatron_fp8.refit.transport",
    "ALIGN": "megatron_fp8.refit.wire",
    "DTYPES": "megatron_fp8.refit.wire",
    "Bucket": "megatron_fp8.refit.wire",
    "RefitOutcome": "megatron_fp8.refit.wire",
    "RefitVersion": "megatron_fp8.refit.wire",
    "TensorMeta": "megatron_fp8.refit.wire",
    "VersionTrailer": "megatron_fp8.refit.wire",
    "TRANSPORTS": "megatron_fp8.vocab",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
