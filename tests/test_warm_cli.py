"""The suite's warm launcher (tests/_warm_cli.py) gives a command what a fresh ``python -m megatron_fp8.cli`` gets:
its exit code, its own stdout and stderr, its environment and working directory; and torchrun's worker variables
per rank."""

from __future__ import annotations

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
