"""The KL penalty's reference policy (megatron_fp8.megatron.reference): the arm's initial weights, swapped in.

On the real Megatron-Core model of the tiny checkpoint: after training steps the model differs from the reference;
inside ``swapped_in`` it scores exactly like the freshly built model; afterwards it holds, byte for byte, the trained
weights again (also when the block raises), and the optimizer's next step is the one it would have taken.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_fp8.megatron import build_megatron_model, make_optimizer, megatron_parallel, sequence_logprobs, train_step
from megatron_fp8.megatron.reference import ReferenceWeights
from megatron_fp8.models import tiny_model_path

pytestmark = pytest.mark.megatron

IDS = torch.randint(4, 360, (4, 12), generator=torch.Generator().manual_seed(3))


def _bytes(m) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in m.model for p in chunk.parameters()]


def test_the_reference_scores_like_the_initial_model_and_the_trained_weights_come_back():
    with megatron_parallel(seed=5):
        m = build_megatron_model(tiny_model_path("tiny"), dtype="fp32")
        with torch.no_grad():
            initial = sequence_logprobs(m, IDS)
        reference = ReferenceWeights.capture(m)
        optimizer = make_optimizer(m, lr=1e-2)
        for _ in range(2):
            train_step(m, optimizer, lambda lp: -lp.mean(), IDS)
        trained = _bytes(m)
        with torch.no_grad():
            after = sequence_logprobs(m, IDS)
        assert not torch.equal(after, initial)  # training moved the policy
        with reference.swapped_in(m), torch.no_grad():
            assert torch.equal(sequence_logprobs(m, IDS), initial)
        assert all(torch.equal(a, b) for a, b in zip(_bytes(m), trained, strict=True))
        with pytest.raises(ValueError, match="inside"), reference.swapped_in(m):
            raise ValueError("inside")
        assert all(torch.equal(a, b) for a, b in zip(_bytes(m), trained, strict=True))
        assert reference.nbytes == sum(t.numel() * 4 for t in trained)


def test_a_reference_of_another_model_is_refused():
    with megatron_parallel(seed=5):
        dense = build_megatron_model(tiny_model_path("tiny"), dtype="fp32")
        moe = build_megatron_model(tiny_model_path("tiny-moe"), dtype="fp32")
        with pytest.raises(RuntimeError, match="another model layout"), ReferenceWeights.capture(dense).swapped_in(moe):
            pass
