"""GRPO run outputs: the JSONL reader, the markdown summary table and the PNG plot.

* ``metrics.jsonl`` (written step by step by :func:`megatron_fp8.rl.driver.grpo.run_grpo`): one JSON
  object per step and arm, see :meth:`megatron_fp8.rl.state.results.StepMetrics.to_json_dict`;
  :func:`read_metrics` reads it back.
* ``summary.md`` (:func:`write_summary`): per arm the first / last / best mean reward, the mean
  ``gen_kl`` (KL(pi_rollout || pi_train) per token, k3 estimator), the mean
  ``token_mult_prob_error`` (one table), the refit payload per step (FP8 / scales / BF16, MiB) and the mean
  refit time (a second table); the header says how the FP8 manifest was obtained, kept when the summary is
  rebuilt (:func:`manifest_line`).
* ``metrics.png`` (:func:`plot_metrics`): reward, ``gen_kl``, IS-weight spread and the fraction of
  tokens token-TIS truncates, per step, one line per arm (matplotlib, Agg backend: no display needed).
"""

from __future__ import annotations

import io
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

from megatron_fp8.config.schema import RunConfig
from megatron_fp8.errors import ConfigError
from megatron_fp8.files import write_atomically
from megatron_fp8.recipes.precision import precision_sentence
from megatron_fp8.rl.state.results import ArmResult, JSONRecord

logger = logging.getLogger(__name__)

MIB = float(1 << 20)

ARM_COLORS: dict[str, str] = {"bf16": "tab:blue", "fp8": "tab:red", "fp8_tis": "tab:green"}
"""Plot colour per arm (other names get matplotlib's cycle)."""


def read_metrics(path: str | Path) -> list[JSONRecord]:
    """Read ``metrics.jsonl``.

    Returns:
        One dict per line, in file order.

    Raises:
        ConfigError: missing file or a line that is not JSON (the message names the line).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such metrics file; run `megatron-fp8 grpo --out {p.parent}` first")
    rows = []
    for number, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p}:{number}: not a JSON line ({exc})") from exc
    return rows


def _problems_line(config: RunConfig) -> str:
    """What the run trained on: the dataset and its reward, or the built-in task."""
    data = config.data
    if data.train.data_path:
        return f"data: `{data.train.data_path}` ({data.train.input_key} -> {data.train.output_key}), reward `{data.default.env_name}`"
    return f"task: `{config.grpo.task}` (max {config.grpo.task_max_digits} digit(s))"


def _fmt(value: float, spec: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


MANIFEST_PREFIX = "- FP8 manifest: "
"""How the summary's header line on the FP8 manifest starts."""


def manifest_line(summary: str | Path) -> str:
    """How the FP8 manifest of a run was obtained, from its ``summary.md`` (``""`` when it has no such line or no
    file): a rebuilt summary keeps it (the manifest is asked of vLLM during the run, not recorded per step)."""
    try:
        text = Path(summary).read_text()
    except (OSError, UnicodeDecodeError):
        return ""
    found = [line.removeprefix(MANIFEST_PREFIX) for line in text.splitlines() if line.startswith(MANIFEST_PREFIX)]
    return found[0] if found else ""


def summary_table(arms: Sequence[ArmResult]) -> str:
    """The per-arm markdown tables (see the module docstring for the columns): rewards and mismatch, then the refit
    payload per step, each narrow enough to read as text."""
    lines = [
        "| arm | engine | training | reward first / last / best | mean gen_kl | token_mult_prob_error |",
        "|---|---|---|---|---|---|",
    ]
    for a in arms:
        rewards = " / ".join(_fmt(v, ".3f") for v in (a.first_reward, a.last_reward, a.best_reward))
        lines.append(
            f"| {a.arm} | {a.engine} | {a.training_recipe} ({a.training_math}) | {rewards} | "
            f"{_fmt(a.mean_gen_kl, '.2e')} | {_fmt(a.mean_token_mult_prob_error, '.4f')} |"
        )
    lines += [
        "",
        "| arm | refit FP8 MiB | refit scales MiB | refit BF16 MiB | refit total MiB | refit s |",
        "|---|---|---|---|---|---|",
    ]
    for a in arms:
        b = a.mean_refit_bytes
        lines.append(
            f"| {a.arm} | {_fmt(b['fp8'] / MIB, '.3f')} | {_fmt(b['scales'] / MIB, '.4f')} | "
            f"{_fmt(b['bf16'] / MIB, '.3f')} | {_fmt(b['total'] / MIB, '.3f')} | {_fmt(a.mean_refit_seconds, '.3f')} |"
        )
    return "\n".join(lines) + "\n"


def terminal_table(arms: Sequence[ArmResult], *, partial: str | None = None) -> str:
    """The per-arm headline in 80 columns, for the terminal (``summary.md`` holds every column): rewards first,
    last and best, mean gen_kl, refit MiB (FP8 part and total) and seconds per step."""
    lines = [f"partial: {partial}"] if partial else []
    lines += ["| arm | reward first/last/best | mean gen_kl | refit MiB fp8/total | refit s |", "|---|---|---|---|---|"]
    for a in arms:
        b = a.mean_refit_bytes
        rewards = " / ".join(_fmt(v, ".3f") for v in (a.first_reward, a.last_reward, a.best_reward))
        lines.append(
            f"| {a.arm} | {rewards} | {_fmt(a.mean_gen_kl, '.2e')} | "
            f"{_fmt(b['fp8'] / MIB, '.2f')} / {_fmt(b['total'] / MIB, '.2f')} | {_fmt(a.mean_refit_seconds, '.3f')} |"
        )
    return "\n".join(lines)


def write_summary(
    arms: Sequence[ArmResult],
    path: str | Path,
    *,
    config: RunConfig | None = None,
    manifest_source: str = "",
    partial: str | None = None,
) -> Path:
    """Write ``summary.md``: a short header about the run and :func:`summary_table`.

    Args:
        arms: the arm results, in run order.
        path: output file.
        config: the run configuration (model, task, sizes for the header).
        manifest_source: how the FP8 manifest was obtained.
        partial: why the run ended before its last step (the table then holds the completed steps only).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    p = Path(path)
    lines = ["# GRPO: BF16 vs FP8 rollout", ""]
    if partial:
        lines += [f"**Partial: {partial}.** The table holds the completed steps only.", ""]
    if config is not None:
        g, gen, opt = config.grpo, config.policy.generation, config.policy.megatron_cfg.optimizer
        steps = max((len(a.steps) for a in arms), default=0)
        corrected = [a.arm for a in arms if any(m.is_applied for m in a.steps)]  # the arms this run corrected
        cap = f"cap C={config.loss_fn.is_cap:g}" if config.loss_fn.is_cap is not None else "no truncation cap"
        lines += [
            f"- model: `{config.model.name_or_path}`; {_problems_line(config)}",
            f"- {steps} step(s) x {g.num_prompts_per_step} prompts x {g.num_generations_per_prompt} generations, "
            f"max {gen.max_new_tokens} new tokens, temperature {gen.temperature}, lr {opt.lr:g}, seed {g.seed}",
            f"- correction of arm(s) {', '.join(corrected)}: `{config.loss_fn.is_variant}` with {cap}"
            if corrected
            else "- no arm corrected the train/rollout mismatch (no importance-sampling weights)",
        ]
    trained = dict.fromkeys((a.training_recipe, a.training_math) for a in arms if a.training_recipe != "n/a")
    lines += [f"- {precision_sentence(recipe=recipe, label=label)}" for recipe, label in trained]
    if manifest_source:
        lines.append(f"{MANIFEST_PREFIX}{manifest_source}")
    if any(a.engine.startswith("reference") for a in arms):
        lines.append(
            "- `reference-*` engines are the CPU emulator of vLLM's FP8 W8A8 blockwise numerics "
            "(BF16 for the bf16 arm), not vLLM itself"
        )
    lines += [
        "- gen_kl: KL(pi_rollout || pi_train) per response token (k3 estimator) between the rollout engine's "
        "and the trainer's log-probabilities of the sampled tokens; refit columns: payload per step",
        "",
        summary_table(arms),
    ]
    return write_atomically(p, "\n".join(lines))


SMOOTH_WINDOW = 5
"""Steps in the trailing mean drawn over the per-step rewards (every arm sees the same prompts, so the
per-step curves share the prompts' difficulty; the trailing mean shows the trend)."""


def _floor(value: float) -> float:
    """A value for a log axis: at least 1e-12 (NaN stays NaN: a gap in the line)."""
    return value if math.isnan(value) else max(value, 1e-12)


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_metrics(
    arms: Sequence[ArmResult], path: str | Path, *, is_cap: float | None = 2.0, partial: str | None = None
) -> Path:
    """Write ``metrics.png``, four panels per step, one line per arm.

    * mean reward (faint) and its trailing mean;
    * ``gen_kl`` (log scale): how far the rollout's token distribution is from the trainer's;
    * the spread of the token IS weights ``w = pi_train / pi_rollout``: mean ``|log w|`` per token (log scale);
    * the largest ``|log w|`` of the step against ``log C`` of the TIS cap (``loss_fn.is_cap``, default 2), with
      the fraction of tokens token TIS truncates (``w > C``) in the legend: it enters the loss only in the
      ``fp8_tis`` arm; the other arms show what it would clip.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    import matplotlib  # lazy: importing matplotlib costs ~0.5 s and only the plot needs it

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # lazy: after choosing the Agg backend above
    from matplotlib.ticker import MaxNLocator

    p = Path(path)
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), dpi=100)
    (ax_r, ax_k), (ax_w, ax_t) = axes
    try:
        for a in arms:
            steps = [s.step for s in a.steps]
            color = ARM_COLORS.get(a.arm)
            rewards = [s.reward_mean for s in a.steps]
            ax_r.plot(steps, rewards, marker="o", ms=2, lw=0.8, alpha=0.35, color=color)
            ax_r.plot(
                steps,
                rolling_mean(rewards, SMOOTH_WINDOW),
                lw=2.2,
                label=f"{a.arm} ({SMOOTH_WINDOW}-step mean)",
                color=color,
            )
            kl = [s.gen_kl for s in a.steps]
            ax_k.plot(steps, [max(v, 1e-12) for v in kl], marker="o", ms=3, label=a.arm, color=color)
            spread = [s.mismatch.get("logp_abs_diff_mean", math.nan) for s in a.steps]
            ax_w.plot(steps, [_floor(v) for v in spread], marker="o", ms=3, label=a.arm, color=color)
            worst = [s.mismatch.get("logp_abs_diff_max", math.nan) for s in a.steps]
            truncated = 100.0 * sum(s.is_truncated_fraction for s in a.steps) / max(len(a.steps), 1)
            applied = "in the loss" if a.steps and a.steps[0].is_applied else "not applied"
            label = f"{a.arm}: {truncated:.2f}% of tokens w > C ({applied})"
            ax_t.plot(steps, [_floor(v) for v in worst], marker="o", ms=3, label=label, color=color)
        ax_r.set_title("mean reward per step (faint) and its trailing mean")
        ax_r.set_ylabel("reward")
        ax_k.set_title("gen_kl = KL(rollout || train) per token")
        ax_k.set_yscale("log")
        ax_w.set_title("IS-weight spread: mean |log w| per token, w = p_train / p_rollout")
        ax_w.set_yscale("log")
        if is_cap is not None:
            ax_t.axhline(math.log(is_cap), color="black", ls=":", lw=1.2, label=f"log C (TIS cap C={is_cap:g})")
        ax_t.set_title("largest |log w| of the step vs the TIS cap")
        ax_t.set_yscale("log")
        for ax in (ax_r, ax_k, ax_w, ax_t):
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        steps = max((len(a.steps) for a in arms), default=0)
        title = f"GRPO, BF16 vs FP8 rollout: {', '.join(a.arm for a in arms)}; {steps} step(s) per arm"
        fig.suptitle(title + (f" (partial: {partial})" if partial else ""), fontsize=12)
        # fixed margins for the 12 x 7.5 in figure: tight_layout measures every tick label (~0.5 s of a 1 s plot)
        fig.subplots_adjust(left=0.07, right=0.985, bottom=0.07, top=0.9, wspace=0.2, hspace=0.33)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        write_atomically(p, buffer.getvalue())
    finally:
        plt.close(fig)
    return p
