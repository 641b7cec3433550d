"""Transports by name: :data:`FACTORIES` (keys = :data:`megatron_fp8.vocab.TRANSPORTS`) and :func:`make_transport`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch.distributed as dist

from megatron_fp8.errors import ConfigError
from megatron_fp8.refit.transport.base import Transport
from megatron_fp8.refit.transport.cuda_ipc import CudaIpcTransport
from megatron_fp8.refit.transport.inproc import InProcTransport
from megatron_fp8.refit.transport.torch_dist import TorchDistTransport

if TYPE_CHECKING:
    # not imported at run time: torch builds without distributed support lack it
    from torch.distributed import ProcessGroup

TransportFactory = Callable[..., Transport]
"""Builds a transport from keyword options (those of the transport's class)."""


def _torch_dist(backend: str) -> TransportFactory:
    def build(**kwargs: object) -> Transport:
        if dist.is_available() and dist.is_initialized():
            group = cast("ProcessGroup | None", kwargs.get("group"))
            actual = str(dist.get_backend(group)).lower()
            if actual != backend:
                raise ConfigError(
                    f"transport {backend!r} was asked for, but the refit process group uses {actual!r}; "
                    f"create the group with backend={backend!r} or ask for transport {actual!r}"
                )
        construct: TransportFactory = TorchDistTransport  # options are checked by the class
        return construct(**kwargs)

    build.__doc__ = f"A :class:`TorchDistTransport` over a {backend} process group."
    return build


FACTORIES: dict[str, TransportFactory] = {
    "inproc": InProcTransport,
    "gloo": _torch_dist("gloo"),
    "nccl": _torch_dist("nccl"),
    "cuda_ipc": CudaIpcTransport,
}
"""Transport factories by name (the keys of :data:`megatron_fp8.vocab.TRANSPORTS`); keyword arguments go to the class."""


def make_transport(name: str, **kwargs: object) -> Transport:
    """Build the transport registered as ``name`` in :data:`FACTORIES`.

    Args:
        name: a :data:`megatron_fp8.vocab.TRANSPORTS` key.
        **kwargs: options of the transport's class (e.g. ``timeout``, ``src``, ``role``).

    Raises:
        ConfigError: unknown name (the message lists the valid names) or a bad option.
    """
    try:
        factory = FACTORIES[name]
    except KeyError:
        raise ConfigError(f"unknown refit transport {name!r}; valid transports: {sorted(FACTORIES)}") from None
    return factory(**kwargs)
