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

from megatron_fp8.refit.transport.base import DEFAULT_TIMEOUT_S, Transport
from megatron_fp8.refit.transport.cuda_ipc import CudaIpcTransport, IpcQueue
from megatron_fp8.refit.transport.inproc import InProcTransport
from megatron_fp8.refit.transport.registry import FACTORIES, TransportFactory, make_transport
from megatron_fp8.refit.transport.torch_dist import TorchDistTransport

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FACTORIES",
    "CudaIpcTransport",
    "InProcTransport",
    "IpcQueue",
    "TorchDistTransport",
    "Transport",
    "TransportFactory",
    "make_transport",
]
