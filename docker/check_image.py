"""Last step of the image build: import every package and check the container's invariants.

Checks (each failure is one line naming the package / variable and the remedy):

* every module in ``--modules`` imports (default: the whole stack, torch to megatron_fp8);
* exactly one ``torch`` distribution is installed and it is the one imported (vLLM did not bring a second);
* the base image's own packages (``--base-pins``, written by ``docker/pins.py freeze-base``) kept their versions;
* ``torch.version.cuda`` is at least ``--min-cuda`` (TE's blockwise FP8 GEMM needs CUDA >= 12.9);
* the environment variables FP8 needs are set (``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``, ``TORCH_CUDA_ARCH_LIST``);
* vLLM's compiled extension loads against this torch (a missing driver, ``libcuda``, is only a warning: build
  machines often have no GPU);
* the modules that need the NVIDIA driver to import (:data:`RUNTIME_MODULES`, e.g. ``deep_gemm``, which loads
  ``libcuda.so.1``) are installed; they are imported at run time by ``megatron-fp8 doctor --imports`` on a GPU node.

Prints one line per package with its version; exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import re
import sys
from pathlib import Path

DEFAULT_MODULES = (
    "torch",
    "triton",
    "transformer_engine.pytorch",
    "vllm",
    "megatron.core",
    "megatron.bridge",
    "modelopt.torch.quantization",
    "transformers",
    "megatron_fp8",
    "megatron_fp8.quant",
    "megatron_fp8.cli",
)
RUNTIME_MODULES = ("deep_gemm",)
"""Need ``libcuda.so.1`` (a driver) to import: only checked to be installed here (build machines have no driver)."""
REQUIRED_ENV: dict[str, str] = {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1", "TORCH_CUDA_ARCH_LIST": "9.0"}


def _version(module_name: str, module: object) -> str:
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    top = module_name.split(".")[0]
    dist = {"megatron": "megatron-core", "modelopt": "nvidia-modelopt", "deep_gemm": "deep-gemm"}.get(top, top)
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def check_imports(modules: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Import each module; return (report lines ``name version``, problems)."""
    report, problems = [], []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # any import-time failure is a broken image
            problems.append(f"import {name} failed: {type(exc).__name__}: {exc}")
            continue
        report.append(f"{name} {_version(name, module)}")
    return report, problems


def check_installed(modules: tuple[str, ...]) -> list[str]:
    """Each module can be found (``importlib.util.find_spec``) without importing it."""
    import importlib.util

    return [
        f"{name} is not installed (it is imported at run time by `megatron-fp8 doctor --imports`)"
        for name in modules
        if importlib.util.find_spec(name) is None
    ]


def check_single_torch() -> list[str]:
    """Exactly one distribution named torch, and the imported torch is the one it installed."""
    dists = [d for d in importlib.metadata.distributions() if (d.metadata["Name"] or "").lower() == "torch"]
    if len(dists) != 1:
        where = ", ".join(f"{d.version} at {d.locate_file('')}" for d in dists) or "none"
        return [
            f"expected exactly one torch distribution, found {len(dists)}: {where}; a package replaced or "
            "duplicated the base image's torch (install it with --no-deps)"
        ]
    import torch

    dist = dists[0]
    if dist.version.split("+")[0] != torch.__version__.split("+")[0]:
        return [f"imported torch {torch.__version__} but the installed distribution is {dist.version}"]
    return []


def check_base_pins(path: Path) -> list[str]:
    """Every ``name==version`` in ``path`` is still installed at that version."""
    problems = []
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, version = line.split("==", 1)
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"base package {name}=={version} was removed by the build")
            continue
        if installed != version:
            problems.append(
                f"base package {name} changed from {version} to {installed}: install the offending "
                "package with --no-deps or constrain it with the base pins"
            )
    return problems


def check_cuda(min_cuda: tuple[int, int]) -> list[str]:
    """torch was built with CUDA >= ``min_cuda``."""
    import torch

    cuda = torch.version.cuda
    if cuda is None:
        return ["torch has no CUDA (a CPU build replaced the base image's torch)"]
    found = tuple(int(x) for x in re.findall(r"\d+", cuda)[:2])
    if found < min_cuda:
        return [
            f"torch is built with CUDA {cuda}; blockwise FP8 (TE Float8BlockScaling) needs CUDA >= "
            f"{min_cuda[0]}.{min_cuda[1]}: use an NGC PyTorch release on CUDA 12.9 as BASE_IMAGE"
        ]
    return []


def check_env(required: dict[str, str]) -> list[str]:
    """Each variable in ``required`` is set to its value."""
    return [
        f"environment {k}={os.environ.get(k)!r}, expected {v!r} (set it with ENV in the Dockerfile)"
        for k, v in required.items()
        if os.environ.get(k) != v
    ]


def check_vllm_extension() -> tuple[list[str], list[str]]:
    """Load ``vllm._C``; return (warnings, problems)."""
    try:
        importlib.import_module("vllm._C")
    except ImportError as exc:
        if "libcuda" in str(exc):
            return [f"vllm._C not loaded here ({exc}): no NVIDIA driver on the build machine; checked at run time"], []
        return [], [f"vllm._C does not load against this torch: {exc}; rebuild vLLM after use_existing_torch.py"]
    return [], []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", default=",".join(DEFAULT_MODULES), help="comma-separated modules to import")
    parser.add_argument("--base-pins", type=Path, default=None, help="NAME==VERSION file from pins.py freeze-base")
    parser.add_argument("--min-cuda", default="12.9", help="minimum CUDA version of torch; 'none' skips the check")
    parser.add_argument("--no-env-check", action="store_true", help="skip the required environment variables")
    parser.add_argument("--no-vllm-extension", action="store_true", help="skip loading vllm._C")
    parser.add_argument(
        "--runtime-modules",
        default=",".join(RUNTIME_MODULES),
        help="comma-separated modules that need a driver to import: checked to be installed, not imported",
    )
    args = parser.parse_args(argv)

    modules = tuple(m.strip() for m in args.modules.split(",") if m.strip())
    report, problems = check_imports(modules)
    problems += check_installed(tuple(m.strip() for m in args.runtime_modules.split(",") if m.strip()))
    warnings: list[str] = []
    if "torch" in modules:
        problems += check_single_torch()
        if args.min_cuda != "none":
            major, minor = (int(x) for x in args.min_cuda.split("."))
            problems += check_cuda((major, minor))
    if args.base_pins is not None:
        problems += check_base_pins(args.base_pins)
    if not args.no_env_check:
        problems += check_env(REQUIRED_ENV)
    if not args.no_vllm_extension:
        w, p = check_vllm_extension()
        warnings += w
        problems += p
    for line in report:
        print(f"image: {line}")
    for line in warnings:
        print(f"image: warning: {line}")
    for line in problems:
        print(f"image: FAILED: {line}", file=sys.stderr)
    print(f"image: {'FAILED' if problems else 'ok'} ({len(report)}/{len(modules)} modules imported)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
