"""Random conv problems and their float64 reference (forward and VJP), shared by the emulator and GPU tests of
kernels/causal_conv1d*.py and the op."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_mamba2 import conv1d_reference


def make_conv_args(seed, *, batch=2, seqlen=37, channels=40, d_conv=4, dtype=jnp.float32, bias=True,
                   init_width=0, seq_idx=None):
    """(x, kernel, bias, initial_states, seq_idx, dy) of a random problem; seq_idx: None or a list of sequence
    lengths per row summing to seqlen; init_width 0 (none), d_conv - 1 or d_conv. Floats are drawn in f32 and
    rounded to dtype (the kernel and bias too)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(keys[0], (batch, seqlen, channels), jnp.float32).astype(dtype)
    kernel = (jax.random.normal(keys[1], (d_conv, channels), jnp.float32) / np.sqrt(d_conv)).astype(dtype)
    b = jax.random.normal(keys[2], (channels,), jnp.float32).astype(dtype) if bias else None
    init = (jax.random.normal(keys[3], (batch, channels, init_width), jnp.float32).astype(dtype)
            if init_width else None)
    ids = None
    if seq_idx is not None:
        assert sum(seq_idx) == seqlen, "seq_idx lengths must sum to seqlen"
        ids = jnp.asarray(np.broadcast_to(np.repeat(np.arange(len(seq_idx)), seq_idx).astype(np.int32),
                                          (batch, seqlen)))
    dy = jax.random.normal(keys[4], x.shape, jnp.float32).astype(dtype)
    return x, kernel, b, init, ids, dy


def reference_conv(x, kernel, bias, init, seq_idx, silu=True):
    """The float64 reference: silu (when `silu`) of conv1d_reference.causal_conv1d in x's dtype."""
    pre, _ = conv1d_reference.causal_conv1d(x, kernel, bias, init, seq_idx=seq_idx, dtype=x.dtype)
    return jax.nn.silu(pre) if silu else pre


def float64_reference(x, kernel, bias, init, seq_idx, dy, silu=True):
    """(y, (dx, dkernel, dbias, dinit)) in float64 (dbias / dinit None where absent)."""
    with jax.enable_x64(True):
        f64 = [None if a is None else jnp.asarray(np.asarray(a, np.float64)) for a in (x, kernel, bias, init, dy)]
        y, grads = _reference_vjp(*f64, seq_idx, silu)
        return np.asarray(y), tuple(None if g is None else np.asarray(g) for g in grads)


@functools.partial(jax.jit, static_argnums=(6,))
def _reference_vjp(x, kernel, bias, init, dy, seq_idx, silu):
    y, vjp = jax.vjp(lambda *a: reference_conv(*a, seq_idx, silu), x, kernel, bias, init)
    return y, vjp(dy)
