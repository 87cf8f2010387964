"""AdamW's update of one parameter array in pure JAX: the "xla" backend of `jax_mamba2.adamw` and the reference
its kernel is checked against (in float64 when the arrays are float64).

The arithmetic is optax.adamw's (`scale_by_adam`, `add_decayed_weights`, `scale_by_learning_rate`), with the
gradient first scaled by `grad_scale` (optax.clip_by_global_norm's factor when it clips, else 1), computed in
float32 (float64 for float64 arrays) and rounded to each array's dtype once at the end; optax computes in the
arrays' own dtypes, so for float32 arrays the two agree to float32 rounding.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class AdamWHyper(NamedTuple):
    """The scalars of one AdamW step (float32 scalars, traced or not).

    one_minus_b1 / one_minus_b2: 1 - b1 and 1 - b2, each rounded once from its exact value (as optax computes
    them from Python floats): 1 - b2 formed in float32 would be 1.3e-5 off 0.001 at b2 = 0.999;
    bias_correction1 / bias_correction2: 1 - b1^t and 1 - b2^t at the step t (from 1) being taken;
    grad_scale: the factor every gradient is multiplied by first (the global-norm clip's, or 1).
    """

    learning_rate: jax.Array
    b1: jax.Array
    one_minus_b1: jax.Array
    b2: jax.Array
    one_minus_b2: jax.Array
    eps: jax.Array
    eps_root: jax.Array
    weight_decay: jax.Array
    bias_correction1: jax.Array
    bias_correction2: jax.Array
    grad_scale: jax.Array


def adamw_update(param, grad, mu, nu, hyper: AdamWHyper, *, decay: bool):
    """(param', mu', nu'), each in its input's dtype: one AdamW step of one array.

    param, grad, mu, nu: arrays of one shape (any float dtypes); decay: whether weight decay applies to this
    array (optax.adamw's mask)."""
    compute = jnp.promote_types(jnp.float32, jnp.result_type(param, grad, mu, nu))
    h = AdamWHyper(*(jnp.asarray(v, compute) for v in hyper))
    g = grad.astype(compute) * h.grad_scale
    m = h.one_minus_b1 * g + h.b1 * mu.astype(compute)
    v = h.one_minus_b2 * (g * g) + h.b2 * nu.astype(compute)
    p = param.astype(compute)
    update = (m / h.bias_correction1) / (jnp.sqrt(v / h.bias_correction2 + h.eps_root) + h.eps)
    if decay:
        update = update + h.weight_decay * p
    return (p - h.learning_rate * update).astype(param.dtype), m.astype(mu.dtype), v.astype(nu.dtype)
