"""Bad input through the real CLI: exit code, a message naming the thing, no traceback, nothing lost.

Each row of :data:`CASES` runs ``python -m megatron_fp8.cli`` in a subprocess and checks the exit code
(2 = usage error, 1 = error), that stderr names the offending file/key and says what to do, that no
Python traceback is printed, and that the output folder is unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _warm_cli
import pytest

from megatron_fp8.rl.state.outputs import RUN_OUTPUTS, claim_out_dir, rebuild_outputs
from megatron_fp8.rl.state.results import METRICS_FILE, ArmResult, StepMetrics, arms_from_records

CLI = [sys.executable, "-m", "megatron_fp8.cli"]


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``megatron-fp8 *args`` in a process of its own (the suite's warm launcher, tests/_warm_cli.py)."""
    return _warm_cli.run(list(args), timeout=timeout)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _previous_run(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text('{"arm": "bf16"}\n')
    (folder / "summary.md").write_text("# an earlier run\n")
    (folder / "config.yaml").write_text("grpo: {max_num_steps: 1}\n")
    return folder


def _bad_model(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "qwen3", "hidden_size": ')  # truncated JSON
    return folder


def _truncated_checkpoint(folder: Path) -> Path:
    from megatron_fp8.models import tiny_model_path

    src = tiny_model_path("tiny")
    folder.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            data = f.read_bytes()
            (folder / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    return folder


# (name, argv builder (tmp_path -> argv), exit code, text stderr must contain (tmp_path -> str), folder to keep)
CASES = [
    (
        "out is an existing file",
        lambda t: ["grpo", "--steps", "1", "--out", str(_touch(t / "f.txt"))],
        2,
        lambda t: f"--out {t / 'f.txt'} is a file",
        None,
    ),
    (
        "out under a file",
        lambda t: ["grpo", "--steps", "1", "--out", str(_touch(t / "f.txt") / "sub")],
        2,
        lambda t: "which is a file",
        None,
    ),
    (
        "out holds another run",
        lambda t: ["grpo", "--steps", "1", "--out", str(_previous_run(t / "old"))],
        2,
        lambda t: "already holds another run's outputs (metrics.jsonl, summary.md, config.yaml)",
        "old",
    ),
    ("steps 0", lambda t: ["grpo", "--steps", "0", "--out", str(t / "new")], 2, lambda t: "--steps must be >= 1", None),
    ("refit repeats 0", lambda t: ["refit", "--repeats", "0"], 2, lambda t: "--repeats must be >= 1", None),
    (
        "report without metrics",
        lambda t: ["report", str(t)],
        1,
        lambda t: f"{t / 'metrics.jsonl'}: no such metrics file",
        None,
    ),
    (
        "corrupt model config.json",
        lambda t: ["manifest", "--model", str(_bad_model(t / "model"))],
        1,
        lambda t: f"{t / 'model' / 'config.json'} is not valid JSON",
        "model",
    ),
    (
        "truncated model.safetensors",
        lambda t: ["manifest", "--model", str(_truncated_checkpoint(t / "model"))],
        1,
        lambda t: "the file is truncated or damaged: re-download the checkpoint",
        "model",
    ),
    (
        "missing data file",
        lambda t: ["config", *_data_args(t / "nope.jsonl")],
        1,
        lambda t: f"data.train.data_path: no such file {t / 'nope.jsonl'}",
        None,
    ),
    (
        "JSONL line that is not JSON",
        lambda t: [
            "grpo",
            "--steps",
            "1",
            "--out",
            str(t / "run"),
            *_data_args(_write(t / "d.jsonl", _ROW + "oops\n")),
        ],
        1,
        lambda t: f"{t / 'd.jsonl'} line 2 is not JSON",
        None,
    ),
    (
        "data row without the input key",
        lambda t: [
            "config",
            *_data_args(_write(t / "d.jsonl", _ROW + '{"question": "2+2", "expected_answer": "4"}\n')),
        ],
        1,
        lambda t: "line 2 has no 'problem' (its columns: 'question', 'expected_answer'); set data.train.input_key",
        None,
    ),
    ("empty dataset", lambda t: ["config", *_data_args(_write(t / "d.jsonl", ""))], 1, lambda t: "holds no rows", None),
    (  # new-user pass (issue 57 re-run): `config` approved these, `grpo` refused them after the preflight
        "save period 0",
        lambda t: ["config", "checkpointing.enabled=true", "checkpointing.save_period=0"],
        1,
        lambda t: "checkpointing.save_period must be >= 1, got 0",
        None,
    ),
    (
        "keep_top_k 0",
        lambda t: ["config", "checkpointing.keep_top_k=0"],
        1,
        lambda t: "checkpointing.keep_top_k must be >= 1 (or null: keep every checkpoint), got 0",
        None,
    ),
    (
        "max_val_samples 0",
        lambda t: ["config", "grpo.max_val_samples=0"],
        1,
        lambda t: "grpo.max_val_samples must be >= 1 (or null: every validation problem), got 0",
        None,
    ),
    (  # was exit 1 (a bare SystemExit), though a usage error
        "config and explain name different files",
        lambda t: ["config", "--config", "configs/tiny_cpu.yaml", "--explain", "configs/qwen3_8b_fp8.yaml"],
        2,
        lambda t: "name different files; give one (`megatron-fp8 config --explain configs/qwen3_8b_fp8.yaml`",
        None,
    ),
    (  # was "expected str, got int 60" and nothing about the 1:00 the user wrote
        "deadline written as H:MM",
        lambda t: ["config", "checkpointing.checkpoint_must_save_by=1:00"],
        1,
        lambda t: "all four fields, two digits each: YAML reads an unquoted 1:30 as the base-60 number 90",
        None,
    ),
    (
        "unknown model name offline",
        lambda t: ["manifest", "--model", "Qwen/Qwen3-8B-not-staged"],
        1,
        lambda t: "huggingface-cli download Qwen/Qwen3-8B-not-staged --local-dir DIR",
        None,
    ),
]


_ROW = '{"problem": "1+1", "expected_answer": "2"}\n'


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _data_args(path: Path) -> list[str]:
    return [f"data.train.data_path={path}", "data.train.input_key=problem", "data.train.output_key=expected_answer"]


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("not a folder\n")
    return path


@pytest.mark.parametrize("name, argv, code, needle, keep", CASES, ids=[c[0] for c in CASES])
def test_bad_input_table(tmp_path, name, argv, code, needle, keep):
    args = argv(tmp_path)
    before = _snapshot(tmp_path / keep) if keep else None
    proc = _cli(*args)
    assert proc.returncode == code, (name, proc.returncode, proc.stderr[-2000:])
    assert needle(tmp_path) in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if keep:
        assert _snapshot(tmp_path / keep) == before, f"{name}: the folder changed"


def test_debug_shows_the_traceback(tmp_path):
    proc = _cli("--debug", "manifest", "--model", str(_bad_model(tmp_path / "model")))
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr


def test_claim_out_dir_overwrite_removes_the_old_run_only(tmp_path):
    old = _previous_run(tmp_path / "run")
    (old / "notes.txt").write_text("mine\n")
    claim_out_dir(old, overwrite=True)
    assert not any((old / name).exists() for name in RUN_OUTPUTS)
    assert (old / "notes.txt").read_text() == "mine\n"  # not a run output: kept


def _step(arm: str, step: int, reward: float) -> StepMetrics:
    nan = float("nan")
    return StepMetrics(
        arm=arm,
        step=step,
        engine=f"reference-{'bf16' if arm == 'bf16' else 'fp8'}",
        reward_mean=reward,
        reward_std=0.1,
        reward_max=1.0,
        exact_match=0.0,
        response_tokens_mean=4.0,
        loss=0.5,
        grad_norm=1.0,
        update_successful=True,
        learning_rate=1e-3,
        ppo_clip_fraction=0.0,
        ppo_approx_kl=0.0,
        is_applied=arm == "fp8_tis",
        is_variant="token_tis",
        is_weight_mean=1.0,
        is_truncated_fraction=0.0,
        is_masked_fraction=0.0,
        mismatch={"gen_kl_k3": 1e-4 * (step + 1), "token_mult_prob_error": 0.01},
        refit_bytes={"fp8": 100, "scales": 4, "bf16": 50},
        refit_seconds=0.1,
        refit_version=step + 1,
        refit_max_rel_error=nan,
        rollout_seconds=0.2,
        train_seconds=0.3,
        step_seconds=0.6,
        sample="1+2=3",
    )


def test_metrics_records_round_trip_and_rebuild(tmp_path):
    steps = [_step(a, s, 0.1 * s) for a in ("bf16", "fp8") for s in range(3)]
    lines = [
        json.dumps(m.to_json_dict() | {"training_recipe": "blockwise", "training_math": "bf16-emulated"}) for m in steps
    ]
    (tmp_path / METRICS_FILE).write_text("\n".join(lines) + "\n")
    arms = arms_from_records([json.loads(x) for x in lines])
    assert [a.arm for a in arms] == ["bf16", "fp8"]
    assert isinstance(arms[0], ArmResult) and arms[0].training_recipe == "blockwise"
    back = arms[1].steps[2]
    assert back.gen_kl == steps[5].gen_kl and back.refit_bytes["scales"] == 4
    assert back.to_json_dict() == steps[5].to_json_dict()
    summary, plot, _ = rebuild_outputs(tmp_path)
    assert "| fp8 |" in summary.read_text() and plot.read_bytes()[:4] == b"\x89PNG"
    # issue 57 trip 10: the run's summary said how the FP8 manifest was obtained; `report` keeps that line, and every
    # line of the summary reads as text (two tables instead of one of 188 columns)
    manifest = "asked of vLLM (0.11.0) for tiny, cached in /cache/manifest-1234.json"
    text = summary.read_text().replace("- gen_kl:", f"- FP8 manifest: {manifest}\n- gen_kl:")
    summary.write_text(text)
    proc = _cli("report", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rebuilt from 6 step(s) of 2 arm(s)" in proc.stdout
    rebuilt = summary.read_text()
    assert f"- FP8 manifest: {manifest}" in rebuilt and rebuilt.count("| fp8 |") == 2
    assert max(len(line) for line in rebuilt.splitlines() if line.startswith("|")) <= 120


def test_report_names_the_bad_line(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"arm": "bf16"}\nnot json\n')
    proc = _cli("report", str(tmp_path))
    assert proc.returncode == 1
    assert f"{tmp_path / METRICS_FILE}:2: not a JSON line" in proc.stderr


@pytest.mark.slow
def test_rerun_refused_overwrite_allowed_and_sigint_keeps_completed_steps(tmp_path):
    out = tmp_path / "run"
    small = ["--no-progress", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2"]
    first = _cli("grpo", "--steps", "1", "--arms", "bf16", "--out", str(out), *small, "grpo.warm_start_steps=0")
    assert first.returncode == 0, first.stderr[-3000:]
    before = _snapshot(out)
    again = _cli("grpo", "--steps", "1", "--arms", "bf16", "--out", str(out), *small, "grpo.warm_start_steps=0")
    assert again.returncode == 2 and "--overwrite" in again.stderr
    assert _snapshot(out) == before  # nothing truncated or replaced

    overwritten = _cli(
        "grpo", "--steps", "1", "--arms", "bf16", "--out", str(out), "--overwrite", *small, "grpo.warm_start_steps=0"
    )
    assert overwritten.returncode == 0, overwritten.stderr[-3000:]

    # Ctrl-C after the first completed step: one line, exit 130, summary rebuilt from that step.
    out = tmp_path / "interrupted"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [*CLI, "grpo", "--steps", "50", "--arms", "bf16", "--out", str(out), *small, "grpo.warm_start_steps=0"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # default SIGINT handling in the child: a background shell (nohup, `&`) leaves SIGINT ignored, and Python
        # then installs no KeyboardInterrupt handler
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = out / METRICS_FILE
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.read_text().count("\n") >= 1:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "interrupted" in stderr and "Traceback" not in stderr
    done = metrics.read_text().count("\n")
    assert 1 <= done < 50
    assert "| bf16 |" in (out / "summary.md").read_text()


def test_report_rebuilds_from_metrics_when_config_yaml_is_unreadable(tmp_path):
    """Was: ``report`` refused the whole rebuild for a truncated config.yaml (a crash or a full disk leaves one)."""
    steps = [_step(a, 0, 0.5) for a in ("bf16", "fp8")]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(m.to_json_dict()) + "\n" for m in steps))
    (tmp_path / "config.yaml").write_text("grpo: [\n")
    proc = _cli("report", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{tmp_path / 'config.yaml'} is unreadable (" in proc.stderr and "without the run's settings" in proc.stderr
    assert "rebuilt from 2 step(s) of 2 arm(s)" in proc.stdout and "| fp8 |" in (tmp_path / "summary.md").read_text()
