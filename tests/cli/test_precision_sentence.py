"""One precision sentence: ``doctor``, the run log and ``summary.md`` say what the training math runs in alike.

They used to disagree (``doctor`` and the log: "the math runs in BF16", the log also "torch.float32 ...
(bf16-emulated)", the summary ``fp32-emulated``); now each prints
:func:`megatron_fp8.recipes.precision.precision_sentence`. The commands run for real: ``doctor`` and a one-step
``grpo`` of the default config (training recipe ``blockwise``).
"""

from __future__ import annotations

import re
import subprocess
import sys

import _warm_cli
import torch

from megatron_fp8.recipes.precision import math_label, precision_sentence, trainer_dtype_name

CLI = [sys.executable, "-m", "megatron_fp8.cli"]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_doctor_the_run_log_and_the_summary_say_the_same_sentence(tmp_path):
    has_gpu = torch.cuda.is_available()
    label = math_label("fp8" if has_gpu else "bf16-emulated", trainer_dtype_name(has_gpu=has_gpu))
    sentence = precision_sentence(recipe="blockwise", label=label)
    out = tmp_path / "run"
    run = _warm_cli.run(  # a process of its own, forked by the suite's warm launcher (tests/_warm_cli.py)
        ["grpo", "--steps", "1", "--arms", "fp8", "--no-progress", "--out", str(out)]
        + ["grpo.warm_start_steps=0", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2"],
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    built = [line for line in run.stderr.splitlines() if "megatron.build: built " in line]
    assert built and all(line.endswith(f": {sentence}") for line in built), built
    assert "runs in BF16" not in run.stderr or has_gpu
    summary = (out / "summary.md").read_text()
    assert f"\n- {sentence}\n" in summary and f"| blockwise ({label}) |" in summary, summary
    if not has_gpu:
        assert label == "fp32-emulated" and sentence.endswith("the math runs in float32 (fp32-emulated)")
        doctor = subprocess.run([*CLI, "doctor"], capture_output=True, text=True, timeout=300)
        assert doctor.returncode == 0, doctor.stderr
        flat = _flat(doctor.stdout)
        # the same sentence, for any FP8 recipe
        assert f"No CUDA GPU: {precision_sentence(recipe=None, label=label)}." in flat, flat[-1500:]
        assert "in BF16" not in flat
