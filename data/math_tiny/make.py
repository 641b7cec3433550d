"""Write the tiny math dataset: ``train.jsonl``, ``validation.jsonl`` and ``prompt.txt``.

Deterministic (a fixed seed, no downloads): running it again writes the same bytes. Problems are easy
integer arithmetic in printable ASCII, which the tiny models' character tokenizer covers one token per
character; answers are integers as text. Rows use NeMo-RL's math keys ``problem`` / ``expected_answer``.

Usage::

    .venv/bin/python data/math_tiny/make.py            # into this folder
    .venv/bin/python data/math_tiny/make.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

SEED = "megatron-fp8 math_tiny v1"
"""Seed of the generator (a string: stable across Python versions and processes)."""

N_TRAIN = 200
N_VALIDATION = 50

PROMPT = "Question: {}\nAnswer with a number."
"""The prompt template (``data.default.prompt_file``): ``{}`` is the problem."""

Maker = Callable[[random.Random], tuple[str, int]]


def _add(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    return f"What is {a} + {b}?", a + b


def _sub(rng: random.Random) -> tuple[str, int]:
    a = rng.randint(1, 50)
    b = rng.randint(0, a)
    return f"What is {a} - {b}?", a - b


def _mul(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(2, 12), rng.randint(2, 9)
    return f"What is {a} * {b}?", a * b


def _apples(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return f"Tom has {a} apples and gets {b} more. How many apples does he have?", a + b


def _pens(rng: random.Random) -> tuple[str, int]:
    a = rng.randint(2, 30)
    b = rng.randint(1, a)
    return f"A box has {a} pens. {b} are taken out. How many pens are left?", a - b


def _boxes(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"There are {a} boxes with {b} eggs each. How many eggs are there?", a * b


MAKERS: tuple[Maker, ...] = (_add, _sub, _mul, _apples, _pens, _boxes)


def generate() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The training and validation rows: distinct problems, no problem in both.

    Returns:
        ``(train, validation)``, :data:`N_TRAIN` and :data:`N_VALIDATION` rows of
        ``{"problem": str, "expected_answer": str}``.
    """
    rng = random.Random(SEED)
    seen: set[str] = set()
    rows: list[dict[str, str]] = []
    while len(rows) < N_TRAIN + N_VALIDATION:
        problem, answer = MAKERS[len(rows) % len(MAKERS)](rng)
        if problem in seen:
            continue
        seen.add(problem)
        rows.append({"problem": problem, "expected_answer": str(answer)})
    rng.shuffle(rows)
    return rows[:N_TRAIN], rows[N_TRAIN:]


def _jsonl(rows: list[dict[str, str]]) -> str:
    return "".join(json.dumps(row, ensure_ascii=True) + "\n" for row in rows)


def write(out: Path) -> None:
    """Write ``train.jsonl``, ``validation.jsonl`` and ``prompt.txt`` into ``out`` (created if missing)."""
    out.mkdir(parents=True, exist_ok=True)
    train, validation = generate()
    (out / "train.jsonl").write_text(_jsonl(train), encoding="ascii")
    (out / "validation.jsonl").write_text(_jsonl(validation), encoding="ascii")
    (out / "prompt.txt").write_text(PROMPT, encoding="ascii")
    logger.info("wrote %d training and %d validation rows and prompt.txt to %s", len(train), len(validation), out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="output folder")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write(args.out)


if __name__ == "__main__":
    main()
