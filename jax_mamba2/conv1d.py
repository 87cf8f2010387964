"""The causal depthwise conv1d (+ SiLU) op of the Mamba-2 mixer: input checks, backend dispatch, custom VJP.

`causal_conv1d_silu` has the semantics of causal_conv1d's `causal_conv1d_fn` (channels-last, as in_proj
produces it) followed by SiLU, with `conv1d_reference.causal_conv1d` as the reference. Backends are the
"causal_conv1d" entries of the registry in `jax_mamba2.backends`: "xla" (the reference, differentiated by JAX,
registered here), "cutile" (kernels/causal_conv1d*.py as XLA FFI custom calls) and "cutile_callback" (the same
kernels in one buffer callback), registered by the bridge. "auto" picks cutile on a supported GPU behind
`lax.platform_dependent` (so the program still lowers for CPU) and xla otherwise; a kernel backend asked
for by name never falls back.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_mamba2 import backends as registry
from jax_mamba2 import conv1d_reference
from jax_mamba2.checks import check_array, check_flag, check_ndim, check_seq_idx

OP = "causal_conv1d"
ACTIVATIONS = ("silu", None)
_API = "causal_conv1d_silu"


class ConvInputs(NamedTuple):
    """The array arguments of the op (None where absent); see `causal_conv1d_silu` for shapes."""

    x: jax.Array
    kernel: jax.Array
    bias: Optional[jax.Array]
    initial_states: Optional[jax.Array]
    seq_idx: Optional[jax.Array]


@dataclasses.dataclass(frozen=True)
class ConvStatic:
    """The static options of the op (hashable: a custom_vjp nondiff argument)."""

    silu: bool


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------

def _check_inputs(inputs: ConvInputs, activation, return_final_states) -> None:
    x, kernel, bias, initial_states, seq_idx = inputs
    batch, seqlen, channels = check_ndim(_API, "x", x, 3, "(batch, seqlen, channels)")
    check_array(_API, "x", x)
    if not hasattr(kernel, "shape") or len(kernel.shape) != 2 or kernel.shape[0] < 1:
        raise ValueError(f"{_API}: kernel.shape={getattr(kernel, 'shape', None)} must be (d_conv, channels) "
                         f"with d_conv >= 1 and channels={channels}")
    d_conv = kernel.shape[0]
    check_array(_API, "kernel", kernel, "(d_conv, channels)", (d_conv, channels))
    if bias is not None:
        check_array(_API, "bias", bias, "(channels,)", (channels,))
    if initial_states is not None:
        check_array(_API, "initial_states", initial_states, "(batch, channels, d_conv - 1 or d_conv)",
                    (batch, channels, d_conv - 1), (batch, channels, d_conv))
    if seq_idx is not None:
        check_seq_idx(_API, seq_idx, batch, seqlen)
        if initial_states is not None:
            raise ValueError(f"{_API}: seq_idx and initial_states cannot be combined (as in causal_conv1d): "
                             f"the states would belong to no sequence")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_API}: activation={activation!r} must be 'silu' or None")
    check_flag(_API, "return_final_states", return_final_states)


# ----------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------

def _xla_conv(inputs: ConvInputs, static: ConvStatic):
    pre, _ = conv1d_reference.causal_conv1d(inputs.x, inputs.kernel, inputs.bias, inputs.initial_states,
                                            seq_idx=inputs.seq_idx, dtype=inputs.x.dtype)
    return jax.nn.silu(pre) if static.silu else pre


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _kernel_conv(kernels: Any, static: ConvStatic, inputs: ConvInputs):
    return kernels.forward(inputs, static.silu)


def _kernel_conv_fwd(kernels, static, inputs):
    # The backward recomputes the pre-activation from x, which it reads anyway for dkernel.
    return kernels.forward(inputs, static.silu), inputs


def _kernel_conv_bwd(kernels, static, inputs, dy):
    return (kernels.backward(inputs, static.silu, dy),)


_kernel_conv.defvjp(_kernel_conv_fwd, _kernel_conv_bwd)

registry.register_backend(registry.LayerBackend("xla", None, registry.always_supported), op=OP)


def _run(backend: registry.LayerBackend, inputs: ConvInputs, static: ConvStatic):
    if backend.kernels is None:
        return _xla_conv(inputs, static)
    return _kernel_conv(backend.kernels, static, inputs)


def causal_conv1d_silu(x, kernel, bias=None, *, seq_idx=None, initial_states=None, activation="silu",
                       return_final_states=False, backend="auto"):
    """Causal depthwise conv1d over the sequence, then SiLU: causal_conv1d's `causal_conv1d_fn`.

        y[b, t, c] = silu(bias[c] + Σ_{k < d_conv} kernel[k, c] · x[b, t - d_conv + 1 + k, c])

    x is left-padded by the last d_conv - 1 columns of `initial_states` (zeros without them). The sum runs in
    float32 (float64 for float64 x) on operands rounded to x's dtype, and y is rounded to x's dtype once
    (the xla backend rounds the pre-activation before the SiLU, as the layer did). Differentiable in x,
    kernel, bias and initial_states (the cutile backends run cuTile backward kernels, deterministic); composes
    with jit, vmap, shard_map and remat.

    Args:
      x: (batch, seqlen, channels), bf16/f16/f32/f64, channels-last.
      kernel: (d_conv, channels) float (mamba_ssm's conv1d.weight (channels, 1, d_conv) transposed).
      bias: (channels,) float, optional.
      seq_idx: (batch, seqlen) int32, optional ids of packed sequences: a tap never reads a token of another
        sequence (it reads zero instead). Not combinable with initial_states.
      initial_states: (batch, channels, d_conv - 1) or (batch, channels, d_conv) float, optional: the input
        columns before x (a decode cache's conv_state); only the last d_conv - 1 are read.
      activation: "silu" or None (the convolution alone).
      return_final_states: also return the state after the sequence.
      backend: "auto", "cutile", "cutile_callback" or "xla".

    Returns:
      y (batch, seqlen, channels) in x.dtype; with `return_final_states` also final_states
      (batch, channels, d_conv): the last d_conv columns of x left-extended by initial_states (or zeros), in
      initial_states' dtype (x's without them).

    Raises:
      ValueError / TypeError: on a wrong shape, dtype or option, naming the argument, before any
        computation; ValueError when a named kernel backend cannot run the call, saying why.

    Example:
      >>> x = jnp.ones((1, 8, 4)); kernel = jnp.full((4, 4), 0.25)
      >>> causal_conv1d_silu(x, kernel, backend="xla").shape
      (1, 8, 4)
    """
    inputs = ConvInputs(x, kernel, bias, initial_states, seq_idx)
    _check_inputs(inputs, activation, return_final_states)
    static = ConvStatic(silu=activation == "silu")
    selected = registry.select(backend, _API, lambda b: b.unsupported_reason(inputs), op=OP)
    if x.size == 0:
        y = jnp.zeros(x.shape, x.dtype)
    else:
        y = registry.run_selected(selected, lambda b, inp: _run(b, inp, static), inputs)
    if not return_final_states:
        return y
    return y, conv1d_reference.final_conv_state(x, kernel.shape[0], initial_states)
