"""One home for writing files safely: :func:`write_atomically`, a full disk named (:func:`disk_guard`), the cache
root and its folders (no torch).

A write that fails because the filesystem is full (ENOSPC), over quota (EDQUOT) or read-only (EROFS), through
``open``, safetensors (its ``SafetensorError`` carries only "os error 28") or torch's zip writer (a ``RuntimeError``
on a nearly full disk), becomes one :class:`~megatron_fp8.errors.DiskFullError` naming the path, the bytes needed,
the bytes free, what was kept and what to do, instead of "unexpected error ... please report it".
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from megatron_fp8.errors import ConfigError, DiskFullError

DISK_ERRNOS: dict[int, str] = {
    errno.ENOSPC: "no space left",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only filesystem",
}
"""The errors of a write that the filesystem, not the data, caused: what to call each."""

NEARLY_FULL = 16 << 20
"""Free bytes under which a failed write with no errno is taken for a full disk (torch's zip writer reports ENOSPC
as a ``RuntimeError``: "unexpected pos ...")."""

_OS_ERROR = re.compile(r"os error (\d+)")


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent); ``None`` when unknown."""
    p = Path(path)
    for candidate in (p, *p.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def disk_error_kind(exc: BaseException, where: str | Path) -> str | None:
    """What filled or locked the filesystem of ``where`` for the failed write ``exc`` (a :data:`DISK_ERRNOS` value),
    ``None`` for any other failure. The cause chain is searched; safetensors' "os error N" is read as errno N."""
    seen: BaseException | None = exc
    while seen is not None:
        code = getattr(seen, "errno", None)
        if code is None and (match := _OS_ERROR.search(str(seen))):
            code = int(match.group(1))
        if code in DISK_ERRNOS:
            return DISK_ERRNOS[code]
        seen = seen.__cause__ or seen.__context__
    free = free_bytes(where)
    if isinstance(exc, RuntimeError) and free is not None and free < NEARLY_FULL:
        return DISK_ERRNOS[errno.ENOSPC]
    return None


@contextlib.contextmanager
def disk_guard(path: str | Path, *, needed: int | None, kept: str, fix: str = "") -> Iterator[None]:
    """Turn a write into ``path`` that fails on a full, over-quota or read-only filesystem into one clear error.

    Args:
        path: what is being written (named in the message).
        needed: the bytes the write needs (``None``: unknown).
        kept: what is intact after the failure (the caller removed its partial files), e.g. "the previous
            metrics.jsonl is unchanged".
        fix: what to do besides freeing space (default: free space, then run the same command again).

    Raises:
        DiskFullError: ``"<kind> writing <path> (<needed> bytes needed, <free> bytes free on its filesystem);
            kept: <kept>; <fix>"``; any other failure propagates unchanged.
    """
    try:
        yield
    except DiskFullError:
        raise
    except Exception as exc:
        kind = disk_error_kind(exc, path)
        if kind is None:
            raise
        free = free_bytes(path)
        need = f"{needed} bytes needed" if needed is not None else "size needed unknown"
        have = f"{free} bytes free" if free is not None else "free space unknown"
        todo = fix or "free space (or write to a larger filesystem), then run the same command again"
        raise DiskFullError(f"{kind} writing {path} ({need}, {have} on its filesystem); kept: {kept}; {todo}") from exc


CACHE_ENV_VAR = "MEGATRON_FP8_CACHE"
"""Environment variable naming the megatron-fp8 cache root (tiny models in ``<root>/models``, vLLM's FP8 manifests
in ``<root>/manifests``); default ``~/.cache/megatron-fp8``."""


def cache_root() -> Path:
    """``$MEGATRON_FP8_CACHE`` (``~`` expanded), else ``~/.cache/megatron-fp8``."""
    root = os.environ.get(CACHE_ENV_VAR, "").strip()
    return Path(root).expanduser() if root else Path.home() / ".cache" / "megatron-fp8"


def unwritable_dir(path: Path) -> str | None:
    """Create ``path`` (and its parents) if missing and write a file in it once: ``None`` when that worked, else the
    operating system's reason (e.g. ``"Permission denied"``), for the caller's message."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def ensure_dir(path: Path, *, what: str, root_from_env: bool = False) -> Path:
    """Create ``path`` (and its parents) if missing and check that a file can be written in it.

    Raises:
        ConfigError: naming ``what``, the path and the reason (``MEGATRON_FP8_CACHE`` when ``root_from_env``).
    """
    reason = unwritable_dir(path)
    if reason is not None:
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
    payload = data.encode() if isinstance(data, str) else data
    kept = f"{p.name} as it was before (written atomically; the partial copy was removed)"
    with disk_guard(p, needed=len(payload), kept=kept):
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600: give the file what open() would (teammates read it)
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return p
