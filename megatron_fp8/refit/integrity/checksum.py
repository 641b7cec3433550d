"""The checksum every refit bucket carries: its payload (one device pass, one host read) mixed with a digest of
its header and metadata (version, index, is_last, stream id, trailer, every TensorMeta).

Definition (the same value on every device and backend):

* the payload's ``n`` bytes are read as little-endian signed 32-bit words ``w_i`` (the last word zero-padded
  when ``n`` is not a multiple of 4), cut into blocks of :data:`BLOCK_WORDS` words (64 KiB);
* the device computes, per block ``b``, ``p_b = sum_j w`` and ``q_b = sum_j (j + 1) * w`` over the block's
  words ``j = 0 .. BLOCK_WORDS - 1``, exactly in int64 (``|q_b| < 2**59``): :func:`checksum_partials`;
* the host reads ``p`` and ``q`` once and folds them modulo ``2**64``:
  ``h = sum_b (p_b * (2b + 1) * K1 + q_b * K2) + n * K3``, ``K1`` odd, ``K2`` even, and keeps 63 bits.

Every change of one word (so every single-byte change) moves ``h`` by ``delta * odd`` with ``0 < |delta| <
2**32``, which is never 0 modulo ``2**63``: it is always caught. Moving data inside a block changes ``q``,
between blocks ``p_b * (2b + 1)``, a truncation ``n``. Not cryptographic: it catches transport faults,
not an adversary.

On CUDA with Triton the partials come from one kernel launch reading every payload byte once
(:mod:`megatron_fp8.refit.integrity.kernels`); on CPU from numpy's integer sums over the payload's memory; on any
other device from four torch ops. All give the same int64 partials.

The host reads: :class:`HostCopy` copies a tensor to the host behind the host's back (pinned memory and an event on
CUDA); :class:`HostRead` reads a bucket's partials (and probe flags) back through it, and the receiver stages whole
buckets in host memory with it for an applier that keeps host copies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from megatron_fp8.errors import RefitError
from megatron_fp8.layout import ceil_div
from megatron_fp8.refit.wire import TensorMeta, VersionTrailer

BLOCK_WORDS = 1 << 14
"""Words per checksum block (64 KiB of payload); one int64 pair per block goes to the host."""

_K1 = np.uint64(0x9E3779B97F4A7C15)  # odd
_K2 = np.uint64(0xC2B2AE3D27D4EB4E)  # even
_K3 = 0x165667B19E3779F9
_M63 = (1 << 63) - 1

_JW: dict[torch.device, torch.Tensor] = {}


def _word_weights(device: torch.device) -> torch.Tensor:
    """``[1, 2, ..., BLOCK_WORDS]`` as int64 on ``device`` (built once per device)."""
    w = _JW.get(device)
    if w is None:
        w = _JW[device] = torch.arange(1, BLOCK_WORDS + 1, dtype=torch.int64, device=device)
    return w


def _check_payload(payload: torch.Tensor) -> None:
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise RefitError(
            f"a bucket payload must be a 1-D uint8 tensor, got {getattr(payload, 'dtype', type(payload).__name__)} "
            f"of shape {tuple(getattr(payload, 'shape', ()))}"
        )


def checksum_partials(payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block sums ``p`` and weighted sums ``q`` of a payload's full words, on its device, without a host sync.

    Args:
        payload: 1-D ``torch.uint8`` tensor (any device); its data pointer 4-byte aligned for the kernel
            path (bucket payloads are), else it is read through a copy.

    Returns:
        ``(p, q)``: two int64 tensors of ``ceil((n // 4) / BLOCK_WORDS)`` entries each, on the payload's device.
        The trailing ``n % 4`` bytes are not included (see :func:`finish_checksum`).
    """
    _check_payload(payload)
    nwords = payload.numel() // 4
    if nwords == 0:
        empty = payload.new_zeros(0, dtype=torch.int64)
        return empty, empty
    words = payload[: nwords * 4]
    if words.data_ptr() % 4 or not words.is_contiguous():
        words = words.clone()
    words = words.view(torch.int32)
    from megatron_fp8.refit.integrity import kernels  # the kernel module imports Triton lazily

    if kernels.runs_on(words):
        return kernels.checksum_partials_triton(words, BLOCK_WORDS)
    if words.device.type == "cpu":
        return _partials_numpy(words)
    return _partials_torch(words)


_JW_NP = np.arange(1, BLOCK_WORDS + 1, dtype=np.int64)
_NP_ROWS = 256
"""Blocks per numpy step (16 MiB of payload: its int64 copy stays 32 MiB whatever the bucket size)."""


def _partials_numpy(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU path: numpy's int64 sums and dot products over the payload's own memory (no copy of it).

    Exact integer arithmetic, so the same ``p`` and ``q`` as the torch path and the CUDA kernel; about 7x the
    torch path's throughput on one core (1.4 GB/s against 0.18 GB/s for 64 MiB here, 2026-11-26), which both ends
    of every CPU refit pay per byte. Reading CPU memory through numpy is not a device sync: the op counter
    (:mod:`megatron_fp8.refit.opcount`) does not see it.
    """
    with torch._C.DisableTorchFunction():
        w = words.numpy()
    nwords = w.shape[0]
    full, rem = divmod(nwords, BLOCK_WORDS)
    nb = full + (1 if rem else 0)
    p = np.empty(nb, dtype=np.int64)
    q = np.empty(nb, dtype=np.int64)
    for r0 in range(0, full, _NP_ROWS):
        r1 = min(full, r0 + _NP_ROWS)
        blocks = w[r0 * BLOCK_WORDS : r1 * BLOCK_WORDS].reshape(r1 - r0, BLOCK_WORDS)
        p[r0:r1] = blocks.sum(axis=1, dtype=np.int64)
        q[r0:r1] = blocks.astype(np.int64) @ _JW_NP
    if rem:
        tail = w[full * BLOCK_WORDS :]
        p[full] = tail.sum(dtype=np.int64)
        q[full] = tail.astype(np.int64) @ _JW_NP[:rem]
    return torch.from_numpy(p), torch.from_numpy(q)


def _partials_torch(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path (devices other than CPU and CUDA with Triton): four ops over int32 words."""
    nwords = words.numel()
    pad = ceil_div(nwords, BLOCK_WORDS) * BLOCK_WORDS - nwords
    if pad:
        words = torch.nn.functional.pad(words, (0, pad))
    blocks = words.view(-1, BLOCK_WORDS)
    p = blocks.sum(1, dtype=torch.int64)
    q = (blocks * _word_weights(blocks.device)).sum(1)
    return p, q


def _tail_word(tail: Sequence[int]) -> int:
    """The zero-padded little-endian signed int32 of the last ``n % 4`` bytes (0 when there are none)."""
    value = sum(int(b) << (8 * i) for i, b in enumerate(tail))
    return value - (1 << 32) if value >= 1 << 31 else value


def finish_checksum(p: Sequence[int], q: Sequence[int], *, nbytes: int, tail: Sequence[int] = ()) -> int:
    """Fold the host copies of :func:`checksum_partials` into the payload checksum.

    Args:
        p: per-block word sums (host ints, or an int64 numpy array).
        q: per-block position-weighted word sums (host ints, or an int64 numpy array).
        nbytes: payload length in bytes.
        tail: the payload's last ``nbytes % 4`` bytes (values 0..255).

    Returns:
        The checksum, an int in ``[0, 2**63)``.
    """
    pa = np.asarray(p, dtype=np.int64).view(np.uint64)
    qa = np.asarray(q, dtype=np.int64).view(np.uint64)
    odd = np.arange(1, 2 * len(pa) + 1, 2, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = int((pa * odd * _K1).sum(dtype=np.uint64)) + int((qa * _K2).sum(dtype=np.uint64))
    if tail:
        word, block = nbytes // 4, nbytes // 4 // BLOCK_WORDS
        j = word - block * BLOCK_WORDS
        t = _tail_word(tail)
        h += t * (2 * block + 1) * int(_K1) + t * (j + 1) * int(_K2)
    h += nbytes * _K3
    return h & _M63


def payload_checksum(payload: torch.Tensor) -> int:
    """The position-sensitive checksum of a 1-D ``uint8`` payload, computed on its own device.

    Cost: one read of the payload on its device (one Triton launch on CUDA, four torch ops elsewhere) and
    one host read of ``16`` bytes per 64 KiB block (a second one only when the length is not a multiple of 4).

    Args:
        payload: 1-D ``torch.uint8`` tensor (any device).

    Returns:
        The checksum as a Python int in ``[0, 2**63)``; the same on every device.
    """
    p, q = checksum_partials(payload)
    both = read_host_int64(torch.cat([p, q]))
    n = payload.numel()
    tail = payload[n // 4 * 4 :].tolist() if n % 4 else ()
    return finish_checksum(both[: len(p)], both[len(p) :], nbytes=n, tail=tail)


def read_host_int64(values: torch.Tensor) -> np.ndarray:
    """One host read of a 1-D int64 device tensor as a numpy array (no Python int per element).

    A 1 GiB bucket has 16,384 checksum blocks: reading its ``p``/``q`` partials through ``tolist()`` and back
    into numpy cost ~2.4 ms of host time per bucket on each side (an H100 profile, 2026-11-25), longer than the
    GPU's whole pass over the bucket. ``.cpu().numpy()`` is one copy of 256 KiB.
    """
    return values.detach().cpu().numpy()


class HostCopy:
    """A host copy of ``values`` that belongs to its taker alone (never a view of ``values``).

    Args:
        values: any tensor; on CUDA it must not be written to until :meth:`ready` (or :meth:`tensor` returned).
    """

    __slots__ = ("_event", "_host")

    def __init__(self, values: torch.Tensor):
        self._event = None
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            with torch.cuda.device(values.device):  # the copy and its event on the source device's current stream
                self._host.copy_(values.detach(), non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
        else:
            self._host = values.detach().to("cpu", copy=True)

    @property
    def asynchronous(self) -> bool:
        """Whether the copy runs behind the host's back (CUDA): waiting for it later is worth a lookahead."""
        return self._event is not None

    @property
    def destination(self) -> torch.Tensor:
        """The host tensor the copy goes to, without waiting: its bytes are valid once :meth:`ready` (or after
        any later host wait on work queued behind the copy on its stream)."""
        return self._host

    def ready(self) -> bool:
        """Whether :meth:`tensor` would return without waiting for the device (always, off CUDA); not a sync."""
        return self._event is None or self._event.query()

    def tensor(self) -> torch.Tensor:
        """The host tensor (same shape and dtype as the source; pinned on CUDA); waits for the copy on CUDA."""
        if self._event is not None:
            self._event.synchronize()
        return self._host


class HostRead:
    """A host read of a 1-D int64 tensor started now and taken later (:meth:`result`), so the host can go on.

    On CUDA a :class:`HostCopy` (pinned memory, non-blocking, an event after it):
    :meth:`result` waits for that event only, not for work queued behind it (the next bucket's kernels, or another
    thread's on a shared stream). Elsewhere :meth:`result` is :func:`read_host_int64`. Either way one host read
    (one device sync on a GPU).

    Args:
        values: 1-D int64 tensor (any device); not written to until :meth:`result` returns.
    """

    __slots__ = ("_copy", "_values")

    def __init__(self, values: torch.Tensor):
        self._values: torch.Tensor | None = None if values.is_cuda else values
        self._copy = HostCopy(values) if values.is_cuda else None

    @property
    def asynchronous(self) -> bool:
        """Whether the copy runs behind the host's back (CUDA): waiting for it later is worth a lookahead."""
        return self._copy is not None

    def ready(self) -> bool:
        """Whether :meth:`result` would return without waiting for the device (always, off CUDA); not a sync."""
        return self._copy is None or self._copy.ready()

    def result(self) -> np.ndarray:
        """The values as a host int64 numpy array (waits for the copy on CUDA)."""
        if self._copy is None:
            return read_host_int64(self._values)
        return self._copy.tensor().numpy()


_HEADER_MASK = (1 << 61) - 1


def header_digest(
    *,
    version: int,
    index: int,
    is_last: bool,
    stream_id: int,
    metas: Sequence[TensorMeta],
    trailer: VersionTrailer | None,
) -> int:
    """BLAKE2b digest (61 bits) of a bucket's header fields and metadata, computed on the host.

    Any change of the version, index, ``is_last`` flag, stream id, a tensor's name, shape, dtype, offset or
    byte count, or the trailer changes it. Cost: one JSON encoding of the metadata (~100 bytes per tensor).

    Returns:
        An int in ``[0, 2**61)``.
    """
    # the characters of json.dumps([version, index, is_last, stream_id, [m.to_json() ...], trailer.to_json()],
    # separators=(",", ":")), from the records' own JSON text (made once per record, not once per bucket and side)
    records = ",".join([m.json_text for m in metas])
    tail = trailer.json_text if trailer is not None else "null"
    data = f"[{int(version)},{int(index)},{'true' if is_last else 'false'},{int(stream_id)},[{records}],{tail}]"
    return int.from_bytes(hashlib.blake2b(data.encode("ascii"), digest_size=8).digest(), "little") & _HEADER_MASK


def bucket_checksum(
    payload: torch.Tensor,
    *,
    version: int,
    index: int,
    is_last: bool,
    stream_id: int,
    metas: Sequence[TensorMeta],
    trailer: VersionTrailer | None,
) -> int:
    """The checksum a bucket carries: :func:`payload_checksum` (on the payload's device) XOR :func:`header_digest`.

    Returns:
        An int in ``[0, 2**63)`` (fits the int64 header of the inter-process transports).
    """
    digest = header_digest(
        version=version, index=index, is_last=is_last, stream_id=stream_id, metas=metas, trailer=trailer
    )
    return payload_checksum(payload) ^ digest
