"""Cost of one extra cuTile launch through each bridge path, with a kernel that does almost nothing.

The kernel adds one to 256 floats (grid (1,)). For N in {1, 32, 128}, one program chains N launches
(each reads the previous one's output, so none can be dropped or reordered) and its wall time per
call (median, block_until_ready or stream synchronize) is measured; the slope of a least-squares line
through (N, time) is the cost per extra launch, its intercept the fixed cost of one program call.

  cutile_call   N bare `cuda.tile.jax.cutile_call`s inside one jax.jit
  ffi_plan      N `jax_mamba2.bridge.ffi.run_plan` calls of a one-launch Plan inside one jax.jit
  callback_plan N `jax_mamba2.bridge.callback.run_plan` calls (N buffer_callbacks) inside one jax.jit
  ct_launch     N Python `ct.launch`es on CuPy arrays, then one stream synchronize (no JAX)

  source .gpu/gpu-env.sh && python benchmarks/bridge_overhead.py --out $OUT
writes <out>/bridge_overhead_<gpu>.json and prints its table.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

if __package__ in (None, ""):  # run as a script: benchmarks/ is sys.path[0], the repo root may not be
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cuda.tile as ct  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import report  # noqa: E402
from benchmarks.environment import environment, gpu_slug  # noqa: E402
from jax_mamba2.kernels._common import Buffer, ConstInt, Launch, Plan  # noqa: E402

SIZE = 256
CALL_COUNTS = (1, 32, 128)
PATHS = ("cutile_call", "ffi_plan", "callback_plan", "ct_launch")


@ct.kernel
def add_one_kernel(x, y, SIZE: ConstInt):
    ct.store(y, index=(0,), tile=ct.load(x, index=(0,), shape=(SIZE,)) + 1.0)


def add_one_plan() -> Plan:
    """A one-launch Plan: y = x + 1 over SIZE float32 values."""
    return Plan(inputs=("x",), buffers={"y": Buffer((SIZE,), "float32")},
                launches=(Launch(add_one_kernel, (1,), ("x", "y", SIZE), writes=("y",)),),
                outputs=("y",))


def _chained_jit(step: Callable[[jax.Array], jax.Array], n: int):
    def program(x):
        for _ in range(n):
            x = step(x)
        return x
    return jax.jit(program)


def _jax_step(path: str):
    if path == "cutile_call":
        from cuda.tile.jax import OutputPlaceholder, cutile_call
        return lambda x: cutile_call((1,), add_one_kernel,
                                     (x, OutputPlaceholder((SIZE,), jnp.float32), SIZE))
    from jax_mamba2.bridge import callback, ffi
    run_plan = ffi.run_plan if path == "ffi_plan" else callback.run_plan
    plan = add_one_plan()
    return lambda x: run_plan(plan, {"x": x})["y"]


def time_jax_path(path: str, n: int, iters: int) -> tuple[float, float]:
    """(median us per program call, the result's first value) for N chained launches via `path`."""
    fn = _chained_jit(_jax_step(path), n)
    x = jnp.zeros((SIZE,), jnp.float32)
    out = jax.block_until_ready(fn(x))
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(x))
        samples.append((time.perf_counter() - start) * 1e6)
    return float(np.median(samples)), float(out[0])


def time_ct_launch(n: int, iters: int) -> tuple[float, float]:
    """The same chain as Python ct.launch calls on CuPy arrays and one synchronize per program."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    buffers = [cp.zeros((SIZE,), cp.float32), cp.zeros((SIZE,), cp.float32)]

    def program():
        buffers[0].fill(0)  # enqueued on the null stream: synchronise before the chain
        cp.cuda.Device().synchronize()
        for i in range(n):
            ct.launch(stream, (1,), add_one_kernel, (buffers[i % 2], buffers[(i + 1) % 2], SIZE))
        stream.synchronize()
        return buffers[n % 2]

    program()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        out = program()
        samples.append((time.perf_counter() - start) * 1e6)
    return float(np.median(samples)), float(out[0])


def fit(counts, times_us) -> tuple[float, float]:
    """(slope us per extra call, intercept us) of the least-squares line through (N, time)."""
    slope, intercept = np.polyfit(np.asarray(counts, float), np.asarray(times_us, float), 1)
    return float(slope), float(intercept)


def measure(path: str, iters: int, env: dict) -> dict:
    record = {"op": "bridge_overhead", "impl": path, "n_calls": list(CALL_COUNTS), "error": None,
              "timing": "stream_synchronize" if path == "ct_launch" else "block_until_ready", **env}
    try:
        times, values = zip(*(time_ct_launch(n, iters) if path == "ct_launch"
                              else time_jax_path(path, n, iters) for n in CALL_COUNTS))
    except Exception as e:  # noqa: BLE001  one failing path must not end the run
        record["error"] = f"{type(e).__name__}: {e}"[:2000]
        return record
    if list(values) != [float(n) for n in CALL_COUNTS]:
        record["error"] = f"wrong results: {values} after {CALL_COUNTS} increments from zero"
    slope, intercept = fit(CALL_COUNTS, times)
    record.update(us_median=list(times), us_per_extra_call=slope, us_fixed=intercept)
    return record


def format_table(records: list[dict]) -> str:
    """Median us per program call for each N, the fitted us per extra launch, then any errors."""
    header = ("path", *(f"N={n} us" for n in CALL_COUNTS), "us/extra call", "fixed us")
    rows = [header] + [(r["impl"], *(f"{t:.1f}" for t in r["us_median"]),
                        f"{r['us_per_extra_call']:.2f}", f"{r['us_fixed']:.1f}")
                       for r in records if r.get("us_median") is not None]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"{r['impl']}: {r['error']}" for r in records if r.get("error")]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    env = environment()
    records = [measure(path, args.iters, env) for path in args.paths]
    args.out.mkdir(parents=True, exist_ok=True)
    path = report.write_records(records, args.out / f"bridge_overhead_{gpu_slug(env['gpu'])}.json")
    print(f"wrote {path}\n")
    print(format_table(report.load_records(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
