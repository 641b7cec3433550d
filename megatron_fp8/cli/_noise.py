"""Third-party noise kept at DEBUG: what the Megatron / Transformers / vLLM stacks print on every run.

Without ``-v`` a run shows megatron-fp8's own INFO lines only: Megatron-Core's "Params for bucket" lists and
rerun-state-machine notes, the "Apex / Transformer Engine not installed" import warnings, Transformers'
deprecation notes and vLLM's INFO lines (its "Chat template warmup failed" traceback included) are raised
to ERROR; with ``-v`` everything is shown. Only the CLI calls this (the library never changes global
logging or warning filters).
"""

from __future__ import annotations

import logging
import os
import warnings

THIRD_PARTY_LOGGERS: tuple[str, ...] = (
    "megatron",
    "transformers",
    "vllm",
    "huggingface_hub",
    "torch.distributed",
    "modelopt",
    "filelock",
)
"""Loggers whose INFO / WARNING lines are noise for a megatron-fp8 user (shown with ``-v``)."""

NOISY_WARNING_MODULES = r"(megatron|transformers|vllm|modelopt|torch\.distributed)(\..*)?$"
"""Modules whose Python warnings (e.g. "Apex is not installed. Falling back to Torch Norm") are hidden."""


def quiet_third_party(*, verbose: bool = False) -> None:
    """Raise the third-party loggers to ERROR and hide their Python warnings, unless ``verbose``.

    Call before the third-party stacks are imported: their import-time warnings are filtered then,
    and vLLM reads ``VLLM_LOGGING_LEVEL`` (set here unless the user set it) when it configures its logger.
    """
    if verbose:
        return
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars too (e.g. "Writing model shards")
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=NOISY_WARNING_MODULES)
