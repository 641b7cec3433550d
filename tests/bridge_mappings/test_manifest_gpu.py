"""Both manifest sources agree on a live FP8 engine (gpu-marked: needs CUDA and vLLM's CUDA build)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from bridge_mappings.manifest import ask_vllm, build_quantization_config
    from megatron_fp8.models import tiny_model_path
    from megatron_fp8.rollout.vllm.adapter import build_llm, shutdown_llm

    path = tiny_model_path(sys.argv[1])
    qcfg = build_quantization_config(path, num_first_layers_in_bf16=1)
    llm = build_llm(str(path), quantization_config=qcfg if sys.argv[2] == "fp8" else None,
                    skip_tokenizer_init=True, gpu_memory_utilization=0.3)
    m = ask_vllm(path, qcfg, llm=llm, num_first_layers_in_bf16=1)
    shutdown_llm(llm)
    print(json.dumps({"source": m.source, "fp8": list(m.fp8_params)}))
    """
)


def _ask(model: str, engine: str) -> dict:
    import json

    proc = subprocess.run([sys.executable, "-c", SCRIPT, model, engine], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM's CUDA build (the container)")
@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_param_dtypes_of_live_fp8_engine_equal_quant_method_decisions(model):
    live = _ask(model, "fp8")  # a real FP8 engine: which weights are float8_e4m3fn
    asked = _ask(model, "bf16")  # a BF16 engine: what Fp8Config.get_quant_method decides per layer
    assert live["source"].startswith("vllm-param-dtype ")
    assert asked["source"].startswith("vllm-quant-method ")
    assert live["fp8"] == asked["fp8"] and live["fp8"]
