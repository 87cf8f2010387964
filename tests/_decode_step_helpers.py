"""Random fused-decode-step problems (`jax_mamba2.mamba2_decode_step`) and their float64 reference, shared by the
emulator, op and GPU tests."""
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_mamba2 import decode_step
from tests._helpers import to_float64


def make_decode_args(seed, *, batch=3, nheads=4, headdim=16, ngroups=1, dstate=16, d_conv=4, d_mlp=0,
                     dtype=jnp.float32, param_dtype=jnp.float32, state_dtype=jnp.float32, conv_bias=True,
                     D="head", dt_bias=True, rmsnorm=True, norm_before_gate=False, dt_limit=(0.0, math.inf)):
    """(args, kwargs) of `mamba2_decode_step` with fresh random values (never zeros): zxbcdt in `dtype`, the
    states in `state_dtype`, the parameters in `param_dtype` (A_log float32 as the layer stores it in f32
    models, else param_dtype). D: None | "head" | "headdim"."""
    d_ssm = nheads * headdim
    conv_dim = d_ssm + 2 * ngroups * dstate
    keys = jax.random.split(jax.random.PRNGKey(seed), 10)

    def normal(key, shape, dt, scale=1.0):
        return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dt)

    zxbcdt = normal(keys[0], (batch, 2 * d_mlp + d_ssm + conv_dim + nheads), dtype)
    conv_state = normal(keys[1], (batch, conv_dim, d_conv), state_dtype)
    ssm_state = normal(keys[2], (batch, nheads, headdim, dstate), state_dtype)
    conv_weight = normal(keys[3], (d_conv, conv_dim), param_dtype, 1 / np.sqrt(d_conv))
    A_log = jax.random.uniform(keys[4], (nheads,), jnp.float32, -1.0, 1.5).astype(param_dtype)
    kwargs = dict(norm_before_gate=norm_before_gate, dt_limit=dt_limit)
    if conv_bias:
        kwargs["conv_bias"] = normal(keys[5], (conv_dim,), param_dtype, 0.5)
    if D is not None:
        kwargs["D"] = normal(keys[6], (nheads,) if D == "head" else (nheads, headdim), param_dtype)
    if dt_bias:
        kwargs["dt_bias"] = jax.random.uniform(keys[7], (nheads,), jnp.float32, -4.0, -1.0).astype(param_dtype)
    if rmsnorm:
        kwargs["norm_weight"] = (1.0 + normal(keys[8], (d_ssm,), jnp.float32, 0.2)).astype(param_dtype)
    return (zxbcdt, conv_state, ssm_state, conv_weight, A_log), kwargs


def float64_reference(args, kwargs):
    """(y, new conv_state, new ssm_state) of the composed step (conv1d_reference, reference.ssd_step,
    norm_reference) on the arguments cast to float64, as NumPy arrays."""
    with jax.enable_x64(True):
        args, kwargs = to_float64((args, kwargs))
        return tuple(np.asarray(a) for a in decode_step.mamba2_decode_step(*args, **kwargs, backend="xla"))
