"""A full disk is named, not reported as a bug: the path, the bytes needed and free, what was kept, how to rerun.

Each case runs the real CLI with its folder on a real 300 KiB tmpfs (mounted here: root only, else skipped), then
grows the filesystem (``mount -o remount``) and runs the advised command, which must work:

* the tiny-model cache (``MEGATRON_FP8_CACHE``) while ``config`` generates the model (it was
  "unexpected error: SafetensorError: ... No space left on device ... please report it", with no path);
* ``grpo --out`` while the warm start writes its safetensors: the run's folder then holds its ``config.yaml``, which
  a plain rerun refuses, so the advice is ``--overwrite``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import _warm_cli
import pytest

CLI = [sys.executable, "-m", "megatron_fp8.cli"]
SMALL = ("grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.warm_start_steps=1")


@pytest.fixture
def tiny_fs(tmp_path) -> Iterator[Path]:
    """A 300 KiB tmpfs mounted at ``tmp_path/fs`` (unmounted after the test)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mnt)], check=False).returncode:
        pytest.skip("mount -t tmpfs is not permitted here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _grow(mnt: Path) -> None:
    subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """``megatron-fp8 argv[3:]`` in a process of its own (the suite's warm launcher, tests/_warm_cli.py)."""
    assert argv[:3] == CLI, argv
    return _warm_cli.run(argv[3:], env={**os.environ, **env}, timeout=600)


def _error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "please report" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr.strip().splitlines()[-1]


def test_a_full_model_cache_is_named_and_the_rerun_works(tiny_fs):
    line = _error_line(_run([*CLI, "config"], MEGATRON_FP8_CACHE=str(tiny_fs)))
    found = re.search(r"no space left writing (\S+) \((\d+) bytes needed, (\d+) bytes free on its filesystem\)", line)
    assert found, line
    assert Path(found[1]).parent == tiny_fs / "models" and int(found[2]) > 300 << 10 > int(found[3])
    assert "kept: the cache's other models; the partial folder" in line and "MEGATRON_FP8_CACHE" in line
    assert list((tiny_fs / "models").iterdir()) == []  # no partial folder left to trip the next run
    _grow(tiny_fs)
    again = _run([*CLI, "config"], MEGATRON_FP8_CACHE=str(tiny_fs))
    assert again.returncode == 0 and "approved" in again.stdout, again.stderr[-3000:]


def test_a_full_out_folder_is_named_and_the_advised_rerun_works(tiny_fs):
    out = tiny_fs / "run"
    argv = [*CLI, "grpo", "--steps", "1", "--arms", "bf16", "--no-progress", "--out", str(out), *SMALL]
    line = _error_line(_run(argv))
    weights = out / "warm_start" / "model.safetensors"
    assert re.search(rf"no space left writing {re.escape(str(weights))} \(\d+ bytes needed, \d+ bytes free", line), line
    assert f"{out} keeps the 0 completed step record(s) in metrics.jsonl and no checkpoint" in line
    assert "rerun with --overwrite" in line
    assert not list((out / "warm_start").glob("*.safetensors*"))  # no partial weights
    _grow(tiny_fs)
    refused = _run(argv)  # what blocked the rerun: the folder holds this run's config.yaml
    assert refused.returncode == 2 and "already holds" in refused.stderr, refused.stderr[-2000:]
    again = _run([*argv, "--overwrite"])  # as advised
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "summary.md").is_file() and weights.is_file()
