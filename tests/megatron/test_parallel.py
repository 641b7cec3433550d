"""Tests of the gloo + Megatron-Core parallel-state context."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_fp8.errors import ConfigError
from megatron_fp8.launch_env import find_free_port
from megatron_fp8.megatron import megatron_parallel

pytestmark = pytest.mark.megatron


def test_a_lone_process_meets_on_an_in_process_store(monkeypatch):
    """No port for a single process: nothing another process does can make its start-up fail (EADDRINUSE)."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with megatron_parallel() as state:
        assert state.owns_process_group and dist.get_world_size() == 1
        assert isinstance(_underlying_store(), dist.HashStore)
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    with megatron_parallel():  # a launcher's port is used as given
        assert isinstance(_underlying_store(), dist.TCPStore)


def _underlying_store() -> dist.Store:
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def test_context_sets_up_and_tears_down():
    from megatron.core import parallel_state

    with megatron_parallel() as state:
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert (state.rank, state.world_size, state.tensor_parallel_size) == (0, 1, 1)
        assert state.owns_process_group
        assert parallel_state.model_parallel_is_initialized()
        assert parallel_state.get_tensor_model_parallel_world_size() == 1
        with pytest.raises(ConfigError, match="already initialised"):
            with megatron_parallel():
                pass
    assert not dist.is_initialized()
    assert not parallel_state.model_parallel_is_initialized()


def test_teardown_on_error():
    from megatron.core import parallel_state

    with pytest.raises(RuntimeError, match="boom"):
        with megatron_parallel():
            raise RuntimeError("boom")
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_parallel_size": 2}, "not divisible"),
        ({"world_size": 2, "rank": 0}, "master_port"),
        ({"rank": 3}, "outside"),
    ],
)
def test_bad_sizes_are_rejected(kwargs, match, monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ConfigError, match=match):
        with megatron_parallel(**kwargs):
            pass
    assert not dist.is_initialized()


def test_build_outside_context_is_an_error(tmp_path):
    from megatron_fp8.megatron import build_megatron_model

    with pytest.raises(ConfigError, match="megatron_parallel"):
        build_megatron_model(tmp_path)
