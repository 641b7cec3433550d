"""What the trainer's math really runs in, said one way everywhere: ``doctor``, the run log and the run's summary.

A recipe's application says whether its FP8 GEMMs run (:data:`~megatron_fp8.recipes.apply.MATH_MODES`: ``fp8``,
``bf16``, ``bf16-emulated`` without a GPU, ``unchecked``); the trainer's dtype says what the rest runs in. The GRPO
trainer runs in ``policy.precision`` on a GPU (BF16 by default, or FP16 / float32) and in float32 on a CPU
(:func:`trainer_dtype_name`: a CPU without AVX512-BF16 / AMX has no fast BF16 GEMM), so on this CPU an FP8 recipe
is ``fp32-emulated``, not ``bf16-emulated``. FP16 on a CPU is emulated: float32 math, the weights rounded to FP16
after every update, Megatron-Core's dynamic loss scale (``fp32 (fp16 weights)``). :func:`math_label` is the short
form (the summary's training column, ``metrics.jsonl``'s ``training_math``) and :func:`precision_sentence` the
sentence built from it; ``doctor``, the model-build log line and ``summary.md`` all print that sentence, so they
cannot disagree. No torch: dtypes are named (``"float32"``, ``"bfloat16"``, ``"float16"``).
"""

from __future__ import annotations

TRAINER_DTYPES: dict[bool, str] = {True: "bfloat16", False: "float32"}
"""The GRPO trainer's default parameter / compute dtype by whether a CUDA GPU is there
(``rl.driver.runtime.trainer_dtype``): BF16 on a GPU; float32 on a CPU, where a BF16 matmul takes ~50x the float32
time on the 2-core CI machine."""

_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_WORDS = {"fp32": "float32", "bf16": "BF16", "fp16": "FP16"}


def trainer_dtype_name(*, has_gpu: bool, precision: str = "bfloat16") -> str:
    """The GRPO trainer's dtype name: ``policy.precision`` (``"bfloat16"``, ``"float16"``, ``"float32"``) on a
    GPU, ``"float32"`` on a CPU (:data:`TRAINER_DTYPES`; FP16 there is emulated: :func:`rounded_dtype_name`)."""
    return precision if has_gpu else TRAINER_DTYPES[False]


def rounded_dtype_name(*, has_gpu: bool, precision: str = "bfloat16") -> str | None:
    """The dtype a float32 CPU trainer rounds its weights to (``"float16"`` for ``policy.precision: float16``: FP16
    emulated), else ``None`` (a GPU holds the weights in that dtype; BF16 on a CPU is not rounded)."""
    return "float16" if precision == "float16" and not has_gpu else None


def math_label(math: str, dtype: str, *, rounded: str | None = None) -> str:
    """The short form: the recipe's ``math`` with its BF16 replaced by what the trainer's ``dtype`` really runs.

    Args:
        math: :attr:`~megatron_fp8.recipes.apply.RecipeApplication.math` (``fp8``, ``bf16``, ``bf16-emulated``,
            ``unchecked``).
        dtype: the trainer's dtype name, with or without ``torch.`` (``float32``, ``bfloat16``, ``float16``).
        rounded: the dtype a float32 trainer rounds its weights to (:func:`rounded_dtype_name`; ``None``: none).

    Returns:
        ``fp8``, ``bf16``, ``fp16``, ``fp32``, ``bf16-emulated``, ``fp16-emulated``, ``fp32-emulated``, or
        ``"<label> (<dtype> weights)"``: ``fp8 (fp32 weights)``, ``fp32 (fp16 weights)`` (FP16 emulated on a CPU),
        ``fp32-emulated (fp16 weights)``.
    """
    short = _SHORT.get(dtype.removeprefix("torch."), "bf16")
    weights = f" ({_SHORT.get(rounded.removeprefix('torch.'), rounded)} weights)" if rounded else ""
    if math == "bf16":
        return short + weights
    if math == "bf16-emulated":
        return f"{short}-emulated{weights}"
    return math if short == "bf16" else f"{math} ({short} weights)"


def precision_sentence(*, recipe: str | None, label: str) -> str:
    """The one sentence on a training run's precision, from :func:`math_label`'s ``label``.

    Args:
        recipe: the training recipe's name (``None``: any FP8 recipe).
        label: :func:`math_label`'s answer.

    Example: ``precision_sentence(recipe="blockwise", label="fp32-emulated")`` is "training recipe blockwise: no
    CUDA GPU, so its FP8 fields are validated and recorded and the math runs in float32 (fp32-emulated)".
    """
    main, _, weights = label.partition(" (")
    rounded = weights.removesuffix(" weights)")
    if rounded in _WORDS and main.removesuffix("-emulated") in _WORDS:  # a float32 trainer rounding its weights
        how = _how(main) + f", the weights rounded to {_WORDS[rounded]} after every update ({_WORDS[rounded]} emulated)"
    else:
        how = _how(label)
    return f"{f'training recipe {recipe}' if recipe else 'any FP8 training recipe'}: {how} ({label})"


def _how(label: str) -> str:
    base = label.removesuffix("-emulated")
    if label == "fp8":
        return "the GEMMs run in FP8 through TransformerEngine"
    if label in _WORDS:
        return f"no FP8: the math runs in {_WORDS[label]}"
    if label.endswith("-emulated") and base in _WORDS:
        return f"no CUDA GPU, so its FP8 fields are validated and recorded and the math runs in {_WORDS[base]}"
    if label.startswith("unchecked"):
        return "the capability check was skipped: FP8 GEMMs if TransformerEngine accepts the recipe"
    weights = label.partition(" (")[2].removesuffix(" weights)")  # fp8 (fp32 weights), fp8 (fp16 weights)
    return f"the GEMMs run in FP8 through TransformerEngine, the weights in {_WORDS.get(weights, 'float32')}"


def cpu_fp8_sentence(recipe: str | None = None) -> str:
    """:func:`precision_sentence` of an FP8 recipe in the GRPO trainer on a machine without a CUDA GPU."""
    return precision_sentence(recipe=recipe, label=math_label("bf16-emulated", trainer_dtype_name(has_gpu=False)))
