"""DAPO's dynamic sampling in real GRPO runs (``grpo.use_dynamic_sampling``, ``batch_multiplier``,
``dynamic_sampling_max_gen_batches``): the rounds a step takes, the groups it trains on, the data position on resume,
and the stop when the rounds run out. The selection itself is NeMo-RL's (``tests/rl/algorithm/
test_dynamic_sampling_oracle.py``).

The reward (a user's function on the embedded math file) is 1.0 for every response to a problem whose answer is odd,
so those groups never vary and are always left out, and the response's length parity otherwise, so most other groups
vary."""

from __future__ import annotations

import json
import logging
import os
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_fp8.config import load_config
from megatron_fp8.errors import DynamicSamplingError
from megatron_fp8.rl.driver import phases
from megatron_fp8.rl.driver.grpo import run_grpo
from megatron_fp8.rl.sampling import dynamic as dynamic_module
from megatron_fp8.rl.state.results import METRICS_FILE, TIMING_SUFFIXES

pytestmark = [pytest.mark.slow, pytest.mark.megatron, pytest.mark.processes]

MATH = Path(__file__).resolve().parents[3] / "data" / "math_tiny"
GROUP = 4
DS = ("grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=1.5", "grpo.dynamic_sampling_max_gen_batches=6")
REWARDS = """
def odd_answers_always_right(prompt, response, answer):
    return 1.0 if int(answer) % 2 else float(len(response) % 2)

def always_right(prompt, response, answer):
    return 1.0

def length(prompt, response, answer):
    return len(response) / 100.0
"""


@pytest.fixture
def reward_pkg(tmp_path, monkeypatch) -> str:
    pkg = tmp_path / "dapo_rewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "rewards.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "dapo_rewards.rewards"


def _config(tmp_path: Path, reward: str, *extra: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join((MATH / "train.jsonl").read_text().splitlines()[:60]) + "\n")
    return load_config(
        None,
        [
            f"data.train.data_path={data}",
            "data.train.input_key=problem",
            "data.train.output_key=expected_answer",
            f"data.default.env_name={reward}",
            "grpo.num_prompts_per_step=4",
            f"grpo.num_generations_per_prompt={GROUP}",
            "grpo.warm_start_steps=1",
            *extra,
        ],
    )


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.endswith(TIMING_SUFFIXES)}


def test_a_dapo_run_trains_only_on_groups_whose_rewards_vary(tmp_path, reward_pkg, monkeypatch, caplog):
    trained = []
    real_train = phases.train_phase

    def spy(state, ctx, out, scores, *, step):
        trained.append((out.problems, scores.rewards.clone()))
        return real_train(state, ctx, out, scores, step=step)

    monkeypatch.setattr(phases, "train_phase", spy)
    out = tmp_path / "out"
    cfg = _config(tmp_path, f"{reward_pkg}:odd_answers_always_right", *DS)
    with caplog.at_level(logging.INFO, logger="megatron_fp8.rl.sampling.dynamic"):
        run_grpo(cfg, out_dir=out, steps=4, arms=["fp8_tis"], progress=False)
    records = _records(out)
    assert len(records) == 4 and len(trained) == 4
    for problems, rewards in trained:
        assert len(problems) == 4 * GROUP  # num_prompts_per_step x num_generations_per_prompt, every step
        for g in range(4):
            group = rewards[g * GROUP : (g + 1) * GROUP]
            assert bool((group != group[0]).any()), "a group with equal rewards was trained on"
            assert all(int(p.answer) % 2 == 0 for p in problems[g * GROUP : (g + 1) * GROUP])
    for r in records:  # 6 prompts a round; the odd-answer groups always leave
        assert r["dynamic_sampling_num_gen_batches"] >= 1 and 0 <= r["dynamic_sampling_filtered_share"] < 1
        assert r["dynamic_sampling_num_discarded_valid_samples"] >= 0 and r["filtered_reward_mean"] is not None
    assert sum(r["dynamic_sampling_num_gen_batches"] for r in records) > 4  # some step needed a second round
    assert sum(r["dynamic_sampling_filtered_share"] for r in records) > 0
    assert "dynamic sampling round 2 (data batch" in caplog.text and "samples have varying group rewards" in caplog.text


def test_when_every_group_varies_dynamic_sampling_is_the_plain_run(tmp_path, reward_pkg, monkeypatch):
    """Every sample kept (the deviation forced non-zero): one round, nothing filtered, and the run is the plain one,
    metric for metric: the rounds' plumbing (gather, share, scores rebuilt) changes nothing it trains on."""
    monkeypatch.setattr(dynamic_module, "prompt_reward_std", lambda rewards, **_: torch.ones_like(rewards))
    reward = f"{reward_pkg}:length"
    plain = _records(_run(tmp_path / "plain", reward))
    dynamic = _records(_run(tmp_path / "ds", reward, "grpo.use_dynamic_sampling=true"))
    ds_keys = {k for k in dynamic[0] if k.startswith("dynamic_sampling_")} | {"filtered_reward_mean", "reward_mean"}
    for a, b in zip(plain, dynamic, strict=True):
        assert b["dynamic_sampling_num_gen_batches"] == 1 and b["dynamic_sampling_filtered_share"] == 0.0
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], rel=1e-6)
        assert b["filtered_reward_mean"] == pytest.approx(a["reward_mean"], rel=1e-6)
        assert {k: v for k, v in _untimed(a).items() if k not in ds_keys} == {
            k: v for k, v in _untimed(b).items() if k not in ds_keys
        }


def _run(tmp_path: Path, reward: str, *extra: str, steps: int = 2) -> Path:
    out = tmp_path / "out"
    run_grpo(_config(tmp_path, reward, *extra), out_dir=out, steps=steps, arms=["fp8"], progress=False)
    return out


def test_a_resumed_dapo_run_draws_the_rounds_an_uninterrupted_one_draws(tmp_path, reward_pkg):
    reward = f"{reward_pkg}:odd_answers_always_right"
    ckpt = ("checkpointing.enabled=true", "checkpointing.save_period=1")
    whole = _records(
        _run(tmp_path / "a", reward, *DS, *ckpt, f"checkpointing.checkpoint_dir={tmp_path / 'ca'}", steps=3)
    )
    extra = (*DS, *ckpt, f"checkpointing.checkpoint_dir={tmp_path / 'cb'}")
    _run(tmp_path / "b", reward, *extra, steps=2)
    meta = json.loads((tmp_path / "cb" / "fp8" / "step_1" / "checkpoint.json").read_text())
    assert meta["extra"]["data_batches"] == sum(r["dynamic_sampling_num_gen_batches"] for r in whole[:2])
    assert meta["extra"]["data_batches"] > 2  # a step took two rounds: the position is not the step count
    resumed = _records(_run(tmp_path / "b", reward, *extra, steps=3))
    for a, b in zip(whole, resumed, strict=True):  # the engine's version counts its refits: the resume's is one more
        a, b = _untimed(a), _untimed(b)
        assert {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k) and k != "refit_version"} == {}


def test_a_step_that_runs_out_of_rounds_stops_naming_the_keys_and_keeps_the_last_checkpoint(tmp_path, reward_pkg):
    cfg = _config(
        tmp_path,
        f"{reward_pkg}:always_right",
        "grpo.use_dynamic_sampling=true",
        "grpo.dynamic_sampling_max_gen_batches=1",
    )
    with pytest.raises(
        DynamicSamplingError, match=r"after 2 generation rounds .*grpo\.dynamic_sampling_max_gen_batches=1"
    ):
        run_grpo(cfg, out_dir=tmp_path / "out", steps=2, arms=["fp8"], progress=False)


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    """The reward package and the math rows, for runs in processes of their own (``PYTHONPATH``)."""
    root = tmp_path_factory.mktemp("staged")
    (root / "dapo_rewards").mkdir()
    (root / "dapo_rewards" / "__init__.py").write_text("")
    (root / "dapo_rewards" / "rewards.py").write_text(textwrap.dedent(REWARDS))
    (root / "train.jsonl").write_text("\n".join((MATH / "train.jsonl").read_text().splitlines()[:60]) + "\n")
    return root


def _cli_grpo(warm_cli, staged: Path, out: Path, processes: int, *extra: str) -> list[dict]:
    """``megatron-fp8 grpo`` on the staged math rows with the reward package (``PYTHONPATH``), ``processes`` ranks
    (torchrun's worker environment, gloo), 3 steps of the FP8 arm with dynamic sampling."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MFP8_ROLE", "ROLLOUT_TASKS")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(staged), env.get("PYTHONPATH", "")])}
    overrides = (
        f"data.train.data_path={staged / 'train.jsonl'}", "data.train.input_key=problem",
        "data.train.output_key=expected_answer", "data.default.env_name=dapo_rewards.rewards:odd_answers_always_right",
        "grpo.num_prompts_per_step=4", f"grpo.num_generations_per_prompt={GROUP}", "grpo.warm_start_steps=1", *DS,
        "policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise", *extra,  # tensorwise: the tiny model splits at TP 2
    )  # fmt: skip
    argv = ["grpo", "--out", str(out), "--steps", "3", "--arms", "fp8", "--no-progress", *overrides]
    proc = warm_cli.run(argv, env=env, nprocs=processes, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _records(out)


@pytest.fixture(scope="module")
def one_process(staged, warm_cli) -> list[dict]:
    """The colocated one-process run the layouts below are compared with."""
    runs = _cli_grpo(warm_cli, staged, staged / "one", 1)
    assert sum(r["dynamic_sampling_num_gen_batches"] for r in runs) > 3  # a step took a second round
    return runs


def test_separate_rollout_ranks_draw_the_rounds_the_colocated_engine_draws(tmp_path, staged, one_process, warm_cli):
    """The 16-GPU report configs' layout: 1 trainer + 1 rollout rank (``colocated.enabled: false``); every round is a
    request to the rollout rank, answered with the version it holds, so the run is the colocated one."""
    split = (
        "policy.generation.colocated.enabled=false",
        "policy.generation.colocated.resources.gpus_per_node=1",
        "policy.generation.colocated.resources.num_nodes=1",
    )
    separate = _cli_grpo(warm_cli, staged, tmp_path / "separate", 2, *split)
    keys = ("dynamic_sampling_num_gen_batches", "dynamic_sampling_num_discarded_valid_samples", "reward_mean")
    for a, b in zip(one_process, separate, strict=True):
        assert {k: b[k] for k in (*keys, "sample", "filtered_reward_mean")} == {
            k: a[k] for k in (*keys, "sample", "filtered_reward_mean")
        }
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-8)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)


def test_data_parallel_2_trains_on_what_one_process_trains_on(tmp_path, staged, one_process, warm_cli):
    """Two data-parallel replicas (torchrun's worker environment, gloo): each generates half of every round, their
    kept samples are gathered in order, so both draw the same rounds, keep and discard the same samples as one
    process, and train on its halves (the update equal to one process's up to float32 summation order)."""
    two_process = _cli_grpo(warm_cli, staged, tmp_path / "dp2", 2)
    for one, two in zip(one_process, two_process, strict=True):
        for key in ("dynamic_sampling_num_gen_batches", "dynamic_sampling_num_discarded_valid_samples"):
            assert two[key] == one[key], key
        assert two["dynamic_sampling_filtered_share"] == pytest.approx(one["dynamic_sampling_filtered_share"])
        assert two["reward_mean"] == pytest.approx(one["reward_mean"], rel=1e-6)
        assert two["filtered_reward_mean"] == pytest.approx(one["filtered_reward_mean"], rel=1e-6)
        assert two["rollout_prompts_per_rank"] == [sum(one["rollout_prompts_per_rank"]) // 2] * 2
        # the update: both halves normalized by the whole batch's token count (NeMo-RL's), so the gradient and the
        # loss are one process's
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize(
    ("layout", "engines"),
    [
        ("policy.megatron_cfg.tensor_model_parallel_size=2", 2),
        ("policy.megatron_cfg.pipeline_model_parallel_size=2", 2),
    ],
    ids=["tp2", "pp2"],
)
def test_tensor_and_pipeline_parallel_2_draw_and_train_as_one_process(
    tmp_path, staged, one_process, warm_cli, layout, engines
):
    """One replica over 2 ranks (TP 2 or PP 2): each rank's engine generates half of every round, the halves are
    gathered within the replica, so the rounds, the kept samples and the update are one process's (losses and
    gradient norms to the model-parallel tests' 1e-5)."""
    got = _cli_grpo(warm_cli, staged, tmp_path / "out", 2, layout)
    keys = ("dynamic_sampling_num_gen_batches", "dynamic_sampling_num_discarded_valid_samples", "reward_mean", "sample")
    for a, b in zip(one_process, got, strict=True):
        assert {k: b[k] for k in keys} == {k: a[k] for k in keys}
        assert b["rollout_prompts_per_rank"] == [sum(a["rollout_prompts_per_rank"]) // engines] * engines
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
