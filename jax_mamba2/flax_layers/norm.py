"""RMSNorm with mamba_ssm's optional SiLU gate and group-wise statistics (`mamba_ssm.ops.triton.layernorm_gated`).

One function serves the block/final norms (no gate, one group) and the mixer's gated norm:

  x <- x * silu(z)                    if z is given and not norm_before_gate
  y  = x / sqrt(mean_group(x^2) + eps) * weight
  y <- y * silu(z)                    if z is given and norm_before_gate

computed in float32 (float64 for float64 inputs) and returned in the input's dtype.
"""
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx


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


class RMSNorm(nnx.Module):
    """RMSNorm layer (mamba_ssm `RMSNorm` / `RMSNormGated`); see `rms_norm` for the math.

    The scale parameter is `scale` (NNX naming; mamba_ssm calls it `weight`), shape (features,), init ones.

    Args:
      features: size of the normalized last axis.
      eps: added to the mean square (default: 1e-5).
      group_size: features per statistics group (default: None, all features); must divide `features`.
      norm_before_gate: gate placement when called with `z` (default: False).
      dtype: output dtype (default: None, the input's dtype).
      param_dtype: dtype of `scale` (default: float32).
      rngs: unused by the initializer; accepted for NNX's constructor convention.
    """

    def __init__(self, features: int, *, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = False, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        del rngs  # ones init needs no randomness
        if group_size is not None and (group_size < 1 or features % group_size):
            raise ValueError(f"RMSNorm: group_size={group_size} must be a positive divisor of {features=}")
        self.eps, self.group_size, self.norm_before_gate, self.dtype = eps, group_size, norm_before_gate, dtype
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))

    def __call__(self, x, z=None, *, sum_groups: Callable | None = None):
        """Normalizes x (..., features), gated by z if given; `sum_groups` as in `rms_norm`."""
        y = rms_norm(x, self.scale[...], z, eps=self.eps, group_size=self.group_size,
                     norm_before_gate=self.norm_before_gate, sum_groups=sum_groups)
        return y if self.dtype is None else y.astype(self.dtype)
