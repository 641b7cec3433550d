"""NeMo-RL's ``policy.sequence_packing`` / ``policy.dynamic_batching`` keys: typed, validated, explained, and acted on.

They were once accepted with no effect; now a NeMo-RL file's values reach the trainer's micro-batch layouts
(``rl.driver.train_settings.batch_layouts`` -> ``megatron.microbatch``). Only ``sequence_packing.fuse_loss`` and
``sequence_packing.sequence_length_round`` stay no-effect keys. Every config here is a real load of a shipped NeMo-RL
file (tests/config/data/nemo_rl) or of the defaults, with overrides.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from megatron_fp8.config import load_config
from megatron_fp8.config.explain import EFFECTS
from megatron_fp8.config.loader import load_config_report
from megatron_fp8.config.nemo_rl.keys import known_keys
from megatron_fp8.errors import ConfigError
from megatron_fp8.megatron.bins import PACKING_ALGORITHMS
from megatron_fp8.megatron.microbatch import plan_micro_batches
from megatron_fp8.rl.driver import train_settings
from megatron_fp8.rl.driver.train_settings import BatchLayouts, batch_layouts

DATA = Path(__file__).parent / "data" / "nemo_rl"
CONFIGS = DATA / "examples" / "configs"
E2E = CONFIGS / "recipes/llm/grpo-llama3.1-8b-instruct-2n8g-megatron-fp8-e2e.yaml"
"""NeMo-RL's Llama-3.1-8B Megatron FP8 recipe: inherits grpo_math_1B.yaml (sequence packing on, budgets
``${mul:${policy.max_total_sequence_length}, ...}``), blockwise FP8 training, two pipeline stages."""
MEGATRON_1B = CONFIGS / "grpo_math_1B_megatron.yaml"
"""NeMo-RL's 1B Megatron file: BF16 training, one pipeline stage."""

PACK, DYN = "policy.sequence_packing", "policy.dynamic_batching"
PACK_KEYS = tuple(f"{PACK}.{k}" for k in ("enabled", "train_mb_tokens", "logprob_mb_tokens", "algorithm"))
PACK_KEYS += (f"{PACK}.microbatch_order",)
DYN_KEYS = tuple(f"{DYN}.{k}" for k in ("enabled", "train_mb_tokens", "logprob_mb_tokens", "sequence_length_round"))
STILL_NO_EFFECT = (f"{PACK}.fuse_loss", f"{PACK}.sequence_length_round")
LOADABLE_FP8 = [r for r in (DATA / "FP8_CONFIGS.txt").read_text().split() if "mxfp8" not in r]
"""The shipped FP8 files that load on this machine (the MXFP8-rollout ones are refused: they need Blackwell)."""


def _batching_keys(keys) -> set[str]:
    return {k for k in keys if k.startswith((PACK + ".", DYN + "."))}


# ----------------------------------------------------------------------------------- 1. a NeMo-RL file's values


def test_nemo_rl_fp8_file_packs_with_its_own_budgets():
    loaded = load_config_report(E2E)
    cfg = loaded.config
    pack = cfg.policy.sequence_packing
    # the budgets are NeMo-RL's interpolations, resolved against the file's own values
    max_total = loaded.no_effect["policy.max_total_sequence_length"]  # read for the interpolation only
    assert isinstance(max_total, int) and max_total > 0
    assert pack.enabled and not cfg.policy.dynamic_batching.enabled
    assert pack.train_mb_tokens == max_total * cfg.policy.train_micro_batch_size
    assert pack.logprob_mb_tokens == max_total * cfg.policy.logprob_batch_size
    assert pack.train_mb_tokens != pack.logprob_mb_tokens  # the two budgets are not mixed up
    assert pack.algorithm == "modified_first_fit_decreasing" and pack.microbatch_order == "packer"
    assert Path(loaded.sources[f"{PACK}.train_mb_tokens"]).name == "grpo_math_1B.yaml"

    assert cfg.training_recipe == "blockwise"
    layouts = batch_layouts(cfg, moe=False)
    for layout, tokens, key in (
        (layouts.train, pack.train_mb_tokens, f"{PACK}.train_mb_tokens"),
        (layouts.score, pack.logprob_mb_tokens, f"{PACK}.logprob_mb_tokens"),
    ):
        assert layout.is_packed and layout.kind == "packed"
        assert (layout.tokens, layout.key) == (tokens, key)
        assert layout.algorithm == "modified_first_fit_decreasing" and not layout.largest_first
        assert layout.round_to == 128  # blockwise FP8 GEMMs: 128-token blocks


def test_packed_multiple_follows_the_training_recipe():
    tensorwise = load_config(E2E, ["policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise"])
    assert tensorwise.training_recipe == "tensorwise"
    layouts = batch_layouts(tensorwise, moe=False)
    assert layouts.train.round_to == layouts.score.round_to == 16
    # without FP8 training nothing pads a packed micro-batch
    blockwise = load_config(E2E)
    mcfg = blockwise.policy.megatron_cfg
    bf16 = dataclasses.replace(
        blockwise,
        policy=dataclasses.replace(
            blockwise.policy,
            megatron_cfg=dataclasses.replace(mcfg, fp8_cfg=dataclasses.replace(mcfg.fp8_cfg, enabled=False)),
        ),
    )
    assert bf16.training_recipe == "bf16" and batch_layouts(bf16, moe=False).train.round_to == 1
    # the other order of the bins
    largest = batch_layouts(load_config(E2E, [f"{PACK}.microbatch_order=largest_first"]), moe=False)
    assert largest.train.largest_first and largest.score.largest_first


# ------------------------------------------------------------------------------------ 2. no longer no-effect keys


@pytest.mark.parametrize("rel", LOADABLE_FP8, ids=lambda r: Path(r).stem)
def test_batching_keys_are_not_reported_as_no_effect(rel):
    loaded = load_config_report(DATA / rel)
    assert _batching_keys(loaded.no_effect) <= set(STILL_NO_EFFECT), _batching_keys(loaded.no_effect)


def test_only_fuse_loss_and_sequence_length_round_stay_no_effect(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.config.loader"):
        loaded = load_config_report(E2E, [f"{PACK}.fuse_loss=true"])
    assert _batching_keys(loaded.no_effect) == set(STILL_NO_EFFECT)
    (warning,) = [r.getMessage() for r in caplog.records if "no effect in megatron-fp8" in r.getMessage()]
    section = [line for line in warning.splitlines() if line.strip().startswith(f"{PACK}:")]
    assert len(section) == 1 and "fuse_loss" in section[0] and "sequence_length_round" in section[0]
    assert not [line for line in warning.splitlines() if line.strip().startswith(f"{DYN}:")]
    kk = known_keys()
    for key in STILL_NO_EFFECT:
        assert key in kk.reasons, key  # a reason of its own, not the generic policy one
    for key in PACK_KEYS + DYN_KEYS:
        assert key not in kk.reasons, key
        assert key in EFFECTS, key


# ----------------------------------------------------------------------------------------- 3. config --explain


def test_explain_lists_the_batching_keys_with_their_effect(warm_cli):
    proc = warm_cli.run(["config", "--explain", str(E2E), "--json"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {r["key"]: r for r in json.loads(proc.stdout)["keys"]}
    for key in PACK_KEYS + DYN_KEYS:
        assert rows[key]["implemented"] is True, key
        assert rows[key]["effect"] == EFFECTS[key], key
        assert rows[key]["source"].endswith("grpo_math_1B.yaml"), key
    assert rows[f"{PACK}.train_mb_tokens"]["value"] == load_config(E2E).policy.sequence_packing.train_mb_tokens
    assert rows[f"{PACK}.sequence_length_round"]["implemented"] is False
    assert rows[f"{PACK}.sequence_length_round"]["effect"].startswith("no effect")

    text = warm_cli.run(["config", "--explain", str(E2E)], timeout=120)
    assert text.returncode == 0, text.stderr
    blocks: dict[str, str] = {}  # key line "key = value", then its indented explanation
    for line in text.stdout.splitlines():
        if line and not line[0].isspace() and " = " in line:
            current = line.split(" = ", 1)[0]
            blocks[current] = ""
        elif line.startswith(" ") and blocks:
            blocks[current] += line
    for key in PACK_KEYS + DYN_KEYS:
        squeezed = "".join(blocks[key].split())  # the explanation is wrapped to 80 columns
        assert "".join(EFFECTS[key].split()) in squeezed, (key, blocks[key])
        assert "noeffect" not in squeezed, (key, blocks[key])
    assert "no effect" in blocks[f"{PACK}.sequence_length_round"]


# ------------------------------------------------------------------------------------------------- 4. refusals


def _refused(path: Path | None, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    return str(err.value)


def test_both_enabled_is_refused():
    msg = _refused(E2E, [f"{DYN}.enabled=true"])
    assert f"{PACK} and {DYN} are both enabled" in msg and "exclusive" in msg
    assert f"{DYN}.enabled: false" in msg


def test_enabled_without_a_budget_is_refused():
    msg = _refused(None, [f"{PACK}.enabled=true"])
    assert f"{PACK}.train_mb_tokens must be a token budget >= 1" in msg and "got None" in msg
    assert f"{PACK}.logprob_mb_tokens must be a token budget >= 1" in msg
    msg = _refused(None, [f"{DYN}.enabled=true", f"{DYN}.train_mb_tokens=512"])
    assert f"{DYN}.logprob_mb_tokens must be a token budget >= 1" in msg
    assert f"{DYN}.train_mb_tokens" not in msg


def test_zero_budget_is_refused():
    msg = _refused(E2E, [f"{PACK}.train_mb_tokens=0"])
    assert f"{PACK}.train_mb_tokens must be a token budget >= 1" in msg and "got 0" in msg
    assert "logprob_mb_tokens" not in msg
    # a disabled section's budgets are not read (as in NeMo-RL)
    assert not load_config(E2E, [f"{DYN}.train_mb_tokens=0"]).policy.dynamic_batching.enabled


def test_unknown_algorithm_is_refused_listing_the_packers():
    msg = _refused(E2E, [f"{PACK}.algorithm=best_fit"])
    assert f"{PACK}.algorithm='best_fit' is not one of NeMo-RL's packers" in msg
    assert all(name in msg for name in PACKING_ALGORITHMS)


def test_unknown_microbatch_order_is_refused():
    msg = _refused(E2E, [f"{PACK}.microbatch_order=bogus"])
    assert f"{PACK}.microbatch_order='bogus'" in msg and "packer" in msg and "largest_first" in msg


def test_dynamic_batching_with_pipeline_parallelism_points_to_packing():
    assert load_config(E2E).policy.megatron_cfg.pipeline_model_parallel_size == 2
    msg = _refused(E2E, [f"{PACK}.enabled=false", f"{DYN}.enabled=true"])
    assert f"{DYN} needs one pipeline stage" in msg and f"use {PACK}" in msg
    msg = _refused(
        MEGATRON_1B,
        [f"{PACK}.enabled=false", f"{DYN}.enabled=true", "policy.megatron_cfg.pipeline_model_parallel_size=2"],
    )
    assert f"{DYN} needs one pipeline stage" in msg


# ------------------------------------------------------------------------------- 5. mixture of experts: rows


def test_moe_keeps_rows_and_warns_once_naming_the_section(monkeypatch, caplog):
    monkeypatch.setattr(train_settings, "_WARNED", set())
    packed = load_config(E2E)
    dynamic = load_config(MEGATRON_1B, [f"{PACK}.enabled=false", f"{DYN}.enabled=true"])
    with caplog.at_level(logging.WARNING, logger=train_settings.__name__):
        for _ in range(3):
            assert batch_layouts(packed, moe=True) == BatchLayouts(None, None)
            assert batch_layouts(dynamic, moe=True) == BatchLayouts(None, None)
    warnings = [r.getMessage() for r in caplog.records if r.name == train_settings.__name__]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(f"{PACK} is enabled") and "mixture-of-experts" in warnings[0]
    assert warnings[1].startswith(f"{DYN} is enabled")
    # neither section enabled: rows, no warning
    assert batch_layouts(load_config(MEGATRON_1B, [f"{PACK}.enabled=false"]), moe=False) == BatchLayouts(None, None)


# ------------------------------------------------------------------------------------------ 6. dynamic batching


def test_dynamic_batching_layouts_round_to_sequence_length_round():
    loaded = load_config_report(MEGATRON_1B, [f"{PACK}.enabled=false", f"{DYN}.enabled=true"])
    cfg = loaded.config
    dyn = cfg.policy.dynamic_batching
    max_total = loaded.no_effect["policy.max_total_sequence_length"]
    assert dyn.train_mb_tokens == max_total * cfg.policy.train_micro_batch_size
    assert dyn.logprob_mb_tokens == max_total * cfg.policy.logprob_batch_size
    layouts = batch_layouts(cfg, moe=False)
    assert (layouts.train.kind, layouts.score.kind) == ("dynamic", "dynamic")
    assert layouts.train.round_to == layouts.score.round_to == dyn.sequence_length_round
    assert (layouts.train.tokens, layouts.train.key) == (dyn.train_mb_tokens, f"{DYN}.train_mb_tokens")
    assert (layouts.score.tokens, layouts.score.key) == (dyn.logprob_mb_tokens, f"{DYN}.logprob_mb_tokens")
    other = load_config(
        MEGATRON_1B, [f"{PACK}.enabled=false", f"{DYN}.enabled=true", f"{DYN}.sequence_length_round=32"]
    )
    assert batch_layouts(other, moe=False).train.round_to == 32


# -------------------------------------------------------------------------------- 7. a row over the budget


def _right_padded(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(lengths) + 3
    ids = torch.zeros(len(lengths), width, dtype=torch.int64)
    mask = torch.zeros(len(lengths), width, dtype=torch.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(1, n + 1)
        mask[i, :n] = 1
    return ids, mask


def test_row_longer_than_the_budget_is_refused_at_plan_time():
    lengths = [40, 100, 20]
    ids, mask = _right_padded(lengths)
    # the file's own budgets plan the batch: every row once, bins padded to the blockwise multiple
    fits = batch_layouts(load_config(E2E), moe=False).train
    micro = plan_micro_batches(ids, mask, fits)
    assert sorted(int(r) for mb in micro for r in mb.rows) == [0, 1, 2]
    assert all(mb.computed_tokens % 128 == 0 for mb in micro)

    # a budget below what a row can reach is refused when the config loads (the engine's max_model_len here) ...
    with pytest.raises(ConfigError, match=rf"{PACK}\.train_mb_tokens=96 is below the longest row .*max_model_len"):
        load_config(E2E, [f"{PACK}.train_mb_tokens=96"])
    # ... and a row over the budget when a pass is planned, naming the key
    small = dataclasses.replace(fits, tokens=96)
    with pytest.raises(ConfigError) as err:
        plan_micro_batches(ids, mask, small)
    msg = str(err.value)
    assert f"{PACK}.train_mb_tokens=96" in msg and "row 1 of the batch has 100 tokens" in msg

    dyn_cfg = load_config(MEGATRON_1B, [f"{PACK}.enabled=false", f"{DYN}.enabled=true"])
    dyn_small = dataclasses.replace(batch_layouts(dyn_cfg, moe=False).score, tokens=64)
    with pytest.raises(ConfigError, match=rf"row 1 of the batch has 100 tokens .*{DYN}\.logprob_mb_tokens=64"):
        plan_micro_batches(ids, mask, dyn_small)
