"""The causal conv1d (+ SiLU) op on the cuTile kernels, for any plan executor (FFI or callback).

From the op's arguments to what kernels/causal_conv1d*.py take (weight, bias and initial states rounded to
x's dtype as the reference rounds them, dummies for absent options), and what raw kernel calls lack: vmap
rules (the mapped axis folds into the kernels' batch; the backward's weight partials are then summed per
mapped item, so vmap of a gradient is one launch too), outputs that keep shard_map's varying axes, and
parameter gradients summed over the shards that share the parameters.

`inputs` are the op's `ConvInputs` (x, kernel, bias, initial_states, seq_idx; None where absent).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jax_mamba2.bridge import _compat, callback, ffi, problem
from jax_mamba2.bridge.batching import broadcast_unbatched, fold, unfold
from jax_mamba2.kernels._common import KERNEL_DTYPES
from jax_mamba2.kernels.causal_conv1d import ConvDims, conv_fwd_plan
from jax_mamba2.kernels.causal_conv1d_bwd import conv_bwd_plan

RunPlan = Callable[..., dict]

# The kernels unroll d_conv taps per row; mamba_ssm's causal_conv1d kernels stop at 4.
MAX_WIDTH = 8
# Arrays with a leading batch axis: a vmapped axis over them folds into the kernels' batch.
_PER_ROW = ("x", "initial_states", "seq_idx")


def unsupported_reason(inputs) -> Optional[str]:
    """Why the cuTile kernels cannot run this call (None when they can)."""
    for name in ("x", "kernel", "bias", "initial_states"):
        arr = getattr(inputs, name)
        if arr is not None and arr.dtype == jnp.float64:
            return f"{name} is float64; the kernels compute in float32: use backend='xla' or cast"
    dtype = jnp.dtype(inputs.x.dtype).name
    if dtype not in KERNEL_DTYPES:
        return f"x.dtype={dtype} is not supported by the cuTile kernels (bfloat16, float16, float32)"
    if inputs.kernel.shape[0] > MAX_WIDTH:
        return f"d_conv={inputs.kernel.shape[0]} exceeds the kernels' {MAX_WIDTH} taps; use backend='xla'"
    return problem.gpu_unavailable_reason()


def _dims(inputs, silu: bool) -> ConvDims:
    batch, seqlen, channels = inputs.x.shape
    init = inputs.initial_states
    return ConvDims(batch=batch, seqlen=seqlen, channels=channels, width=inputs.kernel.shape[0],
                    dtype=jnp.dtype(inputs.x.dtype).name, init_width=0 if init is None else init.shape[-1],
                    has_seq_idx=inputs.seq_idx is not None, silu=silu)


def _kernel_arrays(inputs) -> dict:
    """The plan inputs (names as in kernels.causal_conv1d.CONV_INPUTS)."""
    x = inputs.x
    return dict(
        x=x,
        weight=inputs.kernel.astype(x.dtype),
        bias=jnp.zeros(x.shape[-1:], x.dtype) if inputs.bias is None else inputs.bias.astype(x.dtype),
        initial_states=(jnp.zeros((1, 1, 1), x.dtype) if inputs.initial_states is None
                        else inputs.initial_states.astype(x.dtype)),
        seq_idx=jnp.zeros((1, 1), jnp.int32) if inputs.seq_idx is None else inputs.seq_idx.astype(jnp.int32))


def _fold_rows(inputs, batched, axis_size: int):
    return inputs._replace(**{name: fold(getattr(inputs, name), getattr(batched, name), axis_size)
                              for name in _PER_ROW if getattr(inputs, name) is not None})


def _weights_batched(batched) -> bool:
    return bool(batched.kernel) or bool(batched.bias)


@functools.cache
def _batchable_forward(run_plan: RunPlan, silu: bool):
    """y of the conv (+ SiLU) under a vmap rule."""

    @jax.custom_batching.custom_vmap
    def forward(inputs):
        out = run_plan(conv_fwd_plan(_dims(inputs, silu)), _kernel_arrays(inputs))
        return _compat.match_varying_axes(out["y"], inputs)

    @forward.def_vmap
    def forward_vmap(axis_size, in_batched, inputs):
        batched = in_batched[0]
        if _weights_batched(batched):  # per-item weights cannot share one launch: map over the items
            return jax.lax.map(forward, broadcast_unbatched(inputs, batched, axis_size)), True
        return unfold(forward(_fold_rows(inputs, batched, axis_size)), axis_size), True

    return forward


@functools.cache
def _batchable_backward(run_plan: RunPlan, silu: bool, items: int):
    """(dx, dkernel (items, d_conv, channels), dbias (items, channels) or None, dinitial_states or None) of
    the conv (+ SiLU) for the cotangent dy, item i of the weight gradients summing batch rows
    [i * batch / items, (i + 1) * batch / items), under a vmap rule."""

    @jax.custom_batching.custom_vmap
    def backward(inputs, dy):
        arrays = {**_kernel_arrays(inputs), "dy": dy.astype(inputs.x.dtype)}
        out = run_plan(conv_bwd_plan(_dims(inputs, silu), items=items), arrays)
        out = _compat.match_varying_axes(out, (inputs, dy))
        init, bias = inputs.initial_states, inputs.bias
        return (out["dx"].astype(inputs.x.dtype), out["dweight"].astype(inputs.kernel.dtype),
                None if bias is None else out["dbias"].astype(bias.dtype),
                None if init is None else out["dinitial_states"].astype(init.dtype))

    @backward.def_vmap
    def backward_vmap(axis_size, in_batched, inputs, dy):
        batched, dy_batched = in_batched
        if _weights_batched(batched):
            args = broadcast_unbatched((inputs, dy), (batched, dy_batched), axis_size)
            grads = jax.lax.map(lambda a: backward(*a), args)
            return grads, jax.tree.map(lambda _: True, grads)
        folded = _fold_rows(inputs, batched, axis_size)
        grads = _batchable_backward(run_plan, silu, items * axis_size)(folded, fold(dy, dy_batched, axis_size))
        grads = jax.tree.map(lambda g: unfold(g, axis_size), grads)
        return grads, jax.tree.map(lambda _: True, grads)

    return backward


@dataclasses.dataclass(frozen=True)
class ConvKernels:
    """The op on one plan executor: forward(inputs, silu) -> y and backward(inputs, silu, dy) -> the
    cotangents of `inputs` (the same NamedTuple, seq_idx None)."""

    name: str
    run_plan: RunPlan

    def forward(self, inputs, silu: bool):
        return _batchable_forward(self.run_plan, silu)(inputs)

    def backward(self, inputs, silu: bool, dy):
        dx, dkernel, dbias, dinit = _batchable_backward(self.run_plan, silu, 1)(inputs, dy)
        grads = inputs._replace(x=dx, kernel=dkernel[0], bias=None if dbias is None else dbias[0],
                                initial_states=dinit, seq_idx=None)
        return _compat.reduce_to_primal_axes(grads, inputs._replace(seq_idx=None))

    unsupported_reason = staticmethod(unsupported_reason)


BACKENDS = {"cutile": ConvKernels("cutile", ffi.run_plan),
            "cutile_callback": ConvKernels("cutile_callback", callback.run_plan)}
