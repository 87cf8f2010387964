"""Pure-JAX reference of the depthwise causal conv1d over the sequence (mamba_ssm `causal_conv1d_fn` /
`causal_conv1d_update`), the float64-capable oracle of `jax_mamba2.causal_conv1d_silu`.

  y[t, c] = bias[c] + sum_{k<d_conv} kernel[k, c] * x[t - d_conv + 1 + k, c]

with x left-padded by the d_conv - 1 columns before the sequence (zeros, or the cached ones). The inputs (x and
the cached columns) are rounded to the computation dtype; the kernel and bias enter the sum as they are, in its
accumulation dtype (float32, float64 for a float64 computation dtype) with no rounding to the computation dtype,
and the result is rounded to the computation dtype once, as causal_conv1d's CUDA kernels do (they take the weight
in its own dtype and accumulate in float32).
Nothing here validates its arguments: `jax_mamba2.causal_conv1d_silu` does.
"""
import functools

import jax
import jax.numpy as jnp


def causal_conv1d(x, kernel, bias=None, conv_state=None, *, seq_idx=None, dtype=None):
    """Convolves a sequence.

    Args:
      x: (batch, seqlen, channels).
      kernel: (d_conv, channels); bias: (channels,) or None.
      conv_state: optional (batch, channels, width) input columns before x, width d_conv (a
        `Mamba2Cache.conv_state`) or d_conv - 1; only its last d_conv - 1 columns are read. None means zeros.
      seq_idx: optional (batch, seqlen) int sequence ids of packed rows: a tap never crosses into an
        earlier sequence (it reads zero instead). Not combinable with conv_state.
      dtype: computation dtype (default: promoted from x and kernel).

    Returns:
      (y (batch, seqlen, channels) in dtype, `final_conv_state(x, d_conv, conv_state, seq_idx)`).
    """
    d_conv = kernel.shape[0]
    seqlen = x.shape[1]
    dtype = dtype or jnp.result_type(x, kernel)
    window = jnp.concatenate([_state_columns(x, d_conv, conv_state, dtype), _widened(x, dtype)], axis=1)
    # window[:, d_conv + t] is input column t; output t reads window columns t+1 .. t+d_conv.
    taps = [window[:, k + 1: k + 1 + seqlen] for k in range(d_conv)]
    if seq_idx is not None:
        padded_idx = jnp.pad(seq_idx, ((0, 0), (d_conv, 0)), constant_values=-1)
        taps = [jnp.where((padded_idx[:, k + 1: k + 1 + seqlen] == seq_idx)[..., None], tap, 0)
                for k, tap in enumerate(taps)]
    y = _weighted_sum(taps, kernel, bias, dtype)
    return y, final_conv_state(x, d_conv, conv_state, seq_idx)


def final_conv_state(x, d_conv, conv_state=None, seq_idx=None):
    """The state after the sequence: the last d_conv columns of x left-extended by conv_state (as in
    `causal_conv1d`), (batch, channels, d_conv) in conv_state's dtype (x's when None): x's columns converted to it,
    conv_state's carried over as they are (a sequence shorter than d_conv leaves some; `causal_conv1d_step` shifts
    them so too). With the ids of packed sequences `seq_idx` (batch, seqlen) (which conv_state does not combine
    with), the columns of tokens before each row's last sequence are zero, as a call on that sequence alone leaves
    them: no value of another sequence, a NaN included, is carried on."""
    batch, seqlen, channels = x.shape
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    before = (jnp.zeros((batch, channels, d_conv), state_dtype) if conv_state is None
              else _full_width(conv_state, d_conv))
    tail = jnp.swapaxes(x[:, max(seqlen - d_conv, 0):], 1, 2).astype(state_dtype)  # only the columns kept
    state = jnp.concatenate([before, tail], axis=-1)[..., -d_conv:]
    if seq_idx is not None and seqlen:
        positions = seqlen - d_conv + jnp.arange(d_conv)  # column j holds token seqlen - d_conv + j
        same = jnp.take(seq_idx, jnp.maximum(positions, 0), axis=1) == seq_idx[:, -1:]  # (batch, d_conv)
        state = jnp.where(((positions >= 0) & same)[:, None, :], state, 0)
    return state


def _state_columns(x, d_conv, conv_state, dtype):
    """The d_conv columns before x (batch, d_conv, channels) in the accumulation dtype: conv_state's (zeros without
    it; a zero column first for a (d_conv - 1)-column state) rounded to x's dtype, then to dtype, as x's columns
    are, their cotangent returned unrounded (in the accumulation dtype, then conv_state's), as the kernels
    return it: a float32 state's gradient is not rounded to a bfloat16 x's precision."""
    acc_dtype = jnp.promote_types(jnp.float32, dtype)
    if conv_state is None:
        return jnp.zeros((x.shape[0], d_conv, x.shape[2]), acc_dtype)
    columns = jnp.swapaxes(_full_width(conv_state, d_conv), 1, 2)
    return _rounded_keeping_cotangent(columns, jnp.dtype(x.dtype), jnp.dtype(dtype), jnp.dtype(acc_dtype))


def _full_width(conv_state, d_conv):
    """conv_state (batch, channels, d_conv - 1 or d_conv) as d_conv columns: a zero column first where it has
    d_conv - 1 (that column is never read)."""
    return jnp.pad(conv_state, ((0, 0), (0, 0), (d_conv - conv_state.shape[-1], 0)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _rounded_keeping_cotangent(a, x_dtype, dtype, acc_dtype):
    """a rounded to x_dtype, then dtype, as acc_dtype; differentiated as a plain conversion to acc_dtype, so its
    tangent and cotangent pass unrounded (forward and reverse mode alike)."""
    return a.astype(x_dtype).astype(dtype).astype(acc_dtype)


@_rounded_keeping_cotangent.defjvp
def _rounded_jvp(x_dtype, dtype, acc_dtype, primals, tangents):
    (a,), (a_dot,) = primals, tangents
    return _rounded_keeping_cotangent(a, x_dtype, dtype, acc_dtype), a_dot.astype(acc_dtype)


def causal_conv1d_step(x, conv_state, kernel, bias=None, *, dtype=None):
    """One token: x (batch, channels), conv_state (batch, channels, d_conv) -> (y (batch, channels),
    new conv_state), equal to `causal_conv1d` on a length-1 sequence."""
    d_conv = kernel.shape[0]
    new_state = jnp.concatenate([conv_state[..., 1:], x[..., None].astype(conv_state.dtype)], axis=-1)
    dtype = dtype or jnp.result_type(new_state, kernel)
    window = _widened(new_state, dtype)
    return _weighted_sum([window[..., k] for k in range(d_conv)], kernel, bias, dtype), new_state


def _widened(inputs, dtype):
    """The conv's input columns rounded to dtype, then widened to the accumulation dtype (float32, float64 for
    float64) as one array before any tap is sliced from it: under autodiff the taps' cotangents then add up in
    the accumulation dtype and are rounded once (a cast per tap would round each of them first)."""
    return inputs.astype(dtype).astype(jnp.promote_types(jnp.float32, dtype))


def _weighted_sum(taps, kernel, bias, dtype):
    """bias + sum_k kernel[k] * taps[k], the taps already in the accumulation dtype (`_widened`), the kernel and
    bias converted to it (float32 or float64 for float64; exact for narrower parameters, never rounded to dtype),
    the sum rounded to dtype once."""
    acc_dtype = jnp.promote_types(jnp.float32, dtype)
    acc = sum(tap * kernel[k].astype(acc_dtype) for k, tap in enumerate(taps))
    if bias is not None:
        acc = acc + bias.astype(acc_dtype)
    return acc.astype(dtype)
