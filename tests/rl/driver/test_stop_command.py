"""The command a stopped run prints (:func:`~megatron_fp8.rl.driver.stopping.next_command`), for every stop reason.

The runs in ``tests/cli/test_stop_advice.py`` run the printed command after SIGTERM and Ctrl-C; the rule is the same
function for every reason, checked here for each (the deadline included) without a run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_fp8.rl.driver.stopping import DEADLINE, STOP_SIGNALS, RunStopped, next_command, stop_message


def _stopped(reason: str, *, checkpoint: Path | None, out_dir: Path | None) -> RunStopped:
    return RunStopped(
        "x", reason=reason, arm="fp8", completed_steps=1, total_steps=3, checkpoint=checkpoint, out_dir=out_dir
    )


@pytest.mark.parametrize("reason", [*STOP_SIGNALS, DEADLINE])
def test_without_a_checkpoint_the_command_starts_over_in_the_same_folder(reason):
    stopped = _stopped(reason, checkpoint=None, out_dir=Path("out/grpo-1"))
    saves = ["checkpointing.enabled=true"] if reason == DEADLINE else []  # issue 57, trip 5: no loop at a deadline
    assert next_command(["grpo", "--steps", "3"], stopped) == [
        "grpo",
        "--steps",
        "3",
        "--out",
        "out/grpo-1",
        "--overwrite",
        *saves,
    ]
    given = next_command(["grpo", "--out=o", "--overwrite", *saves], stopped)
    assert given == ["grpo", "--out=o", "--overwrite", *saves]  # none repeated
    line = stop_message(stopped, command="megatron-fp8 grpo --out o --overwrite")
    assert "nothing was saved (checkpointing.enabled=false)" in line and "start over with" in line
    assert "continue with" not in line


@pytest.mark.parametrize("reason", [*STOP_SIGNALS, DEADLINE])
def test_with_a_checkpoint_the_command_continues_and_never_overwrites(reason):
    stopped = _stopped(reason, checkpoint=Path("o/checkpoints/fp8/step_0"), out_dir=Path("o"))
    assert next_command(["grpo", "--out", "o", "--overwrite"], stopped) == ["grpo", "--out", "o"]
    assert "continue with: megatron-fp8 grpo --out o" in stop_message(stopped, command="megatron-fp8 grpo --out o")


def test_a_deadline_start_over_replaces_checkpointing_off_instead_of_repeating_the_key():
    """A command that turned checkpointing off by name gets it on in its place, not the key twice (was: both
    ``checkpointing.enabled=false`` and ``=true`` in the printed command, which now warns about a repeated key)."""
    stopped = _stopped(DEADLINE, checkpoint=None, out_dir=Path("o"))
    command = next_command(["grpo", "--out", "o", "checkpointing.enabled=false", "grpo.seed=1"], stopped)
    assert command == ["grpo", "--out", "o", "grpo.seed=1", "--overwrite", "checkpointing.enabled=true"]
