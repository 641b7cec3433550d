"""GRPO as users run it: their JSONL data and reward, checkpoints and resume, validation, TensorBoard.

Real runs (Megatron-Core trainer, reference FP8 engine, verified refit) of one small arm on the shipped
``data/math_tiny`` rows; marked slow (each run takes 10-30 s on 2 cores).
"""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("datasets")
pytest.importorskip("math_verify")

from megatron_fp8.config import load_config
from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.driver import arm as arm_module
from megatron_fp8.rl.driver.grpo import run_grpo
from megatron_fp8.rl.state.results import METRICS_FILE, VALIDATION_FILE

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

MATH = Path(__file__).resolve().parents[3] / "data" / "math_tiny"


def _config(tmp_path: Path, *extra: str):
    """The embedded tiny config on a JSONL math file, one FP8 arm, small steps, checkpoints every step."""
    rows = (MATH / "train.jsonl").read_text().splitlines()[:40]
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(rows) + "\n")
    return load_config(
        None,
        [
            f"data.train.data_path={data}",
            "data.train.input_key=problem",
            "data.train.output_key=expected_answer",
            "data.default.env_name=math",
            "checkpointing.enabled=true",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            "checkpointing.save_period=1",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "grpo.warm_start_steps=2",
            *extra,
        ],
    )


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


_COMPARED = ("reward_mean", "loss", "grad_norm", "gen_kl", "refit_fp8_bytes", "sample")


def test_train_on_jsonl_checkpoint_resume_equals_an_uninterrupted_run(tmp_path, caplog):
    """2 steps + resume to 3 gives exactly the metrics of 3 uninterrupted steps; `resumed from step 2` is logged."""
    run_grpo(_config(tmp_path / "a"), out_dir=tmp_path / "a" / "out", steps=3, arms=["fp8"], progress=False)
    out = tmp_path / "b" / "out"
    first = run_grpo(_config(tmp_path / "b"), out_dir=out, steps=2, arms=["fp8"], progress=False)
    assert [s.step for s in first.arm("fp8").steps] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "b" / "ckpt" / "fp8").iterdir()) == ["step_0", "step_1"]
    with caplog.at_level(logging.INFO, logger="megatron_fp8.rl.driver.arm"):
        resumed = run_grpo(_config(tmp_path / "b"), out_dir=out, steps=3, arms=["fp8"], progress=False)
    assert "arm fp8: resumed from step 2" in caplog.text and "step_1: folder names count steps from 0" in caplog.text
    assert "continuing at step 3" in caplog.text  # issue 57 trip 10: 1-based messages, 0-based folders, both said
    assert [r["step"] for r in _records(out)] == [0, 1, 2]  # metrics continue at step 3 (index 2)
    assert [s.step for s in resumed.arm("fp8").steps] == [0, 1, 2]
    a, b = _records(tmp_path / "a" / "out")[2], _records(out)[2]
    assert {k: a[k] for k in _COMPARED} == {k: b[k] for k in _COMPARED}
    assert b["refit_fp8_bytes"] > 0 and "answer" in b["sample"]


def test_checkpoint_of_another_config_is_refused_before_anything_is_touched(tmp_path):
    out = tmp_path / "out"
    run_grpo(_config(tmp_path), out_dir=out, steps=1, arms=["fp8"], progress=False)
    before = (out / METRICS_FILE).read_text()
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.optimizer\.lr"):
        lr = "policy.megatron_cfg.optimizer.lr=0.5"
        run_grpo(_config(tmp_path, lr), out_dir=out, steps=2, arms=["fp8"], progress=False)
    assert (out / METRICS_FILE).read_text() == before


def test_ctrl_c_mid_step_keeps_the_last_complete_checkpoint(tmp_path, monkeypatch):
    real_run_step = arm_module.run_step

    def interrupted(state, ctx, *, step, **kwargs):
        if step == 1:
            raise KeyboardInterrupt
        return real_run_step(state, ctx, step=step, **kwargs)

    monkeypatch.setattr(arm_module, "run_step", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_grpo(_config(tmp_path), out_dir=out, steps=3, arms=["fp8"], progress=False)
    ckpt = tmp_path / "ckpt" / "fp8"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_0"]
    assert (ckpt / "step_0" / "checkpoint.json").is_file()
    monkeypatch.setattr(arm_module, "run_step", real_run_step)
    result = run_grpo(_config(tmp_path), out_dir=out, steps=2, arms=["fp8"], progress=False)
    assert [s.step for s in result.arm("fp8").steps] == [0, 1]


def test_validation_tensorboard_and_a_raising_user_reward(tmp_path, monkeypatch, caplog):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "rewards.py").write_text(
        textwrap.dedent(
            """
            def flaky(prompt, response, answer):
                if int(answer) % 2:
                    raise ValueError("my reward broke")
                return float(response.strip() == answer)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    cfg = _config(
        tmp_path,
        "data.default.env_name=userpkg.rewards:flaky",
        f"data.validation.data_path={MATH / 'validation.jsonl'}",
        "data.validation.input_key=problem",
        "data.validation.output_key=expected_answer",
        "grpo.val_period=1",
        "grpo.val_at_start=true",
        "grpo.max_val_samples=8",
        "logger.tensorboard_enabled=true",
        "checkpointing.enabled=false",
    )
    with caplog.at_level(logging.WARNING):
        run_grpo(cfg, out_dir=out, steps=2, arms=["fp8"], progress=False)
    vals = [json.loads(line) for line in (out / VALIDATION_FILE).read_text().splitlines()]
    assert [v["step"] for v in vals] == [0, 1, 2] and all(v["problems"] == 8 for v in vals)
    assert all(0.0 <= v["accuracy"] <= 1.0 for v in vals)
    events = list((out / "logs" / "tensorboard" / "fp8").glob("events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert any(t.endswith("reward_mean") for t in tags) and any(t.startswith("validation/") for t in tags)
    records = _records(out)
    assert sum(r["reward_errors"] for r in records) > 0  # odd answers raise: scored 0, reported, run goes on
    assert "my reward broke" in caplog.text and len(records) == 2


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    """A byte flipped in step_1's model file: the rerun warns, resumes after step 0 and redoes steps 1-2."""
    out = tmp_path / "out"
    run_grpo(_config(tmp_path), out_dir=out, steps=2, arms=["fp8"], progress=False)
    model_file = next((tmp_path / "ckpt" / "fp8" / "step_1").glob("model_*.pt"))
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digest can tell
    model_file.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO):
        result = run_grpo(_config(tmp_path), out_dir=out, steps=3, arms=["fp8"], progress=False)
    assert "step_1" in caplog.text and "arm fp8: resumed from step 1" in caplog.text
    assert [r["step"] for r in _records(out)] == [0, 1, 2]
    assert [s.step for s in result.arm("fp8").steps] == [0, 1, 2]
