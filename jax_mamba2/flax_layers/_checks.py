"""Argument checks of the layers' entry points (`Mamba2`, `Mamba2Block`, `Mamba2LMHeadModel`, `generate`).

Each check raises before any computation, with a message `"<api>: <name>=<value> must be <expected>"` as
`jax_mamba2.op.ssd` words its own. Shapes are static under jit, so these checks also hold for traced arrays.

An expected shape is a tuple of (axis name, size) pairs; a size of None accepts any length, e.g.
`(("batch", None), ("seqlen", None), ("d_model", 64))`.
"""
import math
from numbers import Real

import jax.numpy as jnp
from flax import nnx

from jax_mamba2.checks import check_float, check_seq_idx_order, check_seq_idx_range, float_dtype

Axes = tuple[tuple[str, int | None], ...]


def _shape_text(axes: Axes) -> str:
    """The expected shape as a tuple is written: "(batch, seqlen)", "(batch, d_model)=(batch, 64)", "(batch,)"."""
    comma = "," if len(axes) == 1 else ""  # a shape of one axis reads as Python writes it, not as a parenthesized name
    names = ", ".join(name for name, _ in axes) + comma
    sizes = ", ".join(name if size is None else str(size) for name, size in axes) + comma
    return f"({names})=({sizes})" if names != sizes else f"({names})"


def check_named_array(api: str, name: str, value, axes: Axes, *, kind: str) -> tuple[int, ...]:
    """Checks that `value` is an array of shape `axes` whose dtype is of `kind`: "floating", one of the float dtypes
    the ops take (bfloat16, float16, float32, float64; float8 and the like would fail later, inside an op, naming
    no argument), or "integer".

    Returns:
      The shape.

    Raises:
      TypeError: if `value` has no shape and dtype, or a dtype other than `kind`'s.
      ValueError: if the rank or a sized axis differs.
    """
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{api}: {name} must be an array of shape {_shape_text(axes)}, got "
                        f"{type(value).__name__}")
    shape = tuple(value.shape)
    if len(shape) != len(axes) or any(size is not None and n != size for n, (_, size) in zip(shape, axes)):
        raise ValueError(f"{api}: {name}.shape={shape} must be {_shape_text(axes)}")
    if kind == "floating":
        check_float(api, name, value)
    elif not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{api}: {name}.dtype={value.dtype} must be integer")
    return shape


def check_cache(api: str, cache, conv_axes: Axes, ssm_axes: Axes) -> None:
    """Checks a `Mamba2Cache` (or any pair with fields conv_state and ssm_state) against the expected shapes."""
    if not all(hasattr(cache, field) for field in ("conv_state", "ssm_state")):
        raise TypeError(f"{api}: cache must be a Mamba2Cache (conv_state, ssm_state), got {type(cache).__name__}")
    check_named_array(api, "cache.conv_state", cache.conv_state, conv_axes, kind="floating")
    check_named_array(api, "cache.ssm_state", cache.ssm_state, ssm_axes, kind="floating")


def check_layer_seq_idx(api: str, seq_idx, batch: int, seqlen: int, cache=None) -> None:
    """seq_idx: None or (batch, seqlen) integer ids of packed sequences, nondecreasing along seqlen where concrete
    (checked here, before the layer's first launch, as the SSD would check it after the projection and the conv);
    not with a cache (whose state continues one sequence per row)."""
    if seq_idx is None:
        return
    check_named_array(api, "seq_idx", seq_idx, (("batch", batch), ("seqlen", seqlen)), kind="integer")
    if cache is not None:
        raise ValueError(f"{api}: seq_idx needs cache=None (a cache continues one sequence per row)")
    check_seq_idx_range(api, seq_idx)
    check_seq_idx_order(api, seq_idx)


def check_batch_splits(api: str, name: str, batch: int, mesh_axes) -> None:
    """`batch` (the rows of argument `name`) splits evenly over the data axis of `mesh_axes` (a `MeshAxes`, set by
    `shard_model`; None: not sharded, any batch)."""
    if mesh_axes is None:
        return
    size = mesh_axes.mesh.shape[mesh_axes.data_axis]
    if batch % size:
        raise ValueError(f"{api}: {name}.shape[0]={batch} (the batch) must be divisible by {size}, the size of the "
                         f"mesh axis {mesh_axes.data_axis!r} that shard_model splits the batch over")


def check_rngs(api: str, rngs) -> None:
    """`rngs` is an `nnx.Rngs` (a bare key or seed would fail inside flax's initializers, naming nothing)."""
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"{api}: rngs must be an nnx.Rngs, e.g. nnx.Rngs(0); got {type(rngs).__name__}")


def check_float_dtype(api: str, name: str, dtype) -> None:
    """`dtype` must be None or one of the float dtypes the kernels and references take (bfloat16, float16,
    float32, float64; a dtype, its type or its name): float8 and the like would fail later, inside an op."""
    if dtype is not None:
        float_dtype(api, name, dtype)


def check_range(api: str, name: str, value, *, low_min: float, strict_low: bool = False) -> tuple[float, float]:
    """A pair (low, high) of real numbers with low_min <= low <= high (low_min < low if strict_low).

    Returns:
      (low, high) as floats.
    """
    try:
        pair = () if isinstance(value, (str, bytes)) else tuple(value)
    except TypeError:
        pair = ()
    if len(pair) != 2 or not all(isinstance(v, Real) and not isinstance(v, bool) for v in pair):
        raise TypeError(f"{api}: {name}={value!r} must be a pair of numbers (low, high)")
    low, high = (float(v) for v in pair)
    low_ok = low > low_min if strict_low else low >= low_min
    if math.isnan(low) or math.isnan(high) or not low_ok or low > high:
        raise ValueError(f"{api}: {name}={value!r} must satisfy {low_min} {'<' if strict_low else '<='} low "
                         "<= high")
    return low, high
