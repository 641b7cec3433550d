"""NeMo-RL's own ``scale_rewards`` and ``apply_reward_shaping`` (its code, run unchanged: ``data/nemo_rl/README.md``)
against :mod:`megatron_fp8.rl.algorithm.shaping`, on the same rewards, response lengths and truncation flags, with
the config a NeMo-RL-style file gives (``grpo.reward_scaling``, ``grpo.reward_shaping``), in NeMo-RL's order."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import yaml

from megatron_fp8.config import load_config
from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.algorithm.shaping import scale_rewards, shape_rewards

DATA = Path(__file__).parent / "data" / "nemo_rl"


class _BatchedDataDict(dict):
    """What the two functions use of NeMo-RL's ``BatchedDataDict``: ``[]``, ``.get`` and a generic annotation."""

    def __class_getitem__(cls, item):
        return cls


def _module(file: str) -> types.ModuleType:
    mod = types.ModuleType(f"nemo_rl_{file.split('.')[0]}")
    mod.__dict__.update(BatchedDataDict=_BatchedDataDict, DatumSpec=object, get_gdpo_reward_component_keys=lambda b: [])
    source = DATA / file
    code = source.read_text().replace(
        "from nemo_rl.distributed.batched_data_dict import BatchedDataDict", "BatchedDataDict = BatchedDataDict"
    )  # the one import of a NeMo-RL package: its stand-in above (the functions read [] and .get)
    exec(compile(code, str(source), "exec"), mod.__dict__)
    return mod


@pytest.fixture(scope="module")
def nemo_rl() -> tuple[types.ModuleType, types.ModuleType]:
    return _module("grpo_scale_rewards.py.txt"), _module("reward_functions.py.txt")


def _batch(seed: int, n: int = 24, limit: int = 64) -> tuple[torch.Tensor, list[int], list[bool]]:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(n, generator=g) * 1.6 - 0.3  # some outside [0, 1]: the scaling clamps them
    lengths = torch.randint(1, limit + 1, (n,), generator=g).tolist()
    lengths[::4] = [limit] * len(lengths[::4])  # a quarter stopped at the limit (truncated)
    truncated = [length == limit for length in lengths]
    return rewards, lengths, truncated


def _config(tmp_path: Path, grpo: dict):
    path = tmp_path / "nemo_rl_style.yaml"
    path.write_text(yaml.safe_dump({"grpo": grpo}))
    return load_config(path).grpo


CASES = {
    "scaling": {
        "reward_scaling": {"enabled": True, "source_min": 0.0, "source_max": 1.0, "target_min": -1.0, "target_max": 1.0}
    },
    "dapo-overlong": {
        "reward_shaping": {
            "enabled": True,
            "overlong_buffer_length": 16,
            "overlong_buffer_penalty": 1.0,
            "max_response_length": 64,
        }
    },
    "both": {
        "reward_scaling": {
            "enabled": True,
            "source_min": -0.2,
            "source_max": 1.2,
            "target_min": 0.0,
            "target_max": 2.0,
        },
        "reward_shaping": {
            "enabled": True,
            "overlong_buffer_length": 40,
            "overlong_buffer_penalty": 0.5,
            "max_response_length": 48,
        },
    },
    "stop-properly": {"reward_shaping": {"enabled": True, "stop_properly_penalty_coef": 0.25}},
    "off": {},
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nemo_rls_scaling_and_shaping_and_ours_agree(nemo_rl, tmp_path, case, seed):
    grpo_mod, shaping_mod = nemo_rl
    keys = CASES[case]
    cfg = _config(tmp_path, keys)
    rewards, lengths, truncated = _batch(seed)
    batch = _BatchedDataDict(
        total_reward=rewards.clone(), truncated=list(truncated), response_token_lengths=list(lengths)
    )
    batch = grpo_mod.scale_rewards(batch, grpo_mod.RewardScalingConfig(**keys.get("reward_scaling", {})))
    shaping = shaping_mod.RewardShapingConfig(**keys.get("reward_shaping", {}))
    if shaping.enabled:
        batch = shaping_mod.apply_reward_shaping(batch, shaping)
    ours = shape_rewards(scale_rewards(rewards, cfg.reward_scaling), lengths, truncated, cfg.reward_shaping)
    assert torch.equal(ours, batch["total_reward"]), (ours, batch["total_reward"])
    if case != "off":
        assert not torch.equal(ours, rewards)  # the case changes the rewards (the agreement is not vacuous)


@pytest.mark.parametrize(
    ("grpo", "message"),
    [
        ({"reward_shaping": {"enabled": True, "overlong_buffer_length": 8}}, "needs overlong_buffer_penalty"),
        ({"reward_shaping": {"enabled": True, "stop_properly_penalty_coef": 1.5}}, r"must be in \[0, 1\]"),
        ({"reward_scaling": {"enabled": True, "source_min": 1.0, "source_max": 1.0}}, "must exceed source_min"),
        (
            {
                "reward_shaping": {
                    "enabled": True,
                    "overlong_buffer_length": 80,
                    "overlong_buffer_penalty": 1.0,
                    "max_response_length": 64,
                }
            },
            "must be in",
        ),
    ],
    ids=["missing-keys", "coef-range", "empty-range", "buffer-past-limit"],
)
def test_bad_sections_are_refused(tmp_path, grpo, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, grpo)
