"""What a refit's bytes are: the payload of each stream, and the traffic floor of a refit inside one memory.

:func:`fp8_param_payload` and :func:`tally` count the FP8 parameters' bytes as BF16 and as FP8 + scales (what the
benchmark's payload ratio is). The rest of this module is the **traffic floor**: the bytes a refit's passes must
move, and the least time they take.

``bench/refit.py`` reports each run's seconds next to this floor, so a figure reads as a share of what the memory
system allows, and FP8/BF16 next to the floor's own ratio, which is what a perfect implementation would show.

The passes a refit cannot skip when sender and receiver share one memory (``inproc``, ``cuda_ipc``):

* **source read**: the sender reads every weight once (a BF16 weight to copy it, a weight quantized in its bucket
  to quantize it: the quantizer reads its source once);
* **bucket write**: the bucket's payload is written once (FP8 codes + block scales for a quantized weight);
* **sender checksum read** and **receiver checksum read**: every payload byte is read once per side for the
  bucket checksum (:mod:`megatron_fp8.refit.integrity.checksum`);
* the applier's: ``dict`` (an engine's parameters) reads the payload and writes it into the parameters;
  ``host`` (the receiver's host staging for vLLM's applier) reads the payload on the device and sends it over the
  device -> host link (on a CPU nothing: the buckets already are in host memory and are kept as the staged version);
  ``device`` (GRPO's colocated refit kept on the device, into an engine loaded in place) copies the parameters (its
  rollback snapshot), writes the payload into them and reads both back to compare them: no link.

The floor is ``max(device bytes / copy bandwidth, link bytes / link bandwidth)`` with the copy bandwidth measured
as ``bench/quant.py`` does (bytes read + written per second by a 1 GiB ``copy_``). What a real applier does
beyond that (a rollback backup, a NaN/Inf check of the values, a read-back) is not in the floor: it is the cost
the floor shows.

Why it matters for the Llama-3.1-8B set: its embeddings and ``lm_head`` (2.1 GB) stay BF16 in vLLM's FP8
checkpoints, so the FP8 payload is 0.5655 of BF16's, not 0.5. With a no-op receiver the floor's FP8/BF16 is then
``(1 + 3 * 0.5655) / 4 = 0.674``: no in-GPU no-op refit of that set can reach a ratio under it. With an applier
the payload's share grows and the floor's ratio falls (``(1 + 5 * 0.5655) / 6 = 0.638``); over a link it tends
to the payload ratio.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from megatron_fp8.quant import quantize_blockwise


def tally(
    stream: Iterable[tuple[str, torch.Tensor]], fp8_names: set[str], counts: dict[str, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``stream`` through, adding each tensor's bytes to ``counts["fp8_params"]`` (an FP8 parameter, or its
    ``_scale_inv``) or ``counts["rest"]``."""
    for name, t in stream:
        base = name.removesuffix("_scale_inv")
        key = "fp8_params" if base in fp8_names else "rest"
        counts[key] = counts.get(key, 0) + t.numel() * t.element_size()
        yield name, t


def fp8_param_payload(spec_fp8_shapes: dict[str, tuple[int, int]], weights: dict[str, torch.Tensor]) -> dict:
    """Bytes of the FP8 parameters sent as BF16 vs as FP8 + float32 block scales (quantizes each once)."""
    bf16 = fp8 = scales = 0
    start = time.perf_counter()
    for name in spec_fp8_shapes:
        q, s = quantize_blockwise(weights[name], name=name)
        bf16 += weights[name].numel() * weights[name].element_size()
        fp8 += q.numel() * q.element_size()
        scales += s.numel() * s.element_size()
    seconds = time.perf_counter() - start
    return {
        "count": len(spec_fp8_shapes),
        "bf16_bytes": bf16,
        "fp8_bytes": fp8,
        "scale_bytes": scales,
        "fp8_plus_scale_bytes": fp8 + scales,
        "payload_ratio": (fp8 + scales) / bf16,
        "quantize_seconds": seconds,
    }


def stream_passes(runs: list, stream: str, use_cuda: bool, appliers: list[str]) -> int:
    """How many times the stream was consumed by the timed runs (``bench/refit.py``'s ``RunResult`` s: repeats,
    warm-ups, ``dict`` target specs)."""
    n = 0
    for r in runs:
        if r.stream != stream:
            continue
        n += len(r.seconds_all) + (1 if use_cuda else 0) + (1 if r.applier == "dict" else 0)
    return n


SAME_MEMORY_TRANSPORTS = ("inproc", "cuda_ipc")
"""Transports whose two ends share one device memory: the floor below applies. Over a link (``gloo``, ``nccl``)
the link's bandwidth bounds a refit instead: ``bench/_refit_link.py`` measures that one."""


@dataclass(frozen=True)
class Traffic:
    """The bytes one refit must move.

    Attributes:
        passes: ``(pass name, bytes read or written in device memory)`` in the order a refit does them.
        link_bytes: bytes that cross from the device to the host (``host`` staging on a GPU), else 0.
    """

    passes: tuple[tuple[str, int], ...]
    link_bytes: int = 0

    def __post_init__(self) -> None:
        if any(n < 0 for _, n in self.passes) or self.link_bytes < 0:
            raise ValueError(f"byte counts must be >= 0: {self.passes}, link {self.link_bytes}")

    @property
    def device_bytes(self) -> int:
        """Bytes read + written in device memory."""
        return sum(n for _, n in self.passes)

    def seconds(self, *, copy_gbps: float, link_gbps: float | None = None) -> float:
        """The floor in seconds: the device's passes at ``copy_gbps`` (GB/s read + written), or the link's bytes at
        ``link_gbps`` (GB/s) where that takes longer.

        Raises:
            ValueError: a non-positive bandwidth, or link bytes without ``link_gbps``.
        """
        if copy_gbps <= 0:
            raise ValueError(f"copy_gbps must be > 0, got {copy_gbps}")
        device = self.device_bytes / copy_gbps / 1e9
        if not self.link_bytes:
            return device
        if link_gbps is None or link_gbps <= 0:
            raise ValueError(f"{self.link_bytes} bytes cross a link: give its bandwidth (> 0), got {link_gbps}")
        return max(device, self.link_bytes / link_gbps / 1e9)

    def to_dict(self) -> dict:
        """A JSON-able dict: every pass's bytes, the device total, the link bytes."""
        return {"passes": dict(self.passes), "device_bytes": self.device_bytes, "link_bytes": self.link_bytes}


def refit_traffic(*, source_bytes: int, payload_bytes: int, applier: str, on_gpu: bool) -> Traffic:
    """The passes of one refit between two ends of one memory (see the module docstring).

    Args:
        source_bytes: bytes of the weights the sender reads (the BF16 set, whatever is sent).
        payload_bytes: tensor bytes in the buckets (BF16: ``source_bytes``; FP8: codes + scales + the BF16 rest).
        applier: ``"noop"``, ``"dict"``, ``"host"`` or ``"device"`` (``bench/_refit_device.py``'s :data:`APPLIERS`).
        on_gpu: whether the refit runs on a GPU (``host`` staging and ``device``'s rollback copy then cross the
            device -> host link).

    Returns:
        The :class:`Traffic`.

    Raises:
        ValueError: an unknown applier.
    """
    passes = [
        ("source read", source_bytes),
        ("bucket write", payload_bytes),
        ("sender checksum read", payload_bytes),
        ("receiver checksum read", payload_bytes),
    ]
    link = 0
    if applier == "dict":
        passes += [("apply read", payload_bytes), ("apply write", payload_bytes)]
    elif applier == "host":
        if on_gpu:  # on a CPU the buckets are the staged version (the receiver keeps them: no copy)
            passes.append(("host copy read", payload_bytes))
            link = payload_bytes
    elif applier == "device":  # the snapshot of the weights, the load, the exact compare of both
        passes += [("snapshot read", payload_bytes), ("snapshot write", payload_bytes)]
        passes += [("apply read", payload_bytes), ("apply write", payload_bytes), ("verify read", 2 * payload_bytes)]
    elif applier != "noop":
        raise ValueError(f"unknown applier {applier!r}; valid: noop, dict, host, device")
    return Traffic(tuple(passes), link)


def floor_fields(run: dict, *, source_bytes: int, copy_gbps: float, link_gbps: float | None, on_gpu: bool) -> dict:
    """The floor fields of one ``bench/refit.py`` run (a ``RunResult`` as a dict), empty over a link transport.

    Returns:
        ``{"floor": Traffic.to_dict(), "floor_s": seconds, "pct_of_floor": 100 * floor_s / seconds}``, or ``{}``
        for a transport outside :data:`SAME_MEMORY_TRANSPORTS`.
    """
    if run["transport"] not in SAME_MEMORY_TRANSPORTS:
        return {}
    traffic = refit_traffic(
        source_bytes=source_bytes, payload_bytes=run["total_bytes"], applier=run.get("applier", "noop"), on_gpu=on_gpu
    )
    floor_s = traffic.seconds(copy_gbps=copy_gbps, link_gbps=link_gbps)
    return {"floor": traffic.to_dict(), "floor_s": floor_s, "pct_of_floor": 100 * floor_s / run["seconds"]}


def floor_ratios(runs: list[dict], *, keyed_by_applier: bool) -> dict[str, float]:
    """FP8 floor over BF16 floor per (transport, applier) that has both, keyed as ``time_ratio_fp8_over_bf16``."""
    by = {(r["transport"], r.get("applier", "noop"), r["stream"]): r for r in runs if "floor_s" in r}
    return {
        f"{t}/{a}" if keyed_by_applier else t: by[(t, a, "fp8")]["floor_s"] / by[(t, a, "bf16")]["floor_s"]
        for (t, a, s) in by
        if s == "fp8" and (t, a, "bf16") in by
    }
