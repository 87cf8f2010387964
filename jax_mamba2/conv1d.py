"""The causal depthwise conv1d (+ SiLU) op of the Mamba-2 mixer: input checks, backend dispatch, custom VJP.

`causal_conv1d_silu` has the semantics of causal_conv1d's `causal_conv1d_fn` (channels-last, as in_proj
produces it) followed by SiLU, with `conv1d_reference.causal_conv1d` as the reference.
`causal_conv1d_silu_split` is the same conv on a channel window of a wider input, returned in pieces: the
mixer's in_proj output in, x, B and C out, with no copy between them on the kernel backends. Backends are the
"causal_conv1d" entries of the registry in `jax_mamba2.backends`: "xla" (the reference, differentiated by JAX,
registered here), "cutile" (kernels/causal_conv1d*.py as XLA FFI custom calls) and "cutile_callback" (the same
kernels in one buffer callback), registered by the bridge. "auto" picks cutile on a supported GPU behind
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

from jax_mamba2 import backends as registry
from jax_mamba2 import conv1d_reference
from jax_mamba2.checks import (as_int, check_array, check_flag, check_int, check_ndim, check_seq_idx,
                               check_seq_idx_order)
from jax_mamba2.ssd_args import sequence_numbers

OP = "causal_conv1d"
# causal_conv1d's names: "swish" is SiLU's other name (mamba_ssm's Mamba2Simple passes it), None the conv alone.
ACTIVATIONS = ("silu", "swish", None)
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
    """The static options of the op (hashable: a custom_vjp nondiff argument): the activation, the channels
    of x convolved (offset .. offset + channels - 1), the widths of the output pieces (split (): one output
    of all channels), and whether x's channels outside the window are returned too (pass_through)."""

    silu: bool
    offset: int = 0
    split: tuple[int, ...] = ()
    pass_through: bool = False


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------

def _check_inputs(inputs: ConvInputs, activation, return_final_states, api: str = _API) -> None:
    x, kernel, bias, initial_states, seq_idx = inputs
    batch, seqlen, channels = check_ndim(api, "x", x, 3, "(batch, seqlen, channels)")
    check_array(api, "x", x)
    check_array(api, "kernel", kernel)
    if len(kernel.shape) != 2 or kernel.shape[0] < 1:
        raise ValueError(f"{api}: kernel.shape={getattr(kernel, 'shape', None)} must be (d_conv, channels) "
                         f"with d_conv >= 1 and channels={channels}")
    if kernel.shape[0] == channels != kernel.shape[1]:  # causal_conv1d's layout, (channels, d_conv)
        raise ValueError(f"{api}: kernel.shape={tuple(kernel.shape)} must be (d_conv, channels)="
                         f"{(kernel.shape[1], channels)}: causal_conv1d's (channels, d_conv) weight, transposed")
    d_conv = kernel.shape[0]
    check_array(api, "kernel", kernel, "(d_conv, channels)", (d_conv, channels))
    if bias is not None:
        check_array(api, "bias", bias, "(channels,)", (channels,))
    if initial_states is not None:
        check_array(api, "initial_states", initial_states, "(batch, channels, d_conv - 1 or d_conv)",
                    (batch, channels, d_conv - 1), (batch, channels, d_conv))
    if seq_idx is not None:
        check_seq_idx(api, seq_idx, batch, seqlen)
        check_seq_idx_order(api, seq_idx)
        if initial_states is not None:
            raise ValueError(f"{api}: seq_idx and initial_states cannot be combined (as in causal_conv1d): "
                             f"the states would belong to no sequence")
    if not (activation is None or (isinstance(activation, str) and activation in ACTIVATIONS)):
        raise ValueError(f"{api}: activation={activation!r} must be 'silu', 'swish' (the same) or None")
    check_flag(api, "return_final_states", return_final_states)


# ----------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------

def _without_empty_states(inputs: ConvInputs) -> ConvInputs:
    """`inputs` without initial_states of no columns (d_conv 1 in the d_conv - 1 form): they hold no column to
    read, and the kernels' plans take a state of width 0 for none (a (1, 1, 1) dummy in its place, no gradient
    written for it), so every backend runs the call as one without states. The op's final states still come from
    the states it was given (in their dtype)."""
    init = inputs.initial_states
    return inputs._replace(initial_states=None) if init is not None and init.shape[-1] == 0 else inputs


def _numbered(inputs: ConvInputs) -> ConvInputs:
    """`inputs` with seq_idx as the numbers of its runs of one id (`ssd_args.sequence_numbers`), as the SSD takes
    them: a tap reads only its own run, also where a traced seq_idx (unchecked) decreases and an id comes back,
    and ids int32 cannot hold never reach the kernels."""
    if inputs.seq_idx is None:
        return inputs
    return inputs._replace(seq_idx=sequence_numbers(inputs.seq_idx))


def _window(x, kernel, offset: int):
    """The channels of x that the conv reads."""
    return x if x.shape[-1] == kernel.shape[1] else x[..., offset:offset + kernel.shape[1]]


def _outputs(x, static: ConvStatic, channels: int, pieces: tuple) -> tuple:
    """The op's outputs: the pieces, with pass_through between x's channels before and after the window."""
    if not static.pass_through:
        return pieces
    return (x[..., :static.offset], *pieces, x[..., static.offset + channels:])


def _xla_conv(inputs: ConvInputs, static: ConvStatic):
    """The outputs (a tuple) from the reference."""
    pre, _ = conv1d_reference.causal_conv1d(_window(inputs.x, inputs.kernel, static.offset), inputs.kernel,
                                            inputs.bias, inputs.initial_states, seq_idx=inputs.seq_idx,
                                            dtype=inputs.x.dtype)
    y = jax.nn.silu(pre) if static.silu else pre
    pieces = tuple(jnp.split(y, list(itertools.accumulate(static.split[:-1])), axis=-1)) if static.split else (y,)
    return _outputs(inputs.x, static, inputs.kernel.shape[1], pieces)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _kernel_conv(kernels: Any, static: ConvStatic, inputs: ConvInputs):
    return kernels.forward(inputs, static)


def _kernel_conv_fwd(kernels, static, inputs):
    # The backward recomputes the pre-activation from x, which it reads anyway for dkernel.
    return kernels.forward(inputs, static), inputs


def _kernel_conv_bwd(kernels, static, inputs, dys):
    return (kernels.backward(inputs, static, dys),)


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
    float32 (float64 for float64 x): x and initial_states enter it rounded to x's dtype, kernel and bias as they
    are, not rounded to x's dtype (converted to the sum's dtype, exactly where they are no wider), as
    causal_conv1d's kernels take the weight in its own dtype; y is rounded to x's dtype once (the xla backend
    also rounds the pre-activation before the SiLU). Differentiable in x, kernel, bias and initial_states, each
    gradient in its argument's dtype (the cutile backends run cuTile backward kernels, deterministic); composes
    with jit, vmap, shard_map and remat.

    Args:
      x: (batch, seqlen, channels), bf16/f16/f32/f64, channels-last.
      kernel: (d_conv, channels) float (mamba_ssm's conv1d.weight (channels, 1, d_conv) transposed).
      bias: (channels,) float, optional.
      seq_idx: (batch, seqlen) int32, optional ids of packed sequences: a tap never reads a token of another
        sequence (it reads zero instead); a sequence is a run of one id, as for `ssd`. Not combinable with
        initial_states.
      initial_states: (batch, channels, d_conv - 1) or (batch, channels, d_conv) float, optional: the input
        columns before x (a decode cache's conv_state); only the last d_conv - 1 are read.
      activation: "silu" (or "swish", its other name in causal_conv1d) or None (the convolution alone).
      return_final_states: also return the state after the sequence.
      backend: "auto", "cutile", "cutile_callback" or "xla".

    Returns:
      y (batch, seqlen, channels) in x.dtype; with `return_final_states` also final_states
      (batch, channels, d_conv): the last d_conv columns of x left-extended by initial_states (or zeros), in
      initial_states' dtype (x's without them; initial_states' columns carried over unrounded); with seq_idx,
      those of tokens before each row's last sequence zero (the state of that sequence alone, as the decode cache
      needs it).

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
    inputs = _numbered(_without_empty_states(inputs))
    static = ConvStatic(silu=activation is not None)  # "silu" or "swish"
    selected = registry.select(backend, _API, lambda b: b.unsupported_reason(inputs), op=OP)
    if x.size == 0:
        y = jnp.zeros(x.shape, x.dtype)
    else:
        (y,) = registry.run_compiled(tuple(selected), _run, static, inputs)
    if not return_final_states:
        return y
    return y, conv1d_reference.final_conv_state(x, kernel.shape[0], initial_states, inputs.seq_idx)


def _check_layout(x, kernel, channel_offset, split) -> tuple[int, int, tuple[int, ...]]:
    """The channel window and the pieces fit x and the kernel; returns the conv's channels, and channel_offset and
    split as Python ints (static data)."""
    check_array(_SPLIT_API, "x", x)
    check_array(_SPLIT_API, "kernel", kernel)
    if len(x.shape) != 3:
        raise ValueError(f"{_SPLIT_API}: x.shape={tuple(x.shape)} must be (batch, seqlen, width)")
    if len(kernel.shape) != 2 or kernel.shape[0] < 1:
        raise ValueError(f"{_SPLIT_API}: kernel.shape={tuple(kernel.shape)} must be (d_conv, channels) "
                         f"with d_conv >= 1")
    channels, width = kernel.shape[1], x.shape[-1]
    if channels > width:  # no channel_offset could place the window: the kernel is what does not fit
        raise ValueError(f"{_SPLIT_API}: kernel.shape={tuple(kernel.shape)} must be (d_conv, channels) with channels "
                         f"<= x.shape[-1]={width} (a window of x's channels)")
    requirement = (f"an int in [0, x.shape[-1] - channels]=[0, {width - channels}] (x.shape[-1]={width}, "
                   f"channels={channels})")
    check_int(_SPLIT_API, "channel_offset", channel_offset, requirement, minimum=0, maximum=width - channels)
    requirement = f"a tuple of 1 to {MAX_PIECES} positive ints summing to channels={channels}"
    widths = tuple(as_int(w) for w in split) if isinstance(split, tuple) else (None,)
    if None in widths:
        raise TypeError(f"{_SPLIT_API}: split={split!r} must be {requirement}")
    if not 1 <= len(widths) <= MAX_PIECES or not all(w >= 1 for w in widths) or sum(widths) != channels:
        raise ValueError(f"{_SPLIT_API}: split={split!r} must be {requirement}")
    return channels, int(channel_offset), widths


def causal_conv1d_silu_split(x, kernel, bias=None, *, channel_offset, split, seq_idx=None, initial_states=None,
                             activation="silu", return_final_states=False, pass_through=False, backend="auto"):
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
      pass_through: also return x's channels outside the window, unchanged, before and after the pieces. The
        outputs then cover all of x: the kernel forward copies those channels out in the same launch (no XLA
        slice of x), and the kernel backward writes x's whole cotangent in its one pass (the cotangents of the
        passed-through channels copied in) where XLA would pad the pieces' and add them. The mixer passes
        in_proj's z and dt columns through, so in_proj's output is read and its cotangent written by the
        conv's launches alone.

    Returns:
      A tuple of len(split) arrays (batch, seqlen, split[i]) in x.dtype (with `pass_through` len(split) + 2:
      x[..., :channel_offset] first and x[..., channel_offset + channels:] last, either of width 0 where
      the window touches that end); with `return_final_states`, (pieces, final_states).

    Raises:
      ValueError / TypeError: on a wrong shape, dtype, layout or option, naming the argument, before any
        computation; ValueError when a named kernel backend cannot run the call, saying why.

    Example:
      >>> zxbcdt = jnp.ones((1, 8, 12)); kernel = jnp.full((4, 6), 0.25)
      >>> [p.shape for p in causal_conv1d_silu_split(zxbcdt, kernel, channel_offset=4, split=(4, 1, 1),
      ...                                            backend="xla")]
      [(1, 8, 4), (1, 8, 1), (1, 8, 1)]
    """
    channels, channel_offset, split = _check_layout(x, kernel, channel_offset, split)
    inputs = ConvInputs(x, kernel, bias, initial_states, seq_idx)
    # The remaining checks see the window's shape; x itself is checked for its dtype.
    check_array(_SPLIT_API, "x", x)
    window = jax.ShapeDtypeStruct((*x.shape[:2], channels), x.dtype)
    _check_inputs(inputs._replace(x=window), activation, return_final_states, _SPLIT_API)
    inputs = _numbered(_without_empty_states(inputs))
    pass_through = check_flag(_SPLIT_API, "pass_through", pass_through)
    static = ConvStatic(silu=activation is not None, offset=channel_offset, split=split,  # "silu" or "swish"
                        pass_through=pass_through)
    selected = registry.select(backend, _SPLIT_API, lambda b: b.unsupported_reason(inputs), op=OP)
    if x.size == 0:
        pieces = _outputs(x, static, channels, tuple(jnp.zeros((*x.shape[:2], w), x.dtype) for w in split))
    else:
        pieces = registry.run_compiled(tuple(selected), _run, static, inputs)
    if not return_final_states:
        return pieces
    window = _window(x, kernel, channel_offset)
    return pieces, conv1d_reference.final_conv_state(window, kernel.shape[0], initial_states, inputs.seq_idx)
