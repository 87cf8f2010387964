"""Executes a kernel `Plan` as XLA FFI custom calls (`cuda.tile.jax.cutile_call`) on XLA's stream.

Each launch becomes one custom call, of a target XLA may record into its command buffers (CUDA graphs) with
the kernels around it (`_compat.register_command_buffer_launches`, done on import): arrays the launch writes for
the first time become `OutputPlaceholder`s (XLA allocates them), arrays written again become `InputOutput`s
(aliased in place), everything else is a read-only input. Kernels are compiled to cubins when the jitted program
is lowered, all of a program's at once (`compile_ahead`: each launch is noted as it is traced); the
cubin travels inside the HLO.
"""
from __future__ import annotations

import jax.numpy as jnp
from cuda.tile.jax import InputOutput, OutputPlaceholder, cutile_call

from jax_mamba2.bridge import _compat, compile_ahead
from jax_mamba2.bridge.first_order import first_order_only
from jax_mamba2.kernels._common import Plan

_compat.register_command_buffer_launches()


def _run_plan(plan: Plan, arrays: dict) -> dict:
    """Runs `plan` on `arrays` (name -> jax.Array, one per plan input); returns its outputs by name."""
    env = dict(arrays)
    for name, buf in plan.buffers.items():
        if buf.zero_init:
            env[name] = jnp.zeros(buf.shape, buf.dtype)
    for launch in plan.launches:
        args, written = [], []
        for arg in launch.args:
            if not isinstance(arg, str):
                args.append(arg)
            elif arg in launch.writes:
                written.append(arg)
                if arg in env:
                    args.append(InputOutput(env[arg]))
                else:
                    buf = plan.buffers[arg]
                    args.append(OutputPlaceholder(buf.shape, jnp.dtype(buf.dtype)))
            else:
                args.append(env[arg])
        compile_ahead.note(launch.kernel, args)
        results = cutile_call(launch.grid, launch.kernel, tuple(args))
        if len(written) == 1:
            results = (results,)
        env.update(zip(written, results))
    return {name: env[name] for name in plan.outputs}


run_plan = first_order_only(_run_plan)
