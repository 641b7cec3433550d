"""Shared helpers for the quantizer tests: random inputs and byte comparisons.

Exposed as fixtures (``--import-mode=importlib`` keeps test folders off
``sys.path``, so sibling modules cannot be imported by name).
"""

from __future__ import annotations

import math

import pytest
import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def make_input(shape: tuple[int, ...], dtype: torch.dtype, seed: int, *, spread: bool = True) -> torch.Tensor:
    """Random test tensor: normal values with per-row magnitudes over ~12 binades.

    Some rows get tiny magnitudes (subnormal territory for float16/bfloat16 and
    below ``448 * 2**-126`` for float32) and one leading block is zeroed, so
    zero blocks, the 2**-126 scale floor and the e4m3 subnormals are all hit.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if spread and x.dim() >= 2:
        exps = torch.randint(-8, 5, (*shape[:-1], 1), generator=g).to(torch.float64)
        x = x * torch.pow(2.0, exps)
    x = x.to(dtype)
    if x.dim() >= 2 and x.shape[-2] > 3 and x.shape[-1] > 3:
        x[..., :2, :3] = 0  # a corner of the first block: partially (or wholly, for small blocks) zero
    return x


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """View a tensor's storage as bytes (fp8 -> uint8, float32 -> 4 x uint8)."""
    return t.contiguous().view(torch.uint8)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Assert bitwise equality and report the first differing index and values if not."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, b = as_bytes(actual), as_bytes(expected)
    if not torch.equal(a, b):
        diff = (
            (actual.view(torch.uint8) != expected.view(torch.uint8))
            if actual.element_size() == 1
            else (actual.to(torch.float64) != expected.to(torch.float64))
        )
        idx = tuple(int(i) for i in diff.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(diff.sum())} element(s) differ; first at {idx}: "
            f"{actual[idx].to(torch.float64).item()!r} vs {expected[idx].to(torch.float64).item()!r}"
        )


def e4m3_spacing(v: torch.Tensor) -> torch.Tensor:
    """Spacing of e4m3 values around float64 ``|v|`` (2**-9 in the subnormal range)."""
    _, exp = torch.frexp(v.abs())
    return torch.ldexp(torch.ones_like(v), torch.clamp(exp - 1, min=-6) - 3)


@pytest.fixture(scope="session")
def qhelp():
    """Namespace of the helpers above, for tests in this folder."""

    class _Helpers:
        FLOAT_DTYPES = FLOAT_DTYPES
        make_input = staticmethod(make_input)
        as_bytes = staticmethod(as_bytes)
        assert_same_bytes = staticmethod(assert_same_bytes)
        e4m3_spacing = staticmethod(e4m3_spacing)
        ceil_div = staticmethod(lambda a, b: math.ceil(a / b))

    return _Helpers
