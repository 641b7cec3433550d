"""Supervised warm start shared by every GRPO arm, saved as a Hugging Face checkpoint folder.

A randomly initialised toy model almost never earns a reward; a few supervised steps on the
task's answers give GRPO a policy whose rewards vary within a group, so advantages are non-zero.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_fp8.config.schema import RunConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.files import disk_guard
from megatron_fp8.megatron import (
    MegatronModel,
    build_megatron_model,
    export_hf_weights,
    make_optimizer,
    megatron_parallel,
    train_step,
)
from megatron_fp8.rl.algorithm.batch import Tokenizer, eos_and_pad, make_batch
from megatron_fp8.rl.data.problems import ProblemSource
from megatron_fp8.rl.driver.runtime import quiet_stdout, rollout_dtype_stream, trainer_dtype
from megatron_fp8.rl.state.outputs import OUT_FULL_FIX
from megatron_fp8.rl.state.results import WARM_START_DIR
from megatron_fp8.rollout.engines import Rollout

logger = logging.getLogger(__name__)

WARM_START_STEP_OFFSET = 1_000_000
"""Warm-start step ``i`` takes the problems of the source's step ``WARM_START_STEP_OFFSET + i``: for the built-in
task they differ from the GRPO problems; a dataset's rows are the same rows in another order."""


def save_hf_checkpoint(tensors: Mapping[str, torch.Tensor], source: Path, dest: Path) -> Path:
    """Write the trainer's weights as an HF folder: the source's config/tokenizer files + ``model.safetensors``.

    Args:
        tensors: HF-named weights (any dtype; written as they are).
        source: the HF checkpoint folder whose non-weight files are copied.
        dest: the folder to write (created).

    Returns:
        ``dest``.
    """
    tmp = dest / "model.safetensors.tmp"
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    with disk_guard(dest / "model.safetensors", needed=needed, kept="no partial weights file", fix=OUT_FULL_FIX):
        try:
            dest.mkdir(parents=True, exist_ok=True)
            for f in source.iterdir():
                if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
                    shutil.copy2(f, dest / f.name)
            save_file({n: t.detach().contiguous() for n, t in tensors.items()}, str(tmp), metadata={"format": "pt"})
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    tmp.replace(dest / "model.safetensors")
    return dest


def warm_start(
    config: RunConfig,
    model_path: Path,
    *,
    problems: ProblemSource,
    tokenizer: Tokenizer,
    out_dir: Path,
    on_step: Callable[[int, int, float], None] | None = None,
) -> tuple[Path, list[float]]:
    """Supervised warm start on the problems' answers, shared by every arm; saved as an HF checkpoint folder.

    ``grpo.warm_start_steps`` AdamW steps (lr ``grpo.warm_start_learning_rate``) of the mean
    negative log-likelihood of ``answer + EOS`` given the prompt, on fresh problems each step
    (seeded apart from the GRPO problems), ``num_prompts_per_step x num_generations_per_prompt``
    examples per step, BF16 recipe, the trainer's dtype (:func:`~megatron_fp8.rl.driver.runtime.trainer_dtype`;
    the checkpoint is written in BF16, as the base). Every model-parallel rank trains and exports; rank 0 writes.

    Args:
        config: the run configuration.
        model_path: the base checkpoint folder.
        problems: the run's problems (warm-start steps draw the source's steps from
            :data:`WARM_START_STEP_OFFSET` on, apart from the GRPO steps of a short run).
        tokenizer: the model's tokenizer.
        out_dir: the run's output folder.
        on_step: called after each step with ``(step, total steps, loss)`` (a progress bar); ``None``: one
            INFO line every few steps.

    Returns:
        ``(checkpoint folder, per-step loss)``; the folder is ``out_dir/warm_start``.

    Raises:
        ConfigError: the tokenizer has no EOS; a non-finite loss (naming the first non-finite weight, if any).
    """
    g = config.grpo
    eos, pad = eos_and_pad(tokenizer, where=model_path)
    batch_size = g.num_prompts_per_step * g.num_generations_per_prompt
    losses: list[float] = []
    path = out_dir / WARM_START_DIR
    torch.manual_seed(g.seed)
    with megatron_parallel(seed=g.seed):
        with quiet_stdout():
            model = build_megatron_model(model_path, recipe="bf16", dtype=trainer_dtype())
        optimizer = make_optimizer(model, lr=g.warm_start_learning_rate)
        for step in range(g.warm_start_steps):
            drawn = problems.step_problems(step=WARM_START_STEP_OFFSET + step, count=batch_size)
            prompts = [tokenizer.encode(p.prompt, add_special_tokens=False) for p in drawn]
            answers = [(*tokenizer.encode(p.answer, add_special_tokens=False), eos) for p in drawn]
            teacher = Rollout(
                token_ids=tuple(answers),
                logprobs=tuple(torch.zeros(len(a)) for a in answers),
                finished=tuple(True for _ in answers),
                engine="warm-start",
            )
            batch = make_batch(prompts, teacher, pad)
            mask = batch.response_mask.float()

            def nll(logp: torch.Tensor, mask: torch.Tensor = mask) -> torch.Tensor:
                """Mean negative log-likelihood of the answer tokens."""
                return -(logp * mask).sum() / mask.sum()

            try:
                result = train_step(
                    model, optimizer, nll, {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
                )
            except ConfigError as exc:
                raise ConfigError(f"warm start step {step + 1}: {exc}{_nonfinite_weight_hint(model)}") from exc
            losses.append(result.loss)
            if on_step is not None:
                on_step(step, g.warm_start_steps, result.loss)
            elif (step + 1) % max(1, g.warm_start_steps // 4) == 0 or step + 1 == g.warm_start_steps:
                logger.info("warm start step %d/%d: NLL %.3f", step + 1, g.warm_start_steps, result.loss)
        tensors = dict(
            rollout_dtype_stream(export_hf_weights(model))
        )  # BF16, as the base checkpoint  # collective over model-parallel ranks: every rank exports
        if not dist.is_initialized() or dist.get_rank() == 0:
            save_hf_checkpoint(tensors, model_path, path)
        if dist.is_initialized():
            dist.barrier()
    logger.info(
        "warm start: %d supervised steps, NLL %.3f -> %.3f per answer token; checkpoint %s",
        g.warm_start_steps,
        losses[0] if losses else float("nan"),
        losses[-1] if losses else float("nan"),
        path,
    )
    return path, losses


def _nonfinite_weight_hint(model: MegatronModel) -> str:
    """``"; weight X holds NaN/Inf"`` for the first non-finite trainer weight, ``""`` when all are finite."""
    for name, tensor in export_hf_weights(model):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"; weight {name} holds NaN/Inf: fix or re-download the checkpoint"
    return ""
