"""`project`: a layer's dense projection `inputs @ kernel`, kept a matrix product when it has one row.

XLA's GPU compiler strength-reduces a product whose left operand is a vector (a decode step at batch 1: one
token, `(1, d_in) @ (d_in, d_out)`) into an elementwise multiply and a reduction over the kernel's rows, which
its reduction emitter runs as a column reduction, far below the memory bandwidth a matrix-product kernel reaches
on the same weights (docs/design.md, "Decode"). A decode step is bound by reading the weights, so `project` pads
a single row to two: the product stays a matrix product (cuBLAS or XLA's GEMM fusion) and the padding row, which
costs a (2, d_in) copy, is dropped from the result. Other shapes are a plain `jnp.einsum`.
"""
import math

import jax.numpy as jnp

# Rows a product needs for XLA's GPU compiler to keep it a matrix product (one row is a vector).
MIN_MATMUL_ROWS = 2


def project(inputs, kernel, preferred_element_type=None):
    """inputs (..., d_in) @ kernel (d_in, d_out) -> (..., d_out), in the operands' result dtype (or
    preferred_element_type: the product's accumulation, unrounded).

    The same values as `jnp.einsum("...d,de->...e", inputs, kernel)`; a single row (every leading axis of
    size 1) is computed as the first row of a two-row product (see the module docstring).
    """
    rows = math.prod(inputs.shape[:-1])
    if rows != 1:
        return jnp.einsum("...d,de->...e", inputs, kernel, preferred_element_type=preferred_element_type)
    padded = jnp.pad(inputs.reshape(1, inputs.shape[-1]), ((0, MIN_MATMUL_ROWS - 1), (0, 0)))
    product = jnp.matmul(padded, kernel, preferred_element_type=preferred_element_type)
    return product[:1].reshape(*inputs.shape[:-1], kernel.shape[-1])
