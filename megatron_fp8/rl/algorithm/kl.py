"""The KL penalty to the reference policy (NeMo-RL's ``loss_fn.reference_policy_kl_penalty`` and its options).

Per real response token, with ``log_r = clamp(logp_ref - logp, -c_in, c_in)`` (``kl_input_clamp_value``):

======  =====================================
``k1``  ``-log_r``
``k2``  ``log_r**2 / 2``
``k3``  ``exp(log_r) - 1 - log_r`` (>= 0)
======  =====================================

(Schulman's estimators of KL(pi || pi_ref) from tokens sampled by pi, :data:`megatron_fp8.vocab.KL_ESTIMATORS`.)
Each estimate is multiplied by an importance weight ``w``: ``exp(logp - sg(logp))`` (value 1; its gradient adds the
score-function term of an estimate over tokens the policy itself sampled) or, with
``use_on_policy_kl_approximation``, ``exp(logp - logp_rollout)`` (the tokens came from the rollout policy). Where
the input clamp is active, ``w`` is detached. Then the estimate is clamped to ``[-c_out, c_out]``
(``kl_output_clamp_value``), multiplied by ``beta`` and averaged like the policy-gradient term (token mean, or
per sequence then over sequences). The term is added to the PPO loss; it does not take the IS correction's
weights. This is the loss NeMo-RL's clipped policy-gradient loss computes for the same keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.vocab import KL_ESTIMATORS


def _k1(log_r: torch.Tensor) -> torch.Tensor:
    return -log_r


def _k2(log_r: torch.Tensor) -> torch.Tensor:
    return log_r * log_r / 2


def _k3(log_r: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_r) - 1 - log_r


_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}
assert set(_ESTIMATORS) == set(KL_ESTIMATORS)


@dataclass(frozen=True)
class KLSettings:
    """The KL penalty of ``loss_fn``.

    Attributes:
        coef: ``beta`` (``reference_policy_kl_penalty``), >= 0.
        kind: a key of :data:`~megatron_fp8.vocab.KL_ESTIMATORS`.
        input_clamp: bound on ``|log(pi_ref / pi)|`` (``None``: none), > 0.
        output_clamp: bound on the per-token estimate (``None``: none), > 0.
        on_policy_approximation: weight by ``pi / pi_rollout`` instead of 1.
    """

    coef: float
    kind: str = "k3"
    input_clamp: float | None = 20.0
    output_clamp: float | None = 10.0
    on_policy_approximation: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _ESTIMATORS:
            raise ConfigError(f"unknown KL estimator {self.kind!r}; valid: {sorted(_ESTIMATORS)}")
        if self.coef < 0:
            raise ConfigError(f"the KL penalty weight must be >= 0, got {self.coef}")
        for name in ("input_clamp", "output_clamp"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"KL {name} must be > 0 or None, got {value}")


def per_token_kl(
    logp: torch.Tensor,
    logp_ref: torch.Tensor,
    settings: KLSettings,
    *,
    mask: torch.Tensor,
    logp_rollout: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weighted, clamped per-token estimate (module docstring), before ``beta`` and the mean.

    Args:
        logp: ``[B, T]`` float32 log-probs of the policy being trained (carries the gradient).
        logp_ref: ``[B, T]`` log-probs of the same tokens under the reference policy (detached here).
        settings: the estimator and clamps.
        mask: ``[B, T]`` bool/0-1, True on real response tokens.
        logp_rollout: ``[B, T]`` rollout log-probs; needed with ``on_policy_approximation``.

    Returns:
        ``[B, T]`` float32, exactly 0 (with zero gradient) on padding.
    """
    real = mask.bool()
    zero = torch.zeros_like(logp, dtype=torch.float32)
    # where() before exp: padding may hold -inf/NaN, and where's backward sends 0 (not NaN) there
    logp = torch.where(real, logp.float(), zero)
    log_r = torch.where(real, logp_ref.detach().float(), zero) - logp
    if settings.on_policy_approximation:
        if logp_rollout is None:
            raise ConfigError("use_on_policy_kl_approximation needs the rollout log-probs")
        weight = torch.exp(logp - torch.where(real, logp_rollout.detach().float(), zero))
    else:
        weight = torch.exp(logp - logp.detach())
    weight = torch.nan_to_num(weight, nan=0.0, posinf=0.0, neginf=0.0)
    if settings.input_clamp is not None:
        clamped = log_r.clamp(-settings.input_clamp, settings.input_clamp)
        weight = torch.where(log_r == clamped, weight, weight.detach())
        log_r = clamped
    kl = weight * _ESTIMATORS[settings.kind](log_r)
    if settings.output_clamp is not None:
        kl = kl.clamp(-settings.output_clamp, settings.output_clamp)
    return kl
