"""``say``: the ranks of one job share a stderr pipe (torchrun, ``srun``); each line arrives whole.

``print(line, file=sys.stderr)`` writes the text and its newline in two calls, so two ranks can produce
``line-aline-b`` followed by two newlines (a CI run failed on exactly that in ``test_launch_signal``).
"""

from __future__ import annotations

import os
import subprocess
import sys

WRITER = """
import sys
from megatron_fp8.cli._io import say
rank = int(sys.argv[1])
for i in range(200):
    say(f"rank {rank} line {i} " + "x" * 2000 + " end")
"""


def test_lines_from_four_processes_on_one_pipe_arrive_whole():
    read, write = os.pipe()
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(rank)], stderr=write, stdout=subprocess.DEVNULL)
        for rank in range(4)
    ]
    os.close(write)
    with open(read, "rb") as pipe:
        data = pipe.read().decode()
    assert all(p.wait(timeout=120) == 0 for p in procs)
    lines = data.splitlines()
    assert len(lines) == 800
    for line in lines:
        head, _, tail = line.partition(" " + "x" * 2000 + " ")
        assert tail == "end" and head.startswith("rank ") and len(head.split()) == 4, line[:80]
    for rank in range(4):
        assert sorted(int(ln.split()[3]) for ln in lines if ln.startswith(f"rank {rank} ")) == list(range(200))


def test_without_a_descriptor_it_writes_to_the_stream(capsys):
    from megatron_fp8.cli._io import say

    say("one line")
    assert capsys.readouterr().err == "one line\n"
