"""`RMSNorm`: the block, final and (gated, grouped) mixer norms as an NNX layer over `jax_mamba2.rms_norm`.

The math is `jax_mamba2.norm_reference` (mamba_ssm `RMSNorm` / `RMSNormGated` and the fused residual add +
norm of `Block`); the op runs it as cuTile kernels on a GPU ("auto") or in pure JAX ("xla").
"""
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from jax_mamba2 import backends
from jax_mamba2 import norm as norm_op
from jax_mamba2.checks import check_flag, check_positive_float, float_dtype
from jax_mamba2.flax_layers import _checks


class RMSNorm(nnx.Module):
    """RMSNorm layer (mamba_ssm `RMSNorm` / `RMSNormGated`); see `jax_mamba2.rms_norm` for the math.

    The scale parameter is `scale` (NNX naming; mamba_ssm calls it `weight`), shape (features,), init ones.

    Args:
      features: size of the normalized last axis.
      eps: added to the mean square (default: 1e-5).
      group_size: features per statistics group (default: None, all features); must divide `features`.
      norm_before_gate: gate placement when called with `z` (default: False).
      backend: the op's backend, "auto" | "cutile" | "cutile_callback" | "xla" (default: "auto").
      dtype: output dtype (default: None, the input's dtype).
      param_dtype: dtype of `scale` (default: float32).
      rngs: unused by the initializer; accepted for NNX's constructor convention.
    """

    def __init__(self, features: int, *, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = False, backend: str = "auto", dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        _checks.check_rngs("RMSNorm", rngs)  # (unused: the scale starts at ones)
        _checks.check_positive_int("RMSNorm", "features", features)
        if group_size is not None:
            _checks.check_positive_int("RMSNorm", "group_size", group_size)
            if features % group_size:
                raise ValueError(f"RMSNorm: group_size={group_size} must be a positive divisor of {features=}")
        eps = check_positive_float("RMSNorm", "eps", eps)
        norm_before_gate = check_flag("RMSNorm", "norm_before_gate", norm_before_gate)
        _checks.check_float_dtype("RMSNorm", "dtype", dtype)
        param_dtype = float_dtype("RMSNorm", "param_dtype", param_dtype)
        backends.check_name(backend, "RMSNorm", norm_op.OP)
        self.eps, self.group_size, self.norm_before_gate, self.dtype = eps, group_size, norm_before_gate, dtype
        self.backend = backend
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))

    def __call__(self, x, z=None, *, sum_groups: Callable | None = None, z_kept_in=None):
        """Normalizes x (..., features), gated by z if given; `sum_groups` and `z_kept_in` (where the kernels'
        backward reads z again) as in `jax_mamba2.rms_norm`. A group split across devices (`sum_groups`) runs
        the XLA path whatever the layer's backend, which names the kernels for every other call (the
        tensor-parallel mixer with fewer groups than devices shards its other work as any other)."""
        y = norm_op.rms_norm(x, self.scale[...], z, eps=self.eps, group_size=self.group_size,
                             norm_before_gate=self.norm_before_gate, sum_groups=sum_groups, z_kept_in=z_kept_in,
                             backend="xla" if sum_groups is not None else self.backend)
        return y if self.dtype is None else y.astype(self.dtype)

    def add_norm(self, x, residual, *, residual_dtype=None, return_residual: bool = True):
        """The fused residual add + norm: (norm(h), h) with h = x + residual in `residual_dtype` (default: the
        result type of x and residual); the output in `dtype`, else x's. Ungated, one group (the block and
        final norms). With return_residual=False only norm(h)."""
        return norm_op.add_rms_norm(x, residual, self.scale[...], eps=self.eps, residual_dtype=residual_dtype,
                                    out_dtype=self.dtype or x.dtype, return_residual=return_residual,
                                    backend=self.backend)
