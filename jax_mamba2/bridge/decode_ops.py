"""The fused Mamba2 decode step (kernels/decode_step.py) for `jax_mamba2.decode_step`, on any plan executor.

Adds what the raw kernel call lacks: a vmap rule (the mapped axis folds into the kernel's batch axis) and
outputs that keep shard_map's varying axes. Arrays go to the kernel in their own dtypes (it converts on load)
and absent options become literal constants of the program, so the launch adds no XLA op of its own.

`inputs` are the op's `DecodeStepInputs`, `static` its `DecodeStepStatic`.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_mamba2.bridge import _compat, problem
from jax_mamba2.bridge.batching import broadcast_unbatched, fold, unfold
from jax_mamba2.kernels import decode_step as kernels
from jax_mamba2.kernels._common import KERNEL_DTYPES

RunPlan = Callable[..., dict]

# Arrays with a leading batch axis: a vmapped axis over them folds into the kernel's batch.
_PER_ROW = ("zxbcdt", "conv_state", "ssm_state")
# The op's arrays that reach the kernel (norm_weight is applied by the op after the launch).
_KERNEL_ARRAYS = ("zxbcdt", "conv_state", "conv_weight", "conv_bias", "ssm_state", "A_log", "D", "dt_bias")


def kernel_dims(inputs, static) -> kernels.DecodeStepDims:
    """What the kernel specialises on, from the op's checked arguments."""
    batch, nheads, headdim, dstate = inputs.ssm_state.shape
    conv_dim, d_conv = inputs.conv_state.shape[1:]
    d_ssm = nheads * headdim
    return kernels.DecodeStepDims(
        batch=batch, nheads=nheads, headdim=headdim, ngroups=(conv_dim - d_ssm) // (2 * dstate), dstate=dstate,
        d_conv=d_conv, d_mlp=(inputs.zxbcdt.shape[1] - d_ssm - conv_dim - nheads) // 2,
        dtype=jnp.dtype(inputs.zxbcdt.dtype).name, conv_state_dtype=jnp.dtype(inputs.conv_state.dtype).name,
        ssm_state_dtype=jnp.dtype(inputs.ssm_state.dtype).name,
        conv_weight_dtype=jnp.dtype(inputs.conv_weight.dtype).name, has_conv_bias=inputs.conv_bias is not None,
        has_D=inputs.D is not None, D_has_hdim=inputs.D is not None and inputs.D.ndim == 2,
        has_dt_bias=inputs.dt_bias is not None, rmsnorm=inputs.norm_weight is not None,
        norm_before_gate=static.norm_before_gate, dt_softplus=static.dt_softplus,
        dt_limit=tuple(static.dt_limit))


def unsupported_reason(inputs, static) -> Optional[str]:
    """Why the decode kernel cannot run this step here (None when it can)."""
    for name, arr in inputs._asdict().items():
        if arr is not None and jnp.dtype(arr.dtype).name not in KERNEL_DTYPES:
            return f"{name}.dtype={arr.dtype} is not one of {KERNEL_DTYPES}: use backend='xla' or cast"
    dims = kernel_dims(inputs, static)
    reason = problem.shape_unsupported_reason(dtype=dims.dtype, headdim=dims.headdim, dstate=dims.dstate)
    return reason or kernels.decode_step_unsupported_reason(dims) or problem.gpu_unavailable_reason()


def _kernel_arrays(inputs) -> dict:
    """The plan's inputs: the arrays as given, a never-read literal (1,) for each absent option."""
    dummy = jnp.asarray(np.zeros((1,), np.float32))
    arrays = {name: getattr(inputs, name) for name in _KERNEL_ARRAYS}
    return {name: dummy if arr is None else arr for name, arr in arrays.items()}


def kernel_plan(inputs, static, cfg: kernels.DecodeStepConfig | None = None) -> tuple:
    """(the decode plan of this call at `cfg` (None: the default), its input arrays by name)."""
    return kernels.decode_step_plan(kernel_dims(inputs, static), cfg), _kernel_arrays(inputs)


def _run_once(run_plan: RunPlan, inputs, static) -> dict:
    plan, arrays = kernel_plan(inputs, static)
    out = run_plan(plan, arrays)
    if plan.buffers["sumsq"].shape == (1, 1):  # no norm: the dummy was never written
        del out["sumsq"]
    else:  # one sum of squares per group: a shape that does not depend on the config's BLOCK_P
        dims = kernel_dims(inputs, static)
        out["sumsq"] = out["sumsq"].reshape(dims.batch, dims.ngroups, -1).sum(axis=-1)
    return _compat.match_varying_axes({name: out[name] for name in plan.outputs if name in out}, inputs)


@functools.cache
def _batchable_step(run_plan: RunPlan, static):
    """inputs -> {"gated", "sumsq" (batch, ngroups) f32 (only with the norm), "new_conv_state",
    "new_ssm_state"} under a vmap rule."""

    @jax.custom_batching.custom_vmap
    def step(inputs):
        return _run_once(run_plan, inputs, static)

    @step.def_vmap
    def step_vmap(axis_size, in_batched, inputs):
        batched = in_batched[0]
        if any(getattr(batched, name) for name in inputs._fields if name not in _PER_ROW):
            # Per-item parameters cannot share one launch: map over the items instead.
            out = jax.lax.map(step, broadcast_unbatched(inputs, batched, axis_size))
        else:
            folded = inputs._replace(**{name: fold(getattr(inputs, name), getattr(batched, name), axis_size)
                                        for name in _PER_ROW})
            out = jax.tree.map(lambda a: unfold(a, axis_size), step(folded))
        return out, jax.tree.map(lambda _: True, out)

    return step


def make_decode_step(run_plan: RunPlan):
    """run(inputs, static) -> {"gated": (batch, d_ssm) f32 with the norm, else the output in zxbcdt's dtype;
    "sumsq": (batch, ngroups) f32 sums of squares of the norm's statistic (only with the norm);
    "new_conv_state", "new_ssm_state"} of the fused decode kernel."""
    def run(inputs, static):
        return _batchable_step(run_plan, static)(inputs)
    return run
