"""Every check a GRPO run makes before it touches a model, shared by ``megatron-fp8 grpo`` and ``megatron-fp8 config``.

:func:`preflight` runs, on a loaded (already rule-checked) :class:`~megatron_fp8.config.schema.RunConfig`:

* the run's arguments: steps, arms (known, distinct; ``fp8_tis`` needs an IS variant; none contradicts
  ``loss_fn.use_importance_sampling_correction`` when it is given), the task;
* the FP8 rollout: FP8 arms need ``vllm_cfg.precision: fp8`` with 128x128 block scales (the refit is
  blockwise), and vLLM for the FP8 manifest;
* the processes: trainer TP x PP divides ``WORLD_SIZE``, the prompts split over the GRPO processes;
* the model, resolved (a tiny name, a folder, or a Hugging Face id in the local cache / fetched):
  its ``config.json`` dimensions against the trainer and rollout TP sizes (heads, 128-blocks: the
  cross-field rules of :mod:`megatron_fp8.config.validate` run again on the real dimensions), the
  MoE blockwise rule, BF16 first/last layers, the rollout ``quantization_config``; its tokenizer
  (loads, has EOS, encodes the task's prompts and answers);
* the data: ``data.train`` / ``data.validation`` load into prompts (files, keys, prompt file, chat template,
  ``max_input_seq_length``), and ``data.default.env_name`` names a usable reward;
* with ``scan_weights`` (``grpo`` only: it reads every weight), that no weight is NaN/Inf, naming the
  tensor (a NaN would otherwise surface as a non-finite warm-start loss).

``megatron-fp8 config`` calls it with ``download=False``: a Hugging Face model that is not in the
local cache is checked against the known dimensions (:mod:`megatron_fp8.models.dims`) and the
report says what could not be checked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from megatron_fp8.config.algorithm_rules import correction_switch_problems
from megatron_fp8.config.memory import describe_engine_memory
from megatron_fp8.config.nemo_rl.inheritance import check_config_size
from megatron_fp8.config.schema import RunConfig
from megatron_fp8.config.validate import validate_config
from megatron_fp8.errors import ConfigError, UsageError
from megatron_fp8.launch_env import env_int, launch_place
from megatron_fp8.layout import engine_group_problem
from megatron_fp8.models import resolve_model
from megatron_fp8.models.dims import known_dims
from megatron_fp8.models.folder_check import folder_problems
from megatron_fp8.models.tiny import HF_ID_PATTERN
from megatron_fp8.rl.algorithm.batch import eos_and_pad
from megatron_fp8.rl.algorithm.metrics import METRIC_KEYS
from megatron_fp8.rl.data.problems import PromptTokenizer, load_rows, problem_source, read_prompt_template
from megatron_fp8.rl.data.rewards import reward_function
from megatron_fp8.rl.data.task import get_task, sample_problems
from megatron_fp8.rl.driver.fp8_rollout import rollout_quantization_config
from megatron_fp8.rl.driver.stopping import parse_duration
from megatron_fp8.rl.state.results import StepMetrics
from megatron_fp8.rollout.vllm.adapter import vllm_version
from megatron_fp8.vocab import ARMS, PAYLOAD_CLASSES

__all__ = ["PreflightReport", "check_weights_finite", "preflight", "refuse_empty_config"]

logger = logging.getLogger(__name__)

_VLLM = "policy.generation.vllm_cfg"


@dataclass(frozen=True)
class PreflightReport:
    """What :func:`preflight` found.

    Attributes:
        config: the config, with the model dimensions read from the resolved model's ``config.json``.
        arms: the arms the run will run.
        steps: steps per arm.
        model_path: the resolved checkpoint folder (``None``: not available here, see ``notes``).
        notes: what was checked against what, and anything left unchecked.
    """

    config: RunConfig
    arms: tuple[str, ...]
    steps: int
    model_path: Path | None
    notes: tuple[str, ...]


def preflight(
    config: RunConfig,
    *,
    arms: Sequence[str] | None = None,
    steps: int | None = None,
    world_size: int | None = None,
    launch_checks: bool = True,
    download: bool = True,
    scan_weights: bool = False,
    runs_here: bool = True,
) -> PreflightReport:
    """Run every check a GRPO run makes before touching a model; raise one error listing every problem.

    Args:
        config: a loaded config (:func:`megatron_fp8.config.load_config` ran its cross-field rules).
        arms: the arms (``None``: ``grpo.arms``).
        steps: steps per arm (``None``: ``grpo.max_num_steps``).
        world_size: GRPO processes (``None``: ``$WORLD_SIZE``, else 1).
        launch_checks: check the process count (``config`` checks it only when ``WORLD_SIZE`` is set: the
            launch is not known yet; a note says what it needs).
        download: a Hugging Face id may be fetched; ``False`` uses only a cached copy (``config``).
        scan_weights: read every weight and refuse NaN/Inf, naming the tensor.
        runs_here: the run starts on this machine (``grpo``); ``False`` (``config``, which plans a run wherever it
            is launched): what only this machine's lack of a GPU refuses becomes a note.

    Returns:
        The :class:`PreflightReport`.

    Raises:
        ConfigError: ``"this run cannot start:"`` and one ``  - problem`` line each, naming the key and the fix;
            or the model's own error (unknown name, damaged folder, not staged) when ``download`` is true.
    """
    arm_names = tuple(config.grpo.arms if arms is None else arms)
    n_steps = config.grpo.max_num_steps if steps is None else int(steps)
    problems = _argument_problems(config, n_steps=n_steps, arm_names=arm_names)
    notes: list[str] = []
    expert, cpu_only = _expert_problems(config)
    problems += expert
    if cpu_only:
        (problems if runs_here else notes).extend(cpu_only)
    if launch_checks:
        problems += _world_problems(config, world_size)
    else:
        mcfg = config.policy.megatron_cfg
        needed = mcfg.tensor_model_parallel_size * mcfg.pipeline_model_parallel_size
        if needed > 1:
            notes.append(f"trainer TP x PP = {needed}: launch a multiple of {needed} processes (WORLD_SIZE)")
    problems += _rollout_placement_problems(config)
    problems += _deadline_problems(config)
    config, metric_problems = _checkpoint_metric(config)
    problems += metric_problems
    fp8_arms = [a for a in arm_names if a in ARMS and ARMS[a].rollout_precision == "fp8"]
    if fp8_arms:
        problems += _fp8_rollout_problems(config, fp8_arms)

    model_path: Path | None = None
    try:
        model_path = resolve_model(config.model.name_or_path, download=download)
    except ConfigError as exc:
        if (
            download or not _is_hub_id(config.model.name_or_path) or isinstance(exc, UsageError)
        ):  # a damaged local folder, a bad HF_HUB_OFFLINE: errors here too
            raise
        known = (
            "checked against its known dimensions" if config.model.hidden_size is not None else "no known dimensions"
        )
        notes.append(f"model not checked: {exc} ({known}; TP / 128-block and tokenizer checks run when it is staged)")
        data_problems, data_note = _data_files_problems(config)
        problems += data_problems
        if data_note:
            notes.append(data_note)
    if model_path is not None:
        folder = folder_problems(model_path)  # config.json against the safetensors headers, before any dimension
        if folder:
            raise ConfigError("this run cannot start:\n  - " + "\n  - ".join(folder))
        config = _with_model_dims(config, model_path)
        try:
            validate_config(config)  # every cross-field rule again, on the model's real dimensions
        except ConfigError as exc:
            problems += [line.removeprefix("  - ") for line in str(exc).splitlines()[1:]]
        problems += _model_problems(config, model_path, fp8_arms=fp8_arms)
        if scan_weights and not problems:
            check_weights_finite(model_path)
        notes.append(
            f"model {config.model.name_or_path!r} resolved to {model_path}; its config.json and tokenizer checked"
        )
    if problems:
        raise ConfigError("this run cannot start:\n  - " + "\n  - ".join(dict.fromkeys(problems)))
    return PreflightReport(config=config, arms=arm_names, steps=n_steps, model_path=model_path, notes=tuple(notes))


_NEMO_RL_METRICS = {"val_reward": "val_reward_mean", "val:reward": "val_reward_mean"}
"""NeMo-RL ``checkpointing.metric_name`` spellings that are not ``val:X`` -> ``val_X`` or ``train:X`` -> ``X``."""


def checkpoint_metric_names() -> frozenset[str]:
    """The metrics a checkpoint carries: every number of a ``metrics.jsonl`` record, and the last validation's."""
    fields = {f.name for f in dataclasses.fields(StepMetrics)} - {"mismatch", "refit_bytes", "arm", "engine", "sample"}
    refit = {f"refit_{c}_bytes" for c in (*PAYLOAD_CLASSES, "total")}
    return frozenset(
        fields
        | set(METRIC_KEYS)
        | refit
        | {
            "gen_kl",
            "refit_payload_ratio",
            "trainer_padding_share",
            "rollout_overlap_seconds",
            "val_accuracy",
            "val_reward_mean",
        }
    )


def _checkpoint_metric(config: RunConfig) -> tuple[RunConfig, list[str]]:
    """``checkpointing.metric_name`` in megatron-fp8's spelling (NeMo-RL's ``val:accuracy`` accepted), or a problem."""
    ck = config.checkpointing
    name = ck.metric_name
    if name is None or not ck.enabled:
        return config, []
    canonical = _NEMO_RL_METRICS.get(name) or (
        f"val_{name[4:]}" if name.startswith("val:") else name.removeprefix("train:")
    )
    known = checkpoint_metric_names()
    if canonical not in known:
        return config, [
            f"checkpointing.metric_name={name!r} is not a metric of a step; use one of val_accuracy, "
            f"val_reward_mean, reward_mean, exact_match, gen_kl, ... ({len(known)} names: see metrics.jsonl) or null"
        ]
    return dataclasses.replace(config, checkpointing=dataclasses.replace(ck, metric_name=canonical)), []


def _is_hub_id(name: str) -> bool:
    """``owner/name`` that is not a local path: a Hugging Face id (possibly just not downloaded yet)."""
    return bool(HF_ID_PATTERN.match(name)) and not Path(name).expanduser().exists()


def refuse_empty_config(path: str | Path | None) -> None:
    """Refuse a config file that sets no key (empty, only comments, or ``{}``): it would silently run the defaults.

    Raises:
        ConfigError: naming the file and what to do.
    """
    if path is None:
        return
    p = Path(path)
    try:
        check_config_size(p)  # by size first: a 26 MB file must not be parsed (twice) before it is refused
        data = yaml.safe_load(p.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return  # the loader reports an unreadable or malformed file with its line
    if data is None or data == {}:
        raise ConfigError(
            f"{p} sets no key (it is empty); a run would silently take every default. Start from "
            "configs/tiny_cpu.yaml (the embedded default: `megatron-fp8 config` prints it) or omit --config"
        )


def _argument_problems(config: RunConfig, *, n_steps: int, arm_names: tuple[str, ...]) -> list[str]:
    """A bad step count, unknown / repeated arms, a TIS arm without an IS variant, an unknown task."""
    problems = []
    if n_steps < 1:
        problems.append(f"steps must be >= 1, got {n_steps}")
    unknown = [a for a in arm_names if a not in ARMS]
    if unknown or not arm_names:
        problems.append(f"unknown or no arm(s) {unknown or list(arm_names)}; valid arms: {', '.join(ARMS)}")
    if len(set(arm_names)) != len(arm_names):
        problems.append(f"an arm is listed twice: {list(arm_names)}")
    loss = config.loss_fn
    if "fp8_tis" in arm_names and loss.is_variant == "none" and loss.use_importance_sampling_correction is None:
        problems.append("arm fp8_tis corrects with loss_fn.is_variant, which is 'none'; set is_variant: token_tis")
    problems += correction_switch_problems(loss, arm_names)  # --arms against the key
    uncorrected = [arm for arm in arm_names if arm in ARMS and not loss.arm_corrects(arm)]
    if config.grpo.async_grpo.ahead and uncorrected:  # NeMo-RL's async guide: required for convergence (a warning)
        logger.warning(
            "grpo.async_grpo.enabled trains on samples one update old, and arm(s) %s do not correct for it: set "
            "loss_fn.use_importance_sampling_correction: true (NeMo-RL's async GRPO guide requires it)",
            ", ".join(uncorrected),
        )
    try:
        get_task(config.grpo.task, max_digits=config.grpo.task_max_digits)
    except ConfigError as exc:
        problems.append(f"grpo.task: {exc}")
    return problems


def _expert_problems(config: RunConfig) -> tuple[list[str], list[str]]:
    """Expert parallelism needs routed experts that split evenly, and no CPU distributed optimizer beside it:
    ``(problems, problems of a run on this machine only)``."""
    ep, key = config.policy.megatron_cfg.expert_model_parallel_size, "policy.megatron_cfg.expert_model_parallel_size"
    if ep == 1:
        return [], []
    if ep < 1:
        return [f"{key}={ep} must be >= 1"], []
    if not config.model.is_moe:
        return [f"{key}={ep}: {config.model.name_or_path!r} has no routed experts; set it to 1"], []
    problems, here = [], []
    if config.model.num_experts % ep:
        problems.append(f"{key}={ep} does not split the model's {config.model.num_experts} experts evenly")
    if config.policy.megatron_cfg.optimizer.use_distributed_optimizer and not torch.cuda.is_available():
        here.append(
            f"{key}={ep} with policy.megatron_cfg.optimizer.use_distributed_optimizer on this machine (no GPU): the "
            "CPU distributed optimizer shards over the dense data-parallel ranks, which hold different experts; set "
            "one of them off on CPU (Megatron-Core's DistributedOptimizer handles both on a GPU)"
        )
    return problems, here


def _world_problems(config: RunConfig, world_size: int | None) -> list[str]:
    """Trainer TP x PP must divide the process count; each GRPO process rolls out whole prompt groups."""
    if world_size is None:
        world_size = launch_place().world_size
    mcfg = config.policy.megatron_cfg
    model_parallel = mcfg.tensor_model_parallel_size * mcfg.pipeline_model_parallel_size
    problems = []
    if model_parallel > 0 and world_size % model_parallel:
        problems.append(
            f"policy.megatron_cfg.tensor_model_parallel_size x pipeline_model_parallel_size = {model_parallel} "
            f"needs a multiple of {model_parallel} processes; this run has {world_size} (WORLD_SIZE): launch "
            f"{model_parallel} processes (torchrun --nproc-per-node {model_parallel}, or slurm/) or set the sizes to 1"
        )
    replicas = world_size // model_parallel if model_parallel > 0 and not world_size % model_parallel else world_size
    ep = mcfg.expert_model_parallel_size
    if ep > 1 and replicas % ep:
        problems.append(
            f"policy.megatron_cfg.expert_model_parallel_size={ep} splits the experts over data-parallel replicas; "
            f"this run has {replicas} ({world_size} processes / TP x PP {model_parallel}): launch a multiple of "
            f"{ep * model_parallel} processes"
        )
    if replicas and config.grpo.num_prompts_per_step % replicas:
        problems.append(
            f"grpo.num_prompts_per_step={config.grpo.num_prompts_per_step} is not divisible by the {replicas} "
            f"data-parallel model replicas ({world_size} processes, WORLD_SIZE, / TP x PP {model_parallel}); each "
            "replica rolls out whole prompt groups"
        )
    elif replicas and config.grpo.round_prompts % replicas:
        problems.append(
            f"a dynamic-sampling round's {config.grpo.round_prompts} prompts (grpo.num_prompts_per_step x "
            f"batch_multiplier={config.grpo.batch_multiplier}) are not divisible by the {replicas} data-parallel model "
            "replicas; each replica rolls out whole prompt groups: change grpo.batch_multiplier"
        )
    return problems


def _deadline_problems(config: RunConfig) -> list[str]:
    """``checkpointing.checkpoint_must_save_by`` in NeMo-RL's ``DD:HH:MM:SS`` (``grpo`` parses it as the loop starts;
    checked here so ``config`` refuses what ``grpo`` would)."""
    deadline = config.checkpointing.checkpoint_must_save_by
    if not deadline:
        return []
    try:
        parse_duration(deadline)
    except ConfigError as exc:
        return [str(exc)]
    return []


def _rollout_placement_problems(config: RunConfig) -> list[str]:
    """Where a rollout engine of rollout TP above 1 can live: across the trainer's own ranks, colocated.

    Every process owns one GPU (``slurm/grpo.sbatch`` binds one per task). Colocated, an engine of rollout TP ``e``
    is sharded over ``e`` consecutive trainer ranks of one node (vLLM's ``external_launcher``), which must lie inside
    one model replica or hold whole replicas (:func:`megatron_fp8.layout.engine_group_problem`). A separate rollout rank builds its engine
    in its own process, on its one GPU: rollout TP 1 there.
    """
    tp = config.policy.generation.vllm_cfg.tensor_parallel_size
    if tp <= 1:
        return []
    fix = _one_gpu_engine_fix(config)
    if not config.policy.generation.colocated.enabled:
        return [
            f"{_VLLM}.tensor_parallel_size={tp} cannot be placed: each separate rollout rank owns one GPU "
            f"(policy.generation.colocated.resources: one rank per GPU) and builds its engine in its own process; "
            f"{fix}, or colocate the rollout (policy.generation.colocated.enabled=true), where an engine spans "
            f"{tp} trainer ranks"
        ]
    place = launch_place()
    mcfg = config.policy.megatron_cfg
    if place.world_size == 1:
        gpus = torch.cuda.device_count()
        if gpus >= tp:
            return []  # one process owning the GPUs: vLLM's own workers (mp executor)
        return [
            f"{_VLLM}.tensor_parallel_size={tp} in one process that sees {gpus} GPU(s): a one-process engine of "
            f"rollout TP {tp} needs {tp}; {fix}, or launch {tp} ranks (torchrun --nproc-per-node {tp}), which then "
            "shard one engine"
        ]
    problem = engine_group_problem(
        world_size=place.world_size,
        engine_ranks=tp,
        tp=mcfg.tensor_model_parallel_size,
        pp=mcfg.pipeline_model_parallel_size,
    )
    per_node = env_int("LOCAL_WORLD_SIZE", default=0) or env_int("SLURM_NTASKS_PER_NODE", default=0)
    if problem is None and per_node and per_node % tp:
        problem = f"{per_node} ranks per node do not split into engines of {tp} ranks of one node"
    if problem is None:
        return []
    return [
        f"{_VLLM}.tensor_parallel_size={tp} with {place.world_size} colocated rank(s) (WORLD_SIZE): {problem}; {fix}, "
        f"or a rollout TP dividing policy.megatron_cfg.tensor_model_parallel_size "
        f"({mcfg.tensor_model_parallel_size}), or a multiple of it over which the replicas split evenly (an engine "
        "then holds the TP groups of consecutive replicas)"
    ]


def _one_gpu_engine_fix(config: RunConfig) -> str:
    """The fix "rollout TP 1" a placement refusal names, only where an engine's weights fit one GPU's budget (else
    what they need): never a fix that does not fit."""
    fix = f"set {_VLLM}.tensor_parallel_size=1 (every GPU then runs its own engine on its part of the samples)"
    dims = known_dims(config.model.name_or_path)
    if dims is None:
        return fix
    one = dataclasses.replace(
        config,
        policy=dataclasses.replace(
            config.policy,
            generation=dataclasses.replace(
                config.policy.generation,
                vllm_cfg=dataclasses.replace(config.policy.generation.vllm_cfg, tensor_parallel_size=1),
            ),
        ),
    )
    line, fits = describe_engine_memory(one, dims)
    if fits:
        return fix
    return f"rollout TP 1 does not fit ({line}): keep a rollout TP whose engine fits, placed as below"


def _fp8_rollout_problems(config: RunConfig, fp8_arms: list[str]) -> list[str]:
    """FP8 arms need an FP8, blockwise rollout config and vLLM (the FP8 manifest is asked of it)."""
    vllm = config.policy.generation.vllm_cfg
    problems = []
    if vllm.precision != "fp8":
        problems.append(
            f"grpo.arms has FP8 rollout arm(s) {', '.join(fp8_arms)} but {_VLLM}.precision is {vllm.precision!r}; "
            f"set {_VLLM}.precision: fp8 (128x128 blockwise by default) or grpo.arms: [bf16]"
        )
    elif not config.rollout_blockwise:
        problems.append(
            f"{_VLLM}.quantization_config has no weight_block_size: the GRPO refit sends 128x128 blockwise FP8; "
            "set weight_block_size: [128, 128] (or drop quantization_config)"
        )
    if vllm_version() is None:
        problems.append(
            f"FP8 arm(s) {', '.join(fp8_arms)} need vLLM for the FP8 manifest, and vLLM is not installed; "
            "install it (make install) or run --arms bf16"
        )
    return problems


def _model_dims(model_path: Path) -> dict[str, object]:
    """The dimension fields of :class:`~megatron_fp8.config.schema.ModelConfig`, from ``config.json``."""
    hf = json.loads((model_path / "config.json").read_text())
    hf = hf.get("text_config", hf) if isinstance(hf.get("text_config"), dict) else hf
    heads = hf.get("num_attention_heads")
    hidden = hf.get("hidden_size")
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    dims = {
        "num_layers": hf.get("num_hidden_layers"),
        "hidden_size": hidden,
        "intermediate_size": hf.get("intermediate_size"),
        "num_attention_heads": heads,
        "num_key_value_heads": hf.get("num_key_value_heads", heads),
        "head_dim": hf.get("head_dim") or (hidden // heads if hidden and heads else None),
        "moe_intermediate_size": hf.get("moe_intermediate_size") if experts else None,
        "num_experts": int(experts),
    }
    return {k: v for k, v in dims.items() if v is not None or k == "moe_intermediate_size"}


def _with_model_dims(config: RunConfig, model_path: Path) -> RunConfig:
    """``config`` with ``model.*`` dimensions taken from the resolved model (what the run will build)."""
    try:
        dims = _model_dims(model_path)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{model_path / 'config.json'}: cannot read the model dimensions ({exc})") from None
    model = dataclasses.replace(config.model, **dims, is_moe=bool(dims.get("num_experts")))
    return dataclasses.replace(config, model=model)


def _model_problems(config: RunConfig, model_path: Path, *, fp8_arms: list[str]) -> list[str]:
    """Model-dependent checks beyond the cross-field rules: the rollout quantization config, the tokenizer."""
    problems: list[str] = []
    if fp8_arms and config.rollout_blockwise:
        try:
            rollout_quantization_config(config, model_path)
        except ConfigError as exc:
            problems.append(str(exc))
        except Exception as exc:  # the quantization config reads the checkpoint: name what failed
            problems.append(f"{_VLLM}: the FP8 quantization config for {model_path} failed ({exc})")
    problems += _tokenizer_problems(config, model_path, warm_start=config.grpo.warm_start_steps > 0)
    return problems


def _data_files_problems(config: RunConfig) -> tuple[list[str], str]:
    """Without the model's tokenizer: the data files, their keys, the prompt files and the reward, and a note."""
    data = config.data
    if data.train.data_path is None:
        return [], ""
    problems: list[str] = []
    rows = 0
    splits = [("data.train", data.train)]
    if data.validation is not None and data.validation.data_path is not None:
        splits.append(("data.validation", data.validation))
    try:
        for what, split in splits:
            rows += len(load_rows(split, what=what))
        if data.default.prompt_file is not None:
            read_prompt_template(data.default.prompt_file)
        system = data.default.system_prompt_file
        if system is not None and not Path(system).expanduser().is_file():
            problems.append(f"data.default.system_prompt_file: no such file {system}")
        reward_function(config, None)
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:
        return problems, ""
    return (
        [],
        f"data: {rows} rows read and checked; prompts tokenized (chat template, max_input_seq_length) when the model is staged",
    )


def _data_problems(config: RunConfig, tokenizer: PromptTokenizer) -> list[str]:
    """The dataset loads into prompts with the model's tokenizer, and the reward is usable (``data``)."""
    try:
        problem_source(config, tokenizer)
        reward_function(config, None)
    except ConfigError as exc:
        return [str(exc)]
    return []


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""A model folder holding none of these has no tokenizer (transformers then builds one that encodes nothing)."""


def _tokenizer_problems(config: RunConfig, model_path: Path, *, warm_start: bool) -> list[str]:
    """The tokenizer loads, has EOS, turns the task's prompts (and, for the warm start, answers) into tokens, and
    turns the dataset's rows into prompts (:func:`_data_problems`, with the same tokenizer)."""
    from transformers import AutoTokenizer  # lazy: transformers is optional (not a core dependency)

    if model_path.is_dir() and not any((model_path / name).is_file() for name in TOKENIZER_FILES):
        return [
            f"the model folder {model_path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); GRPO "
            "needs the model's tokenizer: copy them from where the weights came from (e.g. `huggingface-cli download "
            "ID tokenizer.json tokenizer_config.json --local-dir DIR`)"
        ]
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    except Exception as exc:  # transformers raises many types for a bad tokenizer folder
        return [f"the tokenizer of {model_path} does not load ({type(exc).__name__}: {exc}); GRPO needs one"]
    try:
        eos_and_pad(tokenizer, where=model_path)
    except ConfigError as exc:
        return [str(exc)]
    task = get_task(config.grpo.task, max_digits=config.grpo.task_max_digits)
    problem = sample_problems(task, seed=config.grpo.seed, step=0, count=1)[0]
    texts = [problem.prompt] + ([problem.answer] if warm_start else [])
    for text in texts:
        if not tokenizer.encode(text, add_special_tokens=False):
            return [f"the tokenizer of {model_path} encodes the task text {text!r} to no tokens"]
    return _data_problems(config, tokenizer)


def check_weights_finite(model_path: Path) -> None:
    """Refuse a checkpoint holding a NaN or Inf weight, naming the tensor and the file.

    Raises:
        ConfigError: ``"<file>: tensor <name> has N non-finite value(s)"`` and what to do.
    """
    for shard in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if not t.is_floating_point():
                    continue
                bad = int((~torch.isfinite(t.float())).sum())
                if bad:
                    raise ConfigError(
                        f"{shard}: tensor {name} has {bad} non-finite value(s) (NaN/Inf); the checkpoint is damaged: "
                        "re-download or re-export it"
                    )
