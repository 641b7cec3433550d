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
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
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


def runtime_deps(dists: list[str], *, exclude: set[str]) -> list[str]:
    """Requirement strings of installed ``dists`` that apply here, minus extras and the ``exclude`` names.

    Used after ``pip install --no-deps`` to install a package's dependencies without its torch requirement:
    NGC's torch is a pre-release build (``2.8.0a0+...``) that a ``torch>=2.8`` specifier rejects, which would
    make pip fetch a second torch.

    Raises:
        importlib.metadata.PackageNotFoundError: a name in ``dists`` is not installed.
    """
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - pip's environment always has packaging on NGC images
        Requirement = None
    out: list[str] = []
    for dist in dists:
        for req in importlib.metadata.requires(dist) or []:
            spec, _, marker = req.partition(";")
            if "extra ==" in marker or "extra==" in marker:
                continue
            if Requirement is not None:
                parsed = Requirement(req)
                if parsed.marker is not None and not parsed.marker.evaluate({"extra": ""}):
                    continue
                name = normalize(parsed.name)
            else:
                name = normalize(re.split(r"[\s\[<>=!~;(]", spec.strip(), maxsplit=1)[0])
            if name in exclude or name in {normalize(d) for d in dists}:
                continue
            if spec.strip() not in out:
                out.append(spec.strip())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="CI pins vs container pins vs Dockerfile ARGs")
    fz = sub.add_parser("freeze-base", help="pin the base image's own packages (torch, TE, ...) to what is installed")
    fz.add_argument("--out", type=Path, required=True)
    fz.add_argument("--pins", type=Path, default=CONTAINER_CONSTRAINTS)
    rd = sub.add_parser("runtime-deps", help="print the dependencies of installed packages, minus --exclude")
    rd.add_argument("dists", nargs="+")
    rd.add_argument("--exclude", default="torch", help="comma-separated names to leave out (default: torch)")
    args = parser.parse_args(argv)
    if args.cmd == "runtime-deps":
        exclude = {normalize(x) for x in args.exclude.split(",") if x.strip()}
        print("\n".join(runtime_deps(args.dists, exclude=exclude)))
        return 0
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
