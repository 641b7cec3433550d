"""Dataset files read and checked: JSON Lines, a JSON array, Parquet (``data.train`` / ``data.validation``).

JSON and JSON Lines files are read and checked here line by line (errors name the line); Parquet goes through
the ``datasets`` library with its cache in a temporary folder (nothing is written next to the data or in
``~``). ``datasets`` is imported only for Parquet. A column may be a path into nested values (``prompt[0].content``,
NeMo-RL's DAPO-Math rows): :func:`megatron_fp8.config.nemo_rl.datasets.column_value`.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

from megatron_fp8.config.nemo_rl.datasets import column_value
from megatron_fp8.config.schema import DatasetConfig
from megatron_fp8.errors import ConfigError

SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet")
"""File extensions :func:`load_rows` reads."""

_SHOWN_CHARS = 80
"""Characters of a row or line quoted in an error message."""


def shown(value: object) -> str:
    """``repr(value)``, cut to a length that fits an error message."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def check_limit(value: int | None, *, key: str) -> None:
    """Refuse a limit below 1 (``None`` = no limit) naming ``key``."""
    if value is not None and value < 1:
        raise ConfigError(f"{key} must be >= 1 (or null for no limit), got {value}")


def _read_json_array(text: str, path: Path, *, what: str) -> list[dict[str, Any]] | None:
    """Rows of a ``.json`` file holding one JSON value; ``None`` when the text is not one JSON value."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if text.lstrip().startswith("["):
            raise ConfigError(
                f"{what}.data_path: {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
            ) from None
        return None  # JSON Lines in a .json file
    if isinstance(value, dict):
        return [value]
    if not isinstance(value, list):
        raise ConfigError(
            f"{what}.data_path: {path} holds a JSON {type(value).__name__}; expected an array of objects "
            "(one per row) or JSON Lines (one object per line)"
        )
    for i, row in enumerate(value, 1):
        if not isinstance(row, dict):
            raise ConfigError(
                f"{what}.data_path: {path} row {i} is not a JSON object ({shown(row)}); each row must be an "
                "object with the input and output keys"
            )
    return value


def _read_json(path: Path, *, what: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of a JSON Lines file (or a ``.json`` array) and where each one stands (``"line 3"``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what}.data_path: {path} is not UTF-8 text ({exc}); save it as UTF-8") from None
    if path.suffix.lower() == ".json":
        rows = _read_json_array(text, path, what=what)
        if rows is not None:
            return rows, [f"row {i}" for i in range(1, len(rows) + 1)]
    rows, where = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{what}.data_path: {path} line {lineno} is not JSON ({exc.msg} at column {exc.colno}): "
                f"{shown(line)}; JSON Lines files hold one JSON object per line"
            ) from None
        if not isinstance(row, dict):
            raise ConfigError(
                f"{what}.data_path: {path} line {lineno} is a JSON {type(row).__name__}, not an object: "
                f"{shown(line)}; each line must be an object with the input and output keys"
            )
        rows.append(row)
        where.append(f"line {lineno}")
    return rows, where


def _read_parquet(path: Path, *, what: str) -> list[dict[str, Any]]:
    """Rows of a Parquet file, through ``datasets`` with its cache in a temporary folder."""
    try:
        import datasets  # lazy: optional dependency (the GPU test box has torch only); needed for Parquet only
    except ImportError:
        raise ConfigError(
            f"{what}.data_path: reading Parquet ({path}) needs the 'datasets' library: pip install datasets, "
            "or convert the file to JSON Lines"
        ) from None
    bars_were_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="megatron-fp8-datasets-") as cache:
            table = datasets.load_dataset("parquet", data_files=str(path.resolve()), split="train", cache_dir=cache)
            return table.to_list()
    except Exception as exc:  # datasets / pyarrow raise many types for a bad file
        raise ConfigError(
            f"{what}.data_path: {path} is not a readable Parquet file ({type(exc).__name__}: {exc})"
        ) from exc
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


def _check_row(row: dict[str, Any], cfg: DatasetConfig, *, what: str) -> str | None:
    """Why ``row`` cannot be a problem (``None`` when it can)."""
    for attr, role in (("input_key", "problem text"), ("output_key", "expected answer")):
        key = getattr(cfg, attr)
        if column_value(row, key) is None:
            state = "a null" if key in row else "no"
            return (
                f"has {state} {key!r} (its columns: {', '.join(map(repr, row)) or 'none'}); "
                f"set {what}.{attr} to the column holding the {role}"
            )
    problem, answer = column_value(row, cfg.input_key), column_value(row, cfg.output_key)
    if not isinstance(problem, str):
        return f"has a {type(problem).__name__} {cfg.input_key!r} ({shown(problem)}); the problem must be text"
    bad_number = isinstance(answer, float) and not math.isfinite(answer)
    if isinstance(answer, bool) or not isinstance(answer, str | int | float) or bad_number:
        return (
            f"has a {type(answer).__name__} {cfg.output_key!r} ({shown(answer)}); the expected answer must be "
            "text or a finite number"
        )
    return None


def load_rows(cfg: DatasetConfig, *, what: str) -> list[dict[str, Any]]:
    """Read and check a dataset file: every row has a text input and an answer (text or number).

    Args:
        cfg: the dataset section (``data_path``, ``input_key``, ``output_key``, ``max_samples``).
        what: its config key, ``"data.train"`` or ``"data.validation"`` (named in every message).

    Returns:
        The rows in file order, the first ``max_samples`` of them (``None`` = all); each a dict of the file's
        columns.

    Raises:
        ConfigError: no ``data_path``, a missing file, an unknown extension, a line that is not a JSON object
            (its line number), an empty file, a row without the input / output key or with a value of the
            wrong type (the key, the row's columns, the first bad row and how many are bad), or a bad
            ``max_samples``.
    """
    if cfg.data_path is None:
        raise ConfigError(f"{what}.data_path is not set; name a .jsonl, .json or .parquet file")
    check_limit(cfg.max_samples, key=f"{what}.max_samples")
    path = Path(cfg.data_path).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{what}.data_path: no such file {path} (a relative path is relative to the working directory {Path.cwd()})"
        )
    if not path.is_file():
        raise ConfigError(f"{what}.data_path: {path} is not a file; name a .jsonl, .json or .parquet file")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigError(
            f"{what}.data_path: {path} has the unknown extension {suffix or '(none)'!r}; "
            f"use one of {', '.join(SUFFIXES)}"
        )
    if suffix == ".parquet":
        rows = _read_parquet(path, what=what)
        where = [f"row {i}" for i in range(1, len(rows) + 1)]
    else:
        rows, where = _read_json(path, what=what)
    if not rows:
        raise ConfigError(f"{what}.data_path: {path} holds no rows")
    if cfg.max_samples is not None:
        rows, where = rows[: cfg.max_samples], where[: cfg.max_samples]
    problems = [(w, why) for row, w in zip(rows, where, strict=True) if (why := _check_row(row, cfg, what=what))]
    if problems:
        first_where, why = problems[0]
        more = f" ({len(problems) - 1} more rows like it)" if len(problems) > 1 else ""
        raise ConfigError(f"{what}: {path} {first_where} {why}{more}")
    return rows
