"""How samples flow from the rollout to the trainer, as run-configuration sections (NeMo-RL's names): the ``grpo``
section (prompts and samples per step, DAPO's dynamic sampling), the ``data`` sections, how the trainer batches the
samples (``policy.sequence_packing``, ``policy.dynamic_batching``), how far the rollout runs ahead of the trainer (``grpo.async_grpo``) and what a sample's reward becomes before its advantage
(``grpo.reward_scaling``, ``grpo.reward_shaping``); frozen dataclasses, re-exported by
:mod:`megatron_fp8.config.schema`.

A split names a local file (``data_path``) and its two columns; NeMo-RL's ``dataset_name`` with a ``data_path``
fills the columns and the held-out share NeMo-RL's dataset class uses (:mod:`megatron_fp8.config.nemo_rl.datasets`)
before these are built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_fp8 import vocab


@dataclass(frozen=True)
class DatasetConfig:
    """``data.train`` / ``data.validation``: a local JSONL or Parquet file of problems.

    Attributes:
        data_path: the file (``.jsonl``, ``.json`` or ``.parquet``); ``None`` = no dataset (the built-in
            ``grpo.task``).
        input_key: column holding the problem text (``a.b`` / ``a[0].b``: a path into nested values when the row
            has no column of that name).
        output_key: column holding the expected answer (a path as ``input_key``).
        max_samples: rows used (``None`` = all), taken before shuffling and before the validation hold-out.
        split_validation_size: rows of this file held out for validation (NeMo-RL's key): ``0`` = none, a
            fraction in ``(0, 1)`` (rounded up) or a row count ``>= 1``. Drawn as NeMo-RL draws them (Hugging Face
            ``train_test_split`` with ``seed``: the same rows of the same file), never trained on, and validated
            before any ``data.validation`` rows. ``data.train`` only.
        seed: seed of the hold-out draw (NeMo-RL's key; its files give ``${grpo.seed}``).
    """

    data_path: str | None = None
    input_key: str = "input"
    output_key: str = "output"
    max_samples: int | None = None
    split_validation_size: float = 0.0
    seed: int = 42


@dataclass(frozen=True)
class DataDefaultsConfig:
    """``data.default``: how every dataset's rows become prompts and rewards.

    Attributes:
        prompt_file: a text file with ``{}`` where the problem goes (``None`` = the problem as is); the result
            goes through the tokenizer's chat template when it has one. NeMo-RL's ``examples/prompts/*.txt``
            paths read NeMo-RL's own text when no such file exists here (:mod:`megatron_fp8.config.nemo_rl.prompts`).
        system_prompt_file: a text file, the system message of the chat template (``None`` = none).
        env_name: the reward: ``"math"`` (the final answer, boxed or plain, checked with ``math-verify``) or a
            Python entry point ``"module:function"`` called as ``function(prompt, response, answer) -> float``.
    """

    prompt_file: str | None = None
    system_prompt_file: str | None = None
    env_name: str = "math"


@dataclass(frozen=True)
class DataConfig:
    """``data`` (NeMo-RL names): the training and validation problems.

    Attributes:
        train: the training set; without ``data_path`` GRPO trains on ``grpo.task``.
        validation: the validation set. A dataset run that validates (``grpo.val_period`` or ``val_at_start``)
            needs validation rows: this file, rows held out of the training file
            (``train.split_validation_size``), or both (held-out rows first, as NeMo-RL merges them). Built-in task
            runs validate on task problems drawn with another seed.
        default: prompt template and reward.
        max_input_seq_length: longest prompt (tokens, after the template); longer rows are skipped and counted
            (refused when none is left). ``None`` = no limit.
        shuffle: shuffle the training rows with ``grpo.seed`` (a new order each epoch).
    """

    train: DatasetConfig = field(default_factory=DatasetConfig)
    validation: DatasetConfig | None = None
    default: DataDefaultsConfig = field(default_factory=DataDefaultsConfig)
    max_input_seq_length: int | None = None
    shuffle: bool = True


@dataclass(frozen=True)
class SequencePackingConfig:
    """``policy.sequence_packing`` (NeMo-RL's keys): every trainer pass packs the rows' real tokens into micro-batches
    of at most a token budget (:mod:`megatron_fp8.megatron.microbatch`), each sequence attending only to itself.

    Attributes:
        enabled: pack (exclusive with ``policy.dynamic_batching``).
        train_mb_tokens: tokens per training micro-batch at most (prompt + response of each row; the bin's length is
            then rounded up to the FP8 training recipe's multiple, as NeMo-RL does).
        logprob_mb_tokens: tokens per scoring micro-batch at most (the old-policy and reference passes).
        algorithm: NeMo-RL's bin packer (:data:`megatron_fp8.megatron.bins.PACKING_ALGORITHMS`).
        microbatch_order: ``"packer"`` (the packer's order) or ``"largest_first"`` (bins by length, longest first:
            the contents of each bin are unchanged).
    """

    enabled: bool = False
    train_mb_tokens: int | None = None
    logprob_mb_tokens: int | None = None
    algorithm: str = "modified_first_fit_decreasing"
    microbatch_order: str = "packer"


@dataclass(frozen=True)
class DynamicBatchingConfig:
    """``policy.dynamic_batching`` (NeMo-RL's keys): rows sorted by length and grouped up to a token budget, each
    micro-batch padded to its own longest row (rounded up to ``sequence_length_round``).

    Attributes:
        enabled: batch dynamically (exclusive with ``policy.sequence_packing``; one pipeline stage).
        train_mb_tokens: tokens per training micro-batch at most (rows x padded length).
        logprob_mb_tokens: tokens per scoring micro-batch at most.
        sequence_length_round: micro-batch lengths rounded up to a multiple of this (tokens).
    """

    enabled: bool = False
    train_mb_tokens: int | None = None
    logprob_mb_tokens: int | None = None
    sequence_length_round: int = 64


@dataclass(frozen=True)
class AsyncGRPOConfig:
    """``grpo.async_grpo`` (NeMo-RL's keys): the rollout ranks generate the next step's samples while the trainers
    train on this step's (separate rollout ranks only).

    Attributes:
        enabled: overlap rollout and training.
        max_trajectory_age_steps: the most updates a trained sample's generating weights may be behind the trainer's
            (``0``: every sample generated by the newest weights, the synchronous run). The rollout runs at most one
            step ahead, so ages are 0 or 1.
    """

    enabled: bool = False
    max_trajectory_age_steps: int = 1

    @property
    def ahead(self) -> int:
        """Steps the rollout runs ahead of the trainer: 1 when enabled with an age limit >= 1, else 0."""
        return 1 if self.enabled and self.max_trajectory_age_steps >= 1 else 0


@dataclass(frozen=True)
class RewardScalingConfig:
    """``grpo.reward_scaling`` (NeMo-RL's keys): each reward clamped to ``[source_min, source_max]`` and mapped linearly
    onto ``[target_min, target_max]`` before the advantages (:func:`megatron_fp8.rl.algorithm.shaping.scale_rewards`).
    """

    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0


@dataclass(frozen=True)
class RewardShapingConfig:
    """``grpo.reward_shaping`` (NeMo-RL's keys): DAPO's overlong penalty, after the scaling
    (:func:`megatron_fp8.rl.algorithm.shaping.shape_rewards`).

    Attributes:
        enabled: shape.
        overlong_buffer_length: tokens before ``max_response_length`` where the penalty grows from 0.
        overlong_buffer_penalty: the penalty at the buffer's end (>= 0), per buffer length of excess.
        max_response_length: the length the buffer ends at, tokens.
        stop_properly_penalty_coef: instead of the overlong penalty, a truncated response's reward times this
            (in ``[0, 1]``).
    """

    enabled: bool = False
    overlong_buffer_length: int | None = None
    overlong_buffer_penalty: float | None = None
    max_response_length: int | None = None
    stop_properly_penalty_coef: float | None = None


@dataclass(frozen=True)
class GRPOConfig:
    """``grpo``. Attributes:
    max_num_steps: training steps per arm (NeMo-RL's key; ``grpo.num_steps`` is its former spelling).
    num_prompts_per_step: prompts per step.
    num_generations_per_prompt: samples per prompt (the GRPO group size).
    seed: RNG seed (prompts, sampling, init).
    arms: which arms to run, keys of :data:`megatron_fp8.vocab.ARMS`.
    task: the verifiable toy task, a key of :data:`megatron_fp8.rl.data.task.TASKS` (``addition``, ``copy``).
    task_max_digits: operand / string length limit of the task (digits).
    updates_per_step: optimizer updates on each step's batch (PPO epochs; the first is on-policy).
    warm_start_steps: supervised steps on task answers before the arms (shared; 0 = none): a random-init
        model gets a policy RL can improve, as RL normally starts from a pretrained model.
    warm_start_learning_rate: learning rate of the warm-start steps.
    val_period: validate (accuracy on ``data.validation`` or held-out task problems) every N steps; 0 or below
        (NeMo-RL's files write -1) = never.
    val_at_start: also validate before the first step.
    max_val_samples: validation problems used (``None`` = all).
    normalize_rewards: divide each advantage by its group's reward standard deviation (where it is not 0).
    use_leave_one_out_baseline: each response's baseline (and standard deviation) is taken over the other
        responses of its group (RLOO) instead of the whole group.
    allow_no_effect: run although NeMo-RL keys that change the experiment have no effect here (warned).
    allow_over_memory: run although the memory plan per phase exceeds the GPU (``config.memory_plan``; warned).
    async_grpo: the rollout one step ahead of the trainer (separate rollout ranks).
    reward_scaling, reward_shaping: what the rewards become before the advantages (NeMo-RL's order).
    overlong_filtering: truncated responses out of the loss (still in their group's baseline).
    use_dynamic_sampling: DAPO's dynamic sampling: a step trains on ``num_prompts_per_step x
        num_generations_per_prompt`` samples whose group rewards vary, drawn from as many generation rounds of
        ``num_prompts_per_step x batch_multiplier`` prompts as it takes (:mod:`megatron_fp8.rl.sampling.dynamic`).
    batch_multiplier: prompts of one generation round, in multiples of ``num_prompts_per_step`` (dynamic sampling
        only; NeMo-RL's key).
    dynamic_sampling_max_gen_batches: generation rounds a step may take before the run stops with an error; as
        NeMo-RL counts them, a step still short after round ``max + 1`` stops.
    """

    max_num_steps: int = 20
    num_prompts_per_step: int = 8
    num_generations_per_prompt: int = 4
    seed: int = 0
    arms: tuple[str, ...] = tuple(vocab.ARMS)
    task: str = "addition"
    task_max_digits: int = 1
    updates_per_step: int = 1
    warm_start_steps: int = 0
    warm_start_learning_rate: float = 1.0e-3
    val_period: int = 0
    val_at_start: bool = False
    max_val_samples: int | None = None
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = False
    allow_no_effect: bool = False
    async_grpo: AsyncGRPOConfig = field(default_factory=AsyncGRPOConfig)
    reward_scaling: RewardScalingConfig = field(default_factory=RewardScalingConfig)
    reward_shaping: RewardShapingConfig = field(default_factory=RewardShapingConfig)
    overlong_filtering: bool = False
    use_dynamic_sampling: bool = False
    batch_multiplier: float = 1.0
    dynamic_sampling_max_gen_batches: int = 10
    allow_over_memory: bool = False

    @property
    def round_prompts(self) -> int:
        """Prompts of one generation round: ``num_prompts_per_step``, times ``batch_multiplier`` (rounded down, as
        NeMo-RL's ``int()``) with dynamic sampling."""
        if not self.use_dynamic_sampling:
            return self.num_prompts_per_step
        return int(self.num_prompts_per_step * self.batch_multiplier)
