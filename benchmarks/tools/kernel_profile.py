"""Per-kernel GPU times of one jitted SSD program, from JAX's profiler (CUPTI) or Nsight Compute.

`run` executes ssd(backend=...) forward or forward+backward (the programs of benchmarks/ssd.py) at one
shape: it compiles and warms up, then calls the program --calls times back to back, either inside
`jax.profiler.trace` (--trace DIR: a Perfetto trace of the real, unserialised program) or inside a CUDA
profiler range for `ncu --profile-from-start off`. `summarize` folds either record (a
perfetto_trace.json.gz, or ncu's raw CSV of gpu__time_duration.sum) into one row per kernel name:
launches and microseconds per call, and for a trace the span from the first kernel's start to the last
one's end per call (what the program takes on the GPU, gaps included). The readers of those records
(`trace_kernels`, and `torch_trace_kernels` for a torch.profiler Chrome trace, which benchmarks/lm_bench.py
uses for the PyTorch peer) give (name, start, duration) per kernel.

On the GPU machine:
  python benchmarks/tools/kernel_profile.py run --shape 4,8192,32,64,128,1 --trace /tmp/trace
  python benchmarks/tools/kernel_profile.py summarize /tmp/trace/plugins/profile/*/perfetto_trace.json.gz --calls 4
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def run(args) -> None:
    import jax

    from benchmarks import ssd

    shape = ssd.Shape(*args.shape)
    inputs, weights = ssd.make_inputs(shape), ssd.loss_weights(shape)
    program = ssd.prepare_ours(args.backend, inputs, weights, args.chunk, args.direction).run
    for _ in range(3):
        jax.block_until_ready(program())

    def calls():
        outputs = [program() for _ in range(args.calls)]
        jax.block_until_ready(outputs)

    if args.trace:
        with jax.profiler.trace(args.trace, create_perfetto_trace=True):
            calls()
    else:
        import cupy
        cupy.cuda.runtime.profilerStart()
        calls()
        cupy.cuda.runtime.profilerStop()


def _ncu_kernels(text: str) -> list[tuple[str, float, float]]:
    """(name, start_us, duration_us) of each launch in ncu's raw CSV (no start times: 0)."""
    kernels = []
    for row in csv.DictReader(io.StringIO(text[text.index('"ID"'):])):
        value = row.get("gpu__time_duration.sum", "").replace(",", "")
        if value.replace(".", "").isdigit():          # skips the units row
            kernels.append((row["Kernel Name"], 0.0, float(value) / 1e3))
    return kernels


def trace_kernels(trace: dict) -> list[tuple[str, float, float]]:
    """(name, start_us, duration_us) of each event on a GPU stream of a Perfetto trace."""
    gpu_pids = {e["pid"] for e in trace["traceEvents"]
                if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    return [(e["name"], float(e["ts"]), float(e["dur"])) for e in trace["traceEvents"]
            if e.get("ph") == "X" and e.get("pid") in gpu_pids]


# The device events of a torch.profiler Chrome trace: kernels, and the copies and fills the driver runs.
_TORCH_GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def torch_trace_kernels(trace: dict) -> list[tuple[str, float, float]]:
    """(name, start_us, duration_us) of each kernel, memcpy and memset in a torch.profiler Chrome trace."""
    return [(e["name"], float(e["ts"]), float(e["dur"])) for e in trace["traceEvents"]
            if e.get("ph") == "X" and e.get("cat") in _TORCH_GPU_EVENTS]


def summarize(args) -> None:
    """One row per kernel: launches and microseconds per call, largest first."""
    from jax_mamba2._files import write_atomically

    if args.record.endswith(".json.gz"):
        kernels = trace_kernels(json.loads(gzip.decompress(Path(args.record).read_bytes())))
    else:
        kernels = _ncu_kernels(Path(args.record).read_text())
    launches, total_us = defaultdict(int), defaultdict(float)
    for name, _, duration in kernels:
        launches[name] += 1
        total_us[name] += duration
    table = sorted(({"kernel": name, "launches": launches[name] / args.calls,
                     "us": total_us[name] / args.calls} for name in launches), key=lambda r: -r["us"])
    summary = {"source": args.record, "calls": args.calls, "kernels": table,
               "busy_us_per_call": sum(r["us"] for r in table)}
    starts = [start for _, start, _ in kernels]
    if any(starts):
        summary["span_us_per_call"] = (max(s + d for _, s, d in kernels) - min(starts)) / args.calls
    for row in table:
        print(f"{row['us']:9.1f} us  x{row['launches']:<4g} {row['kernel'][:110]}")
    print(f"{summary['busy_us_per_call']:9.1f} us  kernel time per call")
    if "span_us_per_call" in summary:
        print(f"{summary['span_us_per_call']:9.1f} us  first start to last end, per call")
    if args.out:
        write_atomically(Path(args.out), json.dumps(summary, indent=1).encode())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="the profiled program")
    p.add_argument("--shape", type=lambda s: tuple(int(v) for v in s.split(",")), required=True,
                   help="B,L,H,P,N,G")
    p.add_argument("--direction", choices=("fwd", "fwd_bwd"), default="fwd_bwd")
    p.add_argument("--backend", default="cutile")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--trace", help="write a jax.profiler trace here (else: a CUDA profiler range for ncu)")
    s = sub.add_parser("summarize", help="a Perfetto trace (.json.gz) or ncu raw CSV -> per-kernel table")
    s.add_argument("record")
    s.add_argument("--calls", type=int, default=4)
    s.add_argument("--out")
    args = parser.parse_args(argv)
    (run if args.command == "run" else summarize)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
