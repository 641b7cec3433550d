"""Refuse NaN/Inf before a tensor is packed: float dtypes via their min and max, FP8 dtypes via their bit patterns.

A float tensor holds a NaN/Inf iff its min or max is not finite (both propagate NaN): one ``aminmax`` pass. FP8
NaN/Inf encodings (e.g. ``0x7f``/``0xff`` for ``float8_e4m3fn``) are the largest values of the bytes read as
``int8`` or ``uint8``: one ``max`` per byte order. Neither upcasts the tensor or writes a temporary of its size
(:func:`has_nonfinite`), which is what makes the check run at memory speed on a CPU.

Many tensors at once: :class:`FiniteProbe` (a few multi-tensor reductions, or on CUDA the grouped probe pass of
:mod:`megatron_fp8.refit.fused_fill`) and :class:`FlagProbe` (the verdict of a fused bucket fill); either way a
flagged tensor is named, with its first bad element, by :func:`check_finite`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from megatron_fp8.errors import NonFiniteError
from megatron_fp8.refit import fused_fill
from megatron_fp8.refit.wire import DTYPES, TensorMeta, dtype_name
from megatron_fp8.vocab import SCALE_SUFFIX

_CHECK_CHUNK = 1 << 24  # elements per comparison of the fnuz rule (bounds its temporaries)

_HasBad = Callable[[torch.Tensor], bool]
"""Fast test: does the tensor hold a NaN/Inf? (Reductions over the tensor as it is, no temporary of its size.)"""
_BadMask = Callable[[torch.Tensor], torch.Tensor]
"""Bool mask of the offending elements (only built for the error message)."""

FLOAT_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32, torch.float64})
"""The IEEE float dtypes a refit carries: NaN/Inf are values (min/max find them), zero and negatives exist."""
# FP8 dtype -> ((view dtype, "max", bad when the max is >= this), ...): one max per entry, over the bytes as they are.
# e4m3fn NaN is 0x7f / 0xff: the int8 max is 127 only for 0x7f, the uint8 max is 255 only for 0xff.
# e5m2 Inf/NaN is 0x7c..0x7f / 0xfc..0xff. UE8M0 NaN is 0xff.
_FP8_MAX_RULES: dict[torch.dtype, tuple[tuple[torch.dtype, int], ...]] = {
    torch.float8_e4m3fn: ((torch.int8, 0x7F), (torch.uint8, 0xFF)),
    torch.float8_e5m2: ((torch.int8, 0x7C), (torch.uint8, 0xFC)),
    torch.float8_e8m0fnu: ((torch.uint8, 0xFF),),
}


def _chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), _CHECK_CHUNK):
        yield flat[start : start + _CHECK_CHUNK]


def _float_has_nonfinite(t: torch.Tensor) -> bool:
    # one pass, no temporary: min and max propagate NaN, and -Inf / +Inf are the extremes (an abs() first, or
    # isfinite(), writes a tensor of the input's size: ~10x slower on a CPU, where an engine checks host-staged
    # weights)
    return not bool(torch.isfinite(torch.stack(torch.aminmax(t))).all())


def _float_nonfinite_mask(t: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(t)


def _max_rule(dtype: torch.dtype, mask: Callable[[torch.Tensor], torch.Tensor]) -> tuple[_HasBad, _BadMask]:
    def fast(t: torch.Tensor) -> bool:
        return any(int(t.view(view).max()) >= bad_at for view, bad_at in _FP8_MAX_RULES[dtype])

    def slow(t: torch.Tensor) -> torch.Tensor:
        return mask(t.view(torch.uint8))

    return fast, slow


def _fnuz_rule() -> tuple[_HasBad, _BadMask]:
    # the single NaN is 0x80 (negative zero's pattern): not an extreme of either byte order
    def fast(t: torch.Tensor) -> bool:
        return any(bool((c == 0x80).any()) for c in _chunks(t.view(torch.uint8)))

    def slow(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) == 0x80

    return fast, slow


# dtype name -> (fast "holds a NaN/Inf?" test, mask of the offending elements for the error message).
# Integer and bool dtypes have no non-finite values and are absent.
_NONFINITE_RULES: dict[str, tuple[_HasBad, _BadMask]] = {
    "bfloat16": (_float_has_nonfinite, _float_nonfinite_mask),
    "float16": (_float_has_nonfinite, _float_nonfinite_mask),
    "float32": (_float_has_nonfinite, _float_nonfinite_mask),
    "float64": (_float_has_nonfinite, _float_nonfinite_mask),
    "float8_e4m3fn": _max_rule(torch.float8_e4m3fn, lambda b: (b & 0x7F) == 0x7F),
    "float8_e5m2": _max_rule(torch.float8_e5m2, lambda b: (b & 0x7F) >= 0x7C),
    "float8_e4m3fnuz": _fnuz_rule(),
    "float8_e5m2fnuz": _fnuz_rule(),
    "float8_e8m0fnu": _max_rule(torch.float8_e8m0fnu, lambda b: b == 0xFF),
}


def has_nonfinite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds a NaN/Inf (float dtypes) or a NaN/Inf bit pattern (FP8 dtypes).

    One or two reductions over the tensor as it is (any strides, any device; no temporary of its size, no upcast),
    and one host read per reduction. For naming the bad tensor and element, use :func:`check_finite`; for many
    tensors on a GPU, :class:`FiniteProbe`.

    Args:
        tensor: any :data:`~megatron_fp8.refit.wire.DTYPES` dtype (integer and bool dtypes hold no NaN/Inf).

    Raises:
        RefitError: the dtype cannot travel in a bucket.
    """
    if tensor.numel() == 0:
        return False
    rule = _NONFINITE_RULES.get(dtype_name(tensor.dtype))
    return rule is not None and rule[0](tensor.detach())


def _first_bad_index(mask_bad: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    flat = int(mask_bad.reshape(-1).nonzero()[0, 0])
    if not shape:
        return ()
    idx = []
    for dim in reversed(shape):
        idx.append(flat % dim)
        flat //= dim
    return tuple(reversed(idx))


def check_finite(name: str, tensor: torch.Tensor, *, version: int | None = None) -> None:
    """Refuse a tensor holding NaN/Inf (float dtypes) or a NaN/Inf bit pattern (FP8 dtypes).

    Args:
        name: HF name of the tensor, for the message.
        tensor: any :data:`~megatron_fp8.refit.wire.DTYPES` dtype, any device, any shape.
        version: refit version, for the message.

    Raises:
        NonFiniteError: naming the tensor, the count and the first offending index.
        RefitError: the dtype cannot travel in a bucket.
    """
    if tensor.numel() == 0:
        return
    rule = _NONFINITE_RULES.get(dtype_name(tensor.dtype, tensor_name=name))
    if rule is None:
        return
    has_bad, bad_mask = rule
    tensor = tensor.detach()
    if not has_bad(tensor):
        return
    bad = bad_mask(tensor)
    count = int(bad.sum())
    first = _first_bad_index(bad, tuple(tensor.shape))
    where = f" of version {version}" if version is not None else ""
    hint = ""
    if name.endswith(SCALE_SUFFIX) and tensor.dim() >= 2:
        hint = (
            f" (block scales: block {first[-2:]} of {name.removesuffix(SCALE_SUFFIX)!r} held NaN/Inf when it was "
            "quantized)"
        )
    raise NonFiniteError(
        f"tensor {name!r}{where} ({tensor.dtype}, shape {tuple(tensor.shape)}) holds {count} NaN/Inf value(s), "
        f"first at index {first}{hint}; refusing to refit it (the engine keeps its last good version). "
        "Find the step that produced it (loss scale, grad clipping, zero-amax blocks) before refitting again.",
        name=name,
        block=first,
    )


# ----------------------------------------------------------------------------- many tensors, one host read


class FiniteProbe:
    """A NaN/Inf test of many tensors in a handful of multi-tensor ops and no host sync until :meth:`check`.

    Float tensors are grouped by dtype and reduced with one ``torch._foreach_norm(ord=inf)`` per group (NaN
    and Inf survive the reduction); FP8 tensors with one or two ``torch._foreach_max`` over byte views per
    group (their NaN/Inf patterns are the extreme byte values, see :data:`_FP8_MAX_RULES`). On CUDA with Triton
    the contiguous ones are flagged instead by one read of each in one launch per element width
    (:func:`~megatron_fp8.refit.fused_fill.probe_many`: their NaN/Inf bit patterns). The results are
    stacked into :attr:`values` (float32, on the tensors' device) for the caller to read together with
    anything else it needs on the host. Dtypes without such a rule (the fnuz formats) and tensors on another
    device than the first are checked one by one by :meth:`check`. Integer and bool tensors need no check.

    Args:
        pairs: ``(name, tensor)``; the tensors are only read.
    """

    def __init__(self, pairs: Sequence[tuple[str, torch.Tensor]]):
        self.pairs = list(pairs)
        self._rules: list[tuple[list[int], float | None]] = []  # (tensor indices, bad-at threshold or None: finite)
        self._slow: list[int] = []
        results: list[torch.Tensor] = []
        device = next((t.device for _, t in self.pairs if t.numel()), None)
        groups: dict[torch.dtype, list[int]] = {}
        for i, (name, t) in enumerate(self.pairs):
            if t.numel() == 0 or not (t.is_floating_point() or t.dtype in _FP8_MAX_RULES):
                continue
            if t.device != device:
                self._slow.append(i)
                continue
            dtype_name(t.dtype, tensor_name=name)
            groups.setdefault(t.dtype, []).append(i)
        flagged = [i for idx in groups.values() for i in idx if self.pairs[i][1].dtype in fused_fill.PATTERNS]
        if flagged and fused_fill.runs_on([self.pairs[i][1] for i in flagged]):
            results.extend(fused_fill.probe_many([self.pairs[i][1] for i in flagged]).float().unbind())  # by pointer
            self._rules.append((flagged, 1.0))
            groups = {dt: idx for dt, idx in groups.items() if dt not in fused_fill.PATTERNS}
        for dtype, idx in groups.items():
            tensors = [self.pairs[i][1].detach() for i in idx]
            if dtype in FLOAT_DTYPES:
                results.extend(torch._foreach_norm(tensors, ord=float("inf")))
                self._rules.append((idx, None))
            elif dtype in _FP8_MAX_RULES:
                for view, bad_at in _FP8_MAX_RULES[dtype]:
                    results.extend(torch._foreach_max([t.view(view) for t in tensors]))
                    self._rules.append((idx, float(bad_at)))
            else:
                self._slow.extend(idx)
        self.values: torch.Tensor | None = torch.stack(results).float() if results else None

    def check(self, values: Sequence[float] | np.ndarray | None = None, *, version: int | None = None) -> None:
        """Raise for the first tensor (in stream order) that holds a NaN/Inf.

        Args:
            values: the host copy of :attr:`values` (default: read it here, one host sync).
            version: refit version, for the message.

        Raises:
            NonFiniteError: as :func:`check_finite`, naming the tensor, the count and the first index.
        """
        if values is None and self.values is not None:
            values = self.values.tolist()
        suspects = set(self._slow)
        at = 0
        for idx, bad_at in self._rules:
            got = np.asarray(values[at : at + len(idx)], dtype=np.float64)
            at += len(idx)
            bad = ~np.isfinite(got) if bad_at is None else got >= bad_at
            suspects.update(i for i, b in zip(idx, bad.tolist(), strict=True) if b)
        for i in sorted(suspects):  # the exact per-tensor rule decides and names the element
            name, tensor = self.pairs[i]
            check_finite(name, tensor, version=version)


class FlagProbe:
    """The NaN/Inf verdict of a :func:`~megatron_fp8.refit.fused_fill.fill_and_flag` pass, read with the bucket's
    one host read.

    Args:
        entries: the metadata record of each segment's tensor, in the order given to ``fill_and_flag``
            (``None`` for a segment that was not probed: a part, an alignment gap).
        buffer: the bucket (a flagged tensor is read back from it by its record).
        flags: ``fill_and_flag``'s result.
    """

    def __init__(self, entries: Sequence[TensorMeta | None], buffer: torch.Tensor, flags: torch.Tensor):
        self.entries = list(entries)
        self.buffer = buffer
        self.values = flags

    def check(self, host_flags: np.ndarray, *, version: int | None = None) -> None:
        """Raise for the first flagged tensor (in stream order), naming it and its first bad element.

        Raises:
            NonFiniteError: as :func:`~megatron_fp8.refit.integrity.finite.check_finite`.
        """
        for i in np.flatnonzero(np.asarray(host_flags) > 0).tolist():
            m = self.entries[i]
            if m is None:
                continue
            tensor = self.buffer[m.offset : m.offset + m.nbytes].view(DTYPES[m.dtype]).view(m.shape)
            check_finite(m.name, tensor, version=version)
            where = f" of version {version}" if version is not None else ""
            raise NonFiniteError(
                f"tensor {m.name!r}{where}: the bucket's NaN/Inf pass flagged it but it reads finite now (it changed "
                "while it was copied?); refusing to refit it",
                name=m.name,
            )
