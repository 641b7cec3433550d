"""A warm ``megatron-fp8`` launcher for the test suite: the interpreter start-up is paid once, not per command.

A command of this project spends most of its test-time wall clock importing torch, transformers, Megatron-Core and
Megatron-Bridge (~15 s of one core on the 2-core CI machine; the work of a tiny-model GRPO run is ~5 s). The suite
runs the real CLI a few hundred times, as separate processes. This module keeps one *zygote* per thread setting: a
process that has imported those packages and then only waits; each command is a ``fork()`` of it that calls
:func:`megatron_fp8.cli.main` with the command's argv, environment, working directory and its own stdout/stderr, and
exits with its exit code. Every command still runs in a process of its own (its signal handlers, its
``torch.distributed`` world, its exit code), from the same start state (the zygote only imported; it never ran a
command, a thread pool or a process group).

``nprocs > 1`` forks that many ranks with the environment ``torchrun --standalone`` gives its workers (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RUN_ID``); like torchrun, the first rank that fails stops the others (SIGTERM) and the launch exits 1;
the ranks share one stdout and one stderr. What it does not replace, and where the real launcher stays in the suite:
the entry points themselves (``python -m megatron_fp8``, the console script: tests/cli/test_entry_points.py),
import-time noise (tests/cli/test_cli_behaviour.py), torchrun's own signal forwarding (tests/rl/driver/
test_stopping.py), the 2-rank sharded-rollout layout (tests/rl/driver/test_sharded_rollout.py) and Slurm's srun
(tests/slurm). Environment variables that a library reads when it is imported (``OMP_NUM_THREADS`` for libgomp's
pool, ``HF_HUB_OFFLINE``/``HF_HOME`` for huggingface_hub's constants) are taken at zygote start: a zygote is kept
per ``OMP_NUM_THREADS`` value, and a command whose environment differs from its zygote's in
:data:`IMPORT_TIME_ENV` runs as a plain subprocess instead. A command's ``PYTHONPATH`` (where a user's reward module
is found) becomes the fork's ``sys.path`` as a fresh interpreter would build it; where one of its folders holds a
module the zygote has already imported from elsewhere (a fresh interpreter would import that copy), the fork execs
a fresh interpreter instead.

Run as a script, this file is the zygote (its protocol: one JSON request per stdin line, one JSON reply per line).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMPORT_TIME_ENV = (
    "OMP_NUM_THREADS",
    "HF_HUB_OFFLINE",
    "HF_HOME",
    "TRANSFORMERS_OFFLINE",
    "TORCH_CPP_LOG_LEVEL",
)
"""Variables read when a library is imported: a command whose values differ from its zygote's is not forked."""
_CLI_MAIN = str(REPO / "megatron_fp8" / "cli" / "__main__.py")
_ZYGOTE_PYTHONPATH = os.environ.get("PYTHONPATH")
"""The zygote's own ``PYTHONPATH`` (what its ``sys.path`` was built with at start-up)."""


# ----------------------------------------------------------------------------------------------- the zygote side
def _preload() -> None:
    """Import what every heavy command imports (before any fork: nothing runs, no thread pool starts)."""
    import matplotlib
    import megatron.core  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    matplotlib.use("Agg", force=True)  # what plot_metrics chooses (~0.8 s of pyplot import per run, once here)
    import matplotlib.pyplot

    import bridge_mappings.adapter as adapter
    import megatron_fp8.cli
    from megatron_fp8.cli import COMMANDS

    adapter.import_bridge()  # Megatron-Bridge with the project's patches applied (idempotent, as at a run's entry)
    for name in ("config", "grpo", "refit", "manifest", "report", "doctor"):
        megatron_fp8.cli._load(name)
    assert set(COMMANDS) >= {"config", "grpo"}
    import megatron_fp8.rl.driver.grpo
    import megatron_fp8.rl.driver.runtime

    # the imported heap (~700k objects) to the permanent generation before any fork: a child's full collections
    # (vLLM runs four while it builds an engine, Python one whenever the old generation grows by a quarter) no longer
    # traverse it (~0.35 s each on 2 cores), and collecting never writes to the pages the children share with the
    # zygote (what gc.freeze is for: https://docs.python.org/3/library/gc.html#gc.freeze)
    gc.collect()
    gc.freeze()


def _pythonpath_entries(value: str | None) -> list[str]:
    """``sys.path`` entries a fresh interpreter makes of ``PYTHONPATH=value`` in the current directory: in order,
    absolute (an empty entry is the directory itself), without repeats."""
    entries: list[str] = []
    for part in value.split(os.pathsep) if value else []:
        path = os.path.abspath(part)
        if path not in entries:
            entries.append(path)
    return entries


def _shadowed(entry: str) -> str | None:
    """The first module the zygote imported that ``entry`` would resolve elsewhere, coming first on ``sys.path``
    (``None``: nothing imported is shadowed)."""
    try:
        names = os.listdir(entry)
    except OSError:
        return None
    folder = os.path.realpath(entry)
    for name in names:
        top = name.split(".", 1)[0]
        module = sys.modules.get(top)
        if module is None or not (name == top or name.endswith((".py", ".so", ".pyc"))):
            continue
        where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", None) or []), None)
        if where is None or os.path.commonpath([os.path.realpath(where), folder]) != folder:  # imported elsewhere
            return top
    return None


def _apply_pythonpath(value: str | None) -> bool:
    """Make ``sys.path`` what a fresh interpreter started with ``PYTHONPATH=value`` would have: the zygote's own
    ``PYTHONPATH`` entries out, ``value``'s in, after the checkout and the suite's folder (modules are looked up
    there at run time: a user's reward module). False, with ``sys.path`` untouched, where an entry would shadow a
    module the zygote already imported (a fresh interpreter would import that one from the entry): the caller then
    starts a fresh interpreter."""
    if value == _ZYGOTE_PYTHONPATH:
        return True
    old, new = _pythonpath_entries(_ZYGOTE_PYTHONPATH), _pythonpath_entries(value)
    if any(_shadowed(entry) for entry in new if entry not in old):
        return False
    head, rest = sys.path[:2], [p for p in sys.path[2:] if p not in old and p not in new]
    sys.path[:] = [*head, *[p for p in new if p not in head], *rest]
    return True


def _run_command(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In a forked child: become the command (fds, cwd, environment, signals), run it, exit with its code."""
    try:
        fd_in = os.open(os.devnull, os.O_RDONLY)
        fd_out = os.open(out, os.O_WRONLY | os.O_APPEND)
        fd_err = os.open(err, os.O_WRONLY | os.O_APPEND)
        for fd, target in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
            os.dup2(fd, target)
        os.chdir(cwd)
        if not _apply_pythonpath(env.get("PYTHONPATH")):  # a fresh interpreter, as a user's shell would start
            os.execve(sys.executable, [sys.executable, "-m", "megatron_fp8.cli", *argv], env)
        os.environ.clear()
        os.environ.update(env)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = [_CLI_MAIN, *argv]
        import torch

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or torch.get_num_threads()))
        from megatron_fp8.cli import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:  # escaped main (``--debug``): the interpreter prints it and dies of SIGINT
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:  # escaped main (``--debug``): what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _launch(req: dict) -> int:
    """In the per-request child (its own process group): run ``nprocs`` ranks of the command, torchrun-style."""
    os.setpgid(0, 0)
    nprocs = int(req.get("nprocs", 1))
    env = dict(req["env"])
    if nprocs == 1:
        _run_command(req["argv"], env, req["cwd"], req["stdout"], req["stderr"])
    from megatron_fp8.launch_env import find_free_port  # imported by the zygote's preload

    port = find_free_port()
    run_id = f"warm-{os.getpid()}"
    pids = {}
    for rank in range(nprocs):
        rank_env = {
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": run_id,
        }
        pid = os.fork()
        if pid == 0:
            _run_command(req["argv"], rank_env, req["cwd"], req["stdout"], req["stderr"])
        pids[pid] = rank
    failed = False
    while pids:
        pid, status = os.wait()
        pids.pop(pid, None)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            for other in pids:  # torchrun stops the surviving workers of a failed group
                try:
                    os.kill(other, signal.SIGTERM)
                except ProcessLookupError:
                    pass
    return 1 if failed else 0


def _serve(*, preload: bool = True) -> None:
    if preload:
        _preload()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _launch(req)
            finally:
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


# ----------------------------------------------------------------------------------------------- the test side
class _Zygote:
    """The zygote process and its reply channel (JSON lines read from the raw pipe: a fast command's ``pid`` and
    ``rc`` lines may arrive in one read, so lines are split here, never left in a buffered reader ``select`` cannot
    see)."""

    def __init__(self, env: dict[str, str], *, preload: bool = True) -> None:
        self.env = env
        self._log = tempfile.TemporaryFile()  # the zygote's own stderr (import errors), shown if it dies
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *([] if preload else ["--no-preload"])],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            bufsize=0,
        )
        self._buf = b""
        self._ready = False

    def request(self, req: dict) -> None:
        self.proc.stdin.write((json.dumps(req) + "\n").encode())

    def reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            poll = select.poll()  # not select(): a pytest process may hold more than 1024 file descriptors
            poll.register(self.proc.stdout.fileno(), select.POLLIN)
            if remaining <= 0 or not poll.poll(remaining * 1000):
                raise TimeoutError
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                self._log.seek(0)
                tail = self._log.read().decode(errors="replace")[-3000:]
                raise RuntimeError(f"the warm launcher (pid {self.proc.pid}) exited with {self.proc.wait()}:\n{tail}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def wait_ready(self) -> None:
        if not self._ready:
            self.reply(600)
            self._ready = True

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


class WarmCli:
    """Runs ``megatron-fp8`` commands as forks of a warm zygote (see the module docstring); ``close()`` ends it.

    Args:
        preload: import the heavy packages in the zygote (the point of it). ``False`` only for tests of the launcher
            itself whose command fails before any heavy import: each fork then imports what it needs.
    """

    def __init__(self, *, preload: bool = True) -> None:
        self._zygotes: dict[str | None, _Zygote] = {}
        self._preload = preload

    def _zygote(self, env: dict[str, str]) -> _Zygote | None:
        key = env.get("OMP_NUM_THREADS")
        z = self._zygotes.get(key)
        if z is None:
            log_level = env.get("TORCH_CPP_LOG_LEVEL", "ERROR")
            z = self._zygotes[key] = _Zygote({**env, "TORCH_CPP_LOG_LEVEL": log_level}, preload=self._preload)
        if any(env.get(k) != z.env.get(k) for k in IMPORT_TIME_ENV if k != "TORCH_CPP_LOG_LEVEL"):
            return None
        return z

    def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike = REPO,
        nprocs: int = 1,
        timeout: float = 600,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``megatron-fp8 *argv`` (``nprocs`` ranks) and return what ``subprocess.run(..., text=True)`` would.

        Raises:
            subprocess.TimeoutExpired: the command ran past ``timeout`` seconds (its process group is killed).
        """
        env = dict(os.environ if env is None else env)
        shown = [sys.executable, "-m", "megatron_fp8.cli", *argv]
        z = self._zygote(env)
        if z is None:  # an import-time variable differs: a fresh interpreter, as a user's shell would start
            if nprocs > 1:
                shown = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}"]
                shown += ["-m", "megatron_fp8.cli", *argv]
            return subprocess.run(shown, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        z.wait_ready()
        with tempfile.TemporaryDirectory(prefix="warm-cli-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            out.touch()
            err.touch()
            req = {"argv": argv, "env": env, "cwd": str(cwd), "nprocs": nprocs, "stdout": str(out), "stderr": str(err)}
            z.request(req)
            pid = z.reply(60)["pid"]
            deadline = time.monotonic() + timeout
            try:
                rc = z.reply(deadline - time.monotonic())["rc"]
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)
                z.reply(60)
                raise subprocess.TimeoutExpired(shown, timeout, out.read_text(), err.read_text()) from None
            return subprocess.CompletedProcess(shown, rc, out.read_text(), err.read_text())

    def close(self) -> None:
        for z in self._zygotes.values():
            z.close()
        self._zygotes.clear()


_SHARED: WarmCli | None = None


def shared() -> WarmCli:
    """The launcher of this test process (one per pytest-xdist worker), started on first use, ended at exit."""
    global _SHARED
    if _SHARED is None:
        _SHARED = WarmCli()
        atexit.register(_SHARED.close)
    return _SHARED


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    """``shared().run(argv, **kwargs)``: a ``megatron-fp8`` command through this process's warm launcher."""
    return shared().run(argv, **kwargs)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # this checkout's packages, as ``python -m megatron_fp8.cli`` run in it finds them
    _serve(preload="--no-preload" not in sys.argv[1:])
