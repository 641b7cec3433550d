"""Sampling, generation loop and token logprobs of the reference FP8 engine.

Part of :mod:`megatron_fp8.rollout.reference`, an emulator and oracle of vLLM's
FP8 W8A8 blockwise numerics for CPU machines; NOT a serving engine (on GPU use vLLM).

:func:`generate` prefills a batch into a KV cache and decodes one token per
step, greedy or sampled as vLLM samples (temperature, top-p, Gumbel-max in
exponential form with one seeded generator per sequence); :func:`score`
computes teacher-forced logprobs of response tokens. Because every per-token
forward result is independent of the batch and of prefill vs decode, a
generated token's logprob equals :func:`score` of the finished sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.rollout.reference.forward import ReferenceForward


@dataclass(frozen=True)
class GenerationResult:
    """Output of :meth:`ReferenceFP8Engine.generate` (reference FP8 engine: a CPU emulator and
    oracle of vLLM's FP8 W8A8 blockwise numerics, NOT a serving engine; on GPU use vLLM).

    Attributes:
        token_ids: per sequence, the generated (response) token ids, EOS included.
        logprobs: per sequence, float32 ``[len(token_ids[i])]`` log-probabilities of
            the generated tokens under the engine's distribution: ``log_softmax(logits / T)``
            for ``temperature = T > 0`` (before top-p truncation), ``log_softmax(logits)``
            for greedy decoding.
        finish_reasons: per sequence, one of :data:`megatron_fp8.vocab.FINISH_REASONS`.
    """

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[torch.Tensor, ...]
    finish_reasons: tuple[str, ...]


def as_token_lists(seqs: Sequence[Sequence[int]] | torch.Tensor, what: str) -> list[list[int]]:
    """Token-id lists from a list of sequences or a ``[B, L]`` tensor.

    Raises:
        ConfigError: a tensor that is not 2-D, or no sequences (``what`` names the caller).
    """
    if isinstance(seqs, torch.Tensor):
        if seqs.dim() != 2:
            raise ConfigError(
                f"{what}: expected a list of token-id lists or a 2-D tensor, got shape {tuple(seqs.shape)}"
            )
        return [list(map(int, row)) for row in seqs.tolist()]
    out = [list(map(int, s)) for s in seqs]
    if not out:
        raise ConfigError(f"{what}: no sequences given")
    return out


def check_ready(model: ReferenceForward, seqs: list[list[int]], extra: int, what: str) -> None:
    """Refuse to run before every weight was loaded, or on sequences the model cannot take.

    Args:
        model: the forward (its weight store and config).
        seqs: the token ids.
        extra: positions needed past each sequence (tokens to generate).
        what: the caller, for messages.

    Raises:
        ConfigError: unloaded weights, an empty sequence, a token id outside the
            vocabulary, or a sequence longer than ``max_position_embeddings``.
    """
    missing = model.weights.missing_weights()
    if missing:
        raise ConfigError(
            f"{what}: {len(missing)} weights were never loaded (e.g. {missing[:3]}); call load_weights or "
            "from_hf_checkpoint first"
        )
    vocab = model.config.vocab_size
    for j, s in enumerate(seqs):
        if not s:
            raise ConfigError(f"{what}: sequence {j} is empty")
        bad = [tok for tok in s if not 0 <= tok < vocab]
        if bad:
            raise ConfigError(f"{what}: sequence {j} has token ids {bad[:4]} outside [0, {vocab})")
        if len(s) + extra > model.config.max_position_embeddings:
            raise ConfigError(
                f"{what}: sequence {j} needs {len(s) + extra} positions, max_position_embeddings is "
                f"{model.config.max_position_embeddings}"
            )


@torch.no_grad()
def score(
    model: ReferenceForward,
    input_ids: Sequence[Sequence[int]] | torch.Tensor,
    *,
    response_start: int | Sequence[int],
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """Teacher-forced log-probabilities of the response tokens.

    Args:
        model: the forward to score with.
        input_ids: per sequence, prompt + response token ids (lengths may differ),
            or a ``[B, L]`` tensor.
        response_start: index of the first response token (int for all, or one per
            sequence), at least 1.
        temperature: logits are divided by it before ``log_softmax`` (> 0; use
            1.0 to compare with greedy :func:`generate`).

    Returns:
        per sequence a float32 tensor ``[len - response_start]``: ``log p(x_t | x_<t)``.
    """
    seqs = as_token_lists(input_ids, "score")
    starts = [int(response_start)] * len(seqs) if isinstance(response_start, int) else list(response_start)
    if len(starts) != len(seqs):
        raise ConfigError(f"score: {len(starts)} response_start values for {len(seqs)} sequences")
    if not temperature > 0:
        raise ConfigError(f"score: temperature must be > 0, got {temperature}")
    check_ready(model, seqs, 0, "score")
    for j, (s, rs) in enumerate(zip(seqs, starts, strict=True)):
        if not 1 <= rs <= len(s):
            raise ConfigError(f"score: response_start={rs} for sequence {j} of length {len(s)}; need 1..len")
    hidden, _ = model.prefill(seqs, max(len(s) for s in seqs))
    out: list[torch.Tensor] = []
    for j, (s, rs) in enumerate(zip(seqs, starts, strict=True)):
        logits = model.logits(hidden[j, rs - 1 : len(s) - 1]).to(torch.float32) / temperature
        lp = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(s[rs:], dtype=torch.long)
        out.append(lp.gather(1, targets[:, None])[:, 0] if targets.numel() else lp.new_zeros(0))
    return out


def pick(
    logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row and return it with its logprob.

    Args:
        logits: ``[B, vocab]`` logits.
        temperature: 0.0 for greedy (argmax), else sample from ``softmax(logits / T)``.
        top_p: nucleus mass in (0, 1]: the smallest-probability tokens whose
            cumulative mass is ``<= 1 - top_p`` are dropped (the most likely one is kept).
        generators: one per row when sampling (``None`` for greedy).

    Returns:
        long ``[B]`` token ids and float32 ``[B]`` logprobs (of the untruncated distribution).
    """
    lf = logits.to(torch.float32)
    if temperature == 0.0:
        tok = lf.argmax(dim=-1)
        return tok, torch.log_softmax(lf, dim=-1).gather(1, tok[:, None])[:, 0]
    scaled = lf / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    probs = logprobs.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1)  # ascending, as vLLM's top-p
        drop = sorted_p.cumsum(dim=-1) <= 1.0 - top_p
        drop[:, -1] = False  # always keep the most likely token
        probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
    assert generators is not None
    toks = []
    for row, g in zip(probs, generators, strict=True):
        noise = torch.empty_like(row).exponential_(generator=g)
        toks.append(int((row / noise).argmax()))  # Gumbel-max in exponential form, as vLLM samples
    tok = torch.tensor(toks, dtype=torch.long)
    return tok, logprobs.gather(1, tok[:, None])[:, 0]


@torch.no_grad()
def generate(
    model: ReferenceForward,
    prompt_token_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | Iterable[int] | None = None,
) -> GenerationResult:
    """Generate continuations with a batched KV cache.

    Args:
        model: the forward to generate with.
        prompt_token_ids: per sequence the prompt token ids (lengths may differ).
        max_new_tokens: tokens to generate per sequence at most (>= 1).
        temperature: 0.0 for greedy decoding, > 0 to sample from ``softmax(logits / T)``.
        top_p: nucleus sampling mass in (0, 1] (sampling only).
        seed: sequence ``j`` samples from ``torch.Generator().manual_seed(seed + j)``,
            so a result does not depend on the rest of the batch.
        eos_token_id: token id(s) that finish a sequence (kept in the output).

    Returns:
        :class:`GenerationResult`.
    """
    seqs = as_token_lists(prompt_token_ids, "generate")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if temperature < 0:
        raise ConfigError(f"generate: temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"generate: top_p must be in (0, 1], got {top_p}")
    eos = set() if eos_token_id is None else ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
    check_ready(model, seqs, max_new_tokens, "generate")
    b = len(seqs)
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    hidden, cache = model.prefill(seqs, int(lens.max()) + max_new_tokens)
    logits = model.logits(hidden[torch.arange(b), lens - 1])
    generators = [torch.Generator().manual_seed(seed + j) for j in range(b)] if temperature > 0 else None
    tokens: list[list[int]] = [[] for _ in range(b)]
    lps: list[list[float]] = [[] for _ in range(b)]
    reasons: list[str | None] = [None] * b
    for step in range(max_new_tokens):
        tok, lp = pick(logits, temperature, top_p, generators)
        for j in range(b):
            if reasons[j] is not None:
                continue
            tokens[j].append(int(tok[j]))
            lps[j].append(float(lp[j]))
            if int(tok[j]) in eos:
                reasons[j] = "stop"
            elif len(tokens[j]) == max_new_tokens:
                reasons[j] = "length"
        if all(r is not None for r in reasons):
            break
        pos = (lens + step)[:, None]
        logits = model.logits(model.hidden(tok[:, None], pos, cache)[:, 0])
    return GenerationResult(
        token_ids=tuple(tuple(t) for t in tokens),
        logprobs=tuple(torch.tensor(v, dtype=torch.float32) for v in lps),
        finish_reasons=tuple(r or "length" for r in reasons),
    )
