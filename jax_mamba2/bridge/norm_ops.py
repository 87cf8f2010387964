"""The RMSNorm ops on the cuTile kernels (kernels/rms_norm.py, rms_norm_bwd.py), for any plan executor.

Adds what raw kernel calls lack: a vmap rule (the mapped axis folds into the kernels' rows), outputs that keep
shard_map's varying axes, and gradients reduced to their primals' (a weight replicated over shard_map's
shards gets the sum of every shard's partial gradient). `jax_mamba2.norm` calls `KERNELS[backend]` inside
its custom VJP; arrays arrive in the kernels' (rows, ngroups, group_size) layout with the (ngroups, group_size)
weight in its own dtype (the kernels widen it to f32 as they load it).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_mamba2.bridge import _compat, callback, ffi
from jax_mamba2.bridge.problem import gpu_unavailable_reason, symbolic_sizes_reason
from jax_mamba2.kernels import rms_norm as fwd_kernels
from jax_mamba2.kernels import rms_norm_bwd as bwd_kernels
from jax_mamba2.kernels._common import KERNEL_DTYPES
from jax_mamba2.kernels.rms_norm import NormConfig, NormDims, norm_default_config

RunPlan = Callable[..., dict]
# The kernels' tile and hint choice for a problem (the default: norm_default_config).
ChooseConfig = Callable[[NormDims], NormConfig]


class NormSaved(NamedTuple):
    """What the forward keeps for the backward: the norm's input (x, or the residual stream h for the add +
    norm), the gate (or, with `NormDims.z_in_window`, the (..., z_columns) array the kernel reads it from),
    the weight, and zero-size stand-ins of x and the residual input (for the add + norm) that carry their
    dtypes and shard_map varying axes to the gradients."""

    x: jax.Array
    z: Optional[jax.Array]
    weight: jax.Array
    x_like: jax.Array
    residual_like: Optional[jax.Array]


def norm_dims(x, z, residual, weight, *, group_size: int, norm_before_gate: bool, eps: float, out_dtype,
              residual_dtype, z_window: Optional[tuple[int, int]] = None) -> NormDims:
    """The kernels' problem for x, z, residual (..., features) (z, residual optional), the weight and the op's
    options; z_window: None, or (columns, offset) of the wider array the backward reads z from."""
    def name(dtype):
        return jnp.dtype(dtype).name

    return NormDims(
        rows=math.prod(x.shape[:-1]), ngroups=x.shape[-1] // group_size, group_size=group_size,
        dtype=name(x.dtype), out_dtype=name(out_dtype), z_dtype=None if z is None else name(z.dtype),
        residual_dtype=None if residual is None else name(residual_dtype),
        residual_in_dtype=None if residual is None else name(residual.dtype),
        norm_before_gate=bool(norm_before_gate) and z is not None, eps=float(eps), weight_dtype=name(weight.dtype),
        z_columns=None if z_window is None else z_window[0], z_offset=0 if z_window is None else z_window[1])


def unsupported_reason(dims: NormDims) -> Optional[str]:
    """Why the kernels cannot run this norm here (None when they can)."""
    reason = symbolic_sizes_reason(rows=dims.rows, ngroups=dims.ngroups, group_size=dims.group_size)
    if reason is not None:
        return reason
    dtypes = {"x": dims.dtype, "z": dims.z_dtype, "residual": dims.residual_in_dtype,
              "residual_dtype": dims.residual_dtype, "out_dtype": dims.out_dtype, "weight": dims.weight_dtype}
    for name, dtype in dtypes.items():
        if dtype is not None and dtype not in KERNEL_DTYPES:
            return (f"{name} is {dtype}; the kernels take bfloat16, float16 or float32: use backend='xla' "
                    f"or cast")
    if dims.width > fwd_kernels.MAX_WIDTH:
        return (f"group_size={dims.group_size} is wider than the kernels' largest group "
                f"({fwd_kernels.MAX_WIDTH} features)")
    return gpu_unavailable_reason()


def _with_dummies(arrays: dict, specs: dict) -> dict:
    """The plan's inputs (`specs`) from `arrays`, each absent (None) one its (1, 1, 1) dummy of its declared dtype;
    arrays the plan does not take are left out."""
    return {name: jnp.zeros(spec.shape, spec.dtype) if arrays.get(name) is None else arrays[name]
            for name, spec in specs.items()}


def _forward_once(run_plan: RunPlan, config: ChooseConfig, dims: NormDims, x, z, residual, weight):
    arrays = _with_dummies(dict(x=x, z=z, residual=residual, weight=weight), fwd_kernels.rms_norm_fwd_inputs(dims))
    out = run_plan(fwd_kernels.rms_norm_fwd_plan(dims, config(dims)), arrays)
    # Each output varies over the mesh axes of what it is computed from (the kernels' outputs carry none): the
    # residual stream x + residual not over the weight's.
    return (_compat.match_varying_axes(out["out"], (x, z, residual, weight)),
            _compat.match_varying_axes(out["residual_out"], (x, residual)) if dims.has_residual else None)


def _fold(arr, batched: bool, axis_size: int):
    """(axis_size, rows, ...) or an unbatched (rows, ...) array -> (axis_size * rows, ...)."""
    if not batched:
        arr = jnp.broadcast_to(arr[None], (axis_size, *arr.shape))
    return arr.reshape((axis_size * arr.shape[1], *arr.shape[2:]))


def _broadcast_unbatched(tree, batched_tree, axis_size: int):
    return jax.tree.map(lambda a, b: a if b else jnp.broadcast_to(a[None], (axis_size, *a.shape)),
                        tree, batched_tree)


@functools.cache
def _batchable_forward(run_plan: RunPlan, config: ChooseConfig, dims: NormDims):
    @jax.custom_batching.custom_vmap
    def forward(x, z, residual, weight):
        return _forward_once(run_plan, config, dims, x, z, residual, weight)

    @forward.def_vmap
    def forward_vmap(axis_size, in_batched, x, z, residual, weight):
        out_batched = (True, None if residual is None else True)
        if in_batched[3]:  # a weight per item: the items cannot share one launch
            args = _broadcast_unbatched((x, z, residual, weight), tuple(in_batched), axis_size)
            return jax.lax.map(lambda a: forward(*a), args), out_batched
        rows = [None if a is None else _fold(a, b, axis_size) for a, b in zip((x, z, residual), in_batched)]
        folded = dataclasses.replace(dims, rows=axis_size * dims.rows)
        outputs = _forward_once(run_plan, config, folded, *rows, weight)
        return tuple(None if o is None else o.reshape((axis_size, dims.rows, *o.shape[1:]))
                     for o in outputs), out_batched

    return forward


def _backward_once(run_plan: RunPlan, config: ChooseConfig, dims: NormDims, saved: NormSaved, dout, dresidual_out):
    has_dresidual_out = dresidual_out is not None
    z = saved.z.reshape(dims.rows, dims.z_columns) if dims.z_in_window else saved.z
    arrays = _with_dummies(dict(
        x=saved.x, z=z, weight=saved.weight, dout=dout.astype(dims.out_dtype),
        dresidual=None if dresidual_out is None else dresidual_out.astype(dims.residual_dtype)),
        bwd_kernels.rms_norm_bwd_inputs(dims, has_dresidual_out))
    out = run_plan(bwd_kernels.rms_norm_bwd_plan(dims, config(dims), has_dresidual_out), arrays)
    out = _compat.match_varying_axes(out, (saved.x, saved.z, saved.weight, dout, dresidual_out))
    dx = out["dresidual"] if bwd_kernels.dx_is_dresidual(dims) else out["dx"]
    grads = (dx.astype(saved.x_like.dtype),
             None if saved.z is None else out["dz"],
             None if saved.residual_like is None else out["dresidual"].astype(saved.residual_like.dtype),
             out["dweight"].astype(saved.weight.dtype))
    return _compat.reduce_to_primal_axes(grads, (saved.x_like, saved.z, saved.residual_like, saved.weight))


@functools.cache
def _batchable_backward(run_plan: RunPlan, config: ChooseConfig, dims: NormDims):
    @jax.custom_batching.custom_vmap
    def backward(saved, dout, dresidual_out):
        return _backward_once(run_plan, config, dims, saved, dout, dresidual_out)

    @backward.def_vmap
    def backward_vmap(axis_size, in_batched, saved, dout, dresidual_out):
        # The weight gradient sums over rows, so items cannot share one launch.
        args = _broadcast_unbatched((saved, dout, dresidual_out), tuple(in_batched), axis_size)
        grads = jax.lax.map(lambda a: backward(*a), args)
        return grads, jax.tree.map(lambda _: True, grads)

    return backward


@dataclasses.dataclass(frozen=True)
class NormKernels:
    """The kernel path of the norm ops for one plan executor.

    forward(dims, x, z, residual, weight) -> (out, residual_out or None);
    backward(dims, saved: NormSaved, dout, dresidual_out or None) -> (dx, dz, dresidual, dweight), None where
    the primal is absent, each in its primal's dtype; dresidual_out None for the add + norm
    means a zero cotangent of the residual stream (not read).
    """

    forward: Callable
    backward: Callable


def make_kernels(run_plan: RunPlan, config: ChooseConfig = norm_default_config) -> NormKernels:
    """The norm ops' kernel path with every plan run by `run_plan` (ffi.run_plan, callback.run_plan, ...) in
    the tiles and hints `config(dims)` chooses (benchmarks/norm.py passes its sweep's). Keep one `config`
    object per choice: the traced kernels are cached per (run_plan, config, dims)."""
    def forward(dims, x, z, residual, weight):
        return _batchable_forward(run_plan, config, dims)(x, z, residual, weight)

    def backward(dims, saved, dout, dresidual_out):
        return _batchable_backward(run_plan, config, dims)(saved, dout, dresidual_out)

    return NormKernels(forward, backward)


KERNELS = {"cutile": make_kernels(ffi.run_plan), "cutile_callback": make_kernels(callback.run_plan)}
