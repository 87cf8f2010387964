"""The RMSNorm ops of Mamba-2: input checks, backend dispatch and the custom VJP of the cuTile kernels.

  rms_norm       the gated, grouped RMSNorm (the mixer's `norm`; without z the block and final norms):
                 mamba_ssm `layernorm_gated.rmsnorm_fn`.
  add_rms_norm   the residual add + RMSNorm of a block (mamba_ssm `layer_norm_fn(..., residual=,
                 prenorm=True)`): returns the normalized output and the new residual stream.

Both have the semantics of `jax_mamba2.norm_reference`, which is the "xla" backend. Backends are the
"rms_norm" entries of the registry in `jax_mamba2.backends`: "xla" (registered here), "cutile" (one cuTile
kernel forward and two backward, kernels/rms_norm.py, rms_norm_bwd.py, as XLA FFI custom calls) and
"cutile_callback" (the same kernels in a buffer callback), registered by the bridge. "auto" picks cutile on a
supported GPU (behind `lax.platform_dependent`, so the program still lowers for CPU) and xla otherwise. A
kernel backend asked for by name never falls back: it raises saying why it cannot run.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jax_mamba2 import backends as registry
from jax_mamba2 import norm_reference as reference
from jax_mamba2.checks import as_int, check_array, check_flag, check_int, check_positive_float, float_dtype

OP = "rms_norm"


def _bridge():
    """jax_mamba2.bridge.norm_ops: how the kernels describe a call (`norm_dims`) and what their backward reads
    (`NormSaved`). Called only once a kernel backend was selected, whose registration imported it."""
    from jax_mamba2.bridge import norm_ops
    return norm_ops


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------

def _check_common(api, x, weight, eps) -> float:
    """x (..., features) and weight (features,) arrays, eps a positive number; returns eps as a Python float."""
    check_array(api, "x", x)
    if len(x.shape) < 1 or x.shape[-1] < 1:
        raise ValueError(f"{api}: x.shape={tuple(x.shape)} must be (..., features) with features >= 1")
    check_array(api, "weight", weight, "(features,)", (x.shape[-1],))
    return check_positive_float(api, "eps", eps)


# ----------------------------------------------------------------------------------------------
# Kernel path and dispatch
# ----------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _kernel_norm(kernels, dims, x, z, residual, weight, z_source):
    """(out, residual_out or None) on the kernels; arrays in their (rows, ngroups, group_size) layout, weight
    (ngroups, group_size) in its own dtype; z_source None, or (`dims.z_in_window`) the (..., z_columns) array
    the backward reads z from (kept instead of z; no cotangent)."""
    del z_source
    return kernels.forward(dims, x, z, residual, weight)


def _kernel_norm_fwd(kernels, dims, x, z, residual, weight, z_source):
    # symbolic_zeros: the primals arrive wrapped (CustomVJPPrimal), absent ones as None.
    x, z, residual, weight, z_source = (None if a is None else a.value for a in (x, z, residual, weight, z_source))
    out, residual_out = kernels.forward(dims, x, z, residual, weight)
    # The add + norm keeps only the residual stream it normalized (the next block keeps it anyway), plus
    # zero-size slices of x and the residual that carry their dtypes and varying axes; the gated norm keeps z,
    # or the array it reads z from in the backward, which its caller keeps anyway.
    saved = _bridge().NormSaved(
        x=x if residual is None else residual_out, z=z if z_source is None else z_source, weight=weight,
        x_like=x[:0], residual_like=None if residual is None else residual[:0])
    return (out, residual_out), saved


def _kernel_norm_bwd(kernels, dims, saved, cotangents):
    dout, dresidual_out = cotangents
    if isinstance(dout, SymbolicZero):  # only the residual stream is used: the kernels still read dy
        dout = jnp.zeros(dout.shape, dout.dtype)
    # A residual stream nothing reads (the final norm's) has a symbolic zero cotangent: the kernel skips it
    # instead of reading a zero array XLA would write.
    if isinstance(dresidual_out, SymbolicZero):
        dresidual_out = None
    return (*kernels.backward(dims, saved, dout, dresidual_out), None)


_kernel_norm.defvjp(_kernel_norm_fwd, _kernel_norm_bwd, symbolic_zeros=True)


def _run_kernels(kernels, dims, x, z, residual, weight, z_source=None):
    """The kernel path on (..., features) arrays (z_source (..., z_columns)): -> (out, residual_out or None) of
    x's shape."""
    rows = (dims.rows, dims.ngroups, dims.group_size)

    def as_rows(a):
        return None if a is None else a.reshape(rows)

    # z_source goes in as it is: a reshaped copy of it would be another residual (stacked anew by a layer scan).
    out, residual_out = _kernel_norm(kernels, dims, as_rows(x), as_rows(z), as_rows(residual),
                                     weight.reshape(rows[1:]), z_source)
    return out.reshape(x.shape), None if residual_out is None else residual_out.reshape(x.shape)


registry.register_backend(registry.LayerBackend("xla", None, registry.always_supported), op=OP)


def _dispatch(api: str, backend: str, reference_fn: Callable, x, z, residual, weight, z_kept_in=None,
              **dims_kwargs):
    """Runs the norm on `backend` ("auto" picks the kernels where they can run); reference_fn(x, z, residual,
    weight) is the xla path; z_kept_in as in `rms_norm` (the kernels' backward only). Returns (out,
    residual_out or None)."""
    z_source, z_offset = (None, 0) if z_kept_in is None else z_kept_in
    z_window = None if z_source is None else (z_source.shape[-1], z_offset)

    def kernel_dims():  # the kernels' description of the call (only a kernel backend needs it)
        return _bridge().norm_dims(x, z, residual, weight, z_window=z_window, **dims_kwargs)

    def run(b, x, z, residual, weight):
        if b.kernels is None:
            return reference_fn(x, z, residual, weight)
        return _run_kernels(b.kernels, kernel_dims(), x, z, residual, weight, z_source)

    selected = registry.select(
        backend, api, lambda b: b.unsupported_reason(None if b.kernels is None else kernel_dims()), op=OP)
    if x.size == 0:
        return reference_fn(x, z, residual, weight)
    return registry.run_selected(selected, run, x, z, residual, weight)


# ----------------------------------------------------------------------------------------------
# Public ops
# ----------------------------------------------------------------------------------------------

def rms_norm(x, weight, z=None, *, eps: float = 1e-5, group_size: Optional[int] = None,
             norm_before_gate: bool = False, sum_groups: Optional[Callable] = None, z_kept_in=None,
             backend: str = "auto"):
    """Gated, grouped RMSNorm over the last axis (mamba_ssm `rmsnorm_fn`).

        h = x * silu(z) if z is given and not norm_before_gate, else x
        y = h / sqrt(mean_group(h^2) + eps) * weight;   y *= silu(z) if z is given and norm_before_gate

    computed in float32 (float64 for float64 x). Differentiable in x, weight and z; the cuTile backward
    recomputes the statistics from x and z (nothing is saved besides the inputs) and sums the weight
    gradient without atomics (bitwise reproducible).

    Args:
      x: (..., features), bf16/f16/f32/f64.
      weight: (features,), float.
      z: optional gate, x's shape, float.
      eps: added to the mean square (default 1e-5).
      group_size: statistics over consecutive groups of this many features (default: all features); must
        divide features.
      norm_before_gate: gate after normalizing (True) or before (False, Mamba-2's default: its mixer passes False,
        while mamba_ssm's `rmsnorm_fn` and `RMSNormGated` default to True).
      sum_groups: for a group split across devices (the tensor-parallel mixer with fewer groups than devices):
        maps the local sums of squares (..., features // gcd(group_size, features)) to the whole groups'.
        Such a call runs the XLA path (the kernels keep a group on one device): under backend "auto" or "xla";
        a kernel backend named explicitly refuses it (ValueError).
      z_kept_in: None, or (source, offset): an array (..., columns) whose columns [offset, offset + features)
        hold z, which the caller keeps for its own backward anyway (the mixer's in_proj output, z's origin):
        the kernels' backward then reads z there, and z itself is not kept. The caller vouches that the
        columns equal z; the xla path ignores it.
      backend: "auto", "cutile", "cutile_callback" or "xla".

    Returns:
      (..., features) in x.dtype.

    Raises:
      ValueError / TypeError: on a wrong shape, dtype or option, naming the argument; ValueError when a named
        kernel backend cannot run the call (float64, a group wider than 8192 features, no GPU), saying why.
    """
    api = "rms_norm"
    eps = _check_common(api, x, weight, eps)
    norm_before_gate = check_flag(api, "norm_before_gate", norm_before_gate)
    features = x.shape[-1]
    if z is not None:
        check_array(api, "z", z, "x.shape", x.shape)
    if sum_groups is not None and not callable(sum_groups):
        raise TypeError(f"rms_norm: sum_groups={sum_groups!r} must be a callable or None")
    if z_kept_in is not None:
        z_kept_in = _check_z_source(api, x, z, z_kept_in)
    # A Python int: the kernels' (rows, ngroups, group_size) layout is built from it, and a NumPy int in an array
    # shape is a symbolic dimension to cutile_call, which it refuses.
    number = features if group_size is None else as_int(group_size)
    if number is None:
        raise TypeError(f"rms_norm: group_size={group_size!r} must be an int or None")
    if group_size is not None and sum_groups is None and (number < 1 or features % number):
        raise ValueError(f"rms_norm: group_size={group_size} must be a positive divisor of features={features}")
    if group_size is not None and (number < 1 or (number % features and features % number)):
        raise ValueError(f"rms_norm: group_size={group_size} must divide features={features} or be a multiple "
                         f"of it (a group split across devices)")
    group_size = number

    def reference_fn(x, z, residual, weight):
        del residual
        return reference.rms_norm(x, weight, z, eps=eps, group_size=group_size,
                                  norm_before_gate=norm_before_gate, sum_groups=sum_groups), None

    if sum_groups is not None:
        registry.check_name(backend, api, OP)  # an unknown name is told the known ones first
        if backend not in ("auto", "xla"):
            raise ValueError(f"rms_norm: backend={backend!r} cannot run sum_groups (a group split across devices): "
                             f"the kernels keep a group on one device; pass backend='auto' or 'xla'")
        backend = "xla"
    out, _ = _dispatch(api, backend, reference_fn, x, z, None, weight, z_kept_in, group_size=group_size,
                       norm_before_gate=norm_before_gate, eps=eps, out_dtype=x.dtype, residual_dtype=None)
    return out


def _check_z_source(api: str, x, z, z_kept_in) -> tuple:
    """z_kept_in = (source, offset): z given, source (..., columns) with x's leading axes and z's dtype, and
    offset an int with [offset, offset + features) inside the columns. Returns (source, offset) with the offset a
    Python int: it is a kernel constant, and a launch takes any other value for an array."""
    if z is None:
        raise ValueError(f"{api}: z_kept_in needs z (it says where the backward reads z again)")
    if not isinstance(z_kept_in, tuple) or len(z_kept_in) != 2:
        raise TypeError(f"{api}: z_kept_in must be a pair (source array, column offset), got "
                        f"{type(z_kept_in).__name__}")
    source, offset = z_kept_in
    check_array(api, "z_kept_in[0]", source)
    features = x.shape[-1]
    if tuple(source.shape[:-1]) != tuple(x.shape[:-1]) or source.dtype != z.dtype:
        raise ValueError(f"{api}: z_kept_in[0] has shape {tuple(source.shape)} and dtype {source.dtype}; it must be "
                         f"(*x.shape[:-1], columns)={(*x.shape[:-1], 'columns')} in z's dtype {z.dtype}")
    requirement = f"an int with 0 <= offset and offset + features={features} <= columns={source.shape[-1]}"
    return source, check_int(api, "z_kept_in[1]", offset, requirement, minimum=0, maximum=source.shape[-1] - features)


def add_rms_norm(x, residual, weight, *, eps: float = 1e-5, residual_dtype=None, out_dtype=None,
                 return_residual: bool = True, backend: str = "auto"):
    """Residual add + RMSNorm (mamba_ssm's fused add-norm of `Block`).

        h   = x + residual, added in float32 (float64 for float64 operands), rounded to residual_dtype (x alone,
              rounded to it, where residual is None: the first block's, as mamba_ssm's `residual=None`)
        out = h / sqrt(mean(h^2) + eps) * weight, normalized from the rounded h in float32 (float64 for
              float64) and rounded to out_dtype once (also where residual_dtype is the narrower)

    (mamba_ssm's kernel normalizes the unrounded sum: the two differ where residual_dtype is narrower than
    float32, by its rounding.)

    Differentiable in x, residual and weight (the gradients of x and residual are equal, in their dtypes); the
    cuTile backward reads the h the forward stored.

    Args:
      x: (..., features), the block input, bf16/f16/f32/f64.
      residual: (..., features), the residual stream so far, float; or None: no stream yet (h is x).
      weight: (features,), float.
      eps: added to the mean square (default 1e-5).
      residual_dtype: dtype of h (default: the result type of x and residual, x's without one); float32 for
        mamba_ssm's residual_in_fp32.
      out_dtype: dtype of the normalized output (default: x.dtype).
      return_residual: also return h (default True; False for the final norm, whose h nothing reads).
      backend: "auto", "cutile", "cutile_callback" or "xla".

    Returns:
      (out, h) with return_residual, else out; both (..., features).

    Raises:
      ValueError / TypeError: as `rms_norm`.
    """
    api = "add_rms_norm"
    eps = _check_common(api, x, weight, eps)
    return_residual = check_flag(api, "return_residual", return_residual)
    if residual is not None:
        check_array(api, "residual", residual, "x.shape", x.shape)
    residual_dtype = float_dtype(api, "residual_dtype", jnp.result_type(x, *(() if residual is None else (residual,)))
                                 if residual_dtype is None else residual_dtype)
    out_dtype = float_dtype(api, "out_dtype", x.dtype if out_dtype is None else out_dtype)
    if residual is None:
        if jnp.promote_types(x.dtype, residual_dtype) == residual_dtype != jnp.float64:
            return _first_add_rms_norm(api, x, weight, eps, residual_dtype, out_dtype, return_residual, backend)
        # A stream narrower than x (whose add kernels keep x's gradient in x's precision) or a float64 one (which
        # the kernels refuse, naming residual_dtype): a zero stream, as documented.
        residual = jnp.zeros(x.shape, residual_dtype)

    def reference_fn(x, z, residual, weight):
        del z
        return reference.add_rms_norm(x, residual, weight, eps=eps, residual_dtype=residual_dtype,
                                      out_dtype=out_dtype)

    out, h = _dispatch(api, backend, reference_fn, x, None, residual, weight, group_size=x.shape[-1],
                       norm_before_gate=False, eps=eps, out_dtype=out_dtype, residual_dtype=residual_dtype)
    return (out, h) if return_residual else out


def _first_add_rms_norm(api, x, weight, eps, residual_dtype, out_dtype, return_residual, backend):
    """`add_rms_norm` without a residual stream, residual_dtype at least as wide as x: h = x in residual_dtype
    (exact), normalized as a plain RMSNorm of h, so no zeros are added and no residual is read. The norm reads h
    rather than x (the same values) so that x's gradient is the sum of h's two cotangents in h's dtype, rounded once
    to x's, as with a zero stream."""
    h = x.astype(residual_dtype)

    def reference_fn(normed, z, residual, weight):
        del z, residual
        return reference.add_rms_norm(normed, None, weight, eps=eps, residual_dtype=normed.dtype,
                                      out_dtype=out_dtype)[0], None

    out, _ = _dispatch(api, backend, reference_fn, h, None, None, weight, group_size=x.shape[-1],
                       norm_before_gate=False, eps=eps, out_dtype=out_dtype, residual_dtype=None)
    return (out, h) if return_residual else out
