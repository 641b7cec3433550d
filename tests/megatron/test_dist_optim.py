"""The CPU distributed optimizer (``ShardedDDPAdam``) against the unsharded Adam, and its checkpoint state.

Across two data-parallel ranks it is compared bit for bit in ``tests/rl/driver/test_model_parallel.py`` (GRPO under
torchrun); here, in one process, the update arithmetic and the DP-independent state layout.
"""

from __future__ import annotations

import pytest
import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.megatron import build_megatron_model, make_optimizer, megatron_parallel, train_step
from megatron_fp8.megatron.dist_optim import STATE_FORMAT, ShardedDDPAdam
from megatron_fp8.megatron.optim import MegatronDDPAdam
from megatron_fp8.models import tiny_model_path

IDS = torch.randint(4, 360, (4, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def parallel():
    with megatron_parallel(seed=3) as state:
        yield state


def _model():
    return build_megatron_model(tiny_model_path("dense"), dtype="fp32")


def _weights(m) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.model[0].named_parameters()}


def _steps(m, optimizer, n: int) -> list[float]:
    return [train_step(m, optimizer, lambda lp: -lp.mean(), IDS).grad_norm for _ in range(n)]


def test_sharded_adam_updates_like_the_unsharded_one(parallel):
    plain, sharded = _model(), _model()
    opt_plain = make_optimizer(plain, lr=1e-2, weight_decay=0.1)
    opt_sharded = make_optimizer(sharded, lr=1e-2, weight_decay=0.1, distributed=True)
    assert isinstance(opt_plain, MegatronDDPAdam) and isinstance(opt_sharded, ShardedDDPAdam)
    assert _steps(plain, opt_plain, 3) == _steps(sharded, opt_sharded, 3)
    a, b = _weights(plain), _weights(sharded)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_state_round_trip_resumes_exactly_and_other_formats_are_refused(parallel):
    ref = _model()
    opt_ref = make_optimizer(ref, lr=1e-2, distributed=True)
    _steps(ref, opt_ref, 2)
    state = opt_ref.state_dict()
    assert state["format"] == STATE_FORMAT and state["step"] == 2.0
    assert [t.shape for t in state["exp_avg"]] == [p.shape for p in ref.model[0].parameters()]
    after_ref = _steps(ref, opt_ref, 1)

    resumed = _model()
    opt = make_optimizer(resumed, lr=1e-2, distributed=True)
    opt.load_state_dict(state)  # the weights come with the state (FP32 main weights)
    assert _steps(resumed, opt, 1) == after_ref
    a, b = _weights(ref), _weights(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)

    with pytest.raises(ConfigError, match="not the distributed optimizer's"):
        opt.load_state_dict(make_optimizer(_model(), lr=1e-2).state_dict())
    with pytest.raises(ConfigError, match="not the unsharded Adam's"):
        make_optimizer(_model(), lr=1e-2).load_state_dict(state)
