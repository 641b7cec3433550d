"""What ``config`` and ``grpo`` refuse before a run although the file loads: settings that would silently change the
experiment (issues 21 and 27).

A NeMo-RL file loads unchanged (so ``config --explain`` can show it), but a run does not start when a key it gives
without effect here would make the run another experiment than the file describes:

* a layout megatron-fp8 does not run (:func:`unimplemented_layout`: context or sequence
  parallelism, expert tensor parallelism, uneven pipeline stages);
* a Hugging Face ``data.{train,validation}.dataset_name`` without a local ``data_path``: the run would train on the
  built-in toy task (or skip validation) instead.
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_fp8.config.schema import JSONValue, RunConfig
from megatron_fp8.errors import ConfigError

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


def refuse_before_run(config: RunConfig, no_effect: Mapping[str, JSONValue]) -> None:
    """Raise when the run would silently be another experiment (module docstring).

    Raises:
        ConfigError: ``"this run cannot start:"`` and one line per key, naming it and the way out.
    """
    problems = unimplemented_layout(no_effect) + unstaged_datasets(config, no_effect)
    if problems:
        raise ConfigError("this run cannot start:\n" + "\n".join(f"  - {p}" for p in problems))
