"""The fused Mamba2 decode step (kernels/decode_step.py) for `jax_mamba2.decode_step`, on any plan executor.

Adds what the raw kernel call lacks: a vmap rule (the mapped axis folds into the kernel's batch axis, as in
ops.py), outputs that keep shard_map's varying axes, and a derivative rule that says there is none. Arrays go
to the kernel in their own dtypes (it converts on load) and absent options become literal constants of the
program, so the step adds no XLA op of its own besides zeroing the group norm's arrival counters.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_mamba2.bridge import _compat, problem
from jax_mamba2.bridge.batching import broadcast_unbatched, fold, unfold
from jax_mamba2.bridge.ops import RunPlan
from jax_mamba2.kernels import decode_step as kernels
from jax_mamba2.kernels._common import KERNEL_DTYPES

# Arrays with a leading batch axis: a vmapped axis over them folds into the kernel batch.
_PER_ROW = ("z", "xBC", "dt", "conv_state", "ssm_state")


def kernel_dims(inputs, static) -> kernels.DecodeStepDims:
    """What the kernel specialises on, from the op's checked arguments (DecodeStepInputs, DecodeStepStatic)."""
    batch, nheads, headdim, dstate = inputs.ssm_state.shape
    conv_dim, d_conv = inputs.conv_state.shape[1:]
    return kernels.DecodeStepDims(
        batch=batch, nheads=nheads, headdim=headdim, ngroups=(conv_dim - nheads * headdim) // (2 * dstate),
        dstate=dstate, d_conv=d_conv, dtype=jnp.dtype(inputs.xBC.dtype).name,
        conv_state_dtype=jnp.dtype(inputs.conv_state.dtype).name,
        ssm_state_dtype=jnp.dtype(inputs.ssm_state.dtype).name,
        param_dtype=jnp.dtype(inputs.conv_weight.dtype).name, has_conv_bias=inputs.conv_bias is not None,
        D_has_hdim=inputs.D is not None and inputs.D.ndim == 2, rmsnorm=inputs.norm_weight is not None,
        norm_before_gate=static.norm_before_gate, eps=static.eps, dt_softplus=static.dt_softplus,
        dt_limit=tuple(static.dt_limit))


def unsupported_reason(inputs, static) -> Optional[str]:
    """Why the decode kernel cannot run this step here (None when it can)."""
    for name, arr in inputs._asdict().items():
        if arr is not None and jnp.dtype(arr.dtype).name not in KERNEL_DTYPES:
            return f"{name}.dtype={arr.dtype} is not one of {KERNEL_DTYPES}: use backend='xla' or cast"
    dims = kernel_dims(inputs, static)
    reason = problem.shape_unsupported_reason(dtype=dims.dtype, headdim=dims.headdim, dstate=dims.dstate)
    return reason or kernels.decode_step_unsupported_reason(dims) or problem.gpu_unavailable_reason()


def _kernel_arrays(inputs, dims: kernels.DecodeStepDims) -> dict:
    """The plan's inputs: the arrays as given, and constants (literals in the program, no XLA op) for the
    absent options: zeros for conv_bias, D and dt_bias, a never-read dummy for norm_weight."""
    def constant_zeros(size):
        return jnp.asarray(np.zeros((size,), np.float32))

    return {**inputs._asdict(),
            "conv_bias": constant_zeros(1) if inputs.conv_bias is None else inputs.conv_bias,
            "D": constant_zeros(dims.nheads) if inputs.D is None else inputs.D,
            "dt_bias": constant_zeros(dims.nheads) if inputs.dt_bias is None else inputs.dt_bias,
            "norm_weight": constant_zeros(1) if inputs.norm_weight is None else inputs.norm_weight}


def kernel_plan(inputs, static) -> tuple:
    """(the decode plan of this call at the default config, its input arrays by name)."""
    dims = kernel_dims(inputs, static)
    return kernels.decode_step_plan(dims), _kernel_arrays(inputs, dims)


def _step_once(run_plan: RunPlan, inputs, static):
    plan, arrays = kernel_plan(inputs, static)
    out = run_plan(plan, arrays)
    return _compat.match_varying_axes(tuple(out[name] for name in plan.outputs), inputs)


@functools.cache
def _batchable_step(run_plan: RunPlan, static):
    all_batched = (True,) * len(kernels.DECODE_STEP_OUTPUTS)

    @jax.custom_batching.custom_vmap
    def step(inputs):
        return _step_once(run_plan, inputs, static)

    @step.def_vmap
    def step_vmap(axis_size, in_batched, inputs):
        batched = in_batched[0]
        if any(getattr(batched, name) for name in inputs._fields if name not in _PER_ROW):
            # Per-item parameters cannot share one launch: map over the items instead.
            return jax.lax.map(step, broadcast_unbatched(inputs, batched, axis_size)), all_batched
        folded = inputs._replace(**{name: fold(getattr(inputs, name), getattr(batched, name), axis_size)
                                    for name in _PER_ROW})
        return tuple(unfold(out, axis_size) for out in step(folded)), all_batched

    @jax.custom_jvp
    def inference_only(inputs):
        return step(inputs)

    @inference_only.defjvp
    def no_derivative(primals, tangents):
        del primals, tangents
        raise TypeError("mamba2_decode_step(backend='cutile') has no derivative: the fused decode kernel is "
                        "for inference; differentiate backend='xla' (or the layer's full forward) instead")

    return inference_only


def make_decode_step(run_plan: RunPlan):
    """run(inputs: DecodeStepInputs, static: DecodeStepStatic) -> (y, new_conv_state, new_ssm_state) on the
    fused decode kernel."""
    def run(inputs, static):
        return _batchable_step(run_plan, static)(inputs)
    return run
