"""Issue 57's new-user trips, each through the real CLI: the message a newcomer gets names the thing and the fix.

Every command is a fork of the suite's warm launcher (tests/_warm_cli.py): the same ``megatron_fp8.cli.main``,
argv and environment as ``megatron-fp8 ...`` in a shell.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import _warm_cli

from megatron_fp8.models import tiny_model_path

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, env: dict[str, str] | None = None):
    proc = _warm_cli.run(list(args), cwd=ROOT, timeout=300, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def test_a_model_folder_without_tokenizer_files_is_named(tmp_path):
    """Was: "the tokenizer of DIR encodes the task text '1+1=' to no tokens"."""
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_path("tiny"), folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink()
    proc = _cli("config", "--model", str(folder))
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"the model folder {folder} has no tokenizer files (none of tokenizer.json" in proc.stderr
    assert "no tokens" not in proc.stderr


def test_config_takes_arms_as_grpo_does():
    """Was: the top-level "unrecognized arguments: --arms"."""
    proc = _cli("config", "--arms", "bf16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "arms: bf16; approved" in proc.stdout
    proc = _cli("config", "--arms", "bf16,fp9")
    assert proc.returncode == 2 and "unknown arm(s) ['fp9']; valid arms: bf16, fp8, fp8_tis" in proc.stderr


def test_a_deadline_of_the_wrong_type_names_the_format():
    """Was: "checkpointing.checkpoint_must_save_by: expected str, got int -1"."""
    proc = _cli("config", "checkpointing.checkpoint_must_save_by=-1")
    assert proc.returncode == 1
    assert "expected str, got int -1 (NeMo-RL's DD:HH:MM:SS after the training loop starts" in proc.stderr
    assert "checkpointing.checkpoint_must_save_by=00:03:30:00" in proc.stderr


def test_a_hugging_face_dataset_name_is_refused_without_a_warning_first():
    """Was: a WARNING that the run would train on the built-in task, then the refusal saying the same."""
    proc = _cli("config", "data.train.dataset_name=OpenMathInstruct-2")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "data.train.dataset_name='OpenMathInstruct-2' names a Hugging Face dataset" in proc.stderr
    assert proc.stderr.count("names a Hugging Face dataset") == 1 and "WARNING" not in proc.stderr, proc.stderr


def test_a_malformed_override_is_a_usage_error():
    """Was: exit 1 (a usage error is exit 2, as the README says); an unclosed bracket was "please report it"."""
    proc = _cli("config", "grpo.max_num_steps")
    assert proc.returncode == 2 and "is not of the form dotted.key=value" in proc.stderr
    proc = _cli("config", "grpo.max_num_steps=[1")
    assert proc.returncode == 2 and "a value is not valid YAML" in proc.stderr and "report it" not in proc.stderr


def test_hf_hub_offline_neither_on_nor_off_is_refused():
    """Was: ``HF_HUB_OFFLINE=maybe`` accepted silently (huggingface_hub reads it as online)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "maybe"}
    proc = _cli("config", "--model", "Qwen/Qwen3-8B", "--allow-over-memory", env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "HF_HUB_OFFLINE='maybe' is neither on nor off; set it to 1" in proc.stderr


def test_resuming_into_another_out_names_both_folders(tmp_path):
    """Was: resuming a checkpoint_dir into another --out split the metrics over two folders without a word."""
    small = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.warm_start_steps=1"]
    ckpt = [
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        "checkpointing.enabled=true",
        "checkpointing.save_period=1",
    ]
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--arms", "bf16", "--no-progress", *small, *ckpt]
    proc = _cli("grpo", "--steps", "1", "--out", str(first), *common)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = _cli("grpo", "--steps", "2", "--out", str(second), *common)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"resuming the run of {first.resolve()} into another folder, {second}" in proc.stderr, proc.stderr[-3000:]
    assert f"rerun with --out {first.resolve()} to keep the run in one folder" in proc.stderr


# ------------------------------------------------------------------- the re-run of the new-user pass (issue 57)
SMALL = ["--no-progress", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.warm_start_steps=1"]


def test_a_key_given_twice_warns_naming_every_value_and_the_one_used():
    """Was: the last value taken without a word (``--model`` over ``model.name_or_path=`` too)."""
    proc = _cli("config", "grpo.max_num_steps=3", "grpo.max_num_steps=4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        "grpo.max_num_steps is given 2 times (grpo.max_num_steps=3, grpo.max_num_steps=4): the last, "
        "grpo.max_num_steps=4, is used" in proc.stderr
    )
    assert "  max_num_steps: 4\n" in proc.stdout
    proc = _cli("config", "--model", "tiny", "model.name_or_path=tiny-moe")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(model.name_or_path=tiny-moe, --model tiny): the last, --model tiny, is used" in proc.stderr
    proc = _cli("config", "--model", "tiny", "model.name_or_path=tiny")  # the same value twice: nothing to say
    assert proc.returncode == 0 and "given 2 times" not in proc.stderr, proc.stderr[-2000:]


def test_an_unwritable_checkpoint_dir_is_refused_before_the_warm_start(tmp_path):
    """Was: the warm start and the first step ran, then the first save failed ("No such file or directory")."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    out = tmp_path / "run"
    ckpt = [f"checkpointing.checkpoint_dir={blocker / 'ckpt'}", "checkpointing.enabled=true"]
    proc = _cli("grpo", "--steps", "1", "--arms", "bf16", "--out", str(out), *SMALL, *ckpt)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"checkpointing.checkpoint_dir={blocker / 'ckpt'} cannot be written (Not a directory); set " in proc.stderr
    assert "warm start" not in proc.stderr and not (out / "metrics.jsonl").exists()


def test_a_run_says_which_arms_it_corrected_and_writes_validation_jsonl_only_when_it_validates(tmp_path):
    """Was: every summary said "correction of arm fp8_tis" (also without that arm) and every run left an empty
    validation.jsonl; the preflight's data line was logged twice."""
    out = tmp_path / "plain"
    proc = _cli("grpo", "--steps", "1", "--arms", "bf16", "--out", str(out), *SMALL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("grpo.task: addition (built-in") == 1, proc.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert "- 1 step(s) x 2 prompts" in summary and "- no arm corrected the train/rollout mismatch" in summary
    assert "fp8_tis" not in summary and not (out / "validation.jsonl").exists()
    # config.yaml keeps the plan (grpo.max_num_steps 20: the schedule's length) and says what --steps 1 ran
    written = (out / "config.yaml").read_text()
    assert written.startswith("# --steps 1: this run goes to step 1 of each arm; grpo.max_num_steps (20) below is")
    assert "  max_num_steps: 20\n" in written
    out = tmp_path / "corrected"
    switch = ["loss_fn.use_importance_sampling_correction=true", "grpo.val_period=1"]
    proc = _cli("grpo", "--steps", "1", "--arms", "bf16", "--out", str(out), *SMALL, *switch)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "- correction of arm(s) bf16: `token_tis` with cap C=2" in (out / "summary.md").read_text()
    assert len((out / "validation.jsonl").read_text().splitlines()) == 1


def test_an_unset_environment_variable_of_a_config_names_the_fix(tmp_path):
    """Was: OmegaConf's "Environment variable 'X' not found" and nothing about what to do."""
    config = tmp_path / "mine.yaml"
    config.write_text("grpo:\n  seed: ${oc.env:NU_NOT_SET_ANYWHERE}\n")
    env = {k: v for k, v in os.environ.items() if k != "NU_NOT_SET_ANYWHERE"}
    proc = _cli("config", "--config", str(config), env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"{config}: cannot resolve 'grpo.seed'" in proc.stderr
    assert "; set NU_NOT_SET_ANYWHERE, or give the file a default: ${oc.env:NU_NOT_SET_ANYWHERE,VALUE}" in proc.stderr
