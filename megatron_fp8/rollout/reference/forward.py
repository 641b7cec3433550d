"""Model forward of the reference FP8 engine (Qwen3 dense and Qwen3-MoE, HF semantics).

Part of :mod:`megatron_fp8.rollout.reference`, an emulator and oracle of vLLM's
FP8 W8A8 blockwise numerics for CPU machines; NOT a serving engine (on GPU use vLLM).

:class:`ReferenceForward` runs a batched forward over the tensors of a
:class:`~megatron_fp8.rollout.reference.weights.WeightStore` with a KV cache
and per-sequence positions: embeddings, RMSNorm, RoPE, attention over the
(optionally FP8-emulated) KV cache, dense MLP or sparse MoE, final norm and
logits. FP8 linears run vLLM's dynamic W8A8 blockwise GEMM
(:func:`~megatron_fp8.rollout.reference.linear.w8a8_block_fp8_linear`), the
others :func:`~megatron_fp8.rollout.reference.linear.bf16_linear`.

Numerics (bfloat16 activations): RMSNorm in float32 (``weight * x_normed.to(bf16)``);
RoPE with cos/sin rounded to bfloat16, the rotation in float32, rounded once;
FP8 KV cache stores ``fp8(clamp(x / scale, +-448))`` and reads ``q * scale``;
attention softmax and products in float64, one rounding of the output;
SiLU-and-mul in float32, rounded once; router softmax / top-k in float32, MoE
routing weights applied to the float32 expert output. Every per-token result is
independent of the batch and of prefill vs decode.
"""

from __future__ import annotations

import torch

from megatron_fp8.quant.formats import FP8_DTYPE, FP8_MAX, KV_CACHE_DTYPES
from megatron_fp8.rollout.reference.config import ReferenceModelConfig
from megatron_fp8.rollout.reference.linear import bf16_linear, w8a8_block_fp8_linear
from megatron_fp8.rollout.reference.weights import WeightStore
from megatron_fp8.vocab import SCALE_SUFFIX


class KVCache:
    """Per-layer K/V storage ``[B, kv_heads, max_len, head_dim]`` in the cache dtype.

    Args:
        cfg: the model (layers, KV heads, head dim).
        batch: sequences B.
        max_len: positions per sequence.
        dtype: bfloat16, or float8_e4m3fn for an emulated FP8 cache.
    """

    def __init__(self, cfg: ReferenceModelConfig, batch: int, max_len: int, dtype: torch.dtype):
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.max_len = max_len


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cache_write(store: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, scale: torch.Tensor) -> None:
    b, t = pos.shape
    bidx = torch.arange(b)[:, None].expand(b, t)
    if store.dtype == FP8_DTYPE:
        values = (values.to(torch.float32) / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    store[bidx, :, pos] = values


def _cache_read(store: torch.Tensor, length: int, scale: torch.Tensor) -> torch.Tensor:
    vals = store[:, :, :length].to(torch.float64)
    if store.dtype == FP8_DTYPE:
        vals = vals * scale.to(torch.float64)
    return vals


class ReferenceForward:
    """The batched forward of a Qwen3 / Qwen3-MoE model over a weight store.

    Args:
        weights: the held tensors (read live: a commit changes what the next forward computes).
        kv_cache_dtype: a key of :data:`~megatron_fp8.quant.formats.KV_CACHE_DTYPES`
            (checked by the engine).

    Attributes:
        weights: the weight store.
        config: its model config.
        kv_cache_dtype: the KV-cache dtype name.
    """

    def __init__(self, weights: WeightStore, *, kv_cache_dtype: str):
        self.weights = weights
        self.config: ReferenceModelConfig = weights.model_config
        self.kv_cache_dtype = kv_cache_dtype
        hd = self.config.head_dim
        self._inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))

    def _w(self, name: str) -> torch.Tensor:
        return self.weights.tensors[name]

    def linear(self, x: torch.Tensor, name: str, *, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for weight ``name``: W8A8 blockwise if it is FP8, else the BF16 GEMM.

        Args:
            x: ``[..., K]`` bfloat16 activations.
            name: the weight's HF name (its bias, if held, is ``name`` with ``bias`` for ``weight``).
            out_dtype: bfloat16, or float32 (the accumulator, for MoE experts).

        Returns:
            ``[..., N]`` tensor in ``out_dtype``.
        """
        tensors = self.weights.tensors
        bias_name = name[: -len("weight")] + "bias"
        bias = tensors.get(bias_name)
        if name in self.weights.fp8_names:
            quant = self.weights.quant_config
            assert quant is not None
            return w8a8_block_fp8_linear(
                x,
                tensors[name],
                tensors[name + SCALE_SUFFIX],
                block_size=quant.block_size,
                bias=bias,
                activation_scale_format=quant.activation_scale_format,
                out_dtype=out_dtype,
                name=name,
                weight_f64=self.weights.weight_f64(name),
            )
        lead = x.shape[:-1]
        y = bf16_linear(x.reshape(-1, x.shape[-1]), tensors[name], bias=bias, out_dtype=out_dtype, name=name)
        return y.view(*lead, y.shape[-1])

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        freqs = pos.to(torch.float32)[..., None] * self._inv_freq  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(torch.bfloat16).to(torch.float32)[:, :, None, :]
        sin = emb.sin().to(torch.bfloat16).to(torch.float32)[:, :, None, :]
        xf = x.to(torch.float32)
        return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)

    def _attention(self, i: int, x: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cfg = self.config
        b, t, _ = x.shape
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        a = f"model.layers.{i}.self_attn"
        q = self.linear(x, f"{a}.q_proj.weight").view(b, t, nh, hd)
        k = self.linear(x, f"{a}.k_proj.weight").view(b, t, nkv, hd)
        v = self.linear(x, f"{a}.v_proj.weight").view(b, t, nkv, hd)
        q = self._rope(_rms_norm(q, self._w(f"{a}.q_norm.weight"), cfg.rms_norm_eps), pos)
        k = self._rope(_rms_norm(k, self._w(f"{a}.k_norm.weight"), cfg.rms_norm_eps), pos)
        k_scale, v_scale = self._w(f"{a}.attn.k_scale"), self._w(f"{a}.attn.v_scale")
        _cache_write(cache.k[i], k, pos, k_scale)
        _cache_write(cache.v[i], v, pos, v_scale)
        length = int(pos.max()) + 1
        keys = _cache_read(cache.k[i], length, k_scale).repeat_interleave(nh // nkv, dim=1)  # [B, nh, S, hd]
        vals = _cache_read(cache.v[i], length, v_scale).repeat_interleave(nh // nkv, dim=1)
        scores = q.to(torch.float64).transpose(1, 2) @ keys.transpose(2, 3) * (hd**-0.5)  # [B, nh, T, S]
        allowed = torch.arange(length)[None, None, :] <= pos[:, :, None]  # [B, T, S]
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ vals  # [B, nh, T, hd]
        out = out.transpose(1, 2).reshape(b, t, nh * hd).to(torch.bfloat16)
        return self.linear(out, f"{a}.o_proj.weight")

    def _mlp(self, prefix: str, x: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        g = self.linear(x, f"{prefix}.gate_proj.weight")
        u = self.linear(x, f"{prefix}.up_proj.weight")
        act = (torch.nn.functional.silu(g.to(torch.float32)) * u.to(torch.float32)).to(torch.bfloat16)
        return self.linear(act, f"{prefix}.down_proj.weight", out_dtype=out_dtype)

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        lead, h = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, h)
        router_logits = self.linear(x2, f"model.layers.{i}.mlp.gate.weight")  # bf16 [M, E]
        probs = torch.softmax(router_logits.to(torch.float32), dim=-1)
        top_w, top_i = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
        if cfg.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = torch.zeros((x2.shape[0], h), dtype=torch.float32)
        for e in range(cfg.num_experts):
            rows, slot = (top_i == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self._mlp(f"model.layers.{i}.mlp.experts.{e}", x2[rows], out_dtype=torch.float32)
            out.index_add_(0, rows, (y * top_w[rows, slot, None]).to(torch.bfloat16).to(torch.float32))
        return out.to(torch.bfloat16).view(*lead, h)

    def hidden(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Final-norm hidden states of tokens ``ids`` at positions ``pos``, writing their K/V into ``cache``.

        Args:
            ids: long ``[B, T]`` token ids.
            pos: long ``[B, T]`` positions (earlier positions must already be in ``cache``).
            cache: the KV cache of the batch.

        Returns:
            bfloat16 ``[B, T, H]``.
        """
        cfg = self.config
        h = self._w("model.embed_tokens.weight")[ids]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            h = h + self._attention(
                i, _rms_norm(h, self._w(f"{p}.input_layernorm.weight"), cfg.rms_norm_eps), pos, cache
            )
            x = _rms_norm(h, self._w(f"{p}.post_attention_layernorm.weight"), cfg.rms_norm_eps)
            h = h + (self._moe(i, x) if cfg.is_moe_layer(i) else self._mlp(f"{p}.mlp", x))
        return _rms_norm(h, self._w("model.norm.weight"), cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """bfloat16 ``[..., vocab]`` logits of hidden states ``[..., H]`` (``lm_head`` or tied embeddings)."""
        name = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        return self.linear(hidden, name)

    def prefill(self, seqs: list[list[int]], cache_len: int) -> tuple[torch.Tensor, KVCache]:
        """Run whole sequences (right-padded to the longest) through a fresh KV cache.

        Args:
            seqs: per sequence its token ids (validated by the caller).
            cache_len: positions the new cache holds per sequence (>= the longest sequence).

        Returns:
            bfloat16 hidden states ``[B, max_len, H]`` (rows past a sequence's length are padding)
            and the filled cache.
        """
        lens = [len(s) for s in seqs]
        t = max(lens)
        ids = torch.zeros((len(seqs), t), dtype=torch.long)
        for j, s in enumerate(seqs):
            ids[j, : len(s)] = torch.tensor(s, dtype=torch.long)
        pos = torch.arange(t)[None, :].expand(len(seqs), t)
        cache = KVCache(self.config, len(seqs), cache_len, KV_CACHE_DTYPES[self.kv_cache_dtype])
        with torch.no_grad():
            return self.hidden(ids, pos, cache), cache
