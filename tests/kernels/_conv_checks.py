"""Random conv problems and their float64 reference (forward and VJP), shared by the emulator and GPU tests of
kernels/causal_conv1d*.py and the op."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_mamba2 import conv1d_reference
from tests._helpers import rel_l2


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


def make_cancelling_args(seed, *, batch=2, seqlen=19, channels=24, d_conv=4, scale=256.0):
    """(x, kernel, bias, initial_states, None, dy) of a bf16 problem whose float32 kernel and bias (no value of
    them representable in bf16) lose accuracy visibly where they are rounded to bf16: x, the initial states'
    d_conv columns and dy are each constant along the sequence, and the kernel's taps are ~scale large and sum
    to ~1, so that the pre-activation x · Σ_k kernel[k] + bias (every token's), and with it silu', y and every
    gradient, are small against terms whose bf16 rounding (~2^-9 of each) they would inherit."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    v = jax.random.normal(keys[0], (batch, 1, channels), jnp.float32).astype(jnp.bfloat16)
    x = jnp.broadcast_to(v, (batch, seqlen, channels))
    init = jnp.broadcast_to(jnp.swapaxes(v, 1, 2), (batch, channels, d_conv))
    dy = jnp.broadcast_to(jax.random.normal(keys[1], (batch, 1, channels), jnp.float32).astype(jnp.bfloat16),
                          x.shape)
    taps = scale * jax.random.normal(keys[2], (d_conv - 1, channels), jnp.float32)
    last = -taps.sum(axis=0, keepdims=True) + jax.random.normal(keys[3], (1, channels), jnp.float32)
    kernel = jnp.concatenate([taps, last])
    bias = jax.random.normal(keys[4], (channels,), jnp.float32)
    for a in (kernel, bias):
        assert not bool(jnp.any(a.astype(jnp.bfloat16).astype(jnp.float32) == a)), "a value exact in bf16"
    return x, kernel, bias, init, None, dy


def rounding_errors(got, args) -> dict[str, tuple[float, float]]:
    """name -> (relative L2 error against the float64 reference of the float32 kernel and bias, the same against
    the reference of them rounded to bf16) of each of `got` = (y, dx, dkernel, dbias, dinit) of a
    `make_cancelling_args` problem (the loss sum(y * dy))."""
    x, kernel, bias, init, seq_idx, dy = args
    exact = float64_reference(*args)
    rounded = float64_reference(x, kernel.astype(jnp.bfloat16), bias.astype(jnp.bfloat16), init, seq_idx, dy)
    return {name: (rel_l2(a, want), rel_l2(a, other))
            for name, a, want, other in zip(("y", "dx", "dkernel", "dbias", "dinit"), got, (exact[0], *exact[1]),
                                            (rounded[0], *rounded[1]))}


def conv_and_grads(backend, args, source=None, offset=0, split=None):
    """(y, dx, dkernel, dbias, dinit) of the op on `args` (loss sum(y * dy)) on `backend`: the plain op on x, or
    with `source` the mixer's call (x's channels at `offset` of the wider `source`, in pieces of `split`, the other
    channels passed through)."""
    from jax_mamba2 import conv1d

    x, kernel, bias, init, _, dy = args
    source = x if source is None else source

    def conv(source, kernel, bias, init):
        if split is None:
            return conv1d.causal_conv1d_silu(source, kernel, bias, initial_states=init, backend=backend)
        outputs = conv1d.causal_conv1d_silu_split(source, kernel, bias, channel_offset=offset, split=split,
                                                  initial_states=init, pass_through=True, backend=backend)
        return jnp.concatenate(outputs[1:-1], axis=-1)

    def loss(*a):
        return jnp.sum(conv(*a).astype(jnp.float32) * dy.astype(jnp.float32))

    y, (dsource, *grads) = jax.jit(lambda *a: (conv(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))(
        source, kernel, bias, init)
    return y, dsource[..., offset:offset + x.shape[-1]], *grads
