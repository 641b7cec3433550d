"""Console helpers for the CLI."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def stdout_to_stderr(enabled: bool = True) -> Iterator[None]:
    """Send everything written to file descriptor 1 to descriptor 2 for a while.

    vLLM and Megatron log to stdout through handlers bound at import time; with
    ``--json`` the only thing on stdout must be the JSON document.
    """
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
