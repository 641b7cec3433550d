"""Transports that move refit buckets from the trainer to the rollout engine(s).

One interface, :class:`Transport` (:mod:`.base`), with four implementations
picked by name from :data:`FACTORIES` (:func:`make_transport`, :mod:`.registry`):

* ``inproc``: a bounded queue between two threads of one process (:mod:`.inproc`);
* ``gloo`` / ``nccl``: :class:`TorchDistTransport`, a ``torch.distributed``
  broadcast from the trainer rank to every rollout rank of a process group (:mod:`.torch_dist`);
* ``cuda_ipc``: :class:`CudaIpcTransport`, CUDA IPC handles of the bucket sent
  to a colocated engine process, which copies the bytes out (:mod:`.cuda_ipc`).

Every wait has a deadline. A peer that dies or stalls becomes a
:class:`~megatron_fp8.errors.TransportTimeoutError` naming the peer rank(s) and
the bucket, never a hang. A sender that gives up mid-version sends an *abort*
message; the receiver's :meth:`Transport.recv` then raises
:class:`~megatron_fp8.errors.RefitAbortedError`. An orderly :meth:`Transport.close`
on the sender makes the receiver's next ``recv`` raise
:class:`~megatron_fp8.errors.TransportClosedError`.
"""

from megatron_fp8.exports import lazy_exports

_EXPORTS = {  # exported name -> the module that defines it (resolved on first use: megatron_fp8.exports)
    "DEFAULT_TIMEOUT_S": "megatron_fp8.refit.transport.base",
    "Transport": "megatron_fp8.refit.transport.base",
    "CudaIpcTransport": "megatron_fp8.refit.transport.cuda_ipc",
    "IpcQueue": "megatron_fp8.refit.transport.cuda_ipc",
    "InProcTransport": "megatron_fp8.refit.transport.inproc",
    "FACTORIES": "megatron_fp8.refit.transport.registry",
    "TransportFactory": "megatron_fp8.refit.transport.registry",
    "make_transport": "megatron_fp8.refit.transport.registry",
    "TorchDistTransport": "megatron_fp8.refit.transport.torch_dist",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
