"""Container pins: parse them, check them against CI's pins and the Dockerfile, freeze the base image.

Three files hold versions:

* ``requirements/constraints.txt``: every CI pin (CPU, Python 3.11);
* ``docker/constraints-container.txt``: the container's pins (CUDA 12.9, Python 3.12). A line equals the CI
  pin unless it says why not after ``# differs:``; ``# from-base: NAME`` lines name packages the base image
  provides and the build must never replace;
* ``docker/Dockerfile.ngc_pytorch``: ``ARG`` defaults for what it installs by version (``MEGATRON_CORE_VERSION``,
  ``VLLM_REF``, ...), which must equal the container pins.

Standard library only: the image build runs it (``freeze-base``) before anything else is installed.

Usage::

    python docker/pins.py check                  # exit 1 and list every disagreement
    python docker/pins.py freeze-base --out F    # write NAME==VERSION for the installed from-base packages
    python docker/pins.py check-base             # the base has torch >= 2.8, TE >= 2.3, CUDA >= 12.9
    python docker/pins.py runtime-deps D...      # dependencies of installed D... minus EXCLUDED
    python docker/pins.py pip-check              # pip check, waiving only the EXCLUDED names
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN_CONSTRAINTS = ROOT / "requirements" / "constraints.txt"
CONTAINER_CONSTRAINTS = ROOT / "docker" / "constraints-container.txt"
DOCKERFILE = ROOT / "docker" / "Dockerfile.ngc_pytorch"

#: Dockerfile ARG -> (container pin it must equal, how the ARG spells the version)
DOCKERFILE_ARG_PINS: dict[str, tuple[str, str]] = {
    "MEGATRON_CORE_VERSION": ("megatron-core", "{v}"),
    "MEGATRON_BRIDGE_VERSION": ("megatron-bridge", "{v}"),
    "MODELOPT_VERSION": ("nvidia-modelopt", "{v}"),
    "VLLM_REF": ("vllm", "v{v}"),
}

_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s#;]+)\s*(?:#(.*))?$")
_FROM_BASE = re.compile(r"^\s*#\s*from-base:\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*$")
_ARG = re.compile(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)=(\S*)\s*$")


def normalize(name: str) -> str:
    """PEP 503 name normalisation (``Megatron_Core`` -> ``megatron-core``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Pin:
    """One ``name==version`` line.

    Attributes:
        name: normalized distribution name.
        version: the pinned version string.
        note: text after ``# differs:`` (container file only), else ``None``.
        line: 1-based line number in its file.
    """

    name: str
    version: str
    note: str | None
    line: int


@dataclass(frozen=True)
class ContainerPins:
    """Parsed ``docker/constraints-container.txt``: ``pins`` by normalized name and the ``from_base`` names."""

    pins: dict[str, Pin]
    from_base: tuple[str, ...]


def parse_constraints(path: Path) -> dict[str, Pin]:
    """Parse a pip constraints file into ``{normalized name: Pin}``.

    Raises:
        ValueError: a non-comment line is not ``name==version``, or a name appears twice (names the line).
    """
    pins: dict[str, Pin] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), start=1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        m = _PIN.match(raw)
        if m is None:
            raise ValueError(f"{path}:{lineno}: expected 'name==version', got {raw.strip()!r}")
        name, version, comment = normalize(m.group(1)), m.group(2), m.group(3)
        note = None
        if comment and "differs:" in comment:
            note = comment.split("differs:", 1)[1].strip() or None
        if name in pins:
            raise ValueError(f"{path}:{lineno}: {name} pinned twice (first on line {pins[name].line})")
        pins[name] = Pin(name=name, version=version, note=note, line=lineno)
    return pins


def parse_container_pins(path: Path = CONTAINER_CONSTRAINTS) -> ContainerPins:
    """Parse the container constraints, including its ``# from-base: NAME`` lines."""
    from_base = tuple(
        normalize(m.group(1)) for m in map(_FROM_BASE.match, path.read_text().splitlines()) if m is not None
    )
    return ContainerPins(pins=parse_constraints(path), from_base=from_base)


def dockerfile_args(path: Path = DOCKERFILE) -> dict[str, str]:
    """``ARG NAME=default`` values of a Dockerfile (the first default wins when an ARG is re-declared)."""
    args: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        m = _ARG.match(raw)
        if m is not None:
            args.setdefault(m.group(1), m.group(2).strip('"'))
    return args


def check_mapping(main: dict[str, Pin], container: ContainerPins) -> list[str]:
    """Every disagreement between the container pins and CI's pins, as readable messages (empty = consistent)."""
    problems = []
    for name, pin in container.pins.items():
        if name in container.from_base:
            problems.append(f"{name}: pinned on line {pin.line} but also marked from-base (the base image owns it)")
            continue
        ci = main.get(name)
        if pin.note is not None:
            if ci is not None and ci.version == pin.version:
                problems.append(f"{name}=={pin.version}: marked 'differs:' but equals requirements/constraints.txt")
            continue
        if ci is None:
            problems.append(
                f"{name}=={pin.version} (container line {pin.line}) is not in requirements/constraints.txt: "
                "pin it there too or explain with '# differs: <reason>'"
            )
        elif ci.version != pin.version:
            problems.append(
                f"{name}: container pins {pin.version} (line {pin.line}) but requirements/constraints.txt pins "
                f"{ci.version} (line {ci.line}); make them equal or add '# differs: <reason>'"
            )
    return problems


def check_dockerfile(args: dict[str, str], container: ContainerPins) -> list[str]:
    """Disagreements between the Dockerfile's versioned ARGs and the container pins."""
    problems = []
    for arg, (dist, spelling) in DOCKERFILE_ARG_PINS.items():
        if arg not in args:
            problems.append(f"Dockerfile has no 'ARG {arg}=...' (it must pin {dist})")
            continue
        pin = container.pins.get(dist)
        if pin is None:
            problems.append(f"ARG {arg}={args[arg]} but docker/constraints-container.txt has no {dist} pin")
            continue
        expected = spelling.format(v=pin.version)
        if args[arg] != expected:
            problems.append(
                f"ARG {arg}={args[arg]} disagrees with docker/constraints-container.txt {dist}=={pin.version} "
                f"(expected {arg}={expected})"
            )
    commit = args.get("DEEPGEMM_COMMIT", "")
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        problems.append(f"ARG DEEPGEMM_COMMIT={commit!r}: pin DeepGEMM to a full 40-hex commit")
    return problems


def freeze_base(from_base: tuple[str, ...]) -> list[str]:
    """``NAME==VERSION`` for every installed distribution named in ``from_base`` (prefix match on ``NAME-``).

    ``transformer-engine`` thus also freezes ``transformer-engine-cu12`` / ``-torch`` where the image has them.
    """
    lines = set()
    for dist in importlib.metadata.distributions():
        name = normalize(dist.metadata["Name"] or "")
        if any(name == base or name.startswith(base + "-") for base in from_base):
            lines.add(f"{name}=={dist.version}")
    return sorted(lines)


#: Names the build never installs from an index, each with its reason: the base image owns them, or they are
#: GPU-only / cu13 dependencies of a package installed with ``--no-deps``. ``runtime-deps`` leaves them out of the
#: one resolution, ``pip-check`` waives exactly these (and nothing else), tests/docker/test_resolution.py uses both.
EXCLUDED: dict[str, str] = {
    "torch": "the base image's (NGC builds a pre-release, 2.8.0a0+..., that 'torch>=2.8' rejects)",
    "torchvision": "not used; a PyPI build would pin a second torch",
    "torchaudio": "not used; a PyPI build would pin a second torch",
    "xformers": "vLLM uses FlashAttention on Hopper; the PyPI wheel pins a PyPI torch",
    "triton": "the base image's",
    "transformer-engine": "the base image's (megatron-bridge asks for a cu13 build)",
    "mamba-ssm": "megatron-bridge GPU-only extra, not used (CI leaves it out too)",
    "causal-conv1d": "megatron-bridge GPU-only extra, not used (CI leaves it out too)",
    "flash-linear-attention": "megatron-bridge GPU-only extra, not used (CI leaves it out too)",
    "nvidia-resiliency-ext": "megatron-bridge training extra, not used (CI leaves it out too)",
    "timm": "megatron-bridge vision-model dependency, not used",
    "open-clip-torch": "megatron-bridge vision-model dependency, not used",
    "qwen-vl-utils": "megatron-bridge vision-model dependency, not used",
    "mlflow": "megatron-bridge logger, not used",
    "wandb": "megatron-bridge logger, not used",
}

#: Installed with ``--no-deps``; their dependencies minus :data:`EXCLUDED` are resolved together with
#: docker/requirements-container.txt in one pip call.
NO_DEPS_DISTS = ("vllm", "deep-gemm", "megatron-core", "nvidia-modelopt", "megatron-bridge")


def _req_name(spec: str) -> str:
    return normalize(re.split(r"[\s\[<>=!~;(@]", spec.strip(), maxsplit=1)[0])


def requirement_set(
    requires: dict[str, list[str]],
    *,
    exclude: set[str],
    environment: dict[str, str] | None = None,
) -> list[str]:
    """The dependencies of several distributions as one requirement list, minus extras and ``exclude``.

    Args:
        requires: distribution name -> its ``Requires-Dist`` strings (installed metadata or a pip report).
        exclude: normalized names to leave out (:data:`EXCLUDED`); the distributions themselves are left out too.
        environment: marker environment overrides (e.g. ``python_version`` 3.12 when resolving for the image
            from another Python); ``None`` evaluates markers for this interpreter.

    Returns:
        Requirement strings without their markers, in first-seen order, duplicates removed.
    """
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - pip's environment always has packaging on NGC images
        Requirement = None
    own = {normalize(d) for d in requires}
    out: list[str] = []
    for reqs in requires.values():
        for req in reqs:
            spec, _, marker = req.partition(";")
            if "extra ==" in marker or "extra==" in marker:
                continue
            if Requirement is not None:
                parsed = Requirement(req)
                if parsed.marker is not None and not parsed.marker.evaluate({**(environment or {}), "extra": ""}):
                    continue
                name = normalize(parsed.name)
                spec = str(Requirement(req.split(";")[0]))
            else:
                name = _req_name(spec)
            if name in exclude or name in own:
                continue
            if spec.strip() not in out:
                out.append(spec.strip())
    return out


def runtime_deps(dists: list[str], *, exclude: set[str]) -> list[str]:
    """Requirement strings of installed ``dists`` that apply here, minus extras and the ``exclude`` names.

    Used after ``pip install --no-deps`` to install a package's dependencies without its torch requirement:
    NGC's torch is a pre-release build (``2.8.0a0+...``) that a ``torch>=2.8`` specifier rejects, which would
    make pip fetch a second torch.

    Raises:
        importlib.metadata.PackageNotFoundError: a name in ``dists`` is not installed.
    """
    return requirement_set({d: importlib.metadata.requires(d) or [] for d in dists}, exclude=exclude)


_PIP_CHECK_LINE = re.compile(
    r"^(?P<dist>\S+) \S+ (?:requires (?P<missing>[^,]+), which is not installed"
    r"|has requirement (?P<req>.+?), but you have (?P<have>\S+) \S+)\.?$"
)


def waive_pip_check(output: str, *, excluded: set[str]) -> tuple[list[str], list[str]]:
    """Split ``pip check`` output into (waived lines, problems).

    A line is waived only when the package it names as missing or mismatched is in ``excluded`` (the base
    image's own packages and the documented ``--no-deps`` exclusions); every other line is a problem.
    """
    waived, problems = [], []
    for line in output.splitlines():
        line = line.strip()
        if not line or line.startswith("No broken requirements"):
            continue
        m = _PIP_CHECK_LINE.match(line)
        name = None
        if m is not None:
            name = _req_name(m.group("missing") or m.group("req") or "")
        (waived if name is not None and name in excluded else problems).append(line)
    return waived, problems


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", re.split(r"[a-z+]", text, maxsplit=1)[0])[:3])


def _torch_cuda() -> str | None:
    """``torch.version.cuda`` read from ``torch/version.py`` as text (torch is not imported)."""
    try:
        files = importlib.metadata.files("torch") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).replace("\\", "/") == "torch/version.py":
            m = re.search(r"^cuda\s*(?::\s*\S+)?\s*=\s*['\"]([^'\"]+)['\"]", f.read_text(), re.M)
            return m.group(1) if m else None
    return None


#: What the base image must provide (checked first thing in the build, ``pins.py check-base``): TE's blockwise
#: FP8 GEMM needs CUDA >= 12.9, vLLM 0.11.0 is built for torch 2.8, Megatron-Core builds Float8BlockScaling only
#: from TE 2.3. NGC PyTorch 25.05 and 25.06 meet all three (25.04 has torch 2.7 and TE 2.2, 25.08+ CUDA 13).
BASE_MINIMUMS: dict[str, tuple[int, ...]] = {"torch": (2, 8), "transformer-engine": (2, 3), "cuda": (12, 9)}


def check_base(minimums: dict[str, tuple[int, ...]] = BASE_MINIMUMS) -> list[str]:
    """Problems with the base image's torch, TransformerEngine and torch CUDA build (empty = fine)."""
    problems = []
    found: dict[str, str | None] = {"cuda": _torch_cuda()}
    for name in ("torch", "transformer-engine"):
        found[name] = None
        for candidate in (name, f"{name}-cu12", "transformer_engine"):
            try:
                found[name] = importlib.metadata.version(candidate)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    for name, minimum in minimums.items():
        have = found.get(name)
        want = ".".join(map(str, minimum))
        if have is None:
            problems.append(f"base image has no {name}; use NGC PyTorch 25.05 or 25.06 as BASE_IMAGE")
        elif _version_tuple(have) < minimum:
            problems.append(
                f"base image has {name} {have}, needs >= {want}; use NGC PyTorch 25.05 or 25.06 as BASE_IMAGE "
                "(25.04 has torch 2.7 and TE 2.2; 25.08 and newer are CUDA 13)"
            )
    return problems


def _waived_name(line: str) -> str:
    m = _PIP_CHECK_LINE.match(line.strip())
    return _req_name((m.group("missing") or m.group("req")) if m else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="CI pins vs container pins vs Dockerfile ARGs")
    fz = sub.add_parser("freeze-base", help="pin the base image's own packages (torch, TE, ...) to what is installed")
    fz.add_argument("--out", type=Path, required=True)
    fz.add_argument("--pins", type=Path, default=CONTAINER_CONSTRAINTS)
    rd = sub.add_parser("runtime-deps", help="print the dependencies of installed packages, minus --exclude")
    rd.add_argument("dists", nargs="+")
    rd.add_argument("--exclude", default=None, help="comma-separated names to leave out (default: EXCLUDED)")
    sub.add_parser("pip-check", help="pip check; fail on anything but the documented EXCLUDED packages")
    sub.add_parser("check-base", help="the base image has torch >= 2.8, TE >= 2.3, CUDA >= 12.9")
    args = parser.parse_args(argv)
    if args.cmd == "runtime-deps":
        names = EXCLUDED if args.exclude is None else args.exclude.split(",")
        exclude = {normalize(x) for x in names if x.strip()}
        print("\n".join(runtime_deps(args.dists, exclude=exclude)))
        return 0
    if args.cmd == "pip-check":
        proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False)
        waived, problems = waive_pip_check(proc.stdout + proc.stderr, excluded=set(EXCLUDED))
        for line in waived:
            print(f"pins: pip check waived (excluded on purpose: {EXCLUDED[_waived_name(line)]}): {line}")
        for line in problems:
            print(f"pins: pip check FAILED: {line}", file=sys.stderr)
        print(f"pins: pip check {'FAILED' if problems else 'ok'} ({len(waived)} waived)")
        return 1 if problems else 0
    if args.cmd == "check-base":
        problems = check_base()
        for p in problems:
            print(f"pins: {p}", file=sys.stderr)
        print(f"pins: base image {'FAILED' if problems else 'ok'} (torch >= 2.8, TE >= 2.3, CUDA >= 12.9)")
        return 1 if problems else 0
    if args.cmd == "check":
        container = parse_container_pins()
        problems = check_mapping(parse_constraints(MAIN_CONSTRAINTS), container)
        problems += check_dockerfile(dockerfile_args(), container)
        for p in problems:
            print(f"pins: {p}", file=sys.stderr)
        print(f"pins: {'FAILED' if problems else 'ok'} ({len(container.pins)} container pins)")
        return 1 if problems else 0
    container = parse_container_pins(args.pins)
    lines = freeze_base(container.from_base)
    found = {line.split("==")[0] for line in lines}
    missing = [b for b in container.from_base if not any(f == b or f.startswith(b + "-") for f in found)]
    if "torch" in missing:
        print("pins: the base image has no torch: BASE_IMAGE must be an NGC PyTorch image", file=sys.stderr)
        return 1
    args.out.write_text("".join(f"{line}\n" for line in lines))
    print(f"pins: froze {len(lines)} base packages into {args.out}; not in the image: {', '.join(missing) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
