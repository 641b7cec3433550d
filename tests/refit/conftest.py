"""Refit tests run torch on one intra-op thread: on shared 2-core CI machines OpenMP spin-waits
make small reductions 10-100x slower with 2 threads. The previous setting is restored afterwards."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
