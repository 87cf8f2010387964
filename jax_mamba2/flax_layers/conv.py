"""The parameters of the depthwise causal conv1d over the sequence (mamba_ssm's `conv1d`); the op that applies
them is `jax_mamba2.causal_conv1d_silu` (full sequences) and `causal_conv1d_step` (one decode token), both with
the semantics of `jax_mamba2.conv1d_reference`.
"""
import jax.numpy as jnp
from flax import nnx

from jax_mamba2.conv1d_reference import causal_conv1d_step
from jax_mamba2.flax_layers.initializers import torch_uniform

__all__ = ["CausalConv1d", "causal_conv1d_step"]


class CausalConv1d(nnx.Module):
    """Holds the depthwise causal conv's parameters; `causal_conv1d_silu` / `causal_conv1d_step` apply them.

    Parameters: `kernel` (d_conv, channels) (mamba_ssm's conv1d.weight (channels, 1, d_conv), transposed) and
    `bias` (channels,) or None, both PyTorch-default initialized, U(+-1/sqrt(d_conv)), unless `kernel_bound`.

    Args:
      channels: number of independent channels.
      d_conv: kernel width.
      use_bias: whether there is a bias.
      kernel_bound: the kernel starts in U(-kernel_bound, kernel_bound) (mamba_ssm's `conv_init`; default:
        None, PyTorch's bound; the bias keeps PyTorch's).
      param_dtype: parameter dtype (default: float32).
      rngs: parameter initialization keys.
    """

    def __init__(self, channels: int, d_conv: int, *, use_bias: bool = True, kernel_bound: float | None = None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        # fan_in = (in_channels / groups) * d_conv = d_conv
        kernel_init, bias_init = torch_uniform(d_conv, kernel_bound), torch_uniform(d_conv)
        self.kernel = nnx.Param(kernel_init(rngs.params(), (d_conv, channels), param_dtype))
        self.bias = nnx.Param(bias_init(rngs.params(), (channels,), param_dtype)) if use_bias else nnx.data(None)
