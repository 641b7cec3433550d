"""The vLLM worker's recovery after a failed write, without an engine: the checkpoint on disk restores version 0 only.

An engine loaded in place keeps no stream of its versions (its rollback source is a snapshot, dropped at the
release). If the worker is later configured to load through vLLM's layerwise reload (e.g. a second applier without
the shard plan), a failure there must not "restore" version N by re-reading the checkpoint (version 0) and serving it
as N: it stops serving, saying why.
"""

from __future__ import annotations

import pytest

from megatron_fp8.errors import EngineNotServingError, RefitError
from megatron_fp8.rollout.vllm.worker_extension import FP8RefitWorkerExtension, WorkerRefitState


def _worker(version: int) -> FP8RefitWorkerExtension:
    worker = object.__new__(FP8RefitWorkerExtension)  # no vLLM worker behind it: nothing may be loaded
    worker._mfp8 = WorkerRefitState(version=version, last_good=None)
    return worker


def test_the_checkpoint_is_not_restored_as_a_later_version():
    with pytest.raises(RefitError, match="no rollback source for version 2: .*only version 0 can be re-read"):
        _worker(2)._mfp8_restore(2, None)


def test_a_failure_without_a_rollback_source_stops_serving_naming_why():
    worker = _worker(2)
    error = worker._mfp8_recover(3, RuntimeError("device error"), native=True)
    assert isinstance(error, EngineNotServingError)
    assert "restoring version 2 failed too (RefitError: no rollback source for version 2" in str(error)
