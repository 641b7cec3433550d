"""``megatron-fp8 doctor`` as a subprocess: JSON schema, CPU verdicts, speed."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_fp8.cli", "doctor", *args], capture_output=True, text=True, timeout=120
    )


def test_doctor_json_schema():
    start = time.perf_counter()
    proc = _run("--json")
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) == {"environment", "recipes"}
    env = data["environment"]
    for key in (
        "gpu_name",
        "compute_capability",
        "torch_version",
        "torch_cuda",
        "cublas_version",
        "transformer_engine",
        "vllm",
        "deep_gemm",
        "megatron_core",
        "megatron_bridge",
        "modelopt",
    ):
        assert key in env
    names = [r["name"] for r in data["recipes"]]
    assert names == ["bf16", "tensorwise", "blockwise", "fp8_param", "delayed", "mxfp8"]
    for r in data["recipes"]:
        assert set(r) == {"name", "supported", "reasons"}
        assert isinstance(r["supported"], bool)
        assert all(isinstance(x, str) for x in r["reasons"])
    assert data["recipes"][0]["supported"] is True
    if not torch.cuda.is_available():
        assert env["gpu_name"] is None
        for r in data["recipes"][1:]:
            assert r["supported"] is False
            text = " ".join(r["reasons"])
            assert "GPU" in text and "CUDA" in text and "compute capability" in text
            assert "the math runs in float32 (fp32-emulated)" in text
    assert elapsed < 10  # < 2 s on an idle machine; generous for 2 shared cores


def test_doctor_table():
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    assert "blockwise" in proc.stdout and "Float8BlockScaling" in proc.stdout


def test_runtime_imports_are_checked_in_a_fresh_interpreter(tmp_path):
    from megatron_fp8.recipes.capability import RUNTIME_IMPORTS, check_runtime_imports

    assert "deep_gemm" in RUNTIME_IMPORTS  # needs libcuda.so.1: imported at run time, not at image build
    got = check_runtime_imports(("json", "no_such_module_xyz", "megatron_fp8.no_such_submodule"))
    assert [c.status for c in got] == ["ok", "absent", "failed"]
    assert "No module named" in got[2].detail


def test_doctor_imports_exit_status_and_out_file(tmp_path, monkeypatch, capsys):
    import argparse
    import json

    from megatron_fp8.cli import doctor
    from megatron_fp8.recipes.capability import ImportCheck

    monkeypatch.setattr(doctor, "check_runtime_imports", lambda: (ImportCheck("deep_gemm", "failed", "libcuda"),))
    out = tmp_path / "d.json"
    assert doctor.run(argparse.Namespace(json=True, imports=True, out=out)) == 1
    assert json.loads(out.read_text())["imports"] == [{"module": "deep_gemm", "status": "failed", "detail": "libcuda"}]
    monkeypatch.setattr(doctor, "check_runtime_imports", lambda: (ImportCheck("deep_gemm", "ok"),))
    assert doctor.run(argparse.Namespace(json=True, imports=True, out=None)) == 0
    capsys.readouterr()


def test_doctor_prints_the_layout_and_memory_estimate_of_a_config():
    """Issue 27: ``doctor --config`` shows what ``config`` shows about the layout, on this machine's GPU."""
    proc = _run("--json", "--config", "configs/qwen3_8b_fp8.yaml")
    assert proc.returncode == 0, proc.stderr
    layout = json.loads(proc.stdout)["layout"]
    assert layout[0].startswith("layout: TP 2 x PP 1 per model replica; DP = processes / 2")
    assert "Adam state sharded over DP (distributed optimizer)" in layout[0]
    assert layout[1].startswith("rollout (8 processes): 8 ranks: 8 engine(s) of TP 1, colocated (one per GPU)")
    assert layout[2].startswith("memory per GPU (estimate): 8.19 B params x (6 B + 12 B / DP ")
    table = _run("--config", "configs/qwen3_8b_fp8.yaml")
    assert "configs/qwen3_8b_fp8.yaml: layout: TP 2 x PP 1" in table.stdout
