"""Shared fixture of the benchmark tests: import a module of ``bench/`` (a folder of scripts, not a package)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="session")
def bench_module() -> Callable[[str], ModuleType]:
    """``bench_module(name)``: the module ``bench/<name>.py``, imported with ``bench/`` on the path for its own
    sibling imports (``import _refit_device``), then taken off it again."""

    def load(name: str) -> ModuleType:
        sys.path.insert(0, str(BENCH))
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(str(BENCH))

    return load
