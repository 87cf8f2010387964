"""vmap rules of the kernel ops: a mapped axis folded into (and unfolded from) the kernels' leading batch axis,
and unmapped arguments broadcast to it (for `jax.lax.map` over items that cannot share one launch)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def fold(arr, batched: bool, axis_size: int):
    """(axis_size, batch, ...) -> (axis_size * batch, ...); an unmapped `arr` (batch, ...) is broadcast first."""
    if not batched:
        arr = jnp.broadcast_to(arr[None], (axis_size, *arr.shape))
    return arr.reshape((axis_size * arr.shape[1], *arr.shape[2:]))


def unfold(arr, axis_size: int):
    """(axis_size * batch, ...) -> (axis_size, batch, ...)."""
    return arr.reshape((axis_size, arr.shape[0] // axis_size, *arr.shape[1:]))


def broadcast_unbatched(tree, batched_tree, axis_size: int):
    """Every leaf of `tree` with a leading mapped axis of axis_size (broadcast where `batched_tree` says it
    has none)."""
    return jax.tree.map(
        lambda a, b: a if b else jnp.broadcast_to(a[None], (axis_size, *a.shape)),
        tree, batched_tree)


def map_items(fn, args, in_batched, axis_size: int):
    """fn(*args) for each item of the mapped axis, one call each under `jax.lax.map` (items that cannot share one
    launch); `args` may hold None for absent arrays, which pass through as None."""
    present = [i for i, a in enumerate(args) if a is not None]
    mapped = broadcast_unbatched([args[i] for i in present], [in_batched[i] for i in present], axis_size)

    def one(items):
        full = list(args)
        for i, a in zip(present, items):
            full[i] = a
        return fn(*full)
    return jax.lax.map(one, mapped)
