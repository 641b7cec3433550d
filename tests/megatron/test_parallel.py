"""Tests of the gloo + Megatron-Core parallel-state context."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from megatron_fp8.errors import ConfigError
from megatron_fp8.megatron import megatron_parallel
from megatron_fp8.megatron.parallel import find_free_port

pytestmark = pytest.mark.megatron


def test_find_free_port_is_bindable():
    port = find_free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


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
