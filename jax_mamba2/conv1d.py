"""The causal depthwise conv1d (+ SiLU) op of the Mamba-2 mixer: input checks, backend dispatch, custom VJP.

`causal_conv1d_silu` has the semantics of causal_conv1d's `causal_conv1d_fn` (channels-last, as in_proj
produces it) followed by SiLU, with `conv1d_reference.causal_conv1d` as the reference.
`causal_conv1d_silu_split` is the same conv on a channel window of a wider input, returned in pieces: the
mixer's in_proj output in, x, B and C out, with no copy between them on the kernel backends. Backends: "xla" (the
reference, differentiated by JAX), "cutile" (kernels/causal_conv1d*.py as XLA FFI custom calls) and
"cutile_callback" (the same kernels in one buffer callback). "auto" picks cutile on a supported GPU behind
`lax.platform_dependent` (so the program still lowers for CPU) and xla otherwise; a kernel backend asked
for by name never falls back.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_mamba2 import conv1d_reference

BACKENDS = ("auto", "cutile", "cutile_callback", "xla")
ACTIVATIONS = ("silu", None)
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
_API = "causal_conv1d_silu"
_SPLIT_API = "causal_conv1d_silu_split"
# The output pieces of `causal_conv1d_silu_split`, at most (the mixer's x, B, C; the kernels' outputs).
MAX_PIECES = 3


class ConvInputs(NamedTuple):
    """The array arguments of the op (None where absent); see `causal_conv1d_silu` for shapes."""

    x: jax.Array
    kernel: jax.Array
    bias: Optional[jax.Array]
    initial_states: Optional[jax.Array]
    seq_idx: Optional[jax.Array]


@dataclasses.dataclass(frozen=True)
class ConvStatic:
    """The static options of the op (hashable: a custom_vjp nondiff argument): the activation, and the
    channels of x convolved (offset .. offset + channels - 1) and the widths of the output pieces (split ():
    one output of all channels)."""

    silu: bool
    offset: int = 0
    split: tuple[int, ...] = ()


@functools.cache
def _kernel_backends() -> tuple[dict, Optional[str]]:
    """The cuTile backends (name -> bridge.conv_ops.ConvKernels) and why there are none, if so."""
    try:
        from jax_mamba2.bridge import conv_ops
    except ImportError as e:
        return {}, f"{e} (pip install 'jax-mamba2[cuda]')"
    return conv_ops.BACKENDS, None


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------

def _check_array(name, arr, want_desc, want):
    """`arr` is a floating array whose shape is one of `want`."""
    if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
        raise TypeError(f"{_API}: {name} must be an array, got {type(arr).__name__}")
    if tuple(arr.shape) not in want:
        raise ValueError(f"{_API}: {name}.shape={tuple(arr.shape)} must be {want_desc}="
                         f"{' or '.join(str(w) for w in want)}")
    if not any(arr.dtype == d for d in _FLOAT_DTYPES):
        raise TypeError(f"{_API}: {name}.dtype={arr.dtype} must be one of bfloat16, float16, float32, float64")


def _check_inputs(inputs: ConvInputs, activation, backend, return_final_states) -> None:
    x, kernel, bias, initial_states, seq_idx = inputs
    if not hasattr(x, "shape") or len(x.shape) != 3:
        raise ValueError(f"{_API}: x.shape={getattr(x, 'shape', None)} must be (batch, seqlen, channels)")
    batch, seqlen, channels = x.shape
    _check_array("x", x, "(batch, seqlen, channels)", [(batch, seqlen, channels)])
    if not hasattr(kernel, "shape") or len(kernel.shape) != 2 or kernel.shape[0] < 1:
        raise ValueError(f"{_API}: kernel.shape={getattr(kernel, 'shape', None)} must be (d_conv, channels) "
                         f"with d_conv >= 1 and channels={channels}")
    d_conv = kernel.shape[0]
    _check_array("kernel", kernel, "(d_conv, channels)", [(d_conv, channels)])
    if bias is not None:
        _check_array("bias", bias, "(channels,)", [(channels,)])
    if initial_states is not None:
        _check_array("initial_states", initial_states, "(batch, channels, d_conv - 1 or d_conv)",
                     [(batch, channels, d_conv - 1), (batch, channels, d_conv)])
    if seq_idx is not None:
        if not hasattr(seq_idx, "shape") or tuple(seq_idx.shape) != (batch, seqlen):
            raise ValueError(f"{_API}: seq_idx.shape={getattr(seq_idx, 'shape', None)} must be "
                             f"(batch, seqlen)={(batch, seqlen)}")
        if not jnp.issubdtype(seq_idx.dtype, jnp.integer):
            raise TypeError(f"{_API}: seq_idx.dtype={seq_idx.dtype} must be an integer dtype (int32)")
        if initial_states is not None:
            raise ValueError(f"{_API}: seq_idx and initial_states cannot be combined (as in causal_conv1d): "
                             f"the states would belong to no sequence")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_API}: activation={activation!r} must be 'silu' or None")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{_API}: backend={backend!r} must be one of {BACKENDS}")
    if not isinstance(return_final_states, bool):
        raise TypeError(f"{_API}: return_final_states={return_final_states!r} must be a bool")


# ----------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------

def _window(x, kernel, offset: int):
    """The channels of x that the conv reads."""
    return x if x.shape[-1] == kernel.shape[1] else x[..., offset:offset + kernel.shape[1]]


def _xla_conv(inputs: ConvInputs, static: ConvStatic):
    """The output pieces (a tuple) from the reference."""
    pre, _ = conv1d_reference.causal_conv1d(_window(inputs.x, inputs.kernel, static.offset), inputs.kernel,
                                            inputs.bias, inputs.initial_states, seq_idx=inputs.seq_idx,
                                            dtype=inputs.x.dtype)
    y = jax.nn.silu(pre) if static.silu else pre
    return tuple(jnp.split(y, list(itertools.accumulate(static.split[:-1])), axis=-1)) if static.split else (y,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _kernel_conv(kernels: Any, static: ConvStatic, inputs: ConvInputs):
    return kernels.forward(inputs, static.silu, static.offset, static.split)


def _kernel_conv_fwd(kernels, static, inputs):
    # The backward recomputes the pre-activation from x, which it reads anyway for dkernel.
    return kernels.forward(inputs, static.silu, static.offset, static.split), inputs


def _kernel_conv_bwd(kernels, static, inputs, dys):
    return (kernels.backward(inputs, static.silu, dys, static.offset, static.split),)


_kernel_conv.defvjp(_kernel_conv_fwd, _kernel_conv_bwd)


def _select_kernels(backend: str, inputs: ConvInputs):
    """The kernel backend to run (None: the xla reference), raising where a named one cannot run."""
    kernels, import_error = _kernel_backends()
    if backend == "xla":
        return None
    if backend == "auto":
        chosen = kernels.get("cutile")
        return chosen if chosen is not None and chosen.unsupported_reason(inputs) is None else None
    if backend not in kernels:
        raise ValueError(f"{_API}(backend={backend!r}) is unavailable: {import_error}")
    reason = kernels[backend].unsupported_reason(inputs)
    if reason is not None:
        raise ValueError(f"{_API}(backend={backend!r}) cannot run this call: {reason}")
    return kernels[backend]


def _apply(kernels, inputs: ConvInputs, static: ConvStatic, *, fallback: bool):
    """y from `kernels` (custom VJP), behind platform_dependent with the xla reference when `fallback`."""
    if kernels is None:
        return _xla_conv(inputs, static)
    if not fallback:
        return _kernel_conv(kernels, static, inputs)
    return jax.lax.platform_dependent(inputs, cuda=lambda inp: _kernel_conv(kernels, static, inp),
                                      default=lambda inp: _xla_conv(inp, static))


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
    _check_inputs(inputs, activation, backend, return_final_states)
    static = ConvStatic(silu=activation == "silu")
    kernels = _select_kernels(backend, inputs)
    if x.size == 0:
        y = jnp.zeros(x.shape, x.dtype)
    else:
        (y,) = _apply(kernels, inputs, static, fallback=backend == "auto")
    if not return_final_states:
        return y
    return y, conv1d_reference.final_conv_state(x, kernel.shape[0], initial_states)


def _check_layout(x, kernel, channel_offset, split) -> int:
    """The channel window and the pieces fit x and the kernel; returns the conv's channels."""
    if not hasattr(x, "shape") or len(x.shape) != 3:
        raise ValueError(f"{_SPLIT_API}: x.shape={getattr(x, 'shape', None)} must be (batch, seqlen, width)")
    if not hasattr(kernel, "shape") or len(kernel.shape) != 2 or kernel.shape[0] < 1:
        raise ValueError(f"{_SPLIT_API}: kernel.shape={getattr(kernel, 'shape', None)} must be (d_conv, channels) "
                         f"with d_conv >= 1")
    channels, width = kernel.shape[1], x.shape[-1]
    if not isinstance(channel_offset, int) or not 0 <= channel_offset <= width - channels:
        raise ValueError(f"{_SPLIT_API}: channel_offset={channel_offset!r} must be an int in [0, x.shape[-1] - "
                         f"channels]=[0, {width - channels}] (x.shape[-1]={width}, channels={channels})")
    if (not isinstance(split, tuple) or not 1 <= len(split) <= MAX_PIECES
            or not all(isinstance(w, int) and w >= 1 for w in split) or sum(split) != channels):
        raise ValueError(f"{_SPLIT_API}: split={split!r} must be a tuple of 1 to {MAX_PIECES} positive ints "
                         f"summing to channels={channels}")
    return channels


def causal_conv1d_silu_split(x, kernel, bias=None, *, channel_offset, split, seq_idx=None, initial_states=None,
                             activation="silu", return_final_states=False, backend="auto"):
    """`causal_conv1d_silu` of channels channel_offset .. channel_offset + channels - 1 of x, in pieces.

    The same conv as `causal_conv1d_silu(x[..., channel_offset:channel_offset + channels], ...)` split along
    the channels into pieces of the widths `split`. The kernel backends read the channels in place and write
    each piece as its own array (and their backward takes each piece's cotangent as it comes), so that
    in_proj's output feeds the conv, and the conv the SSD, without a slice, concatenate or split copy. The
    cotangent of x is zero outside the window.

    Args:
      x: (batch, seqlen, width), bf16/f16/f32/f64, channels-last (e.g. in_proj's [z, xBC, dt]).
      kernel: (d_conv, channels) float; bias: (channels,) float, optional.
      channel_offset: the first channel of x convolved (an int; 0 <= channel_offset <= width - channels).
        Offsets and widths that are multiples of 16 bytes keep the kernels' loads and stores vectorised.
      split: the widths of the output pieces, a tuple of 1 to MAX_PIECES positive ints summing to channels
        (e.g. (d_ssm, ngroups * d_state, ngroups * d_state)).
      seq_idx, initial_states, activation, backend: as in `causal_conv1d_silu` (initial_states over the
        conv's channels).
      return_final_states: also return the state after the sequence (batch, channels, d_conv).

    Returns:
      A tuple of len(split) arrays (batch, seqlen, split[i]) in x.dtype; with `return_final_states`, (pieces,
      final_states).

    Raises:
      ValueError / TypeError: on a wrong shape, dtype, layout or option, naming the argument, before any
        computation; ValueError when a named kernel backend cannot run the call, saying why.

    Example:
      >>> zxbcdt = jnp.ones((1, 8, 12)); kernel = jnp.full((4, 6), 0.25)
      >>> [p.shape for p in causal_conv1d_silu_split(zxbcdt, kernel, channel_offset=4, split=(4, 1, 1),
      ...                                            backend="xla")]
      [(1, 8, 4), (1, 8, 1), (1, 8, 1)]
    """
    channels = _check_layout(x, kernel, channel_offset, split)
    inputs = ConvInputs(x, kernel, bias, initial_states, seq_idx)
    # The remaining checks see the window's shape; x itself is checked for its dtype.
    _check_array("x", x, "(batch, seqlen, width)", [tuple(x.shape)])
    window = jax.ShapeDtypeStruct((*x.shape[:2], channels), x.dtype)
    _check_inputs(inputs._replace(x=window), activation, backend, return_final_states)
    static = ConvStatic(silu=activation == "silu", offset=channel_offset, split=split)
    kernels = _select_kernels(backend, inputs)
    if x.size == 0:
        pieces = tuple(jnp.zeros((*x.shape[:2], w), x.dtype) for w in split)
    else:
        pieces = _apply(kernels, inputs, static, fallback=backend == "auto")
    if not return_final_states:
        return pieces
    window = _window(x, kernel, channel_offset)
    return pieces, conv1d_reference.final_conv_state(window, kernel.shape[0], initial_states)
