"""One rank of ``test_vllm011_external_launcher.py``: vLLM 0.11.0's own ``external_launcher`` construction in a
``torch.distributed`` world that exists before it (the GRPO trainer's), on CPU with gloo.

Writes ``rank<R>.json`` into the folder given as the first argument.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")  # the trainer's world, as data_parallel_from_env builds it
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer_world = dist.group.WORLD
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)

    import vllm
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.executor.uniproc_executor import ExecutorWithExternalLauncher

    from megatron_fp8.layout import engine_of_rank
    from megatron_fp8.rollout.vllm.adapter import engine_shard_group

    config = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    init_method, vllm_rank, local_rank = ExecutorWithExternalLauncher._distributed_args(None)
    # what 0.11's worker (init_device -> init_worker_distributed_environment) calls, with the executor's arguments;
    # the device is named: without vllm._C (see test_vllm011_layouts.py) 0.11 cannot infer it
    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=config)
    with set_current_vllm_config(vllm_config):
        parallel_state.init_distributed_environment(config.world_size, vllm_rank, init_method, local_rank, "gloo")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=1, backend="gloo"
        )
    tp = parallel_state.get_tp_group()
    group = engine_shard_group()
    box = torch.tensor([1 << rank], dtype=torch.int64)
    dist.all_reduce(box, group=group)  # the ranks the applier's agreement reaches
    engine, engines, leader = engine_of_rank(rank, list(range(world)), 2)
    record = {
        "vllm": vllm.__version__,
        "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
        "config_world_size": config.world_size,
        "distributed_args": [init_method, vllm_rank, local_rank],
        "adopted": dist.group.WORLD is trainer_world and dist.get_world_size() == world,
        "vllm_world": parallel_state.get_world_group().world_size,
        "tp_ranks": list(tp.ranks),
        "tp_rank": tp.rank_in_group,
        "shard_group_mask": int(box),
        "our_engine": [engine, engines, leader],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
