"""A real 2-step GRPO run on a staged NeMo-RL named dataset: OpenMathInstruct-2's columns, its 5% held out and
validated (issue 38 item 2). Megatron-Core trainer and the reference FP8 engine on the tiny model; marked slow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("math_verify")

from megatron_fp8.config import load_config
from megatron_fp8.rl.driver.grpo import run_grpo
from megatron_fp8.rl.state.results import METRICS_FILE, VALIDATION_FILE

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

MATH = Path(__file__).resolve().parents[3] / "data" / "math_tiny"


def test_a_two_step_run_reads_openmathinstruct2_and_validates_on_its_held_out_rows(tmp_path):
    """``dataset_name: OpenMathInstruct-2`` with only ``data_path``: the run trains on ``problem`` ->
    ``expected_answer`` and validates on ceil(0.05 * 40) = 2 held-out rows, with no validation file."""
    staged = tmp_path / "omi2.jsonl"
    staged.write_text("\n".join((MATH / "train.jsonl").read_text().splitlines()[:40]) + "\n")
    cfg = load_config(
        None,
        [
            "data.train.dataset_name=OpenMathInstruct-2",
            f"data.train.data_path={staged}",
            "data.default.env_name=math",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=2",
            "grpo.val_period=1",
            "grpo.val_at_start=false",
        ],
    )
    assert (cfg.data.train.input_key, cfg.data.train.output_key) == ("problem", "expected_answer")
    assert cfg.data.train.split_validation_size == 0.05
    out = tmp_path / "out"
    run_grpo(cfg, out_dir=out, steps=2, arms=["fp8"], progress=False)
    records = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    validations = [json.loads(line) for line in (out / VALIDATION_FILE).read_text().splitlines()]
    assert validations and all(v["problems"] == 2 for v in validations)
