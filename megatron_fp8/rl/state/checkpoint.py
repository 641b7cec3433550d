"""GRPO checkpoints and resume (NeMo-RL's ``checkpointing`` section): one folder per arm, ``step_N`` in each.

What a checkpoint holds (file names in :mod:`megatron_fp8.rl.state.checkpoint_files`):

* the Megatron-Core model: every chunk's ``state_dict()``, one file per model-parallel rank ``(tp, pp)``;
* the optimizer's ``state_dict()`` per model-parallel rank (the CPU Adam's includes its FP32 main weights;
  Megatron-Core's optimizer on a GPU has its own);
* the RNG states of every rank: Python ``random``, NumPy, torch CPU, its CUDA device (once in use), Megatron's
  tensor-parallel RNG tracker (when initialised);
* ``checkpoint.json``: arm, step, data position (the data source is a pure function of ``grpo.seed`` and the step,
  so the step is the position), the step's metrics, caller ``extra`` data, the config fingerprint
  (:func:`~megatron_fp8.rl.state.fingerprint.config_fingerprint`), versions (torch, megatron-core, megatron-fp8), parallel sizes, and the SHA-256 and
  size of every other file;
* with ``save_consolidated``: ``hf/``, a Hugging Face folder (``model.safetensors`` in the base model's dtype, BF16
  for the embedded models, + its config and tokenizer files) that ``AutoModelForCausalLM.from_pretrained`` reads.

Atomicity: a save writes into the hidden ``.step_N.tmp``, fsyncs every file, writes ``checkpoint.json`` last and
renames the folder to ``step_N`` (then fsyncs the arm folder). A crash leaves a hidden folder (ignored with a
warning, removed at the next save) or a ``step_N`` whose files do not match ``checkpoint.json`` (skipped with a
warning): never a folder that passes for complete. Digests are checked when the files are read; a damaged
checkpoint makes :meth:`CheckpointManager.load_latest` fall back to the previous complete one.

Multi-rank contract (``torch.distributed`` initialised): every rank calls :meth:`~CheckpointManager.save`,
:meth:`~CheckpointManager.load_latest` (or :meth:`~CheckpointManager.latest` + :meth:`~CheckpointManager.load`) with
the same arguments, in the same order. ``is_writer`` must be true on global rank 0 only: it creates and publishes
the folder, writes ``checkpoint.json`` and ``hf/``, prunes, and chooses the checkpoint to resume from (broadcast to
the others). The model and optimizer files of each ``(tp, pp)`` are written by its data-parallel rank 0 (DP replicas
are identical); every rank writes its own RNG file. Barriers keep any rank from reading before the writer is done,
and a failure on any rank fails the save on all of them. The folder must be on a file system every rank sees.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import math
import pickle
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from megatron_fp8.config.schema import CheckpointingConfig, JSONValue
from megatron_fp8.errors import ConfigError, MegatronFP8Error
from megatron_fp8.files import DISK_ERRNOS, disk_error_kind, free_bytes
from megatron_fp8.megatron import MegatronModel, export_hf_weights
from megatron_fp8.rl.state.checkpoint_files import (
    FORMAT_VERSION,
    HF_DIR,
    CheckpointInfo,
    FileRecord,
    Place,
    all_gather,
    barrier,
    capture_rng,
    current_place,
    from_writer,
    hf_dtype,
    metrics_to_json,
    publish,
    remove_leftovers,
    remove_tree,
    restore_rng,
    rng_file,
    save_torch,
    scan,
    step_dir_name,
    tmp_dir_name,
    verify_files,
    versions,
    write_hf_folder,
    write_metadata,
)
from megatron_fp8.rl.state.fingerprint import fingerprint_differences

logger = logging.getLogger(__name__)


class CheckpointError(MegatronFP8Error, RuntimeError):
    """A checkpoint could not be written or read (the message names the folder, the file and the rank)."""


_FULL = DISK_ERRNOS[errno.ENOSPC]


def disk_problem(exc: BaseException, where: Path, *, needed: int) -> str | None:
    """One line for a save that failed because the filesystem is full or read-only, ``None`` for other failures
    (:func:`megatron_fp8.files.disk_error_kind`: safetensors' and torch's ways of saying so included)."""
    kind = disk_error_kind(exc, where)
    if kind is None:
        return None
    free = free_bytes(where)
    need = f"the last checkpoint took {needed} bytes" if needed else "no earlier checkpoint to size it by"
    return (
        f"{kind} on the filesystem of {where} ({free if free is not None else '?'} bytes free; {need}); the partial "
        "files were removed and the previous checkpoints are untouched: free space, or set "
        "checkpointing.checkpoint_dir to a larger filesystem"
    )


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files do not match the digests in its ``checkpoint.json``; nothing was restored from it."""


class CheckpointMismatchError(ConfigError):
    """The checkpoint to resume from was written with another configuration.

    Attributes:
        differences: ``(dotted key, value in the checkpoint, value now)`` per differing key.
    """

    def __init__(self, message: str, *, differences: tuple[tuple[str, JSONValue, JSONValue], ...]):
        super().__init__(message)
        self.differences = differences


class CheckpointableOptimizer(Protocol):
    """What a checkpoint needs of an optimizer (met by :class:`~megatron_fp8.megatron.optim.MegatronDDPAdam` and
    Megatron-Core's ``MegatronOptimizer``)."""

    def state_dict(self) -> dict:
        """The optimizer's state (moments, step counts, main weights)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output."""
        ...


@dataclass(frozen=True)
class ResumeState:
    """What :meth:`CheckpointManager.load` restored besides the model, optimizer and RNG.

    Attributes:
        step: 0-based index of the last completed step; training continues at ``step + 1``.
        metrics: that step's metrics as saved (non-finite values as ``nan``).
        extra: the caller's ``extra`` data of that save.
        path: the checkpoint folder.
    """

    step: int
    metrics: Mapping[str, float]
    extra: Mapping[str, JSONValue]
    path: Path

    @property
    def next_step(self) -> int:
        """The first step to run after resuming."""
        return self.step + 1


# ----------------------------------------------------------------------------- the manager


def _torch_load(path: Path) -> object:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path}: holds an object torch.load(weights_only=True) refuses: {exc}") from None


class CheckpointManager:
    """Saves and restores one arm's trainer state under ``<checkpoint_dir>/<arm>/step_N``.

    Args:
        cfg: the ``checkpointing`` section.
        arm: the arm name (its folder).
        fingerprint: :func:`~megatron_fp8.rl.state.fingerprint.config_fingerprint` of this run; a checkpoint with another one is refused.
        is_writer: true on global rank 0 only (see the module docstring for the multi-rank contract).

    Raises:
        ConfigError: ``save_period < 1``, ``keep_top_k < 1``, or an empty arm name.
    """

    def __init__(self, *, cfg: CheckpointingConfig, arm: str, fingerprint: Mapping[str, JSONValue], is_writer: bool):
        if cfg.save_period < 1:
            raise ConfigError(f"checkpointing.save_period must be >= 1, got {cfg.save_period}")
        if cfg.keep_top_k is not None and cfg.keep_top_k < 1:
            raise ConfigError(f"checkpointing.keep_top_k must be >= 1 or null (keep all), got {cfg.keep_top_k}")
        if not arm or "/" in arm:
            raise ConfigError(f"checkpoint arm name {arm!r} must be a non-empty folder name")
        self.cfg = cfg
        self.arm = arm
        self.fingerprint = dict(fingerprint)
        self.is_writer, self.run_extra = is_writer, {}  # run_extra: in every checkpoint's ``extra`` (the out folder)

    @property
    def arm_dir(self) -> Path:
        """``<checkpoint_dir>/<arm>``."""
        return Path(self.cfg.checkpoint_dir) / self.arm

    def should_save(self, step: int, *, last: bool) -> bool:
        """Whether to save after 0-based step ``step``: every ``save_period`` steps and after the last (never when
        ``checkpointing.enabled`` is false)."""
        return self.cfg.enabled and ((step + 1) % self.cfg.save_period == 0 or last)

    def _check_place(self, place: Place) -> None:
        if place.world_size > 1 and self.is_writer != (place.rank == 0):
            raise ConfigError(
                f"rank {place.rank}: CheckpointManager(is_writer={self.is_writer}); the writer must be global rank 0 "
                "and only it (pass DataParallel.is_writer)"
            )

    # -- choosing a checkpoint

    def checkpoints(self) -> tuple[CheckpointInfo, ...]:
        """This arm's complete checkpoints, oldest first (no digest check, no warnings, this rank's view)."""
        return scan(self.arm_dir).complete

    def _candidates(self, place: Place) -> tuple[CheckpointInfo, ...]:
        """Complete checkpoints, newest first, as the writer sees them (broken ones and leftovers: one warning each)."""
        found: tuple[CheckpointInfo, ...] = ()
        if self.is_writer or place.world_size == 1:
            result = scan(self.arm_dir)
            for path, why in result.incomplete:
                logger.warning("arm %s: skipping checkpoint %s, it is not complete: %s", self.arm, path, why)
            for path in result.leftovers:
                logger.warning(
                    "arm %s: ignoring %s, left by an interrupted checkpoint save or delete (removed at the next save)",
                    self.arm,
                    path,
                )
            found = tuple(reversed(result.complete))
        return from_writer(found, place)  # type: ignore[return-value]

    def check_fingerprint(self, info: CheckpointInfo) -> None:
        """Refuse a checkpoint of another arm or configuration.

        Raises:
            CheckpointMismatchError: listing every differing dotted key with both values.
        """
        diffs = fingerprint_differences(info.fingerprint, self.fingerprint)
        if info.arm != self.arm:
            diffs = (("arm", info.arm, self.arm), *diffs)
        if not diffs:
            return
        lines = "\n".join(f"  {key}: {old!r} (checkpoint) != {new!r} (now)" for key, old, new in diffs)
        raise CheckpointMismatchError(
            f"checkpoint {info.path} was written by another configuration; {len(diffs)} key(s) differ:\n{lines}\n"
            f"Resume with the configuration that wrote it, or set checkpointing.checkpoint_dir to another folder "
            f"(or remove {self.arm_dir}) to start this arm afresh.",
            differences=diffs,
        )

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint of this arm (broken newer ones are skipped with a warning), or ``None``.

        Collective when ``torch.distributed`` is initialised (the writer scans, every rank gets its answer).

        Raises:
            CheckpointMismatchError: it was written with another configuration (see :meth:`check_fingerprint`).
        """
        place = current_place()
        self._check_place(place)
        candidates = self._candidates(place)
        if not candidates:
            return None
        self.check_fingerprint(candidates[0])
        return candidates[0]

    # -- saving

    def save(
        self,
        *,
        step: int,
        model: MegatronModel,
        optimizer: CheckpointableOptimizer,
        metrics: Mapping[str, float],
        extra: Mapping[str, JSONValue] | None = None,
    ) -> Path:
        """Save the state after 0-based step ``step`` as ``step_N``; then keep ``keep_top_k``. Collective.

        Args:
            step: the last completed step.
            model: the trainer (its chunks' ``state_dict()``; ``hf/`` via Megatron-Bridge with ``save_consolidated``).
            optimizer: the trainer's optimizer.
            metrics: the step's metrics (floats; the ranking of ``keep_top_k`` reads ``metric_name`` here).
            extra: more JSON data to get back from :meth:`load` (e.g. the step's whole metrics record).

        Returns:
            The ``step_N`` folder.

        Raises:
            CheckpointError: with several processes, a rank failed to write (every rank raises); one process
                raises the error itself (e.g. ``OSError``). Either way the earlier checkpoints are untouched and the
                hidden temporary folder is removed at the next save.
            TypeError: a metric is not a number, or ``extra`` is not JSON (``ValueError`` for NaN in it).
        """
        rng = capture_rng()  # first: nothing below may change what is saved
        place = current_place()
        self._check_place(place)
        metrics_json = metrics_to_json(metrics)
        extra_json = json.loads(json.dumps({**self.run_extra, **dict(extra or {})}, allow_nan=False))
        tmp, final = self.arm_dir / tmp_dir_name(step), self.arm_dir / step_dir_name(step)
        if self.is_writer:
            self.arm_dir.mkdir(parents=True, exist_ok=True)
            remove_leftovers(self.arm_dir)
            tmp.mkdir()
        barrier(place)
        outcome: dict[str, FileRecord] | str
        needed = self._last_size()
        try:
            self._check_space(final, needed)
            outcome = self._write_files(tmp, place, model=model, optimizer=optimizer, rng=rng)
        except Exception as exc:  # reported to every rank below, so that none waits for the failed one forever
            full = disk_problem(exc, self.arm_dir, needed=needed)
            if place.world_size == 1:
                if full is None:
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(f"arm {self.arm}: saving step {step} to {final} failed: {full}") from exc
            logger.exception("rank %d: writing checkpoint %s failed", place.rank, tmp)
            outcome = f"rank {place.rank}: {full or f'{type(exc).__name__}: {exc}'}"
        gathered = all_gather(outcome, place)
        failures = [g for g in gathered if isinstance(g, str)]
        if failures:
            if self.is_writer and any(_FULL in f for f in failures):
                shutil.rmtree(tmp, ignore_errors=True)  # every rank is past its writes (the gather)
            raise CheckpointError(
                f"arm {self.arm}: saving step {step} to {final} failed ({'; '.join(failures)}); the previous "
                "checkpoints are untouched"
            )
        error: str | None = None
        if self.is_writer:
            files: dict[str, FileRecord] = {}
            for records in gathered:
                files.update(records)  # type: ignore[arg-type]
            try:
                write_metadata(tmp, self._metadata(step, place, model, metrics_json, extra_json, files))
                publish(tmp, final)
            except Exception as exc:  # told to every rank below (one process: raised as it is)
                full = disk_problem(exc, self.arm_dir, needed=needed)
                if full is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                if place.world_size == 1:
                    if full is None:
                        raise
                    raise CheckpointError(f"arm {self.arm}: saving step {step} to {final} failed: {full}") from exc
                logger.exception("writing checkpoint %s failed", final)
                error = f"rank {place.rank}: {full or f'{type(exc).__name__}: {exc}'}"
            else:
                size = sum(r.size for r in files.values()) / 2**20
                logger.info("arm %s: checkpoint after step %d saved to %s (%.1f MiB)", self.arm, step, final, size)
                self._prune(step)
        error = from_writer(error, place)  # also the barrier: nobody reads before the writer is done
        if error is not None:
            raise CheckpointError(f"arm {self.arm}: saving step {step} to {final} failed ({error}); earlier ones stay")
        return final

    def _last_size(self) -> int:
        """Bytes of this arm's newest complete checkpoint (0 before the first): what the next save needs."""
        done = self.checkpoints()
        return sum(r.size for r in done[-1].files.values()) if done else 0

    def _check_space(self, final: Path, needed: int) -> None:
        """Refuse to start a save the filesystem cannot hold (judged from the last checkpoint's size)."""
        free = shutil.disk_usage(self.arm_dir).free
        if needed and free < needed:
            raise OSError(errno.ENOSPC, f"{free} bytes free, the last checkpoint took {needed}", str(final))

    def _write_files(
        self, tmp: Path, place: Place, *, model: MegatronModel, optimizer: CheckpointableOptimizer, rng: object
    ) -> dict[str, FileRecord]:
        records: dict[str, FileRecord] = {}
        optimizer_state = optimizer.state_dict()  # on every rank: the distributed optimizer gathers its shards
        if place.writes_model:  # one writer per (tp, pp[, ep]) shard: data-parallel replicas are identical
            model_name, optim_name = place.files()
            records[model_name] = save_torch({"chunks": [c.state_dict() for c in model.model]}, tmp / model_name)
            records[optim_name] = save_torch(optimizer_state, tmp / optim_name)
        name = rng_file(place.rank)
        records[name] = save_torch(rng, tmp / name)
        if self.cfg.save_consolidated:
            dtype = hf_dtype(model.hf_path)
            # collective over the model-parallel group: every rank iterates the whole stream
            tensors = {
                n: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t for n, t in export_hf_weights(model)
            }
            if self.is_writer:
                records.update(write_hf_folder(tensors, source=model.hf_path, dest=tmp / HF_DIR))
        return records

    def _metadata(
        self,
        step: int,
        place: Place,
        model: MegatronModel,
        metrics: dict[str, JSONValue],
        extra: dict[str, JSONValue],
        files: dict[str, FileRecord],
    ) -> dict[str, JSONValue]:
        return {
            "format": FORMAT_VERSION,
            "arm": self.arm,
            "step": step,
            "data_step": step,  # the data source is a pure function of (grpo.seed, step): resume at step + 1
            "metrics": metrics,
            "extra": extra,
            "fingerprint": self.fingerprint,
            "versions": versions(),
            "parallel": {
                "tensor": place.tp_size,
                "pipeline": place.pp_size,
                "expert": place.ep_size,
                "world_size": place.world_size,
            },
            "param_dtype": str(model.dtype).removeprefix("torch."),
            "hf_dtype": str(hf_dtype(model.hf_path)).removeprefix("torch.") if self.cfg.save_consolidated else None,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "files": {name: files[name].to_json() for name in sorted(files)},
        }

    def _prune(self, saved: int) -> None:
        """Keep ``keep_top_k`` complete checkpoints: the one just saved (step ``saved``), then the best by
        ``metric_name`` (lacking it: last), else the newest. Newer steps left by an abandoned damaged trajectory
        rank like any other."""
        k = self.cfg.keep_top_k
        complete = scan(self.arm_dir).complete
        if k is None or len(complete) <= k:
            return
        others = [info for info in complete if info.step != saved]
        name = self.cfg.metric_name
        sign = -1.0 if self.cfg.higher_is_better else 1.0

        def rank(info: CheckpointInfo) -> tuple[int, float, int]:
            """Sort key, best first; ties and ``metric_name=None``: the newer first."""
            if name is None:
                return (0, 0.0, -info.step)
            value = info.metrics.get(name)
            if value is None or not math.isfinite(value):
                return (1, 0.0, -info.step)  # lacking the metric: last
            return (0, sign * value, -info.step)

        others.sort(key=rank)
        kept = {saved, *(info.step for info in others[: k - 1])}
        for info in complete:
            if info.step not in kept:
                logger.info(
                    "arm %s: removing checkpoint %s (keep_top_k=%d, by %s)", self.arm, info.path, k, name or "step"
                )
                remove_tree(info.path)

    # -- loading

    def load(self, info: CheckpointInfo, *, model: MegatronModel, optimizer: CheckpointableOptimizer) -> ResumeState:
        """Restore model, optimizer and RNG from ``info``. Collective.

        Every rank checks the digests of the files it reads before anything is restored, so a damaged checkpoint
        leaves the model and optimizer as they were.

        Raises:
            CheckpointMismatchError: another configuration or arm wrote it.
            CheckpointCorruptError: a file does not match its digest or size (on any rank; nothing restored).
            ConfigError: other tensor/pipeline-parallel sizes or another number of model chunks.
        """
        place = current_place()
        self._check_place(place)
        self.check_fingerprint(info)
        parallel = info.metadata.get("parallel") or {}
        saved = (parallel.get("tensor"), parallel.get("pipeline"), parallel.get("expert", 1))
        if saved != (place.tp_size, place.pp_size, place.ep_size):
            raise ConfigError(
                f"checkpoint {info.path} was saved with tensor/pipeline/expert parallel sizes "
                f"{'/'.join(map(str, saved))}, this run has {place.tp_size}/{place.pp_size}/{place.ep_size}; "
                "resume with the same sizes"
            )
        names = list(place.files())
        rng_name = rng_file(place.rank)
        has_rng = rng_name in info.files
        problems = verify_files(info, [*names, rng_name] if has_rng else names)
        gathered: list[list[str]] = all_gather(problems, place)  # type: ignore[assignment]
        every = [f"rank {r}: {p}" if place.world_size > 1 else p for r, ps in enumerate(gathered) for p in ps]
        if every:
            raise CheckpointCorruptError(f"checkpoint {info.path} is damaged: {'; '.join(every)}")
        chunks = _torch_load(info.path / names[0])["chunks"]  # type: ignore[index]
        if len(chunks) != len(model.model):
            raise ConfigError(
                f"checkpoint {info.path} holds {len(chunks)} model chunks, the model has {len(model.model)}"
            )
        for chunk, state in zip(model.model, chunks, strict=True):
            chunk.load_state_dict(state, strict=True)
        optimizer.load_state_dict(_torch_load(info.path / names[1]))  # type: ignore[arg-type]
        if has_rng:
            restore_rng(_torch_load(info.path / rng_name))  # type: ignore[arg-type]
        else:
            logger.warning(
                "checkpoint %s has no RNG state of rank %d (another world size?); RNG not restored",
                info.path,
                place.rank,
            )
        logger.debug(
            "arm %s: resumed from %s (step %d done, continuing at step %d)",
            self.arm,
            info.path,
            info.step,
            info.step + 1,
        )
        return ResumeState(step=info.step, metrics=dict(info.metrics), extra=dict(info.extra), path=info.path)

    def load_latest(self, *, model: MegatronModel, optimizer: CheckpointableOptimizer) -> ResumeState | None:
        """Resume from the newest usable checkpoint: a damaged one is skipped with a warning and the previous tried.

        Returns:
            The :class:`ResumeState`, or ``None`` when ``checkpointing.enabled`` is false or no checkpoint is usable
            (start at step 0). Collective.

        Raises:
            CheckpointMismatchError: the checkpoint to resume from was written with another configuration.
        """
        if not self.cfg.enabled:
            return None
        place = current_place()
        self._check_place(place)
        for info in self._candidates(place):
            self.check_fingerprint(info)
            try:
                return self.load(info, model=model, optimizer=optimizer)
            except CheckpointCorruptError as exc:
                logger.warning("arm %s: %s; falling back to the previous complete checkpoint", self.arm, exc)
        logger.info("arm %s: no checkpoint in %s, starting at step 0", self.arm, self.arm_dir)
        return None
