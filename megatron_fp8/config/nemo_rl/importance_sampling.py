"""NeMo-RL's importance-sampling keys, read as the IS correction megatron-fp8 runs (one source per value).

NeMo-RL describes the correction of the rollout mismatch with ``loss_fn.use_importance_sampling_correction`` and
``loss_fn.truncated_importance_sampling_{type, ratio, ratio_min}``; megatron-fp8's ``loss_fn.is_variant`` /
``is_cap`` / ``is_lower`` / ``is_upper`` name more rules (:data:`megatron_fp8.vocab.IS_VARIANTS`). Where the file
gives NeMo-RL's keys, they decide, translated here before the config is typed:

=====================================  ==================================================================
NeMo-RL (correction on)                megatron-fp8
=====================================  ==================================================================
type ``tis``, ratio C                  ``token_tis``, ``is_cap`` C: ``min(w, C)``
type ``tis``, ratio_min m > 0          refused: a lower clamp of the token weight is not implemented
type ``icepop``, ratio C, ratio_min m  ``icepop``, ``is_lower`` m, ``is_upper`` C: ``w`` inside, 0 outside
type ``seq-mask-tis``, C, m            ``seq_mask_tis``, band [m, C] on the geometric mean, ``is_cap`` null
                                       (kept sequences keep their raw token weights, as NeMo-RL)
type null or not given                 ``token_tis``, ``is_cap`` null: raw token weights ``w`` (NeMo-RL's
                                       untruncated correction), unless megatron-fp8's own keys are given
ratio without a type                   refused (NeMo-RL's loss raises on it)
=====================================  ==================================================================

Whether the correction runs at all is ``use_importance_sampling_correction`` (every arm, when given:
:meth:`megatron_fp8.config.schema.LossConfig.arm_corrects`). A type with the correction off is refused (NeMo-RL
refuses it too). When both spellings are given, the later
source wins (an override over a file, a child file over its parents); both from one source with different values
are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from megatron_fp8.config.nemo_rl.inheritance import OVERRIDE_SOURCE
from megatron_fp8.config.schema import JSONValue
from megatron_fp8.errors import ConfigError

NEMO_RL_IS_KEYS = (
    "truncated_importance_sampling_type",
    "truncated_importance_sampling_ratio",
    "truncated_importance_sampling_ratio_min",
)
"""NeMo-RL's ``loss_fn`` keys this module reads."""

OUR_IS_KEYS = ("is_variant", "is_cap", "is_lower", "is_upper")
"""megatron-fp8's ``loss_fn`` keys they become."""

_MISSING = object()


def _translated(kind: JSONValue, ratio: JSONValue, low: JSONValue) -> dict[str, JSONValue]:
    given = f"loss_fn.truncated_importance_sampling_type={kind!r}"
    if ratio is None:
        raise ConfigError(f"{given} needs loss_fn.truncated_importance_sampling_ratio (a positive number)")
    if kind == "tis":
        if low not in (None, 0, 0.0):
            raise ConfigError(
                f"{given} with truncated_importance_sampling_ratio_min={low!r} clamps the token weight from below, "
                "which megatron-fp8 does not implement; remove ratio_min (or use type icepop, which drops tokens "
                "outside [ratio_min, ratio])"
            )
        return {"is_variant": "token_tis", "is_cap": ratio}
    if low is None:
        raise ConfigError(f"{given} needs loss_fn.truncated_importance_sampling_ratio_min (the lower bound)")
    if kind == "icepop":
        return {"is_variant": "icepop", "is_lower": low, "is_upper": ratio}
    if kind == "seq-mask-tis":
        return {"is_variant": "seq_mask_tis", "is_lower": low, "is_upper": ratio, "is_cap": None}
    raise ConfigError(f"{given}: NeMo-RL's types are 'tis', 'icepop' and 'seq-mask-tis' (or null)")


def _rank(source: str | None, files: Sequence[Path]) -> int:
    """How late a source is: the embedded default / unknown -1, files parents first, overrides last."""
    if source == OVERRIDE_SOURCE:
        return len(files) + 1
    for i, f in enumerate(files):
        if source is not None and Path(source) == Path(f):
            return i
    return -1


def translate_is_keys(
    raw: dict[str, JSONValue], sources: dict[str, str], files: Sequence[Path] = ()
) -> dict[str, JSONValue]:
    """Replace NeMo-RL's IS keys in the resolved config ``raw`` by megatron-fp8's (module docstring), in place;
    ``sources`` (dotted key -> file) follows, so ``config --explain`` names the file that set them.

    Args:
        raw: the resolved config (nested mappings).
        sources: dotted leaf -> the file or ``<override>`` that set it.
        files: the config files read, parents before children (which source is later).

    Returns:
        The NeMo-RL keys read (dotted, ``loss_fn.``) and their values (for ``config --explain``).

    Raises:
        ConfigError: a type with the correction off, a type without its ratios, a ratio without a type, a lower
            clamp for ``tis``, or one source that also gives megatron-fp8's keys with other values.
    """
    loss = raw.get("loss_fn")
    if not isinstance(loss, dict):
        return {}
    if not any(k in loss for k in NEMO_RL_IS_KEYS):
        if loss.get("use_importance_sampling_correction") is True and not any(k in loss for k in OUR_IS_KEYS):
            # NeMo-RL's correction with no truncation type given (its default): raw token weights
            loss.update(is_variant="token_tis", is_cap=None)
            source = sources.get("loss_fn.use_importance_sampling_correction", "<file>")
            sources.update({"loss_fn.is_variant": source, "loss_fn.is_cap": source})
        return {}
    read = {f"loss_fn.{k}": loss[k] for k in NEMO_RL_IS_KEYS if k in loss}
    kind = loss.pop(NEMO_RL_IS_KEYS[0], _MISSING)
    ratio = loss.pop(NEMO_RL_IS_KEYS[1], None)
    low = loss.pop(NEMO_RL_IS_KEYS[2], None)
    theirs = [sources.get(f"loss_fn.{k}") for k in NEMO_RL_IS_KEYS if f"loss_fn.{k}" in sources]
    source = max(theirs, key=lambda s: _rank(s, files), default=None) or "<file>"
    latest = _rank(source, files)
    # megatron-fp8's keys count where they come from a source as late as NeMo-RL's (an earlier one is overridden)
    ours = {k: loss[k] for k in OUR_IS_KEYS if k in loss and _rank(sources.get(f"loss_fn.{k}"), files) >= latest}
    correction = bool(loss.get("use_importance_sampling_correction", False))
    if (kind is _MISSING or kind is None) and ratio is not None:
        raise ConfigError(
            f"loss_fn.truncated_importance_sampling_ratio={ratio!r} with loss_fn.truncated_importance_sampling_type "
            f"{'not given' if kind is _MISSING else 'null'}: a ratio needs a type (NeMo-RL refuses it too: its loss "
            "raises 'Invalid truncated importance sampling type: None'); set truncated_importance_sampling_type "
            "(tis, icepop or seq-mask-tis) or truncated_importance_sampling_ratio: null"
        )
    if kind is _MISSING or kind is None:
        if correction and not ours:  # NeMo-RL's correction without a truncation type: raw token weights
            loss.update(is_variant="token_tis", is_cap=None)
            sources.update({"loss_fn.is_variant": source, "loss_fn.is_cap": source})
        return read
    if not correction:
        raise ConfigError(
            f"loss_fn.truncated_importance_sampling_type={kind!r} needs loss_fn.use_importance_sampling_correction: "
            "true (NeMo-RL refuses it too)"
        )
    translated = _translated(kind, ratio, low)
    clash = {k: (ours[k], v) for k, v in translated.items() if k in ours and ours[k] != v}
    if clash:
        raise ConfigError(
            f"loss_fn.truncated_importance_sampling_type={kind!r} (ratio {ratio!r}, ratio_min {low!r}) means "
            f"{translated}, but the config also gives "
            + ", ".join(f"loss_fn.{k}={a!r}" for k, (a, _) in clash.items())
            + "; keep one spelling (NeMo-RL's keys, or megatron-fp8's is_variant / is_cap / is_lower / is_upper)"
        )
    loss.update(translated)
    sources.update({f"loss_fn.{k}": source for k in translated})
    return read
