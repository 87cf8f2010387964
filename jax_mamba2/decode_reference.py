"""Pure-JAX reference of the decode step's fused ops (`jax_mamba2.decode`): the float64-capable oracle of their
kernels and the "xla" backend.

  norm_project   an optional residual add and (gated, grouped) RMSNorm of a few rows, then their product with a
                 weight matrix: the block norm + in_proj, the gated norm + out_proj, the final norm + LM head.
  mixer_step     the mixer between its projections for one token: the conv step + SiLU on in_proj's xBC
                 columns, then the SSD state update (`reference.ssd_step`) with D and, without the gated norm,
                 the gate.

Both compose the references of the ops the full forward uses (`norm_reference`, `conv1d_reference`, `reference`),
with the roundings of the layers' composed decode step, so that a model decodes the same on every backend. They
take one layer's arrays (no stacks) and validate nothing: `jax_mamba2.decode` does.
"""
import jax
import jax.numpy as jnp

from jax_mamba2 import conv1d_reference, norm_reference, reference
from jax_mamba2.projection import project


def norm_project(x, weight, *, norm_weight=None, residual=None, residual_dtype=None, z=None, group_size=None,
                 norm_before_gate=False, eps=1e-5, bias=None, transpose_weight=False, dtype=None, x_dtype=None,
                 partials=False, parts=1, sum_squares=None):
    """(out, residual_out) of one decode projection.

        h   = x (+ residual), rounded to residual_dtype (when given: the new residual stream, residual_out)
        a   = rms_norm(h, norm_weight, z, ...) in h's dtype (residual_dtype when given), then x.dtype, when
              norm_weight is given, else x
        out = a.astype(dtype) @ weight.astype(dtype) (+ bias.astype(dtype)), in dtype

    Args:
      x: (rows, K), or (parts, rows, K) partial sums whose sum rounded to x_dtype is x (an earlier
        projection's output with `partials`).
      weight: (K, N), or (N, K) with transpose_weight.
      norm_weight: (K,) or None (no norm); z: optional gate (rows, K); group_size, norm_before_gate, eps: the
        norm's (see `norm_reference.rms_norm`).
      residual: optional (rows, K) added to x; residual_dtype: the residual stream's dtype (None: no residual
        stream, residual_out is None).
      bias: optional (N,).
      dtype: the computation dtype (default: the result type of x and weight).
      x_dtype: the dtype of x's sum when x is partial sums.
      partials: return out as (parts, rows, N) partial sums in the product's accumulation dtype (float32, float64
        for float64), the bias added and nothing rounded to dtype: rounding their sum to dtype gives out.
      parts: with `partials`, the product's partial sums over this many consecutive equal pieces of K (it divides
        K), the bias in the first: the kernels' split of K, whose pieces' gradients differ where their cotangents do.
      sum_squares: optional (rows, parts): the norm's sums of squares in pieces, parts / ngroups consecutive ones
        per group, which it takes instead of summing its input's squares (`mixer_step`'s with norm_z_offset).

    Returns:
      (out (rows, N) in dtype, or its partial sums with `partials`; residual_out (rows, K) in residual_dtype or
      None).
    """
    if x.ndim == 3:
        x = x.sum(axis=0).astype(x_dtype)
    dtype = dtype or jnp.result_type(x, weight)
    residual_out = None
    a = x
    if residual_dtype is not None:
        compute = jnp.promote_types(jnp.float32, x.dtype if residual is None else jnp.result_type(x, residual))
        h = x.astype(compute) if residual is None else x.astype(compute) + residual.astype(compute)
        residual_out = h.astype(residual_dtype)
        a = residual_out
    if norm_weight is not None:
        given = None if sum_squares is None else _given_sums(sum_squares, a.shape[-1], group_size)
        a = norm_reference.rms_norm(a, norm_weight, z, eps=eps, group_size=group_size,
                                    norm_before_gate=norm_before_gate, sum_groups=given).astype(x.dtype)
    a, weight = a.astype(dtype), (weight.T if transpose_weight else weight).astype(dtype)
    if partials and parts > 1:  # piece p: a[:, pK/parts:(p+1)K/parts] @ weight[pK/parts:(p+1)K/parts]
        out = jnp.einsum("rpk,pkn->prn", a.reshape(a.shape[0], parts, -1), weight.reshape(parts, -1, weight.shape[1]),
                         preferred_element_type=jnp.promote_types(jnp.float32, dtype))
        return (out if bias is None else out.at[0].add(bias.astype(dtype).astype(out.dtype))), residual_out
    out = project(a, weight, preferred_element_type=jnp.promote_types(jnp.float32, dtype) if partials else None)
    if bias is not None:
        out = out + bias.astype(dtype).astype(out.dtype)
    return (out[None] if partials else out), residual_out


def _given_sums(sum_squares, features: int, group_size):
    """The norm's `sum_groups` that replaces its own sums of squares per group by those of `sum_squares` (rows,
    parts), parts / ngroups consecutive pieces per group."""
    ngroups = features // (group_size or features)
    sums = sum_squares.reshape(*sum_squares.shape[:-1], ngroups, sum_squares.shape[-1] // ngroups).sum(axis=-1)
    return lambda computed: sums.astype(computed.dtype)


def mixer_step(zxbcdt, conv_state, ssm_state, conv_weight, conv_bias, A_log, dt_bias, D, *, nheads, headdim,
               ngroups, dstate, xbc_offset, dt_offset, z_offset=None, dt_limit=(0.0, float("inf")),
               norm_z_offset=None, norm_group_size=None, norm_before_gate=False, norm_pieces=None):
    """One token of the mixer between in_proj and the gated norm.

    Args:
      zxbcdt: (rows, in_width), in_proj's output: xBC (conv_dim = nheads * headdim + 2 * ngroups * dstate
        columns) from xbc_offset, dt (nheads) from dt_offset, and the gate z (nheads * headdim) from z_offset
        when the step applies it (a mixer without the gated norm; None otherwise).
      conv_state: (rows, conv_dim, d_conv); ssm_state: (rows, nheads, headdim, dstate).
      conv_weight: (d_conv, conv_dim); conv_bias: (conv_dim,) or None.
      A_log, dt_bias: (nheads,); D: (nheads,) or (nheads, headdim).
      dt_limit: the clip of softplus(dt + dt_bias).
      norm_z_offset, norm_group_size, norm_before_gate: the gated norm after the step (its gate's first column in
        zxbcdt, its group size (None: every feature) and gate placement): y is then that norm's input, and the step
        also returns its sums of squares.
      norm_pieces: the sums per row (consecutive pieces of equal width, a multiple of the groups; None: one per
        group), as the kernels return them.

    Returns:
      (y (rows, nheads * headdim) in zxbcdt's dtype, the new ssm_state in its dtype, the new conv_state in its
      dtype), and with norm_z_offset instead y as the norm's input, y times silu(z) unless norm_before_gate, in
      float32 (float64 for float64 y), and its sums of squares (rows, norm_pieces or groups) in the same dtype.
    """
    rows = zxbcdt.shape[0]
    d_ssm, bc = nheads * headdim, ngroups * dstate
    xBC = zxbcdt[:, xbc_offset:xbc_offset + d_ssm + 2 * bc]
    u, new_conv_state = conv1d_reference.causal_conv1d_step(xBC, conv_state, conv_weight, conv_bias,
                                                            dtype=xBC.dtype)
    x, B, C = jnp.split(jax.nn.silu(u), [d_ssm, d_ssm + bc], axis=-1)
    dt = zxbcdt[:, dt_offset:dt_offset + nheads]
    A = -jnp.exp(A_log.astype(jnp.promote_types(jnp.float32, A_log.dtype)))
    z = None if z_offset is None else zxbcdt[:, z_offset:z_offset + d_ssm].reshape(rows, nheads, headdim)
    y, new_ssm_state = reference.ssd_step(
        ssm_state, x.reshape(rows, nheads, headdim), dt, A, B.reshape(rows, ngroups, dstate),
        C.reshape(rows, ngroups, dstate), D=D, z=z, dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit)
    y = y.reshape(rows, d_ssm)
    if norm_z_offset is None:
        return y, new_ssm_state, new_conv_state
    h = y.astype(jnp.promote_types(jnp.float32, y.dtype))
    if not norm_before_gate:
        h = h * jax.nn.silu(zxbcdt[:, norm_z_offset:norm_z_offset + d_ssm].astype(h.dtype))
    pieces = norm_pieces or d_ssm // (norm_group_size or d_ssm)
    # The piece width stated, not inferred (-1): with no rows the reshape could not infer it.
    return h, new_ssm_state, new_conv_state, jnp.square(h).reshape(rows, pieces, d_ssm // pieces).sum(axis=-1)
