"""Package exports resolved on first use (PEP 562), so that importing one submodule does not import its siblings.

A package ``__init__`` that re-exports names of its submodules declares them once, as data, and binds the
module-level ``__getattr__`` / ``__dir__`` this returns::

    _EXPORTS = {"RefitSender": "megatron_fp8.refit.sender", ...}
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
    __all__ = sorted(_EXPORTS)

``from megatron_fp8.refit import RefitSender`` still works (the package's ``__getattr__`` imports
``megatron_fp8.refit.sender`` then), while ``import megatron_fp8.refit.wire`` runs the package ``__init__``
without importing the sender, the receiver, every transport and the quantizers behind them. The import graph
of ``tests/test_architecture.py`` therefore counts a package's exports as no edges: nothing is imported until a
name is used, after every module has finished initialising.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, table: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose exports ``table`` names.

    Args:
        package: the package's ``__name__``.
        table: exported name -> the module (dotted, absolute) that defines it under that name.

    Returns:
        ``(__getattr__, __dir__)`` for the package's module namespace. A resolved name is cached in the package,
        so later lookups are plain attribute reads.
    """
    exports = dict(table)

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
