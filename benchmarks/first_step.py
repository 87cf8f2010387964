"""The LM's first training step in this fresh process: seconds to trace, lower, compile and run it.

The step is lm_train.py's (default d1024-l24-8x2048: d_model 1024, 24 layers, batch 8 x 2048 tokens, bf16
compute, f32 parameters, AdamW), jitted. Stages, timed one by one: model (parameters and AdamW state
created on the device), trace (Python to a jaxpr), lower (to StableHLO; every cuTile kernel compiles to a
cubin here, `jax_mamba2.bridge.compile_ahead`), XLA's compile, the first run (to the loss on the host).
The record also counts the cubins compiled and the seconds each kernel's took (they overlap: their sum
exceeds the lower stage).

cuTile's disk cache of cubins points at a new empty folder unless --cutile-cache DIR names one (then run
it twice with the same DIR to see the second process). JAX's persistent compilation cache stays off.

On the GPU machine:
  source .gpu/gpu-env.sh
  python benchmarks/first_step.py --out $OUT                                 # a fresh machine
  python benchmarks/first_step.py --cutile-cache /tmp/cubins --out $OUT      # twice: the second process
On a machine without a GPU, --lower-only traces and lowers for sm_90 with abstract parameters (no model,
XLA compile or run). Adds one record to <out>/first_step_<gpu>.json (<gpu>: the GPU's model, "h200"; "cpu"
without one), in place of an earlier one of the same config, impl, lower_only, cache state (empty or not) and
layer mode (--unroll-layers).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import lm_bench, lm_train  # noqa: E402
from benchmarks.environment import exit_unless_cutile_runs  # noqa: E402


def _cache_entries(folder: str) -> int:
    """Cubins in cuTile's disk cache at `folder` (0 when it holds none yet)."""
    from cutile_cache._cache import cache_entries
    return sum(1 for _ in cache_entries(folder)) if os.path.isfile(os.path.join(folder, "cache.db")) else 0


def first_step(config_name: str, impl: str, lower_only: bool, cutile_cache: str, scan_layers: bool = True) -> dict:
    """The record of one first step (see the module docstring); cuda.tile must not be imported yet."""
    os.environ["CUDA_TILE_CACHE_DIR"] = cutile_cache  # read once, when cuda.tile is imported
    import contextlib

    import jax

    from benchmarks.environment import environment
    from jax_mamba2.bridge import aot
    from jax_mamba2.flax_layers import Mamba2LMHeadModel

    config = lm_train.TrainConfig.parse(config_name)
    record = {"config": config_name, "impl": impl, "lower_only": lower_only, "cutile_cache": cutile_cache,
              "cutile_cache_entries_before": _cache_entries(cutile_cache), "cpu_count": os.cpu_count(),
              "scan_layers": scan_layers}
    loss_impl = lm_train.choose_loss("auto", Mamba2LMHeadModel)
    with aot.cuda_target("sm_90") if lower_only else contextlib.nullcontext():
        began = time.perf_counter()
        step, *args = lm_train.make_train_step(config, impl, loss_impl, abstract=lower_only, scan_layers=scan_layers)
        if not lower_only:
            jax.block_until_ready(args)
        record["model_s"] = time.perf_counter() - began
        compiled, seconds = lm_train.compile_step(step, *args, platform="cuda" if lower_only else None)
    record.update(seconds)
    if not lower_only:
        began = time.perf_counter()
        loss = float(compiled(*args)[2])
        record["run_s"] = time.perf_counter() - began
        record["loss"] = loss
    stages = ("trace_s", "lower_s", "xla_compile_s", "run_s")
    record["first_step_s"] = sum(record[k] for k in stages if record.get(k) is not None)
    record["environment"] = environment()
    return record


def main(argv=None) -> int:
    parser = lm_bench.make_parser(__doc__)
    parser.add_argument("--config", default=lm_train.DEFAULT_CONFIG,
                        help=f"d<width>-l<layers>-<batch>x<seqlen> (default: {lm_train.DEFAULT_CONFIG})")
    parser.add_argument("--impl", choices=lm_train.OURS, default="cutile", help="the SSD backend (default: cutile)")
    parser.add_argument("--lower-only", action="store_true", help="trace and lower for sm_90 only (no GPU needed)")
    parser.add_argument("--unroll-layers", action="store_true",
                        help="Mamba2LMHeadModel(scan_layers=False), the blocks unrolled (default: one scan)")
    parser.add_argument("--cutile-cache", help="cuTile's disk cache folder (default: a new empty one)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    try:
        lm_train.TrainConfig.parse(args.config)
    except ValueError as e:
        parser.error(str(e))
    if args.impl == "cutile" and not args.lower_only:
        exit_unless_cutile_runs("first_step.py (--lower-only needs no GPU)")
    with tempfile.TemporaryDirectory(prefix="cutile_cache_") as empty:
        record = first_step(args.config, args.impl, args.lower_only, args.cutile_cache or empty,
                            scan_layers=not args.unroll_layers)
    if not args.cutile_cache:
        record["cutile_cache"] = "a new empty folder"
    path = lm_bench.results_path(args.out, "first_step")
    lm_bench.merge_results(path, "first_step", [record], key=lambda r: (
        r["config"], r["impl"], r["lower_only"], r["cutile_cache_entries_before"] > 0, r.get("scan_layers", True)))
    stages = ", ".join(f"{k} {record[k]:.2f}" for k in ("model_s", "trace_s", "lower_s", "xla_compile_s", "run_s")
                       if record.get(k) is not None)
    layers = ", layers unrolled" if args.unroll_layers else ""
    print(f"{args.config} {args.impl}{layers}: first step {record['first_step_s']:.1f} s ({stages}); "
          f"{record['cubins_compiled']} cubins compiled\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
