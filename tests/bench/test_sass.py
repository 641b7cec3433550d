"""bench/sass.py: the refit's Triton kernels compiled for sm_90 on this CPU machine (Triton's bundled ptxas and
cuobjdump), specialized as a launch specializes them, and read back as static SASS figures."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def sass(bench_module):
    return bench_module("sass")


def test_occupancy_follows_the_register_file(sass) -> None:
    # 58 registers at 16 warps: what ncu reported for the quantizer (docs/gpu.md): two programs, half the warps
    assert sass.occupancy(registers=58, num_warps=16) == {
        "programs_per_sm": 2, "warps_per_sm": 32, "occupancy": 0.5, "limited_by": "registers"
    }  # fmt: skip
    # 106 registers at 8 warps: 112 per thread allocated (units of 256 per warp), 18 warps fit: two programs
    assert sass.occupancy(registers=106, num_warps=8)["programs_per_sm"] == 2
    assert sass.occupancy(registers=80, num_warps=8)["programs_per_sm"] == 3
    # few registers: the warp limit (64 per SM), then the program limit (32)
    assert sass.occupancy(registers=32, num_warps=8)["limited_by"] == "warps"
    assert sass.occupancy(registers=16, num_warps=1) == {
        "programs_per_sm": 32, "warps_per_sm": 32, "occupancy": 0.5, "limited_by": "programs"
    }  # fmt: skip
    assert sass.occupancy(registers=32, num_warps=4, shared_bytes=100 * 1024)["limited_by"] == "shared"


def test_the_specialization_is_the_launchs(sass) -> None:
    """The JIT's own argument handling where this Triton has it (3.9's ``_pack_args``): the same signature,
    constexprs and pointer-alignment attributes as a launch with these arguments."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    case = sass.quantizer_cases(warps=(8,), variants={"lean": {"clamp": False, "division": "reciprocal_noselect"}})[0]
    fn, backend = case.kernel(), make_backend(GPUTarget("cuda", 90, 32))
    kwargs = {**case.constexprs, "num_warps": 8}
    ours = sass.specialize(fn, case.args(), kwargs, backend)
    assert all(ours[2][(i,)] == [["tt.divisibility", 16]] for i in range(5))  # the five 16-byte aligned pointers
    assert hasattr(fn, "_pack_args"), "the pinned Triton's JIT packs a launch's arguments in _pack_args"
    bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(*case.args(), **kwargs)
    signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)[1:]
    assert (ours[0], ours[1], ours[2]) == (signature, constexprs, attrs)


def test_the_quantizer_compiles_with_wide_loads_and_no_spills(sass, tmp_path) -> None:
    """The smoke run: the refit's quantizer setting, the fill and the checksum. The bfloat16 tile is read with
    16-byte loads (the launch's alignment reached the compiler) and nothing spills; a division compiled per element
    shows as its slow-path calls, which ``reciprocal_only`` does not have."""
    out = tmp_path / "sass.json"
    assert sass.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["arch"] == "sm_90" and result["refit_setting"]["division"] == "reciprocal_noselect"
    rows = {r["name"]: r for r in result["kernels"]}
    assert set(rows) == {"quantizer lean", "fill 2-byte", "checksum"}
    for r in rows.values():
        assert 0 < r["registers"] <= 255 and r["spill_instructions"] == 0 and r["instructions"] > 100, r["name"]
        assert 0 < r["occupancy"] <= 1 and r["wide_loads"] > 0, r["name"]
    lean = rows["quantizer lean"]
    only = sass.measure(sass.quantizer_cases(warps=(8,), variants={"only": {
        "clamp": False, "division": "reciprocal_only"}})[0])  # fmt: skip
    assert lean["by_opcode"].get("CALL", 0) >= 64 > only["by_opcode"].get("CALL", 0)  # one per element of a thread
    assert only["instructions"] < 0.8 * lean["instructions"], (only["instructions"], lean["instructions"])
