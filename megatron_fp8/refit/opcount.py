"""Count the device ops and host reads a piece of refit code issues, on any device (CPU included).

A refit is host-bound when it issues an op, or reads a value back, per tensor: on a GPU every compute op is
a kernel launch and every host read (``.item()``, ``.tolist()``, ``bool(t)``, ``torch.equal``) a device sync.
:class:`OpCounter` counts both from the calling thread, so the launch and sync budget of the hot path is
checked on a CPU-only machine (``tests/refit/test_launch_count.py``) and reported by ``bench/refit.py``.

Counted as compute: every aten op except views and metadata ops (``OpOverload.is_view``, ``detach``,
``lift_fresh``) and allocations (``empty*``), which launch no kernel. Counted as dispatches: every aten op, views
included: each costs the host a trip through the dispatcher (~2-3 us on a GPU machine, an H200 profile of
2026-11-27), so a refit that makes a view per tensor pays for it in host time even though it launches nothing. Counted as host reads:
``aten._local_scalar_dense`` (``item``, ``bool``, ``int``, ``float``), ``aten.equal``, and the Python-level
``Tensor.tolist`` / ``Tensor.numpy`` / ``Tensor.__array__``, which read a whole tensor back without dispatching
``_local_scalar_dense``.

The counters are per thread: the torch mode stacks are thread-local, so enter one :class:`OpCounter` in
each thread to count (e.g. the sender's and the receiver's side of an in-process refit).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "OpCounts"]

_NOT_COMPUTE = frozenset({"detach", "lift_fresh", "empty", "empty_like", "empty_strided", "_to_dense_on_meta"})
_HOST_READ_OPS = frozenset({"_local_scalar_dense", "equal"})
_HOST_READ_METHODS = frozenset({"tolist", "numpy", "__array__"})


@dataclass
class OpCounts:
    """What one :class:`OpCounter` saw.

    Attributes:
        compute: compute ops (kernel launches on a GPU), by aten op name.
        host_reads: host reads (device syncs on a GPU), by op or method name.
        dispatched: every aten op dispatched (compute, views, metadata and allocations), by name.
    """

    compute: collections.Counter = field(default_factory=collections.Counter)
    host_reads: collections.Counter = field(default_factory=collections.Counter)
    dispatched: collections.Counter = field(default_factory=collections.Counter)

    @property
    def num_compute(self) -> int:
        """Total compute ops."""
        return sum(self.compute.values())

    @property
    def dispatches(self) -> int:
        """Total aten ops dispatched."""
        return sum(self.dispatched.values())

    @property
    def num_host_reads(self) -> int:
        """Total host reads."""
        return sum(self.host_reads.values())

    def to_dict(self) -> dict:
        """A JSON-able summary."""
        return {
            "compute_ops": self.num_compute,
            "host_reads": self.num_host_reads,
            "dispatches": self.dispatches,
            "by_op": dict(self.compute.most_common()),
            "reads_by_op": dict(self.host_reads),
        }


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: OpCounts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts.dispatched[name] += 1
        if name in _HOST_READ_OPS:
            self.counts.host_reads[name] += 1
            if name == "equal":
                self.counts.compute[name] += 1
        elif not func.is_view and name not in _NOT_COMPUTE:
            self.counts.compute[name] += 1
        return func(*args, **(kwargs or {}))


class _Function(TorchFunctionMode):
    def __init__(self, counts: OpCounts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READ_METHODS:
            self.counts.host_reads[name] += 1
        return func(*args, **(kwargs or {}))


class OpCounter:
    """Context manager counting compute ops and host reads issued by the current thread.

    Example::

        with OpCounter() as counter:
            sender.send(stream, version=1)
        counter.counts.num_compute, counter.counts.num_host_reads
    """

    def __init__(self) -> None:
        self.counts = OpCounts()
        self._modes = (_Function(self.counts), _Dispatch(self.counts))

    def __enter__(self) -> OpCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def _self_check() -> OpCounts:
    """Counts of a tiny known sequence (used by the tests to prove the counter itself works)."""
    with OpCounter() as c:
        x = torch.arange(8)
        y = (x * 2).sum()
        y.item()
        x.view(torch.uint8).tolist()
    return c.counts
