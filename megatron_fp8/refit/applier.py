"""The engine side's contract: the two-phase :class:`RefitApplier` protocol, and two small appliers.

The receiver (:mod:`megatron_fp8.refit.receiver`) hands an applier one whole
version: ``begin(version, metas)`` with the metadata of *every* tensor of the
version, ``stage(name, tensor)`` for each tensor, then ``commit(version)``; or
``abort(version, reason)`` on any failure before commit. The guarantees an applier
gives (README "Refit guarantees"):

* ``begin`` and ``stage`` write nothing to the engine: they validate names,
  shapes, dtypes, completeness (the version holds exactly the tensors the engine
  expects, unless the applier was built for partial refits) and values;
* ``commit`` validates whatever is left before its first write; if anything fails
  after the first write, the engine is restored to its last good version and
  :class:`~megatron_fp8.errors.RefitRolledBackError` is raised, or, for an engine
  that cannot restore, it stops serving until a good version commits;
* after a successful ``commit`` the engine serves ``version`` and holds exactly
  what was sent (verified).

:class:`DictApplier` is the reference implementation over a dict of tensors;
:class:`CallableApplier` adapts a plain function (no guarantees beyond the function's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from megatron_fp8.errors import RefitError
from megatron_fp8.refit.wire import TensorMeta, torch_dtype


@runtime_checkable
class RefitApplier(Protocol):
    """Two-phase application of one refit version to an engine's weights."""

    def begin(self, version: int, metas: Sequence[TensorMeta]) -> None:
        """Check that every tensor of the version can be applied; raise :class:`RefitError` naming one that can't."""

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        """Accept one tensor (a view of the staging area); must not modify engine weights yet."""

    def commit(self, version: int) -> None:
        """Apply every staged tensor; afterwards the engine serves ``version``."""

    def abort(self, version: int, reason: str) -> None:
        """Drop anything staged for ``version``; the engine keeps its last committed version."""


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8).to(a.device))


class DictApplier:
    """Reference :class:`RefitApplier` over a dict of named tensors.

    Tensors are updated in place with ``copy_`` (never rebound, so their
    storage, and anything holding it, stays valid) and only on :meth:`commit`.
    Incoming dtype and shape must equal the target's: an FP8 tensor is never
    silently cast into a BF16 slot.

    Args:
        tensors: name -> target tensor (the engine's weights).
        version: version the tensors hold now.
        require_all: every name of ``tensors`` must be in each refit.
        verify: read every tensor back after copying and compare bytes.
    """

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], *, version: int = 0, require_all: bool = False, verify: bool = True
    ):
        self.tensors = tensors
        self.version = version
        self.require_all = require_all
        self.verify = verify
        self.last_abort: tuple[int, str] | None = None
        self._pending: int | None = None
        self._metas: dict[str, TensorMeta] = {}
        self._staged: dict[str, torch.Tensor] = {}

    def _target(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            known = sorted(self.tensors)
            hint = ", ".join(known[:5]) + (", ..." if len(known) > 5 else "")
            raise RefitError(
                f"refit tensor {name!r} is not a parameter of this engine ({len(known)} known, e.g. {hint}); "
                "check the HF name mapping and the FP8 manifest"
            ) from None

    def _check(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        target = self._target(name)
        if tuple(target.shape) != tuple(shape) or target.dtype != dtype:
            raise RefitError(
                f"refit tensor {name!r}: got {tuple(shape)} {dtype}, the engine holds {tuple(target.shape)} "
                f"{target.dtype}; trainer and engine disagree on this parameter's layout or precision"
            )

    def begin(self, version: int, metas: Sequence[TensorMeta]) -> None:
        if version <= self.version:
            raise RefitError(f"refit version {version} is not newer than the applied version {self.version}")
        self._pending, self._metas, self._staged = version, {}, {}
        for m in metas:
            self._check(m.name, m.shape, torch_dtype(m.dtype, tensor_name=m.name))
            self._metas[m.name] = m
        if self.require_all:
            missing = sorted(set(self.tensors) - set(self._metas))
            if missing:
                raise RefitError(f"refit version {version} misses {len(missing)} engine tensor(s), e.g. {missing[:5]}")

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        if self._pending is None:
            raise RefitError(f"stage({name!r}) called before begin()")
        if name not in self._metas:
            raise RefitError(f"refit tensor {name!r} was not announced in begin() for version {self._pending}")
        if name in self._staged:
            raise RefitError(f"refit tensor {name!r} staged twice in version {self._pending}")
        self._check(name, tuple(tensor.shape), tensor.dtype)
        self._staged[name] = tensor

    def commit(self, version: int) -> None:
        if self._pending != version:
            raise RefitError(f"commit({version}) does not match the version begun ({self._pending})")
        missing = sorted(set(self._metas) - set(self._staged))
        if missing:
            raise RefitError(
                f"commit of version {version}: {len(missing)} announced tensor(s) never staged, e.g. {missing[:5]}"
            )
        with torch.no_grad():
            for name, src in self._staged.items():
                self.tensors[name].copy_(src)
        if self.verify:
            for name, src in self._staged.items():
                if not _same_bytes(self.tensors[name], src):
                    raise RefitError(f"refit version {version}: tensor {name!r} reads back different bytes after copy")
        self.version = version
        self._pending, self._metas, self._staged = None, {}, {}

    def abort(self, version: int, reason: str) -> None:
        self.last_abort = (version, reason)
        self._pending, self._metas, self._staged = None, {}, {}


class CallableApplier:
    """Adapt ``apply(version, [(name, tensor), ...])`` to :class:`RefitApplier` (called once, on commit)."""

    def __init__(self, apply: Callable[[int, list[tuple[str, torch.Tensor]]], None]):
        self.apply = apply
        self._staged: list[tuple[str, torch.Tensor]] = []

    def begin(self, version: int, metas: Sequence[TensorMeta]) -> None:
        self._staged = []

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        self._staged.append((name, tensor))

    def commit(self, version: int) -> None:
        staged, self._staged = self._staged, []
        self.apply(version, staged)

    def abort(self, version: int, reason: str) -> None:
        self._staged = []
