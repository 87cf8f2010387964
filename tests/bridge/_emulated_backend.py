"""The cuTile backend with every kernel plan run on the NumPy emulator of tests/kernels/_cutile_emulator.py
(float64, through `jax.pure_callback`): bridge/ops.py's forward, saving forward, backward and vmap rules
without a GPU. Register it (`op.register_backend`) to reach it through `ssd(backend="cutile_emulated")`.
"""
import jax
import jax.numpy as jnp
import numpy as np

from jax_mamba2 import op
from jax_mamba2.bridge import ops
from tests.kernels import _cutile_emulator as emulator


def _run_plan_emulated(plan, arrays):
    """A bridge RunPlan: `plan` on the emulator in float64, its outputs cast to the plan's dtypes."""
    names = list(plan.inputs)
    shapes = [jax.ShapeDtypeStruct(arrays[n].shape, arrays[n].dtype) if n in plan.inputs
              else jax.ShapeDtypeStruct(plan.buffers[n].shape, jnp.dtype(plan.buffers[n].dtype))
              for n in plan.outputs]

    def host(*values):
        out = emulator.run_plan(plan, dict(zip(names, map(np.asarray, values))), float64=True)
        return tuple(out[n].astype(s.dtype) for n, s in zip(plan.outputs, shapes))

    return dict(zip(plan.outputs, jax.pure_callback(host, shapes, *(arrays[n] for n in names))))


EMULATED = op.Backend(
    name="cutile_emulated", forward=ops.make_forward(_run_plan_emulated),
    forward_saving=ops.make_forward_saving(_run_plan_emulated), backward=ops.make_backward(_run_plan_emulated),
    unsupported_reason=lambda inputs, static: None)
