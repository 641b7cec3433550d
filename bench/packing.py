#!/usr/bin/env python
"""The train phase's cost per micro-batch layout: padded rows vs dynamic batching vs sequence packing, side by side.

What a GRPO step's trainer runs (:func:`megatron_fp8.rl.driver.phases.train_phase`): one no-grad scoring pass of the
old policy (:func:`~megatron_fp8.megatron.step.sequence_logprobs`) and one :func:`~megatron_fp8.megatron.step.train_step`
with a token-mean loss over the response tokens, each micro-batch returning its exact share (its rows' sum over the
batch's response tokens). The batch is length-skewed like a rollout: ``--rows`` rows, each a prompt of 16..32 tokens
and a response drawn long-tailed over ``--min-response``..``--max-response`` (a truncated Pareto draw, alpha 1: most
short, a few long; the longest row always hits ``--max-response``, as a response that ran to ``max_new_tokens``),
right-padded to the longest row. The three layouts (:mod:`megatron_fp8.megatron.microbatch`):

* ``padded``: ``--micro-rows`` rows per micro-batch, each as long as the batch (``policy.train_micro_batch_size``);
* ``dynamic``: NeMo-RL's dynamic batching, ``--tokens`` per micro-batch, lengths rounded to ``--round``;
* ``packed``: NeMo-RL's sequence packing, bins of ``--tokens``, modified first-fit decreasing, no rounding (what the
  trainer uses without FP8).

Each layout runs on its own copy of the embedded tiny model (``fp32``, built from the same checkpoint: the same
fresh weights; each copy then takes the same updates), one warm-up and ``--repeats`` timed passes, the layouts
interleaved within each repeat so drift hits all three alike; the median is reported. The warm-up pass, on the
identical fresh weights, is also the exactness check: the dynamic and packed scoring log-probs against the padded
ones on the response positions (max abs difference), the loss and gradient norm of the step (relative difference)
and the weights after it (reported only: see :data:`GATED`); over 1e-4 logs a warning (the bench does not fail
on it).

A packed micro-batch's attention computes each sequence's own scores only (``n^2`` per sequence: TransformerEngine's
THD attention on a GPU, the local attention over each sequence alone on a CPU, patch 6 of the adapter); rows and
dynamic micro-batches compute ``t^2`` per row; the JSON counts these attention scores next to the tokens.

Example::

    python bench/packing.py --out bench/results/packing.json   # also writes bench/results/packing.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_fp8.megatron import build_megatron_model, make_optimizer, megatron_parallel
from megatron_fp8.megatron.microbatch import BatchLayout, MicroBatch, TokenTally, plan_micro_batches
from megatron_fp8.megatron.step import sequence_logprobs, train_step
from megatron_fp8.models import tiny_model_path

logger = logging.getLogger("bench.packing")

LAYOUTS = ("padded", "dynamic", "packed")
"""The layouts compared, in table order (``padded`` is the reference of the ratios)."""
PROMPT_TOKENS = (16, 32)
"""Prompt length range (inclusive)."""
EXACT_BOUND = 1e-4
"""Exactness differences over this log a warning (float32: ~1e-6 expected)."""
GATED = ("logprob_max_abs_diff", "loss_rel_diff", "grad_norm_rel_diff")
"""The differences held to :data:`EXACT_BOUND`. The weights after the step are reported only: Adam's first step
moves each weight by about ``lr * sign(g)``, so a gradient element near 0 whose float32 sum changes sign with the
summation order moves by up to ``2 * lr`` either way."""
PAD_ID = 3
"""The tiny model's ``pad_token_id``: padding and the fill of packed bins (never scored)."""
LR = 1e-3


# ----------------------------------------------------------------------------- the batch


def response_lengths(rows: int, low: int, high: int, generator: torch.Generator) -> list[int]:
    """``rows`` lengths in ``[low, high]``, truncated Pareto (alpha 1: ``P(L > x) = low / x``); the first is ``high``."""
    u = 1.0 - torch.rand(rows, generator=generator, dtype=torch.float64)  # (0, 1]
    lengths = [min(high, max(low, int(low / float(x)))) for x in u]
    lengths[0] = high  # the response that ran to the limit: the batch's padded length
    return lengths


def make_batch(
    rows: int, min_response: int, max_response: int, vocab: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, response)``: ``[B, T]`` right-padded rows, 1 on real tokens, 1 on response
    tokens. The rows are shuffled (the long one not first)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1, (rows,), generator=g).tolist()
    responses = response_lengths(rows, min_response, max_response, g)
    order = torch.randperm(rows, generator=g).tolist()
    responses = [responses[i] for i in order]
    t = max(p + r for p, r in zip(prompts, responses, strict=True))
    ids = torch.full((rows, t), PAD_ID, dtype=torch.int64)
    mask = torch.zeros(rows, t, dtype=torch.int64)
    response = torch.zeros(rows, t, dtype=torch.int64)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, : p + r] = torch.randint(4, vocab, (p + r,), generator=g)
        mask[i, : p + r] = 1
        response[i, p : p + r] = 1
    return ids, mask, response


# ----------------------------------------------------------------------------- layouts and counts


def layouts(micro_rows: int, tokens: int, round_to: int) -> dict[str, dict[str, object]]:
    """Per layout the keyword arguments of ``sequence_logprobs`` and ``train_step`` (score / train)."""
    dynamic = BatchLayout(kind="dynamic", tokens=tokens, round_to=round_to, key="--tokens")
    packed = BatchLayout(kind="packed", tokens=tokens, algorithm="modified_first_fit_decreasing", key="--tokens")
    return {
        "padded": {"score": {"batch_size": micro_rows}, "train": {"micro_batch_size": micro_rows}},
        "dynamic": {"score": {"layout": dynamic}, "train": {"layout": dynamic}},
        "packed": {"score": {"layout": packed}, "train": {"layout": packed}},
    }


def _plan(ids: torch.Tensor, mask: torch.Tensor, kwargs: dict[str, object]) -> list[MicroBatch]:
    layout = kwargs.get("layout") or BatchLayout(kind="rows", rows=kwargs.get("micro_batch_size"))
    return plan_micro_batches(ids, mask, layout, pad_id=PAD_ID)


def attention_scores(plan: list[MicroBatch]) -> tuple[int, int]:
    """``(computed, real)`` attention scores of a pass per head and layer: ``b x t^2`` per rows / dynamic micro-batch,
    each sequence's ``n^2`` in a packed one (its fill a sequence of its own), against ``n^2`` per sequence alone."""
    computed = sum(
        int(((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).long() ** 2).sum())
        if mb.cu_seqlens is not None
        else mb.input_ids.shape[0] * mb.input_ids.shape[1] ** 2
        for mb in plan
    )
    real = sum(n * n for mb in plan for n in mb.lengths)
    return computed, real


def token_mean_share(response: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The token-mean loss over the batch's response tokens; with ``rows``, that micro-batch's exact share."""
    scored = response[:, 1:].float()  # position j scores token j + 1
    total = scored.sum().clamp(min=1.0)

    def loss(logprobs: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        part = scored if rows is None else scored[rows]
        return -(logprobs * part).sum() / total

    return loss


# ----------------------------------------------------------------------------- one pass


def train_pass(
    arm: dict[str, object], ids: torch.Tensor, mask: torch.Tensor, response: torch.Tensor, tally: TokenTally
) -> dict[str, object]:
    """Score (no grad) then one train step, timed; the log-probs and the step's result."""
    m, optimizer, kw = arm["model"], arm["optimizer"], arm["kwargs"]
    t0 = time.perf_counter()
    with torch.no_grad():
        logp = sequence_logprobs(m, ids, attention_mask=mask, tally=tally, pad_id=PAD_ID, **kw["score"])
    t1 = time.perf_counter()
    batch = {"input_ids": ids, "attention_mask": mask}
    result = train_step(m, optimizer, token_mean_share(response), batch, tally=tally, pad_id=PAD_ID, **kw["train"])
    t2 = time.perf_counter()
    return {"logp": logp, "result": result, "score_s": t1 - t0, "train_s": t2 - t1}


def _weights(m) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.model[0].parameters()])


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


# ----------------------------------------------------------------------------- the run


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _load_average() -> float | None:
    """The 1-minute load average (``None`` where the OS has none): other work on the cores skews the timings."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run(
    *,
    rows: int = 64,
    min_response: int = 16,
    max_response: int = 256,
    micro_rows: int = 8,
    tokens: int = 2048,
    round_to: int = 64,
    repeats: int = 3,
    warmup: int = 1,
    seed: int = 0,
) -> dict:
    """Time each layout (see the module docstring); returns the JSON summary."""
    if warmup < 1 or repeats < 1:
        raise ValueError("warmup and repeats must be >= 1")
    kwargs = layouts(micro_rows, tokens, round_to)
    load_start = _load_average()
    if load_start is not None and load_start > 0.5 * (os.cpu_count() or 1):
        logger.warning(
            "load average %.2f on %s cores before the run: other work skews the timings", load_start, os.cpu_count()
        )
    with megatron_parallel(seed=seed):
        arms: dict[str, dict[str, object]] = {}
        for name in LAYOUTS:
            m = build_megatron_model(tiny_model_path("dense"), dtype="fp32")
            arms[name] = {"model": m, "optimizer": make_optimizer(m, lr=LR), "kwargs": kwargs[name]}
        first = _weights(arms["padded"]["model"])
        same_weights = all(torch.equal(first, _weights(a["model"])) for a in arms.values())
        vocab = arms["padded"]["model"].vocab_size
        ids, mask, response = make_batch(rows, min_response, max_response, vocab, seed)
        real_tokens = int(mask.sum())
        logger.info(
            "batch: %d rows x %d tokens, %d real (%d response); micro-batches of %d rows / %d tokens; %d torch threads",
            rows,
            ids.shape[1],
            real_tokens,
            int(response.sum()),
            micro_rows,
            tokens,
            torch.get_num_threads(),
        )

        tallies = {name: TokenTally() for name in LAYOUTS}
        warm = {name: train_pass(arms[name], ids, mask, response, tallies[name]) for name in LAYOUTS}
        for _ in range(warmup - 1):
            for name in LAYOUTS:
                train_pass(arms[name], ids, mask, response, TokenTally())
        exactness = _exactness(warm, arms, response, same_weights)

        times: dict[str, dict[str, list[float]]] = {n: {"total": [], "score": [], "train": []} for n in LAYOUTS}
        for i in range(repeats):
            for name in LAYOUTS:
                out = train_pass(arms[name], ids, mask, response, TokenTally())
                times[name]["score"].append(out["score_s"])
                times[name]["train"].append(out["train_s"])
                times[name]["total"].append(out["score_s"] + out["train_s"])
                logger.info("repeat %d/%d %-8s %.3f s", i + 1, repeats, name, times[name]["total"][-1])

    per_layout: dict[str, dict] = {}
    for name in LAYOUTS:
        tally = tallies[name]  # the warm-up's two passes (score + train): computed / real is each pass's
        score_plan, train_plan = _plan(ids, mask, kwargs[name]["score"]), _plan(ids, mask, kwargs[name]["train"])
        att_computed, att_real = attention_scores(train_plan)
        per_layout[name] = {
            "layout": _describe(kwargs[name]["train"]),
            "micro_batches": {"score": len(score_plan), "train": len(train_plan)},
            "tokens": {
                "computed": tally.computed,
                "real": tally.real,
                "computed_over_real": tally.computed / tally.real,
                "padding_share": tally.padding_share,
                "passes": 2,  # the scoring pass and the train step's
            },
            "attention_scores_per_pass": {
                "computed": att_computed,
                "real": att_real,
                "computed_over_real": att_computed / att_real,
            },
            "median_seconds": statistics.median(times[name]["total"]),
            "median_score_seconds": statistics.median(times[name]["score"]),
            "median_train_seconds": statistics.median(times[name]["train"]),
            "seconds": times[name]["total"],
        }
    padded = per_layout["padded"]["median_seconds"]
    for r in per_layout.values():
        r["speedup_vs_padded"] = padded / r["median_seconds"]
    lengths = (response.sum(dim=1)).tolist()
    return {
        "bench": "train phase (score + train step) per micro-batch layout, embedded tiny model, fp32, one process",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "device": "cpu",
            "cpu": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_1min": {"start": load_start, "end": _load_average()},
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "settings": {
            "rows": rows,
            "prompt_tokens": list(PROMPT_TOKENS),
            "min_response": min_response,
            "max_response": max_response,
            "response_draw": "truncated Pareto alpha 1 over [min, max], one row at max",
            "micro_rows": micro_rows,
            "tokens": tokens,
            "round_to": round_to,
            "packing_algorithm": "modified_first_fit_decreasing",
            "repeats": repeats,
            "warmup": warmup,
            "seed": seed,
            "model": "tiny dense (Qwen3-shaped), fp32",
            "optimizer": f"MegatronDDPAdam lr {LR:g}",
            "loss": "token mean over response tokens, exact micro-batch shares",
        },
        "batch": {
            "rows": rows,
            "padded_length": ids.shape[1],
            "real_tokens": real_tokens,
            "response_tokens": int(response.sum()),
            "response_lengths": {
                "min": min(lengths),
                "median": statistics.median(lengths),
                "mean": statistics.fmean(lengths),
                "max": max(lengths),
            },
        },
        "layouts": per_layout,
        "ratios": {
            "dynamic_speedup_vs_padded": per_layout["dynamic"]["speedup_vs_padded"],
            "packed_speedup_vs_padded": per_layout["packed"]["speedup_vs_padded"],
            "packed_speedup_vs_dynamic": per_layout["dynamic"]["median_seconds"]
            / per_layout["packed"]["median_seconds"],
            "computed_tokens_padded_over_packed": per_layout["padded"]["tokens"]["computed"]
            / per_layout["packed"]["tokens"]["computed"],
            "computed_tokens_dynamic_over_packed": per_layout["dynamic"]["tokens"]["computed"]
            / per_layout["packed"]["tokens"]["computed"],
        },
        "exactness": exactness,
    }


def _describe(kwargs: dict[str, object]) -> dict[str, object]:
    layout = kwargs.get("layout")
    if layout is None:
        return {"kind": "rows", "rows": kwargs["micro_batch_size"]}
    out = {"kind": layout.kind, "tokens": layout.tokens, "round_to": layout.round_to}
    if layout.is_packed:
        out["algorithm"] = layout.algorithm
    return out


def _exactness(
    warm: dict[str, dict[str, object]], arms: dict[str, dict[str, object]], response: torch.Tensor, same: bool
) -> dict[str, object]:
    """The warm-up pass (identical fresh weights) of dynamic and packed against padded."""
    scored = response[:, 1:].bool()
    ref = warm["padded"]
    ref_weights = _weights(arms["padded"]["model"])
    out: dict[str, object] = {"bound": EXACT_BOUND, "same_initial_weights": same}
    worst = 0.0
    for name in LAYOUTS[1:]:
        got = warm[name]
        diffs = {
            "logprob_max_abs_diff": float((got["logp"] - ref["logp"])[scored].abs().max()),
            "loss_rel_diff": _rel(got["result"].loss, ref["result"].loss),
            "grad_norm_rel_diff": _rel(got["result"].grad_norm, ref["result"].grad_norm),
            "weights_max_abs_diff_after_step": float((_weights(arms[name]["model"]) - ref_weights).abs().max()),
        }
        out[name] = diffs
        gated = {k: v for k, v in diffs.items() if k in GATED}
        worst = max(worst, *(v if math.isfinite(v) else math.inf for v in gated.values()))
        for key, value in gated.items():
            if not value <= EXACT_BOUND:
                logger.warning("%s: %s = %.3g is over %.0e against padded", name, key, value, EXACT_BOUND)
    out["padded_loss"] = ref["result"].loss
    out["padded_grad_norm"] = ref["result"].grad_norm
    out["worst"] = worst
    out["within_bound"] = same and worst <= EXACT_BOUND
    if not same:
        logger.warning("the three models were not built with the same weights: the exactness check is void")
    return out


# ----------------------------------------------------------------------------- report


def log_table(summary: dict) -> None:
    """The table, through logging."""
    b, s = summary["batch"], summary["settings"]
    r = b["response_lengths"]
    lines = [
        f"train phase (score + train step) on {summary['machine']['cpu']}, {summary['machine']['torch_threads']} "
        f"torch threads: {b['rows']} rows padded to {b['padded_length']}, responses {r['min']}..{r['max']} "
        f"(median {r['median']:g}, mean {r['mean']:.1f}), {b['real_tokens']} real tokens; tokens counted over both passes "
        f"(score + train), seconds the median of {s['repeats']}",
        f"{'layout':<9}{'micro-b.':>9}{'computed':>10}{'real':>8}{'comp/real':>10}{'attn c/r':>9}"
        f"{'score s':>9}{'train s':>9}{'total s':>9}{'speed-up':>10}",
    ]
    for name, x in summary["layouts"].items():
        t = x["tokens"]
        lines.append(
            f"{name:<9}{x['micro_batches']['train']:>9}{t['computed']:>10}{t['real']:>8}{t['computed_over_real']:>10.2f}"
            f"{x['attention_scores_per_pass']['computed_over_real']:>9.2f}{x['median_score_seconds']:>9.3f}"
            f"{x['median_train_seconds']:>9.3f}{x['median_seconds']:>9.3f}{x['speedup_vs_padded']:>9.2f}x"
        )
    e = summary["exactness"]
    for name in LAYOUTS[1:]:
        d = e[name]
        lines.append(
            f"exactness {name} vs padded: logprob max |diff| {d['logprob_max_abs_diff']:.2e}, loss rel "
            f"{d['loss_rel_diff']:.2e}, grad-norm rel {d['grad_norm_rel_diff']:.2e}, weights after the step "
            f"{d['weights_max_abs_diff_after_step']:.2e} (reported only; bound {e['bound']:.0e}: "
            f"{'within' if e['within_bound'] else 'OVER'})"
        )
    logger.info("\n%s", "\n".join(lines))


def plot(summary: dict, path: Path) -> Path:
    """Two bar charts: median seconds per layout (score + train stacked), computed / real tokens per layout."""
    import matplotlib  # lazy: only the plot needs it

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # lazy: after choosing the Agg backend

    names = list(summary["layouts"])
    x = summary["layouts"]
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    try:
        score = [x[n]["median_score_seconds"] for n in names]
        train = [x[n]["median_train_seconds"] for n in names]
        ax_t.bar(names, score, label="score (no grad)", color="#8fb3d9")
        ax_t.bar(names, train, bottom=score, label="train step", color="#2b6cb0")
        for i, n in enumerate(names):
            ax_t.text(i, score[i] + train[i], f"{x[n]['speedup_vs_padded']:.2f}x", ha="center", va="bottom")
        ax_t.set_ylabel("median seconds")
        ax_t.set_title("train phase time (speed-up vs padded)")
        ax_t.legend(fontsize=8)
        ratios = [x[n]["tokens"]["computed_over_real"] for n in names]
        ax_r.bar(names, ratios, color="#c05621")
        ax_r.axhline(1.0, color="black", ls=":", lw=1)
        for i, v in enumerate(ratios):
            ax_r.text(i, v, f"{v:.2f}", ha="center", va="bottom")
        ax_r.set_ylabel("computed / real tokens")
        ax_r.set_title("tokens the model computes per real token")
        b = summary["batch"]
        fig.suptitle(
            f"{b['rows']} rows, responses {b['response_lengths']['min']}..{b['response_lengths']['max']} tokens, "
            f"{summary['machine']['cpu']} ({summary['machine']['torch_threads']} threads)",
            fontsize=9,
        )
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64, help="rows of the batch")
    ap.add_argument("--min-response", type=int, default=16, help="shortest response, tokens")
    ap.add_argument("--max-response", type=int, default=256, help="longest response, tokens (one row has it)")
    ap.add_argument("--micro-rows", type=int, default=8, help="padded layout: rows per micro-batch")
    ap.add_argument("--tokens", type=int, default=2048, help="dynamic / packed: tokens per micro-batch")
    ap.add_argument("--round", type=int, default=64, help="dynamic: lengths rounded up to this (NeMo-RL's 64)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed passes first (the first is the exactness check)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/packing.json"), help="the JSON summary")
    ap.add_argument("--plot", type=Path, default=None, help="the PNG (default: packing.png next to --out)")
    args = ap.parse_args(argv)
    if min(args.rows, args.micro_rows, args.tokens, args.round, args.repeats, args.warmup) < 1:
        ap.error("--rows, --micro-rows, --tokens, --round, --repeats and --warmup must be >= 1")
    if not 1 <= args.min_response <= args.max_response:
        ap.error("need 1 <= --min-response <= --max-response")
    if args.max_response + PROMPT_TOKENS[1] > args.tokens:
        ap.error(f"--tokens must hold the longest row: >= {args.max_response + PROMPT_TOKENS[1]}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    summary = run(
        rows=args.rows,
        min_response=args.min_response,
        max_response=args.max_response,
        micro_rows=args.micro_rows,
        tokens=args.tokens,
        round_to=args.round,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
    )
    log_table(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    logger.info("wrote %s", args.out)
    png = plot(summary, args.plot if args.plot is not None else args.out.with_name("packing.png"))
    logger.info("wrote %s", png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
