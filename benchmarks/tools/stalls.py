"""Where one kernel's warps stall, per loop of its SASS, from Nsight Compute's warp-state samples.

`run` launches the default forward plan of one shape eagerly through torch (`--runs` times: compiled by
the first, so profile a later one), for ncu to profile one chain launch; `summarize` reads ncu's source
page of that launch (`--page source --print-source sass --csv`) and, optionally, its details page, and
writes per loop with wgmma (found as `sass.py loops` finds them) its instructions, its share of all samples,
the share of each stall reason in its samples and its top stall sites, as one record of the JSON list at
`--out` (replacing a record of the same shape and layout).

On the GPU machine:
  ncu --clock-control none --set full --kernel-name regex:fused_scan --launch-skip 2 --launch-count 1 \\
      -o /tmp/fused python benchmarks/tools/stalls.py run 4,8192,32,64,128,1 --runs 3
  ncu -i /tmp/fused.ncu-rep --page source --print-source sass --csv > /tmp/fused_source.csv
  ncu -i /tmp/fused.ncu-rep --page details > /tmp/fused_details.txt
  python benchmarks/tools/stalls.py summarize /tmp/fused_source.csv --details /tmp/fused_details.txt --out OUT.json
"""
from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as a script: benchmarks/tools/ is sys.path[0], the repo root may not be
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.report import load_records, write_records  # noqa: E402
from benchmarks.ssd import Shape  # noqa: E402
from benchmarks.tools import sass  # noqa: E402

SAMPLES = "Warp Stall Sampling (All Samples)"
# Details-page metrics kept in the summary: ncu's name -> the record's key.
KERNEL_METRICS = {
    "Duration": "duration_us", "SM Frequency": "sm_ghz", "Issue Slots Busy": "issue_slots_busy_pct",
    "Eligible Warps Per Scheduler": "eligible_warps_per_scheduler",
    "Warp Cycles Per Issued Instruction": "warp_cycles_per_issued_instruction",
    "DRAM Throughput": "dram_throughput_pct", "L2 Hit Rate": "l2_hit_rate_pct",
    "Registers Per Thread": "registers_per_thread",
}
TOP_SITES = 8


def run(args) -> None:
    import torch

    from benchmarks.tools import stages
    from jax_mamba2.bridge import eager
    from jax_mamba2.bridge.tuning import timing
    from jax_mamba2.kernels import forward

    dims = stages.dims_of(args.shape, args.chunk)
    arrays = {name: torch.from_dlpack(value) for name, value in timing.random_inputs(dims).items()}
    layout = forward.forward_layout(dims)
    plan = forward.forward_plan(dims, {}, layout)
    xp = eager.ArrayNamespace("torch")
    for _ in range(args.runs):
        eager.run_plan(plan, arrays, xp)
    torch.cuda.synchronize()
    print(f"{layout} plan, grids {[launch.grid for launch in plan.launches]}, run {args.runs} times")


def source_rows(text: str) -> list[dict]:
    """The instruction rows of ncu's source-page CSV (the kernel-name line before the header skipped):
    address, SASS text (whitespace collapsed), samples and per stall reason ("stall_*", not-issued columns
    left out) its samples."""
    reader = csv.DictReader(io.StringIO(text[text.index('"Address"'):]))
    reasons = [name for name in reader.fieldnames if name.startswith("stall_") and "Not Issued" not in name]
    return [{"address": int(row["Address"], 16), "sass": " ".join(row["Source"].split()),
             "samples": int(row[SAMPLES] or 0),
             "reasons": {name[len("stall_"):]: int(row[name]) for name in reasons if row[name] not in ("", "0")}}
            for row in reader]


def kernel_metrics(details: str) -> dict[str, float]:
    """KERNEL_METRICS read off ncu's details page (the first value of each)."""
    found = {}
    for line in details.splitlines():
        for name, key in KERNEL_METRICS.items():
            match = re.match(rf"\s+{re.escape(name)}\s+\S+\s+([\d.,]+)\s*$", line)
            if match and key not in found:
                found[key] = float(match.group(1).replace(",", ""))
    return found


def summarize_rows(rows: list[dict]) -> dict:
    """Per loop with wgmma: its offsets in the kernel, instructions, HGMMA and waits, share of all samples,
    stall-reason shares of its own samples and its TOP_SITES sites."""
    base = rows[0]["address"]
    total = sum(row["samples"] for row in rows)
    by_address = {row["address"]: row for row in rows}
    loops = []
    for loop in sass.listing_loops([(row["address"], row["sass"]) for row in rows]):
        if not loop.hgmma:
            continue
        body = [row for address, row in by_address.items() if loop.start <= address <= loop.end]
        samples = sum(row["samples"] for row in body)
        reasons = Counter()
        for row in body:
            reasons.update(row["reasons"])
        loops.append({
            "offsets": [hex(loop.start - base), hex(loop.end - base)], "instructions": loop.instructions,
            "hgmma": loop.hgmma, "waits": loop.waits, "samples": samples,
            "share_of_all_samples": round(samples / total, 4),
            "stall_reasons": {name: round(count / samples, 4) for name, count in reasons.most_common()},
            "top_sites": [{"offset": hex(row["address"] - base), "sass": row["sass"],
                           "share_of_loop": round(row["samples"] / samples, 4),
                           "reasons": dict(Counter(row["reasons"]).most_common(3))}
                          for row in sorted(body, key=lambda r: -r["samples"])[:TOP_SITES]]})
    return {"samples": total, "loops": loops}


def summarize(args) -> None:
    record = {**dict(item.split("=", 1) for item in args.meta),
              **summarize_rows(source_rows(Path(args.source).read_text()))}
    if args.details:
        record["kernel"] = kernel_metrics(Path(args.details).read_text())
    for loop in record["loops"]:
        reasons = ", ".join(f"{name} {share:.1%}" for name, share in list(loop["stall_reasons"].items())[:5])
        print(f"loop {loop['offsets'][0]}-{loop['offsets'][1]}: {loop['instructions']} instructions, "
              f"{loop['share_of_all_samples']:.1%} of the samples: {reasons}")
    if args.out:
        out = Path(args.out)
        key = (record.get("shape"), record.get("layout"))
        kept = [r for r in load_records(out) if (r.get("shape"), r.get("layout")) != key] if out.exists() else []
        write_records(kept + [record], out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="the default forward plan of one shape, launched eagerly")
    run_parser.add_argument("shape", type=Shape.parse, help="B,L,H,P,N,G")
    run_parser.add_argument("--chunk", type=int, default=64)
    run_parser.add_argument("--runs", type=int, default=3)
    summary_parser = commands.add_parser("summarize", help="ncu's source page (CSV) -> stalls per loop")
    summary_parser.add_argument("source")
    summary_parser.add_argument("--details", help="ncu's details page (text): kernel metrics")
    summary_parser.add_argument("--meta", nargs="*", default=[], help="KEY=VALUE fields of the record")
    summary_parser.add_argument("--out")
    args = parser.parse_args(argv)
    (run if args.command == "run" else summarize)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
