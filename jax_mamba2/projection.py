"""`project`: a layer's dense projection `inputs @ kernel`, kept a matrix product when it has one row.

XLA's GPU compiler strength-reduces a product whose left operand is a vector (a decode step at batch 1: one
token, `(1, d_in) @ (d_in, d_out)`) into an elementwise multiply and a reduction over the kernel's rows, which
its reduction emitter runs as a column reduction, far below the memory bandwidth a matrix-product kernel reaches
on the same weights (docs/design.md, "Decode"). A decode step is bound by reading the weights, so `project` pads
a single row to two: the product stays a matrix product (cuBLAS or XLA's GEMM fusion) and the padding row, which
costs a (2, d_in) copy, is dropped from the result. Other shapes are a plain `jnp.einsum`.

With `dtype`, a kernel kept in another dtype (float32 parameters under bfloat16 compute) is converted inside a
`jax.checkpoint`: autodiff keeps the parameter itself for the backward product, which lives anyway, and converts
it again there, instead of keeping the converted copy (a layer's weights once more per layer, 28 MB at d_model
1536, against a conversion that reads them once).
"""
import functools
import math

import jax
import jax.numpy as jnp

# Rows a product needs for XLA's GPU compiler to keep it a matrix product (one row is a vector).
MIN_MATMUL_ROWS = 2


def project(inputs, kernel, preferred_element_type=None, *, dtype=None):
    """inputs (..., d_in) @ kernel (d_in, d_out) -> (..., d_out), in the operands' result dtype (or
    preferred_element_type: the product's accumulation, unrounded).

    The same values as `jnp.einsum("...d,de->...e", inputs, kernel)`; a single row (every leading axis of
    size 1) is computed as the first row of a two-row product (see the module docstring). With `dtype`, both
    operands are converted to it first, the kernel's conversion not kept for the backward pass.
    """
    if dtype is not None:
        inputs = inputs.astype(dtype)
        if kernel.dtype != jnp.dtype(dtype):
            return _convert_and_project(inputs, kernel, jnp.dtype(dtype), preferred_element_type)
    rows = math.prod(inputs.shape[:-1])
    if rows != 1:
        return jnp.einsum("...d,de->...e", inputs, kernel, preferred_element_type=preferred_element_type)
    padded = jnp.pad(inputs.reshape(1, inputs.shape[-1]), ((0, MIN_MATMUL_ROWS - 1), (0, 0)))
    product = jnp.matmul(padded, kernel, preferred_element_type=preferred_element_type)
    return product[:1].reshape(*inputs.shape[:-1], kernel.shape[-1])


@functools.partial(jax.checkpoint, static_argnums=(2, 3))
def _convert_and_project(inputs, kernel, dtype, preferred_element_type):
    """`project` of the kernel converted to dtype, recomputing the conversion where the backward needs it."""
    return project(inputs, kernel.astype(dtype), preferred_element_type)
