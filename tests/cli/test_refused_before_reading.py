"""What a new user mistypes is refused by what it is, before it is read: run through the real CLI.

* a config file above the 1 MiB limit is refused by its size, naming the file, its size and the limit, before it is
  parsed (a file of only comments would otherwise be parsed and called empty: the message tells which ran first);
* an override value above the 64 KiB limit likewise;
* ``--config DIR`` says it is a directory and names a file to pass;
* ``--model /nonexistent/path`` says the path does not exist instead of advising a Hugging Face download of it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import _warm_cli

CLI = [sys.executable, "-m", "megatron_fp8.cli"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``megatron-fp8 *args`` in a process of its own (the suite's warm launcher, tests/_warm_cli.py)."""
    return _warm_cli.run(list(args), timeout=300)


def _refused(proc: subprocess.CompletedProcess[str], *, code: int = 1) -> str:
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "approved" not in proc.stdout
    return proc.stderr.strip().splitlines()[-1]


def test_an_oversized_config_is_refused_by_its_size_before_parsing(tmp_path):
    big = tmp_path / "big.yaml"
    line = "# " + "x" * 98 + "\n"
    big.write_text(line * (3 * (1 << 20) // len(line)))  # 3 MiB of comments: parsed, it would "set no key"
    size = big.stat().st_size
    message = _refused(_cli("config", "--config", str(big)))
    assert f"{big} is 3.0 MiB ({size} bytes)" in message and "the limit is 1 MiB" in message, message
    assert "sets no key" not in message


def test_an_oversized_override_is_refused_by_its_size(tmp_path):
    override = "grpo.arms=[" + ",".join(["bf16"] * 14000) + "]"  # 70 KB, below Linux's 128 KiB per argument
    message = _refused(_cli("config", override), code=2)  # a bad override is a usage error
    assert f"override grpo.arms=... is {len(override)} bytes (the limit is 65536 bytes)" in message, message


def test_config_given_a_directory_says_so_and_names_a_file(tmp_path):
    (tmp_path / "run.yaml").write_text("grpo: {max_num_steps: 2}\n")
    message = _refused(_cli("config", "--config", str(tmp_path)))
    assert f"config {str(tmp_path)!r} is a directory (it holds run.yaml)" in message, message
    assert f"--config {tmp_path / 'NAME.yaml'}" in message and "not found" not in message


def test_a_model_path_that_does_not_exist_is_named_not_downloaded(tmp_path):
    missing = Path("/nonexistent/path")
    message = _refused(_cli("manifest", "--model", str(missing)))
    assert f"model path {str(missing)!r} does not exist" in message, message
    assert "huggingface-cli" not in message
