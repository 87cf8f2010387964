"""Tables and plots of benchmark records (the JSON that benchmarks/ssd.py writes), never of stdout.

A record is a dict with op, direction, impl, shape {batch, seqlen, nheads, headdim, dstate, ngroups},
chunk_size, ms_median, ms_p20, ms_p80, ms_pipelined, tflops, gbps, rel_l2_err, timing, roofline
{floor_ms, bound, ...}, and "error" (None, or why the implementation did not run).

  python -m benchmarks.report benchmarks/results/ssd_fwd_h200.json [--png OUT.png] [--merge NEW.json ...]

--merge folds the records of later runs into the file: a new record replaces the one of the same
(direction, shape, implementation), so a grid measured over several device calls stays one file.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional

# Implementation names: jax-mamba2's backends, then the peers the ratios compare against.
OURS = ("cutile", "cutile_callback", "xla")
PEERS = ("mamba_ssm", "jla")


def write_records(records: list[dict], path: Path) -> Path:
    """Writes `records` as one JSON list."""
    path = Path(path)
    path.write_text(json.dumps(records, indent=1, sort_keys=True, default=str) + "\n")
    return path


def load_records(path: Path) -> list[dict]:
    return json.loads(Path(path).read_text())


def merge_records(records: list[dict], newer: list[dict]) -> list[dict]:
    """`records` with every record of `newer` in place of the one of the same (direction, shape, impl),
    in the original order; new keys are appended."""
    def key(record):
        return record.get("direction"), shape_label(record), record["impl"]
    merged = {key(r): r for r in records}
    merged.update({key(r): r for r in newer})
    return list(merged.values())


def shape_label(record: dict) -> str:
    s = record["shape"]
    return "({batch},{seqlen},{nheads},{headdim},{dstate},{ngroups})".format(**s)


def _ok(record: dict) -> bool:
    return record.get("error") is None and record.get("ms_pipelined") is not None


def _by_shape(records: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(shape_label(record), []).append(record)
    return groups


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def ratios(records: list[dict]) -> dict[str, dict[str, Optional[float]]]:
    """Per impl of ONE shape: ms_pipelined / best peer's and the xla time / ms_pipelined (speedup)."""
    ok = [r for r in records if _ok(r)]
    peer_ms = [r["ms_pipelined"] for r in ok if r["impl"] in PEERS]
    best_peer = min(peer_ms) if peer_ms else None
    xla = next((r["ms_pipelined"] for r in ok if r["impl"] == "xla"), None)
    return {r["impl"]: {"vs_best_peer": r["ms_pipelined"] / best_peer if best_peer else None,
                        "speedup_vs_xla": xla / r["ms_pipelined"] if xla else None}
            for r in ok}


def format_record_line(record: dict) -> str:
    """One progress line for a record, printed while the benchmark runs."""
    if not _ok(record):
        return f"{record['impl']:<16} ERROR {record.get('error')}"
    return (f"{record['impl']:<16} median {record['ms_median']:.3f} ms "
            f"[{record['ms_p20']:.3f}, {record['ms_p80']:.3f}]  pipelined {record['ms_pipelined']:.3f} ms"
            f"  {record['tflops']:.0f} TFLOP/s  rel_l2 {_fmt(record.get('rel_l2_err'), '.1e')}"
            f"  ({record['timing']}, first call {record['first_call_s']:.1f} s)")


def format_table(records: list[dict]) -> str:
    """A fixed-width table: one row per (shape, impl), ratios computed within each shape."""
    header = ("shape", "impl", "Q", "timing", "median", "p20-p80", "pipelined", "TFLOP/s", "GB/s",
              "floor", "%floor", "/best peer", "x vs xla", "rel_l2")
    rows, errors = [header], []
    for label, group in _by_shape(records).items():
        ratio = ratios(group)
        for r in group:
            if not _ok(r):
                rows.append((label, r["impl"], _fmt(r.get("chunk_size"), "d"), "error")
                            + ("",) * (len(header) - 4))
                errors.append(f"  {label} {r['impl']}: {str(r.get('error'))[:300]}")
                continue
            floor = r["roofline"]["floor_ms"]
            rows.append((
                label, r["impl"], str(r["chunk_size"]), r["timing"], f"{r['ms_median']:.3f}",
                f"{r['ms_p20']:.3f}-{r['ms_p80']:.3f}", f"{r['ms_pipelined']:.3f}",
                f"{r['tflops']:.0f}", f"{r['gbps']:.0f}", f"{floor:.3f}",
                f"{100 * floor / r['ms_pipelined']:.0f}%",
                _fmt(ratio[r["impl"]]["vs_best_peer"], ".2f"),
                _fmt(ratio[r["impl"]]["speedup_vs_xla"], ".2f"), _fmt(r.get("rel_l2_err"), ".1e")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    direction = records[0]["direction"] if records else "fwd"
    lines.append(f"\nms ({direction}). Compare 'pipelined' across impls: after a warm-up, the median over "
                 "rounds of the mean of back-to-back calls (JAX) or CUDA-graph replays (torch peers). "
                 "median/p20-p80: per-call wall time with "
                 "block_until_ready (JAX) or per-replay CUDA events (peers). floor: roofline of an "
                 "ideal fused kernel; /best peer: pipelined ms over the fastest peer's (<1 is "
                 "faster); x vs xla: speedup over our plain-JAX chunked path.")
    if errors:
        lines += ["errors:", *errors]
    return "\n".join(lines)


def plot_records(records: list[dict], path: Path) -> Path:
    """One PNG, a bar panel per shape: pipelined ms per impl, median as a dot, roofline floor dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _by_shape(records)
    cols = min(3, max(len(groups), 1))
    rows = max(1, math.ceil(len(groups) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    colors = {"cutile": "#76b900", "cutile_callback": "#a8d86a", "xla": "#7f7f7f",
              "mamba_ssm": "#1f77b4", "jla": "#ff7f0e"}
    for ax, (label, group) in zip(axes.flat, groups.items()):
        ok = [r for r in group if _ok(r)]
        names = [r["impl"] for r in ok]
        ax.bar(names, [r["ms_pipelined"] for r in ok], color=[colors.get(n, "#999999") for n in names])
        ax.plot(names, [r["ms_median"] for r in ok], "k.", label="median per call")
        if ok:
            ax.axhline(ok[0]["roofline"]["floor_ms"], ls="--", c="r", lw=1, label="roofline floor")
        ax.set_title(f"{label} Q={','.join(sorted({str(r['chunk_size']) for r in ok}))}", fontsize=9)
        ax.set_ylabel("ms (bars: pipelined)")
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    if groups:
        axes.flat[0].legend(fontsize=7)
    direction = records[0]["direction"] if records else "fwd"
    gpu = records[0].get("gpu", "") if records else ""
    fig.suptitle(f"Mamba-2 SSD {direction}, bf16, {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Print the table (and plot) of a benchmark JSON.")
    parser.add_argument("path", type=Path)
    parser.add_argument("--png", type=Path, help="also write the bar plot here")
    parser.add_argument("--merge", type=Path, nargs="+", default=[],
                        help="record files of later runs to fold into PATH (rewritten)")
    args = parser.parse_args(argv)
    records = load_records(args.path)
    for newer in args.merge:
        records = merge_records(records, load_records(newer))
    if args.merge:
        write_records(records, args.path)
    print(format_table(records))
    if args.png:
        print(f"plot: {plot_records(records, args.png)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
