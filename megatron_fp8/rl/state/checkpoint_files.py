"""The files of a GRPO checkpoint: names, digests, ``checkpoint.json``, what counts as complete, safe publish/delete.

Split from :mod:`megatron_fp8.rl.state.checkpoint` (which owns the config fingerprint, what goes into a checkpoint and
the multi-rank protocol): this module holds the storage side (file names, digests, ``checkpoint.json``, scanning,
publish/delete, the HF folder) and the per-process pieces saved with it (RNG states, versions, this rank's place
and the object collectives). It knows nothing of models or optimizers.

Layout of one arm folder::

    <checkpoint_dir>/<arm>/
        step_9/                       a complete checkpoint (step index 9 = 10 steps done)
            checkpoint.json           written last: metadata + sha256 and size of every other file
            model_tp00_pp00.pt        Megatron-Core module state dicts of model-parallel rank (tp 0, pp 0)
            optim_tp00_pp00.pt        optimizer state of that rank
            rng_rank00000.pt          RNG states of global rank 0
            hf/                       with ``save_consolidated``: config/tokenizer files + model.safetensors
        .step_19.tmp/                 a save in progress (or interrupted): never read, removed at the next save
        .step_4.deleting-1a2b3c4d/    a checkpoint being deleted: never read, removed at the next save

A folder is *complete* when its name is ``step_N``, its ``checkpoint.json`` parses, names this step, and every file
it lists exists with the listed size. Digests are checked when a rank reads a file (:func:`verify_files`), not
while scanning, so that choosing the checkpoint stays cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import random
import re
import shutil
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_fp8.config.schema import JSONValue
from megatron_fp8.files import write_atomically

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.json"
"""The metadata file of a checkpoint folder, written last."""

FORMAT_VERSION = 1
"""Version of the checkpoint layout, stored in ``checkpoint.json`` (``format``)."""

HF_DIR = "hf"
"""Sub-folder of a checkpoint holding the Hugging Face export (``save_consolidated``)."""

_STEP_RE = re.compile(r"^step_(\d+)$")
_HIDDEN_RE = re.compile(r"^\.step_\d+\.(tmp|deleting)(-[0-9a-f]+)?$")
_CHUNK_BYTES = 1 << 22


def step_dir_name(step: int) -> str:
    """``step_N``: the folder of the checkpoint after 0-based step ``step``."""
    return f"step_{step}"


def tmp_dir_name(step: int) -> str:
    """``.step_N.tmp``: the hidden folder a save of ``step`` writes into (the same name on every rank)."""
    return f".step_{step}.tmp"


def _expert_suffix(ep_rank: int | None) -> str:
    return "" if ep_rank is None else f"_ep{ep_rank:02d}"


def model_file(tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    """File of the module state dicts of model-parallel rank ``(tp_rank, pp_rank)``; under expert parallelism one per
    expert-parallel rank too (``ep_rank``; ``None`` without expert parallelism)."""
    return f"model_tp{tp_rank:02d}_pp{pp_rank:02d}{_expert_suffix(ep_rank)}.pt"


def optim_file(tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    """File of the optimizer state of model-parallel rank ``(tp_rank, pp_rank)`` (and ``ep_rank``, as model_file)."""
    return f"optim_tp{tp_rank:02d}_pp{pp_rank:02d}{_expert_suffix(ep_rank)}.pt"


def rng_file(rank: int) -> str:
    """File of the RNG states of global rank ``rank``."""
    return f"rng_rank{rank:05d}.pt"


@dataclass(frozen=True)
class FileRecord:
    """Digest and size of one checkpoint file.

    Attributes:
        sha256: hex SHA-256 of the file's bytes.
        size: bytes.
    """

    sha256: str
    size: int

    def to_json(self) -> dict[str, JSONValue]:
        """``{"sha256": ..., "bytes": ...}`` as ``checkpoint.json`` holds it."""
        return {"sha256": self.sha256, "bytes": self.size}


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint folder, as its ``checkpoint.json`` describes it.

    Attributes:
        path: the ``step_N`` folder.
        step: 0-based index of the last completed step (training resumes at ``step + 1``).
        arm: the arm it belongs to.
        metrics: the metrics of that step (non-finite values come back as ``nan``).
        extra: caller data saved with it (JSON).
        fingerprint: :func:`megatron_fp8.rl.state.fingerprint.config_fingerprint` of the run that wrote it.
        files: relative path (``/``-separated) -> digest and size, every file but ``checkpoint.json``.
        metadata: the whole ``checkpoint.json`` (versions, parallel sizes, data position, ...).
    """

    path: Path
    step: int
    arm: str
    metrics: Mapping[str, float]
    extra: Mapping[str, JSONValue]
    fingerprint: Mapping[str, JSONValue]
    files: Mapping[str, FileRecord]
    metadata: Mapping[str, JSONValue] = field(repr=False)


@dataclass(frozen=True)
class ScanResult:
    """What an arm folder holds.

    Attributes:
        complete: complete checkpoints, oldest step first.
        incomplete: ``(step_N folder, what is wrong)`` for folders that look like checkpoints but are not complete.
        leftovers: hidden ``.step_N.tmp`` / ``.step_N.deleting`` folders of an interrupted save or delete.
    """

    complete: tuple[CheckpointInfo, ...]
    incomplete: tuple[tuple[Path, str], ...]
    leftovers: tuple[Path, ...]


class IncompleteCheckpointError(Exception):
    """Internal: a ``step_N`` folder is not a complete checkpoint (the message says why)."""


class _HashingWriter:
    """A binary file wrapper that hashes and counts what goes through ``write``."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self.digest.update(view)
        self.size += view.nbytes
        return self._f.write(view)

    def flush(self) -> None:
        self._f.flush()


def save_torch(obj: object, path: Path) -> FileRecord:
    """``torch.save`` to ``path``, fsynced; the digest is taken from the bytes as they are written.

    Returns:
        The file's :class:`FileRecord`.
    """
    with path.open("wb") as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)  # type: ignore[arg-type]  # any object with write/flush
        f.flush()
        os.fsync(f.fileno())
    return FileRecord(sha256=writer.digest.hexdigest(), size=writer.size)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def record_file(path: Path) -> FileRecord:
    """fsync an already written file and return its digest and size."""
    with path.open("rb") as f:
        os.fsync(f.fileno())
    return FileRecord(sha256=sha256_file(path), size=path.stat().st_size)


def fsync_dir(path: Path) -> None:
    """fsync a folder, so that the names created or renamed in it survive a crash (no-op where unsupported)."""
    with contextlib.suppress(OSError):  # e.g. file systems that refuse opening folders
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _json_float(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def write_metadata(folder: Path, metadata: Mapping[str, JSONValue]) -> None:
    """Write ``checkpoint.json`` into ``folder`` (atomically, fsynced): the last file of a save."""
    write_atomically(folder / CHECKPOINT_FILE, json.dumps(metadata, indent=1, allow_nan=False) + "\n")


def metrics_to_json(metrics: Mapping[str, float | None]) -> dict[str, JSONValue]:
    """Metrics as JSON: non-finite floats and ``None`` become ``null`` (as ``metrics.jsonl`` writes them).

    Raises:
        TypeError: a value that is not a real number (the message names the key).
    """
    out: dict[str, JSONValue] = {}
    for key, value in metrics.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"checkpoint metric {key!r} = {value!r} is not a number; pass floats only")
        out[str(key)] = None if value is None else _json_float(float(value))
    return out


def read_checkpoint(path: Path) -> CheckpointInfo:
    """Read and check one ``step_N`` folder.

    Raises:
        IncompleteCheckpointError: no or unparsable ``checkpoint.json``, a field missing, a step other than the
            folder's, an unknown format, a listed file missing or of another size.
    """
    match = _STEP_RE.match(path.name)
    if match is None:
        raise IncompleteCheckpointError(f"folder name is not step_<N>: {path.name}")
    meta_path = path / CHECKPOINT_FILE
    if not meta_path.is_file():
        raise IncompleteCheckpointError(f"{CHECKPOINT_FILE} is missing (a save that did not finish)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IncompleteCheckpointError(f"{CHECKPOINT_FILE} does not parse: {exc}") from None
    if not isinstance(meta, dict):
        raise IncompleteCheckpointError(f"{CHECKPOINT_FILE} is not a JSON object")
    try:
        fmt, step, arm = meta["format"], meta["step"], meta["arm"]
        raw_files, raw_metrics = meta["files"], meta["metrics"]
        fingerprint, extra = meta["fingerprint"], meta.get("extra") or {}
    except KeyError as exc:
        raise IncompleteCheckpointError(f"{CHECKPOINT_FILE} lacks the field {exc.args[0]!r}") from None
    if fmt != FORMAT_VERSION:
        raise IncompleteCheckpointError(
            f"{CHECKPOINT_FILE} has format {fmt!r}; this megatron-fp8 reads {FORMAT_VERSION}"
        )
    if step != int(match.group(1)):
        raise IncompleteCheckpointError(f"{CHECKPOINT_FILE} says step {step!r}, the folder is {path.name}")
    if not isinstance(raw_files, dict) or not isinstance(raw_metrics, dict) or not isinstance(fingerprint, dict):
        raise IncompleteCheckpointError(f"{CHECKPOINT_FILE}: files, metrics and fingerprint must be JSON objects")
    files: dict[str, FileRecord] = {}
    for rel, rec in raw_files.items():
        try:
            files[rel] = FileRecord(sha256=str(rec["sha256"]), size=int(rec["bytes"]))
        except (KeyError, TypeError, ValueError):
            raise IncompleteCheckpointError(f"{CHECKPOINT_FILE}: bad record for file {rel!r}: {rec!r}") from None
        target = path / rel
        if not target.is_file():
            raise IncompleteCheckpointError(f"file {rel} is missing")
        size = target.stat().st_size
        if size != files[rel].size:
            raise IncompleteCheckpointError(f"file {rel} has {size} bytes, {files[rel].size} were written (truncated?)")
    metrics = {str(k): float("nan") if v is None else float(v) for k, v in raw_metrics.items()}
    return CheckpointInfo(
        path=path,
        step=int(step),
        arm=str(arm),
        metrics=metrics,
        extra=dict(extra),
        fingerprint=fingerprint,
        files=files,
        metadata=meta,
    )


def scan(arm_dir: Path) -> ScanResult:
    """Every checkpoint folder of one arm: the complete ones (oldest first), the broken ones, the leftovers."""
    complete: list[CheckpointInfo] = []
    incomplete: list[tuple[Path, str]] = []
    leftovers: list[Path] = []
    if not arm_dir.is_dir():
        return ScanResult(complete=(), incomplete=(), leftovers=())
    for entry in sorted(arm_dir.iterdir()):
        if not entry.is_dir():
            continue
        if _HIDDEN_RE.match(entry.name):
            leftovers.append(entry)
        elif _STEP_RE.match(entry.name):
            try:
                complete.append(read_checkpoint(entry))
            except IncompleteCheckpointError as exc:
                incomplete.append((entry, str(exc)))
    complete.sort(key=lambda info: info.step)
    return ScanResult(complete=tuple(complete), incomplete=tuple(incomplete), leftovers=tuple(leftovers))


def verify_files(info: CheckpointInfo, names: Iterable[str]) -> list[str]:
    """Check the sizes and digests of ``names`` (relative paths listed in ``info.files``).

    Returns:
        One line per problem (empty: every file is as written).
    """
    problems: list[str] = []
    for rel in names:
        rec = info.files.get(rel)
        target = info.path / rel
        if rec is None:
            problems.append(f"{rel} is not listed in {CHECKPOINT_FILE}")
        elif not target.is_file():
            problems.append(f"{rel} is missing")
        elif target.stat().st_size != rec.size:
            problems.append(f"{rel} has {target.stat().st_size} bytes, {rec.size} were written")
        elif (digest := sha256_file(target)) != rec.sha256:
            problems.append(f"{rel} has sha256 {digest[:12]}..., {rec.sha256[:12]}... was written")
    return problems


def _deleting_name(name: str) -> str:
    """``.step_N.deleting-<id>`` for the folder ``step_N`` (or ``.step_N.tmp``)."""
    match = re.search(r"step_(\d+)", name)
    return f".step_{match.group(1) if match else 0}.deleting-{uuid.uuid4().hex[:8]}"


def remove_tree(path: Path) -> None:
    """Delete a checkpoint folder safely: rename it to a hidden ``.step_N.deleting-<id>`` first, then remove that.

    A crash in the middle leaves a hidden folder that no scan takes for a checkpoint (removed at the next save).
    """
    if not path.exists():
        return
    doomed = path.with_name(_deleting_name(path.name))
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_leftovers(arm_dir: Path) -> None:
    """Remove the hidden folders of interrupted saves and deletes (one DEBUG line each)."""
    for leftover in scan(arm_dir).leftovers:
        logger.debug("removing %s, left by an interrupted checkpoint save or delete", leftover)
        shutil.rmtree(leftover, ignore_errors=True)


def publish(tmp: Path, final: Path) -> None:
    """Make a fully written ``tmp`` folder the checkpoint ``final``: fsync it, rename, fsync the parent.

    An existing ``final`` (a broken checkpoint of the same step) is first renamed away and removed after.
    """
    fsync_dir(tmp)
    replaced: Path | None = None
    if final.exists():
        replaced = final.with_name(_deleting_name(final.name))
        os.rename(final, replaced)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


_HF_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def hf_dtype(source: Path) -> torch.dtype:
    """The parameter dtype of a Hugging Face folder (``dtype`` / ``torch_dtype`` of its ``config.json``; BF16 when
    absent or unknown): the dtype a consolidated export is written in."""
    try:
        config = json.loads((source / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return torch.bfloat16
    name = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return _HF_DTYPES.get(str(name), torch.bfloat16)


def write_hf_folder(tensors: Mapping[str, torch.Tensor], *, source: Path, dest: Path) -> dict[str, FileRecord]:
    """Write a Hugging Face folder: the non-weight files of ``source`` (config, tokenizer) + ``model.safetensors``.

    Args:
        tensors: HF-named weights, written as they are (cast them first).
        source: the base model's folder.
        dest: the folder to create (inside a checkpoint's temporary folder).

    Returns:
        ``"hf/<name>"`` -> :class:`FileRecord` of every file written (fsynced).
    """
    dest.mkdir(parents=True)
    records: dict[str, FileRecord] = {}
    for f in sorted(source.iterdir()):
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copyfile(f, dest / f.name)
            records[f"{dest.name}/{f.name}"] = record_file(dest / f.name)
    save_file(
        {n: t.detach().contiguous() for n, t in tensors.items()}, str(dest / "model.safetensors"), {"format": "pt"}
    )
    records[f"{dest.name}/model.safetensors"] = record_file(dest / "model.safetensors")
    fsync_dir(dest)
    return records


# ----------------------------------------------------------------------------- RNG


def _megatron_rng_tracker() -> object | None:
    """Megatron's tensor-parallel RNG tracker when one is initialised, else ``None``."""
    try:
        from megatron.core.tensor_parallel import random as tp_random  # lazy: Megatron-Core is optional
    except ImportError:
        return None
    if not getattr(tp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):  # asking would create one
        return None
    return tp_random.get_cuda_rng_tracker()


def capture_rng() -> dict[str, object]:
    """Every RNG state of this process: Python, NumPy, torch CPU, this rank's CUDA device (once CUDA is in use),
    Megatron's tensor-parallel tracker (when initialised)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, object] = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # this rank's GPU only: no context on the others
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = _megatron_rng_tracker()
    if tracker is not None:
        state["megatron_tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
    return state


def restore_rng(state: Mapping[str, object]) -> None:
    """Set the RNG states :func:`capture_rng` returned (CUDA and Megatron's tracker where both sides have them)."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda)  # the current device, as captured
        else:
            logger.warning("the checkpoint holds a CUDA RNG state and this process has no GPU: not restored")
    tracker_states = state.get("megatron_tracker")
    tracker = _megatron_rng_tracker()
    if tracker_states is not None and tracker is not None:
        tracker.set_states(dict(tracker_states))


def versions() -> dict[str, JSONValue]:
    """Versions of torch, megatron-core, megatron-bridge and megatron-fp8 (``None`` where not installed)."""
    out: dict[str, JSONValue] = {"torch": torch.__version__}
    for dist_name in ("megatron-core", "megatron-bridge", "megatron-fp8"):
        try:
            out[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            out[dist_name] = None
    return out


# ----------------------------------------------------------------------------- ranks and collectives


@dataclass(frozen=True)
class Place:
    """Where this process sits: which checkpoint files it writes and reads.

    Attributes:
        rank: global rank (0 without torch.distributed).
        world_size: number of processes.
        tp_rank: tensor-parallel rank (0 without Megatron-Core parallel state).
        pp_rank: pipeline-parallel rank.
        tp_size: tensor-parallel size.
        pp_size: pipeline-parallel size.
        dp_rank: data-parallel rank: rank 0 of each ``(tp, pp)`` writes that shard's model and optimizer files.
    """

    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int
    dp_rank: int
    ep_rank: int = 0
    ep_size: int = 1
    expert_dp_rank: int = 0

    @property
    def writes_model(self) -> bool:
        """One writer per model shard: data-parallel rank 0, or under expert parallelism (each EP rank holds other
        experts) expert-data-parallel rank 0 of each EP rank."""
        return self.dp_rank == 0 if self.ep_size == 1 else self.expert_dp_rank == 0

    def files(self) -> tuple[str, str]:
        """This rank's ``(model file, optimizer file)``."""
        ep = self.ep_rank if self.ep_size > 1 else None
        return model_file(self.tp_rank, self.pp_rank, ep), optim_file(self.tp_rank, self.pp_rank, ep)


def current_place() -> Place:
    """This process's :class:`Place` (torch.distributed and Megatron-Core parallel state when initialised)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    try:
        from megatron.core import parallel_state  # lazy: Megatron-Core is optional (the GPU test box has torch only)
    except ImportError:
        parallel_state = None
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return Place(rank, world, 0, 0, 1, 1, rank)
    return Place(
        rank=rank,
        world_size=world,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_dp_rank=parallel_state.get_expert_data_parallel_rank(),
    )


def barrier(place: Place) -> None:
    """``dist.barrier()`` when there are several processes."""
    if place.world_size > 1:
        dist.barrier()


def all_gather(obj: object, place: Place) -> list[object]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if place.world_size == 1:
        return [obj]
    out: list[object] = [None] * place.world_size
    dist.all_gather_object(out, obj)
    return out


def from_writer(obj: object, place: Place) -> object:
    """``obj`` of rank 0 (the writer) on every rank."""
    if place.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
