"""A SIGUSR1 outside the step loop does not kill ``megatron-fp8 grpo``: Slurm's "time limit near" warning, passed on by
``grpo.sbatch`` to every rank, can reach a rank that finished its last step and is writing its outputs (seen on a
loaded 2-core machine: a finished 2-step run died with exit 138 and its job failed)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")

CHILD = textwrap.dedent(
    """
    import logging, os, signal, sys
    logging.basicConfig(level=logging.INFO)
    from megatron_fp8.rl.driver.stopping import StopRequests, tolerate_usr1_outside_steps
    tolerate_usr1_outside_steps()
    late = signal.getsignal(signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)  # before the step loop: logged, not fatal
    with StopRequests() as stops:  # the step loop's own handler takes over ...
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stops.requested == "SIGUSR1", stops.requested
    assert signal.getsignal(signal.SIGUSR1) is late  # ... and hands it back
    os.kill(os.getpid(), signal.SIGUSR1)  # after the last step: logged, not fatal
    print("exited normally")
    """
)


def test_sigusr1_before_and_after_the_step_loop_is_logged_not_fatal():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exited normally" in proc.stdout
    assert proc.stderr.count("SIGUSR1 outside the GRPO step loop") == 2


def test_without_it_the_default_action_kills():
    """The control: what happened before (exit 128 + 10 = 138, i.e. -SIGUSR1 from subprocess)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGUSR1); print('alive')"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGUSR1 and "alive" not in proc.stdout
