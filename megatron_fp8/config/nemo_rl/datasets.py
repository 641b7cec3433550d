"""NeMo-RL's named datasets read from local files: ``data.{train,validation}.dataset_name`` with a ``data_path``.

NeMo-RL's ``response_datasets`` classes (``nemo_rl/data/datasets/response_datasets/*.py``, NVIDIA-NeMo/RL commit
7ea279a) download a Hugging Face dataset and fix its columns, its split and the share held out for validation.
megatron-fp8 reads local files only: when a split gives ``dataset_name`` *and* ``data_path`` (the dataset staged by
the user, JSON Lines or Parquet, rows as on the Hub), :func:`translate_dataset_keys` fills the columns, the split and
``split_validation_size`` NeMo-RL's class uses, before the config is typed; ``dataset_name`` and ``split`` are then
read (``config --explain`` lists them as such), not "no effect". Without ``data_path`` the name is left alone, and
the run is refused by :func:`megatron_fp8.config.refusals.unstaged_datasets` (stage the file first).

====================  ==========================================  ===========================  ====================
``dataset_name``      problem column -> answer column             split (allowed)              held out (default)
====================  ==========================================  ===========================  ====================
OpenMathInstruct-2    ``problem`` -> ``expected_answer`` [#]_     ``train_1M`` (train, 1M,     0.05
                                                                  2M, 5M)
DAPOMath17K           ``prompt[0].content`` ->                    ``train``                    none [#]_
                      ``reward_model.ground_truth``
DAPOMathAIME2024      as DAPOMath17K                              ``train``                    none
DeepScaler            ``problem`` -> ``answer``                   ``train``                    none
AIME2024, AIME2026    ``problem`` -> ``answer``                   ``train``                    none
AIME2025              ``question`` -> ``answer`` (both subsets    ``test``                     none
                      in one file)
OpenR1-Math-220k      ``problem`` -> ``answer``                   ``train``                    0
ResponseDataset       ``input_key`` -> ``output_key`` (default    any                          0
                      ``input`` -> ``output``, yours to set)
====================  ==========================================  ===========================  ====================

.. [#] ``output_key`` may be set (NeMo-RL's class takes it); the problem column is fixed, as in NeMo-RL.
.. [#] "none": NeMo-RL's class takes no ``split_validation_size``: it warns and ignores one (its DAPO recipes inherit
   0.05 from ``grpo_math_1B.yaml``), and so does megatron-fp8 (a warning, the value read as 0).

A column written ``a.b`` or ``a[0].b`` is a path into nested values (``prompt`` is a list of chat messages in
DAPO-Math-17k), read only when the row has no column of that exact name (:func:`column_value`).

Refused with the reason: the names NeMo-RL registers whose rows need more than two columns (``gsm8k``: its answer
is the text after ``####``; ``NuminaMath-1.5``: rows filtered by answer type and validity), non-math datasets
(``HelpSteer3``, ``squad``, ...) and a dotted import path (a custom class). A list of datasets (NeMo-RL's
``grpo_multiple_datasets.yaml``) is read when it holds one entry and refused naming the key otherwise.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from megatron_fp8.config.schema import JSONValue
from megatron_fp8.errors import ConfigError

logger = logging.getLogger(__name__)

NEMO_RL_SOURCE = "NVIDIA-NeMo/RL nemo_rl/data/datasets/response_datasets (commit 7ea279a)"
"""Where the column and split facts of :data:`NAMED_DATASETS` were read."""


@dataclass(frozen=True)
class NamedDataset:
    """One NeMo-RL ``dataset_name``: how its rows become problems.

    Attributes:
        name: NeMo-RL's registry name.
        hub_id: the Hugging Face dataset NeMo-RL downloads (what to stage), ``None`` = the user's own file.
        input_key: the problem column (a path into nested values when it holds ``.`` or ``[``).
        output_key: the expected-answer column.
        input_settable: ``input_key`` may be given (else it is fixed and another value is refused).
        output_settable: ``output_key`` may be given.
        split: the Hub split NeMo-RL reads by default.
        splits: the splits NeMo-RL accepts; ``()`` = any.
        split_validation_size: NeMo-RL's default held-out share; ``None`` = the class holds nothing out.
    """

    name: str
    hub_id: str | None
    input_key: str
    output_key: str
    input_settable: bool = False
    output_settable: bool = False
    split: str | None = "train"
    splits: tuple[str, ...] = ("train",)
    split_validation_size: float | None = None


_DAPO = {"input_key": "prompt[0].content", "output_key": "reward_model.ground_truth"}
NAMED_DATASETS: dict[str, NamedDataset] = {
    d.name: d
    for d in (
        NamedDataset(
            name="OpenMathInstruct-2",
            hub_id="nvidia/OpenMathInstruct-2",
            input_key="problem",
            output_key="expected_answer",
            output_settable=True,
            split="train_1M",
            splits=("train", "train_1M", "train_2M", "train_5M"),
            split_validation_size=0.05,
        ),
        NamedDataset(name="DAPOMath17K", hub_id="BytedTsinghua-SIA/DAPO-Math-17k", **_DAPO),
        NamedDataset(name="DAPOMathAIME2024", hub_id="BytedTsinghua-SIA/AIME-2024", **_DAPO),
        NamedDataset(
            name="DeepScaler",
            hub_id="agentica-org/DeepScaleR-Preview-Dataset",
            input_key="problem",
            output_key="answer",
        ),
        NamedDataset(name="AIME2024", hub_id="HuggingFaceH4/aime_2024", input_key="problem", output_key="answer"),
        NamedDataset(
            name="AIME2025",
            hub_id="opencompass/AIME2025",
            input_key="question",
            output_key="answer",
            split="test",
            splits=("test",),
        ),
        NamedDataset(name="AIME2026", hub_id="MathArena/aime_2026", input_key="problem", output_key="answer"),
        NamedDataset(
            name="OpenR1-Math-220k",
            hub_id="open-r1/OpenR1-Math-220k",
            input_key="problem",
            output_key="answer",
            splits=(),
            split_validation_size=0.0,
        ),
        NamedDataset(
            name="ResponseDataset",
            hub_id=None,
            input_key="input",
            output_key="output",
            input_settable=True,
            output_settable=True,
            split=None,
            splits=(),
            split_validation_size=0.0,
        ),
    )
}
"""The NeMo-RL dataset names megatron-fp8 reads from a local file, as NeMo-RL's classes define them."""

_NOT_MATH = "not a math problem/answer dataset (megatron-fp8's rewards are math-verify or a module:function)"
UNSUPPORTED: dict[str, str] = {
    "gsm8k": "NeMo-RL takes its answer from the text after '####' of the 'answer' column",
    "GSM8K": "NeMo-RL takes its answer from the text after '####' of the 'answer' column",
    "NuminaMath-1.5": "NeMo-RL keeps only rows with a verifiable answer, marked valid",
    "Nemotron-Cascade-2-SFT-Math": "its rows are whole chat transcripts (SFT data)",
    "openai_format": "its rows are chat transcripts",
    "NemoGymDataset": "its rows are NeMo-Gym environment episodes",
    **{
        name: _NOT_MATH
        for name in (
            "HelpSteer3",
            "squad",
            "open_assistant",
            "tulu3_sft_mixture",
            "general-conversation-jsonl",
            "arrow_text",
            "intent-train",
            "intent-bench",
            "audiomcq",
            "avqa",
            "clevr-cogent",
            "daily-omni",
            "geometry3k",
            "mmpr-tiny",
            "refcoco",
        )
    },
}
"""NeMo-RL dataset names megatron-fp8 does not read, and why."""

_PATH_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def column_value(row: dict[str, Any], key: str) -> Any:
    """``row[key]``, or, when the row has no column ``key``, the value at the path ``key`` names.

    ``"prompt[0].content"`` is ``row["prompt"][0]["content"]``; ``None`` when any step is missing.
    """
    if key in row or not any(c in key for c in ".["):
        return row.get(key)
    value: Any = row
    for name, index in _PATH_PART.findall(key):
        if name and isinstance(value, dict):
            value = value.get(name)
        elif index and isinstance(value, list) and int(index) < len(value):
            value = value[int(index)]
        else:
            return None
    return value


def named_dataset(name: str, *, key: str) -> NamedDataset:
    """The spec of NeMo-RL's ``dataset_name`` ``name``.

    Args:
        name: the ``dataset_name`` given.
        key: its dotted config key, for messages.

    Raises:
        ConfigError: a name megatron-fp8 does not read (the reason), or a name NeMo-RL does not register (the names
            that are read).
    """
    if name in NAMED_DATASETS:
        return NAMED_DATASETS[name]
    read = ", ".join(NAMED_DATASETS)
    if name in UNSUPPORTED:
        raise ConfigError(
            f"{key}={name!r}: megatron-fp8 does not read this NeMo-RL dataset ({UNSUPPORTED[name]}). Convert it to a "
            f"JSON Lines file with a problem column and an answer column and remove dataset_name (set input_key and "
            f"output_key), or use one of: {read}"
        )
    what = "a custom dataset class" if "." in name else "not a dataset NeMo-RL registers"
    raise ConfigError(
        f"{key}={name!r}: {what}; megatron-fp8 reads these NeMo-RL datasets from a local data_path: {read}. For any "
        "other file remove dataset_name and set input_key and output_key"
    )


def _unwrap_list(data: dict[str, JSONValue], split: str) -> None:
    """NeMo-RL's list form of ``data.<split>``: one entry is that entry (NeMo-RL reads a mapping as a one-entry
    list), more are refused naming the key."""
    value = data.get(split)
    if not isinstance(value, list):
        return
    if len(value) == 1 and isinstance(value[0], dict):
        data[split] = value[0]
        return
    names = [str(v.get("dataset_name") or v.get("data_path")) if isinstance(v, dict) else repr(v) for v in value]
    raise ConfigError(
        f"data.{split} lists {len(value)} datasets ({', '.join(names) or 'none'}); megatron-fp8 reads one "
        f"{split} dataset (NeMo-RL's grpo_multiple_datasets.yaml form is not implemented): merge them into one JSON "
        f"Lines file with the same two columns and give it as data.{split}.data_path, or keep one entry"
    )


def _translate_split(entry: dict[str, JSONValue], split: str, sources: dict[str, str]) -> dict[str, JSONValue]:
    """Fill one staged named dataset's keys in place (module docstring); the NeMo-RL keys read -> value."""
    key = f"data.{split}"
    name = entry.get("dataset_name")
    spec = named_dataset(str(name), key=f"{key}.dataset_name")
    source = sources.get(f"{key}.dataset_name", "<file>")
    for attr, settable in (("input_key", spec.input_settable), ("output_key", spec.output_settable)):
        given, ours = entry.get(attr), getattr(spec, attr)
        if given is None:
            entry[attr] = ours
            sources[f"{key}.{attr}"] = source
        elif given != ours and not settable:
            raise ConfigError(
                f"{key}.{attr}={given!r}: NeMo-RL's {spec.name} reads the column {ours!r} (its class fixes it); "
                f"stage the file with that column, or remove dataset_name to read {given!r}"
            )
    chosen = entry.pop("split", None)
    if chosen is not None and spec.splits and chosen not in spec.splits:
        raise ConfigError(
            f"{key}.split={chosen!r}: NeMo-RL's {spec.name} has the splits {', '.join(spec.splits)} (stage one of them)"
        )
    held_out = entry.get("split_validation_size")
    if spec.split_validation_size is None and held_out not in (None, 0, 0.0):
        logger.warning(
            "%s.split_validation_size=%r: NeMo-RL's %s holds no rows out (its class ignores the key, with a warning; "
            "NeMo-RL's DAPO recipes inherit 0.05 from grpo_math_1B.yaml this way): all of %s is trained on, as in "
            "NeMo-RL. To hold rows out, remove dataset_name (a plain file honours split_validation_size)",
            key,
            held_out,
            spec.name,
            entry.get("data_path"),
        )
        entry["split_validation_size"] = held_out = 0.0
    if held_out is None and spec.split_validation_size:
        entry["split_validation_size"] = spec.split_validation_size
        sources[f"{key}.split_validation_size"] = source
    del entry["dataset_name"]
    split_read = chosen if chosen is not None else spec.split
    logger.info(
        "%s.dataset_name=%s read from %s: %s -> %s%s%s",
        key,
        spec.name,
        entry.get("data_path"),
        entry["input_key"],
        entry["output_key"],
        f", split {split_read}" if split_read else "",
        f", {entry['split_validation_size']} held out for validation" if entry.get("split_validation_size") else "",
    )
    read: dict[str, JSONValue] = {f"{key}.dataset_name": spec.name}
    if split_read is not None:
        read[f"{key}.split"] = split_read
    return read


def translate_dataset_keys(raw: dict[str, JSONValue], sources: dict[str, str]) -> dict[str, JSONValue]:
    """Read NeMo-RL's named datasets that have a local ``data_path`` (module docstring), in place.

    Args:
        raw: the resolved config (nested mappings).
        sources: dotted leaf -> the file or ``<override>`` that set it (the filled keys get ``dataset_name``'s).

    Returns:
        The NeMo-RL keys read (``data.train.dataset_name``, ``data.train.split``) and their values.

    Raises:
        ConfigError: a list of more than one dataset; a name megatron-fp8 does not read; a fixed column given
            another value; a split the dataset does not have.
    """
    data = raw.get("data")
    if not isinstance(data, dict):
        return {}
    read: dict[str, JSONValue] = {}
    for split in ("train", "validation"):
        _unwrap_list(data, split)
        entry = data.get(split)
        if isinstance(entry, dict) and entry.get("dataset_name") is not None and entry.get("data_path") is not None:
            read.update(_translate_split(entry, split, sources))
    return read
