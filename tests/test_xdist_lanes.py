"""``make test PYTEST_WORKERS=N``'s scheduler (tests/conftest.py): the units that start several processes at once run
on the first worker only, one after the other; the other workers run the rest, and the first helps with the rest once
its own are done. Driven here with stand-in workers, tick by tick, as pytest-xdist's controller drives it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import OrderedDict
from types import SimpleNamespace

import conftest
import pytest

pytest.importorskip("xdist")

COLLECTION = [
    "tests/slurm/test_sbatch.py::test_a",
    "tests/slurm/test_requeue.py::test_b",
    "tests/rl/driver/test_model_parallel.py::test_c",
    "tests/rl/driver/test_model_parallel.py::test_d",
    "tests/rl/driver/test_grpo.py::test_e",
    "tests/quant/test_triton.py::test_f",
    "tests/quant/test_triton.py::test_g",
    "tests/config/test_load.py::test_h",
    "tests/refit/test_buckets.py::test_i",
    "tests/cli/test_launch_signal.py::test_j",
]


class _Worker:
    def __init__(self, name: str) -> None:
        self.name, self.pending, self.shutting_down = name, [], False
        self.gateway = SimpleNamespace(id=name)

    def send_runtest_some(self, indices: list[int]) -> None:
        assert not self.shutting_down
        self.pending.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def _scheduler(workers: list[_Worker]):
    sched = object.__new__(conftest._ScopeScheduling)
    sched.numnodes, sched.collection = len(workers), None
    sched.workqueue, sched.assigned_work, sched.registered_collections = OrderedDict(), {}, {}
    sched.log = lambda *a: None
    sched.config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=False))
    for w in workers:
        sched.add_node(w)
        sched.add_node_collection(w, COLLECTION)
    return sched


@pytest.mark.parametrize("n", [2, 3])
def test_solo_units_run_on_the_first_worker_one_after_the_other_and_every_test_runs_once(n):
    workers = [_Worker(f"gw{i}") for i in range(n)]
    sched = _scheduler(workers)
    sched.schedule()
    ran: list[tuple[int, str, str]] = []  # (tick, worker, node id)
    tick = 0
    while any(w.pending for w in workers):
        for w in workers:  # each worker runs one test per tick, then reports it as the controller hears it
            if w.pending:
                index = w.pending.pop(0)
                ran.append((tick, w.name, COLLECTION[index]))
                sched.mark_test_complete(w, index)
        tick += 1
    assert sorted(nodeid for _, _, nodeid in ran) == sorted(COLLECTION)  # each once
    assert all(w.shutting_down for w in workers) and sched.tests_finished
    solo = {nodeid for nodeid in COLLECTION if conftest.solo_unit(conftest.xdist_scope(nodeid))}
    assert solo == {COLLECTION[i] for i in (0, 1, 2, 3, 9)}  # Slurm, and the modules marked ``processes``
    assert {worker for _, worker, nodeid in ran if nodeid in solo} == {"gw0"}
    others = {worker for _, worker, nodeid in ran if nodeid not in solo}
    assert others >= {f"gw{i}" for i in range(1, n)}  # the other workers ran the rest from the first tick
    first_rest_on_gw0 = min((t for t, worker, nodeid in ran if worker == "gw0" and nodeid not in solo), default=None)
    assert first_rest_on_gw0 is None or first_rest_on_gw0 > max(t for t, _, nodeid in ran if nodeid in solo)


@pytest.mark.parametrize(
    ("cores", "workers", "given", "threads"),
    [(2, 2, None, 1), (16, 2, None, 8), (3, 2, None, 1), (2, 3, None, 1), (2, 0, None, None), (2, 1, None, None)]
    + [(2, 2, "2", None)],
)
def test_each_worker_takes_its_share_of_the_cores_unless_the_user_set_the_threads(cores, workers, given, threads):
    assert conftest.worker_threads(cores=cores, workers=workers, given=given) == threads


def test_a_worker_and_the_processes_its_tests_start_run_with_its_share(tmp_path):
    """What a worker does at configure time, in a fresh interpreter with pytest-xdist's worker count set: torch in
    the worker and a process it starts both run ``cores // 2`` threads."""
    probe = (
        "import os, subprocess, sys; sys.path.insert(0, 'tests'); import conftest, torch; conftest._share_the_cores(); "
        "child = subprocess.run([sys.executable, '-c', 'import torch; print(torch.get_num_threads())'], "
        "capture_output=True, text=True, check=True).stdout.strip(); "
        "print(os.environ['OMP_NUM_THREADS'], torch.get_num_threads(), child)"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTEST_XDIST_WORKER_COUNT": "2"}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=conftest.REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    share = str(max(1, conftest.usable_cores() // 2))
    assert out.stdout.split() == [share, share, share]
