"""What ``config`` and ``grpo`` refuse before a run although the file loads: settings that would silently change the
experiment (issues 21 and 27).

A NeMo-RL file loads unchanged (so ``config --explain`` can show it), but a run does not start when a key it gives
without effect here would make the run another experiment than the file describes:

* a layout megatron-fp8 does not run (:func:`megatron_fp8.config.memory.unimplemented_layout`: context or sequence
  parallelism, expert tensor parallelism, uneven pipeline stages);
* a Hugging Face ``data.{train,validation}.dataset_name`` without a local ``data_path``: the run would train on the
  built-in toy task (or skip validation) instead.
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_fp8.config.memory import unimplemented_layout
from megatron_fp8.config.schema import JSONValue, RunConfig
from megatron_fp8.errors import ConfigError


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
