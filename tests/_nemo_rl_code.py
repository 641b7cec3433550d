"""NeMo-RL's own code as the oracle of a test: excerpts copied unchanged under ``tests/rl/algorithm/data/nemo_rl/``
(its README names each file's source and lines), executed as the modules they come from, with empty stand-ins for
the NeMo-RL packages the excerpts import but never call."""

from __future__ import annotations

import sys
import types
from pathlib import Path

DATA = Path(__file__).resolve().parent / "rl" / "algorithm" / "data" / "nemo_rl"


class Unused:
    """Stand-in for a name an excerpt imports and never calls (a ``PackedTensor`` no value here is)."""


def stand_in(name: str, *, package: bool = False) -> types.ModuleType:
    """An empty module (a package with ``package``) from which ``from X import anything`` gives :class:`Unused`."""
    mod = types.ModuleType(name)
    if package:
        mod.__path__ = []
    mod.__getattr__ = lambda attr: Unused  # PEP 562
    return mod


def exec_excerpt(name: str, file: str, **names: object) -> types.ModuleType:
    """Run ``DATA / file`` as the module ``name`` (registered in ``sys.modules``; ``names`` preset in it, e.g. the
    annotation-only types of an excerpt): NeMo-RL's code, as it is."""
    mod = types.ModuleType(name)
    mod.__dict__.update(names)
    sys.modules[name] = mod
    source = DATA / file
    exec(compile(source.read_text(), str(source), "exec"), mod.__dict__)
    return mod
