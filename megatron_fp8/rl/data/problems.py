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

**Validation** of a dataset run reads rows held out of the training file (``data.train.split_validation_size``,
drawn as NeMo-RL draws them: :mod:`megatron_fp8.rl.data.holdout`; never trained on) and then the rows of
``data.validation.data_path``, as NeMo-RL merges them. With neither, :func:`problem_source` refuses
``grpo.val_period > 0`` or ``grpo.val_at_start`` (as NeMo-RL does). A toy-task run validates on problems drawn
with the seed ``grpo.seed + VALIDATION_SEED_OFFSET`` (the toy tasks have few distinct problems, so some may also
occur in training).

Files are read and checked by :mod:`megatron_fp8.rl.data.files` (:func:`load_rows` is re-exported here); a
NeMo-RL ``examples/prompts/*.txt`` prompt file that does not exist here reads NeMo-RL's own text
(:mod:`megatron_fp8.config.nemo_rl.prompts`).
"""

from __future__ import annotations

import functools
import logging
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megatron_fp8.config.nemo_rl.datasets import column_value
from megatron_fp8.config.nemo_rl.prompts import nemo_rl_prompt
from megatron_fp8.config.schema import DatasetConfig, RunConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.data.files import SUFFIXES as SUFFIXES
from megatron_fp8.rl.data.files import check_limit, load_rows
from megatron_fp8.rl.data.holdout import HeldOut, hold_out
from megatron_fp8.rl.data.task import Problem, ToyTask, get_task, sample_problems

logger = logging.getLogger(__name__)

VALIDATION_SEED_OFFSET = 104729
"""Added to ``grpo.seed`` for the toy task's validation problems (the warm start uses another offset)."""

TASK_VALIDATION_PROBLEMS = 64
"""Toy-task validation problems when ``grpo.max_val_samples`` is ``None`` (the task has no fixed size)."""


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


def _read_text_file(path: str, *, key: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file() and not file.exists() and (text := nemo_rl_prompt(path, key=key)) is not None:
        return text
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
    rows: list[dict[str, Any]] | None = None,
) -> LoadedSplit:
    """Read a dataset file and turn each row into a :class:`Problem`.

    Args:
        cfg: the dataset section.
        what: its config key (``"data.train"``), or a label of part of it (``"data.train (held out)"``).
        build_prompt: problem text -> prompt.
        max_input_seq_length: longest prompt kept (tokens, ``build_prompt.tokenizer.encode(prompt,
            add_special_tokens=False)``); longer rows are skipped, counted and logged once. ``None`` = no limit.
        rows: the rows, already read and checked (part of the file, :mod:`megatron_fp8.rl.data.holdout`);
            ``None`` = read the file.

    Raises:
        ConfigError: any :func:`load_rows` error; a limit without a tokenizer; every prompt too long (the
            message gives the shortest one's length).
    """
    check_limit(max_input_seq_length, key="data.max_input_seq_length")
    rows = load_rows(cfg, what=what) if rows is None else rows
    tokenizer = build_prompt.tokenizer
    if max_input_seq_length is not None and tokenizer is None:
        raise ConfigError("data.max_input_seq_length needs the model's tokenizer to count prompt tokens")
    problems: list[Problem] = []
    skipped: list[tuple[int, int]] = []  # (row number, tokens)
    for number, row in enumerate(rows, 1):
        prompt = build_prompt(column_value(row, cfg.input_key))
        if max_input_seq_length is not None:
            n_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
            if n_tokens > max_input_seq_length:
                skipped.append((number, n_tokens))
                continue
        problems.append(Problem(prompt=prompt, answer=str(column_value(row, cfg.output_key))))
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
        train: the training split (without its held-out rows).
        validation: the validation split, ``None`` = none.
        seed: ``grpo.seed``; with ``shuffle`` it seeds each epoch's order.
        shuffle: a new permutation of the training rows each epoch (``False`` = file order every epoch).
        held_out: rows of the training file held out for validation (``data.train.split_validation_size``),
            validated before ``validation``'s; ``None`` = none. With neither, :meth:`validation_problems` refuses.
    """

    name: str
    train: LoadedSplit
    validation: LoadedSplit | None
    seed: int
    shuffle: bool = True
    held_out: LoadedSplit | None = None

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
        """The first ``limit`` validation rows (``None`` = all): the held-out rows of the training file (in
        NeMo-RL's draw order), then ``data.validation``'s in file order.

        Raises:
            ConfigError: no ``data.validation.data_path`` and no held-out rows.
        """
        check_limit(limit, key="grpo.max_val_samples")
        if self.validation is None and self.held_out is None:
            raise ConfigError(
                "validation of a dataset run needs data.validation.data_path or data.train.split_validation_size > 0 "
                "(the training rows are not held out); set one, or grpo.val_period=0 and grpo.val_at_start=false"
            )
        parts = [s for s in (self.held_out, self.validation) if s is not None]
        return [problem for split in parts for problem in split.problems][:limit]

    def describe(self) -> str:
        """The loaded splits, one clause each."""
        parts = [self.train.describe()] + [s.describe() for s in (self.held_out, self.validation) if s is not None]
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
        check_limit(limit, key="grpo.max_val_samples")
        count = TASK_VALIDATION_PROBLEMS if limit is None else limit
        return sample_problems(self.task, seed=self.seed + VALIDATION_SEED_OFFSET, step=0, count=count)

    def describe(self) -> str:
        """The task and seed."""
        return f"grpo.task: {self.task.name} (built-in, seed {self.seed}); no dataset (data.train.data_path unset)"


def _dataset_source(config: RunConfig, tokenizer: PromptTokenizer | None) -> DatasetSource:
    """The :class:`DatasetSource` of ``data.train`` (its held-out rows) and ``data.validation``."""
    data, g = config.data, config.grpo
    validation_cfg = data.validation if data.validation is not None and data.validation.data_path else None
    if validation_cfg is not None and validation_cfg.split_validation_size:
        raise ConfigError(
            f"data.validation.split_validation_size={validation_cfg.split_validation_size!r}: rows are held out of "
            "the training file only; set data.train.split_validation_size instead, or remove it"
        )
    held_size = data.train.split_validation_size
    if validation_cfg is None and not held_size and (g.val_period > 0 or g.val_at_start):
        raise ConfigError(
            f"grpo.val_period={g.val_period}, grpo.val_at_start={g.val_at_start} on a dataset needs "
            "data.validation.data_path or data.train.split_validation_size > 0 (the training rows are not held out); "
            "set one, or grpo.val_period=0 and grpo.val_at_start=false"
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
    split: HeldOut = hold_out(
        load_rows(data.train, what="data.train"),
        size=held_size,
        seed=data.train.seed,
        key="data.train.split_validation_size",
    )
    train = load_split(data.train, what="data.train", build_prompt=build, max_input_seq_length=limit, rows=split.train)
    held_out = (
        load_split(
            data.train,
            what=f"data.train held out (split_validation_size {held_size:g}, seed {split.seed})",
            build_prompt=build,
            max_input_seq_length=limit,
            rows=split.validation,
        )
        if split.validation
        else None
    )
    validation = (
        load_split(validation_cfg, what="data.validation", build_prompt=build, max_input_seq_length=limit)
        if validation_cfg is not None
        else None
    )
    return DatasetSource(
        name=f"data.train: {Path(str(data.train.data_path)).name}",
        train=train,
        validation=validation,
        seed=g.seed,
        shuffle=data.shuffle,
        held_out=held_out,
    )


def problem_source(config: RunConfig, tokenizer: PromptTokenizer | None, *, log: bool = True) -> ProblemSource:
    """The run's problems: the dataset of ``data.train`` when it names a file, else the toy task ``grpo.task``.

    Loads (and checks) the files now, holds out ``data.train.split_validation_size`` of the training rows for
    validation, and logs :meth:`ProblemSource.describe`.

    Args:
        config: the run config (``data``, ``grpo.seed``, ``grpo.task``, ``grpo.val_period``, ``grpo.val_at_start``).
        tokenizer: the policy's tokenizer (chat template, prompt lengths); ``None`` = prompts without a chat
            template and no length limit (refused when ``data.max_input_seq_length`` is set).
        log: log the description (``False``: the preflight, which built the same source, logged it).

    Raises:
        ConfigError: any dataset or prompt-file error; validation asked for (``grpo.val_period > 0`` or
            ``grpo.val_at_start``) on a dataset with neither ``data.validation.data_path`` nor held-out rows; a
            bad ``split_validation_size``; a validation file without a training file.
    """
    data, g = config.data, config.grpo
    if data.train.data_path is None:
        if data.validation is not None and data.validation.data_path:
            raise ConfigError(
                "data.validation.data_path needs data.train.data_path: without a training file GRPO trains and "
                "validates on grpo.task; set data.train.data_path or remove data.validation"
            )
        task = get_task(g.task, max_digits=g.task_max_digits)
        source: ProblemSource = TaskSource(name=f"grpo.task: {task.name}", task=task, seed=g.seed)
    else:
        source = _dataset_source(config, tokenizer)
    if log:
        logger.info("%s", source.describe())
    return source
