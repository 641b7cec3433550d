"""Issue 21 (part): NeMo-RL's keys drive the run; megatron-fp8's former keys for the same settings only move to them.

NeMo-RL's ``policy.megatron_cfg.optimizer.{lr, weight_decay, adam_beta1, adam_beta2, adam_eps}`` and
``policy.generation.{max_new_tokens, temperature}`` are the keys of those settings; ``grpo.learning_rate``,
``grpo.max_new_tokens`` and ``grpo.temperature`` are read for one more release, moved to NeMo-RL's key with a
warning that names it, and can never shadow it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from megatron_fp8.config.loader import MOVED_KEYS, load_config, load_config_report
from megatron_fp8.config.nemo_rl.inheritance import leaf_paths
from megatron_fp8.config.nemo_rl.keys import known_keys
from megatron_fp8.config.refusals import refuse_before_run
from megatron_fp8.config.schema import RunConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.driver.train_settings import learning_rate_at

DATA = Path(__file__).parent / "data" / "nemo_rl" / "examples" / "configs"


def test_nemo_rl_8b_fp8_config_runs_with_its_own_optimizer_lengths_and_sampling():
    """NeMo-RL's own file, unchanged: its values, not megatron-fp8 defaults, are what the run uses."""
    loaded = load_config_report(DATA / "grpo_math_8B_megatron_fp8.yaml")
    cfg = loaded.config
    opt, gen = cfg.policy.megatron_cfg.optimizer, cfg.policy.generation
    assert (opt.lr, opt.weight_decay, opt.adam_beta1, opt.adam_beta2, opt.adam_eps) == (3e-7, 0.01, 0.9, 0.999, 1e-8)
    assert (gen.max_new_tokens, gen.temperature) == (4096, 1.0)
    # Megatron-Core's schedule from the file's policy.megatron_cfg.scheduler: 13 steps of warm-up from 3e-8
    sched = cfg.policy.megatron_cfg.scheduler
    assert (sched.lr_warmup_iters, sched.lr_warmup_init, sched.lr_decay_style, sched.lr_decay_iters) == (
        13,
        3e-8,
        "constant",
        1000,
    )
    assert learning_rate_at(0, cfg) == pytest.approx(3e-8, rel=1e-12)  # the rate the first update is taken with
    assert learning_rate_at(6, cfg) == pytest.approx(3e-8 + (3e-7 - 3e-8) * 6 / 13, rel=1e-12)
    assert learning_rate_at(13, cfg) == learning_rate_at(500, cfg) == pytest.approx(3e-7, rel=1e-12)
    # the loss and the advantages of its parents (grpo_math_1B.yaml): KL penalty to the reference, RLOO baseline
    loss, g = cfg.loss_fn, cfg.grpo
    assert (loss.reference_policy_kl_penalty, loss.reference_policy_kl_type) == (0.01, "k3")
    assert (loss.kl_input_clamp_value, loss.kl_output_clamp_value, loss.use_on_policy_kl_approximation) == (
        20.0,
        10.0,
        False,
    )
    assert (loss.ratio_clip_min, loss.ratio_clip_max, loss.token_level_loss) == (0.2, 0.2, True)
    assert (g.normalize_rewards, g.use_leave_one_out_baseline) == (True, True)
    for key in (
        "policy.megatron_cfg.optimizer.lr",
        "policy.megatron_cfg.optimizer.weight_decay",
        "policy.megatron_cfg.scheduler.lr_warmup_iters",
        "policy.megatron_cfg.scheduler.lr_warmup_init",
        "policy.generation.max_new_tokens",
        "policy.generation.temperature",
        "loss_fn.reference_policy_kl_penalty",
        "loss_fn.reference_policy_kl_type",
        "grpo.use_leave_one_out_baseline",
        "grpo.normalize_rewards",
    ):
        assert key not in loaded.no_effect, key
    assert Path(loaded.sources["policy.megatron_cfg.optimizer.lr"]).name == "grpo_math_8B_megatron.yaml"


def test_former_keys_move_to_nemo_rl_keys_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.config.loader"):
        cfg = load_config(
            None,
            [
                "grpo.learning_rate=0.25",
                "grpo.max_new_tokens=7",
                "grpo.temperature=0.5",
                "grpo.warmup_steps=4",
                "grpo.num_steps=6",
            ],
        )
    assert cfg.grpo.max_num_steps == 6
    assert cfg.policy.megatron_cfg.optimizer.lr == 0.25
    assert cfg.policy.megatron_cfg.scheduler.lr_warmup_iters == 4
    # the former warm-up (from 10% of lr, linear) is what Megatron-Core's scheduler gives with lr_warmup_init unset
    assert [learning_rate_at(s, cfg) for s in (0, 2, 4, 9)] == pytest.approx([0.025, 0.1375, 0.25, 0.25], rel=1e-12)
    assert (cfg.policy.generation.max_new_tokens, cfg.policy.generation.temperature) == (7, 0.5)
    for old, new in MOVED_KEYS.items():
        assert f"{old} is read as NeMo-RL's {new}; write that key" in caplog.text


def test_an_override_spelled_the_old_way_beats_the_files_nemo_rl_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("policy:\n  megatron_cfg:\n    optimizer:\n      lr: 3.0e-7\n")
    assert load_config(path, []).policy.megatron_cfg.optimizer.lr == 3e-7
    assert load_config(path, ["grpo.learning_rate=1e-4"]).policy.megatron_cfg.optimizer.lr == 1e-4


def test_both_spellings_in_one_source_are_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("grpo:\n  learning_rate: 1.0e-4\npolicy:\n  megatron_cfg:\n    optimizer:\n      lr: 3.0e-7\n")
    with pytest.raises(ConfigError, match="gives grpo.learning_rate and policy.megatron_cfg.optimizer.lr"):
        load_config(path, [])


def test_no_project_key_shadows_a_nemo_rl_key():
    """Every moved setting has one key: NeMo-RL's, which the schema implements; the former key is not in it."""
    schema = set(leaf_paths(RunConfig().to_dict()))
    nemo_rl = known_keys()
    for old, new in MOVED_KEYS.items():
        assert old not in schema and new in schema
        assert nemo_rl.is_known(new), new
    for key in ("policy.megatron_cfg.optimizer.lr", "policy.generation.max_new_tokens"):
        assert key in schema


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("policy.megatron_cfg.optimizer.lr=0", "policy.megatron_cfg.optimizer.lr must be > 0"),
        ("policy.generation.temperature=0", "policy.generation.temperature must be > 0"),
        ("policy.generation.max_new_tokens=0", "policy.generation.max_new_tokens must be >= 1"),
        ("policy.megatron_cfg.optimizer.adam_beta2=1.5", "adam_beta1, adam_beta2 in [0, 1)"),
    ],
)
def test_bad_values_name_the_nemo_rl_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
        load_config(None, [override])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss_fn.reference_policy_kl_penalty=-0.1"], "must be >= 0 (0 = none)"),
        (["loss_fn.reference_policy_kl_type=k4"], "reference_policy_kl_type"),
        (["loss_fn.kl_output_clamp_value=0"], "kl_output_clamp_value must be > 0"),
        (["loss_fn.reference_policy_kl_penalty=0.1", "policy.megatron_cfg.fp8_cfg.fp8_param=true"], "requantize FP8"),
        (["policy.megatron_cfg.scheduler.lr_decay_style=WSD"], "lr_decay_style"),
        (["policy.megatron_cfg.optimizer.min_lr=1.0"], "min_lr must be in [0, lr="),
        (["policy.megatron_cfg.scheduler.lr_warmup_init=1.0"], "lr_warmup_init must be in [0, lr="),
        (["policy.megatron_cfg.scheduler.lr_decay_style=cosine", "policy.megatron_cfg.scheduler.lr_warmup_iters=50",
          "policy.megatron_cfg.scheduler.lr_decay_iters=10"], "above lr_warmup_iters"),
    ],
)  # fmt: skip
def test_bad_loss_and_schedule_values_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_a_decaying_schedule_is_megatron_cores():
    cfg = load_config(
        None,
        [
            "policy.megatron_cfg.optimizer.lr=1.0",
            "policy.megatron_cfg.optimizer.min_lr=0.1",
            "policy.megatron_cfg.scheduler.lr_warmup_iters=2",
            "policy.megatron_cfg.scheduler.lr_warmup_init=0.0",
            "policy.megatron_cfg.scheduler.lr_decay_style=cosine",
            "policy.megatron_cfg.scheduler.lr_decay_iters=12",
        ],
    )
    got = [learning_rate_at(s, cfg) for s in (0, 1, 2, 7, 12, 20)]
    # warm-up 0 -> 1 over 2 steps, cosine from 1 to 0.1 over steps 2..12 (half-way at 7), min_lr after
    assert got == pytest.approx([0.0, 0.5, 1.0, 0.55, 0.1, 0.1], abs=1e-12)


def test_a_dataset_name_without_a_local_file_refuses_the_run_instead_of_the_toy_task(tmp_path):
    """NeMo-RL's 8B FP8 file names OpenMathInstruct-2 (a Hugging Face dataset): it loads, but a run of it does not
    start on the built-in task; staged as a local file, it runs."""
    from megatron_fp8.config.refusals import refuse_before_run

    loaded = load_config_report(DATA / "grpo_math_8B_megatron_fp8.yaml")
    with pytest.raises(ConfigError, match=r"data.train.dataset_name='OpenMathInstruct-2' names a Hugging Face") as info:
        refuse_before_run(loaded.config, loaded.no_effect)
    assert "huggingface-cli download" in str(info.value) and "set data.train.data_path" in str(info.value)
    staged = tmp_path / "train.jsonl"
    staged.write_text('{"problem": "1+1", "expected_answer": "2"}\n')
    ok = load_config_report(DATA / "grpo_math_8B_megatron_fp8.yaml", [f"data.train.data_path={staged}"])
    remaining = [p for p in str(_refusal(ok)).splitlines() if "data.train." in p]
    assert remaining == []


def _refusal(loaded) -> str:
    from megatron_fp8.config.refusals import refuse_before_run

    try:
        refuse_before_run(loaded.config, loaded.no_effect)
    except ConfigError as exc:
        return str(exc)
    return ""


def test_a_plain_nemo_rl_bf16_config_runs_its_bf16_arm():
    """NeMo-RL's BF16 Megatron GRPO example gives no grpo.arms: its BF16 rollout runs the bf16 arm, no override."""
    cfg = load_config(DATA / "grpo_math_1B_megatron.yaml")
    assert cfg.policy.generation.vllm_cfg.precision == "bf16" and cfg.grpo.arms == ("bf16",)


def test_nemo_rls_8b_fp8_file_runs_as_it_is_once_its_data_is_staged(caplog):
    """NeMo-RL's 8B FP8 file asks for a KL penalty, a leave-one-out baseline and an lr warm-up from lr_warmup_init:
    megatron-fp8 runs all three, so with its dataset staged the run starts without --allow-no-effect; a key it does
    not run still refuses the run with the list, and --allow-no-effect runs it with a warning listing them."""
    staged = [f"data.train.data_path={Path('data/math_tiny/train.jsonl').resolve()}"]
    loaded = load_config_report(DATA / "grpo_math_8B_megatron_fp8.yaml", staged)
    refuse_before_run(loaded.config, loaded.no_effect)  # nothing refused
    changed = load_config_report(DATA / "grpo_math_8B_megatron_fp8.yaml", [*staged, "grpo.max_rollout_turns=2"])
    with pytest.raises(ConfigError) as info:
        refuse_before_run(changed.config, changed.no_effect)
    message = str(info.value)
    assert "1 key(s) would change the experiment" in message and "grpo.max_rollout_turns=2" in message
    assert "--allow-no-effect" in message
    assert "truncated_importance_sampling" not in message  # its type 'tis' + ratio 2 is this run's token_tis, cap 2
    allowed = load_config_report(
        DATA / "grpo_math_8B_megatron_fp8.yaml",
        [*staged, "grpo.max_rollout_turns=2", "grpo.allow_no_effect=true"],
    )
    with caplog.at_level(logging.WARNING, logger="megatron_fp8.config.refusals"):
        refuse_before_run(allowed.config, allowed.no_effect)
    assert any("max_rollout_turns=2" in r.getMessage() for r in caplog.records)


def test_the_newer_adv_estimator_spelling_must_agree_with_the_grpo_keys():
    ok = load_config_report(None, ["grpo.adv_estimator.use_leave_one_out_baseline=false"])
    refuse_before_run(ok.config, ok.no_effect)
    bad = load_config_report(None, ["grpo.adv_estimator.use_leave_one_out_baseline=true"])
    with pytest.raises(ConfigError, match="grpo.use_leave_one_out_baseline=False; give both the same value"):
        refuse_before_run(bad.config, bad.no_effect)


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        (["policy.generation.top_p=1.0", "policy.generation.top_k=null", "loss_fn.reference_policy_kl_penalty=0.1"], []),
        (["policy.generation.top_p=0.9"], ["policy.generation.top_p=0.9"]),
        (["policy.generation.top_k=50"], ["policy.generation.top_k=50"]),
        (["grpo.max_rollout_turns=2"], ["grpo.max_rollout_turns=2"]),
    ],
)  # fmt: skip
def test_each_experiment_key_is_judged_by_its_value(overrides, refused):
    loaded = load_config_report(None, overrides)
    if not refused:
        refuse_before_run(loaded.config, loaded.no_effect)
        return
    with pytest.raises(ConfigError) as info:
        refuse_before_run(loaded.config, loaded.no_effect)
    for text in refused:
        assert text in str(info.value)


_TIS = ("loss_fn.use_importance_sampling_correction=true", "grpo.arms=[bf16,fp8_tis]")  # the key decides: no fp8 arm


@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        ([*_TIS, "loss_fn.truncated_importance_sampling_type=tis", "loss_fn.truncated_importance_sampling_ratio=5.0"],
         ("token_tis", 5.0, None, None)),
        ([*_TIS, "loss_fn.truncated_importance_sampling_type=icepop", "loss_fn.truncated_importance_sampling_ratio=5",
          "loss_fn.truncated_importance_sampling_ratio_min=0.5"],
         ("icepop", 2.0, 0.5, 5)),
        ([*_TIS, "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
          "loss_fn.truncated_importance_sampling_ratio=1.002", "loss_fn.truncated_importance_sampling_ratio_min=0.999"],
         ("seq_mask_tis", None, 0.999, 1.002)),
    ],
    ids=["tis", "icepop", "seq-mask-tis"],
)  # fmt: skip
def test_nemo_rls_tis_keys_are_read_as_the_correction_they_name(overrides, want):
    """NeMo-RL's truncated-IS keys decide the correction (an override beats the file's is_variant / is_cap), and
    the run starts without --allow-no-effect."""
    loaded = load_config_report(None, overrides)
    loss = loaded.config.loss_fn
    assert (loss.is_variant, loss.is_cap, loss.is_lower, loss.is_upper) == want
    assert not any(k.startswith("loss_fn.truncated") for k in loaded.no_effect)
    refuse_before_run(loaded.config, loaded.no_effect)


def test_nemo_rls_correction_without_a_type_is_untruncated_token_is():
    """NeMo-RL's files switch the correction on and leave the type null (grpo_math_1B.yaml): NeMo-RL then weights
    every token by its raw ratio; so does megatron-fp8 (token_tis without a cap), not its own C=2 default."""
    cfg = load_config(DATA / "grpo_math_8B_megatron_fp8.yaml")
    assert cfg.loss_fn.use_importance_sampling_correction
    assert (cfg.loss_fn.is_variant, cfg.loss_fn.is_cap) == ("token_tis", None)
    own = load_config(DATA / "grpo_math_8B_megatron_fp8.yaml", ["loss_fn.is_cap=2.0"])
    assert (own.loss_fn.is_variant, own.loss_fn.is_cap) == ("token_tis", 2.0)  # megatron-fp8's key, given: it decides


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss_fn.use_importance_sampling_correction=false", "loss_fn.truncated_importance_sampling_type=tis",
          "loss_fn.truncated_importance_sampling_ratio=2"],
         "needs loss_fn.use_importance_sampling_correction: true"),
        ([*_TIS, "loss_fn.truncated_importance_sampling_type=icepop", "loss_fn.truncated_importance_sampling_ratio=2"],
         "needs loss_fn.truncated_importance_sampling_ratio_min"),
        ([*_TIS, "loss_fn.truncated_importance_sampling_type=tis", "loss_fn.truncated_importance_sampling_ratio=2",
          "loss_fn.truncated_importance_sampling_ratio_min=0.5"],
         "clamps the token weight from below"),
        ([*_TIS, "loss_fn.truncated_importance_sampling_type=tis", "loss_fn.truncated_importance_sampling_ratio=3",
          "loss_fn.is_cap=2.0"],
         "keep one spelling"),
    ],
    ids=["correction-off", "icepop-without-min", "tis-lower-clamp", "both-spellings"],
)  # fmt: skip
def test_nemo_rls_tis_keys_that_cannot_be_run_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config_report(None, overrides)


def test_the_cli_flag_accepts_the_difference(tmp_path):
    from megatron_fp8.cli import main

    assert main(["config", "policy.generation.top_p=0.5"]) == 1
    assert main(["config", "--allow-no-effect", "policy.generation.top_p=0.5"]) == 0
