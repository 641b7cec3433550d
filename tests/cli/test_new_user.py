"""A scripted new-user pass: the README's "Using it" commands, in the README's order, through the real CLI.

The command list is read from the README's usage block, so a command added there and not exercised here
fails the test. Each command must exit 0, print what the README says it prints, and end without a traceback.

``grpo`` and ``launch`` start a fresh interpreter, as the README's commands do: ``grpo`` so that what a new user sees
includes what the libraries print while they are imported (no Apex/TE warnings), ``launch`` because it starts
torchrun itself. The others are forks of the suite's warm launcher (tests/_warm_cli.py: a process of its own that
runs the same ``megatron_fp8.cli.main`` with the same argv, after the imports): their output is the same, and the
console script and ``python -m`` entry points themselves are tests/cli/test_entry_points.py's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import _warm_cli
import pytest
import yaml

from megatron_fp8.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "megatron_fp8.cli"]
SMALL_RUN = [
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.warm_start_steps=1",
]


def readme_commands() -> list[str]:
    """The subcommands of the README's "Using it" usage block, in order (the generic ``COMMAND`` line left out)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Using it", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    names = [m.group(1) for m in re.finditer(r"^megatron-fp8 (?:\[--debug\] )?([a-z]+)", block, flags=re.M)]
    return [n for n in names if n != "COMMAND"]


def _run(*args: str, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """``megatron-fp8 *args`` from the repository root: a fresh interpreter with ``fresh``, else a warm fork."""
    if fresh:
        proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=900, check=False, cwd=ROOT)
    else:
        proc = _warm_cli.run(list(args), cwd=ROOT, timeout=900)
    assert proc.returncode == 0, (args, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_readme_commands_in_order(tmp_path):
    assert readme_commands() == ["doctor", "config", "manifest", "refit", "grpo", "report", "launch"]
    out = tmp_path / "run"

    doctor = _run("doctor", "--json")
    verdicts = json.loads(doctor.stdout)
    assert "blockwise" in json.dumps(verdicts)  # recipes x this machine

    config = _run("config", "--config", "configs/llama31_8b_fp8_nemorl_keys.yaml", "grpo.max_num_steps=3")
    data = yaml.safe_load(config.stdout)
    assert data["grpo"]["max_num_steps"] == 3 and data["policy"]["megatron_cfg"]["fp8_cfg"]["fp8_recipe"] == "blockwise"
    assert "# preflight:" in config.stdout and "approved" in config.stdout

    manifest = json.loads(_run("manifest", "--model", "tiny", "--json").stdout)
    assert manifest["source"].startswith("vllm-quant-method ")
    assert {"fingerprint", "fp8_params", "bf16_params"} <= set(manifest) and len(manifest["fp8_params"]) == 28

    refit = json.loads(_run("refit", "--model", "tiny", "--repeats", "1", "--json").stdout)
    assert refit["verified"] is True and refit["fp8_params"] == 28

    grpo = _run(
        "grpo", "--steps", "1", "--out", str(out), "--arms", "bf16,fp8,fp8_tis", "--no-progress", *SMALL_RUN, fresh=True
    )  # fmt: skip
    for name in ("metrics.jsonl", "summary.md", "metrics.png", "config.yaml"):
        assert (out / name).is_file(), name
    assert (out / "warm_start" / "model.safetensors").is_file()
    assert "| fp8_tis |" in grpo.stdout and "finished in" in grpo.stdout
    table = [line for line in grpo.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 5 and max(len(line) for line in table) <= 80, table  # the terminal summary fits 80 columns
    assert "Params for bucket" not in grpo.stderr and "Apex" not in grpo.stderr  # third-party noise at DEBUG
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3

    report = _run("report", str(out))
    assert "rebuilt from 3 step(s) of 3 arm(s)" in report.stdout and "| bf16 |" in report.stdout

    # torchrun -m megatron_fp8
    launched = _run("launch", "--nproc-per-node", "1", "config", "grpo.max_num_steps=3", fresh=True)
    assert "approved" in launched.stdout and "max_num_steps: 3" in launched.stdout


def _readme_shell_commands() -> list[list[str]]:
    """Every ``megatron-fp8 ...`` line of the README's bash blocks (continuations joined, comments and env dropped)."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("  #", 1)[0], comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            if words[:1] == ["megatron-fp8"]:
                commands.append(words[1:])
    return commands


def test_every_readme_command_names_a_command_and_options_it_has():
    """Each README command line: its subcommand exists and every ``--option`` is one ``COMMAND --help`` lists."""
    commands = _readme_shell_commands()
    assert len(commands) >= 10, commands
    helps: dict[str, str] = {}
    for words in commands:
        words = [w for w in words if w != "[--debug]"]
        if words[0] == "launch":  # torchrun's options, then the command it runs
            words = words[next(i for i, w in enumerate(words) if i and w in COMMANDS) :]
        if words[0] == "COMMAND":
            continue
        assert words[0] in COMMANDS, words
        if words[0] not in helps:
            helps[words[0]] = _run(words[0], "--help").stdout
        options = {w.strip("[]").split("=")[0] for w in words if w.strip("[]").startswith("--")}
        unknown = [o for o in options if o not in helps[words[0]]]
        assert unknown == [], (words, unknown)


def test_first_real_run_config_says_what_to_stage():
    """Issue 57 trip 1: the README's step-2 command on a fresh clone names the model folder, then ``DATA_DIR``."""
    line = next(w for w in _readme_shell_commands() if w[:1] == ["config"] and "configs/qwen3_8b_fp8.yaml" in w)
    env = {**os.environ, "WORLD_SIZE": "8"}
    env.pop("DATA_DIR", None)
    proc = _warm_cli.run(line, cwd=ROOT, timeout=300, env=env)
    assert proc.returncode == 1 and "/shared/models/Qwen3-8B' does not exist" in proc.stderr, proc.stderr[-2000:]
    without_model = [w for w in line if not w.startswith("model.name_or_path=")]
    proc = _warm_cli.run(without_model, cwd=ROOT, timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "data.train.data_path: no such file data/openmathinstruct2/train.jsonl" in proc.stderr
    assert "${oc.env:DATA_DIR,data}" in proc.stderr and "DATA_DIR unset" in proc.stderr
    assert 'docs/cluster.md, "Stage the data"' in proc.stderr and "Traceback" not in proc.stderr
    staged = {**env, "DATA_DIR": "/nonexistent-data"}
    proc = _warm_cli.run(without_model, cwd=ROOT, timeout=300, env=staged)
    assert "DATA_DIR='/nonexistent-data'" in proc.stderr, proc.stderr[-2000:]
