"""Inputs and the float64 oracle of the fused Mamba2 decode step (jax_mamba2.decode_step), shared by its tests."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_mamba2 import decode_step
from tests._helpers import to_float64


def make_decode_args(seed, *, batch=2, nheads=4, headdim=16, ngroups=2, dstate=16, d_conv=4, dtype=jnp.float32,
                     state_dtype=jnp.float32, D="head", conv_bias=True, rmsnorm=True, norm_before_gate=False,
                     dt_limit=(0.0, math.inf)):
    """Random operands of `mamba2_decode_step`: (positional arrays, keyword arrays (None where absent),
    static options).

    D: None | "head" | "headdim". Raw dt ~ U(-3, 1) (softplus on), A = -exp(U(-2, 1)), norm weight ~ U(0.5, 1.5);
    the rest standard normal (the conv weight scaled by 1/2). z, xBC and dt in `dtype`, both states in
    `state_dtype`, the parameters float32. Drawn with NumPy: no JAX program to compile per shape.
    """
    rng = np.random.default_rng(seed)
    d_ssm = nheads * headdim
    conv_dim = d_ssm + 2 * ngroups * dstate

    def array(values, dt=np.float32):
        return jnp.asarray(np.asarray(values, np.float32).astype(jnp.dtype(dt)))

    def normal(shape, dt=np.float32):
        return array(rng.standard_normal(shape), dt)

    args = (normal((batch, d_ssm), dtype), normal((batch, conv_dim), dtype),
            array(rng.uniform(-3.0, 1.0, (batch, nheads)), dtype), normal((batch, conv_dim, d_conv), state_dtype),
            normal((batch, nheads, headdim, dstate), state_dtype), array(0.5 * rng.standard_normal((d_conv, conv_dim))),
            array(-np.exp(rng.uniform(-2.0, 1.0, nheads))))
    kwargs = dict(
        conv_bias=normal((conv_dim,)) if conv_bias else None,
        D=None if D is None else normal((nheads,) if D == "head" else (nheads, headdim)),
        dt_bias=array(rng.uniform(-0.5, 0.5, nheads)),
        norm_weight=array(rng.uniform(0.5, 1.5, d_ssm)) if rmsnorm else None)
    return args, kwargs, dict(norm_before_gate=norm_before_gate, dt_limit=dt_limit)


def decode_step_float64(args, kwargs, options):
    """The xla path (the composition of the reference pieces) in float64 -> (y, conv_state, ssm_state), NumPy."""
    with jax.enable_x64(True):
        step = jax.jit(lambda a, k: decode_step.mamba2_decode_step(*to_float64(a), **to_float64(k), **options,
                                                                   backend="xla"))
        return tuple(np.asarray(out) for out in step(args, kwargs))


def decode_through_layer_scan(backend, args, kwargs, options, *, layers=3, tokens=3, seed=4):
    """Tokens x layers as the LM decodes, jitted: a lax.scan over stacked layers (per-layer random conv and SSM
    states and conv weights) inside a loop over tokens, each layer's y feeding the next one's xBC.
    -> (y of the last layer per token (tokens, batch, d_ssm), conv states, SSM states)."""
    rng = np.random.default_rng(seed)
    conv_states, ssm_states, weights = (jnp.asarray(scale * rng.standard_normal((layers, *a.shape)), np.float32)
                                        for a, scale in ((args[3], 1.0), (args[4], 1.0), (args[5], 0.5)))
    z, xBC, dt = args[:3]

    def decode(conv_states, ssm_states):
        outs = []
        for t in range(tokens):
            def layer(carry, per_layer):
                conv_state, ssm_state, weight = per_layer
                y, conv_state, ssm_state = decode_step.mamba2_decode_step(
                    z, carry, dt + 0.1 * t, conv_state, ssm_state, weight, args[6], **kwargs, **options,
                    backend=backend)
                return carry.at[:, :y.shape[1]].set(y), (conv_state, ssm_state)
            y, (conv_states, ssm_states) = jax.lax.scan(layer, xBC, (conv_states, ssm_states, weights))
            outs.append(y)
        return jnp.stack(outs), conv_states, ssm_states

    return jax.jit(decode)(conv_states, ssm_states)
