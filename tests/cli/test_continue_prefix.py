"""Issue 57 trip 6: the command a stopped run prints starts as the ranks were started: ``megatron-fp8 launch`` as
typed, the one-node ``launch`` equivalent of plain torchrun (a signal then ends in one line, not torchrun's
traceback), torchrun's node and process counts on several nodes, else ``megatron-fp8``."""

from __future__ import annotations

import pytest

from megatron_fp8.cli.grpo import continue_prefix
from megatron_fp8.cli.launch import LAUNCH_ENV


@pytest.mark.parametrize(
    ("env", "prefix"),
    [
        ({}, "megatron-fp8"),
        ({"RANK": "0", "WORLD_SIZE": "1"}, "megatron-fp8"),  # a single process, or srun's ranks (no torchrun)
        ({LAUNCH_ENV: "megatron-fp8 launch --nproc-per-node 2", "TORCHELASTIC_RUN_ID": "x"}, "megatron-fp8 launch --nproc-per-node 2"),
        ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "8"}, "megatron-fp8 launch --nproc-per-node 8"),
        ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "16"}, "torchrun --nnodes 2 --nproc-per-node 8 -m megatron_fp8"),
        ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "eight"}, "megatron-fp8"),
    ],
)  # fmt: skip
def test_the_continue_command_starts_as_the_ranks_were_started(env, prefix):
    assert continue_prefix(env) == prefix
