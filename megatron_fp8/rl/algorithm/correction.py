"""Importance-sampling (IS) correction of the train/rollout mismatch and the PPO clipped loss.

vLLM samples the rollout under an FP8 policy ``pi_rollout``; the trainer scores
the same tokens under its own (old) policy ``pi_train``. The two differ
(FP8 weights and KV cache, different kernels), so the policy-gradient estimate
is off-policy. Each response token gets an importance weight

    ``w_t = exp(clamp(logp_train_old_t - logp_rollout_t, -c, c))``

(``c = log_ratio_clamp``, default 20, only to keep ``exp`` finite), computed in
float32 and detached: it rescales the loss and never carries a gradient.

Variants (:data:`megatron_fp8.vocab.IS_VARIANTS`; ``S = sum_t log w_t`` over a sequence's real
tokens, ``n`` = its number of real tokens; ``C = cap``, ``[lo, hi] = band``):

=================  ==========================================================  ===============================
variant            token weight for a real token                               kept (``mask``)
=================  ==========================================================  ===============================
``none``           1                                                           every real token
``token_tis``      ``min(w_t, C)`` (truncated IS, C=2 by default)              every real token
``seq_is``         ``min(W, C)`` with ``W = exp(clamp(S, -c, c))`` = the        every real token
                   **product** of the token ratios (not the geometric mean);
                   ``cap=None`` leaves it untruncated
``token_mask``     ``w_t`` if ``lo <= w_t <= hi`` else 0                       tokens inside the band
``icepop``         same rule as ``token_mask`` (IcePop = token-level masked    tokens inside the band
                   IS; registered under its own name for configs)
``seq_mask_sum``   1 if ``log lo <= S <= log hi`` else 0 (sequence-level       whole sequences inside the band
                   rejection on the product ratio; no reweighting)
``seq_mask_geo``   1 if ``lo <= exp(S / n) <= hi`` else 0 (rejection on the    whole sequences inside the band
                   geometric mean of the token ratios; no reweighting)
``seq_mask_tis``   ``min(w_t, C)`` in sequences kept by the ``seq_mask_geo``   whole sequences inside the band
                   rule, else 0
=================  ==========================================================  ===============================

Padding (``response_mask`` False) always gets weight 0 and ``mask`` False.
Fractions are over real tokens: ``truncated_fraction`` counts real tokens whose
weight was lowered by the cap (for ``seq_is``: tokens of truncated sequences);
``masked_fraction`` counts real tokens rejected by a band. Both are 0 when there
are no real tokens.

:func:`ppo_loss` multiplies the per-token clipped PPO loss by these weights and
averages over real tokens only (``token-mean``: the denominator is the number
of real response tokens, so rejected tokens lower the step size instead of
being renormalized away).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.vocab import IS_VARIANTS

DEFAULT_LOG_RATIO_CLAMP: float = 20.0
"""Bound on ``|logp_train - logp_rollout|`` before ``exp``; exp(20) ~ 4.9e8 stays finite in float32."""


@dataclass(frozen=True)
class ISConfig:
    """How to turn log-probability pairs into importance weights.

    Attributes:
        variant: one of :data:`IS_VARIANTS`.
        cap: truncation ``C`` for ``token_tis``, ``seq_is`` and ``seq_mask_tis``
            (positive). ``None`` is allowed only for ``seq_is`` (no truncation).
        lo: lower edge of the acceptance band for the masking variants
            (ratio units, ``0 < lo < hi``).
        hi: upper edge of the acceptance band.
        log_ratio_clamp: ``c``; token log-ratios (and sequence sums) are clamped to
            ``[-c, c]`` before ``exp`` (positive).
    """

    variant: str = "token_tis"
    cap: float | None = 2.0
    lo: float = 0.5
    hi: float = 2.0
    log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP

    def __post_init__(self) -> None:
        if self.variant not in IS_VARIANTS:
            raise ConfigError(f"unknown IS variant {self.variant!r}; valid names: {sorted(IS_VARIANTS)}")
        if self.cap is not None and not (math.isfinite(self.cap) and self.cap > 0):
            raise ConfigError(f"IS cap must be a positive finite number (or None: no truncation), got {self.cap!r}")
        if not (math.isfinite(self.lo) and math.isfinite(self.hi) and 0 < self.lo < self.hi):
            raise ConfigError(f"IS band needs 0 < lo < hi (finite), got lo={self.lo!r}, hi={self.hi!r}")
        if not (math.isfinite(self.log_ratio_clamp) and self.log_ratio_clamp > 0):
            raise ConfigError(f"log_ratio_clamp must be positive and finite, got {self.log_ratio_clamp!r}")


@dataclass(frozen=True)
class ISResult:
    """Importance weights for one batch.

    Attributes:
        weights: float32 ``[B, T]``, detached; 0 on padding and on rejected tokens.
        mask: bool ``[B, T]``; real tokens that were kept (weight may still be 1).
        truncated_fraction: fraction of real tokens whose weight the cap lowered.
        masked_fraction: fraction of real tokens rejected by a band.
        log_ratio: float32 ``[B, T]``, the clamped ``logp_train_old - logp_rollout``
            (0 on padding), kept for metrics.
        variant: the variant that produced it.
    """

    weights: torch.Tensor
    mask: torch.Tensor
    truncated_fraction: float
    masked_fraction: float
    log_ratio: torch.Tensor
    variant: str


@dataclass(frozen=True)
class _Batch:
    """Shared intermediates handed to a variant function."""

    log_ratio: torch.Tensor  # [B, T] float32, clamped, 0 on padding
    real: torch.Tensor  # [B, T] bool
    real_f: torch.Tensor  # [B, T] float32
    config: ISConfig

    def token_w(self) -> torch.Tensor:
        return torch.exp(self.log_ratio) * self.real_f

    def seq_sum(self) -> torch.Tensor:
        return self.log_ratio.sum(dim=-1)  # [B]

    def seq_len(self) -> torch.Tensor:
        return self.real_f.sum(dim=-1)  # [B]


# A variant returns (weights [B,T] float32, kept [B,T] bool, truncated [B,T] bool); all restricted to real tokens.
_Variant = Callable[[_Batch], "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]


def _none(b: _Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return b.real_f.clone(), b.real.clone(), torch.zeros_like(b.real)


def _token_tis(b: _Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = b.token_w()
    if b.config.cap is None:  # plain token-level IS (NeMo-RL's correction without a truncation type)
        return w, b.real.clone(), torch.zeros_like(b.real)
    cap = float(b.config.cap)
    return w.clamp(max=cap), b.real.clone(), (w > cap) & b.real


def _seq_is(b: _Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = b.config.log_ratio_clamp
    seq_w = torch.exp(b.seq_sum().clamp(-c, c))  # product of token ratios, [B]
    truncated_seq = torch.zeros_like(seq_w, dtype=torch.bool)
    if b.config.cap is not None:
        truncated_seq = seq_w > b.config.cap
        seq_w = seq_w.clamp(max=b.config.cap)
    weights = seq_w[:, None] * b.real_f
    return weights, b.real.clone(), truncated_seq[:, None] & b.real


def _token_band(b: _Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = b.token_w()
    kept = (w >= b.config.lo) & (w <= b.config.hi) & b.real
    return w * kept, kept, torch.zeros_like(b.real)


def _seq_keep_sum(b: _Batch) -> torch.Tensor:
    s = b.seq_sum()
    return (s >= math.log(b.config.lo)) & (s <= math.log(b.config.hi))


def _seq_keep_geo(b: _Batch) -> torch.Tensor:
    mean_log = b.seq_sum() / b.seq_len().clamp(min=1.0)
    return (mean_log >= math.log(b.config.lo)) & (mean_log <= math.log(b.config.hi))


def _seq_mask_sum(b: _Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kept = _seq_keep_sum(b)[:, None] & b.real
    return kept.float(), kept, torch.zeros_like(b.real)


def _seq_mask_geo(b: _Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kept = _seq_keep_geo(b)[:, None] & b.real
    return kept.float(), kept, torch.zeros_like(b.real)


def _seq_mask_tis(b: _Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kept = _seq_keep_geo(b)[:, None] & b.real
    w = b.token_w()
    if b.config.cap is None:  # NeMo-RL's seq-mask-tis: kept sequences keep their raw token weights
        return w * kept, kept, torch.zeros_like(b.real)
    cap = float(b.config.cap)
    return w.clamp(max=cap) * kept, kept, (w > cap) & kept


RULES: dict[str, _Variant] = {
    "none": _none,
    "token_tis": _token_tis,
    "seq_is": _seq_is,
    "token_mask": _token_band,
    "icepop": _token_band,
    "seq_mask_sum": _seq_mask_sum,
    "seq_mask_geo": _seq_mask_geo,
    "seq_mask_tis": _seq_mask_tis,
}
"""Registry: variant name (a key of :data:`megatron_fp8.vocab.IS_VARIANTS`) -> weight rule (formulas above)."""


def _check_pair(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, names: tuple[str, str, str]) -> None:
    for t, n in zip((a, b, mask), names, strict=True):
        if t.dim() != 2:
            raise ConfigError(f"{n} must be [batch, tokens], got shape {tuple(t.shape)}")
    if a.shape != b.shape or a.shape != mask.shape:
        raise ConfigError(
            f"{names[0]} {tuple(a.shape)}, {names[1]} {tuple(b.shape)} and {names[2]} {tuple(mask.shape)} "
            "must have the same [batch, tokens] shape"
        )


def masked_log_ratio(
    logp_a: torch.Tensor, logp_b: torch.Tensor, mask: torch.Tensor, *, clamp: float = DEFAULT_LOG_RATIO_CLAMP
) -> torch.Tensor:
    """``clamp(logp_a - logp_b, -clamp, clamp)`` in float32, detached, 0 where ``mask`` is False.

    Padding positions may hold anything (even ``-inf``/NaN); they never reach ``exp``.

    Args:
        logp_a: ``[B, T]`` log-probabilities (nats), any float dtype.
        logp_b: ``[B, T]`` log-probabilities (nats).
        mask: ``[B, T]`` bool or 0/1, True on real tokens.
        clamp: symmetric bound on the difference.

    Returns:
        float32 ``[B, T]``.
    """
    real = mask.bool()
    diff = logp_a.detach().float() - logp_b.detach().float()
    diff = torch.where(real, diff, torch.zeros_like(diff))
    return diff.clamp(-clamp, clamp)


def compute_is_weights(
    logp_train_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: ISConfig | None = None,
) -> ISResult:
    """Importance weights ``pi_train_old / pi_rollout`` per response token, per ``config.variant``.

    Args:
        logp_train_old: ``[B, T]`` log-probs (nats) of the sampled tokens under the
            trainer's policy before the update (any float dtype; gradient ignored).
        logp_rollout: ``[B, T]`` log-probs of the same tokens reported by vLLM.
        response_mask: ``[B, T]`` bool/0-1, True on real response tokens.
        config: variant and its parameters; ``ISConfig()`` (token TIS, C=2) if None.

    Returns:
        A frozen :class:`ISResult` (weights float32 ``[B, T]``, detached).

    Raises:
        ConfigError: shapes disagree or are not 2-D; a real token's log-prob is NaN.
    """
    config = config if config is not None else ISConfig()
    _check_pair(logp_train_old, logp_rollout, response_mask, ("logp_train_old", "logp_rollout", "response_mask"))
    real = response_mask.bool()
    log_ratio = masked_log_ratio(logp_train_old, logp_rollout, real, clamp=config.log_ratio_clamp)
    if torch.isnan(log_ratio).any():
        raise ConfigError(
            "logp_train_old - logp_rollout is NaN on a real response token; check the log-prob gathering "
            "(both must be finite wherever response_mask is True)"
        )
    batch = _Batch(log_ratio=log_ratio, real=real, real_f=real.float(), config=config)
    weights, kept, truncated = RULES[config.variant](batch)
    n_real = int(real.sum())
    denom = max(n_real, 1)
    return ISResult(
        weights=weights.float().detach(),
        mask=kept,
        truncated_fraction=float(truncated.sum()) / denom,
        masked_fraction=float((real & ~kept).sum()) / denom,
        log_ratio=log_ratio,
        variant=config.variant,
    )


# --------------------------------------------------------------------------- PPO loss


def _token_mean(loss: torch.Tensor, real_f: torch.Tensor) -> torch.Tensor:
    return (loss * real_f).sum() / real_f.sum().clamp(min=1.0)


def _seq_mean_token_mean(loss: torch.Tensor, real_f: torch.Tensor) -> torch.Tensor:
    per_seq_count = real_f.sum(dim=-1)
    per_seq = (loss * real_f).sum(dim=-1) / per_seq_count.clamp(min=1.0)
    has_tokens = (per_seq_count > 0).float()
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


LOSS_AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
}
"""Registry: aggregation name -> ``(per-token loss [B,T], real-token mask float [B,T]) -> scalar``.

``token-mean``: sum over real tokens / number of real tokens. ``seq-mean-token-mean``:
each sequence's mean over its real tokens, then the mean over sequences that have at
least one real token. Both give exactly 0 (with zero gradient) when nothing is real.
"""


@dataclass(frozen=True)
class PPOStats:
    """Detached 0-d float32 tensors (no host sync); :meth:`as_floats` for logging.

    Attributes:
        clip_fraction: fraction of real tokens where the clipped term was active.
        approx_kl: k3 estimate of KL(old || new) per real token, ``mean(r - 1 - log r)``.
        ratio_mean: mean of ``pi_new / pi_old`` over real tokens.
        is_weight_mean: mean IS weight over real tokens (1 when none given).
        tokens: number of real tokens.
        kl_penalty: the penalty term added to the loss (``beta`` x the aggregated per-token KL to the reference
            policy; 0 without a penalty).
    """

    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor
    ratio_mean: torch.Tensor
    is_weight_mean: torch.Tensor
    tokens: torch.Tensor
    kl_penalty: torch.Tensor

    def as_floats(self) -> dict[str, float]:
        """Plain floats keyed by field name (one host sync)."""
        return {k: float(getattr(self, k)) for k in self.__dataclass_fields__}


def ppo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_weights: torch.Tensor | ISResult | None = None,
    aggregation: str = "token-mean",
    log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP,
    penalty: torch.Tensor | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, PPOStats]:
    """PPO clipped surrogate per token, times the IS weight, averaged over real tokens, plus a penalty.

    Per real token with ``r = exp(clamp(logp_new - logp_old, -c, c))`` and advantage ``A``:
    ``loss_t = w_t * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` (to minimize); with ``dual_clip`` ``C``
    (dual-clip PPO, NeMo-RL's ``ratio_clip_c``) a token with ``A < 0`` loses at most ``-A C``. ``penalty`` (the KL to
    the reference policy, :func:`megatron_fp8.rl.algorithm.kl.per_token_kl` times ``beta``) is aggregated the same way
    and added without the IS weight.

    Args:
        logp_new: ``[B, T]`` log-probs under the policy being trained (carries the gradient).
        logp_old: ``[B, T]`` log-probs under the policy that the advantages refer to (detached here).
        advantages: ``[B, T]`` per token or ``[B]`` per sequence (broadcast), detached here.
        response_mask: ``[B, T]`` bool/0-1, True on real response tokens.
        clip_low: lower clip ``epsilon`` (ratio floor ``1 - clip_low``), in [0, 1).
        clip_high: upper clip ``epsilon`` (ratio ceiling ``1 + clip_high``), >= 0.
        is_weights: ``[B, T]`` weights, an :class:`ISResult`, or None (all ones).
        aggregation: one of :data:`LOSS_AGGREGATIONS`.
        log_ratio_clamp: bound on ``|logp_new - logp_old|`` before ``exp``.
        penalty: ``[B, T]`` per-token penalty (0 on padding), or ``None``.
        dual_clip: ``C > 1``, the bound of a negative-advantage token's loss (``None``: no dual clip).

    Returns:
        ``(loss, stats)``: a 0-d float32 tensor with a gradient w.r.t. ``logp_new``,
        and :class:`PPOStats`.

    Raises:
        ConfigError: unknown aggregation, bad clip values, or mismatched shapes.
    """
    if aggregation not in LOSS_AGGREGATIONS:
        raise ConfigError(f"unknown loss aggregation {aggregation!r}; valid names: {sorted(LOSS_AGGREGATIONS)}")
    if not (0.0 <= clip_low < 1.0) or clip_high < 0.0:
        raise ConfigError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ConfigError(f"loss_fn.ratio_clip_c (dual clip) must be > 1 (or null), got {dual_clip}")
    _check_pair(logp_new, logp_old, response_mask, ("logp_new", "logp_old", "response_mask"))
    real = response_mask.bool()
    real_f = real.float()
    if advantages.dim() == 1 and advantages.shape[0] == logp_new.shape[0]:
        advantages = advantages[:, None].expand_as(logp_new)
    if advantages.shape != logp_new.shape:
        raise ConfigError(
            f"advantages must be [B] or [B, T] matching logp_new {tuple(logp_new.shape)}, got {tuple(advantages.shape)}"
        )
    adv = torch.where(real, advantages.detach().float(), torch.zeros_like(real_f))

    if isinstance(is_weights, ISResult):
        weights = is_weights.weights
    elif is_weights is None:
        weights = real_f
    else:
        weights = is_weights
    if weights.shape != logp_new.shape:
        raise ConfigError(f"is_weights shape {tuple(weights.shape)} != logp_new shape {tuple(logp_new.shape)}")
    weights = torch.where(real, weights.detach().float(), torch.zeros_like(real_f))

    new = logp_new.float()
    old = logp_old.detach().float()
    # where() before exp: padding may hold -inf/NaN, and where's backward sends 0 (not NaN) there.
    log_r = torch.where(real, new - old, torch.zeros_like(new)).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_r)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.maximum(unclipped, clipped)
    if dual_clip is not None:  # dual-clip PPO (arXiv:1912.09729): a negative advantage's loss is at most -A C
        surrogate = torch.where(adv < 0, torch.minimum(surrogate, -adv * dual_clip), surrogate)
    per_token = surrogate * weights
    loss = LOSS_AGGREGATIONS[aggregation](per_token, real_f)
    if penalty is not None:
        if penalty.shape != logp_new.shape:
            raise ConfigError(f"penalty shape {tuple(penalty.shape)} != logp_new shape {tuple(logp_new.shape)}")
        penalty_term = LOSS_AGGREGATIONS[aggregation](torch.where(real, penalty, torch.zeros_like(real_f)), real_f)
        loss = loss + penalty_term
    else:
        penalty_term = torch.zeros((), dtype=torch.float32, device=loss.device)

    with torch.no_grad():
        n = real_f.sum().clamp(min=1.0)
        lr = log_r.detach()
        r = ratio.detach()
        stats = PPOStats(
            clip_fraction=(((clipped > unclipped).float() * real_f).sum() / n).detach(),
            approx_kl=(((r - 1.0 - lr) * real_f).sum() / n),
            ratio_mean=((r * real_f).sum() / n),
            is_weight_mean=((weights * real_f).sum() / n),
            tokens=real_f.sum(),
            kl_penalty=penalty_term.detach(),
        )
    return loss, stats


def loss_units(response_mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """What a loss aggregation averages over: real tokens (``token-mean``) or sequences with at least one."""
    real = response_mask.bool()
    units = real.sum() if aggregation == "token-mean" else real.any(dim=-1).sum()
    return units.float()


def token_weighted(stats: Sequence[PPOStats]) -> dict[str, float]:
    """One update's PPO statistics over its micro-batches: token-weighted means, ``tokens`` summed."""
    floats = [s.as_floats() for s in stats]
    if len(floats) == 1:
        return floats[0]
    tokens = sum(f["tokens"] for f in floats)
    out = {k: sum(f[k] * f["tokens"] for f in floats) / max(tokens, 1.0) for k in floats[0] if k != "tokens"}
    return out | {"tokens": tokens}
