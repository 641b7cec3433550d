"""NeMo-RL's prompt files, for its configs run outside a NeMo-RL checkout.

NeMo-RL's GRPO examples give ``data.default.prompt_file: "examples/prompts/cot.txt"``, a path relative to a NeMo-RL
checkout. When no file exists at such a path, :func:`nemo_rl_prompt` hands back NeMo-RL's own text (copied byte for
byte from NVIDIA-NeMo/RL ``examples/prompts/``, commit 7ea279abfbeb698b092856d0dab61e7cf39bc909, Apache-2.0), so
the file runs with the prompt NeMo-RL uses; a file that exists always wins.
"""

from __future__ import annotations

import logging
from pathlib import PurePosixPath

logger = logging.getLogger(__name__)

NEMO_RL_PROMPTS: dict[str, str] = {
    "examples/prompts/cot.txt": (
        "Think step-by-step to solve the following problem. Output your answer inside of \\\\boxed{{}} tags.:\n"
        "{}\n\nLet's think step-by-step"
    ),
    "examples/prompts/math.txt": (
        "Solve the following math problem. Make sure to put the answer (and only answer) inside \\\\boxed{{}}.\n\n"
        "{}\n\n"
    ),
}
"""NeMo-RL's prompt-file path -> its text (the math prompts of its GRPO examples)."""


def nemo_rl_prompt(path: str, *, key: str) -> str | None:
    """NeMo-RL's text of the prompt file ``path`` (``examples/prompts/cot.txt``, also written ``./examples/...``),
    ``None`` when ``path`` is not one of NeMo-RL's; logs once per call that NeMo-RL's copy is used.

    Args:
        path: the configured path (the caller found no file there).
        key: its config key, for the log line.
    """
    parts = PurePosixPath(path.replace("\\", "/")).parts
    text = NEMO_RL_PROMPTS.get("/".join(p for p in parts if p != "."))
    if text is not None:
        logger.info("%s: %s is not here; using NeMo-RL's %s (its text, shipped with megatron-fp8)", key, path, path)
    return text
