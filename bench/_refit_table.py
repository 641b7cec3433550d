"""The table ``bench/refit.py`` prints: one row per (transport, applier, stream) run, the ratios below it."""

from __future__ import annotations


def print_table(summary: dict, *, max_ratio: float) -> None:
    """Print the refit benchmark's summary (``bench/refit.py``'s JSON) as a table and its ratios below it.

    Args:
        summary: the JSON summary ``bench/refit.py`` writes (``runs``, ``fp8_params``, ``copy_gbps``, ...).
        max_ratio: the FP8-param payload ratio the benchmark fails above (printed beside the measured one).
    """
    from rich.console import Console
    from rich.table import Table

    p = summary["fp8_params"]
    table = Table(title=f"refit: FP8 vs BF16 ({summary['what_ran']})")
    cols = ("transport", "applier", "stream", "FP8-param bytes", "rest bytes", "buckets", "seconds", "GB/s")
    for col in (*cols, "recv tail s", "% of copy", "% of floor", "ops/bucket (send, recv)", "syncs/bucket"):
        table.add_column(col, justify="left" if col in ("transport", "applier", "stream") else "right")
    for r in summary["runs"]:
        fp8_param_bytes = p["bf16_bytes"] if r["stream"] == "bf16" else p["fp8_plus_scale_bytes"]
        ops = r.get("ops") or {}
        snd, rcv = ops.get("sender", {}), ops.get("receiver", {})
        table.add_row(
            r["transport"],
            r.get("applier", "noop"),
            r["stream"],
            f"{fp8_param_bytes / 1e6:,.2f} MB",
            f"{summary['rest_bf16_bytes'] / 1e6:,.2f} MB",
            str(r["num_buckets"]),
            f"{r['seconds']:.3f}",
            f"{r['gbps']:.2f}",
            f"{r['receiver_tail_s']:.4f}" if r.get("receiver_tail_s") is not None else "-",
            f"{r['pct_of_copy']:.1f}%" if r.get("pct_of_copy") is not None else "-",
            f"{r['pct_of_floor']:.1f}%" if r.get("pct_of_floor") is not None else "-",
            f"{snd.get('compute_ops_per_bucket', 0):.1f}, {rcv.get('compute_ops_per_bucket', 0):.1f}" if ops else "-",
            f"{snd.get('host_reads_per_bucket', 0):.1f}, {rcv.get('host_reads_per_bucket', 0):.1f}" if ops else "-",
        )
    console = Console(width=max(Console().width, 140))
    console.print(table)
    console.print(f"device copy bandwidth: {summary['copy_gbps']:.1f} GB/s read + written ({summary['device']})")
    console.print(
        f"FP8-param payload ratio (FP8 + scales) / BF16 = {p['payload_ratio']:.6f} "
        f"(limit {max_ratio}); quantization alone {p['quantize_seconds']:.3f}s"
    )
    floors = summary.get("floor_ratio_fp8_over_bf16", {})
    for name, ratio in summary["time_ratio_fp8_over_bf16"].items():
        at_floor = f" (at the traffic floor: {floors[name]:.3f})" if name in floors else ""
        console.print(f"time ratio FP8 / BF16 over {name}: {ratio:.3f}{at_floor}")
    if summary.get("d2h_gbps"):
        console.print(f"device -> host (pinned) bandwidth: {summary['d2h_gbps']:.1f} GB/s (host staging's link)")
