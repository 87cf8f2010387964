"""The SSD op and decode step on the cuTile kernels, for any plan executor (FFI or callback).

Adds what raw kernel calls lack: a vmap rule (the mapped axis folds into the kernel's batch axis),
outputs that keep shard_map's varying axes, and kernel configs chosen per problem (forward and
backward, see the tuning package).

The gate z: a forward alone applies it inside the forward kernels. A differentiated call runs them gate-free,
applies y * silu(z) as an XLA elementwise op and saves y for the gate's VJP (as mamba_ssm saves its pre-gate
out_x), so the backward kernels never see z: with the gate in them, the backward's first block pass had
recomputed y and compiled to twice the registers, and the forward + backward ran much slower.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jax_mamba2.bridge import _compat, problem, tuning
from jax_mamba2.bridge.batching import broadcast_unbatched, fold, map_items, unfold
from jax_mamba2.kernels import backward as backward_kernels
from jax_mamba2.kernels import forward as forward_kernels
from jax_mamba2.kernels import state_update as step_kernels
from jax_mamba2.kernels._common import KERNEL_DTYPES, SSDDims

RunPlan = Callable[..., dict]

# Arrays with a leading batch axis: a vmapped axis over them folds into the kernel batch.
_PER_ROW = ("x", "dt", "B", "C", "z", "initial_states", "seq_idx", "reach", "dx_reach")
_PER_HEAD = ("A", "D", "dt_bias")


def _gate(y, z):
    """y * silu(z) computed in f32, in y's dtype: y, z (batch, seqlen, nheads, headdim)."""
    z32 = z.astype(jnp.float32)
    return (y.astype(jnp.float32) * z32 * jax.nn.sigmoid(z32)).astype(y.dtype)


def _gate_vjp(y, z, dout):
    """(∂L/∂y, ∂L/∂z) of out = _gate(y, z) for the cotangent dout (in y's dtype), in y's and z's dtypes."""
    return jax.vjp(_gate, y, z)[1](dout)


def _forward_once(run_plan: RunPlan, inputs, static, save_states: bool):
    dims = problem.kernel_dims(inputs, static)
    layout, configs = tuning.forward_configs(dims)
    plan = forward_kernels.forward_plan(dims, configs, layout, save_states=save_states)
    out = run_plan(plan, problem.kernel_inputs(inputs, dims))
    return _compat.match_varying_axes(tuple(out[name] for name in plan.outputs), inputs)


@functools.cache
def _batchable_forward(run_plan: RunPlan, static, save_states: bool):
    """(y, final_states), and with `save_states` the forward plan's SAVED_FOR_BACKWARD, under a vmap rule."""
    all_batched = (True,) * (2 + (len(forward_kernels.SAVED_FOR_BACKWARD) if save_states else 0))

    @jax.custom_batching.custom_vmap
    def forward(inputs):
        return _forward_once(run_plan, inputs, static, save_states)

    @forward.def_vmap
    def forward_vmap(axis_size, in_batched, inputs):
        batched = in_batched[0]
        if any(getattr(batched, n) for n in _PER_HEAD):
            # Per-item parameters cannot share one launch: map over the items instead.
            return jax.lax.map(forward, broadcast_unbatched(inputs, batched, axis_size)), all_batched
        folded = inputs._replace(**{n: fold(getattr(inputs, n), getattr(batched, n), axis_size)
                                    for n in _PER_ROW if getattr(inputs, n) is not None})
        return tuple(unfold(out, axis_size) for out in forward(folded)), all_batched

    return forward


def make_forward(run_plan: RunPlan):
    """forward(inputs: SSDInputs, static: SSDStatic) -> (y, final_states) on the cuTile kernels."""
    def forward(inputs, static):
        return _batchable_forward(run_plan, static, False)(inputs)
    return forward


def make_forward_saving(run_plan: RunPlan):
    """forward_saving(inputs, static) -> ((y, final_states), saved): the forward a custom VJP runs. It
    saves the chunk-entry states (batch, nchunks, nheads, headdim, dstate) in x's dtype, dstate /
    chunk_size times x's bytes, which the fused kernels store as they pass and the staged layout writes
    anyway, and the chunk quantities Δ and dA_cumsum (f32, 8 bytes per token and head), so that the
    backward recomputes neither (a chain pass over all chunks, and the cumsum); with a gate z also the
    pre-gate output y."""
    def forward_saving(inputs, static):
        y, final, *saved = _batchable_forward(run_plan, static, True)(inputs._replace(z=None))
        if inputs.z is None:
            return (y, final), tuple(saved)
        return (_gate(y, inputs.z), final), (*saved, y)
    return forward_saving


def _backward_once(run_plan: RunPlan, inputs, static, dy, dfinal, saved):
    dims = problem.kernel_dims(inputs, static)
    arrays = problem.kernel_inputs(inputs, dims)
    arrays["dout"] = dy.astype(dims.dtype)
    arrays["dfinal_states"] = dfinal.astype(jnp.float32)
    if saved is not None:
        arrays.update(zip(forward_kernels.SAVED_FOR_BACKWARD, saved))
    deterministic = static.deterministic_backward  # no float atomics: bitwise reproducible
    plan = backward_kernels.backward_plan(dims, tuning.backward_configs(dims, deterministic),
                                          deterministic=deterministic, saved_states=saved is not None)
    out = _compat.match_varying_axes(run_plan(plan, arrays), (inputs, dy, dfinal))

    def like(grad, primal):
        return None if primal is None else grad.astype(primal.dtype)

    D = inputs.D
    dD = None if D is None else out["dD"].sum(axis=1) if D.ndim == 1 else out["dD"]
    grads = type(inputs)(
        x=like(out["dx"], inputs.x), dt=like(out["ddt"], inputs.dt), A=like(out["dA"], inputs.A),
        B=like(out["dB"], inputs.B), C=like(out["dC"], inputs.C), D=like(dD, D),
        z=None, dt_bias=like(out["ddt_bias"], inputs.dt_bias),
        initial_states=like(out["dinitial_states"], inputs.initial_states), seq_idx=None)
    return _compat.reduce_to_primal_axes(grads, inputs._replace(seq_idx=None))


@functools.cache
def _batchable_backward(run_plan: RunPlan, static):
    @jax.custom_batching.custom_vmap
    def backward(inputs, dy, dfinal, saved):
        return _backward_once(run_plan, inputs, static, dy, dfinal, saved)

    @backward.def_vmap
    def backward_vmap(axis_size, in_batched, inputs, dy, dfinal, saved):
        # Parameter gradients are sums over the batch, so items cannot share one launch.
        args = broadcast_unbatched((inputs, dy, dfinal, saved), tuple(in_batched), axis_size)
        grads = jax.lax.map(lambda a: backward(*a), args)
        return grads, jax.tree.map(lambda _: True, grads)

    return backward


def make_backward(run_plan: RunPlan):
    """backward(inputs, static, dy, dfinal_states, saved) -> SSDInputs of cotangents, on the cuTile
    kernels; `saved` as `make_forward_saving` saved it, or None (recomputed); `inputs.dx_reach`, where given,
    is added to the rows of dx."""
    def backward(inputs, static, dy, dfinal, saved=None):
        z, ungated = inputs.z, inputs._replace(z=None)
        if z is None:
            return _batchable_backward(run_plan, static)(ungated, dy, dfinal, saved)
        if saved is None:  # recomputed: the pre-gate output, and what the backward would recompute anyway
            y, _, *saved = _batchable_forward(run_plan, static, True)(ungated._replace(dx_reach=None))
            saved = tuple(saved)
        else:
            saved, y = saved[:-1], saved[-1]
        dy, dz = _gate_vjp(y, z, dy)
        return _batchable_backward(run_plan, static)(ungated, dy, dfinal, saved)._replace(z=dz)
    return backward


def step_unsupported_reason(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit):
    """Why the decode kernel cannot run this step (None when it can)."""
    del dt, A, C, D, z, dt_bias, dt_softplus, dt_limit
    if state.dtype == jnp.float64 or x.dtype == jnp.float64:
        return "float64 state or x; the kernels compute in float32: use backend='xla' or cast"
    reason = (problem.symbolic_sizes_reason(x=x.shape, B=B.shape)
              or problem.shape_unsupported_reason(dtype=x.dtype, headdim=x.shape[2], dstate=B.shape[2]))
    return reason or problem.gpu_unavailable_reason()


def _step_param_dtype(dt_bias, D):
    """The dtype the decode kernel reads dt_bias and D in: their common type if the kernels load it (bf16, f16,
    f32), else float32 (an absent one counts as neither)."""
    present = [a.dtype for a in (dt_bias, D) if a is not None]
    dtype = jnp.result_type(*present) if present else jnp.float32
    return dtype if jnp.dtype(dtype).name in KERNEL_DTYPES else jnp.float32


def _step_once(run_plan: RunPlan, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit):
    batch, nheads, headdim, dstate = state.shape
    dims = SSDDims(
        batch=batch, seqlen=1, nheads=nheads, headdim=headdim, ngroups=B.shape[1], dstate=dstate,
        chunk_size=1, dtype=jnp.dtype(x.dtype).name, dt_dtype="float32", has_z=z is not None,
        dt_softplus=dt_softplus, dt_limit=dt_limit)
    # dt_bias and D go in as the model holds them (a bf16 model's parameters are widened in the kernel, not
    # converted before each token): in one dtype, that of the wider of the two.
    param_dtype = _step_param_dtype(dt_bias, D)
    arrays = dict(
        state=state, x=x, dt=dt.astype(jnp.float32), A=A.astype(jnp.float32),
        dt_bias=jnp.zeros((nheads,), param_dtype) if dt_bias is None else dt_bias.astype(param_dtype),
        B=B.astype(x.dtype), C=C.astype(x.dtype),
        D=jnp.zeros((nheads,), param_dtype) if D is None else D.astype(param_dtype),
        z=jnp.zeros((1, 1, 1), x.dtype) if z is None else z.astype(x.dtype))
    plan = step_kernels.state_update_plan(dims, state_dtype=jnp.dtype(state.dtype).name,
                                          d_per_channel=D is not None and D.ndim == 2)
    out = run_plan(plan, arrays)
    # Both outputs read every array: they vary over the mesh axes any of them does (a per-device A too).
    return _compat.match_varying_axes((out["y"], out["new_state"]), (state, x, dt, A, B, C, D, z, dt_bias))


@functools.cache
def _batchable_step(run_plan: RunPlan, dt_softplus: bool, dt_limit: tuple):
    """step(state, x, dt, A, B, C, D, z, dt_bias) -> (y, new_state) under a vmap rule: a mapped axis folds
    into the batch rows (one launch), unless a per-head parameter (A, D, dt_bias) is mapped too."""
    @jax.custom_batching.custom_vmap
    def step(state, x, dt, A, B, C, D, z, dt_bias):
        return _step_once(run_plan, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit)

    @step.def_vmap
    def step_vmap(axis_size, in_batched, state, x, dt, A, B, C, D, z, dt_bias):
        args = (state, x, dt, A, B, C, D, z, dt_bias)
        per_head = (3, 6, 8)
        if any(in_batched[i] for i in per_head):  # per-item parameters cannot share one launch
            return map_items(step, args, in_batched, axis_size), (True, True)
        folded = [a if i in per_head or a is None else fold(a, in_batched[i], axis_size)
                  for i, a in enumerate(args)]
        return tuple(unfold(out, axis_size) for out in step(*folded)), (True, True)

    return step


def make_step(run_plan: RunPlan):
    """step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit) -> (y, new_state)."""
    def step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit):
        return _batchable_step(run_plan, bool(dt_softplus), tuple(dt_limit))(state, x, dt, A, B, C, D, z, dt_bias)
    return step
