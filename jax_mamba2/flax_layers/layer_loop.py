"""The LM's loop over its stacked blocks, with the backward's residuals stacked in buffers nothing fills first.

Differentiating `lax.scan` (or `nnx.scan`) over the layers stacks each layer's residuals, what its backward
reads, into (n_layer, ...) buffers that the scan creates filled with zeros before its loop overwrites every
slot: at d_model 1024, 24 layers and 8 x 2048 tokens, gigabytes of zeros written each step for nothing.
`scan_blocks` runs the same blocks under a custom VJP whose forward loop creates those buffers unfilled (on a
process with one device; see `_unfilled`) and writes each layer's residuals into its slot, and whose backward
loop rebuilds each layer's pullback from its slot. The residuals are those of the block's own `jax.vjp` (so a
`jax.checkpoint` policy around the block applies), less the ones that are the layer's parameters, which are
read where they already lie. Unlike `lax.scan`, which keeps one copy of a residual that no layer changes (e.g. a
mask the block derives from `seq_idx`), the loop stacks it per layer: on the xla path a few percent more
activation memory, on the cuTile kernels' path none such.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_mamba2._vma import match_varying_axes

_LAYER, _STACKED = "layer", "stacked"


class _Layout(NamedTuple):
    """Where each leaf of a layer's pullback comes from: (kind, index) per leaf, and the pullback's structure."""
    treedef: object
    sources: tuple


def lax_scan_blocks(apply: Callable, stacked, carry, *operands):
    """`scan_blocks`' loop as `lax.scan` runs and differentiates it (its stacks of residuals created as zeros)."""
    return lax.scan(lambda c, layer: (apply(layer, c, *operands), None), carry, stacked)[0]


def _leading_length(stacked) -> int:
    lengths = {leaf.shape[0] for leaf in jax.tree.leaves(stacked)}
    if len(lengths) != 1:
        raise ValueError(f"scan_blocks: the stacked parameters' leading axes {sorted(lengths)} must be one length")
    return lengths.pop()


def _unfilled(like, shape):
    """A buffer of `shape`, `like`'s dtype and shard_map varying axes, whose every slot the loop writes before
    anything reads it. On a process with one device it is `lax.empty` (on GPU an XLA allocation without a fill),
    unbatched under vmap as zeros would be (`lax.empty`'s own batching rule batches it, which forward-over-reverse
    differentiation rejects; vmap batches the buffer where a batched value is written into it); elsewhere zeros:
    the loop leaves an allocation's sharding to XLA's propagation, which a partitioned program has not been checked
    with (JAX's own scan keeps zeros until "AllocateBuffer issues are fixed", its loops.py says)."""
    if jax.device_count() == 1:
        @jax.custom_batching.custom_vmap
        def empty(token):
            del token
            return lax.empty(shape, like.dtype)

        @empty.def_vmap
        def empty_unbatched(axis_size, in_batched, token):
            del axis_size, in_batched, token
            return lax.empty(shape, like.dtype), False

        buffer = empty(jnp.zeros((), jnp.int8))
    else:
        buffer = jnp.zeros(shape, like.dtype)
    return match_varying_axes(buffer, like)


def _layer(stacked, index):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False), stacked)


def _classify(pullback, layer_leaves) -> tuple[_Layout, list]:
    """The layout of `pullback`'s leaves, and the leaves to stack (in order): every leaf but the layer's
    parameters, which the backward reads where they lie."""
    leaves, treedef = jax.tree.flatten(pullback)
    sources, to_stack = [], []
    for leaf in leaves:
        layer_at = next((k for k, p in enumerate(layer_leaves) if leaf is p), None)
        if layer_at is not None:
            sources.append((_LAYER, layer_at))
        else:
            sources.append((_STACKED, len(to_stack)))
            to_stack.append(leaf)
    return _Layout(treedef, tuple(sources)), to_stack


def _check_operands(operands) -> None:
    for leaf in jax.tree.leaves(operands):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.integer):
            raise TypeError(f"scan_blocks: operands are not differentiated, so they must be integer arrays (such as "
                            f"seq_idx); got {jnp.result_type(leaf)}: close over a float value or carry it instead")


def scan_blocks(apply: Callable, stacked, carry, *operands):
    """`carry` after `apply(layer, carry, *operands)` for each layer of `stacked` in turn.

    Args:
      apply: a pure function (layer's parameters, carry, *operands) -> carry of the same structure and dtypes.
        It must not close over a value being differentiated (pass it in `stacked` or `carry`).
      stacked: a pytree of float arrays with a common leading (n_layer,) axis, the layers' parameters.
      carry: a pytree of float arrays, the loop's state (for the LM: the hidden states and the residual stream).
      operands: integer arrays (or None) every layer reads, e.g. seq_idx; not differentiated.

    Returns:
      The final carry. Differentiable in `stacked` and `carry` (reverse mode), as `lax_scan_blocks` is, with
      the same values.

    Raises:
      ValueError: for stacked leaves of different lengths. TypeError: for an operand that is not an integer array.
    """
    length = _leading_length(stacked)
    _check_operands(operands)
    traced = {}  # the layout of a layer's pullback, from the forward's trace, for the backward's

    @jax.custom_vjp
    def run(stacked, carry, operands):
        return lax_scan_blocks(apply, stacked, carry, *operands)

    def forward(stacked, carry, operands):
        def layer_vjp(index, carry):
            layer = _layer(stacked, index)
            carry, pullback = jax.vjp(lambda layer, carry: apply(layer, carry, *operands), layer, carry)
            traced["layout"], to_stack = _classify(pullback, jax.tree.leaves(layer))
            return carry, to_stack

        def step(index, state):
            carry, stacks = state
            carry, to_stack = layer_vjp(index, carry)
            return carry, [lax.dynamic_update_index_in_dim(s, v, index, 0)
                           for s, v in zip(stacks, to_stack, strict=True)]

        residuals = jax.eval_shape(lambda carry: layer_vjp(0, carry)[1], carry)
        stacks = [_unfilled(r, (length, *r.shape)) for r in residuals]
        carry, stacks = lax.fori_loop(0, length, step, (carry, stacks))
        return carry, (stacked, stacks)

    def backward(residuals, carry_cotangent):
        stacked, stacks = residuals
        layout = traced["layout"]  # the forward of this call was traced first, as a custom VJP's always is

        def step(k, state):
            cotangent, grads = state
            index = length - 1 - k
            sources = {_LAYER: jax.tree.leaves(_layer(stacked, index)),
                       _STACKED: [lax.dynamic_index_in_dim(s, index, keepdims=False) for s in stacks]}
            pullback = jax.tree.unflatten(layout.treedef, [sources[kind][at] for kind, at in layout.sources])
            layer_grads, cotangent = pullback(cotangent)
            grads = jax.tree.map(lambda g, v: lax.dynamic_update_index_in_dim(g, v.astype(g.dtype), index, 0),
                                 grads, layer_grads)
            return cotangent, grads

        grads = jax.tree.map(lambda a: _unfilled(a, a.shape), stacked)
        carry_cotangent, grads = lax.fori_loop(0, length, step, (carry_cotangent, grads))
        return grads, carry_cotangent, None

    run.defvjp(forward, backward)
    return run(stacked, carry, operands)
