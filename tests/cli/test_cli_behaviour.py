"""The command line behaves like a good CLI (issue 21, items 5 and 6): a table of careless inputs, each with its exit
code and the one line that names what to fix; overrides anywhere; readable outputs."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import _warm_cli
import pytest

from megatron_fp8.config import load_config
from megatron_fp8.files import write_atomically

REPO = Path(__file__).resolve().parents[2]


def _cli(
    *args: str, cwd: Path = REPO, env: dict[str, str] | None = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """``megatron-fp8 *args`` in a process of its own: forked by the suite's warm launcher (tests/_warm_cli.py), or
    with ``fresh`` a new interpreter (what shows import-time output: third-party noise)."""
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGATRON_FP8_CACHE")
    environ = {k: v for k, v in os.environ.items() if k not in launch} | (env or {})
    if not fresh:
        return _warm_cli.run(list(args), cwd=cwd, env=environ, timeout=300)
    return subprocess.run(
        [sys.executable, "-m", "megatron_fp8.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=environ,
    )


def _fresh_together(*argvs: tuple[str, ...], env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    """``_cli(*argv, env=env, fresh=True)`` for each argv, the interpreters started together (each a process of its
    own, as apart as one after another; their imports share the machine's cores instead of waiting in turn)."""
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGATRON_FP8_CACHE")
    environ = {k: v for k, v in os.environ.items() if k not in launch} | env
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "megatron_fp8.cli", *argv],
            cwd=REPO,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs, strict=True)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("grpo", "--arms", ""), 2, "--arms '' has an empty arm name"),
        (("grpo", "--arms", "bf16,,fp8"), 2, "has an empty arm name"),
        (("grpo", "--out", ""), 2, "--out '' names no folder"),
        (("config", "--bogus"), 2, "unrecognized arguments: --bogus"),
        (("config", "grpo.arms=bf16,"), 1, "grpo.arms: 'bf16,' has an empty item"),
        (("report", "README.md"), 2, "is a file; report wants the run folder that holds metrics.jsonl"),
        (("config", "policy.generation.top_p=0.5"), 1, "--allow-no-effect"),
        (("grpo", "--arms", "bf16,fp9"), 2, "--arms 'bf16,fp9': unknown arm(s) ['fp9']"),  # issue 57, trip 2
        (("launch", "--nproc-per-node", "abc", "config"), 2, "--nproc-per-node 'abc': give the processes per node"),
    ],
    ids=[
        "empty-arms",
        "empty-arm",
        "empty-out",
        "unknown-option",
        "empty-list-item",
        "report-file",
        "no-effect",
        "unknown-arm",
        "nproc-not-a-number",
    ],
)
def test_careless_input_gets_one_line_and_the_right_exit_code(args, code, message):
    proc = _cli(*args)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "please report it" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (("config",), {"WORLD_SIZE": "abc"}, "environment variable WORLD_SIZE='abc' is not a whole number"),
        (("config",), {"WORLD_SIZE": "0"}, "environment variable WORLD_SIZE=0 must be >= 1"),
        (("config",), {"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5 and WORLD_SIZE=2: a rank must be below"),
        (("config",), {"WORLD_SIZE": "2", "RANK": "x"}, "environment variable RANK='x' is not a whole number"),
        (("config",), {"LOCAL_RANK": "-1", "WORLD_SIZE": "1"}, "environment variable LOCAL_RANK=-1 must be >= 0"),
        (
            ("manifest", "--model", "tiny"),
            {"MEGATRON_FP8_CACHE": "/proc/no-such-folder"},
            "MEGATRON_FP8_CACHE=/proc/no-such-folder: the tiny-model cache folder",
        ),
    ],
    ids=["world-not-a-number", "world-zero", "rank-too-big", "rank-not-a-number", "local-rank-negative", "cache"],
)
def test_a_bad_environment_variable_gets_one_line_naming_it(args, env, message):
    proc = _cli(*args, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr and "please report it" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if "error" in line]) == 1, proc.stderr


def test_a_dotted_key_in_a_yaml_file_is_nesting_and_a_clash_is_refused(tmp_path):
    dotted = tmp_path / "dotted.yaml"
    dotted.write_text("grpo.max_num_steps: 3\npolicy.megatron_cfg.optimizer:\n  lr: 0.5\ngrpo:\n  seed: 7\n")
    cfg = load_config(dotted)
    assert (cfg.grpo.max_num_steps, cfg.grpo.seed, cfg.policy.megatron_cfg.optimizer.lr) == (3, 7, 0.5)
    twice = tmp_path / "twice.yaml"
    twice.write_text("grpo.max_num_steps: 3\ngrpo:\n  max_num_steps: 4\n")
    proc = _cli("config", "--config", str(twice))
    assert proc.returncode == 1 and "'grpo.max_num_steps' is given twice" in proc.stderr, proc.stderr
    through = tmp_path / "through.yaml"
    through.write_text("grpo: 3\ngrpo.num_steps: 4\n")
    proc = _cli("config", "--config", str(through))
    assert proc.returncode == 1 and "which 'grpo' sets to a value, not a mapping" in proc.stderr, proc.stderr


def test_a_huge_config_file_is_refused_at_once(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"a: 1\n" * 300_000)  # 1.5 MB
    proc = _cli("config", "--config", str(big))
    assert proc.returncode == 1 and "not a config file (the limit is 1 MiB" in proc.stderr


def test_overrides_may_stand_anywhere_and_a_comma_list_is_a_list():
    proc = _cli("config", "grpo.max_num_steps=3", "--json", "grpo.seed=4", "grpo.arms=bf16,fp8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"max_num_steps": 3' in proc.stdout and '"seed": 4' in proc.stdout
    assert load_config(None, ["grpo.arms=bf16,fp8"]).grpo.arms == load_config(None, ["grpo.arms=[bf16, fp8]"]).grpo.arms


def test_outputs_are_written_with_the_users_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_atomically(tmp_path / "summary.md", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # mkstemp alone would leave 0600, unreadable to teammates


def test_doctor_fits_one_screen_and_all_gives_every_reason():
    short = _cli("doctor")
    full = _cli("doctor", "--all")
    assert short.returncode == 0 and full.returncode == 0, short.stderr[-2000:]
    assert len(short.stdout.splitlines()) <= 45, short.stdout  # a row per recipe, its first blocking reason
    assert len(full.stdout.splitlines()) > len(short.stdout.splitlines())


@pytest.mark.slow
@pytest.mark.processes  # two fresh interpreters at once
def test_refit_and_manifest_refresh_show_progress_and_no_third_party_noise(tmp_path):
    """Without -v: our phase lines, no Megatron parameter count or loading bar, no vLLM loading bar, no C++ warning
    of torch/vLLM, no Python warning (issue 21, item 6)."""
    noise = ("number of parameters", "Loading", "NUMA", "Warning:", "UserWarning", "it/s]")
    env = {"MEGATRON_FP8_CACHE": str(tmp_path / "cache")}
    manifest = _cli("manifest", "--model", "tiny", "--refresh", env=env, fresh=True)
    assert manifest.returncode == 0, manifest.stderr[-3000:]
    assert "building vLLM" in manifest.stderr and "in FP8" in manifest.stderr
    # the two refits only read the cache the manifest command filled: started together
    refit, verbose = _fresh_together(
        ("refit", "--model", "tiny", "--repeats", "1"), ("-v", "refit", "--model", "tiny", "--repeats", "1"), env=env
    )
    assert refit.returncode == 0, refit.stderr[-3000:]
    assert (
        "building the Megatron-Core model" in refit.stderr and "FP8 refit(s) in process, verified: done" in refit.stderr
    )
    for proc in (manifest, refit):
        output = proc.stdout + proc.stderr
        assert not [n for n in noise if n in output], output[-3000:]
    assert "number of parameters" in verbose.stdout + verbose.stderr  # -v shows the Megatron stack's own output


@pytest.mark.parametrize(
    ("env", "prefix"),
    [
        ({}, "INFO name: message"),
        ({"RANK": "0", "WORLD_SIZE": "1"}, "INFO name: message"),
        ({"RANK": "3", "WORLD_SIZE": "8"}, "INFO [rank 3] name: message"),
        ({"RANK": "x", "WORLD_SIZE": "8"}, "INFO name: message"),  # a bad RANK is the launch checks' to report
    ],
)
def test_log_lines_name_the_rank_when_a_launcher_started_several(env, prefix):
    import logging

    from megatron_fp8.cli import log_format

    record = logging.LogRecord("name", logging.INFO, __file__, 1, "message", None, None)
    assert logging.Formatter(log_format(env)).format(record) == prefix
