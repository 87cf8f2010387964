"""The LM's loop over its stacked blocks, with the backward's residuals stacked in buffers nothing fills first.

Differentiating `lax.scan` (or `nnx.scan`) over the layers stacks each layer's residuals, what its backward
reads, into (n_layer, ...) buffers that the scan creates filled with zeros before its loop overwrites every
slot: at d_model 1024, 24 layers and 8 x 2048 tokens, gigabytes of zeros written each step for nothing.
`scan_blocks` runs the same blocks under a custom VJP whose forward loop creates those buffers unfilled and
writes each layer's residuals into its slot, and whose backward loop rebuilds each layer's pullback from its
slot. The residuals are those of the block's own `jax.vjp` (so a `jax.checkpoint` policy around the block
applies), less the ones that are the layer's parameters or the loop's operands, which are read where they
already lie.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_LAYER, _OPERAND, _STACKED, _CONSTANT = "layer", "operand", "stacked", "constant"


class _Layout(NamedTuple):
    """Where each leaf of a layer's pullback comes from: (kind, index) per leaf, and the pullback's structure."""
    treedef: object
    sources: tuple
    constants: tuple


def _leading_length(stacked) -> int:
    lengths = {leaf.shape[0] for leaf in jax.tree.leaves(stacked)}
    if len(lengths) != 1:
        raise ValueError(f"scan_blocks: the stacked parameters' leading axes {sorted(lengths)} must be one length")
    return lengths.pop()


def _unfilled(shape, dtype):
    """A buffer whose every slot the loop writes before anything reads it: on a process with one device
    `lax.empty` (on GPU an XLA allocation without a fill), elsewhere zeros, since an allocation carries no
    sharding of its own for a partitioned program to follow."""
    return lax.empty(shape, dtype) if jax.device_count() == 1 else jnp.zeros(shape, dtype)


def _layer(stacked, index):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False), stacked)


def _classify(pullback, layer_leaves, operand_leaves) -> tuple[_Layout, list]:
    """The layout of `pullback`'s leaves, and the leaves to stack (in order)."""
    leaves, treedef = jax.tree.flatten(pullback)
    sources, constants, to_stack = [], [], []
    for leaf in leaves:
        layer_at = next((k for k, p in enumerate(layer_leaves) if leaf is p), None)
        operand_at = next((k for k, p in enumerate(operand_leaves) if leaf is p), None)
        if layer_at is not None:
            sources.append((_LAYER, layer_at))
        elif operand_at is not None:
            sources.append((_OPERAND, operand_at))
        elif isinstance(leaf, jax.core.Tracer):
            sources.append((_STACKED, len(to_stack)))
            to_stack.append(leaf)
        else:  # a concrete value the trace folded in: the same for every layer
            sources.append((_CONSTANT, len(constants)))
            constants.append(leaf)
    return _Layout(treedef, tuple(sources), tuple(constants)), to_stack


def scan_blocks(apply: Callable, stacked, carry, *operands):
    """`carry` after `apply(layer, carry, *operands)` for each layer of `stacked` in turn.

    Args:
      apply: a pure function (layer's parameters, carry, *operands) -> carry of the same structure and dtypes.
      stacked: a pytree of float arrays with a common leading (n_layer,) axis, the layers' parameters.
      carry: a pytree of float arrays, the loop's state (for the LM: the hidden states and the residual stream).
      operands: arrays every layer reads (e.g. seq_idx); not differentiated.

    Returns:
      The final carry. Differentiable in `stacked` and `carry` (reverse mode), as `lax.scan` of `apply` is.
    """
    length = _leading_length(stacked)
    traced = {}  # the layout of a layer's pullback, from the forward's trace, for the backward's

    @jax.custom_vjp
    def run(stacked, carry, operands):
        return lax.scan(lambda c, layer: (apply(layer, c, *operands), None), carry, stacked)[0]

    def forward(stacked, carry, operands):
        def layer_vjp(index, carry):
            layer = _layer(stacked, index)
            carry, pullback = jax.vjp(lambda layer, carry: apply(layer, carry, *operands), layer, carry)
            traced["layout"], to_stack = _classify(pullback, jax.tree.leaves(layer), jax.tree.leaves(operands))
            return carry, to_stack

        def step(index, state):
            carry, stacks = state
            carry, to_stack = layer_vjp(index, carry)
            return carry, [lax.dynamic_update_index_in_dim(s, v, index, 0) for s, v in zip(stacks, to_stack)]

        shapes = jax.eval_shape(lambda carry: layer_vjp(0, carry)[1], carry)
        stacks = [_unfilled((length, *r.shape), r.dtype) for r in shapes]
        carry, stacks = lax.fori_loop(0, length, step, (carry, stacks))
        return carry, (stacked, stacks, operands)

    def backward(residuals, carry_cotangent):
        stacked, stacks, operands = residuals
        layout = traced["layout"]  # the forward of this call was traced first, as a custom VJP's always is

        def step(k, state):
            cotangent, grads = state
            index = length - 1 - k
            sources = {_LAYER: jax.tree.leaves(_layer(stacked, index)), _OPERAND: jax.tree.leaves(operands),
                       _CONSTANT: layout.constants,
                       _STACKED: [lax.dynamic_index_in_dim(s, index, keepdims=False) for s in stacks]}
            pullback = jax.tree.unflatten(layout.treedef, [sources[kind][at] for kind, at in layout.sources])
            layer_grads, cotangent = pullback(cotangent)
            grads = jax.tree.map(lambda g, v: lax.dynamic_update_index_in_dim(g, v.astype(g.dtype), index, 0),
                                 grads, layer_grads)
            return cotangent, grads

        grads = jax.tree.map(lambda a: _unfilled(a.shape, a.dtype), stacked)
        carry_cotangent, grads = lax.fori_loop(0, length, step, (carry_cotangent, grads))
        return grads, carry_cotangent, None

    run.defvjp(forward, backward)
    return run(stacked, carry, operands)
