"""GRPO checkpoints: exact round trip on the real tiny Megatron model, resume choice, damage, refusal, pruning, HF.

The ``megatron`` tests share one trained fp32 model (``trainer``) and one freshly built model that every load
overwrites (``fresh``); the rest needs no Megatron (config fingerprint, ``should_save``, a two-process save/load
with a plain torch module).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_fp8.config.schema import CheckpointingConfig, RunConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.launch_env import find_free_port
from megatron_fp8.rl.state import checkpoint as ckpt
from megatron_fp8.rl.state.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
)
from megatron_fp8.rl.state.checkpoint_files import CHECKPOINT_FILE, model_file, optim_file
from megatron_fp8.rl.state.fingerprint import config_fingerprint, fingerprint_differences

IDS = torch.randint(4, 360, (2, 12), generator=torch.Generator().manual_seed(0))
LOG = "megatron_fp8.rl.state.checkpoint"


def _config(**grpo) -> RunConfig:
    base = RunConfig()
    return dataclasses.replace(base, grpo=dataclasses.replace(base.grpo, **grpo))


def _with_lr(lr: float) -> RunConfig:
    base = RunConfig()
    mcfg = base.policy.megatron_cfg
    mcfg = dataclasses.replace(mcfg, optimizer=dataclasses.replace(mcfg.optimizer, lr=lr))
    return dataclasses.replace(base, policy=dataclasses.replace(base.policy, megatron_cfg=mcfg))


def _manager(path: Path, *, arm: str = "bf16", config: RunConfig | None = None, **cfg) -> CheckpointManager:
    settings = CheckpointingConfig(enabled=True, checkpoint_dir=str(path), **cfg)
    return CheckpointManager(cfg=settings, arm=arm, fingerprint=config_fingerprint(config or _config()), is_writer=True)


# ----------------------------------------------------------------------------- no model needed


def test_should_save_every_period_and_at_the_end(tmp_path):
    m = _manager(tmp_path, save_period=3)
    assert [s for s in range(8) if m.should_save(s, last=s == 7)] == [2, 5, 7]
    off = CheckpointManager(
        cfg=CheckpointingConfig(enabled=False), arm="bf16", fingerprint=config_fingerprint(RunConfig()), is_writer=True
    )
    assert not off.should_save(9, last=True)


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="save_period"):
        _manager(tmp_path, save_period=0)
    with pytest.raises(ConfigError, match="keep_top_k"):
        _manager(tmp_path, keep_top_k=0)


def test_fingerprint_ignores_steps_validation_arms_and_transport():
    base = config_fingerprint(_config())
    longer = _config(max_num_steps=500, val_period=5, val_at_start=True, max_val_samples=3, arms=("bf16",))
    longer = dataclasses.replace(longer, refit=dataclasses.replace(longer.refit, transport="gloo", bucket_size_mb=8))
    assert config_fingerprint(longer) == base
    diffs = fingerprint_differences(base, config_fingerprint(_with_lr(3e-4)))
    assert diffs == (("policy.megatron_cfg.optimizer.lr", 1e-5, 3e-4),)
    assert "refit" not in base and "checkpointing" not in base and "max_num_steps" not in base["grpo"]


# ----------------------------------------------------------------------------- the real tiny model


@pytest.fixture(scope="module")
def parallel():
    pytest.importorskip("megatron.core")
    from megatron_fp8.megatron import megatron_parallel

    with megatron_parallel(seed=0) as state:
        yield state


def _build(parallel):
    from megatron_fp8.megatron import build_megatron_model
    from megatron_fp8.models import tiny_model_path

    return build_megatron_model(tiny_model_path("dense"), dtype="fp32")


@pytest.fixture(scope="module")
def trainer(parallel):
    """A model and its optimizer after one update (so Adam has moments and a step count)."""
    from megatron_fp8.megatron import make_optimizer

    model = _build(parallel)
    optimizer = make_optimizer(model, lr=1e-3)
    _train(model, optimizer)
    return model, optimizer


@pytest.fixture(scope="module")
def fresh(parallel):
    """A model as built from the HF folder, overwritten by every load."""
    return _build(parallel)


def _train(model, optimizer) -> None:
    from megatron_fp8.megatron import train_step

    result = train_step(model, optimizer, lambda lp: -lp.mean(), IDS)
    assert result.update_successful


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.model[0].named_parameters()}


def _fresh_optimizer(model):
    from megatron_fp8.megatron import make_optimizer

    return make_optimizer(model, lr=1e-3)


def _assert_params_equal(model, expected: dict[str, torch.Tensor]) -> None:
    got = _params(model)
    assert got.keys() == expected.keys()
    bad = [n for n in got if not torch.equal(got[n], expected[n])]
    assert not bad, f"parameters differ: {bad[:3]}"


def _save(manager, trainer, step: int, **metrics: float):
    model, optimizer = trainer
    return manager.save(step=step, model=model, optimizer=optimizer, metrics={"reward_mean": 0.5, **metrics})


@pytest.mark.megatron
def test_round_trip_is_bit_identical_and_rng_continues(tmp_path, trainer, fresh):
    model, optimizer = trainer
    manager = _manager(tmp_path)
    saved_params, saved_optim = _params(model), copy.deepcopy(optimizer.state_dict())
    path = manager.save(step=4, model=model, optimizer=optimizer, metrics={"reward_mean": 0.25}, extra={"note": "x"})
    after_save = (torch.rand(3), random.random(), np.random.rand(2))
    _train(model, optimizer)  # the trainer goes on; the fresh model must reach the same place from the checkpoint
    continued = _params(model)

    fresh_optimizer = _fresh_optimizer(fresh)
    state = manager.load_latest(model=fresh, optimizer=fresh_optimizer)
    after_load = (torch.rand(3), random.random(), np.random.rand(2))

    assert (state.step, state.next_step, state.path) == (4, 5, path)
    assert state.metrics == {"reward_mean": 0.25} and state.extra == {"note": "x"}
    _assert_params_equal(fresh, saved_params)
    loaded = fresh_optimizer.state_dict()
    for a, b in zip(loaded["main_params"], saved_optim["main_params"], strict=True):
        assert torch.equal(a, b)
    for key, moments in saved_optim["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(loaded["optimizer"]["state"][key][name], value), (key, name)
    assert torch.equal(after_load[0], after_save[0]) and after_load[1] == after_save[1]
    assert np.array_equal(after_load[2], after_save[2])
    _train(fresh, fresh_optimizer)  # the same update as the trainer's: moments and step count were restored
    _assert_params_equal(fresh, continued)

    meta = json.loads((path / CHECKPOINT_FILE).read_text())
    assert meta["arm"] == "bf16" and meta["step"] == meta["data_step"] == 4
    assert meta["versions"]["torch"] == torch.__version__ and meta["versions"]["megatron-core"]
    assert {model_file(0, 0), optim_file(0, 0), "rng_rank00000.pt"} <= set(meta["files"])
    assert all(len(r["sha256"]) == 64 and r["bytes"] > 0 for r in meta["files"].values())
    assert [p.name for p in tmp_path.joinpath("bf16").iterdir()] == ["step_4"]  # no temporary folder left


@pytest.mark.megatron
def test_resume_picks_the_newest_complete(tmp_path, trainer, fresh):
    manager = _manager(tmp_path)
    for step in (1, 3, 12):
        _save(manager, trainer, step)
    assert [c.step for c in manager.checkpoints()] == [1, 3, 12]
    assert manager.latest().step == 12
    assert manager.load_latest(model=fresh, optimizer=_fresh_optimizer(fresh)).step == 12
    assert _manager(tmp_path / "empty").load_latest(model=fresh, optimizer=_fresh_optimizer(fresh)) is None


def _truncate(path: Path) -> str:
    target = path / model_file(0, 0)
    target.write_bytes(target.read_bytes()[:1000])
    return "truncated"


def _drop_json(path: Path) -> str:
    (path / CHECKPOINT_FILE).unlink()
    return "checkpoint.json is missing"


@pytest.mark.megatron
@pytest.mark.parametrize("damage", [_truncate, _drop_json], ids=["truncated-file", "no-checkpoint-json"])
def test_incomplete_newer_checkpoint_is_skipped(tmp_path, trainer, fresh, caplog, damage):
    manager = _manager(tmp_path)
    _save(manager, trainer, 1)
    why = damage(_save(manager, trainer, 3))
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert manager.latest().step == 1
        assert manager.load_latest(model=fresh, optimizer=_fresh_optimizer(fresh)).step == 1
    assert any("step_3" in r.getMessage() and why in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.megatron
def test_crash_mid_save_leaves_nothing_that_looks_complete(tmp_path, trainer, caplog, monkeypatch):
    manager = _manager(tmp_path)
    _save(manager, trainer, 1)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "write_metadata", crash)
    with pytest.raises(OSError, match="disk full"):
        _save(manager, trainer, 3)
    monkeypatch.undo()
    arm = tmp_path / "bf16"
    assert sorted(p.name for p in arm.iterdir()) == [".step_3.tmp", "step_1"]
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert manager.latest().step == 1
    assert ".step_3.tmp" in caplog.text and "interrupted" in caplog.text
    _save(manager, trainer, 5)  # the next save removes the leftover
    assert sorted(p.name for p in arm.iterdir()) == ["step_1", "step_5"]


@pytest.mark.megatron
def test_a_full_disk_removes_the_partial_save_and_says_what_is_needed(tmp_path, trainer, monkeypatch):
    import errno

    manager = _manager(tmp_path)
    _save(manager, trainer, 1)
    arm = tmp_path / "bf16"
    size = sum(f.stat().st_size for f in (arm / "step_1").rglob("*") if f.name != CHECKPOINT_FILE)
    real_save = ckpt.save_torch

    def fill_up(obj, path):  # the disk fills in the middle of a file: part of it is written, then ENOSPC
        real_save(obj, path)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ckpt, "save_torch", fill_up)
    with pytest.raises(CheckpointError, match=r"no space left on the filesystem of .*bytes free; the last checkpoint "
                       rf"took {size} bytes\); the partial files were removed"):  # fmt: skip
        _save(manager, trainer, 3)
    monkeypatch.undo()
    assert sorted(p.name for p in arm.iterdir()) == ["step_1"]  # no .tmp keeps the space, step_1 intact
    assert manager.latest().step == 1

    # not enough room for another checkpoint of the last one's size: refused before a byte is written
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=0, free=size // 2))
    with pytest.raises(CheckpointError, match=rf"no space left .*\({size // 2} bytes free; the last checkpoint took"):
        _save(manager, trainer, 3)
    monkeypatch.undo()
    assert sorted(p.name for p in arm.iterdir()) == ["step_1"]
    _save(manager, trainer, 3)  # space again: the save goes through
    assert sorted(p.name for p in arm.iterdir()) == ["step_1", "step_3"]


@pytest.mark.megatron
def test_digest_mismatch_falls_back_to_the_previous(tmp_path, trainer, fresh, caplog):
    model, optimizer = trainer
    manager = _manager(tmp_path)
    _save(manager, trainer, 1)
    at_step_1 = _params(model)
    _train(model, optimizer)
    newest = _save(manager, trainer, 3)
    target = newest / optim_file(0, 0)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digest tells
    target.write_bytes(bytes(data))
    assert manager.latest().step == 3
    fresh_optimizer = _fresh_optimizer(fresh)
    with pytest.raises(ckpt.CheckpointCorruptError, match="sha256"):
        manager.load(manager.latest(), model=fresh, optimizer=fresh_optimizer)
    with caplog.at_level(logging.WARNING, logger=LOG):
        state = manager.load_latest(model=fresh, optimizer=fresh_optimizer)
    assert state.step == 1
    assert "step_3" in caplog.text and optim_file(0, 0) in caplog.text and "previous" in caplog.text
    _assert_params_equal(fresh, at_step_1)
    # going on from step 1, the next save is kept even though the damaged step 3 is newer
    _save(_manager(tmp_path, keep_top_k=1), trainer, 2)
    assert [c.step for c in manager.checkpoints()] == [2]


@pytest.mark.megatron
def test_another_config_is_refused_naming_every_key(tmp_path, trainer, fresh):
    _save(_manager(tmp_path), trainer, 2)
    more_steps = _manager(tmp_path, config=_config(max_num_steps=400))
    assert more_steps.latest().step == 2
    other = _with_lr(3e-4)
    other = dataclasses.replace(other, model=dataclasses.replace(other.model, name_or_path="tiny-llama"))
    with pytest.raises(CheckpointMismatchError) as info:
        _manager(tmp_path, config=other).load_latest(model=fresh, optimizer=_fresh_optimizer(fresh))
    message = str(info.value)
    assert "policy.megatron_cfg.optimizer.lr: 1e-05 (checkpoint) != 0.0003 (now)" in message
    assert "model.name_or_path: 'tiny' (checkpoint) != 'tiny-llama' (now)" in message
    assert "checkpoint_dir" in message and "2 key(s) differ" in message
    assert {d[0] for d in info.value.differences} == {"policy.megatron_cfg.optimizer.lr", "model.name_or_path"}
    assert isinstance(info.value, ConfigError)


@pytest.mark.megatron
def test_keep_top_k_keeps_the_latest(tmp_path, trainer):
    manager = _manager(tmp_path, keep_top_k=2)
    for step in range(5):
        _save(manager, trainer, step)
    assert [c.step for c in manager.checkpoints()] == [3, 4]
    assert sorted(p.name for p in (tmp_path / "bf16").iterdir()) == ["step_3", "step_4"]


@pytest.mark.megatron
@pytest.mark.parametrize(("higher", "k", "kept"), [(True, 2, [1, 4]), (False, 2, [2, 4]), (False, 4, [0, 1, 2, 4])])
def test_keep_top_k_by_metric(tmp_path, trainer, higher, k, kept):
    manager = _manager(tmp_path, keep_top_k=k, metric_name="val_accuracy", higher_is_better=higher)
    values = {0: 0.5, 1: 0.9, 2: 0.1, 4: 0.0}  # step 3 lacks the metric: ranked last either way
    for step in range(5):
        model, optimizer = trainer
        metrics = {"reward_mean": 0.0} | ({"val_accuracy": values[step]} if step in values else {})
        manager.save(step=step, model=model, optimizer=optimizer, metrics=metrics)
    assert [c.step for c in manager.checkpoints()] == kept


@pytest.mark.megatron
def test_save_consolidated_writes_a_loadable_hf_folder(tmp_path, trainer):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_fp8.megatron import export_hf_weights

    model, _ = trainer
    path = _save(_manager(tmp_path, save_consolidated=True), trainer, 0)
    hf = path / "hf"
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= {p.name for p in hf.iterdir()}
    written = load_file(hf / "model.safetensors")
    expected = dict(export_hf_weights(model))
    assert written.keys() == expected.keys()
    assert {t.dtype for t in written.values()} == {torch.bfloat16}  # the base model's dtype, not the fp32 trainer's
    assert all(torch.equal(written[n], expected[n].to(torch.bfloat16)) for n in expected)
    meta = json.loads((path / CHECKPOINT_FILE).read_text())
    assert "hf/model.safetensors" in meta["files"] and meta["hf_dtype"] == "bfloat16"
    hf_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(hf_model.state_dict()[name], written[name])


# ----------------------------------------------------------------------------- two processes, no Megatron


def _two_rank_worker(rank: int, port: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)  # identical replicas, as data-parallel ranks hold
        net = torch.nn.Linear(4, 3)
        model = SimpleNamespace(model=[net], hf_path=Path(root), dtype=torch.float32)
        optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
        net(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        torch.manual_seed(100 + rank)  # ranks hold different RNG states
        manager = CheckpointManager(
            cfg=CheckpointingConfig(enabled=True, checkpoint_dir=root),
            arm="fp8",
            fingerprint=config_fingerprint(RunConfig()),
            is_writer=rank == 0,
        )
        manager.save(step=0, model=model, optimizer=optimizer, metrics={"reward_mean": 1.0})
        expected = torch.rand(2)
        with torch.no_grad():
            net.weight.zero_()
        fresh = torch.optim.AdamW(net.parameters(), lr=0.1)
        state = manager.load_latest(model=model, optimizer=fresh)
        assert state is not None and state.step == 0
        assert torch.equal(torch.rand(2), expected)  # each rank got its own RNG back
        assert net.weight.abs().sum() > 0 and fresh.state_dict()["state"][0]["step"] == 1
    finally:
        dist.destroy_process_group()


def test_two_ranks_save_once_and_both_resume(tmp_path):
    port = find_free_port()
    torch.multiprocessing.spawn(_two_rank_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    step = tmp_path / "fp8" / "step_0"
    names = sorted(json.loads((step / CHECKPOINT_FILE).read_text())["files"])
    assert names == [model_file(0, 0), optim_file(0, 0), "rng_rank00000.pt", "rng_rank00001.pt"]
    assert sorted(os.listdir(tmp_path / "fp8")) == ["step_0"]
