"""A run without ``--out`` gets a new folder (issue 21, item 3), and a rerun that resumes continues in its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_fp8.errors import UsageError
from megatron_fp8.rl.state.outputs import RUNS_ROOT, new_run_dir


def test_a_new_folder_per_run_named_the_same_on_every_rank(tmp_path):
    assert new_run_dir({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}) == RUNS_ROOT / "grpo-slurm-4242.0"
    assert new_run_dir({"SLURM_JOB_ID": "4242"}) == RUNS_ROOT / "grpo-slurm-4242.batch"
    torchrun = {"TORCHELASTIC_RUN_ID": "7f3c2a91-aaaa-bbbb", "WORLD_SIZE": "2"}
    assert new_run_dir(torchrun) == RUNS_ROOT / "grpo-7f3c2a91-aaaa-bb"  # its first 16 characters
    first = new_run_dir({}, root=tmp_path)
    assert first.parent == tmp_path and first.name.startswith("grpo-20")
    first.mkdir()
    second = new_run_dir({}, root=tmp_path)
    assert second != first and second.name.startswith(first.name)  # taken: -2
    with pytest.raises(UsageError, match="give --out"):
        new_run_dir({"WORLD_SIZE": "2", "RANK": "1"})


@pytest.mark.slow
@pytest.mark.megatron
def test_without_out_a_run_gets_its_folder_and_a_resumed_run_continues_in_it(tmp_path, monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron_fp8.config import load_config
    from megatron_fp8.rl.driver.grpo import run_grpo

    monkeypatch.chdir(tmp_path)
    small = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.warm_start_steps=0"]
    saving = [*small, "checkpointing.enabled=true", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"]
    first = run_grpo(load_config(None, saving), steps=1, arms=["bf16"], progress=False)
    assert first.out_dir.parent == Path("out") and first.out_dir.name.startswith("grpo-")
    resumed = run_grpo(load_config(None, saving), steps=2, arms=["bf16"], progress=False)
    assert resumed.out_dir.resolve() == first.out_dir.resolve()  # the checkpoint named its folder
    steps = [json.loads(line)["step"] for line in (first.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
    other = run_grpo(load_config(None, small), steps=1, arms=["bf16"], progress=False)
    assert other.out_dir.resolve() != first.out_dir.resolve() and (other.out_dir / "summary.md").is_file()
