"""How a pass of the trainer lays a batch's rows out in micro-batches: fixed rows, dynamic batches, packed sequences.

A batch is ``[B, T]`` rows, right-padded (``attention_mask`` 1 on real tokens). A :class:`BatchLayout` (one of
:data:`megatron_fp8.vocab.BATCH_LAYOUTS`) turns it into :class:`MicroBatch` es, each one forward (and backward):

* ``rows``: ``rows`` rows per micro-batch, each as long as the batch (what ``policy.train_micro_batch_size`` and
  ``policy.logprob_batch_size`` mean);
* ``dynamic`` (NeMo-RL's ``policy.dynamic_batching``): the rows sorted by length (ascending, stable) and taken in that
  order while ``rows x longest`` (the longest rounded up to ``round_to``, never past ``T``) stays within ``tokens``;
  each micro-batch is as long as its own longest row;
* ``packed`` (NeMo-RL's ``policy.sequence_packing``): the rows' real tokens bin-packed
  (:func:`megatron_fp8.rl.algorithm.bins.pack_bins`, NeMo-RL's algorithms) into one ``[1, L]`` row per bin of at most
  ``tokens``; each sequence attends only to itself and its positions start at 0. The model sees Megatron-Core's
  packed-sequence form (``PackedSeqParams``, THD: ``cu_seqlens`` over the sequences, the rotary embedding restarting
  at each); what fills a bin up to ``L`` (``round_to``, or one length for every bin under pipeline parallelism) is a
  sequence of its own that no loss reads.

Every micro-batch maps its ``[b, t-1]`` next-token log-probabilities back to the batch's layout
(:meth:`MicroBatch.to_rows`: ``[n, T-1]`` for its ``n`` rows, 0 off the real tokens), so losses and metrics never see
the layout. What a pass computes is counted (:meth:`MicroBatch.computed_tokens`; ``real_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_fp8.errors import ConfigError
from megatron_fp8.layout import ceil_div
from megatron_fp8.megatron.bins import PACKING_ALGORITHMS, pack_bins
from megatron_fp8.vocab import BATCH_LAYOUTS

if TYPE_CHECKING:  # annotations only (Megatron is optional at import time)
    from megatron.core.packed_seq_params import PackedSeqParams


@dataclass(frozen=True, kw_only=True)
class BatchLayout:
    """How one pass lays out its rows.

    Attributes:
        kind: a key of :data:`~megatron_fp8.vocab.BATCH_LAYOUTS`.
        rows: ``rows``: rows per micro-batch (``None``: the whole batch at once).
        tokens: ``dynamic`` / ``packed``: tokens per micro-batch at most (padding included; a packed bin's real
            tokens, its length then rounded up to ``round_to`` as NeMo-RL's Megatron path does).
        round_to: ``dynamic`` / ``packed``: micro-batch lengths rounded up to a multiple of this (tokens).
        algorithm: ``packed``: the bin-packing algorithm, one of NeMo-RL's.
        largest_first: ``packed``: run the bins longest first (NeMo-RL's ``microbatch_order: largest_first``),
            else in the packer's order.
        key: the config key that set the budget, named in errors.
    """

    kind: str = "rows"
    rows: int | None = None
    tokens: int | None = None
    round_to: int = 1
    algorithm: str = "modified_first_fit_decreasing"
    largest_first: bool = False
    key: str = "policy.train_micro_batch_size"

    def __post_init__(self) -> None:
        if self.kind not in BATCH_LAYOUTS:
            raise ConfigError(f"unknown batch layout {self.kind!r}; valid: {', '.join(BATCH_LAYOUTS)}")
        if self.kind == "rows":
            if self.rows is not None and self.rows < 1:
                raise ConfigError(f"{self.key} must be >= 1 (or unset), got {self.rows}")
            return
        if self.tokens is None or self.tokens < 1:
            raise ConfigError(f"{self.key} must be a token budget >= 1, got {self.tokens}")
        if self.round_to < 1:
            raise ConfigError(f"the sequence_length_round of {self.key} must be >= 1, got {self.round_to}")
        if self.kind == "packed" and self.algorithm not in PACKING_ALGORITHMS:
            raise ConfigError(
                f"policy.sequence_packing.algorithm={self.algorithm!r} is not one of NeMo-RL's: "
                f"{', '.join(PACKING_ALGORITHMS)}"
            )

    @property
    def is_packed(self) -> bool:
        """Whether micro-batches are packed sequences (Megatron-Core's THD form)."""
        return self.kind == "packed"


@dataclass(frozen=True)
class MicroBatch:
    """One forward (and backward) of a pass.

    Attributes:
        rows: int64 ``[n]``: the batch rows it computes, in the order :meth:`to_rows` returns them.
        input_ids: int64 ``[b, t]`` (``b = n`` for ``rows`` / ``dynamic``, ``1`` packed).
        position_ids: int64 ``[b, t]``: each sequence numbered from 0.
        padding: ``[b, t]`` 1 on real tokens (``rows`` / ``dynamic``), ``None`` packed.
        segments: int64 ``[t]``: packed, the sequence each token belongs to (fill: a sequence of its own).
        cu_seqlens: int32 ``[k + 1]``: packed, the sequences' cumulative lengths (fill included, last = ``t``).
        lengths: real tokens of each of the ``n`` rows.
        width: the batch's ``T - 1`` (the log-probability width :meth:`to_rows` returns).
        batch_rows: ``rows`` layout: whole rows of the batch, their log-probabilities returned as they are.
    """

    rows: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    lengths: tuple[int, ...]
    width: int
    padding: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    batch_rows: bool = False
    _gather: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def real_tokens(self) -> int:
        """Tokens of its rows (prompt and response)."""
        return sum(self.lengths)

    @property
    def computed_tokens(self) -> int:
        """Token positions the model computes (``b x t``: real tokens plus padding)."""
        return self.input_ids.numel()

    def attention_mask(self) -> torch.Tensor:
        """Megatron-Core's boolean ``[b, 1, t, t]`` mask, ``True`` where attention is not allowed: causal, padded keys
        masked; packed, only within each sequence (what the attention keeps to: the model reads ``cu_seqlens``)."""
        from megatron_fp8.megatron.logits import build_attention_mask

        if self.segments is None:
            return build_attention_mask(self.input_ids, self.padding)
        t = self.segments.numel()
        causal = torch.ones(t, t, dtype=torch.bool, device=self.segments.device).tril()
        same = self.segments[:, None] == self.segments[None, :]
        return ~(causal & same)[None, None]

    def packed_seq_params(self, device: torch.device) -> PackedSeqParams | None:
        """Megatron-Core's ``PackedSeqParams`` (THD) of a packed micro-batch on ``device``; ``None`` otherwise."""
        if self.cu_seqlens is None:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams  # lazy: Megatron-Core is optional

        cu = self.cu_seqlens.to(device=device, dtype=torch.int32)
        longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )

    def to_rows(self, logprobs: torch.Tensor) -> torch.Tensor:
        """``[b, t-1]`` next-token log-probabilities of this micro-batch as ``[n, width]`` rows (autograd kept).

        Position ``j`` of row ``i`` scores its token ``j + 1``; positions past a row's last real token are 0.
        """
        if self.batch_rows:  # rows of the batch as they are
            return logprobs
        if self._gather is None:  # dynamic: cut or widened to the batch's width, 0 past each row's last token
            cut = logprobs[:, : self.width]
            rows = torch.nn.functional.pad(cut, (0, self.width - cut.shape[1]))
            scored = torch.tensor(self.lengths, device=rows.device)[:, None] - 1
            return torch.where(torch.arange(self.width, device=rows.device) < scored, rows, 0.0)
        src, dst_row, dst_col = (x.to(logprobs.device) for x in self._gather)
        out = logprobs.new_zeros(len(self.lengths), self.width)
        return out.index_put((dst_row, dst_col), logprobs.reshape(-1)[src])


@dataclass
class TokenTally:
    """Tokens of the passes a step runs: ``real`` (prompt + response of each row, once per pass) and ``computed``
    (what the model ran: real tokens plus padding)."""

    real: int = 0
    computed: int = 0

    def add(self, micro: list[MicroBatch]) -> None:
        """Count one pass over ``micro``."""
        self.real += sum(mb.real_tokens for mb in micro)
        self.computed += sum(mb.computed_tokens for mb in micro)

    @property
    def padding_share(self) -> float:
        """The share of computed tokens that are padding (0 when nothing was computed)."""
        return 1.0 - self.real / self.computed if self.computed else 0.0


def _round_up(n: int, multiple: int) -> int:
    return ceil_div(n, multiple) * multiple


def row_lengths(input_ids: torch.Tensor, padding: torch.Tensor | None) -> list[int]:
    """Real tokens per row of a right-padded batch (``T`` each without a padding mask)."""
    if padding is None:
        return [input_ids.shape[1]] * input_ids.shape[0]
    return [int(n) for n in padding.to(torch.int64).sum(dim=1)]


def _rows_layout(ids: torch.Tensor, padding: torch.Tensor | None, layout: BatchLayout) -> list[MicroBatch]:
    from megatron_fp8.megatron.logits import position_ids_for

    b, t = ids.shape
    size = max(b, 1) if layout.rows is None else layout.rows
    lengths = row_lengths(ids, padding)
    out = []
    for start in range(0, max(b, 1), size):
        part = slice(start, min(start + size, b))
        mask = padding[part] if padding is not None else None
        out.append(
            MicroBatch(
                rows=torch.arange(part.start, part.stop),
                input_ids=ids[part],
                position_ids=position_ids_for(ids[part], mask),
                lengths=tuple(lengths[part]),
                width=t - 1,
                padding=mask,
                batch_rows=True,
            )
        )
    return out


def _dynamic_layout(
    ids: torch.Tensor, padding: torch.Tensor | None, layout: BatchLayout, lengths: list[int]
) -> list[MicroBatch]:
    from megatron_fp8.megatron.logits import position_ids_for

    t_batch = ids.shape[1]
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups: list[tuple[list[int], int]] = []
    for i in order:
        padded = min(_round_up(lengths[i], layout.round_to), t_batch)
        if groups and (len(groups[-1][0]) + 1) * max(groups[-1][1], padded) <= layout.tokens:
            rows, longest = groups[-1]
            groups[-1] = ([*rows, i], max(longest, padded))
        else:
            groups.append(([i], padded))
    out = []
    for rows, t in groups:
        index = torch.tensor(rows, dtype=torch.int64)
        part_ids = ids[index, :t]
        mask = padding[index, :t] if padding is not None else None
        out.append(
            MicroBatch(
                rows=index,
                input_ids=part_ids,
                position_ids=position_ids_for(part_ids, mask),
                lengths=tuple(lengths[r] for r in rows),
                width=t_batch - 1,
                padding=mask,
            )
        )
    return out


def _packed_layout(
    ids: torch.Tensor, layout: BatchLayout, lengths: list[int], *, one_length: bool, pad_id: int
) -> list[MicroBatch]:
    bins = pack_bins(lengths, capacity=layout.tokens, algorithm=layout.algorithm, what=layout.key)
    sizes = [_round_up(sum(lengths[i] for i in b), layout.round_to) for b in bins]
    if one_length and sizes:  # pipeline stages exchange one activation shape per pass
        sizes = [max(sizes)] * len(sizes)
    if layout.largest_first:  # stable: equal sizes keep the packer's order
        order = sorted(range(len(bins)), key=lambda k: -sum(lengths[i] for i in bins[k]))
        bins, sizes = [bins[k] for k in order], [sizes[k] for k in order]
    out = []
    for rows, size in zip(bins, sizes, strict=True):
        pieces, positions, segments, cu = [], [], [], [0]
        src, dst_row, dst_col = [], [], []
        for j, r in enumerate(rows):
            n = lengths[r]
            pieces.append(ids[r, :n])
            positions.append(torch.arange(n))
            segments.append(torch.full((n,), j, dtype=torch.int64))
            src.append(torch.arange(cu[-1], cu[-1] + n - 1))  # position o + k scores token o + k + 1, within the row
            dst_row.append(torch.full((n - 1,), j, dtype=torch.int64))
            dst_col.append(torch.arange(n - 1))
            cu.append(cu[-1] + n)
        fill = size - cu[-1]
        if fill:  # a sequence of its own: attends to itself only, scored by no loss
            pieces.append(torch.full((fill,), pad_id, dtype=ids.dtype))
            positions.append(torch.arange(fill))
            segments.append(torch.full((fill,), len(rows), dtype=torch.int64))
            cu.append(size)
        out.append(
            MicroBatch(
                rows=torch.tensor(rows, dtype=torch.int64),
                input_ids=torch.cat(pieces).unsqueeze(0),
                position_ids=torch.cat(positions).unsqueeze(0),
                lengths=tuple(lengths[r] for r in rows),
                width=ids.shape[1] - 1,
                segments=torch.cat(segments),
                cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                _gather=(torch.cat(src), torch.cat(dst_row), torch.cat(dst_col)),
            )
        )
    return out


def plan_micro_batches(
    input_ids: torch.Tensor,
    padding: torch.Tensor | None,
    layout: BatchLayout,
    *,
    pipeline_stages: int = 1,
    pad_id: int = 0,
) -> list[MicroBatch]:
    """The micro-batches of one pass over a right-padded batch.

    Args:
        input_ids: int64 ``[B, T]``.
        padding: ``[B, T]`` 1 on real tokens (``None``: every token is real).
        layout: how to lay the rows out.
        pipeline_stages: the model's pipeline stages: with several, ``rows`` needs equal micro-batches and packed
            bins all get the longest bin's length (one activation shape per pass).
        pad_id: token id of the fill of packed micro-batches (never scored).

    Returns:
        The micro-batches; every row of the batch is in exactly one.

    Raises:
        ConfigError: a row longer than the token budget (named with the key that sets it), rows that do not split
            evenly under pipeline parallelism, or dynamic batching under pipeline parallelism.
    """
    rows = input_ids.shape[0]
    if layout.kind == "rows":
        if pipeline_stages > 1 and layout.rows is not None and rows % layout.rows:
            raise ConfigError(
                f"{layout.key}={layout.rows} does not split the {rows} rows of a batch into equal micro-batches, "
                f"which pipeline parallelism needs (one activation shape per step); choose a divisor of {rows}"
            )
        return _rows_layout(input_ids, padding, layout)
    lengths = row_lengths(input_ids, padding)
    longest = max(lengths, default=0)
    # dynamic: a row alone is its micro-batch, rounded up (never past T), as NeMo-RL checks it
    alone = min(_round_up(longest, layout.round_to), input_ids.shape[1]) if layout.kind == "dynamic" else longest
    if alone > layout.tokens:
        row = lengths.index(longest)
        rounded = f" ({alone} rounded up to sequence_length_round)" if alone != longest else ""
        raise ConfigError(
            f"row {row} of the batch has {longest} tokens (prompt + response){rounded}, more than {layout.key}="
            f"{layout.tokens}: raise it to at least the longest prompt + policy.generation.max_new_tokens"
        )
    if layout.kind == "dynamic":
        if pipeline_stages > 1:
            raise ConfigError(
                "policy.dynamic_batching needs one pipeline stage (the stages exchange one activation shape per "
                "micro-batch, and dynamic batches change it); use policy.sequence_packing with pipeline parallelism"
            )
        return _dynamic_layout(input_ids, padding, layout, lengths)
    return _packed_layout(input_ids, layout, lengths, one_length=pipeline_stages > 1, pad_id=pad_id)
