"""Depthwise causal conv1d over the sequence (mamba_ssm `causal_conv1d_fn` / `causal_conv1d_update`).

  y[t, c] = bias[c] + sum_{k<d_conv} kernel[k, c] * x[t - d_conv + 1 + k, c]

with x left-padded by the d_conv - 1 columns before the sequence (zeros, or the cached ones). The sum runs in
float32 (float64 for float64 inputs) and the result is cast to the computation dtype, as the CUDA kernels do.
"""
import jax.numpy as jnp
from flax import nnx

from jax_mamba2.flax_layers.initializers import torch_uniform


def causal_conv1d(x, kernel, bias=None, conv_state=None, *, seq_idx=None, dtype=None):
    """Convolves a sequence.

    Args:
      x: (batch, seqlen, channels).
      kernel: (d_conv, channels); bias: (channels,) or None.
      conv_state: optional (batch, channels, d_conv) input columns before x (a `Mamba2Cache.conv_state`);
        only its last d_conv - 1 columns are read. None means zeros.
      seq_idx: optional (batch, seqlen) int sequence ids of packed rows: a tap never crosses into an
        earlier sequence (it reads zero instead). Not combinable with conv_state.
      dtype: computation dtype (default: promoted from x and kernel).

    Returns:
      (y (batch, seqlen, channels) in dtype, new conv_state (batch, channels, d_conv): the last d_conv input
      columns, in conv_state's dtype (x's when None)).
    """
    d_conv = kernel.shape[0]
    batch, seqlen, channels = x.shape
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    if conv_state is None:
        conv_state = jnp.zeros((batch, channels, d_conv), x.dtype)
    window = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2).astype(x.dtype), x], axis=1)
    # window[:, d_conv + t] is input column t; output t reads window columns t+1 .. t+d_conv.
    taps = [window[:, k + 1: k + 1 + seqlen] for k in range(d_conv)]
    if seq_idx is not None:
        padded_idx = jnp.pad(seq_idx, ((0, 0), (d_conv, 0)), constant_values=-1)
        taps = [jnp.where((padded_idx[:, k + 1: k + 1 + seqlen] == seq_idx)[..., None], tap, 0)
                for k, tap in enumerate(taps)]
    y = _weighted_sum(taps, kernel, bias, dtype)
    return y, jnp.swapaxes(window[:, -d_conv:], 1, 2).astype(state_dtype)


def causal_conv1d_step(x, conv_state, kernel, bias=None, *, dtype=None):
    """One token: x (batch, channels), conv_state (batch, channels, d_conv) -> (y (batch, channels),
    new conv_state), equal to `causal_conv1d` on a length-1 sequence."""
    d_conv = kernel.shape[0]
    new_state = jnp.concatenate([conv_state[..., 1:], x[..., None].astype(conv_state.dtype)], axis=-1)
    return _weighted_sum([new_state[..., k] for k in range(d_conv)], kernel, bias, dtype), new_state


def _weighted_sum(taps, kernel, bias, dtype):
    """bias + sum_k kernel[k] * taps[k], rounded to dtype like the operands and accumulated in >= float32."""
    dtype = dtype or jnp.result_type(taps[0], kernel)
    acc_dtype = jnp.promote_types(jnp.float32, dtype)

    def widen(a):
        return a.astype(dtype).astype(acc_dtype)

    acc = sum(widen(tap) * widen(kernel[k]) for k, tap in enumerate(taps))
    if bias is not None:
        acc = acc + widen(bias)
    return acc.astype(dtype)


class CausalConv1d(nnx.Module):
    """Holds the depthwise causal conv's parameters; `causal_conv1d` / `causal_conv1d_step` apply them.

    Parameters: `kernel` (d_conv, channels) (mamba_ssm's conv1d.weight (channels, 1, d_conv), transposed) and
    `bias` (channels,) or None, both PyTorch-default initialized, U(+-1/sqrt(d_conv)).

    Args:
      channels: number of independent channels.
      d_conv: kernel width.
      use_bias: whether there is a bias.
      param_dtype: parameter dtype (default: float32).
      rngs: parameter initialization keys.
    """

    def __init__(self, channels: int, d_conv: int, *, use_bias: bool = True, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        init = torch_uniform(d_conv)  # fan_in = (in_channels / groups) * d_conv = d_conv
        self.kernel = nnx.Param(init(rngs.params(), (d_conv, channels), param_dtype))
        self.bias = nnx.Param(init(rngs.params(), (channels,), param_dtype)) if use_bias else nnx.data(None)
