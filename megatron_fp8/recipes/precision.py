"""What the trainer's math really runs in, said one way everywhere: ``doctor``, the run log and the run's summary.

A recipe's application says whether its FP8 GEMMs run (:data:`~megatron_fp8.recipes.apply.MATH_MODES`: ``fp8``,
``bf16``, ``bf16-emulated`` without a GPU, ``unchecked``); the trainer's dtype says what the rest runs in. The GRPO
trainer runs in BF16 on a GPU and in float32 on a CPU (:data:`TRAINER_DTYPES`: a CPU without AVX512-BF16 / AMX has
no fast BF16 GEMM), so on this CPU an FP8 recipe is ``fp32-emulated``, not ``bf16-emulated``. :func:`math_label` is
the short form (the summary's training column, ``metrics.jsonl``'s ``training_math``) and
:func:`precision_sentence` the sentence built from it; ``doctor``, the model-build log line and ``summary.md`` all
print that sentence, so they cannot disagree. No torch: dtypes are named (``"float32"``, ``"bfloat16"``).
"""

from __future__ import annotations

TRAINER_DTYPES: dict[bool, str] = {True: "bfloat16", False: "float32"}
"""The GRPO trainer's parameter / compute dtype by whether a CUDA GPU is there (``rl.driver.runtime.trainer_dtype``):
BF16 on a GPU; float32 on a CPU, where a BF16 matmul takes ~50x the float32 time on the 2-core CI machine."""

_SHORT = {"float32": "fp32", "bfloat16": "bf16"}
_WORDS = {"fp32": "float32", "bf16": "BF16"}


def trainer_dtype_name(*, has_gpu: bool) -> str:
    """The GRPO trainer's dtype name (``"bfloat16"`` or ``"float32"``), :data:`TRAINER_DTYPES`."""
    return TRAINER_DTYPES[has_gpu]


def math_label(math: str, dtype: str) -> str:
    """The short form: the recipe's ``math`` with its BF16 replaced by what the trainer's ``dtype`` really runs.

    Args:
        math: :attr:`~megatron_fp8.recipes.apply.RecipeApplication.math` (``fp8``, ``bf16``, ``bf16-emulated``,
            ``unchecked``).
        dtype: the trainer's dtype name, with or without ``torch.`` (``float32``, ``bfloat16``).

    Returns:
        ``fp8``, ``bf16``, ``fp32``, ``bf16-emulated``, ``fp32-emulated``, or ``"<math> (fp32 weights)"``.
    """
    short = _SHORT.get(dtype.removeprefix("torch."), "bf16")
    if math == "bf16":
        return short
    if math == "bf16-emulated":
        return f"{short}-emulated"
    return math if short == "bf16" else f"{math} ({short} weights)"


def precision_sentence(*, recipe: str | None, label: str) -> str:
    """The one sentence on a training run's precision, from :func:`math_label`'s ``label``.

    Args:
        recipe: the training recipe's name (``None``: any FP8 recipe).
        label: :func:`math_label`'s answer.

    Example: ``precision_sentence(recipe="blockwise", label="fp32-emulated")`` is "training recipe blockwise: no
    CUDA GPU, so its FP8 fields are validated and recorded and the math runs in float32 (fp32-emulated)".
    """
    base = label.removesuffix("-emulated")
    if label == "fp8":
        how = "the GEMMs run in FP8 through TransformerEngine"
    elif label in _WORDS:
        how = f"no FP8: the math runs in {_WORDS[label]}"
    elif label.endswith("-emulated") and base in _WORDS:
        how = f"no CUDA GPU, so its FP8 fields are validated and recorded and the math runs in {_WORDS[base]}"
    elif label.startswith("unchecked"):
        how = "the capability check was skipped: FP8 GEMMs if TransformerEngine accepts the recipe"
    else:
        how = "the GEMMs run in FP8 through TransformerEngine, the weights in float32"  # fp8 (fp32 weights)
    return f"{f'training recipe {recipe}' if recipe else 'any FP8 training recipe'}: {how} ({label})"


def cpu_fp8_sentence(recipe: str | None = None) -> str:
    """:func:`precision_sentence` of an FP8 recipe in the GRPO trainer on a machine without a CUDA GPU."""
    return precision_sentence(recipe=recipe, label=math_label("bf16-emulated", trainer_dtype_name(has_gpu=False)))
