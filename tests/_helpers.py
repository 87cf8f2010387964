"""Test inputs and error measures shared by the SSD tests (reference, op, bridge, kernels)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Relative L2 error bounds against the float64 scan reference, by input dtype.
TOLERANCE = {
    "kernel_fwd": {"float32": 5e-3, "bfloat16": 2e-2, "float16": 1e-2},
    "kernel_bwd": {"float32": 5e-3, "bfloat16": 3e-2, "float16": 2e-2},
    "xla": {"float32": 1e-5, "bfloat16": 2e-2, "float16": 1e-2, "float64": 1e-10},
}


def rel_l2(actual, expected) -> float:
    actual = np.asarray(jnp.asarray(actual, jnp.float32) if getattr(actual, "dtype", None) == jnp.bfloat16
                        else actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def make_ssd_args(seed, *, batch=2, seqlen=64, nheads=4, headdim=16, ngroups=1, dstate=16,
                  dtype=jnp.float32, D=None, z=False, dt_bias=False, dt_softplus=False,
                  dt_limit=None, initial_states=False, seq_idx=None):
    """Random operands of `jax_mamba2.ssd`: (args tuple, kwargs dict).

    D: None | "head" | "headdim". seq_idx: None or a list of sequence lengths per row (summing to
    seqlen), e.g. [10, 30, 24]. Raw dt ~ U(-3, 1) with softplus, else U(1e-3, 0.5); A = -exp(U(-2, 1)).
    """
    keys = jax.random.split(jax.random.PRNGKey(seed), 9)
    x = jax.random.normal(keys[0], (batch, seqlen, nheads, headdim), jnp.float32).astype(dtype)
    lo, hi = (-3.0, 1.0) if dt_softplus else (1e-3, 0.5)
    dt = jax.random.uniform(keys[1], (batch, seqlen, nheads), jnp.float32, lo, hi).astype(dtype)
    A = -jnp.exp(jax.random.uniform(keys[2], (nheads,), jnp.float32, -2.0, 1.0))
    B = jax.random.normal(keys[3], (batch, seqlen, ngroups, dstate), jnp.float32).astype(dtype)
    C = jax.random.normal(keys[4], (batch, seqlen, ngroups, dstate), jnp.float32).astype(dtype)
    kwargs = {"dt_softplus": dt_softplus}
    if D == "head":
        kwargs["D"] = jax.random.normal(keys[5], (nheads,), jnp.float32)
    elif D == "headdim":
        kwargs["D"] = jax.random.normal(keys[5], (nheads, headdim), jnp.float32)
    if z:
        kwargs["z"] = jax.random.normal(keys[6], x.shape, jnp.float32).astype(dtype)
    if dt_bias:
        kwargs["dt_bias"] = jax.random.uniform(keys[7], (nheads,), jnp.float32, -0.5, 0.5)
    if dt_limit is not None:
        kwargs["dt_limit"] = dt_limit
    if initial_states:
        kwargs["initial_states"] = jax.random.normal(keys[8], (batch, nheads, headdim, dstate))
    if seq_idx is not None:
        assert sum(seq_idx) == seqlen, "seq_idx lengths must sum to seqlen"
        ids = np.repeat(np.arange(len(seq_idx)), seq_idx).astype(np.int32)
        kwargs["seq_idx"] = jnp.asarray(np.broadcast_to(ids, (batch, seqlen)))
    return (x, dt, A, B, C), kwargs


def to_float64(tree):
    """Casts every floating array of a pytree to float64 (call under jax.enable_x64)."""
    return jax.tree.map(
        lambda a: a.astype(jnp.float64) if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)
        else a, tree)
