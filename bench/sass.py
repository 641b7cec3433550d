"""Static SASS of the refit's Triton kernels for Hopper (sm_90), compiled here: no GPU needed.

What a kernel costs per element is decided by the compiler before any GPU runs it: the instructions it emits, the
registers each thread holds (and so how many programs share an SM), and whether it spills. This script compiles
the refit's hot kernels for ``sm_90`` with this machine's Triton and its bundled ``ptxas``, exactly as a launch
specializes them (the JIT's own binder: 16-byte aligned pointers, constexprs), reads the cubin back with the
bundled ``cuobjdump`` and writes, per kernel and setting:

* ``registers``, ``stack_bytes`` and ``spill_instructions`` (``LDL``/``STL``), ``shared_bytes`` (static and the
  dynamic shared memory Triton launches the kernel with);
* the SM's theoretical occupancy from them (H100/H200: 65,536 registers, 64 warps, 32 programs per SM; registers
  allocated per warp in units of 256);
* ``instructions`` (static: every instruction of the kernel, also those of a branch a launch never takes, e.g. the
  quantizer's per-element division for tiles with a scale under 2**-90, and a loop's body once however often it
  runs, as in the quantizer's ``chunks`` variants), by opcode and by class, and per element of the program's tile
  per thread. Compare instruction counts between variants of one division and one ``chunks`` only.

The quantizer variants are ``bench/quant.py``'s ``LEAN_VARIANTS`` (the options it times on a GPU), at 4, 8 and 16
warps, as the refit launches them into a bucket (bfloat16 in, e4m3 codes and float32 scales out, one NaN/Inf flag
per weight); then the fused fill of a bucket's 2-byte tensors and the checksum.

Compare figures of one Triton version only: the lent Hopper machines run Triton 3.6, this project's venv 3.9
(``bench/gpu_run.sh`` runs this script there too, next to the timings). Nothing here is a timing.

Usage::

    python bench/sass.py [--out bench/results/sass_sm90.json] [--smoke]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger("bench.sass")

ARCH = 90
WARPS = (4, 8, 16)


@dataclasses.dataclass(frozen=True)
class SmLimits:
    """Per-SM limits that bound occupancy (Hopper, compute capability 9.0).

    Attributes:
        registers: 32-bit registers per SM.
        warps: resident warps per SM.
        programs: resident thread blocks (Triton programs) per SM.
        shared_bytes: shared memory per SM usable by blocks, bytes.
        register_unit: registers are allocated per warp in multiples of this many.
    """

    registers: int = 65536
    warps: int = 64
    programs: int = 32
    shared_bytes: int = 228 * 1024
    register_unit: int = 256


HOPPER = SmLimits()


def occupancy(*, registers: int, num_warps: int, shared_bytes: int = 0, limits: SmLimits = HOPPER) -> dict:
    """Theoretical occupancy of a kernel on one SM.

    Args:
        registers: registers per thread (as ``cuobjdump -res-usage`` reports them).
        num_warps: warps per program.
        shared_bytes: shared memory per program, bytes.
        limits: the SM's limits.

    Returns:
        ``{"programs_per_sm", "warps_per_sm", "occupancy", "limited_by"}`` (occupancy: resident warps / the SM's
        maximum, 0..1; ``limited_by``: ``registers``, ``warps``, ``programs`` or ``shared``).
    """
    per_warp = -(-registers * 32 // limits.register_unit) * limits.register_unit
    bounds = {
        "warps": limits.warps // num_warps,
        "programs": limits.programs,
        "shared": limits.shared_bytes // shared_bytes if shared_bytes else limits.programs,
        "registers": (limits.registers // per_warp) // num_warps if per_warp else limits.programs,
    }
    limited_by = min(bounds, key=bounds.__getitem__)  # on a tie the first: the SM's fixed limits before registers
    programs = bounds[limited_by]
    return {
        "programs_per_sm": programs,
        "warps_per_sm": programs * num_warps,
        "occupancy": programs * num_warps / limits.warps,
        "limited_by": limited_by,
    }


_CLASSES: dict[str, tuple[str, ...]] = {
    "memory": tuple("LDG STG LDS STS LDL STL LD ST ATOM ATOMG ATOMS RED LDC LDSM".split()),
    "float": tuple(
        "FFMA FMUL FADD FMNMX FSETP FSEL FSET MUFU FCHK F2F F2FP F2I I2F I2FP FRND HADD2 HFMA2 HMUL2 HMNMX2 HSETP2 "
        "DADD DMUL DFMA".split()
    ),
    "integer": tuple(
        "IMAD IADD3 IADD LOP3 SHF SHL SHR ISETP LEA PRMT IABS IMNMX SEL VIMNMX VIMNMX3 POPC FLO BMSK SGXT IMUL LOP "
        "PLOP3 P2R R2P REDUX VIADD".split()
    ),
    "control": tuple(
        "BRA BRX JMP BSSY BSYNC CALL RET EXIT BAR WARPSYNC NOP YIELD BPT VOTE VOTEU MEMBAR DEPBAR ERRBAR CCTL".split()
    ),
    "move": tuple("MOV S2R S2UR CS2R SHFL R2UR MOV32I UMOV ULDC".split()),
}
_CLASS_OF = {op: cls for cls, ops in _CLASSES.items() for op in ops}
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_RESOURCES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def tool(name: str) -> Path:
    """A CUDA binary Triton bundles (``ptxas``, ``cuobjdump``) for this platform."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: Triton's bundled {name} is missing (a Triton wheel for Linux x86-64 has it)")
    return path


def sass_stats(cubin: bytes) -> dict:
    """Static figures of a cubin's one kernel: instructions (total, by opcode, by class) and resources.

    Args:
        cubin: the compiled kernel (``CompiledKernel.asm["cubin"]``).

    Returns:
        ``{"instructions", "by_opcode", "by_class", "registers", "stack_bytes", "shared_bytes", "local_bytes",
        "spill_instructions"}``; an opcode is its mnemonic without modifiers (``LDG.E.128`` -> ``LDG``).
    """
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True)
    ops: collections.Counter[str] = collections.Counter()
    wide_loads = 0
    for line in sass.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            ops[m.group(1)] += 1
            wide_loads += "LDG.E.128" in line or "LDG.E.ENL2.256" in line
    found = _RESOURCES.search(res.stdout)
    if found is None or not ops:
        raise RuntimeError(f"cuobjdump read nothing of the cubin: {res.stdout[:300]!r}")
    registers, stack, shared, local = (int(v) for v in found.groups())
    by_class: collections.Counter[str] = collections.Counter()
    for op, n in ops.items():
        by_class[_CLASS_OF.get(op, "uniform" if op.startswith("U") else "other")] += n
    return {
        "instructions": sum(ops.values()),
        "by_opcode": dict(ops.most_common()),
        "by_class": dict(by_class.most_common()),
        "wide_loads": wide_loads,
        "registers": registers,
        "stack_bytes": stack,
        "shared_bytes": shared,
        "local_bytes": local,
        "spill_instructions": ops["LDL"] + ops["STL"],
    }


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel at one setting, compiled as a launch with these arguments would compile it.

    Attributes:
        name: row name, e.g. ``quantizer lean_amax_bits``.
        kernel: returns the ``triton.jit`` function.
        args: returns the launch's positional arguments (CPU tensors stand in for device ones: only their dtype and
            16-byte alignment matter to the compiler).
        constexprs: the launch's keyword constexprs.
        num_warps: warps per program.
        elements: elements one program handles (for the per-element figure).
        element: what an element is (e.g. ``bfloat16 input``).
    """

    name: str
    kernel: Callable[[], object]
    args: Callable[[], tuple]
    constexprs: dict
    num_warps: int
    elements: int
    element: str


def specialize(fn, args: tuple, kwargs: dict, backend) -> tuple[dict, dict, dict, object]:
    """What the JIT derives from one launch's arguments: ``(signature, constexprs, attrs, options)``.

    Uses the kernel's own binder (``triton.runtime.jit.create_function_from_signature``), so pointer alignment
    (``tt.divisibility``) and integer specializations are the launch's; flat (non-tuple) arguments only.
    """
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, _ = binder(*args, **kwargs)
    options = backend.parse_options(kwargs)
    names = [p.name for p in fn.params]
    values = list(bound.values())
    signature = {n: s[0] for n, s in zip(names, spec, strict=True)}
    constexprs = {(i,): values[i] for i, s in enumerate(spec) if s[0] == "constexpr"}
    attr_values = ["" if s[0] == "constexpr" else s[1] for s in spec]
    attrs = {(i,): backend.parse_attr(v) for i, v in enumerate(attr_values) if isinstance(v, str)}
    return signature, constexprs, attrs, options


def compile_case(case: Case, *, arch: int = ARCH):
    """Compile ``case`` for ``sm_<arch>`` (no device touched); the ``CompiledKernel``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    fn = case.kernel()
    kwargs = {**case.constexprs, "num_warps": case.num_warps}
    signature, constexprs, attrs, options = specialize(fn, case.args(), kwargs, backend)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def measure(case: Case, *, arch: int = ARCH) -> dict:
    """Compile one case and read its SASS: :func:`sass_stats` plus occupancy and the per-element figure."""
    start = time.perf_counter()
    compiled = compile_case(case, arch=arch)
    stats = sass_stats(compiled.asm["cubin"])
    stats["shared_bytes"] += int(getattr(compiled.metadata, "shared", 0) or 0)  # Triton's dynamic shared memory
    threads = case.num_warps * 32
    return {
        "name": case.name,
        "num_warps": case.num_warps,
        "constexprs": {k: v for k, v in case.constexprs.items()},
        **stats,
        **occupancy(registers=stats["registers"], num_warps=case.num_warps, shared_bytes=stats["shared_bytes"]),
        "instructions_per_element": stats["instructions"] * threads / case.elements,
        "element": case.element,
        "compile_s": time.perf_counter() - start,
    }


def _aligned(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)  # CPU allocations are 64-byte aligned: what a bucket's views are


def _quant_bench():
    """``bench/quant.py`` as a module (its ``LEAN_VARIANTS`` and ``normalized``), imported from this folder."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import quant
    finally:
        sys.path.remove(str(Path(__file__).parent))
    return quant


def quantizer_cases(*, warps: tuple[int, ...] = WARPS, variants: dict | None = None, w_p2: int = 32) -> list[Case]:
    """The refit's grouped quantizer (``launch_into_bucket``) under each variant's options, per warp count.

    ``variants``: name -> ``_launch_table`` options (default: ``bench/quant.py``'s ``LEAN_VARIANTS`` built on the
    refit's lean setting, i.e. those that name a division); ``w_p2``: the table's padded item count (32: an 8B FP8
    bucket's ~25 weights).
    """
    from megatron_fp8.quant import triton_grouped as tg

    quant = _quant_bench()
    if variants is None:
        variants = {k: v for k, v in quant.LEAN_VARIANTS.items() if "division" in v}

    def args() -> tuple:
        return (
            _aligned(w_p2 + 7 * 4, torch.int64),
            _aligned(4096, torch.bfloat16),
            _aligned(4096, torch.float8_e4m3fn),
            _aligned(64, torch.float32),
            _aligned(64, torch.int32),
        )

    cases = []
    for name, options in variants.items():
        o = quant.normalized(options)
        constexprs = {
            "W_P2": w_p2, "ROW": tg._ROW, "BN": 128, "BK": 128, "BN_P2": 128, "BK_P2": 128, "UE8M0": False,
            "FP8_OUT": True, "ALIGNED": True, "X_UNIT": 8, "Q_UNIT": 16, "FLAGS": True,
            "RECIP": tg._DIVISIONS[o["division"]], "CLAMP": o["clamp"], "AMAX_BITS": o["amax_bits"],
            "WHOLE": o["unmasked"], "CHUNKS": o["chunks"],
        }  # fmt: skip
        for nw in warps:
            cases.append(Case(f"quantizer {name}", tg._grouped_kernel, args, constexprs, nw, 128 * 128,
                              "bfloat16 input"))  # fmt: skip
    return cases


def fill_case(*, num_warps: int = 4, w_p2: int = 32) -> Case:
    """The fused fill of a bucket's 2-byte tensors (16-byte aligned: the ``ALIGNED`` launch), copy mode."""
    from megatron_fp8.refit import fused_fill as ff

    def args() -> tuple:
        return (_aligned(w_p2 + 6 * 4, torch.int64), _aligned(4096, torch.int16), _aligned(4096, torch.int16),
                _aligned(64, torch.int32))  # fmt: skip

    constexprs = {"W_P2": w_p2, "ROW": ff._ROW, "BLOCK": ff._CHUNK_BYTES // 2, "ALIGNED": True, "VEC": 8,
                  "MODE": ff._COPY}  # fmt: skip
    return Case("fill 2-byte", lambda: ff._fill_kernel, args, constexprs, num_warps, ff._CHUNK_BYTES // 2,
                "2-byte word copied")  # fmt: skip


def checksum_case() -> Case:
    """The bucket checksum's per-block partials (one program per 64 KiB block)."""
    from megatron_fp8.refit.integrity import checksum, kernels

    def args() -> tuple:
        return (_aligned(4096, torch.int32), _aligned(64, torch.int64), _aligned(64, torch.int64), 1 << 20)

    constexprs = {"BLOCK": checksum.BLOCK_WORDS, "TILE": kernels._TILE}
    return Case("checksum", lambda: kernels._checksum_blocks_kernel, args, constexprs, 8, checksum.BLOCK_WORDS,
                "4-byte word read")  # fmt: skip


def _table(rows: list[dict]) -> str:
    head = ("kernel", "warps", "regs", "spills", "programs/SM", "occupancy", "instructions", "per element")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']} | {r['num_warps']} | failed: {r['error']}")
            continue
        lines.append(
            f"{r['name']} | {r['num_warps']} | {r['registers']} | {r['spill_instructions']} | {r['programs_per_sm']} | "
            f"{r['occupancy']:.0%} | {r['instructions']} | {r['instructions_per_element']:.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/sass_sm90.json"), help="JSON output path")
    p.add_argument("--smoke", action="store_true", help="the refit's quantizer setting at 8 warps, fill, checksum")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import triton

    from megatron_fp8.quant import triton_grouped as tg

    if args.smoke:
        lean = {"lean": _quant_bench().LEAN_VARIANTS["lean"]}
        cases = quantizer_cases(warps=(tg.INTO_BUCKET_NUM_WARPS,), variants=lean)
    else:
        cases = quantizer_cases()
    cases += [fill_case(), checksum_case()]
    rows = []
    for i, case in enumerate(cases, 1):
        try:
            rows.append(measure(case))
        except Exception as exc:  # a variant that does not compile is reported; the others still run
            rows.append({"name": case.name, "num_warps": case.num_warps, "error": f"{type(exc).__name__}: {exc}"[:300]})
        logger.info("[%d/%d] %s, %d warps", i, len(cases), case.name, case.num_warps)
    ptxas = subprocess.run([tool("ptxas"), "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    result = {
        "what": f"static SASS for sm_{ARCH}, compiled on this machine (no GPU); not timings",
        "arch": f"sm_{ARCH}",
        "triton": triton.__version__,
        "ptxas": ptxas[-1] if ptxas else "",
        "torch": torch.__version__,
        "refit_setting": {
            "chunks": tg.INTO_BUCKET_CHUNKS,
            "division": tg.INTO_BUCKET_DIVISION,
            "num_warps": tg.INTO_BUCKET_NUM_WARPS,
            "amax_bits": tg.INTO_BUCKET_AMAX_BITS,
            "unmasked": tg.INTO_BUCKET_UNMASKED,
        },
        "kernels": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(_table(rows))
    print(f"Triton {triton.__version__}; static counts (cold branches included); wrote {args.out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
