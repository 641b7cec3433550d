"""Async GRPO against the synchronous run at the same ranks: 1 trainer + 1 rollout rank over gloo, on CPU.

Runs the real ``megatron-fp8 grpo`` command twice under torchrun (2 processes, ``OMP_NUM_THREADS=1`` each, the
embedded tiny default, the FP8 arm with the IS correction): synchronous, then ``grpo.async_grpo.enabled: true``
(``max_trajectory_age_steps: 1``). From each run's ``metrics.jsonl``: the wall time of its steps (``step_seconds``
summed; the process start, model build and warm start are the same in both and left out), per step the rollout
rank's generation time, the trainer's wait for it, and the generation hidden behind training (overlap), the ages,
and the mean reward. Step 0 cannot overlap (nothing was asked before it), so the ratio is also given over the later
steps. Prints a table and writes JSON.

Example::

    python bench/async_grpo.py --steps 6 --out bench/results/async_grpo.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("bench.async_grpo")

REPO = Path(__file__).resolve().parents[1]
SPLIT = (
    "policy.generation.colocated.enabled=false",
    "policy.generation.colocated.resources.gpus_per_node=1",
    "policy.generation.colocated.resources.num_nodes=1",
)
MODES = {"sync": (), "async": ("grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1")}


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def grpo_argv(mode: str, *, steps: int, out: Path, extra: tuple[str, ...]) -> list[str]:
    """The ``megatron-fp8`` arguments of one run of ``mode`` (a key of :data:`MODES`)."""
    return [
        "grpo", "--out", str(out), "--overwrite", "--steps", str(steps), "--no-progress",
        "--arms", "fp8_tis", "policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise", *SPLIT, *MODES[mode], *extra,
    ]  # fmt: skip


def torchrun(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``megatron-fp8 ARGV`` on 2 ranks under ``torchrun --standalone`` (what ``make bench`` runs)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "megatron_fp8"]
    return subprocess.run([*cmd, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False)


Launcher = Callable[[list[str], dict[str, str]], subprocess.CompletedProcess]
"""Runs ``megatron-fp8 ARGV`` on 2 ranks with an environment: :func:`torchrun`, or the test suite's warm launcher."""


def run(
    mode: str, *, steps: int, out: Path, extra: tuple[str, ...], launch: Launcher = torchrun
) -> tuple[list[dict], float]:
    """One ``megatron-fp8 grpo`` run on 1 trainer + 1 rollout rank; its records and its process wall time."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MFP8_ROLE", "ROLLOUT_TASKS")}
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    proc = launch(grpo_argv(mode, steps=steps, out=out, extra=extra), env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], wall


def summarize(records: list[dict], wall: float) -> dict:
    """Step seconds (all, and after step 0), each side's time, the overlap, ages and rewards of one run."""
    later = records[1:]
    return {
        "process_wall_seconds": wall,
        "steps_seconds": sum(r["step_seconds"] for r in records),
        "steps_after_first_seconds": sum(r["step_seconds"] for r in later),
        "rollout_busy_seconds": sum(r["rollout_busy_seconds"] for r in records),
        "trainer_wait_seconds": sum(r["rollout_wait_seconds"] for r in records),
        "overlap_seconds": sum(r["rollout_overlap_seconds"] for r in records),
        "train_seconds": sum(r["train_seconds"] for r in records),
        "refit_seconds": sum(r["refit_seconds"] for r in records),
        "ages": [r["rollout_age_steps"] for r in records],
        "reward_mean_per_step": [r["reward_mean"] for r in records],
        "reward_mean": sum(r["reward_mean"] for r in records) / len(records),
    }


def main(argv: list[str] | None = None, *, launch: Launcher = torchrun) -> dict:
    """Both runs, the table and the JSON; ``launch`` starts each run's 2 ranks (:func:`torchrun`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warm-start-steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "async_grpo.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    extra = (f"grpo.warm_start_steps={args.warm_start_steps}",)
    result: dict = {
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "load_average": os.getloadavg()},
        "settings": {"steps": args.steps, "ranks": "1 trainer + 1 rollout (gloo)", "arm": "fp8_tis"},
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            logger.info("%s: %d steps on 1 trainer + 1 rollout rank ...", mode, args.steps)
            records, wall = run(mode, steps=args.steps, out=Path(tmp) / mode, extra=extra, launch=launch)
            result["runs"][mode] = summarize(records, wall)
    s, a = result["runs"]["sync"], result["runs"]["async"]
    result["ratio_async_over_sync"] = {
        "steps": a["steps_seconds"] / s["steps_seconds"],
        "steps_after_first": a["steps_after_first_seconds"] / s["steps_after_first_seconds"],
    }
    lines = [
        f"async GRPO vs synchronous, {args.steps} steps, 1 trainer + 1 rollout rank (gloo), {result['machine']['cpu']}",
        f"{'run':<7}{'steps s':>9}{'after 0 s':>11}{'gen s':>8}{'wait s':>8}{'overlap s':>11}{'reward':>9}  ages",
    ]
    for mode, r in result["runs"].items():
        lines.append(
            f"{mode:<7}{r['steps_seconds']:>9.2f}{r['steps_after_first_seconds']:>11.2f}{r['rollout_busy_seconds']:>8.2f}"
            f"{r['trainer_wait_seconds']:>8.2f}{r['overlap_seconds']:>11.2f}{r['reward_mean']:>9.4f}  {r['ages']}"
        )
    ratio = result["ratio_async_over_sync"]
    lines.append(f"async / sync: steps {ratio['steps']:.2f}, steps after the first {ratio['steps_after_first']:.2f}")
    logger.info("\n%s", "\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    logger.info("wrote %s", args.out)
    return result


if __name__ == "__main__":
    main()
