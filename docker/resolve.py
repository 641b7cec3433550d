"""Resolve the image's pip requirement set for Python 3.12 manylinux x86_64 without Docker (pip's own resolver).

The image (docker/Dockerfile.ngc_pytorch) installs vLLM, DeepGEMM and the Megatron stack with ``--no-deps``, then
their dependencies minus :data:`pins.EXCLUDED` plus docker/requirements-container.txt in ONE pip call under
docker/constraints-container.txt and the base image's frozen pins. This script builds that same requirement set
from the packages' published metadata and asks pip to resolve it for the image's interpreter and platform:

1. ``pip install --dry-run --no-deps --report`` of the ``--no-deps`` packages (pinned by the container pins) gives
   their ``Requires-Dist``; :func:`pins.requirement_set` turns them into the requirement list for Python 3.12 on
   Linux x86_64, exactly as ``pins.py runtime-deps`` does inside the image;
2. the base image's own packages (docker/base-ngc-pytorch.txt) are made available as metadata-only wheels with the
   base's exact (NGC, pre-release) versions and constrained to them, so a requirement such as ``torch>=2.8`` that
   NGC's ``2.8.0a0+...`` does not satisfy fails here as it fails in the image;
3. ``pip install --dry-run --report`` resolves everything together; a conflict is a non-zero exit and pip's
   "ResolutionImpossible" explanation.

Only the metadata of each candidate is fetched (PEP 658), never the wheels. Not covered: DeepGEMM (built from
source, not on an index; its metadata declares only torch), and vLLM's own build (the PyPI vllm 0.11.0 wheel's
metadata stands in for the source build's, which ``use_existing_torch.py`` changes only in its torch lines).

A resolution asks the index for minutes, and its answer depends only on its inputs (the three pin files, the
subset, the interpreter and platform tags) and on what the index publishes: it is kept in the user cache
(``$XDG_CACHE_HOME/megatron-fp8/resolve``, else ``~/.cache/...``), keyed by the SHA-256 of those inputs, so only a
changed pin asks the index again (``--no-cache`` or ``MFP8_RESOLVE_CACHE=0`` asks anyway).

Usage::

    python docker/resolve.py                      # exit 0 and the resolved set, or 1 and pip's conflict report
    python docker/resolve.py --container-pins F --requirements R --base B --report out.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
logger = logging.getLogger("resolve")


def _load_pins():
    spec = importlib.util.spec_from_file_location("mfp8_docker_pins_for_resolve", HERE / "pins.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


pins = _load_pins()

PYTHON_VERSION = "3.12"
"""The image's interpreter (NGC PyTorch 25.05/25.06: Python 3.12 on Ubuntu 24.04, glibc 2.39)."""

GLIBC_MINOR = 39
PLATFORMS: tuple[str, ...] = (
    *(f"manylinux_2_{m}_x86_64" for m in range(GLIBC_MINOR, 4, -1)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
)
"""Every wheel platform tag glibc 2.39 on x86_64 accepts (older pips do not expand ``manylinux_2_39`` themselves)."""

MARKER_ENVIRONMENT: dict[str, str] = {
    "python_version": PYTHON_VERSION,
    "python_full_version": f"{PYTHON_VERSION}.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
"""Environment markers of the image, for evaluating ``Requires-Dist`` markers from another interpreter."""

SDIST_ONLY: dict[str, str] = {"antlr4-python3-runtime": "4.9.3"}
"""Pure-Python, dependency-free packages published as sdists only (omegaconf 2.3 pins ``antlr4-python3-runtime==4.9.*``):
pip cannot read an sdist's metadata for another platform, so each is stood in by a metadata-only wheel of the
version the image installs. Extend when pip reports "No matching distribution" for an sdist-only package."""

SUBSET = frozenset(
    {"transformers", "datasets", "huggingface-hub", "setuptools", "tokenizers", "omegaconf", "hydra-core", "six"}
    | {"rich", "tqdm", "safetensors", "pyyaml", "regex", "packaging", "pydantic", "numpy", "accelerate"}
)
"""The representative subset CI resolves on every run (``--subset``): every requirement on the Hugging Face stack
and on setuptools (the two conflicts vLLM 0.11 brought), the Megatron configuration packages, and torch users
(accelerate) against the base's pre-release torch. The full set (ray, cupy, opencv, ...) fetches much more
metadata: ``python docker/resolve.py`` without ``--subset`` (several minutes)."""

DEFAULT_BASE = HERE / "base-ngc-pytorch.txt"
DEFAULT_REQUIREMENTS = HERE / "requirements-container.txt"


@dataclass(frozen=True)
class Resolution:
    """Outcome of one resolution.

    Attributes:
        ok: pip found one set of versions satisfying every requirement and constraint.
        installed: normalized name -> version pip would install (empty when not ``ok``).
        requirements: the requirement list that was resolved.
        log: pip's stderr (the conflict explanation when not ``ok``).
    """

    ok: bool
    installed: dict[str, str]
    requirements: tuple[str, ...]
    log: str


def _pip_base_args(target: Path) -> list[str]:
    args = [sys.executable, "-m", "pip", "install", "--dry-run", "--target", str(target), "--quiet"]
    args += ["--python-version", PYTHON_VERSION, "--only-binary=:all:", "--disable-pip-version-check"]
    args += ["--use-feature=fast-deps"]  # wheel metadata by HTTP range requests where PyPI has no PEP 658 file
    for platform_tag in PLATFORMS:
        args += ["--platform", platform_tag]
    return args


def _pip_env() -> dict[str, str]:
    # this run's constraints only (no PIP_CONSTRAINT from the caller's environment)
    return {**os.environ, "PIP_CONSTRAINT": "", "PIP_NO_INPUT": "1"}


def fake_wheel(directory: Path, name: str, version: str) -> Path:
    """A metadata-only, dependency-free wheel ``name==version``: stands for a package the base image owns."""
    dist = name.replace("-", "_")
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: megatron-fp8\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")
    return path


def parse_base(path: Path) -> dict[str, tuple[str, bool]]:
    """``docker/base-ngc-pytorch.txt``: name -> (version, stand-in). ``# ngc`` marks NGC builds not on PyPI."""
    out: dict[str, tuple[str, bool]] = {}
    for raw in path.read_text().splitlines():
        line, _, comment = raw.partition("#")
        if not line.strip():
            continue
        name, version = (x.strip() for x in line.split("==", 1))
        out[pins.normalize(name)] = (version, "ngc" in comment.split())
    return out


def fetch_requires(dists: dict[str, str], workdir: Path) -> dict[str, list[str]]:
    """``Requires-Dist`` of each ``name==version`` in ``dists``, from the index (metadata only).

    Raises:
        RuntimeError: pip could not find one of them (its message included).
    """
    report = workdir / "no-deps-report.json"
    args = _pip_base_args(workdir / "target") + ["--no-deps", "--report", str(report)]
    args += [f"{name}=={version}" for name, version in dists.items()]
    proc = subprocess.run(args, capture_output=True, text=True, env=_pip_env(), timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"pip could not fetch the metadata of {sorted(dists)}:\n{proc.stderr[-3000:]}")
    data = json.loads(report.read_text())
    return {
        pins.normalize(i["metadata"]["name"]): list(i["metadata"].get("requires_dist") or []) for i in data["install"]
    }


def build_requirements(container_pins: Path, requirements: Path, workdir: Path) -> list[str]:
    """The one requirement list the image resolves: runtime deps of the ``--no-deps`` packages + the named ones."""
    pinned = pins.parse_container_pins(container_pins).pins
    # deep-gemm is built from source (not on an index, not pinned): its metadata declares only torch
    dists = {d: pinned[d].version for d in pins.NO_DEPS_DISTS if d in pinned}
    requires = fetch_requires(dists, workdir)
    deps = pins.requirement_set(requires, exclude=set(pins.EXCLUDED), environment=MARKER_ENVIRONMENT)
    named = [ln.split("#")[0].strip() for ln in requirements.read_text().splitlines()]
    return deps + [n for n in named if n and n not in deps]


CACHE_VERSION = 1
"""Bump when :class:`Resolution` or the way it is computed changes: older cache entries are then not read."""


def default_cache_dir() -> Path | None:
    """Where resolutions are kept: ``$XDG_CACHE_HOME/megatron-fp8/resolve`` (``None`` when ``MFP8_RESOLVE_CACHE=0``)."""
    if os.environ.get("MFP8_RESOLVE_CACHE", "1") == "0":
        return None
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "megatron-fp8" / "resolve"


def cache_key(*, container_pins: Path, requirements: Path, base: Path, only: frozenset[str] | None) -> str:
    """SHA-256 (hex) of everything a resolution depends on but the index: the files' bytes, subset, tags."""
    h = hashlib.sha256()
    parts = [f"v{CACHE_VERSION}", PYTHON_VERSION, *PLATFORMS, json.dumps(SDIST_ONLY, sort_keys=True)]
    parts.append(json.dumps(sorted(only)) if only is not None else "all")
    for part in parts:
        h.update(part.encode() + b"\0")
    for path in (container_pins, requirements, base):
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def _cached(path: Path | None) -> Resolution | None:
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return Resolution(
            ok=bool(data["ok"]),
            installed=dict(data["installed"]),
            requirements=tuple(data["requirements"]),
            log=str(data["log"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        logger.warning("ignoring an unreadable cached resolution %s", path)
        return None


def _store(path: Path | None, res: Resolution) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(
            json.dumps(
                {"ok": res.ok, "installed": res.installed, "requirements": list(res.requirements), "log": res.log}
            )
        )
        tmp.replace(path)  # atomic: a concurrent reader sees the old entry or the whole new one
    except OSError as exc:
        logger.warning("could not keep the resolution in %s (%s); the next run asks the index again", path, exc)


def resolve(
    *,
    container_pins: Path = pins.CONTAINER_CONSTRAINTS,
    requirements: Path = DEFAULT_REQUIREMENTS,
    base: Path = DEFAULT_BASE,
    report: Path | None = None,
    only: frozenset[str] | None = None,
    cache_dir: Path | None | str = "default",
) -> Resolution:
    """Resolve the image's requirement set (see the module docstring); never raises for a conflict.

    Args:
        container_pins: the container pins (a modified copy to test a change).
        requirements: the names installed on top (docker/requirements-container.txt).
        base: the base image's packages (docker/base-ngc-pytorch.txt).
        report: JSON file for the requirement list and the resolved versions.
        only: resolve only the requirements with these normalized names (and what they pull in): the
            representative subset of :data:`SUBSET` keeps CI fast; ``None`` resolves everything.
        cache_dir: where resolutions are kept by :func:`cache_key` (``"default"``: :func:`default_cache_dir`;
            ``None``: always ask the index, keep nothing). A pip failure that is not a conflict (no network, a
            timeout) is never kept.
    """
    directory = default_cache_dir() if cache_dir == "default" else cache_dir
    entry = None
    if directory is not None:
        key = cache_key(container_pins=container_pins, requirements=requirements, base=base, only=only)
        entry = Path(directory) / f"{key}.json"
    res = _cached(entry)
    if res is not None:
        logger.info("resolution of these pins from the cache (%s)", entry)
    else:
        res = _resolve(container_pins=container_pins, requirements=requirements, base=base, only=only)
        if res.ok or "ResolutionImpossible" in res.log or "conflict" in res.log.lower():
            _store(entry, res)
    if report is not None and res.ok:
        report.write_text(
            json.dumps({"requirements": list(res.requirements), "installed": res.installed}, indent=2) + "\n"
        )
    return res


def _resolve(*, container_pins: Path, requirements: Path, base: Path, only: frozenset[str] | None) -> Resolution:
    """One resolution by pip against the index (see :func:`resolve`)."""
    with tempfile.TemporaryDirectory(prefix="mfp8-resolve-") as tmp:
        work = Path(tmp)
        reqs = build_requirements(container_pins, requirements, work)
        if only is not None:
            reqs = [r for r in reqs if pins._req_name(r) in only]
        wheels = work / "base-wheels"
        wheels.mkdir()
        base_pins = parse_base(base)
        constraints = [f"{name}=={version}" for name, (version, _) in base_pins.items()]
        for name, (version, ngc) in base_pins.items():
            if ngc:
                fake_wheel(wheels, name, version)
        for name, version in SDIST_ONLY.items():
            fake_wheel(wheels, name, version)
            constraints.append(f"{name}=={version}")
        (work / "base.txt").write_text("\n".join(constraints) + "\n")
        (work / "reqs.txt").write_text("\n".join(reqs) + "\n")
        out = work / "report.json"
        args = _pip_base_args(work / "target") + ["--report", str(out), "--find-links", str(wheels)]
        args += ["-c", str(container_pins), "-c", str(work / "base.txt"), "-r", str(work / "reqs.txt")]
        logger.info("resolving %d requirements for Python %s manylinux x86_64", len(reqs), PYTHON_VERSION)
        proc = subprocess.run(args, capture_output=True, text=True, env=_pip_env(), timeout=900, check=False)
        installed: dict[str, str] = {}
        if proc.returncode == 0:
            data = json.loads(out.read_text())
            installed = {pins.normalize(i["metadata"]["name"]): i["metadata"]["version"] for i in data["install"]}
        return Resolution(ok=proc.returncode == 0, installed=installed, requirements=tuple(reqs), log=proc.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--container-pins", type=Path, default=pins.CONTAINER_CONSTRAINTS)
    parser.add_argument("--requirements", type=Path, default=DEFAULT_REQUIREMENTS)
    parser.add_argument("--base", type=Path, default=DEFAULT_BASE)
    parser.add_argument("--report", type=Path, default=None, help="JSON: the requirement list and the resolved set")
    parser.add_argument("--subset", action="store_true", help="resolve only the representative SUBSET (fast)")
    parser.add_argument("--no-cache", action="store_true", help="ask the index even when these pins were resolved")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="resolve: %(message)s")
    res = resolve(
        container_pins=args.container_pins,
        requirements=args.requirements,
        base=args.base,
        report=args.report,
        only=SUBSET if args.subset else None,
        cache_dir=None if args.no_cache else "default",
    )
    if not res.ok:
        logger.error("the image's requirement set does not resolve:\n%s", res.log[-6000:])
        return 1
    for name, version in sorted(res.installed.items()):
        logger.info("%s==%s", name, version)
    logger.info("ok: %d requirements resolve to %d packages", len(res.requirements), len(res.installed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
