"""The causal conv1d (+ SiLU) op on the cuTile kernels, for any plan executor (FFI or callback).

From the op's arguments to what kernels/causal_conv1d*.py take (weight and bias in float32, not rounded to x's
dtype, and initial states rounded to it, as the reference takes them; dummies for absent options), and what raw
kernel calls lack: vmap rules (the mapped axis folds into the kernels' batch; the backward's weight partials are
then summed per mapped item, so vmap of a gradient is one launch too), outputs that keep shard_map's varying
axes, and parameter gradients summed over the shards that share the parameters.

`inputs` are the op's `ConvInputs` (x, kernel, bias, initial_states, seq_idx; None where absent); with a
channel offset and a split (`Layout`) the conv reads channels offset .. offset + channels - 1 of x (which
may be wider) and returns its output in pieces of the split's widths, so that the mixer's in_proj output
goes in and x, B, C come out without a copy (see kernels/causal_conv1d.py).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_mamba2.bridge import _compat, callback, ffi, problem
from jax_mamba2.bridge.batching import broadcast_unbatched, fold, unfold
from jax_mamba2.kernels._common import KERNEL_DTYPES
from jax_mamba2.kernels.causal_conv1d import (
    CONV_OUTPUTS, MAX_OUTPUTS, OUTSIDE, ConvDims, ConvFwdConfig, conv_fwd_plan)
from jax_mamba2.kernels.causal_conv1d_bwd import COTANGENTS, PASSED_COTANGENTS, ConvBwdConfig, conv_bwd_plan

RunPlan = Callable[..., dict]

# The kernels unroll d_conv taps per row; mamba_ssm's causal_conv1d kernels stop at 4.
MAX_WIDTH = 8
# Arrays with a leading batch axis: a vmapped axis over them folds into the kernels' batch.
_PER_ROW = ("x", "initial_states", "seq_idx")


class Layout(NamedTuple):
    """Which channels of x the conv reads (offset .. offset + channels - 1) and the widths of its output
    pieces; split () is one output of all the kernel's channels. With pass_through the op also returns x's
    channels outside the window unchanged, and the backward writes x's whole cotangent, theirs copied in."""

    offset: int = 0
    split: tuple[int, ...] = ()
    pass_through: bool = False


def unsupported_reason(inputs) -> Optional[str]:
    """Why the cuTile kernels cannot run this call (None when they can)."""
    # x and the kernel hold every size of the problem (the op checked the other arrays against them).
    reason = problem.symbolic_sizes_reason(x=inputs.x.shape, kernel=inputs.kernel.shape)
    if reason is not None:
        return reason
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


def _dims(inputs, silu: bool, layout: Layout) -> ConvDims:
    batch, seqlen, in_width = inputs.x.shape
    channels = inputs.kernel.shape[1]
    init = inputs.initial_states
    return ConvDims(batch=batch, seqlen=seqlen, channels=channels, width=inputs.kernel.shape[0],
                    dtype=jnp.dtype(inputs.x.dtype).name, init_width=0 if init is None else init.shape[-1],
                    has_seq_idx=inputs.seq_idx is not None, silu=silu, in_offset=layout.offset,
                    in_width=0 if in_width == channels else in_width, split=layout.split,
                    pass_through=layout.pass_through)


def _kernel_arrays(inputs) -> dict:
    """The plan inputs (names as in kernels.causal_conv1d.CONV_INPUTS): the weight and bias in float32 (exact for
    the parameters the kernels take, float64 being refused), x and the initial states in x's dtype."""
    x = inputs.x
    channels = inputs.kernel.shape[1]
    return dict(
        x=x,
        weight=inputs.kernel.astype(jnp.float32),
        bias=jnp.zeros((channels,), jnp.float32) if inputs.bias is None else inputs.bias.astype(jnp.float32),
        initial_states=(jnp.zeros((1, 1, 1), x.dtype) if inputs.initial_states is None
                        else inputs.initial_states.astype(x.dtype)),
        seq_idx=jnp.zeros((1, 1), jnp.int32) if inputs.seq_idx is None else inputs.seq_idx.astype(jnp.int32))


def _cotangent_arrays(dys, dtype, layout: Layout) -> dict:
    """The backward's dy0, dy1, dy2 from the pieces' cotangents (dummies past them), and dbefore, dafter: with
    pass_through `dys` starts and ends with the cotangents of the channels before and after the window
    (dummies for a width 0 and without pass_through)."""
    dummy = jnp.zeros((1, 1, 1), dtype)
    passed = [dummy, dummy]
    if layout.pass_through:
        passed = [dy.astype(dtype) if dy.shape[-1] else dummy for dy in (dys[0], dys[-1])]
        dys = dys[1:-1]
    dys = [dy.astype(dtype) for dy in dys] + [dummy] * (MAX_OUTPUTS - len(dys))
    return {**dict(zip(COTANGENTS, dys)), **dict(zip(PASSED_COTANGENTS, passed))}


def _source_cotangent(dx, x, layout: Layout):
    """The cotangent of x from the kernels' dx: zero in the channels the conv does not read (dx is already
    whole with pass_through)."""
    if dx.shape == x.shape:
        return dx
    pad = ((0, 0),) * (dx.ndim - 1) + ((layout.offset, x.shape[-1] - layout.offset - dx.shape[-1]),)
    return jnp.pad(dx, pad)


def _fold_rows(inputs, batched, axis_size: int):
    return inputs._replace(**{name: fold(getattr(inputs, name), getattr(batched, name), axis_size)
                              for name in _PER_ROW if getattr(inputs, name) is not None})


def _weights_batched(batched) -> bool:
    return bool(batched.kernel) or bool(batched.bias)


@functools.cache
def _batchable_forward(run_plan: RunPlan, silu: bool, layout: Layout, cfg: Optional[ConvFwdConfig]):
    """The outputs of the conv (+ SiLU), a tuple, under a vmap rule: its pieces, with pass_through between
    x's channels before and after the window (copied by the kernel; width-0 ones made here)."""

    @jax.custom_batching.custom_vmap
    def forward(inputs):
        dims = _dims(inputs, silu, layout)
        out = run_plan(conv_fwd_plan(dims, cfg), _kernel_arrays(inputs))
        outputs = _compat.match_varying_axes(tuple(out[name] for name in CONV_OUTPUTS[:len(dims.pieces)]), inputs)
        if layout.pass_through:  # copies of x's other channels: varying over x's mesh axes alone
            before, after = (out[name] if w else jnp.zeros((dims.batch, dims.seqlen, 0), inputs.x.dtype)
                             for name, w in zip(OUTSIDE, dims.outside_widths))
            outputs = (_compat.match_varying_axes(before, inputs.x), *outputs,
                       _compat.match_varying_axes(after, inputs.x))
        return outputs

    @forward.def_vmap
    def forward_vmap(axis_size, in_batched, inputs):
        batched = in_batched[0]
        if _weights_batched(batched):  # per-item weights cannot share one launch: map over the items
            pieces = jax.lax.map(forward, broadcast_unbatched(inputs, batched, axis_size))
        else:
            pieces = tuple(unfold(y, axis_size) for y in forward(_fold_rows(inputs, batched, axis_size)))
        return pieces, tuple(True for _ in pieces)

    return forward


@functools.cache
def _batchable_backward(run_plan: RunPlan, silu: bool, layout: Layout, cfg: Optional[ConvBwdConfig],
                        items: int):
    """(dx (batch, seqlen, channels), dkernel (items, d_conv, channels), dbias (items, channels) or None,
    dinitial_states or None) of the conv (+ SiLU) for the cotangents `dys` of its output pieces, item i of
    the weight gradients summing batch rows [i * batch / items, (i + 1) * batch / items), under a vmap rule."""

    @jax.custom_batching.custom_vmap
    def backward(inputs, dys):
        arrays = {**_kernel_arrays(inputs), **_cotangent_arrays(dys, inputs.x.dtype, layout)}
        out = run_plan(conv_bwd_plan(_dims(inputs, silu, layout), cfg, items=items), arrays)
        out = _compat.match_varying_axes(out, (inputs, dys))
        init, bias = inputs.initial_states, inputs.bias
        return (out["dx"].astype(inputs.x.dtype), out["dweight"].astype(inputs.kernel.dtype),
                None if bias is None else out["dbias"].astype(bias.dtype),
                None if init is None else out["dinitial_states"].astype(init.dtype))

    @backward.def_vmap
    def backward_vmap(axis_size, in_batched, inputs, dys):
        batched, dys_batched = in_batched
        if _weights_batched(batched):
            args = broadcast_unbatched((inputs, dys), (batched, dys_batched), axis_size)
            grads = jax.lax.map(lambda a: backward(*a), args)
            return grads, jax.tree.map(lambda _: True, grads)
        folded = _fold_rows(inputs, batched, axis_size)
        folded_dys = tuple(fold(dy, b, axis_size) for dy, b in zip(dys, dys_batched))
        grads = _batchable_backward(run_plan, silu, layout, cfg, items * axis_size)(folded, folded_dys)
        grads = jax.tree.map(lambda g: unfold(g, axis_size), grads)
        return grads, jax.tree.map(lambda _: True, grads)

    return backward


@dataclasses.dataclass(frozen=True)
class ConvKernels:
    """The op on one plan executor: forward(inputs, static) -> the outputs (a tuple: the pieces, with
    pass_through between x's channels before and after the window) and backward(inputs, static, dys) -> the
    cotangents of `inputs` (the same NamedTuple, seq_idx None) for the outputs' cotangents `dys`. `static` is the
    op's `conv1d.ConvStatic`: silu and the fields of `Layout`. `fwd_config` / `bwd_config` replace the kernels'
    default tiles (None: `conv_fwd_default_config` / `conv_bwd_default_config` of each
    problem)."""

    name: str
    run_plan: RunPlan
    fwd_config: Optional[ConvFwdConfig] = None
    bwd_config: Optional[ConvBwdConfig] = None

    def forward(self, inputs, static):
        layout = Layout(static.offset, static.split, static.pass_through)
        return _batchable_forward(self.run_plan, static.silu, layout, self.fwd_config)(inputs)

    def backward(self, inputs, static, dys):
        layout = Layout(static.offset, static.split, static.pass_through)
        dx, dkernel, dbias, dinit = _batchable_backward(self.run_plan, static.silu, layout, self.bwd_config, 1)(
            inputs, tuple(dys))
        grads = inputs._replace(x=_source_cotangent(dx, inputs.x, layout), kernel=dkernel[0],
                                bias=None if dbias is None else dbias[0], initial_states=dinit, seq_idx=None)
        return _compat.reduce_to_primal_axes(grads, inputs._replace(seq_idx=None))

    unsupported_reason = staticmethod(unsupported_reason)


KERNELS = {"cutile": ConvKernels("cutile", ffi.run_plan),
           "cutile_callback": ConvKernels("cutile_callback", callback.run_plan)}
