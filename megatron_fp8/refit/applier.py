"""The engine side's contract: the two-phase :class:`RefitApplier` protocol, and two small appliers.

The receiver (:mod:`megatron_fp8.refit.receiver`) hands an applier one whole
version: ``begin(version, metas)`` with the metadata of *every* tensor of the
version, ``stage(name, tensor)`` for each tensor, then ``commit(version)``; or
``abort(version, reason)`` on any failure before commit. The guarantees an applier
gives (docs/refit.md, "Refit guarantees"):

* ``begin`` and ``stage`` write nothing to the engine: they validate names,
  shapes, dtypes, completeness (the version holds exactly the tensors the engine
  expects, unless the applier was built for partial refits) and values;
* ``commit`` validates whatever is left before its first write; if anything fails
  after the first write, the engine is restored to its last good version and
  :class:`~megatron_fp8.errors.RefitRolledBackError` is raised, or, for an engine
  that cannot restore, it stops serving (``serving`` is ``False``) until a good
  version commits;
* after a successful ``commit`` the engine serves ``version`` and holds exactly
  what was sent (verified byte for byte).

:class:`DictApplier` is the reference implementation over a dict of tensors;
:class:`CallableApplier` adapts a plain function (no guarantees beyond the function's).
The helpers :func:`check_complete`, :func:`check_scale_values` and
:func:`first_byte_mismatch` are shared with the engines' appliers.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from megatron_fp8.errors import EngineNotServingError, RefitError, RefitRolledBackError, WeightStreamError
from megatron_fp8.refit import fused_fill, multi
from megatron_fp8.refit.integrity.finite import FLOAT_DTYPES, FiniteProbe
from megatron_fp8.refit.wire import TensorMeta, torch_dtype
from megatron_fp8.vocab import SCALE_SUFFIX, is_kv_scale_name

logger = logging.getLogger(__name__)

_SHOWN = 5
"""How many names an error message lists before ``...``."""


@runtime_checkable
class RefitApplier(Protocol):
    """Two-phase application of one refit version to an engine's weights.

    Optional: an applier whose attribute ``staging_device`` is a device keeps every staged tensor on that device
    until its commit (the vLLM applier: the device its in-process workers load from, the engine's GPU when it is
    colocated with the trainer); ``keeps_host_copies`` true means the host. The receiver then stages the version on
    that device for it and calls ``stage(name, tensor, owned=True)`` with views of memory that holds this version
    alone (a received bucket already on that device is kept as it is: every transport hands out a fresh buffer per
    bucket; else a copy of it made there), which the applier keeps as they are (:func:`staging_device`).

    Optional: an applier whose attribute ``accepts_checked_values`` is true (:func:`accepts_checked_values`) lets
    the receiver check the version's values for NaN/Inf where the buckets arrive (on their device, in the pass that
    reads them anyway, before any host copy), and is told ``values_checked(version)`` between ``begin`` and
    ``commit`` when every tensor of the version passed; it may then skip its own pass over the values (the vLLM
    applier's workers would read every byte of a host-staged version on the CPU). A version holding NaN/Inf is
    refused by the receiver, naming the tensor, before ``begin``.
    """

    def begin(self, version: int, metas: Sequence[TensorMeta]) -> None:
        """Check that every tensor of the version can be applied; raise :class:`RefitError` naming one that can't."""

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        """Accept one tensor (a view of the staging area); must not modify engine weights yet."""

    def commit(self, version: int) -> None:
        """Apply every staged tensor; afterwards the engine serves ``version``."""

    def abort(self, version: int, reason: str) -> None:
        """Drop anything staged for ``version``; the engine keeps its last committed version."""


def staging_device(applier: object) -> torch.device | None:
    """Where ``applier`` keeps a staged version until its commit, when it says so (then the receiver stages the
    version there for it and hands it views it owns); ``None``: it copies what it keeps (views of the receiver's
    buckets).

    Read from the applier's ``staging_device`` attribute (a device or its name; ``cuda`` alone: the current GPU, with
    its index), else ``keeps_host_copies`` (true: the host).

    Raises:
        RefitError: ``staging_device`` is not a device name.
    """
    device = getattr(applier, "staging_device", None)
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise RefitError(
                f"{type(applier).__name__}.staging_device is {device!r}, not a device; give a torch.device or a name "
                "such as 'cpu' or 'cuda:0' (None: the applier copies what it keeps)"
            ) from exc
        if device.type == "cuda" and device.index is None:  # the current GPU, as a tensor's device names it
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    return torch.device("cpu") if bool(getattr(applier, "keeps_host_copies", False)) else None


def keeps_host_copies(applier: object) -> bool:
    """Whether ``applier`` keeps its staged tensors in host memory (:func:`staging_device` is the host)."""
    device = staging_device(applier)
    return device is not None and device.type == "cpu"


def accepts_checked_values(applier: object) -> bool:
    """Whether ``applier`` takes the receiver's NaN/Inf check of a version (``values_checked(version)``) in place
    of its own (:class:`RefitApplier`)."""
    return bool(getattr(applier, "accepts_checked_values", False)) and callable(
        getattr(applier, "values_checked", None)
    )


# ----------------------------------------------------------------------------- shared checks


def name_list(names: Collection[str], limit: int = _SHOWN) -> str:
    """``'a', 'b', ... (+N more)``: the first ``limit`` names, sorted, for an error message."""
    ordered = sorted(names)
    shown = ", ".join(repr(n) for n in ordered[:limit])
    return shown + (f", ... (+{len(ordered) - limit} more)" if len(ordered) > limit else "")


def check_complete(
    version: int,
    announced: Collection[str],
    *,
    required: Collection[str],
    allowed: Collection[str],
    partial: bool,
    extra_hint: str = "check the HF name mapping, the FP8 manifest and the KV-cache dtype of both sides",
) -> None:
    """Refuse a version that lacks a tensor the engine expects, or carries one it does not hold.

    Args:
        version: the refit version (for the message).
        announced: every name the version carries.
        required: the names a complete version must carry.
        allowed: the names a version may carry (a superset of ``required``).
        partial: only refuse extra names (a partial refit, opted into by name).
        extra_hint: what to check about an extra name.

    Raises:
        WeightStreamError: naming the first missing / extra tensor, the counts and what to check;
            ``name`` is the first extra name, else the first missing one.
    """
    got = set(announced)
    extra = sorted(got - set(allowed))
    missing = [] if partial else sorted(set(required) - got)
    if not extra and not missing:
        return
    parts = []
    if extra:
        parts.append(
            f"{extra[0]!r} is not a parameter of this engine ({len(extra)} unexpected tensor(s): {name_list(extra)}); "
            + extra_hint
        )
    if missing:
        parts.append(
            f"{len(missing)} of the {len(set(required))} tensors a complete version carries are missing "
            f"({name_list(missing)}); check that the sender streamed the whole model (a stream that ended early, "
            "a lost tail bucket, a filtered export) with the engine's FP8 manifest; a partial refit must be asked "
            "for by name (partial=True on the applier)"
        )
    raise WeightStreamError(
        f"refit version {version} refused, nothing applied: " + "; ".join(parts), name=(extra or missing)[0]
    )


def is_scale_name(name: str) -> bool:
    """Whether ``name`` is a block scale (``..._scale_inv``) or a KV-cache scale."""
    return name.endswith(SCALE_SUFFIX) or is_kv_scale_name(name)


def check_scale_values(name: str, tensor: torch.Tensor, *, version: int | None = None) -> None:
    """Refuse a scale tensor holding a zero, negative, NaN or Inf value.

    Args:
        name: the scale's name (``..._scale_inv`` or a KV-cache scale).
        tensor: the scales, any float dtype and shape (small: one value per 128x128 block or per layer).
        version: refit version, for the message.

    Raises:
        WeightStreamError: naming the tensor, the count, the first offending index and value.
    """
    if tensor.numel() == 0:
        return
    values = tensor.detach().to(torch.float32)
    bad = ~(torch.isfinite(values) & (values > 0))
    if not bool(bad.any()):
        return
    flat = int(bad.reshape(-1).nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(values.shape))) if values.dim() else ()
    where = f" of version {version}" if version is not None else ""
    raise WeightStreamError(
        f"refit tensor {name!r}{where}: {int(bad.sum())} of {values.numel()} scale(s) are zero, negative, NaN or "
        f"Inf (first at index {index}: {float(values.reshape(-1)[flat])}); every scale must be finite and > 0 "
        "(an all-zero block gets 1.0): check the sender's quantizer and KV calibration; nothing applied",
        name=name,
    )


def first_byte_mismatch(held: torch.Tensor, sent: torch.Tensor) -> int | None:
    """Flat element index of the first element whose bytes differ, ``None`` when ``held`` equals ``sent`` exactly.

    Dtype and shape must match (compare the element bytes, so ``-0.0 != 0.0`` and NaN payloads count).
    """
    if held.dtype != sent.dtype or held.numel() != sent.numel():
        return 0
    if held.numel() == 0:
        return None
    a = held.detach().reshape(-1).view(torch.uint8).reshape(held.numel(), -1)
    b = sent.detach().reshape(-1).view(torch.uint8).to(held.device).reshape(held.numel(), -1)
    if torch.equal(a, b):
        return None
    return int((a != b).any(dim=1).nonzero()[0, 0])


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return first_byte_mismatch(a, b) is None


def copy_by_dtype(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> int:
    """``targets[i].copy_(sources[i])`` for every ``i``: one ``torch._foreach_copy_`` per (device, dtype).

    A multi-tensor copy takes its fast path on a GPU (a few launches for the whole list) only when every tensor of
    the list shares one dtype and device; a mixed list falls back to one copy launch per tensor. 1-byte dtypes
    (the FP8 formats) are copied as ``uint8`` views, so they form one group and every torch build takes the fast
    path for them. On CUDA with Triton a group of contiguous tensors is copied by
    :func:`~megatron_fp8.refit.fused_fill.copy_many` instead (one pass at copy bandwidth per element width, where
    ``_foreach_copy_`` ran at about half of it). Shapes and dtypes must already agree (the appliers check them).

    Returns:
        The number of multi-tensor copies (or launches) issued.
    """
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for target, source in zip(targets, sources, strict=True):
        if target.numel() == 0:
            continue
        one_byte = target.element_size() == 1 and target.dtype != torch.bool
        dst, src = groups.setdefault((target.device, torch.uint8 if one_byte else target.dtype), ([], []))
        dst.append(target)
        src.append(source)
    issued = 0
    with torch.no_grad():
        for (_, dtype), (dst, src) in groups.items():
            if fused_fill.runs_on(dst + src):  # by data pointer: no view per tensor
                issued += fused_fill.copy_many(dst, src)
                continue
            if dtype == torch.uint8:
                dst, src = [t.view(torch.uint8) for t in dst], [t.view(torch.uint8) for t in src]
            torch._foreach_copy_(dst, src)
            issued += 1
    return issued


# ----------------------------------------------------------------------------- DictApplier


class DictApplier:
    """Reference :class:`RefitApplier` over a dict of named tensors.

    Tensors are updated in place with ``copy_`` (never rebound, so their
    storage, and anything holding it, stays valid) and only on :meth:`commit`.
    Incoming dtype and shape must equal the target's: an FP8 tensor is never
    silently cast into a BF16 slot.

    Guarantees: a version carries exactly the names of ``tensors`` (unless
    ``partial``); names, shapes and dtypes are checked in :meth:`begin`, values
    (NaN/Inf anywhere, zero/negative scales) in :meth:`stage`; the first write is
    in :meth:`commit`, which reads every tensor back (``verify``) and, on any
    failure after its first write, restores the copies it took of the tensors it
    overwrote (``rollback``: costs one extra copy of the version's tensors, on
    their device, during the commit) and raises
    :class:`~megatron_fp8.errors.RefitRolledBackError`. If the restore itself
    fails (or ``rollback=False``), :attr:`serving` turns ``False`` until a version
    commits.

    Args:
        tensors: name -> target tensor (the engine's weights).
        version: version the tensors hold now.
        partial: accept a version that carries a subset of ``tensors`` (default: refuse it).
        require_all: deprecated alias: ``True`` is the default, ``False`` means ``partial=True``.
        verify: read every tensor back after copying and compare bytes.
        rollback: keep copies of the overwritten tensors during a commit, to restore them on failure.

    Attributes:
        version: the version the tensors hold (never advanced by a failed commit).
        last_abort: ``(version, reason)`` of the last :meth:`abort`, else ``None``.
        after_write: fault-injection hook for tests, called with this applier after the copies and
            before verification (``None``: nothing).
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        version: int = 0,
        partial: bool = False,
        require_all: bool | None = None,
        verify: bool = True,
        rollback: bool = True,
    ):
        if require_all is not None:
            warnings.warn(
                "DictApplier(require_all=...) is deprecated: a refit must be complete by default; pass partial=True "
                "to accept a partial version",
                DeprecationWarning,
                stacklevel=2,
            )
            partial = partial or not require_all
        self.tensors = tensors
        self.version = version
        self.partial = partial
        self.verify = verify
        self.rollback = rollback
        self.last_abort: tuple[int, str] | None = None
        self.after_write: Callable[[DictApplier], None] | None = None
        self._serving = True
        self._pending: int | None = None
        self._metas: dict[str, TensorMeta] = {}
        self._staged: dict[str, torch.Tensor] = {}

    @property
    def require_all(self) -> bool:
        """Deprecated: ``not partial``."""
        return not self.partial

    @property
    def serving(self) -> bool:
        """Whether the tensors hold a good (committed, verified) version; ``False`` after a failed restore."""
        return self._serving

    def _reset(self) -> None:
        self._pending, self._metas, self._staged = None, {}, {}

    def _check(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        target = self.tensors[name]
        if tuple(target.shape) != tuple(shape) or target.dtype != dtype:
            raise WeightStreamError(
                f"refit tensor {name!r}: got {tuple(shape)} {dtype}, the engine holds {tuple(target.shape)} "
                f"{target.dtype}; trainer and engine disagree on this parameter's layout or precision "
                "(check the export's HF mapping, TP gather and FP8 manifest); nothing applied",
                name=name,
            )

    def begin(self, version: int, metas: Sequence[TensorMeta]) -> None:
        """Check the version's names (complete, known, each once), shapes and dtypes; write nothing."""
        self._reset()
        if version <= self.version:
            raise RefitError(f"refit version {version} is not newer than the applied version {self.version}")
        announced: dict[str, TensorMeta] = {}
        for m in metas:
            if m.name in announced:
                raise WeightStreamError(f"refit version {version}: tensor {m.name!r} announced twice", name=m.name)
            announced[m.name] = m
        known = list(self.tensors)
        check_complete(
            version,
            announced,
            required=known,
            allowed=known,
            partial=self.partial,
            extra_hint=f"the engine holds {len(known)} tensors (e.g. {name_list(known, 3)}); check the HF name "
            "mapping and the FP8 manifest",
        )
        for m in metas:
            self._check(m.name, m.shape, torch_dtype(m.dtype, tensor_name=m.name))
        self._pending, self._metas = version, announced

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        """Check one tensor against its announcement and its values (NaN/Inf, scales > 0); write nothing."""
        self.stage_many([(name, tensor)])

    def stage_many(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
        """:meth:`stage` for many tensors at once: the value checks in a few multi-tensor ops and one host read.

        The receiver calls this (when an applier has it) with every tensor of a version.
        """
        if self._pending is None:
            raise RefitError(f"stage({pairs[0][0] if pairs else ''!r}) called before begin()")
        seen: set[str] = set()
        for name, tensor in pairs:
            if name not in self._metas:
                raise RefitError(f"refit tensor {name!r} was not announced in begin() for version {self._pending}")
            if name in self._staged or name in seen:
                raise RefitError(f"refit tensor {name!r} staged twice in version {self._pending}")
            seen.add(name)
            self._check(name, tuple(tensor.shape), tensor.dtype)
        probe = FiniteProbe(pairs)
        # UE8M0 scales hold no zero and no negative: only their NaN code can be bad, and the probe flags it
        scales = [(n, t) for n, t in pairs if is_scale_name(n) and t.numel() and t.dtype in FLOAT_DTYPES]
        parts = [probe.values] if probe.values is not None else []
        low = None
        if scales:
            low = multi.smallest([t for _, t in scales], parts[0].device if parts else scales[0][1].device)
            parts.append(low)
        host = torch.cat(parts).tolist() if parts else []  # the one host read
        probe.check(host[: len(host) - (1 if low is not None else 0)], version=self._pending)
        if low is not None and not (math.isfinite(host[-1]) and host[-1] > 0):
            for name, tensor in scales:  # name the first bad scale
                check_scale_values(name, tensor, version=self._pending)
        self._staged.update(pairs)

    def commit(self, version: int) -> None:
        """Copy every staged tensor in place, read back, restore the previous bytes on any failure.

        One multi-tensor copy for the backup (when ``rollback``), one per dtype for the write
        (:func:`copy_by_dtype`), and one byte comparison per device
        (:func:`~megatron_fp8.refit.multi.first_mismatch`) for ``verify``.
        """
        if self._pending != version:
            raise RefitError(f"commit({version}) does not match the version begun ({self._pending})")
        missing = sorted(set(self._metas) - set(self._staged))
        if missing:
            self._reset()
            raise RefitError(
                f"commit of version {version}: {len(missing)} announced tensor(s) never staged "
                f"({name_list(missing)}); nothing applied"
            )
        names = list(self._staged)
        sources = [self._staged[n] for n in names]
        targets = [self.tensors[n] for n in names]
        backup = dict(zip(names, multi.snapshot(targets), strict=True)) if self.rollback else None
        try:
            copy_by_dtype(targets, sources)
            if self.after_write is not None:
                self.after_write(self)
            if self.verify:
                bad = multi.first_mismatch(targets, sources)
                if bad is not None:
                    at = first_byte_mismatch(targets[bad], sources[bad])
                    raise RefitError(
                        f"refit version {version}: tensor {names[bad]!r} reads back different bytes after copy "
                        f"(first at flat index {at}); check the device copy"
                    )
        except Exception as exc:
            self._reset()
            self._roll_back(version, backup, exc)
        self.version = version
        self._serving = True
        self._reset()

    def _roll_back(self, version: int, backup: dict[str, torch.Tensor] | None, exc: Exception) -> None:
        if backup is None:
            self._serving = False
            raise EngineNotServingError(
                f"refit version {version} failed after its first write ({exc}) and this applier keeps no copy to "
                "restore (rollback=False): it serves nothing until a good version commits"
            ) from exc
        try:
            with torch.no_grad():
                for name, old in backup.items():
                    self.tensors[name].copy_(old)
            bad = [n for n, old in backup.items() if not _same_bytes(self.tensors[n], old)]
        except Exception as restore_exc:
            bad = [f"{type(restore_exc).__name__}: {restore_exc}"]
        if bad:
            self._serving = False
            raise EngineNotServingError(
                f"refit version {version} failed after its first write ({exc}) and restoring version "
                f"{self.version} failed too ({name_list(bad)}): the engine serves nothing until a good version commits"
            ) from exc
        logger.warning("refit version %d rolled back to version %d: %s", version, self.version, exc)
        raise RefitRolledBackError(
            f"refit version {version} rolled back: {exc}; the engine holds version {self.version} again "
            "(restored byte for byte)"
        ) from exc

    def abort(self, version: int, reason: str) -> None:
        """Drop what was staged; the tensors keep their version."""
        self.last_abort = (version, reason)
        self._reset()


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
