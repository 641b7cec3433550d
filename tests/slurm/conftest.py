"""A real single-node Slurm cluster for the sbatch tests (``@pytest.mark.slurm``).

The ``slurm_cluster`` fixture writes a ``slurm.conf`` into a temporary directory (state, spool,
logs and pid files all live there), starts Debian's ``slurmctld`` and ``slurmd`` in the foreground
(``-D``) as subprocesses, waits until the node is idle, and stops both daemons at the end of the
session. Authentication is ``auth/none`` with ``cred/none`` (no munge daemon), the controller listens
on 127.0.0.1 on free ports, the node is ``hostname -s`` with ``NodeAddr=127.0.0.1`` and the CPUs
and memory ``slurmd -C`` reports. Needs root. When the Slurm binaries are missing, it installs them
with ``make system-deps`` (root + apt-get); otherwise it skips with the reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_fp8.launch_env import find_free_ports

REPO_ROOT = Path(__file__).resolve().parents[2]
SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
FINISHED_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY",
}  # fmt: skip
"""Job states after which a job no longer runs (Slurm's ``IS_JOB_FINISHED``; a requeued job is PENDING again)."""


@dataclass(frozen=True)
class SlurmCluster:
    """A running single-node cluster.

    Attributes:
        conf: path of its ``slurm.conf``.
        root: temporary directory holding state, spool and daemon logs.
        node: the node name (``hostname -s``).
        cpus: CPUs the node offers.
        env: environment for Slurm client commands (``SLURM_CONF`` set, inherited ``SLURM_*`` job variables
            removed so a submission never looks like a nested step).
    """

    conf: Path
    root: Path
    node: str
    cpus: int
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 60, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """Run a Slurm client command (``sbatch``, ``scontrol``, ...) against this cluster."""
        return subprocess.run(
            list(args),
            env=kwargs.pop("env", self.env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            **kwargs,
        )

    def job_fields(self, job: str) -> dict[str, str]:
        """``scontrol show job JOB`` as ``{field: value}`` (``{}`` once Slurm no longer knows the job)."""
        out = self.run("scontrol", "show", "job", "-o", job, check=False).stdout
        return dict(w.split("=", 1) for w in out.split() if "=" in w)

    def submit(
        self,
        logs: Path,
        script: str,
        *args: str,
        env: dict[str, str],
        sbatch_opts: tuple[str, ...] = (),
        time_limit_min: int = 10,
        timeout: float = 150,
    ) -> tuple[int, str]:
        """Submit ``SCRIPT ARGS`` from the repository root and wait for the job to end: (its exit status as
        ``sbatch --wait`` gives it: the batch script's exit code, 1 when a signal ended it; the job's log written
        under ``logs``).

        The job's state is read every 0.5 s (``scontrol show job``), not through ``sbatch --wait``, whose polling
        backs off 2, 8, 32 s: a 3 s job took 10 s and an 11 s one 42 s. Fails the test (with the daemon logs) when
        sbatch refuses the job or it has not ended after ``timeout`` seconds (then it is cancelled).
        """
        logs.mkdir(parents=True, exist_ok=True)
        res = self.run(
            "sbatch",
            "--parsable",
            f"--output={logs}/%x-%j.out",
            f"--time={time_limit_min}",
            *sbatch_opts,
            script,
            *args,
            cwd=REPO_ROOT,
            env={**self.env, **env},
            check=False,
        )
        job = res.stdout.strip().split(";")[0]
        if res.returncode != 0 or not job.isdigit():
            pytest.fail(f"sbatch refused the job: {res.stderr}\n{self.daemon_logs()}")
        deadline = time.monotonic() + timeout
        while (fields := self.job_fields(job)).get("JobState") not in FINISHED_STATES:
            if time.monotonic() > deadline:
                self.run("scancel", job, check=False)
                pytest.fail(f"job {job} not finished after {timeout} s: {fields}\n{self.daemon_logs()}")
            time.sleep(0.5)
        exit_code, signal_number = (int(v) for v in fields.get("ExitCode", "1:0").split(":"))
        log = "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.out")))
        return (1 if signal_number else exit_code), log

    def daemon_logs(self) -> str:
        """Tail of both daemon logs, for failure messages."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            text = path.read_text(errors="replace") if path.exists() else "(missing)"
            parts.append(f"--- {name} (tail)\n" + "\n".join(text.splitlines()[-25:]))
        return "\n".join(parts)


def _missing_binaries() -> list[str]:
    return [b for b in SLURM_BINARIES if shutil.which(b) is None]


def _ensure_slurm_installed() -> None:
    missing = _missing_binaries()
    if not missing:
        return
    if os.geteuid() != 0:
        pytest.skip(f"Slurm binaries missing ({', '.join(missing)}) and not root: run 'sudo make system-deps'")
    if shutil.which("apt-get") is None:
        pytest.skip(f"Slurm binaries missing ({', '.join(missing)}) and no apt-get: install slurm-wlm")
    proc = subprocess.run(["make", "-s", "system-deps"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    missing = _missing_binaries()
    if missing:
        pytest.skip(
            f"'make system-deps' did not provide {', '.join(missing)}: {proc.stdout[-400:]}{proc.stderr[-400:]}"
        )


def _node_hardware() -> tuple[int, int]:
    """CPUs and RealMemory (MiB) as ``slurmd -C`` reports them (what slurmd will register)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
    return int(fields["CPUs"]), int(fields["RealMemory"])


def _write_conf(root: Path, node: str, cpus: int, memory_mb: int) -> Path:
    for sub in ("state", "spool", "log", "run"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    ctld_port, slurmd_port = find_free_ports(2)
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "# single-node test cluster written by tests/slurm/conftest.py",
                "ClusterName=mfp8test",
                "SlurmctldHost=localhost(127.0.0.1)",
                f"SlurmctldPort={ctld_port}",
                f"SlurmdPort={slurmd_port}",
                "AuthType=auth/none",
                "CredType=cred/none",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'run' / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                "SlurmctldDebug=info",
                "SlurmdDebug=info",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "JobCompType=jobcomp/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "SchedulerType=sched/builtin",
                # a requeued job waits cred_expire seconds (its old credential must expire: slurmd refuses to launch
                # a job it has just killed), then the next pass of the main scheduling loop: 120 s + up to 60 s by
                # default, 10 s + up to 2 s here (tests/slurm/test_requeue.py requeues jobs)
                "AuthInfo=cred_expire=10",
                "SchedulerParameters=sched_interval=2",
                "MpiDefault=none",
                "ReturnToService=2",
                "MailProg=/bin/true",
                "InactiveLimit=0",
                "KillWait=5",
                "MinJobAge=600",
                "SlurmdTimeout=60",
                f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
                "",
            ]
        )
    )
    return conf


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Start slurmctld + slurmd on 127.0.0.1 and yield the cluster; stop both daemons afterwards."""
    _ensure_slurm_installed()
    if os.geteuid() != 0:
        pytest.skip("the local Slurm test cluster runs its daemons as root (SlurmUser=root); not root here")
    node = socket.gethostname().split(".")[0]
    cpus, memory_mb = _node_hardware()
    root = tmp_path_factory.mktemp("slurm")
    conf = _write_conf(root, node, cpus, memory_mb)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    env["SLURM_CONF"] = str(conf)
    cluster = SlurmCluster(conf=conf, root=root, node=node, cpus=cpus, env=env)

    procs: list[subprocess.Popen] = []
    try:
        for argv in (["slurmctld", "-D", "-c", "-i"], ["slurmd", "-D", "-N", node]):
            log = (root / "log" / f"{argv[0]}.stdout").open("w")
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            for p in procs:
                if p.poll() is not None:
                    pytest.fail(f"{p.args[0]} exited with {p.returncode} during startup\n{cluster.daemon_logs()}")
            res = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout=10)
            state = res.stdout.strip()
            if res.returncode == 0 and state.startswith("idle"):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"Slurm node never became idle (last state {state!r})\n{cluster.daemon_logs()}")
        yield cluster
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True, timeout=30, check=False)
        for p in reversed(procs):
            _stop(p)
