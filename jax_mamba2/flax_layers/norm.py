"""`RMSNorm`: the block, final and (gated, grouped) mixer norms as an NNX layer over `jax_mamba2.rms_norm`.

The math is `jax_mamba2.norm_reference` (mamba_ssm `RMSNorm` / `RMSNormGated` and the fused residual add +
norm of `Block`); the op runs it as cuTile kernels on a GPU ("auto") or in pure JAX ("xla").
"""
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_mamba2 import backends
from jax_mamba2 import norm as norm_op
from jax_mamba2.checks import check_flag, check_int, check_positive_float, float_dtype
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
        check_int("RMSNorm", "features", features)
        if group_size is not None:
            check_int("RMSNorm", "group_size", group_size)
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
        # Set by `shard_model` on the norms outside the mixers (the blocks' and the final one): their rows (the
        # leading axis) are split over its data axis, and the op runs per shard inside a `shard_map`. Left to
        # XLA's partitioner, the kernels' custom calls (which have no partitioning rule) would get every row,
        # gathered onto every device. The mixers' gated norm runs inside the mixer's own shard_map.
        self.mesh_axes = None

    def __call__(self, x, z=None, *, sum_groups: Callable | None = None, z_kept_in=None):
        """Normalizes x (..., features), gated by z if given; `sum_groups` and `z_kept_in` (where the kernels'
        backward reads z again) as in `jax_mamba2.rms_norm`. A group split across devices (`sum_groups`) runs
        the XLA path whatever the layer's backend, which names the kernels for every other call (the
        tensor-parallel mixer with fewer groups than devices shards its other work as any other)."""
        def norm(x, z, scale):
            return norm_op.rms_norm(x, scale, z, eps=self.eps, group_size=self.group_size,
                                    norm_before_gate=self.norm_before_gate, sum_groups=sum_groups,
                                    z_kept_in=z_kept_in, backend="xla" if sum_groups is not None else self.backend)

        y = self._on_row_shards(norm, x, z)
        return y if self.dtype is None else y.astype(self.dtype)

    def add_norm(self, x, residual, *, residual_dtype=None, return_residual: bool = True):
        """The fused residual add + norm: (norm(h), h) with h = x + residual in `residual_dtype` (default: the
        result type of x and residual), h = x where residual is None (the first block); the output in `dtype`,
        else x's. Ungated, one group (the block and final norms). With return_residual=False only norm(h)."""
        def add_norm(x, residual, scale):
            return norm_op.add_rms_norm(x, residual, scale, eps=self.eps, residual_dtype=residual_dtype,
                                        out_dtype=self.dtype or x.dtype, return_residual=return_residual,
                                        backend=self.backend)

        return self._on_row_shards(add_norm, x, residual)

    def _on_row_shards(self, fn, *rows):
        """fn(*rows, scale): on this device, or with `mesh_axes` set per shard of the rows (arrays of at least two
        axes whose leading one, the batch, the data axis splits; None passes through) inside `jax.shard_map`, the
        scale replicated. A single row of features runs on this device."""
        if self.mesh_axes is None or rows[0].ndim < 2:
            return fn(*rows, self.scale[...])
        spec = P(self.mesh_axes.data_axis)
        return jax.shard_map(fn, mesh=self.mesh_axes.mesh, in_specs=(*(spec for _ in rows), P()),
                             out_specs=spec)(*rows, self.scale[...])
