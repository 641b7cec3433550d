"""One rank of ``test_sharded_engine.py``: a vLLM engine of TP 2 sharded over the 2 torchrun ranks
(``external_launcher``), refitted through :class:`~megatron_fp8.rollout.vllm.applier.VllmApplier`.

Writes ``rank<R>.json`` into the folder given as the first argument: greedy tokens before / after a good refit and
after a refit that only rank 1's shard refuses, each version's status, what the shard plan cuts, and whether the
shard holds the same bytes after a refit of its parts as after a refit of the full tensors (the oracle: the path
every rank took before shard plans).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megatron_fp8.errors import RefitError
from megatron_fp8.layout import narrow_stream
from megatron_fp8.models import tiny_model_path
from megatron_fp8.rollout.vllm import adapter
from megatron_fp8.rollout.vllm.applier import VllmApplier

PROMPTS = [[5, 17, 33, 40, 2], [60, 61, 62], [9, 9, 9, 9, 9, 9, 9]]


def _greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def _apply(applier: VllmApplier, version: int, weights: dict[str, torch.Tensor]) -> str | None:
    """One version through the applier's two-phase protocol; the error's text, or ``None`` when committed."""
    from megatron_fp8.refit.wire import TensorMeta, dtype_name

    metas = [
        TensorMeta(
            name=n, shape=tuple(t.shape), dtype=dtype_name(t.dtype), offset=0, nbytes=t.numel() * t.element_size()
        )
        for n, t in weights.items()
    ]
    try:
        applier.begin(version, metas)
        for name, t in weights.items():
            applier.stage(name, t)
        applier.commit(version)
    except RefitError as exc:
        return str(exc)
    return None


def _held(llm) -> dict[str, torch.Tensor]:
    """Every parameter and buffer this process's shard holds, copied."""

    def read(worker) -> dict[str, torch.Tensor]:
        model = worker.model_runner.model
        return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}

    return llm.collective_rpc(read)[0]


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    path = tiny_model_path("tiny")
    base = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    new = {n: (t.float() + torch.randn(t.shape, generator=g) * (0.5 * float(t.float().std()) + 1e-3)).to(t.dtype)
           for n, t in base.items()}  # fmt: skip
    llm = adapter.build_llm(str(path), skip_tokenizer_init=True, tensor_parallel_size=2)
    applier = VllmApplier(llm, fp8_names=None, shard_group=adapter.engine_shard_group())
    plan = applier.shard_plan
    record: dict[str, object] = {"rank": rank, "before": _greedy(llm), "plan": plan is not None}
    full_bytes = sum(t.numel() * t.element_size() for t in new.values())
    parts = dict(narrow_stream(new.items(), plan)) if plan is not None else new
    record["sent_fraction"] = sum(t.numel() * t.element_size() for t in parts.values()) / full_bytes
    record["plan_rank"] = [plan.rank, plan.size] if plan is not None else None
    record["good_error"] = _apply(applier, 1, parts)
    record["after_good"] = _greedy(llm)
    record["after_good_status"] = [applier.serving, applier.serving_version]
    record["verify_checked"] = applier.last_verify.checked if applier.last_verify is not None else 0
    record["verify_max_rel_error"] = applier.last_verify.max_rel_error if applier.last_verify is not None else None
    held_parts = _held(llm)
    bad = dict(narrow_stream(base.items(), plan)) if plan is not None else dict(base)
    if rank == 1:  # only this shard's copy is bad: rank 0's shard validates and loads it, then must revert
        name = "model.layers.0.mlp.down_proj.weight"
        bad[name] = bad[name].clone()
        bad[name].view(-1)[0] = float("nan")
    record["bad_error"] = _apply(applier, 2, bad)
    record["after_bad"] = _greedy(llm)
    record["after_bad_status"] = [applier.serving, applier.serving_version]
    record["statuses"] = llm.collective_rpc("mfp8_status")
    # the oracle: the same weights as full tensors (every worker slicing its own part, as before shard plans)
    full_applier = VllmApplier(llm, fp8_names=None, shard_group=None)
    with adapter.readable_cpu_linear_weights():  # vLLM's reload keeps the weights readable, as the engine was built
        record["full_error"] = _apply(full_applier, 3, new)
    held_full = _held(llm)
    record["held_equal_to_full_path"] = sorted(held_parts) == sorted(held_full) and all(
        torch.equal(held_parts[n].reshape(-1).view(torch.uint8), held_full[n].reshape(-1).view(torch.uint8))
        for n in held_full
    )
    record["held_compared"] = len(held_full)
    record["held_differ"] = sorted(
        n
        for n in held_full
        if n not in held_parts
        or not torch.equal(held_parts[n].reshape(-1).view(torch.uint8), held_full[n].reshape(-1).view(torch.uint8))
    )
    record["external_launcher"] = llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
    from vllm.distributed import parallel_state

    tp_all_reduce = parallel_state.get_tp_group().device_communicator.dist_module
    record["tp_all_reduce"] = getattr(tp_all_reduce, "__name__", type(tp_all_reduce).__name__)
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    adapter.shutdown_llm(llm)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
