"""Pure-JAX reference of the RMSNorms of Mamba-2 (mamba_ssm `ops/triton/layernorm_gated.py`, `layer_norm.py`).

`rms_norm` is the gated, grouped RMSNorm of the mixer (and, without a gate, the block and final norms):

  x <- x * silu(z)                    if z is given and not norm_before_gate
  y  = x / sqrt(mean_group(x^2) + eps) * weight
  y <- y * silu(z)                    if z is given and norm_before_gate

`add_rms_norm` is mamba_ssm's fused residual add + RMSNorm of `Block` (fused_add_norm): the residual stream
h = x + residual is rounded to its dtype, then normalized.

Both compute in float32 (float64 for float64 inputs). They are the `backend="xla"` path of `jax_mamba2.rms_norm`
and `add_rms_norm` and the oracle of their kernels; nothing here validates arguments (the ops do).
"""
import math

import jax
import jax.numpy as jnp


def rms_norm(x, weight, z=None, *, eps, group_size=None, norm_before_gate=False, sum_groups=None):
    """Gated, grouped RMSNorm over the last axis.

    Args:
      x: (..., features), any float dtype.
      weight: (features,).
      z: optional gate, same shape as x.
      eps: added to the mean square.
      group_size: statistics over consecutive groups of this many features (None: all features).
      norm_before_gate: gate after normalizing (True) or before (False, Mamba-2's default).
      sum_groups: for a group split across devices (the tensor-parallel mixer): maps the local sums of squares
        (..., features // gcd(group_size, features)), one per piece of a group, to the whole group's sums.

    Returns:
      (..., features) in x.dtype.
    """
    compute_dtype = jnp.promote_types(jnp.float32, x.dtype)
    features = x.shape[-1]
    group_size = features if group_size is None else group_size
    h = x.astype(compute_dtype)
    if z is not None and not norm_before_gate:
        h = h * jax.nn.silu(z.astype(compute_dtype))
    piece = math.gcd(group_size, features)  # == group_size unless a group spans several devices
    grouped = h.reshape(*h.shape[:-1], features // piece, piece)
    sum_sq = jnp.sum(jnp.square(grouped), axis=-1)
    if sum_groups is not None:
        sum_sq = sum_groups(sum_sq)
    rstd = jax.lax.rsqrt(sum_sq / group_size + eps)
    y = (grouped * rstd[..., None]).reshape(h.shape) * weight.astype(compute_dtype)
    if z is not None and norm_before_gate:
        y = y * jax.nn.silu(z.astype(compute_dtype))
    return y.astype(x.dtype)


def add_rms_norm(x, residual, weight, *, eps, residual_dtype, out_dtype):
    """The residual add + RMSNorm of a Mamba-2 block.

    Args:
      x: (..., features), the block input (the previous mixer's output, or the embedding).
      residual: (..., features), the residual stream so far, or None (the first block: h is x).
      weight: (features,).
      eps: added to the mean square.
      residual_dtype: dtype of the new residual stream (float32 with mamba_ssm's residual_in_fp32).
      out_dtype: dtype of the normalized output.

    Returns:
      (rms_norm(h) in out_dtype, h) with h = x + residual added in float32 (float64 for float64 operands) and
      rounded to residual_dtype; the norm reads the rounded h.
    """
    compute_dtype = jnp.promote_types(jnp.float32, jnp.result_type(x, *(() if residual is None else (residual,))))
    h = x.astype(compute_dtype) if residual is None else x.astype(compute_dtype) + residual.astype(compute_dtype)
    h = h.astype(residual_dtype)
    # Normalized from the rounded h, widened: `rms_norm` returns its input's dtype, and a residual stream narrower
    # than out_dtype (bfloat16 under a float32 output) would round the output to it before out_dtype.
    norm_dtype = jnp.promote_types(jnp.float32, jnp.promote_types(residual_dtype, out_dtype))
    return rms_norm(h.astype(norm_dtype), weight, eps=eps).astype(out_dtype), h
