"""What ``config`` and ``grpo`` refuse before a run although the file loads: settings that would silently change the
experiment (issues 21 and 27).

A NeMo-RL file loads unchanged (so ``config --explain`` can show it), but a run does not start when a key it gives
without effect here would make the run another experiment than the file describes:

* a layout megatron-fp8 does not run (:func:`unimplemented_layout`: context or sequence
  parallelism, expert tensor parallelism, uneven pipeline stages);
* a Hugging Face ``data.{train,validation}.dataset_name`` without a local ``data_path``: the run would train on the
  built-in toy task (or skip validation) instead;
* a key that changes the algorithm (another advantage estimator, reward shaping, sampling, a weight-decay schedule,
  an ``adv_estimator`` baseline that contradicts ``grpo``'s) set to anything but the value megatron-fp8 runs
  (:func:`other_experiment`), unless ``grpo.allow_no_effect`` (``--allow-no-effect``) accepts them, with a warning.
  NeMo-RL's TIS keys are not among them: they are read (:mod:`megatron_fp8.config.nemo_rl.importance_sampling`).

Cosmetic and infrastructure keys (Ray, cluster, logger paths, vLLM tuning) only warn.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from megatron_fp8.config.memory_plan import memory_report
from megatron_fp8.config.schema import JSONValue, RunConfig
from megatron_fp8.errors import ConfigError

logger = logging.getLogger(__name__)

_OFF = (False, None)
_ZERO = (0, 0.0, None)
EXPERIMENT_KEYS: dict[str, tuple[tuple[JSONValue, ...], str]] = {
    "loss_fn.use_kl_in_reward": (_OFF, "a KL term in the reward"),
    "loss_fn.use_cispo": (_OFF, "the CISPO loss"),
    "loss_fn.disable_ppo_ratio": (_OFF, "a loss without the PPO ratio"),
    "loss_fn.sequence_level_importance_ratios": (_OFF, "sequence-level (GSPO) ratios"),
    "loss_fn.positive_example_nll_weight": (_ZERO, "an NLL term on positive examples"),
    "grpo.adv_estimator.name": (("grpo", None), "another advantage estimator"),
    "grpo.advantage_clip_low": ((None,), "clipped advantages"),
    "grpo.advantage_clip_high": ((None,), "clipped advantages"),
    "grpo.max_rollout_turns": ((1, None), "multi-turn rollouts"),
    "policy.generation.top_p": ((1.0, None), "nucleus sampling (megatron-fp8 samples the full distribution)"),
    "policy.generation.top_k": ((None, -1, 0), "top-k sampling"),
    "policy.generation.stop_strings": ((None, ()), "stop strings"),
    "policy.generation.stop_token_ids": ((None, ()), "extra stop tokens (megatron-fp8 stops at the tokenizer's EOS)"),
    "policy.megatron_cfg.scheduler.weight_decay_incr_style": (("constant", None), "a changing weight decay"),
}
"""NeMo-RL keys that change the algorithm, the values that match what megatron-fp8 runs (any other value makes the run
another experiment), and what the key would have changed."""

UNIMPLEMENTED_LAYOUT: dict[str, tuple[JSONValue, ...]] = {
    "policy.megatron_cfg.context_parallel_size": (1, None),
    "policy.megatron_cfg.expert_tensor_parallel_size": (1, None),
    "policy.megatron_cfg.sequence_parallel": (False, None),
    "policy.megatron_cfg.num_layers_in_first_pipeline_stage": (None,),
    "policy.megatron_cfg.num_layers_in_last_pipeline_stage": (None,),
}
"""NeMo-RL layout keys megatron-fp8 does not implement, and the values that ask for nothing (accepted with no
effect); any other value is refused before a run starts (:func:`unimplemented_layout`)."""


def unimplemented_layout(no_effect: Mapping[str, JSONValue]) -> list[str]:
    """A problem line for each layout key of ``no_effect`` (a config's no-effect keys) that asks for a layout
    megatron-fp8 does not run: context or sequence parallelism, expert tensor parallelism, uneven pipeline stages."""
    return [
        f"{key}={no_effect[key]!r}: not implemented in megatron-fp8 (tensor, pipeline, data and expert parallelism and "
        f"the distributed optimizer are); set it to {allowed[0]!r} or remove it"
        for key, allowed in UNIMPLEMENTED_LAYOUT.items()
        if key in no_effect and no_effect[key] not in allowed
    ]


def unstaged_datasets(config: RunConfig, no_effect: Mapping[str, JSONValue]) -> list[str]:
    """A problem line per split whose NeMo-RL ``dataset_name`` has no local ``data_path`` to read."""
    problems = []
    for split in ("train", "validation"):
        name = no_effect.get(f"data.{split}.dataset_name")
        dataset = getattr(config.data, split)
        if name is None or (dataset is not None and dataset.data_path is not None):
            continue
        instead = f"train on the built-in task grpo.task={config.grpo.task}" if split == "train" else "not validate"
        problems.append(
            f"data.{split}.dataset_name={name!r} names a Hugging Face dataset, and megatron-fp8 reads local files "
            f"only: this run would {instead}. Stage it (`huggingface-cli download --repo-type dataset NAME "
            f"--local-dir DIR`) and set data.{split}.data_path to its JSONL/Parquet file, or remove dataset_name"
        )
    return problems


def _leaves(data: Mapping[str, JSONValue], prefix: str = "") -> dict[str, JSONValue]:
    """Dotted leaf paths of a (possibly nested) mapping: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, JSONValue] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_leaves(value, path + "."))
        else:
            out[path] = value
    return out


def _same(value: JSONValue, allowed: tuple[JSONValue, ...]) -> bool:
    if isinstance(value, list):
        value = tuple(value)
    return any(value == a and type(value) is not bool or value is a for a in allowed)


def other_experiment(config: RunConfig, no_effect: Mapping[str, JSONValue]) -> list[str]:
    """A line per no-effect key whose value makes the run another experiment than the file describes."""
    leaves = _leaves(no_effect)
    problems = [
        f"{key}={value!r}: asks for {what}; megatron-fp8 runs {allowed[0]!r}"
        for key, (allowed, what) in EXPERIMENT_KEYS.items()
        if key in leaves and not _same(value := leaves[key], allowed)
    ]
    sched = {k.rpartition(".")[2]: v for k, v in leaves.items() if k.startswith("policy.megatron_cfg.scheduler.")}
    decay = config.policy.megatron_cfg.optimizer.weight_decay
    for key in ("start_weight_decay", "end_weight_decay"):
        if sched.get(key) is not None and float(sched[key]) != float(decay):
            problems.append(
                f"policy.megatron_cfg.scheduler.{key}={sched[key]!r}: asks for a weight decay other than "
                f"policy.megatron_cfg.optimizer.weight_decay={decay} (the one megatron-fp8 uses)"
            )
    for key in ("normalize_rewards", "use_leave_one_out_baseline"):  # NeMo-RL's newer spelling of the grpo keys
        given, used = leaves.get(f"grpo.adv_estimator.{key}"), getattr(config.grpo, key)
        if given is not None and given != used:
            problems.append(
                f"grpo.adv_estimator.{key}={given!r}: megatron-fp8 reads grpo.{key}={used!r}; give both the same value"
            )
    return problems


def over_memory(config: RunConfig) -> list[str]:
    """The memory plan's refusal (:func:`megatron_fp8.config.memory_plan.memory_report`): a phase over the GPU, with
    what would fit; warned instead with ``grpo.allow_over_memory``."""
    _, problem = memory_report(config)
    if problem is not None and config.grpo.allow_over_memory:
        logger.warning("running over the GPU's memory (grpo.allow_over_memory): %s", problem)
        return []
    return [problem] if problem is not None else []


def refuse_before_run(config: RunConfig, no_effect: Mapping[str, JSONValue]) -> None:
    """Raise when the run would silently be another experiment (module docstring).

    Raises:
        ConfigError: ``"this run cannot start:"`` and one line per key, naming it and the way out.
    """
    problems = unimplemented_layout(no_effect) + unstaged_datasets(config, no_effect) + over_memory(config)
    other = other_experiment(config, no_effect)
    if other and config.grpo.allow_no_effect:
        logger.warning(
            "running another experiment than the file describes (grpo.allow_no_effect): %d key(s) have no effect "
            "here:\n%s",
            len(other),
            "\n".join(f"  - {p}" for p in other),
        )
    elif other:
        problems.append(
            f"{len(other)} key(s) would change the experiment but have no effect in megatron-fp8 (set them to the "
            "value shown, remove them, or accept the difference with --allow-no-effect / grpo.allow_no_effect=true):"
        )
        problems.extend(f"    {p}" for p in other)
    if problems:
        raise ConfigError(
            "this run cannot start:\n" + "\n".join(f"  - {p}" if not p.startswith("    ") else p for p in problems)
        )
