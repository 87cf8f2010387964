"""Probe: can a chain of cuTile launches inside a jitted loop take programmatic dependent launch (PDL)?

The decode token step is ~100 launches whose latency, not their bytes, sets its time (docs/design.md, Decode).
PDL lets a kernel start while the one before it on the stream finishes (the dependent waits in
`ct.grid_dependency_control_wait()` before reading what its predecessor wrote); outside JAX it took 13.5% off
the token step. The FFI executor's launches carry no launch attribute, but `ct.launch(...,
programmatic_dependent_launch=True)` does, and `buffer_callback(command_buffer_compatible=True)` lets XLA
record a callback's launches into its command buffers (CUDA graphs) once and replay them, with no Python per
call. What this probe decides, before any executor is built on it: whether XLA really replays such a
callback without calling Python again inside a `lax.scan`, whether PDL survives that capture (the outputs
stay right and the time drops), and what a launch costs each way.

A chain of N launches of `add_one_kernel` (each block loads a tile, adds one, stores it) runs T times in a
jitted `lax.scan`; the result must be x + N * T. Executors:
- `ffi`: one custom call per launch (the package's FFI executor, `ffi.run_plan`, in XLA's command buffers);
- `callback`: one `buffer_callback` per scan step launching all N (Python runs every step);
- `graph`: the same callback with `command_buffer_compatible=True` (XLA still ran its Python every step);
- `replay`: the callback launching a CUDA graph of the N launches, captured at its first call
  (`bridge.callback.replay`, what the merged token step does);
- `replay_pdl_wait` / `replay_pdl_early`: that, the launches programmatic dependents, each kernel waiting at its
  top (and, early, also letting its dependent launch right away).
Per executor: ms per scan step (median of synchronised calls), us per launch, how often Python ran the
callback, and whether the result was right.

On the GPU machine (cuda-tile):
  source .gpu/gpu-env.sh
  python benchmarks/tools/callback_graph.py --out $OUT
Writes <out>/callback_graph_<gpu>.json (JAX_MAMBA2_GIT_SHA names the commit) and prints one line per record.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import cuda.tile as ct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import lm_bench  # noqa: E402
from jax_mamba2.bridge import callback, ffi  # noqa: E402
from jax_mamba2.kernels._common import (INDEPENDENT, WAITS, WAITS_AND_RELEASES, Buffer, Launch, Plan,  # noqa: E402
                                        wait_for_predecessor)

EXECUTORS = ("ffi", "callback", "graph", "replay", "replay_pdl_wait", "replay_pdl_early")


def _add_one(x, y, TILE: ct.Constant[int], DEPENDENT: ct.Constant[int]):
    """y[b * TILE:(b + 1) * TILE] = x[...] + 1 (float32), waiting for its predecessor as DEPENDENT says (as the
    decode kernels do)."""
    wait_for_predecessor(DEPENDENT)
    block = ct.bid(0)
    tile = ct.load(x, index=(block,), shape=(TILE,))
    ct.store(y, index=(block,), tile=tile + 1.0)


# The FFI executor records into command buffers only the launches of this package's kernels (by module name,
# `_compat.register_command_buffer_launches`); the probe's kernel takes that name so that `ffi` is the executor
# as the package runs it.
_add_one.__module__ = "jax_mamba2.probe"
add_one_kernel = ct.kernel(_add_one)


def _chain_callback(grid, tile, launches, dependent, pdl, calls, replayed):
    launch = Launch(add_one_kernel, grid, ("x", "y", tile, dependent), ("y",))

    def callback_fn(ctx, outputs, x):
        calls[0] += 1
        y, scratch = outputs
        # launch i reads the previous one's output: x -> a -> b -> ... -> y, alternating y and scratch
        targets = [y if (launches - 1 - i) % 2 == 0 else scratch for i in range(launches)]

        def record(ctx):  # as the package's callbacks launch: callback.cuda_launch
            source = x
            for target in targets:
                callback.cuda_launch(ctx, launch, (source, target, tile, dependent), pdl)
                source = target
        if replayed:
            callback.replay(ctx, callback_fn, (x, y, scratch), record)
        else:
            record(ctx)
    return callback_fn


def make_step(executor: str, size: int, tile: int, launches: int):
    """(step(x) -> x + launches, calls): one scan step of `executor`; calls[0] counts Python callback runs."""
    grid, calls = (size // tile, 1, 1), [0]
    if executor == "ffi":
        plan = Plan(inputs=("x",), buffers={"y": Buffer((size,), "float32")},
                    launches=(Launch(add_one_kernel, grid, ("x", "y", tile, INDEPENDENT), ("y",)),), outputs=("y",))

        def step(x):
            for _ in range(launches):
                x = ffi.run_plan(plan, {"x": x})["y"]
            return x
        return step, calls
    dependent, pdl = {"callback": (INDEPENDENT, False), "graph": (INDEPENDENT, False),
                      "replay": (INDEPENDENT, False), "replay_pdl_wait": (WAITS, True),
                      "replay_pdl_early": (WAITS_AND_RELEASES, True)}[executor]
    shapes = [jax.ShapeDtypeStruct((size,), jnp.float32)] * 2
    chain = _chain_callback(grid, tile, launches, dependent, pdl, calls, executor.startswith("replay"))
    call = buffer_callback(chain, shapes, command_buffer_compatible=executor == "graph")

    def step(x):
        return call(x)[0]
    return step, calls


def measure(executor: str, *, size: int, tile: int, launches: int, steps: int, repeats: int) -> dict:
    step, calls = make_step(executor, size, tile, launches)

    @jax.jit
    def run(x):
        return jax.lax.scan(lambda c, _: (step(c), None), x, None, length=steps)[0]

    x = jax.random.normal(jax.random.key(0), (size,), jnp.float32)
    expected = np.asarray(x) + launches * steps
    result = np.asarray(run(x))  # compiles; the callback executors' first capture
    right = bool(np.allclose(result, expected, rtol=0, atol=1e-3 * launches * steps))
    began = time.perf_counter()
    while time.perf_counter() - began < 0.5:  # the clocks idle low after a compilation
        run(x).block_until_ready()
    calls_before, samples = calls[0], []
    for _ in range(repeats):
        began = time.perf_counter()
        out = run(x)
        out.block_until_ready()
        samples.append((time.perf_counter() - began) * 1e3)
    right = right and bool(np.allclose(np.asarray(out), expected, rtol=0, atol=1e-3 * launches * steps))
    ms = statistics.median(samples) / steps
    return {"executor": executor, "size": size, "tile": tile, "blocks": size // tile, "launches": launches,
            "scan_steps": steps, "ms_per_step": ms, "us_per_launch": ms * 1e3 / launches,
            "python_calls_per_run": (calls[0] - calls_before) / repeats, "right": right}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executors", nargs="+", choices=EXECUTORS, default=list(EXECUTORS))
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 132])
    parser.add_argument("--tile", type=int, default=1024)
    parser.add_argument("--launches", type=int, default=98)
    parser.add_argument("--steps", type=int, default=64, help="scan steps per run")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--worker-timeout", type=float, default=60.0,
                        help="seconds per executor and grid, each in a process of its own (a hang or crash of one "
                             "executor is recorded, the others still run)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a worker: EXECUTOR,BLOCKS
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.one:
        executor, blocks = args.one.split(",")
        print(json.dumps(measure(executor, size=int(blocks) * args.tile, tile=args.tile, launches=args.launches,
                                 steps=args.steps, repeats=args.repeats)), flush=True)
        return
    records = []
    for blocks in args.blocks:
        for executor in args.executors:
            command = [sys.executable, __file__, "--one", f"{executor},{blocks}", "--tile", str(args.tile),
                       "--launches", str(args.launches), "--steps", str(args.steps), "--repeats", str(args.repeats)]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.worker_timeout)
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                record = json.loads(lines[-1]) if lines else {
                    "executor": executor, "blocks": blocks, "error": f"exit {done.returncode}: "
                    + (done.stderr.strip().splitlines() or [""])[-1][:500]}
            except subprocess.TimeoutExpired:
                record = {"executor": executor, "blocks": blocks, "error": f"timed out after {args.worker_timeout} s"}
            records.append(record)
            print(json.dumps(record), flush=True)
    if args.out:
        path = lm_bench.results_path(Path(args.out), "callback_graph")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"git_sha": lm_bench.git_sha(), "jax": jax.__version__,
                                    "device": jax.devices()[0].device_kind, "records": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
