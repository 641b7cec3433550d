"""The trainer's optimizer state and gradient buffers out of (device) memory and back (``megatron.offload``).

On this CPU machine the "device" is host memory: the copies and releases happen as on a GPU, without pinning. What
must hold: the grad buffers are released (storage 0 bytes) while offloaded and come back zeroed with ``main_grad``
still their views; the optimizer state is elsewhere while offloaded (a checkpoint then reads the same values) and
comes back bit for bit; training with an offload / onload around every step equals training without, for the plain
Adam and the distributed optimizer's shards.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.megatron import build_megatron_model, make_optimizer, megatron_parallel, train_step
from megatron_fp8.megatron.offload import TrainerOffload, empty_unused_memory
from megatron_fp8.models import tiny_model_path

IDS = torch.randint(4, 360, (4, 12), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def parallel():
    with megatron_parallel(seed=3) as state:
        yield state


def _model():
    return build_megatron_model(tiny_model_path("dense"), dtype="fp32")


def _step(m, optimizer) -> float:
    return train_step(m, optimizer, lambda lp: -lp.mean(), IDS).grad_norm


def _grads(m) -> list[torch.Tensor]:
    return [b.grad_data for chunk in m.model for b in chunk.buffers]


@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed"])
def test_offload_round_trip_trains_like_no_offload(parallel, distributed):
    plain, offloaded = _model(), _model()
    opt_plain = make_optimizer(plain, lr=1e-2, distributed=distributed)
    opt = make_optimizer(offloaded, lr=1e-2, distributed=distributed)
    mover = TrainerOffload(offloaded.model, opt)
    norms_plain, norms = [], []
    for _ in range(3):
        norms_plain.append(_step(plain, opt_plain))
        norms.append(_step(offloaded, opt))
        before = copy.deepcopy(opt.state_dict())
        assert any(p.grad is not None for group in opt.optimizer.param_groups for p in group["params"])
        report = mover.offload()
        assert report.tensors > 0 and report.optimizer_bytes > 0 and report.grad_bytes > 0
        assert all(g.untyped_storage().nbytes() == 0 for g in _grads(offloaded))  # released
        inner = opt.optimizer  # the torch AdamW over the main weights: its gradient copies released too
        assert all(p.grad is None for group in inner.param_groups for p in group["params"])
        while_off = opt.state_dict()  # a checkpoint taken while offloaded reads the same values
        assert _same(before, while_off)
        assert mover.offload().tensors == 0  # idempotent
        mover.onload()
        assert all(g.untyped_storage().nbytes() > 0 and not g.any() for g in _grads(offloaded))
        p = next(p for p in offloaded.model[0].parameters() if p.requires_grad)
        assert p.main_grad.untyped_storage().data_ptr() == _grads(offloaded)[0].untyped_storage().data_ptr()
        assert _same(before, opt.state_dict())
    assert norms == norms_plain
    a = dict(plain.model[0].named_parameters())
    assert all(torch.equal(a[n], q) for n, q in offloaded.model[0].named_parameters())


def test_offloaded_state_is_not_the_trained_tensors(parallel):
    m = _model()
    opt = make_optimizer(m, lr=1e-2, distributed=True)
    _step(m, opt)
    mover = TrainerOffload(m.model, opt)
    mains = list(opt._mains)
    ptrs = [t.untyped_storage().data_ptr() for t in mains]
    mover.offload()
    assert [t.untyped_storage().data_ptr() for t in mains] != ptrs  # the main weights now live in the host copies
    mover.onload()
    assert all(t.untyped_storage().nbytes() == t.numel() * 4 for t in mains)


def test_empty_unused_memory_levels():
    assert empty_unused_memory(0, point=1) is False
    assert empty_unused_memory(2, point=2) is torch.cuda.is_available()
    with pytest.raises(ConfigError, match="empty_unused_memory_level must be one of"):
        empty_unused_memory(3, point=1)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b
