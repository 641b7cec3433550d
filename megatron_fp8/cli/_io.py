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


def say(line: str) -> None:
    """Write one line to stderr in a single ``write(2)``, so the ranks' lines never interleave.

    ``print(x, file=sys.stderr)`` writes the text and its newline separately; two ranks sharing one pipe (torchrun,
    ``srun``) then produce ``line-aline-b\\n\\n``. A pipe writes up to ``PIPE_BUF`` (4096 bytes on Linux) bytes at
    once, whole; a longer line is written in pieces as the pipe takes them.

    Args:
        line: the text, without its newline.
    """
    sys.stderr.flush()  # whatever Python buffered goes first, in order
    data = (line + "\n").encode(sys.stderr.encoding or "utf-8", errors="backslashreplace")
    view = memoryview(data)
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (pytest's capsys)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        return
    while view:
        view = view[os.write(fd, view) :]
