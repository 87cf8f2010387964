"""Executes a kernel `Plan` inside one `jax.experimental.buffer_callback` (zero copy).

XLA allocates every plan buffer as an output of the callback and hands its device buffers to Python;
`ct.launch` enqueues the kernels on the callback's stream (`ctx.stream`), so nothing is copied or
synchronised. Intermediate buffers are extra outputs that the caller drops. Kernels are JIT-compiled by
cuTile at their first launch. Each callback carries its `PlanCall`, from which `merged_callbacks` launches
several plans from one callback.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import importlib.util
import threading
import types
from typing import Any, Callable, Optional

import cuda.tile as ct
import jax
import jax.numpy as jnp
from jax.experimental.buffer_callback import buffer_callback

from jax_mamba2.bridge.first_order import first_order_only
from jax_mamba2.kernels._common import Launch, Plan

# launch(ctx, launch, args, programmatic): enqueues one kernel launch on the callback's stream; `args` are the
# kernel's arguments (buffers and constants), `programmatic` asks for a programmatic dependent launch.
LaunchFn = Callable[[Any, Launch, tuple, bool], None]


def cuda_launch(ctx, launch: Launch, args: tuple, programmatic: bool) -> None:
    """`ct.launch` on the callback's stream: how every callback of this executor launches a kernel."""
    ct.launch(ctx.stream, launch.grid, launch.kernel, args, programmatic_dependent_launch=programmatic)


# Captured CUDA graphs of merged callbacks (`replay`), by the callback and its buffers' addresses, the most recently
# used last.
_GRAPHS: collections.OrderedDict = collections.OrderedDict()
GRAPH_CACHE_SIZE = 32
# XLA calls callbacks from a thread per device: the cache's reads and updates hold this lock (captures do not).
_GRAPHS_LOCK = threading.Lock()
# A CuPy graph destroys its CUDA graph when it is collected: at exit that must happen while the CUDA context and
# the kernels' modules are alive, i.e. before JAX's and cuda.tile's teardown (atexit runs the latest first).
atexit.register(_GRAPHS.clear)


def replay_unavailable_reason() -> Optional[str]:
    """Why `replay` cannot run here (it captures and launches its graphs through CuPy), or None."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'jax-mamba2[cuda]')"
    return None


def replay(ctx, launches: object, buffers, record: Callable[[Any], None]) -> None:
    """Runs record(ctx) (launches on ctx.stream) as a CUDA graph. XLA runs a buffer callback's Python at every
    call, also one that it may record into its command buffers, so launching ~100 kernels from Python costs more
    than the kernels at a few rows: the first call with `launches` (an object naming what record launches) on
    `buffers` (the callback's, at their addresses) launches them directly and captures the same launches on a side
    stream of the buffers' device into a graph (with their programmatic dependencies); later such calls launch that
    graph, one launch on ctx.stream."""
    import cupy  # the [cuda] extra; only where a merged callback runs on a GPU

    addresses = [b.__cuda_array_interface__["data"][0] for b in buffers]
    key = (launches, *addresses)
    with _GRAPHS_LOCK:
        cached = _GRAPHS.get(key)
        if cached is not None:
            _GRAPHS.move_to_end(key)
    if cached is None:
        record(ctx)  # this call's results; the kernels compile at their first launch, outside any capture
        device = cupy.cuda.runtime.pointerGetAttributes(addresses[0]).device  # XLA's, not necessarily CuPy's
        with cupy.cuda.Device(device):
            capture = cupy.cuda.Stream(non_blocking=True)
            # Relaxed: XLA's threads may call CUDA while this thread captures (a global capture would fail them).
            capture.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
            try:
                record(types.SimpleNamespace(stream=capture.ptr))
            finally:
                graph = capture.end_capture()
            graph.upload(capture)  # instantiated and on the device before its first launch,
            capture.synchronize()  # which goes to XLA's stream: the upload done first (once per graph)
        with _GRAPHS_LOCK:
            _GRAPHS[key] = graph, device
            while len(_GRAPHS) > GRAPH_CACHE_SIZE:
                _GRAPHS.popitem(last=False)  # CUDA frees a graph still running once it has run
        return
    graph, device = cached
    with cupy.cuda.Device(device):
        cupy.cuda.runtime.graphLaunch(graph.graphExec, ctx.stream)  # on XLA's stream, with no stream object


@dataclasses.dataclass(frozen=True)
class PlanCall:
    """What one callback of `run_plan` runs: `plan`, its arrays being the callback's inputs (`input_names`, in
    order) and outputs (`output_names`, in order; an output aliased to an input is the same array)."""

    plan: Plan
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def launch_all(self, ctx, inputs, outputs) -> None:
        env = dict(zip(self.input_names, inputs))
        env.update(zip(self.output_names, outputs))
        for launch in self.plan.launches:
            cuda_launch(ctx, launch, tuple(env[a] if isinstance(a, str) else a for a in launch.args), False)


def _callback(call: PlanCall):
    def callback(ctx, outputs, *inputs):
        call.launch_all(ctx, inputs, outputs)
    callback.plan_call = call  # what merged_callbacks reads to launch the plan from a callback of its own
    return callback


def _run_plan(plan: Plan, arrays: dict) -> dict:
    """Runs `plan` on `arrays` (name -> jax.Array, one per plan input); returns its outputs by name.

    Plan outputs that are inputs (written in place) and zero-initialised buffers that a launch writes are passed
    as inputs aliased to outputs, so XLA provides their contents to the callback; zero-initialised buffers that
    no launch writes (placeholders) are plain inputs.
    """
    written = {name for launch in plan.launches for name in launch.writes} | set(plan.outputs)
    zeros = [n for n, buf in plan.buffers.items() if buf.zero_init]
    aliased_inputs = [n for n in plan.outputs if n in plan.inputs]
    seeded = aliased_inputs + [n for n in zeros if n in written]
    buffer_names = [n for n in plan.buffers if n not in zeros or n in written] + aliased_inputs
    env = dict(arrays)
    for name in zeros:
        env[name] = jnp.zeros(plan.buffers[name].shape, plan.buffers[name].dtype)
    input_names = list(plan.inputs) + [n for n in zeros if n not in written] + seeded
    aliases = {input_names.index(n): buffer_names.index(n) for n in seeded}
    result_shapes = [jax.ShapeDtypeStruct(env[n].shape, env[n].dtype) if n in aliased_inputs
                     else jax.ShapeDtypeStruct(plan.buffers[n].shape, jnp.dtype(plan.buffers[n].dtype))
                     for n in buffer_names]
    call = buffer_callback(_callback(PlanCall(plan, tuple(input_names), tuple(buffer_names))), result_shapes,
                           input_output_aliases=aliases or None)
    results = call(*(env[n] for n in input_names))
    out = dict(zip(buffer_names, results))
    return {name: out[name] for name in plan.outputs}


run_plan = first_order_only(_run_plan)
