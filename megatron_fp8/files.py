"""One home for writing files safely: :func:`write_atomically`, the cache root and its folders (no torch)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from megatron_fp8.errors import ConfigError

CACHE_ENV_VAR = "MEGATRON_FP8_CACHE"
"""Environment variable naming the megatron-fp8 cache root (tiny models in ``<root>/models``, vLLM's FP8 manifests
in ``<root>/manifests``); default ``~/.cache/megatron-fp8``."""


def cache_root() -> Path:
    """``$MEGATRON_FP8_CACHE`` (``~`` expanded), else ``~/.cache/megatron-fp8``."""
    root = os.environ.get(CACHE_ENV_VAR, "").strip()
    return Path(root).expanduser() if root else Path.home() / ".cache" / "megatron-fp8"


def ensure_dir(path: Path, *, what: str, root_from_env: bool = False) -> Path:
    """Create ``path`` (and its parents) if missing and check that a file can be written in it.

    Raises:
        ConfigError: naming ``what``, the path and the reason (``MEGATRON_FP8_CACHE`` when ``root_from_env``).
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if root_from_env:
            raise ConfigError(
                f"{CACHE_ENV_VAR}={os.environ.get(CACHE_ENV_VAR)}: {what} folder {path} cannot be created or written "
                f"({reason}); set {CACHE_ENV_VAR} to a writable folder, or unset it for ~/.cache/megatron-fp8"
            ) from None
        raise ConfigError(
            f"{what} folder {path} cannot be created or written ({reason}); set {CACHE_ENV_VAR} to a writable folder"
        ) from None
    return path


def _umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder, fsync and a rename.

    A reader sees the old file or the new one, never half a file; a crash leaves no partial file under ``path``.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600: give the file what open() would (teammates read it)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
