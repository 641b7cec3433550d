"""TensorBoard and W&B (offline) loggers: the same scalars as ``metrics.jsonl``, read back from the real files."""

from __future__ import annotations

import dataclasses
import logging
import math
import struct
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from megatron_fp8.config.schema import LoggerConfig, WandbConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.algorithm.correction import ISConfig, compute_is_weights
from megatron_fp8.rl.algorithm.metrics import METRIC_KEYS, mismatch_metrics
from megatron_fp8.rl.state.loggers import (
    SCALAR_GROUPS,
    MultiLogger,
    NullLogger,
    TensorBoardLogger,
    WandbLogger,
    build_loggers,
    step_scalars,
    validation_scalars,
)
from megatron_fp8.rl.state.results import StepMetrics

TRAIN = [[-1.0, -2.0, -0.5, 0.0], [-0.3, -0.3, 0.0, 0.0]]
ROLL = [[-1.5, -1.0, -0.5, 3.0], [-0.1, -1.1, 0.0, 0.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0]]


def _metrics(step: int, *, arm: str = "fp8", reward: float = 0.5, refit_error: float = 1e-3) -> StepMetrics:
    """A step with every field set, its mismatch dict from the real :func:`mismatch_metrics` (``is_*`` keys too)."""
    res = compute_is_weights(
        torch.tensor(TRAIN), torch.tensor(ROLL), torch.tensor(MASK), config=ISConfig(variant="token_tis")
    )
    mismatch = mismatch_metrics(torch.tensor(TRAIN), torch.tensor(ROLL), torch.tensor(MASK), is_result=res)
    return StepMetrics(
        arm=arm,
        step=step,
        engine="reference-fp8",
        reward_mean=reward + 0.01 * step,
        reward_std=0.25,
        reward_max=1.0,
        exact_match=0.125,
        response_tokens_mean=17.5,
        loss=-0.03 * step,
        grad_norm=1.25,
        update_successful=True,
        learning_rate=1e-6,
        ppo_clip_fraction=0.0,
        ppo_approx_kl=1e-4,
        is_applied=False,
        is_variant="token_tis",
        is_weight_mean=1.0,
        is_truncated_fraction=0.0,
        is_masked_fraction=0.0,
        mismatch=mismatch,
        refit_bytes={"fp8": 3_000_000_000, "scales": 1_000, "bf16": 2_048, "other": 0},
        refit_seconds=0.75,
        refit_version=step + 1,
        refit_max_rel_error=refit_error,
        rollout_prompts_per_rank=(64, 64),
        rollout_tokens_per_s_per_rank=(1500.0, 1480.5),
        refit_host_staged_bytes_per_rank=(0, 0),
        refit_device_staged_bytes_per_rank=(3_000_003_048, 3_000_003_048),
        reward_mean_per_rank=(0.5, 0.25),
        refit_bytes_per_rank=(1_500_001_524, 1_500_001_524),
        refit_seconds_per_rank=(0.75, 0.74),
        trainer_tokens_real_per_rank=(730, 730),
        trainer_tokens_computed_per_rank=(736, 1024),
        rollout_seconds=2.0,
        train_seconds=3.0,
        step_seconds=6.0,
        sample="2+2= 4",
        filtered_reward_mean=0.5,
    )


def _record(m: StepMetrics) -> dict[str, object]:
    """What the driver appends to ``metrics.jsonl``."""
    return m.to_json_dict() | {"training_recipe": "blockwise", "training_math": "fp8"}


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


# --- step_scalars -------------------------------------------------------------------------------------------


def test_step_scalars_rules():
    got = step_scalars(
        {
            "arm": "fp8",
            "step": 7,
            "loss": 0.5,
            "update_successful": True,
            "is_applied": False,
            "refit_version": 3,
            "gen_kl": None,  # metrics.jsonl's non-finite
            "chi2_seq": float("inf"),
            "ppl_ratio": float("nan"),
            "sample": "text",
            "refit_bytes": {"fp8": 10, "bf16": 2},
            "something_new": 1.5,
            "a_list": [1, 2],
        }
    )
    assert got == {
        "train/loss": 0.5,
        "train/update_successful": 1.0,
        "mismatch/is_applied": 0.0,
        "refit/refit_version": 3.0,
        "refit/refit_bytes/fp8": 10.0,
        "refit/refit_bytes/bf16": 2.0,
        "other/something_new": 1.5,
    }
    assert all(type(v) is float for v in got.values())


def test_every_step_metrics_field_is_grouped():
    m = _metrics(3)
    record = _record(m)
    tags = step_scalars(record)
    assert not [t for t in tags if t.startswith("other/")]
    keys = {t.split("/", 1)[1] for t in tags}
    # every numeric field of StepMetrics reaches the loggers, with its group from the table
    for f in dataclasses.fields(StepMetrics):
        if f.type in ("str", str) or f.name == "step":
            continue
        if f.name == "mismatch":
            assert set(m.mismatch) <= keys and set(METRIC_KEYS) <= set(m.mismatch)
        elif f.name == "refit_bytes":
            assert {f"refit_{c}_bytes" for c in m.refit_bytes} | {"refit_total_bytes"} <= keys
        elif f.name.endswith("_per_rank"):  # one scalar per rank, tagged by the rank
            assert {f"{f.name}/0", f"{f.name}/1"} <= keys, f.name
        else:
            assert f.name in keys, f.name
        assert f.name in SCALAR_GROUPS, f"StepMetrics.{f.name} is not in SCALAR_GROUPS"
    # every numeric value of the record is a scalar, nothing else is
    numeric = {k for k, v in record.items() if isinstance(v, (int, float)) and v is not None and k != "step"}
    per_rank = {f"{k}/{i}" for k, v in record.items() if k.endswith("_per_rank") for i in range(len(v))}
    assert keys == numeric | per_rank
    # the unflattened dataclass groups too
    assert not [t for t in step_scalars(dataclasses.asdict(m)) if t.startswith("other/")]


def test_validation_scalars_drop_non_finite():
    assert validation_scalars(0.75, {"reward_mean": 0.5, "bad": float("nan")}) == {
        "validation/accuracy": 0.75,
        "validation/reward_mean": 0.5,
    }


# --- TensorBoard --------------------------------------------------------------------------------------------


def _read_tb(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_the_records_scalars(tmp_path):
    tb = TensorBoardLogger(tmp_path)
    records = {
        arm: [_record(_metrics(s, arm=arm, reward=r)) for s in range(3)] for arm, r in (("bf16", 0.2), ("fp8", 0.4))
    }
    records["fp8"][1]["refit_max_rel_error"] = None  # a non-finite value: a gap in the curve
    for arm, recs in records.items():
        for rec in recs:
            tb.log(step_scalars(rec), step=int(rec["step"]), arm=arm)
    tb.log_validation(0.625, step=2, arm="fp8", extra={"reward_mean": 0.5})
    tb.close()
    tb.close()  # twice is fine

    assert sorted(p.name for p in (tmp_path / "tensorboard").iterdir()) == ["bf16", "fp8"]
    for arm, recs in records.items():
        got = _read_tb(tmp_path / "tensorboard" / arm)
        expected: dict[str, list[tuple[int, float]]] = {}
        for rec in recs:
            for tag, value in step_scalars(rec).items():
                expected.setdefault(tag, []).append((int(rec["step"]), _f32(value)))
        if arm == "fp8":
            expected["validation/accuracy"] = [(2, 0.625)]
            expected["validation/reward_mean"] = [(2, 0.5)]
        assert got == expected
    assert [s for s, _ in _read_tb(tmp_path / "tensorboard" / "fp8")["refit/refit_max_rel_error"]] == [0, 2]


def test_tensorboard_resume_purges_the_crashed_runs_points(tmp_path):
    first = TensorBoardLogger(tmp_path)
    for step in range(5):
        first.log({"train/loss": float(step)}, step=step, arm="fp8")
        first.log({"train/loss": float(step)}, step=step, arm="bf16")
    first.close()
    time.sleep(1.1)  # event file names carry the second they were opened in

    # resumed after step 2 (everything logged later by the crashed run is hidden), the arms named in a mapping
    resumed = TensorBoardLogger(tmp_path, resume_step=2)
    for step in (3, 4):
        resumed.log({"train/loss": 10.0 + step}, step=step, arm="fp8")
    resumed.close()
    assert _read_tb(tmp_path / "tensorboard" / "fp8")["train/loss"] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 13.0),
        (4, 14.0),
    ]

    # per arm: bf16 is not in the mapping, so it starts over from 0
    time.sleep(1.1)
    again = TensorBoardLogger(tmp_path, resume_step={"fp8": 4})
    again.log({"train/loss": 20.0}, step=0, arm="bf16")
    again.close()
    assert _read_tb(tmp_path / "tensorboard" / "bf16")["train/loss"] == [(0, 20.0)]
    assert len(_read_tb(tmp_path / "tensorboard" / "fp8")["train/loss"]) == 5  # not logged again: untouched


def test_tensorboard_construction_errors(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"logger.log_dir: cannot create"):
        TensorBoardLogger(blocker)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"pip install tensorboard.*logger.tensorboard_enabled: false"):
        TensorBoardLogger(tmp_path)


# --- factory, fan-out, failures -----------------------------------------------------------------------------


def test_build_loggers_null_when_not_writer_or_disabled(tmp_path):
    on = LoggerConfig(tensorboard_enabled=True, wandb_enabled=True)
    assert isinstance(build_loggers(on, out_dir=tmp_path, run_config={}, is_writer=False), NullLogger)
    assert isinstance(build_loggers(LoggerConfig(), out_dir=tmp_path, run_config={}, is_writer=True), NullLogger)
    assert not list(tmp_path.iterdir())  # nothing created
    null = NullLogger()
    null.log({"train/loss": 1.0}, step=0, arm="fp8")
    null.log_validation(0.5, step=0, arm="fp8")
    null.close()


def test_build_loggers_default_and_explicit_log_dir(tmp_path):
    cfg = LoggerConfig(tensorboard_enabled=True)
    multi = build_loggers(cfg, out_dir=tmp_path / "run", run_config={}, is_writer=True, resume_step=None)
    assert isinstance(multi, MultiLogger)
    multi.log({"train/loss": 1.0}, step=0, arm="fp8")
    multi.close()
    assert _read_tb(tmp_path / "run" / "logs" / "tensorboard" / "fp8") == {"train/loss": [(0, 1.0)]}
    explicit = dataclasses.replace(cfg, log_dir=str(tmp_path / "elsewhere"))
    build_loggers(explicit, out_dir=tmp_path / "run", run_config={}, is_writer=True).close()
    assert (tmp_path / "elsewhere" / "tensorboard").is_dir()


def test_build_loggers_missing_wandb_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = LoggerConfig(tensorboard_enabled=True, wandb_enabled=True)
    with pytest.raises(ConfigError, match=r"pip install wandb.*logger.wandb_enabled: false"):
        build_loggers(cfg, out_dir=tmp_path, run_config={}, is_writer=True)


class _Recorder:
    def __init__(self, *, fail_log: bool = False, fail_close: bool = False):
        self.calls: list[tuple[str, int]] = []
        self.closed = 0
        self.fail_log, self.fail_close = fail_log, fail_close

    def log(self, scalars, *, step, arm):
        if self.fail_log:
            raise OSError(28, "No space left on device")
        self.calls.append((arm, step))

    def log_validation(self, accuracy, *, step, arm, extra=None):
        self.log(validation_scalars(accuracy, extra), step=step, arm=arm)

    def close(self):
        self.closed += 1
        if self.fail_close:
            raise RuntimeError("close failed")


def test_a_failing_backend_is_warned_about_once_and_dropped(tmp_path, caplog):
    good, bad = _Recorder(), _Recorder(fail_log=True)
    tb = TensorBoardLogger(tmp_path)
    multi = MultiLogger([bad, tb, good])
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.rl.state.loggers"):
        for step in range(3):
            multi.log({"train/loss": float(step)}, step=step, arm="fp8")
        multi.log_validation(0.5, step=2, arm="fp8")
        multi.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "_Recorder failed to log step 0 of arm fp8" in warnings[0].getMessage()
    assert "No space left on device" in warnings[0].getMessage() and "disabled" in warnings[0].getMessage()
    assert bad.closed == 1 and good.closed == 1
    assert good.calls == [("fp8", 0), ("fp8", 1), ("fp8", 2), ("fp8", 2)]
    assert _read_tb(tmp_path / "tensorboard" / "fp8")["train/loss"] == [(0, 0.0), (1, 1.0), (2, 2.0)]


def test_a_failing_close_is_a_warning_and_the_others_still_close(caplog):
    a, b = _Recorder(fail_close=True), _Recorder()
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.rl.state.loggers"):
        MultiLogger([a, b]).close()
    assert a.closed == b.closed == 1
    assert "failed to close" in caplog.text


def test_a_tensorboard_write_failure_disables_only_tensorboard(tmp_path, caplog):
    tb, good = TensorBoardLogger(tmp_path), _Recorder()
    multi = MultiLogger([tb, good])
    multi.log({"train/loss": 0.0}, step=0, arm="fp8")

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error")

    tb._writers["fp8"].add_scalar = broken  # the event file's disk went away
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.rl.state.loggers"):
        multi.log({"train/loss": 1.0}, step=1, arm="fp8")
        multi.log({"train/loss": 2.0}, step=2, arm="fp8")
    assert multi.loggers == [good] and len(good.calls) == 3
    assert caplog.text.count("TensorBoardLogger failed") == 1
    multi.close()


# --- W&B (offline) ------------------------------------------------------------------------------------------


def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file (a LevelDB-style log: 32 KiB blocks of CRC'd chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, chunks = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _crc, size, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if size == 0 and kind == 0:
            break
        chunks += data[pos + 7 : pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            yield record
            chunks = b""


def _history(path: Path) -> tuple[dict[str, str], dict[int, dict[str, float]]]:
    run: dict[str, str] = {}
    rows: dict[int, dict[str, float]] = {}
    for rec in _wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run = {"name": rec.run.display_name, "group": rec.run.run_group, "project": rec.run.project}
        elif kind == "history":
            row = rows.setdefault(rec.history.step.num, {})
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    row[key] = float(item.value_json)
    return run, rows


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    for var, sub in (("WANDB_DIR", "wandb_dir"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config")):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield tmp_path
    import wandb

    wandb.teardown()  # whatever a failed test left behind
    deadline = time.monotonic() + 20
    while (left := {p.pid for p in psutil.Process().children(recursive=True)} - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind: {[psutil.Process(p).cmdline() for p in left if psutil.pid_exists(p)]}"


def test_wandb_offline_runs_per_arm(wandb_env, capfd):
    out = wandb_env / "run-42"
    earlier = {p.pid for p in psutil.Process().children(recursive=True)}  # other tests' children are not W&B's
    cfg = LoggerConfig(wandb_enabled=True, wandb=WandbConfig(project="mfp8-test"))
    multi = build_loggers(cfg, out_dir=out, run_config={"grpo": {"num_steps": 2}}, is_writer=True)
    records = {arm: [_record(_metrics(s, arm=arm)) for s in range(2)] for arm in ("bf16", "fp8_tis")}
    for arm, recs in records.items():
        for rec in recs:
            multi.log(step_scalars(rec), step=int(rec["step"]), arm=arm)
    multi.log_validation(0.25, step=1, arm="fp8_tis")
    assert isinstance(multi, MultiLogger) and isinstance(multi.loggers[0], WandbLogger)
    service = {p.pid for p in psutil.Process().children(recursive=True)} - earlier
    multi.close()

    printed = capfd.readouterr()
    assert printed.out == "" and "wandb" not in printed.err.lower()  # W&B printed nothing
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(p) for p in service) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in service if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

    folders = sorted((out / "logs" / "wandb").glob("offline-run-*"))
    assert len(folders) == 2
    seen = {}
    for folder in folders:
        files = list(folder.glob("run-*.wandb"))
        assert len(files) == 1
        run, rows = _history(files[0])
        seen[run["name"]] = rows
        assert run["group"] == "run-42" and run["project"] == "mfp8-test"
    assert set(seen) == {"run-42-bf16", "run-42-fp8_tis"}
    for arm, recs in records.items():
        rows = seen[f"run-42-{arm}"]
        for rec in recs:
            expected = step_scalars(rec)
            got = rows[int(rec["step"])]
            assert {k: got[k] for k in expected} == pytest.approx(expected, rel=1e-12)
    assert seen["run-42-fp8_tis"][1]["validation/accuracy"] == 0.25
    assert seen["run-42-fp8_tis"][1]["refit/refit_fp8_bytes"] == 3_000_000_000  # exact, unlike TensorBoard's f32
    assert math.isclose(seen["run-42-bf16"][0]["mismatch/gen_kl"], records["bf16"][0]["gen_kl"])


def test_wandb_name_from_config_and_log_after_close(wandb_env):
    wb = WandbLogger(wandb_env / "logs", project="p", run_name="named", run_config={})
    wb.log({"train/loss": 1.0}, step=0, arm="fp8")
    wb.close()
    wb.close()
    with pytest.raises(RuntimeError, match="closed"):
        wb.log({"train/loss": 1.0}, step=1, arm="fp8")
    (folder,) = (wandb_env / "logs" / "wandb").glob("offline-run-*")
    run, rows = _history(next(folder.glob("run-*.wandb")))
    assert run["name"] == "named-fp8" and rows == {0: {"train/loss": 1.0}}
