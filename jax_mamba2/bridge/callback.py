"""Executes a kernel `Plan` inside one `jax.experimental.buffer_callback` (zero copy).

XLA allocates every plan buffer as an output of the callback and hands its device buffers to Python;
`ct.launch` enqueues the kernels on the callback's stream (`ctx.stream`), so nothing is copied or
synchronised. Intermediate buffers are extra outputs that the caller drops. Kernels are JIT-compiled by
cuTile at their first launch.
"""
from __future__ import annotations

import cuda.tile as ct
import jax
import jax.numpy as jnp
from jax.experimental.buffer_callback import buffer_callback

from jax_mamba2.bridge.merged_callbacks import PlanCall
from jax_mamba2.kernels._common import Plan


def _launch_all(plan: Plan, input_names, buffer_names):
    def callback(ctx, outputs, *inputs):
        env = dict(zip(input_names, inputs))
        env.update(zip(buffer_names, outputs))
        for launch in plan.launches:
            args = tuple(env[a] if isinstance(a, str) else a for a in launch.args)
            ct.launch(ctx.stream, launch.grid, launch.kernel, args)
    # What merged_callbacks reads to launch the plan from a callback of its own.
    callback.plan_call = PlanCall(plan, tuple(input_names), tuple(buffer_names))
    return callback


def run_plan(plan: Plan, arrays: dict) -> dict:
    """Runs `plan` on `arrays` (name -> jax.Array, one per plan input); returns its outputs by name.

    Plan outputs that are inputs (written in place) and zero-initialised buffers are passed as inputs
    aliased to outputs, so XLA provides their contents to the callback.
    """
    aliased_inputs = [n for n in plan.outputs if n in plan.inputs]
    buffer_names = list(plan.buffers) + aliased_inputs
    env = dict(arrays)
    for name, buf in plan.buffers.items():
        if buf.zero_init:
            env[name] = jnp.zeros(buf.shape, buf.dtype)
    seeded = aliased_inputs + [n for n, buf in plan.buffers.items() if buf.zero_init]
    input_names = list(plan.inputs) + seeded
    aliases = {len(plan.inputs) + i: buffer_names.index(n) for i, n in enumerate(seeded)}
    result_shapes = [jax.ShapeDtypeStruct(env[n].shape, env[n].dtype) if n in aliased_inputs
                     else jax.ShapeDtypeStruct(plan.buffers[n].shape, jnp.dtype(plan.buffers[n].dtype))
                     for n in buffer_names]
    call = buffer_callback(_launch_all(plan, input_names, buffer_names), result_shapes,
                           input_output_aliases=aliases or None)
    results = call(*(env[n] for n in input_names))
    out = dict(zip(buffer_names, results))
    return {name: out[name] for name in plan.outputs}
