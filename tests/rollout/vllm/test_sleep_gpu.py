"""The colocated sleep schedule on a real ``vllm.LLM(enable_sleep_mode=True)`` (gpu-marked: needs CUDA and vLLM's CUDA
build, the image; ``make gpu-run`` runs it, and it skips where vLLM is absent, as on a bare GPU machine).

Level 2 gives the engine's weights and KV cache back; a complete refit into the woken weights and the KV-cache wake-up
must then serve exactly what the engine served before it slept (the same weights), and a refit while asleep is
refused. Written for the image; not run on the CPU machines (vLLM's sleep mode is CUDA only).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from safetensors.torch import load_file
    from megatron_fp8.errors import RefitError
    from megatron_fp8.models import tiny_model_path
    from megatron_fp8.refit.pipeline import ColocatedRefit
    from megatron_fp8.rollout.engines import VllmRolloutEngine
    from megatron_fp8.rollout.sleep import ColocatedSleep

    path = tiny_model_path("tiny")
    engine = VllmRolloutEngine(path, quantization_config=None, fp8_names=None,
                               engine_kwargs={"gpu_memory_utilization": 0.3, "enable_sleep_mode": True})
    control = engine.sleep_control()
    assert control is not None, "the engine was built without sleep mode"
    args = dict(max_new_tokens=8, temperature=0.0, seed=0, eos_token_id=-1)
    prompts = [[5, 17, 33, 40, 2], [7, 9, 11]]
    before = engine.generate(prompts, **args).token_ids
    schedule = ColocatedSleep(control=control, applier=engine.applier, level=2, kv_scales=engine.kv_scale_access())
    engine.applier = schedule.applier
    refit = ColocatedRefit(schedule.applier, timeout=120)
    weights = load_file(str(path / "model.safetensors"))
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    schedule.sleep()
    free_asleep = torch.cuda.mem_get_info()[0]
    try:
        refit.refit(iter(weights.items()))
        refused = False
    except RefitError as exc:
        refused = "asleep" in str(exc)
    schedule.refit(lambda: refit.refit(iter(weights.items())))
    after = engine.generate(prompts, **args).token_ids
    engine.close()
    print(json.dumps({"freed": free_asleep - free_awake, "refused": refused, "same": before == after,
                      "state": schedule.state}))
    """
)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM's CUDA build (the image)")
def test_level_2_sleep_refit_and_wake_serve_the_same_tokens():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["refused"] and out["same"] and out["state"] == "serving"
    assert out["freed"] > 0  # the engine gave memory back (its weights and KV cache)
