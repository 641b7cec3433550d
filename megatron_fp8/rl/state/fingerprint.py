"""The config fingerprint a GRPO checkpoint is written with: a resume under a config that computes something else is
refused (:class:`~megatron_fp8.rl.state.checkpoint.CheckpointMismatchError` names each differing key).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from megatron_fp8.config.schema import JSONValue, RunConfig

__all__ = ["NOT_FINGERPRINTED", "config_fingerprint", "fingerprint_differences"]

_FINGERPRINT_SECTIONS: tuple[str, ...] = ("model", "policy", "loss_fn", "grpo", "data", "kv_cache", "rollout")
"""Config sections that decide what a run computes; ``refit`` (how weights travel: buckets, timeouts, verification,
transport), ``logging``, ``logger``, ``checkpointing`` and ``out_dir`` do not, and are left out."""

NOT_FINGERPRINTED: dict[str, str] = {
    "grpo.max_num_steps": "a rerun with more steps resumes where the last one stopped",
    "grpo.num_steps": "its former spelling (checkpoints written before the rename)",
    "grpo.arms": "each arm has its own folder",
    "grpo.val_period": "validation reads the policy, never changes it",
    "grpo.val_at_start": "validation reads the policy, never changes it",
    "grpo.max_val_samples": "validation reads the policy, never changes it",
    "data.validation": "validation reads the policy, never changes it",
    "policy.model_name": "the loader copies it into model.name_or_path",
    "policy.megatron_cfg.env_vars": "the process environment (NCCL, logging switches), not the math",
    "policy.generation.vllm_cfg.gpu_memory_utilization": "vLLM's memory budget, not what it computes",
    "policy.generation.colocated": "where rollouts run, not what they compute",
}
"""Keys inside the fingerprinted sections that may change between a run and its resume, with why."""


def config_fingerprint(config: RunConfig) -> dict[str, JSONValue]:
    """The part of the config a checkpoint belongs to: a resume with a different one is refused.

    The sections ``model``, ``policy``, ``loss_fn``, ``grpo``, ``data``, ``kv_cache`` and ``rollout`` without the
    keys of :data:`NOT_FINGERPRINTED` (more ``--steps``, other arms, validation settings, environment and placement
    may change); ``refit``, ``logging``, ``logger``, ``checkpointing`` and ``out_dir`` are left out.

    Returns:
        Nested plain data (JSON), as :meth:`RunConfig.to_dict` writes it.
    """
    full = config.to_dict()
    out: dict[str, JSONValue] = {section: json.loads(json.dumps(full[section])) for section in _FINGERPRINT_SECTIONS}
    for dotted in NOT_FINGERPRINTED:
        *parents, leaf = dotted.split(".")
        node: JSONValue = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


def _flatten(value: JSONValue, prefix: str = "") -> dict[str, JSONValue]:
    if isinstance(value, dict) and value:
        out: dict[str, JSONValue] = {}
        for key, sub in value.items():
            out.update(_flatten(sub, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


_ABSENT = "<absent>"


def fingerprint_differences(
    saved: Mapping[str, JSONValue], current: Mapping[str, JSONValue]
) -> tuple[tuple[str, JSONValue, JSONValue], ...]:
    """``(dotted key, saved value, current value)`` for every leaf that differs (``"<absent>"`` where missing); a key
    the checkpoint does not have (written before the key existed) differs only where its value now is not the
    default's."""
    a, b = _flatten(dict(saved)), _flatten(dict(current))
    defaults = _flatten(config_fingerprint(RunConfig()))  # a key newer than the checkpoint computed its default
    return tuple(
        (k, a.get(k, _ABSENT), b.get(k, _ABSENT))
        for k in sorted(a.keys() | b.keys())
        if a.get(k, _ABSENT) != b.get(k, _ABSENT) and not (k not in a and k in defaults and defaults[k] == b.get(k))
    )
