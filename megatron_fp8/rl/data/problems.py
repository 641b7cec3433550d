"""GRPO problems: a local dataset (NeMo-RL's ``data`` section) or the built-in toy task.

A :class:`ProblemSource` hands GRPO the problems of each step and the validation problems:

* :class:`DatasetSource` -- rows of a local ``.jsonl`` / ``.json`` / ``.parquet`` file (``data.train``,
  ``data.validation``), each turned into a prompt by ``data.default.prompt_file`` and the tokenizer's chat
  template; the answer is the row's ``output_key`` as text;
* :class:`TaskSource` -- the built-in toy task (``grpo.task``), used when ``data.train.data_path`` is unset.

:func:`problem_source` builds the one a config asks for.

**Data position.** :meth:`ProblemSource.step_problems` is a pure function of ``(grpo.seed, step, count)``:
the problems of step ``N`` are the same whether or not steps ``0..N-1`` were drawn in this process, so a run
resumed from a checkpoint of step ``N`` sees exactly what an uninterrupted run would (the checkpoint's data
position is its step). A dataset is walked in epochs: position ``p = step * count + i`` is row
``order(epoch)[p % n]`` of epoch ``p // n``; with ``data.shuffle`` each epoch's order is a permutation seeded
by ``(seed, epoch)``, so epochs wrap and reshuffle. The position depends on ``count``
(``grpo.num_prompts_per_step``): a run resumed with another count sees other problems.

**Prompt files** follow NeMo-RL's convention (``str.format``): one ``{}`` where the problem goes, literal braces
doubled (``\\boxed{{}}`` reads as ``\\boxed{}``). The file is used verbatim (a trailing newline included).
The final prompt text is what the model continues: tokenize it with
``tokenizer.encode(problem.prompt, add_special_tokens=False)`` (the chat template's special tokens are in the
text already).

**Validation** of a dataset run needs ``data.validation.data_path``: the training rows are not held out, so
:func:`problem_source` refuses ``grpo.val_period > 0`` or ``grpo.val_at_start`` without it (as NeMo-RL does).
A toy-task run validates on problems drawn with the seed ``grpo.seed + VALIDATION_SEED_OFFSET`` (the toy tasks
have few distinct problems, so some may also occur in training).

JSON and JSON Lines files are read and checked here line by line (errors name the line); Parquet goes through
the ``datasets`` library with its cache in a temporary folder (nothing is written next to the data or in
``~``). ``datasets`` is imported only for Parquet.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megatron_fp8.config.schema import DatasetConfig, RunConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.data.task import Problem, ToyTask, get_task, sample_problems

logger = logging.getLogger(__name__)

SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet")
"""File extensions :func:`load_rows` reads."""

VALIDATION_SEED_OFFSET = 104729
"""Added to ``grpo.seed`` for the toy task's validation problems (the warm start uses another offset)."""

TASK_VALIDATION_PROBLEMS = 64
"""Toy-task validation problems when ``grpo.max_val_samples`` is ``None`` (the task has no fixed size)."""

_SHOWN_CHARS = 80
"""Characters of a row or line quoted in an error message."""


class PromptTokenizer(Protocol):
    """What prompt building needs of a Hugging Face tokenizer (``chat_template`` / ``apply_chat_template``
    are looked up with ``getattr``: a tokenizer without a chat template gets the prompt text as is)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        ...


class ProblemSource(Protocol):
    """Where a GRPO run's problems come from.

    Attributes:
        name: a short label for logs (``"data.train: train.jsonl"``, ``"grpo.task: addition"``).
    """

    name: str

    def step_problems(self, *, step: int, count: int) -> list[Problem]:
        """The ``count`` problems of step ``step`` (0-based), a pure function of ``(seed, step, count)``."""
        ...

    def validation_problems(self, *, limit: int | None) -> list[Problem]:
        """The validation problems, the first ``limit`` of them (``None`` = all), the same on every call."""
        ...

    def describe(self) -> str:
        """One log line: what was loaded, from where, what was skipped."""
        ...


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _check_limit(value: int | None, *, key: str) -> None:
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
                f"{what}.data_path: {path} row {i} is not a JSON object ({_shown(row)}); each row must be an "
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
                f"{_shown(line)}; JSON Lines files hold one JSON object per line"
            ) from None
        if not isinstance(row, dict):
            raise ConfigError(
                f"{what}.data_path: {path} line {lineno} is a JSON {type(row).__name__}, not an object: "
                f"{_shown(line)}; each line must be an object with the input and output keys"
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
        if row.get(key) is None:
            state = "a null" if key in row else "no"
            return (
                f"has {state} {key!r} (its columns: {', '.join(map(repr, row)) or 'none'}); "
                f"set {what}.{attr} to the column holding the {role}"
            )
    problem, answer = row[cfg.input_key], row[cfg.output_key]
    if not isinstance(problem, str):
        return f"has a {type(problem).__name__} {cfg.input_key!r} ({_shown(problem)}); the problem must be text"
    bad_number = isinstance(answer, float) and not math.isfinite(answer)
    if isinstance(answer, bool) or not isinstance(answer, str | int | float) or bad_number:
        return (
            f"has a {type(answer).__name__} {cfg.output_key!r} ({_shown(answer)}); the expected answer must be "
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
    _check_limit(cfg.max_samples, key=f"{what}.max_samples")
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


def _read_text_file(path: str, *, key: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{key}: no such file {file} (a relative path is relative to {Path.cwd()})")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{key}: {file} is not UTF-8 text ({exc})") from None


def read_prompt_template(path: str, *, key: str = "data.default.prompt_file") -> str:
    """A prompt template file: text with exactly one ``{}`` where the problem goes (``str.format`` rules).

    Args:
        path: the file.
        key: its config key, for messages.

    Returns:
        The file's text, verbatim.

    Raises:
        ConfigError: a missing file, or not exactly one bare ``{}`` (named fields, format specs and single
            literal braces are refused: write literal braces doubled, ``{{`` / ``}}``).
    """
    template = _read_text_file(path, key=key)
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ConfigError(
            f"{key}: {path} is not a valid template ({exc}); write literal braces doubled: {{{{ and }}}}"
        ) from None
    if fields != [("", "", None)]:
        found = ", ".join(
            "{" + name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
            for name, spec, conv in fields
        )
        raise ConfigError(
            f"{key}: {path} must contain exactly one {{}} placeholder where the problem goes; found "
            f"{len(fields)} replacement field(s){': ' + found if found else ''}. Write literal braces doubled "
            "(\\boxed{{}} reads as \\boxed{})"
        )
    return template


@dataclass(frozen=True)
class PromptBuilder:
    """Problem text -> the prompt the model continues.

    Attributes:
        template: the prompt template (one ``{}``), ``None`` = the problem as is.
        system_prompt: the chat template's system message, ``None`` = none.
        tokenizer: its chat template (when it has one) wraps the text; ``None`` = no chat template.
    """

    template: str | None = None
    system_prompt: str | None = None
    tokenizer: PromptTokenizer | None = None

    def __call__(self, problem: str) -> str:
        """The final prompt text for ``problem``."""
        text = problem if self.template is None else self.template.format(problem)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            return text
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        messages.append({"role": "user", "content": text})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclass(frozen=True)
class LoadedSplit:
    """One dataset file turned into problems.

    Attributes:
        what: its config key (``"data.train"``).
        path: the file.
        problems: the problems kept, in file order.
        rows: rows read (after ``max_samples``).
        skipped: rows whose prompt was longer than ``max_input_seq_length``.
        max_input_seq_length: the limit (tokens), ``None`` = none.
    """

    what: str
    path: str
    problems: tuple[Problem, ...]
    rows: int
    skipped: int
    max_input_seq_length: int | None

    def describe(self) -> str:
        """``"data.train: 200 rows from F (12 skipped: longer than max_input_seq_length=64)"``."""
        skipped = (
            f" ({self.skipped} skipped: longer than max_input_seq_length={self.max_input_seq_length})"
            if self.skipped
            else ""
        )
        return f"{self.what}: {len(self.problems)} rows from {self.path}{skipped}"


def load_split(
    cfg: DatasetConfig,
    *,
    what: str,
    build_prompt: PromptBuilder,
    max_input_seq_length: int | None = None,
) -> LoadedSplit:
    """Read a dataset file and turn each row into a :class:`Problem`.

    Args:
        cfg: the dataset section.
        what: its config key (``"data.train"``).
        build_prompt: problem text -> prompt.
        max_input_seq_length: longest prompt kept (tokens, ``build_prompt.tokenizer.encode(prompt,
            add_special_tokens=False)``); longer rows are skipped, counted and logged once. ``None`` = no limit.

    Raises:
        ConfigError: any :func:`load_rows` error; a limit without a tokenizer; every prompt too long (the
            message gives the shortest one's length).
    """
    _check_limit(max_input_seq_length, key="data.max_input_seq_length")
    rows = load_rows(cfg, what=what)
    tokenizer = build_prompt.tokenizer
    if max_input_seq_length is not None and tokenizer is None:
        raise ConfigError("data.max_input_seq_length needs the model's tokenizer to count prompt tokens")
    problems: list[Problem] = []
    skipped: list[tuple[int, int]] = []  # (row number, tokens)
    for number, row in enumerate(rows, 1):
        prompt = build_prompt(row[cfg.input_key])
        if max_input_seq_length is not None:
            n_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
            if n_tokens > max_input_seq_length:
                skipped.append((number, n_tokens))
                continue
        problems.append(Problem(prompt=prompt, answer=str(row[cfg.output_key])))
    if not problems:
        number, n_tokens = min(skipped, key=lambda s: s[1])
        raise ConfigError(
            f"{what}: every prompt of {cfg.data_path} is longer than data.max_input_seq_length="
            f"{max_input_seq_length} tokens (the shortest, row {number}, has {n_tokens}); raise "
            "data.max_input_seq_length or shorten data.default.prompt_file"
        )
    if skipped:
        logger.warning(
            "%s: skipped %d of %d rows of %s: prompt longer than data.max_input_seq_length=%d tokens "
            "(the first: row %d, %d tokens)",
            what,
            len(skipped),
            len(rows),
            cfg.data_path,
            max_input_seq_length,
            *skipped[0],
        )
    return LoadedSplit(
        what=what,
        path=str(cfg.data_path),
        problems=tuple(problems),
        rows=len(rows),
        skipped=len(skipped),
        max_input_seq_length=max_input_seq_length,
    )


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, *, seed: int, epoch: int) -> tuple[int, ...]:
    """The row order of one epoch: a permutation of ``range(n)`` seeded by ``(seed, epoch)``."""
    order = list(range(n))
    random.Random(f"data-{seed}-{epoch}").shuffle(order)
    return tuple(order)


def _check_step(step: int, count: int) -> None:
    if step < 0:
        raise ConfigError(f"step_problems: step must be >= 0, got {step}")
    if count < 1:
        raise ConfigError(f"step_problems: count must be >= 1 (grpo.num_prompts_per_step), got {count}")


@dataclass(frozen=True)
class DatasetSource:
    """Problems from dataset files (``data.train``, optionally ``data.validation``).

    Attributes:
        name: ``"data.train: <file name>"``.
        train: the training split.
        validation: the validation split, ``None`` = none (then :meth:`validation_problems` refuses).
        seed: ``grpo.seed``; with ``shuffle`` it seeds each epoch's order.
        shuffle: a new permutation of the training rows each epoch (``False`` = file order every epoch).
    """

    name: str
    train: LoadedSplit
    validation: LoadedSplit | None
    seed: int
    shuffle: bool = True

    def step_problems(self, *, step: int, count: int) -> list[Problem]:
        """Positions ``step * count .. step * count + count - 1`` of the epoch walk (module docstring).

        Args:
            step: the step (0-based).
            count: problems per step (``grpo.num_prompts_per_step``), >= 1; may exceed the dataset size.

        Raises:
            ConfigError: a negative step or a count below 1.
        """
        _check_step(step, count)
        rows = self.train.problems
        n = len(rows)
        out = []
        for position in range(step * count, (step + 1) * count):
            epoch, index = divmod(position, n)
            out.append(rows[_epoch_order(n, seed=self.seed, epoch=epoch)[index] if self.shuffle else index])
        return out

    def validation_problems(self, *, limit: int | None) -> list[Problem]:
        """The first ``limit`` validation rows in file order (``None`` = all).

        Raises:
            ConfigError: no ``data.validation.data_path`` (the training rows are not held out).
        """
        _check_limit(limit, key="grpo.max_val_samples")
        if self.validation is None:
            raise ConfigError(
                "validation of a dataset run needs data.validation.data_path (the training rows are not held "
                "out); set it, or grpo.val_period=0 and grpo.val_at_start=false"
            )
        return list(self.validation.problems[:limit])

    def describe(self) -> str:
        """The loaded splits, one clause each."""
        parts = [self.train.describe()] + ([self.validation.describe()] if self.validation else [])
        order = f"shuffled per epoch with seed {self.seed}" if self.shuffle else "in file order"
        return "; ".join(parts) + f"; training rows {order}"


@dataclass(frozen=True)
class TaskSource:
    """Problems of the built-in toy task (``grpo.task``).

    Attributes:
        name: ``"grpo.task: <task>"``.
        task: the task.
        seed: ``grpo.seed``.
    """

    name: str
    task: ToyTask
    seed: int

    def step_problems(self, *, step: int, count: int) -> list[Problem]:
        """:func:`megatron_fp8.rl.data.task.sample_problems` of ``(seed, step, count)``."""
        _check_step(step, count)
        return sample_problems(self.task, seed=self.seed, step=step, count=count)

    def validation_problems(self, *, limit: int | None) -> list[Problem]:
        """``limit`` problems (``None`` = :data:`TASK_VALIDATION_PROBLEMS`) drawn with the seed
        ``seed + VALIDATION_SEED_OFFSET``: other draws than training's, not guaranteed disjoint from them."""
        _check_limit(limit, key="grpo.max_val_samples")
        count = TASK_VALIDATION_PROBLEMS if limit is None else limit
        return sample_problems(self.task, seed=self.seed + VALIDATION_SEED_OFFSET, step=0, count=count)

    def describe(self) -> str:
        """The task and seed."""
        return f"grpo.task: {self.task.name} (built-in, seed {self.seed}); no dataset (data.train.data_path unset)"


def problem_source(config: RunConfig, tokenizer: PromptTokenizer | None) -> ProblemSource:
    """The run's problems: the dataset of ``data.train`` when it names a file, else the toy task ``grpo.task``.

    Loads (and checks) the files now and logs :meth:`ProblemSource.describe`.

    Args:
        config: the run config (``data``, ``grpo.seed``, ``grpo.task``, ``grpo.val_period``, ``grpo.val_at_start``).
        tokenizer: the policy's tokenizer (chat template, prompt lengths); ``None`` = prompts without a chat
            template and no length limit (refused when ``data.max_input_seq_length`` is set).

    Raises:
        ConfigError: any dataset or prompt-file error; validation asked for (``grpo.val_period > 0`` or
            ``grpo.val_at_start``) on a dataset without ``data.validation.data_path``; a validation file
            without a training file.
    """
    data, g = config.data, config.grpo
    validation_cfg = data.validation if data.validation is not None and data.validation.data_path else None
    if data.train.data_path is None:
        if validation_cfg is not None:
            raise ConfigError(
                "data.validation.data_path needs data.train.data_path: without a training file GRPO trains and "
                "validates on grpo.task; set data.train.data_path or remove data.validation"
            )
        task = get_task(g.task, max_digits=g.task_max_digits)
        source: ProblemSource = TaskSource(name=f"grpo.task: {task.name}", task=task, seed=g.seed)
    else:
        if validation_cfg is None and (g.val_period > 0 or g.val_at_start):
            raise ConfigError(
                f"grpo.val_period={g.val_period}, grpo.val_at_start={g.val_at_start} on a dataset needs "
                "data.validation.data_path (the training rows are not held out); set it, or grpo.val_period=0 and "
                "grpo.val_at_start=false"
            )
        d = data.default
        build = PromptBuilder(
            template=read_prompt_template(d.prompt_file) if d.prompt_file is not None else None,
            system_prompt=_read_text_file(d.system_prompt_file, key="data.default.system_prompt_file")
            if d.system_prompt_file is not None
            else None,
            tokenizer=tokenizer,
        )
        limit = data.max_input_seq_length
        train = load_split(data.train, what="data.train", build_prompt=build, max_input_seq_length=limit)
        validation = (
            load_split(validation_cfg, what="data.validation", build_prompt=build, max_input_seq_length=limit)
            if validation_cfg is not None
            else None
        )
        source = DatasetSource(
            name=f"data.train: {Path(data.train.data_path).name}",
            train=train,
            validation=validation,
            seed=g.seed,
            shuffle=data.shuffle,
        )
    logger.info("%s", source.describe())
    return source
