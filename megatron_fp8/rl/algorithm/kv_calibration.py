"""FP8 KV-cache / attention scale calibration from the training forward.

vLLM with ``kv_cache_dtype="fp8"`` stores ``k / k_scale`` and ``v / v_scale`` in
e4m3 and, on FP8 attention backends, quantizes the query with ``q_scale``. The
scales are *multipliers* (``x ~= fp8 * scale``), one float32 per attention layer
and per tensor. After each training step this module turns what the trainer saw
into fresh scales (DESIGN.md, "KV scales"):

1. during the training forward, :class:`KVAmaxRecorder` keeps, per layer and per
   call, ``amax = max |x|`` of the query, key and value tensors (0-d device
   tensors: no host sync per call);
2. :func:`compute_kv_scales` takes per layer the ``percentile`` (default 99.9,
   linear interpolation, as ``torch.quantile``) of the per-call amaxes, the max
   over ranks (``all_reduce(MAX)``), multiplies by ``margin`` (1.05) and applies
   the project's scale rule ``scale = amax / 448`` (amax 0 -> 1.0, see
   :mod:`megatron_fp8.quant.formats`).

Which tensors are recorded: exactly those that reach the attention kernel, i.e.
what lands in the KV cache -- **k after k_norm (Qwen3's QK-norm) and after
RoPE**, **v straight from v_proj**, and q after q_norm and RoPE (q_scale is
applied to the rotated query). :func:`attach_kv_amax_hooks` wires this up:

* ``hf`` (Hugging Face Llama/Qwen-family attention: modules with ``q_proj``,
  ``k_proj``, ``v_proj``, ``layer_idx``): forward hooks on ``q_norm``/``k_norm``
  when present (else ``q_proj``/``k_proj``) and on ``v_proj``; a pre-hook on the
  attention module captures ``position_embeddings = (cos, sin)`` and a post-hook
  applies the model's own ``apply_rotary_pos_emb`` to q and k before recording;
* ``megatron`` (Megatron-Core ``SelfAttention``): a forward pre-hook on
  ``core_attention``, whose inputs are ``query [sq, b, np, hn]``,
  ``key/value [sq, b, ng, hn]`` after q/k layernorm and RoPE (``thd`` packing:
  ``[t, heads, hn]``). Layer index = ``layer_number - 1`` (global, so pipeline
  stages agree). ``megatron_source="linear_qkv"`` instead hooks the fused
  projection and splits it with :func:`split_megatron_qkv`; that sees q and k
  *before* QK-norm and RoPE (RoPE may raise an element by up to sqrt(2)), so it
  is exact only for v.

Megatron-Core's fused ``linear_qkv`` output layout (``SelfAttention.
get_query_key_value_tensors``): the last dim, per tensor-parallel partition, is
``ng`` query groups laid out one after another, each holding its ``np/ng`` query
heads, then its key head, then its value head, every head ``hn`` wide::

    [q_0 .. q_{np/ng-1}, k, v] (group 0) | [q .., k, v] (group 1) | ...

Names returned are vLLM's, ``model.layers.{i}.self_attn.attn.{q,k,v}_scale``
(float32, shape ``[]``). vLLM 0.32 loads them through ``KVCacheScaleParameter``
(accepts shape ``[]`` or ``[1]``) when the model was built with a quantization
config whose KV-cache method is active (``quantization="fp8"`` with an FP8 KV
cache); its ``get_cache_scale_mapper`` leaves this canonical form alone and also
maps ``...self_attn.{k,v}_proj.{k,v}_scale``, ``...self_attn.qkv_proj.{k,v}_scale``,
``...self_attn.{q,k,v}_scale`` and the deprecated ``...kv_scale`` onto it. After
``process_weights_after_loading`` vLLM deletes those parameters and keeps the
values in ``Attention._q_scale/_k_scale/_v_scale`` (+ ``_*_scale_float`` host
copies), so an in-place refit of scales must write those buffers.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from megatron_fp8.errors import ConfigError, NonFiniteError
from megatron_fp8.quant.formats import FP8_MAX, scale_from_amax
from megatron_fp8.vocab import KV_SCALE_KINDS, kv_scale_name

logger = logging.getLogger(__name__)


class KVAmaxRecorder:
    """Per-layer history of per-call ``max |q|``, ``max |k|``, ``max |v|``.

    ``record`` only launches an ``amax`` reduction and keeps the 0-d float32
    result on the tensor's device; nothing syncs with the host until
    :func:`compute_kv_scales`. Call :meth:`reset` after each calibration.

    Attributes:
        enabled: when False, :meth:`record` is a no-op (see :meth:`paused`).
    """

    def __init__(self) -> None:
        self.enabled: bool = True
        self._history: dict[int, list[torch.Tensor]] = {}

    def record(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add one call's amaxes for decoder layer ``layer_idx`` (0-based, global).

        Args:
            layer_idx: global decoder-layer index (same on every rank that holds the layer).
            q: query as it enters attention (any shape, float dtype).
            k: key as it is written to the KV cache.
            v: value as it is written to the KV cache.
        """
        if not self.enabled:
            return
        if layer_idx < 0:
            raise ConfigError(f"layer_idx must be >= 0, got {layer_idx}")
        with torch.no_grad():
            amax = torch.stack([_amax(t) for t in (q, k, v)])
        self._history.setdefault(int(layer_idx), []).append(amax)

    def layers(self) -> list[int]:
        """Sorted layer indices with at least one recorded call."""
        return sorted(self._history)

    def num_calls(self, layer_idx: int) -> int:
        """Number of calls recorded for ``layer_idx``."""
        return len(self._history.get(layer_idx, ()))

    def history(self, layer_idx: int) -> torch.Tensor:
        """float32 ``[calls, 3]`` on the CPU, columns q, k, v.

        Raises:
            ConfigError: nothing was recorded for ``layer_idx``.
        """
        calls = self._history.get(layer_idx)
        if not calls:
            raise ConfigError(f"no q/k/v amax recorded for layer {layer_idx}; recorded layers: {self.layers()}")
        return torch.stack([c.float() for c in calls]).cpu()

    def reset(self) -> None:
        """Forget every recorded call."""
        self._history.clear()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Context in which :meth:`record` does nothing (e.g. evaluation forwards)."""
        previous = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = previous


def _amax(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return t.detach().abs().amax().float()


def _reduce_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compute_kv_scales(
    recorder: KVAmaxRecorder,
    *,
    percentile: float = 99.9,
    margin: float = 1.05,
    group: dist.ProcessGroup | None = None,
    num_layers: int | None = None,
) -> dict[str, torch.Tensor]:
    """Per-layer q/k/v scales for vLLM from the recorded amaxes.

    ``scale = max_over_ranks(percentile_p(per-call amax)) * margin / 448`` (amax 0 ->
    1.0). When ``torch.distributed`` is initialized, every rank of ``group`` (the
    default world group when None) must call this; ranks may hold different layers
    (pipeline stages) -- a layer absent on a rank does not lower the maximum.

    Args:
        recorder: filled by :meth:`KVAmaxRecorder.record` during the step.
        percentile: in (0, 100]; 100 means the plain maximum.
        margin: head-room multiplier (>= 1 typical), > 0.
        group: process group for the max over ranks.
        num_layers: number of decoder layers of the whole model; every layer
            ``0 .. num_layers-1`` must have been recorded on some rank. Inferred as
            the largest recorded index + 1 (over ranks) when None.

    Returns:
        ``{"model.layers.{i}.self_attn.attn.{q,k,v}_scale": float32 tensor of shape []}``
        on the CPU, ordered by layer then q, k, v.

    Raises:
        ConfigError: bad percentile/margin, or a layer without any recorded call.
        NonFiniteError: a layer's amax is NaN/Inf (the forward produced non-finite q/k/v).
    """
    if not (0.0 < percentile <= 100.0):
        raise ConfigError(f"percentile must be in (0, 100], got {percentile}")
    if not (margin > 0.0 and margin < float("inf")):
        raise ConfigError(f"margin must be a positive finite number, got {margin}")
    distributed = dist.is_available() and dist.is_initialized()

    local_layers = recorder.layers()
    local_count = (local_layers[-1] + 1) if local_layers else 0
    if distributed:
        device = _reduce_device(group)
        count = torch.tensor([local_count], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        inferred = int(count.item())
    else:
        device = torch.device("cpu")
        inferred = local_count
    total = inferred if num_layers is None else int(num_layers)
    if total < inferred:
        raise ConfigError(
            f"num_layers={num_layers} but layer {inferred - 1} was recorded; pass the model's layer count"
        )
    if total == 0:
        raise ConfigError(
            "no q/k/v amax was recorded: attach the recorder with attach_kv_amax_hooks(model, recorder) "
            "(or call recorder.record) before the training forward"
        )

    # -1 marks "not recorded here"; amaxes are >= 0 (or NaN, caught below).
    table = torch.full((total, 3), -1.0, dtype=torch.float64)
    q = percentile / 100.0
    for layer in local_layers:
        hist = recorder.history(layer).double()
        if not torch.isfinite(hist).all():
            bad = KV_SCALE_KINDS[int((~torch.isfinite(hist)).any(dim=0).nonzero()[0])]
            name = kv_scale_name(layer, bad)
            raise NonFiniteError(
                f"{name}: the recorded {bad} amax is NaN/Inf in layer {layer}; the training forward produced "
                "non-finite activations, fix the step before calibrating (the previous scales stay valid)",
                name=name,
            )
        table[layer] = torch.quantile(hist, q, dim=0)
    if distributed:
        reduced = table.to(device)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        table = reduced.cpu()
    missing = [i for i in range(total) if bool((table[i] < 0).any())]
    if missing:
        raise ConfigError(
            f"no q/k/v amax recorded for layers {missing} on any rank; every attention layer must run a "
            "forward with the recorder attached (check the hooks cover all layers)"
        )
    scales = scale_from_amax((table * margin).float(), scale_format="fp32")
    out: dict[str, torch.Tensor] = {}
    for layer in range(total):
        for j, which in enumerate(KV_SCALE_KINDS):
            out[kv_scale_name(layer, which)] = scales[layer, j].clone().reshape(())
    logger.debug("KV scales for %d layers (max k_scale %.4g, FP8 max %g)", total, float(scales[:, 1].max()), FP8_MAX)
    return out


# --------------------------------------------------------------------------- hooks


@dataclass(frozen=True)
class KVHookHandle:
    """Handles of the hooks :func:`attach_kv_amax_hooks` registered; :meth:`remove` detaches them.

    Attributes:
        layers: global layer indices that got hooks, in module order.
        handles: the torch hook handles.
    """

    layers: tuple[int, ...]
    handles: tuple[RemovableHandle, ...] = field(repr=False)

    def remove(self) -> None:
        """Detach every hook (idempotent)."""
        for h in self.handles:
            h.remove()

    def __enter__(self) -> KVHookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _is_hf_attention(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "layer_idx", "head_dim"))


def _is_megatron_attention(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("linear_qkv", "core_attention", "layer_number"))


def _heads(t: torch.Tensor, lead: torch.Size, head_dim: int) -> torch.Tensor:
    """``[*lead, heads * head_dim]`` or ``[*lead, heads, head_dim]`` -> ``[*lead, heads, head_dim]``."""
    return t.reshape(*lead, -1, head_dim)


@dataclass
class _AttentionCapture:
    """What the hooks of one HF attention module saw during its current forward (mutable, reused per call)."""

    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    pos: tuple[torch.Tensor, torch.Tensor] | None = None

    def clear(self) -> None:
        self.q = self.k = self.v = None
        self.pos = None


def _first_output(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _attach_hf(model: nn.Module, recorder: KVAmaxRecorder, **_: object) -> KVHookHandle:
    handles: list[RemovableHandle] = []
    layers: list[int] = []
    for name, attn in model.named_modules():
        if not _is_hf_attention(attn):
            continue
        rope_module = sys.modules.get(type(attn).__module__)
        apply_rope = getattr(rope_module, "apply_rotary_pos_emb", None)
        if apply_rope is None:
            raise ConfigError(
                f"{name}: cannot find apply_rotary_pos_emb in {type(attn).__module__}; use "
                "KVAmaxRecorder.record from the model code instead of attach_kv_amax_hooks"
            )
        layer_idx = int(attn.layer_idx)
        head_dim = int(attn.head_dim)
        capture = _AttentionCapture()
        q_src = attn.q_norm if hasattr(attn, "q_norm") else attn.q_proj
        k_src = attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj

        def keep(key: str, cap: _AttentionCapture = capture) -> Callable[..., None]:
            def hook(_m: nn.Module, _args: tuple[object, ...], output: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
                setattr(cap, key, _first_output(output))

            return hook

        def pre(
            _m: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], cap: _AttentionCapture = capture
        ) -> None:
            cap.clear()
            pos = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            cap.pos = pos if isinstance(pos, tuple) else None  # HF passes (cos, sin)

        def post(
            _m: nn.Module,
            _args: tuple[object, ...],
            _out: object,
            cap: _AttentionCapture = capture,
            idx: int = layer_idx,
            hd: int = head_dim,
            rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] = apply_rope,
            mod_name: str = name,
        ) -> None:
            if not recorder.enabled:
                cap.clear()
                return
            if cap.q is None or cap.k is None or cap.v is None:
                raise ConfigError(f"{mod_name}: q/k/v projections did not run inside the attention forward")
            if cap.pos is None:
                raise ConfigError(
                    f"{mod_name}: attention was called without position_embeddings=(cos, sin); cannot apply "
                    "RoPE to the recorded q/k"
                )
            cos, sin = cap.pos
            lead = cap.v.shape[:-1]  # v_proj output is [batch, tokens, kv_heads * head_dim]
            q, k = rope(_heads(cap.q, lead, hd), _heads(cap.k, lead, hd), cos, sin, unsqueeze_dim=2)
            recorder.record(idx, q, k, cap.v)
            cap.clear()

        handles.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(q_src.register_forward_hook(keep("q")))
        handles.append(k_src.register_forward_hook(keep("k")))
        handles.append(attn.v_proj.register_forward_hook(keep("v")))
        handles.append(attn.register_forward_hook(post))
        layers.append(layer_idx)
    return KVHookHandle(layers=tuple(layers), handles=tuple(handles))


def split_megatron_qkv(
    mixed: torch.Tensor, *, num_query_groups: int, heads_per_group: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a Megatron-Core fused ``linear_qkv`` output into q, k, v.

    Args:
        mixed: ``[..., num_query_groups * (heads_per_group + 2) * head_dim]`` (one TP
            partition's output).
        num_query_groups: query groups (= KV heads) in this partition.
        heads_per_group: query heads per group (``np / ng``).
        head_dim: ``hn``.

    Returns:
        ``q [..., ng * heads_per_group, hn]``, ``k [..., ng, hn]``, ``v [..., ng, hn]`` (views where possible).

    Raises:
        ConfigError: the last dimension does not match the layout.
    """
    width = num_query_groups * (heads_per_group + 2) * head_dim
    if mixed.shape[-1] != width:
        raise ConfigError(
            f"linear_qkv output last dim {mixed.shape[-1]} != num_query_groups {num_query_groups} x "
            f"(heads_per_group {heads_per_group} + 2) x head_dim {head_dim} = {width}"
        )
    grouped = mixed.view(*mixed.shape[:-1], num_query_groups, (heads_per_group + 2) * head_dim)
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=-1)
    q = q.reshape(*q.shape[:-2], num_query_groups * heads_per_group, head_dim)
    return q, k, v


def _megatron_layer_idx(attn: nn.Module) -> int:
    return int(attn.layer_number) - 1  # Megatron-Core layer numbers are 1-based and global


def _hook_core_attention(name: str, attn: nn.Module, recorder: KVAmaxRecorder) -> RemovableHandle:
    idx = _megatron_layer_idx(attn)

    def pre(_m: nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, torch.Tensor]) -> None:
        qkv = list(args[:3])
        for key in ("query", "key", "value")[len(qkv) :]:
            if key not in kwargs:
                raise ConfigError(f"{name}.core_attention was called without {key}; cannot record q/k/v amax")
            qkv.append(kwargs[key])
        recorder.record(idx, *qkv)

    return attn.core_attention.register_forward_pre_hook(pre, with_kwargs=True)


def _hook_linear_qkv(name: str, attn: nn.Module, recorder: KVAmaxRecorder) -> RemovableHandle:
    idx = _megatron_layer_idx(attn)
    groups = int(attn.num_query_groups_per_partition)
    heads = int(attn.num_attention_heads_per_partition)
    head_dim = int(attn.hidden_size_per_attention_head)
    cfg = getattr(attn, "config", None)
    if getattr(cfg, "attention_output_gate", False):
        raise ConfigError(
            f"{name}: gated attention adds a gate slice to linear_qkv; use megatron_source='core_attention'"
        )
    if cfg is not None and getattr(attn, "world_size", 1) > int(cfg.num_query_groups):
        raise ConfigError(
            f"{name}: tensor-parallel size {attn.world_size} > num_query_groups {cfg.num_query_groups}, so "
            "linear_qkv partitions are not whole groups; use megatron_source='core_attention'"
        )

    def post(_m: nn.Module, _args: tuple[object, ...], output: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        mixed = _first_output(output)
        q, k, v = split_megatron_qkv(mixed, num_query_groups=groups, heads_per_group=heads // groups, head_dim=head_dim)
        recorder.record(idx, q, k, v)

    return attn.linear_qkv.register_forward_hook(post)


MEGATRON_SOURCES: dict[str, Callable[[str, nn.Module, KVAmaxRecorder], RemovableHandle]] = {
    "core_attention": _hook_core_attention,
    "linear_qkv": _hook_linear_qkv,
}
"""Registry: where to read q/k/v in a Megatron-Core ``SelfAttention`` (see the module docstring)."""


def _attach_megatron(
    model: nn.Module, recorder: KVAmaxRecorder, *, megatron_source: str = "core_attention", **_: object
) -> KVHookHandle:
    if megatron_source not in MEGATRON_SOURCES:
        raise ConfigError(f"unknown megatron_source {megatron_source!r}; valid names: {sorted(MEGATRON_SOURCES)}")
    hook = MEGATRON_SOURCES[megatron_source]
    handles: list[RemovableHandle] = []
    layers: list[int] = []
    for name, attn in model.named_modules():
        if _is_megatron_attention(attn):
            handles.append(hook(name, attn, recorder))
            layers.append(_megatron_layer_idx(attn))
    return KVHookHandle(layers=tuple(layers), handles=tuple(handles))


KV_HOOK_ATTACHERS: dict[str, Callable[..., KVHookHandle]] = {
    "hf": _attach_hf,
    "megatron": _attach_megatron,
}
"""Registry: model family -> function attaching amax hooks to every attention module."""


def _detect_kind(model: nn.Module) -> str:
    for m in model.modules():
        if _is_megatron_attention(m):
            return "megatron"
        if _is_hf_attention(m):
            return "hf"
    raise ConfigError(
        f"{type(model).__name__} has no recognizable attention module (Megatron-Core SelfAttention with "
        "linear_qkv/core_attention, or HF attention with q_proj/k_proj/v_proj/layer_idx); call "
        "KVAmaxRecorder.record yourself"
    )


def attach_kv_amax_hooks(
    model: nn.Module, recorder: KVAmaxRecorder, *, kind: str = "auto", megatron_source: str = "core_attention"
) -> KVHookHandle:
    """Register forward hooks that feed every attention layer's q/k/v amax to ``recorder``.

    Args:
        model: a Megatron-Core model (possibly wrapped, e.g. DDP / Float16Module) or an HF model.
        recorder: receives one ``record`` per attention call.
        kind: ``"auto"`` or a key of :data:`KV_HOOK_ATTACHERS`.
        megatron_source: for Megatron-Core, a key of :data:`MEGATRON_SOURCES`.

    Returns:
        :class:`KVHookHandle` (``.remove()`` or use as a context manager).

    Raises:
        ConfigError: unknown kind/source, or no attention module found.
    """
    if kind == "auto":
        kind = _detect_kind(model)
    if kind not in KV_HOOK_ATTACHERS:
        raise ConfigError(f"unknown attention kind {kind!r}; valid names: {['auto', *sorted(KV_HOOK_ATTACHERS)]}")
    handle = KV_HOOK_ATTACHERS[kind](model, recorder, megatron_source=megatron_source)
    if not handle.layers:
        raise ConfigError(f"no {kind} attention module found in {type(model).__name__}; nothing to calibrate")
    logger.info("KV amax hooks on %d %s attention layers", len(handle.layers), kind)
    return handle
