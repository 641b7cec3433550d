"""The single-tensor NaN/Inf rule (:func:`has_nonfinite`, :func:`check_finite`): every bit pattern, any layout.

The rule reads a tensor as it is (float: one ``aminmax``; FP8: one ``max`` per byte order), never writing a
temporary of its size: an engine runs it over a whole host-staged version on a CPU (``bench/engine_checks.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_fp8.errors import NonFiniteError
from megatron_fp8.refit.integrity.finite import check_finite, has_nonfinite

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _every_pattern(dtype: torch.dtype) -> torch.Tensor:
    bits = torch.arange(1 << (8 * torch.empty(0, dtype=dtype).element_size()), dtype=torch.int64)
    if dtype.itemsize == 1:
        return bits.to(torch.uint8).view(dtype)
    return bits.to(torch.int32).to(torch.int16).view(dtype)  # 0..65535 wrap to the int16 patterns


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, *FP8], ids=str)
def test_every_bit_pattern_is_judged_as_its_value(dtype):
    values = _every_pattern(dtype)
    want = (~torch.isfinite(values.float())).tolist()
    assert sum(want) > 0
    got = [has_nonfinite(v) for v in values]  # each pattern alone, as a 0-d tensor
    assert got == want, [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b][:10]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_random_wide_float_patterns_are_judged_as_their_values(dtype):
    g = torch.Generator().manual_seed(1)
    idt = torch.int32 if dtype == torch.float32 else torch.int64
    lo, hi = torch.iinfo(idt).min, torch.iinfo(idt).max
    for _ in range(300):
        bits = torch.randint(lo, hi, (8,), generator=g, dtype=torch.int64).to(idt)
        bits[0] = torch.tensor(0x7F80_0000 if dtype == torch.float32 else 0x7FF0_0000_0000_0000).to(idt)  # +Inf
        bits[0] ^= torch.randint(0, 2, (), generator=g).to(idt) * 7  # or a NaN next to it
        keep = torch.randint(0, 2, (), generator=g).item()
        values = bits.view(dtype)[keep:]  # with or without the special value
        assert has_nonfinite(values) == bool((~torch.isfinite(values)).any())
    for special in (float("inf"), -float("inf"), float("nan"), -float("nan")):
        assert has_nonfinite(torch.tensor([1.0, special, -3.0], dtype=dtype))
    assert not has_nonfinite(torch.tensor([torch.finfo(dtype).max, torch.finfo(dtype).min, -0.0], dtype=dtype))


def _bad_value(dtype: torch.dtype) -> list[torch.Tensor]:
    if dtype in (torch.float8_e4m3fn,):
        return [torch.tensor(b, dtype=torch.uint8).view(dtype) for b in (0x7F, 0xFF)]
    if dtype == torch.float8_e8m0fnu:
        return [torch.tensor(0xFF, dtype=torch.uint8).view(dtype)]
    return [torch.tensor(v).to(dtype) for v in (float("inf"), -float("inf"), float("nan"))]


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e8m0fnu], ids=str
)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_one_bad_element_anywhere_in_any_layout_is_found(dtype, layout):
    g = torch.Generator().manual_seed(2)
    base = (torch.rand(300, 260, generator=g) + 0.5).to(dtype)  # finite, positive (e8m0 holds no zero)
    view = {"contiguous": base, "transposed": base.t(), "strided": base[::3, 1::2]}[layout]
    assert not has_nonfinite(view)
    rows, cols = view.shape
    for bad in _bad_value(dtype):
        for r, c in ((0, 0), (rows // 2, cols // 3), (rows - 1, cols - 1)):
            old = view[r, c].clone()
            view[r, c] = bad
            assert has_nonfinite(view), (r, c)
            with pytest.raises(NonFiniteError, match=rf"first at index \({r}, {c}\)"):
                check_finite("w", view)
            view[r, c] = old
    assert not has_nonfinite(view)


class _Outputs(TorchDispatchMode):
    """Records every op's name and the element count of the largest tensor it returns."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        sizes = [t.numel() for t in flat if isinstance(t, torch.Tensor) and not func.is_view]  # views write nothing
        self.ops.append((func._schema.name.removeprefix("aten::"), max(sizes, default=0)))
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e8m0fnu], ids=str)
def test_the_rule_writes_no_temporary_of_the_tensors_size(dtype):
    """Only reductions read the tensor (aminmax / max); every op returns at most 2 elements. An ``abs``, an
    ``isfinite`` or a bitwise ``&`` over the whole tensor (what the rule did) would return 262,144."""
    g = torch.Generator().manual_seed(3)
    if dtype.itemsize == 1:
        t = torch.randint(1, 0x7E, (512, 512), generator=g, dtype=torch.uint8).view(dtype)
    else:
        t = torch.randn(512, 512, generator=g).to(dtype)
    with _Outputs() as rec:
        assert not has_nonfinite(t)
    assert rec.ops and max(n for _, n in rec.ops) <= 2, rec.ops
    reductions = [name for name, _ in rec.ops if name in ("aminmax", "max")]
    assert reductions == (
        ["aminmax"]
        if dtype.is_floating_point and dtype.itemsize > 1
        else ["max"] * (2 if dtype == torch.float8_e4m3fn else 1)
    ), rec.ops


def test_integers_and_empty_tensors_hold_no_nonfinite_value():
    assert not has_nonfinite(torch.full((4,), -1, dtype=torch.int32))
    assert not has_nonfinite(torch.empty(0, dtype=torch.bfloat16))
    assert not has_nonfinite(torch.ones(3, dtype=torch.bool))
