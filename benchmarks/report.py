"""Tables and plots of benchmark records (the JSON that benchmarks/ssd.py writes), never of stdout.

A record is a dict with op, direction, impl, shape {batch, seqlen, nheads, headdim, dstate, ngroups},
chunk_size, ms_median, ms_p20, ms_p80, ms_pipelined, tflops, gbps, rel_l2_err, timing, roofline
{floor_ms, bound, ...}, tuning (the configs the cutile backends ran, by stage) and "error" (None, or why
the implementation did not run).

  python -m benchmarks.report benchmarks/results/ssd_fwd_h200.json [--png OUT.png] [--markdown]
                              [--merge NEW.json ...]

--png writes the plot the README shows, --markdown prints the README's table of the file. --merge folds
the records of later runs into the file: a new record replaces the one of the same (direction, shape,
implementation), so a grid measured over several device calls stays one file.
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
# How tables and plots name them, in the one order every panel and table uses.
DISPLAY_NAMES = {
    "cutile": "jax-mamba2 cuTile",
    "cutile_callback": "jax-mamba2 cuTile (callback)",
    "jla": "jax-linear-attention (Pallas)",
    "mamba_ssm": "mamba_ssm (Triton)",
    "xla": "jax-mamba2 XLA (pure JAX)",
}
# The README tables' column names (its text says which implementation each is).
TABLE_NAMES = {"cutile": "cuTile", "cutile_callback": "cuTile (callback)", "jla": "jax-linear-attention",
               "mamba_ssm": "mamba_ssm", "xla": "XLA"}
COLORS = {"cutile": "#76b900", "cutile_callback": "#b5dc6e", "jla": "#ff7f0e", "mamba_ssm": "#1f77b4",
          "xla": "#8c8c8c"}
# The forward plan the cutile backends ran, read off the stage names their `tuning` record is keyed by.
_LAYOUT_STAGES = {"fused_scan": "fused", "segmented_scan": "segmented", "chunk_scan": "staged"}
DIRECTION_TITLES = {"fwd": "forward", "fwd_bwd": "forward + backward"}


def write_records(records: list[dict], path: Path) -> Path:
    """Writes `records` as one JSON list."""
    from jax_mamba2._files import write_atomically

    path = Path(path)
    write_atomically(path, (json.dumps(records, indent=1, sort_keys=True, default=str) + "\n").encode())
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


def layout(record: dict) -> Optional[str]:
    """The forward plan ("fused", "segmented", "staged") a cutile record ran, None if it does not say."""
    stages = record.get("tuning") or {}
    return next((name for stage, name in _LAYOUT_STAGES.items() if stage in stages), None)


def _shape_tuple(label: str) -> str:
    return label.replace(",", ", ")


def _two_line_shape(label: str) -> str:
    parts = label.strip("()").split(",")
    return f"({', '.join(parts[:3])},\n{', '.join(parts[3:])})"


def _impl_ms(group: list[dict], impl: str) -> Optional[float]:
    return next((r["ms_pipelined"] for r in group if r["impl"] == impl and _ok(r)), None)


def markdown_table(records: list[dict], impls: tuple[str, ...] = ("cutile", "mamba_ssm", "jla", "xla")) -> str:
    """The README's table of one benchmark file, one row per shape: the forward plan cutile ran, pipelined ms
    per implementation, cutile's speedup over each peer (the peer's time over cutile's: > 1 means cutile is
    faster) and the roofline floor in ms. An implementation that did not run a shape reads "n/a"."""
    groups = _by_shape(records)
    show_layout = any(layout(r) for r in records if r["impl"] == "cutile")
    header = ["shape (B, L, H, P, N, G)", *(["plan"] if show_layout else []),
              *(TABLE_NAMES[i] for i in impls),
              *(f"speedup vs {TABLE_NAMES[p]}" for p in PEERS if p in impls), "roofline floor"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, group in groups.items():
        ours = _impl_ms(group, "cutile")
        cutile = next((r for r in group if r["impl"] == "cutile"), {})
        row = [_shape_tuple(label), *([layout(cutile) or "-"] if show_layout else [])]
        row += ["n/a" if _impl_ms(group, i) is None else f"{_impl_ms(group, i):.3f}" for i in impls]
        for peer in (p for p in PEERS if p in impls):
            theirs = _impl_ms(group, peer)
            row.append(f"{theirs / ours:.2f}x" if theirs and ours else "n/a")
        floor = next((r["roofline"]["floor_ms"] for r in group if r["impl"] == "cutile" and _ok(r)), None)
        row.append(_fmt(floor, ".3f"))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot_records(records: list[dict], path: Path) -> Path:
    """One PNG in two panels, shapes along x: (top) pipelined ms per implementation on a log axis, every
    implementation in DISPLAY_NAMES order, the roofline floor of an ideal fused kernel as a black bar across
    each shape; (bottom) cutile's speedup over each peer (> 1: cutile faster)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jax_mamba2._files import save_figure

    groups = _by_shape(records)
    labels = list(groups)
    impls = [i for i in DISPLAY_NAMES if any(r["impl"] == i for r in records)]
    peers = [p for p in PEERS if p in impls]
    width = 0.8 / max(len(impls), 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8.0, 1.45 * len(labels) + 2), 9.0), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    for k, impl in enumerate(impls):
        offsets = [x - 0.4 + (k + 0.5) * width for x in range(len(labels))]
        times = [_impl_ms(groups[label], impl) for label in labels]
        top.bar([o for o, t in zip(offsets, times) if t], [t for t in times if t], width,
                color=COLORS.get(impl, "#999999"), label=DISPLAY_NAMES.get(impl, impl))
        for o, t in zip(offsets, times):
            if t is None:
                top.annotate("n/a", (o, 0), xycoords=("data", "axes fraction"), xytext=(0, 3),
                             textcoords="offset points", ha="center", va="bottom", fontsize=7, rotation=90)
    floors = []
    for x, label in enumerate(labels):
        floor = next((r["roofline"]["floor_ms"] for r in groups[label] if _ok(r)), None)
        if floor:
            floors.append(floor)
            top.hlines(floor, x - 0.42, x + 0.42, colors="k", linewidth=2,
                       label="roofline floor (ideal fused kernel)" if len(floors) == 1 else None)
    top.set_yscale("log")
    if floors:  # room under the lowest floor for the "n/a" marks
        top.set_ylim(bottom=min(floors) / 3)
    top.set_ylabel("ms per call (log scale, lower is better)")
    top.legend(fontsize=8, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    top.grid(axis="y", which="both", alpha=0.3)
    pwidth = 0.8 / max(len(peers), 1)
    for k, peer in enumerate(peers):
        for x, label in enumerate(labels):
            ours, theirs = _impl_ms(groups[label], "cutile"), _impl_ms(groups[label], peer)
            offset = x - 0.4 + (k + 0.5) * pwidth
            if not (ours and theirs):
                bottom.text(offset, 0.05, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
                continue
            bottom.bar(offset, theirs / ours, pwidth, color=COLORS[peer],
                       label=f"vs {DISPLAY_NAMES[peer]}" if x == 0 or not bottom.get_legend_handles_labels()[0]
                       else None)
            bottom.text(offset, theirs / ours, f"{theirs / ours:.1f}x", ha="center", va="bottom", fontsize=7)
    bottom.axhline(1.0, color="k", linewidth=1)
    bottom.set_ylabel("speedup of jax-mamba2 cuTile\n(peer's time / cuTile's; > 1: cuTile faster)")
    handles, names = bottom.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    bottom.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left")
    bottom.set_ylim(0, max([b.get_height() for b in bottom.patches] + [1.0]) * 1.2)
    bottom.set_xticks(range(len(labels)), [_two_line_shape(label) for label in labels], fontsize=8)
    bottom.set_xlabel("shape (batch, seqlen, nheads, headdim, dstate, ngroups)")
    direction = records[0]["direction"] if records else "fwd"
    gpu = records[0].get("gpu", "") if records else ""
    dtype = records[0].get("dtype", "bfloat16") if records else ""
    fig.suptitle(f"Mamba-2 SSD {DIRECTION_TITLES.get(direction, direction)}, {dtype}, {gpu}")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return Path(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Print the table (and plot) of a benchmark JSON.")
    parser.add_argument("path", type=Path)
    parser.add_argument("--png", type=Path, help="also write the plot here (default: no plot)")
    parser.add_argument("--markdown", action="store_true", help="print the README's table instead of the "
                        "full one (default: the full table)")
    parser.add_argument("--merge", type=Path, nargs="+", default=[],
                        help="record files of later runs to fold into PATH (rewritten)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in (args.path, *args.merge) if not p.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    records = load_records(args.path)
    for newer in args.merge:
        records = merge_records(records, load_records(newer))
    if args.merge:
        write_records(records, args.path)
    print(markdown_table(records) if args.markdown else format_table(records))
    if args.png:
        print(f"plot: {plot_records(records, args.png)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
