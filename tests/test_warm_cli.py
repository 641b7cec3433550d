"""The suite's warm launcher (tests/_warm_cli.py) gives a command what a fresh ``python -m megatron_fp8.cli`` gets:
its exit code, its own stdout and stderr, its environment and working directory; and torchrun's worker variables
per rank."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time

import _warm_cli
import pytest


@pytest.fixture(scope="module")
def launcher():
    """The suite's own launcher (its zygote already warm when other tests used it): the one under test."""
    return _warm_cli.shared()


def test_exit_code_streams_env_and_cwd_match_a_fresh_interpreter(launcher, tmp_path):
    env = {**os.environ, "MEGATRON_FP8_CACHE": str(tmp_path / "cache")}
    for argv in (["config", "--bogus"], ["config", "grpo.arms=bf16,"], ["--version"]):
        warm = launcher.run(argv, env=env, cwd=tmp_path)
        fresh = subprocess.run(
            [sys.executable, "-m", "megatron_fp8.cli", *argv], env=env, cwd=tmp_path, capture_output=True, text=True
        )
        assert (warm.returncode, warm.stdout) == (fresh.returncode, fresh.stdout), argv
        assert warm.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:], argv


def test_a_fast_commands_two_replies_in_one_read_are_both_seen(launcher, tmp_path):
    z = launcher._zygote(dict(os.environ))
    z.wait_ready()
    for _ in range(3):
        proc = launcher.run(["config", "--bogus"], timeout=60)
        assert proc.returncode == 2
    # the reply lines of a command that ended before they are read arrive in one read of the pipe
    out = launcher.run(["--version"], timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("megatron-fp8 ")
    (tmp_path / "out").touch()
    (tmp_path / "err").touch()
    z.request(
        {"argv": ["--version"], "env": dict(os.environ), "cwd": os.getcwd(), "nprocs": 1}
        | {"stdout": str(tmp_path / "out"), "stderr": str(tmp_path / "err")}
    )
    time.sleep(3)  # both the pid and the rc line are in the pipe now
    assert "pid" in z.reply(5) and z.reply(5) == {"rc": 0}
    assert (tmp_path / "out").read_text().startswith("megatron-fp8 ")


def test_a_failed_rank_stops_the_others_and_fails_the_launch(launcher, tmp_path):
    proc = launcher.run(["report", str(tmp_path / "missing")], nprocs=2, timeout=120)
    assert proc.returncode == 1  # a rank failed: the survivors get SIGTERM and the launch exits 1, as torchrun's
    assert 1 <= proc.stderr.count("megatron-fp8 report: error: ") <= 2, proc.stderr  # the ranks share one stderr


def test_a_launcher_whose_pipe_is_above_fd_1024_still_hears_its_replies():
    """A long pytest session holds many descriptors: the zygote's pipe can land above select()'s 1024 limit.
    (What the zygote imported plays no part here: it imports nothing, and the command fails in its argument parser.)"""
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    cli = _warm_cli.WarmCli(preload=False)
    try:
        proc = cli.run(["config", "--bogus"], timeout=300)
        assert proc.returncode == 2 and "unrecognized arguments: --bogus" in proc.stderr
    finally:
        cli.close()
        for fd in fds:
            os.close(fd)


def test_pythonpath_entries_are_the_ones_a_fresh_interpreter_puts_on_sys_path(tmp_path):
    value = os.pathsep.join(["rel", "", str(tmp_path / "abs"), "rel", str(tmp_path / "abs")])
    fresh = subprocess.run(
        [sys.executable, "-S", "-c", "import sys; print(repr(sys.path))"],
        env={**os.environ, "PYTHONPATH": value},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    # -S: no site, so the entries stay as the interpreter wrote them; site only makes them absolute and unique
    listed = [os.path.abspath(os.path.join(tmp_path, p)) for p in ast.literal_eval(fresh.stdout)[1 : 1 + 5]]
    unique = list(dict.fromkeys(listed))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert _warm_cli._pythonpath_entries(value) == unique
    finally:
        os.chdir(cwd)
    assert _warm_cli._pythonpath_entries("") == _warm_cli._pythonpath_entries(None) == []


def test_a_users_module_on_pythonpath_is_imported_by_the_forked_command(launcher, tmp_path):
    """The reward function comes from a package on the command's ``PYTHONPATH``, which the zygote never had."""
    launcher._zygote({k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).wait_ready()  # started without it
    pkg = tmp_path / "site" / "my_rewards"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "fns.py").write_text("def always(prompt, response, answer):\n    return 1.0\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "MEGATRON_FP8_CACHE": str(tmp_path / "cache")}
    argv = [
        "grpo", "--steps", "1", "--arms", "bf16", "--no-progress", "--out", str(tmp_path / "out"),
        "grpo.warm_start_steps=0", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
        "data.train.data_path=data/math_tiny/train.jsonl", "data.train.input_key=problem",
        "data.train.output_key=expected_answer", "data.default.env_name=my_rewards.fns:always",
    ]  # fmt: skip
    proc = launcher.run(argv, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"reward_mean": 1.0' in (tmp_path / "out" / "metrics.jsonl").read_text()


def test_a_pythonpath_folder_shadowing_an_imported_module_gets_a_fresh_interpreter(launcher, tmp_path):
    """A fresh interpreter imports the ``yaml`` it finds first on ``PYTHONPATH``; so does the command, though its
    zygote imported the installed one."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "yaml.py").write_text("raise SystemExit('the yaml of PYTHONPATH was imported')\n")
    env = {**os.environ, "PYTHONPATH": str(shadow)}
    fresh = subprocess.run(
        [sys.executable, "-m", "megatron_fp8.cli", "config"], env=env, capture_output=True, text=True, timeout=300
    )
    warm = launcher.run(["config"], env=env, timeout=300)
    assert fresh.returncode == 1 and "the yaml of PYTHONPATH was imported" in fresh.stderr
    assert (warm.returncode, warm.stderr.splitlines()[-1:]) == (fresh.returncode, fresh.stderr.splitlines()[-1:])
