"""One GPU per rank: the pure selection/check logic of megatron_fp8.rl.cluster.devices (no GPU needed)."""

from __future__ import annotations

import pytest

from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.cluster.devices import (
    DeviceAssignment,
    assign_device,
    bind_device,
    check_distinct,
    local_assignment,
    visible_from_env,
)


def _node(visible_per_rank: list[tuple[str, ...]], host: str = "n1", start: int = 0) -> list[DeviceAssignment]:
    return [
        assign_device(rank=start + lr, local_rank=lr, host=host, visible=v) for lr, v in enumerate(visible_per_rank)
    ]


def test_all_gpus_visible_each_rank_takes_its_local_rank():
    ranks = _node([("0", "1", "2", "3")] * 4)
    assert [a.index for a in ranks] == [0, 1, 2, 3] and [a.device_id for a in ranks] == ["0", "1", "2", "3"]
    check_distinct(ranks)


def test_one_gpu_bound_per_task_is_index_zero():
    ranks = _node([("GPU-a",), ("GPU-b",)])
    assert [a.index for a in ranks] == [0, 0]
    check_distinct(ranks)


def test_two_ranks_on_one_gpu_fail_with_both_named():
    ranks = _node([("3",), ("3",)])
    with pytest.raises(ConfigError, match=r"rank 1 \(LOCAL_RANK=1\) on n1 would use GPU 3.*already used by rank 0"):
        check_distinct(ranks)


def test_same_device_on_different_hosts_is_fine():
    check_distinct(_node([("0",)], host="a") + _node([("0",)], host="b", start=1))


def test_more_ranks_than_visible_gpus_is_an_error():
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=2.*sees 2 GPU\(s\)"):
        assign_device(rank=2, local_rank=2, host="n1", visible=("0", "1"))


def test_cpu_ranks_have_no_device_and_never_clash():
    ranks = _node([(), ()])
    assert all(a.index is None and a.device_id is None for a in ranks)
    check_distinct(ranks)


def test_visible_from_env():
    assert visible_from_env({}) is None
    assert visible_from_env({"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert visible_from_env({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ("2", "5")


def test_bind_device_uses_the_fake_layout_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is usable here: devices are identified by UUID, not by the fake layout")
    env = {"RANK": "1", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,7"}
    assert local_assignment(env).device_id == "7"
    other = assign_device(rank=0, local_rank=0, host=local_assignment(env).host, visible=("7",))
    with pytest.raises(ConfigError, match="already used by rank 0"):
        bind_device(gather=lambda mine: [other, mine], env=env)
    assert bind_device(env=env).index == 1
