"""Train/rollout mismatch metrics, logged once per RL step.

All estimates use the rollout's own samples (tokens drawn from ``pi_rollout``)
and are means over real response tokens (or over sequences that have at least
one real token), computed in float64. With ``d_t = logp_train_t - logp_rollout_t``
(clamped to ``[-c, c]``, c = 20) and the importance ratio ``r_t = exp(d_t) =
pi_train / pi_rollout``:

===========================  ==================================================================
key                          definition
===========================  ==================================================================
``token_mult_prob_error``    ``mean(exp(|d|))``; 1 means identical probabilities
``gen_kl_k1``                KL(pi_rollout || pi_train), samples from pi_rollout: ``mean(-d)``
``gen_kl_k3``                same KL, low-variance k3 estimator: ``mean(r - 1 - log r)`` (>= 0)
``policy_kl_k1``             KL(pi_train || pi_rollout) by importance sampling from pi_rollout:
                             ``E_train[log(p_t/p_r)] = E_rollout[r log r]`` -> ``mean(r d)``
``policy_kl_k3``             same KL, k3 form ``E_train[(1/r) - 1 + log r]`` reweighted by r:
                             ``mean(1 - r + r d)`` (>= 0 per token)
``js_divergence``            Jensen-Shannon (nats) with ``m = (p_r + p_t)/2``:
                             ``0.5 E_r[log(p_r/m)] + 0.5 E_t[log(p_t/m)]``
                             ``= mean(0.5 log(2/(1+r)) + 0.5 r log(2r/(1+r)))`` (>= 0 per token)
``chi2_token``               ``mean(r^2) - 1`` (chi-square divergence of the token ratio; unbiased
                             because E_rollout[r] = 1, so a finite sample can give a value < 0)
``chi2_seq``                 ``mean_seq(W^2) - 1``, ``W = exp(clamp(sum_t d_t, -c, c))``
``ess_token``                ``(sum r)^2 / (n sum r^2)`` in (0, 1]: normalized effective sample size
``ess_seq``                  same with sequence weights ``W`` and n = number of sequences
``ppl_train`` / ``_rollout``  ``exp(mean NLL)`` of the sampled tokens under each policy
``ppl_ratio``                ``ppl_train / ppl_rollout = exp(gen_kl_k1)``
``logp_abs_diff_mean/max``   mean / max of ``|d|``
``is_truncated_fraction``    from the :class:`~megatron_fp8.rl.algorithm.correction.ISResult` when given
``is_masked_fraction``       idem
``is_weight_mean``           mean IS weight over real tokens, idem
``tokens`` / ``sequences``   counts used as denominators
===========================  ==================================================================

The KL/JS/chi-square values are per-token (or per-sequence for ``_seq``) Monte
Carlo averages at the sampled contexts, not exact divergences of the full
next-token distributions. With no real token every divergence is 0, every ratio,
ESS and ``token_mult_prob_error`` is 1, and perplexities are 1 (neutral values,
never NaN).
"""

from __future__ import annotations

import math

import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.rl.algorithm.correction import DEFAULT_LOG_RATIO_CLAMP, ISResult
from megatron_fp8.vocab import MISMATCH_METRICS

METRIC_KEYS: tuple[str, ...] = MISMATCH_METRICS
"""Keys always present in :func:`mismatch_metrics`' result (declared in :data:`megatron_fp8.vocab.MISMATCH_METRICS`)."""


def _ess(w: torch.Tensor) -> float:
    n = w.numel()
    if n == 0:
        return 1.0
    sq = float((w * w).sum())
    if sq == 0.0:
        return 1.0
    return float(w.sum()) ** 2 / (n * sq)


def mismatch_metrics(
    logp_train: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_result: ISResult | None = None,
    log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP,
) -> dict[str, float]:
    """Mismatch between the trainer's and vLLM's log-probs of the rollout tokens.

    Args:
        logp_train: ``[B, T]`` log-probs (nats) of the sampled tokens under the trainer.
        logp_rollout: ``[B, T]`` log-probs reported by vLLM for the same tokens.
        mask: ``[B, T]`` bool/0-1, True on real response tokens.
        is_result: the correction applied this step, to log its fractions.
        log_ratio_clamp: bound on ``|d|`` before ``exp``.

    Returns:
        ``{key: float}`` with the keys of :data:`METRIC_KEYS` (see the module docstring),
        plus ``is_truncated_fraction``, ``is_masked_fraction`` and ``is_weight_mean`` when
        ``is_result`` is given.

    Raises:
        ConfigError: shapes disagree, or a real token's log-prob is not finite.
    """
    for t, n in ((logp_train, "logp_train"), (logp_rollout, "logp_rollout"), (mask, "mask")):
        if t.dim() != 2 or t.shape != logp_train.shape:
            raise ConfigError(
                f"{n} must be [batch, tokens] like logp_train {tuple(logp_train.shape)}, got {tuple(t.shape)}"
            )
    real = mask.bool().cpu()
    lt = logp_train.detach().double().cpu()
    lr = logp_rollout.detach().double().cpu()
    for t, n in ((lt, "logp_train"), (lr, "logp_rollout")):
        if not torch.isfinite(t[real]).all():
            raise ConfigError(f"{n} is not finite on a real response token; metrics need finite log-probs there")
    zero = torch.zeros_like(lt)
    d = torch.where(real, lt - lr, zero).clamp(-log_ratio_clamp, log_ratio_clamp)
    n_tok = int(real.sum())
    has_tok = real.any(dim=-1)
    n_seq = int(has_tok.sum())

    dv = d[real]
    rv = torch.exp(dv)
    seq_w = torch.exp(d.sum(dim=-1).clamp(-log_ratio_clamp, log_ratio_clamp))[has_tok]

    def mean(x: torch.Tensor, default: float = 0.0) -> float:
        return float(x.mean()) if x.numel() else default

    nll_train = mean(-lt[real])
    nll_rollout = mean(-lr[real])
    out = {
        "token_mult_prob_error": mean(torch.exp(dv.abs()), 1.0),
        "gen_kl_k1": mean(-dv),
        "gen_kl_k3": mean(rv - 1.0 - dv),
        "policy_kl_k1": mean(rv * dv),
        "policy_kl_k3": mean(1.0 - rv + rv * dv),
        "js_divergence": mean(0.5 * torch.log(2.0 / (1.0 + rv)) + 0.5 * rv * torch.log(2.0 * rv / (1.0 + rv))),
        "chi2_token": mean(rv * rv, 1.0) - 1.0,
        "chi2_seq": mean(seq_w * seq_w, 1.0) - 1.0,
        "ess_token": _ess(rv),
        "ess_seq": _ess(seq_w),
        "ppl_train": math.exp(nll_train),
        "ppl_rollout": math.exp(nll_rollout),
        "ppl_ratio": math.exp(nll_train - nll_rollout),
        "logp_abs_diff_mean": mean(dv.abs()),
        "logp_abs_diff_max": float(dv.abs().max()) if n_tok else 0.0,
        "tokens": float(n_tok),
        "sequences": float(n_seq),
    }
    if is_result is not None:
        if is_result.weights.shape != logp_train.shape:
            raise ConfigError(
                f"is_result.weights shape {tuple(is_result.weights.shape)} != logp_train shape "
                f"{tuple(logp_train.shape)}; pass the ISResult computed for this batch"
            )
        out["is_truncated_fraction"] = float(is_result.truncated_fraction)
        out["is_masked_fraction"] = float(is_result.masked_fraction)
        out["is_weight_mean"] = mean(is_result.weights.detach().double().cpu()[real], 1.0)
    return out
