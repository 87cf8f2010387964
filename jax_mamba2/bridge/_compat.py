"""The few JAX internals the bridge depends on, in one place (they move between JAX releases)."""
from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
    """Mesh axes over which `x` varies inside shard_map (empty outside it)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def match_varying_axes(outputs, inputs):
    """Marks kernel outputs as varying over every manual axis any input varies over.

    cutile_call's abstract eval builds plain ShapedArrays, which drop shard_map's varying-axes type:
    the forward values are right, but custom_vjp then rejects (or, with check_vma=False, silently
    mis-sums) the gradients. See notes jax_bridge.md §7.
    """
    axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(inputs)))
    if not axes:
        return outputs

    def cast(y):
        missing = tuple(sorted(axes - varying_axes(y)))
        return jax.lax.pcast(y, missing, to="varying") if missing else y

    return jax.tree.map(cast, outputs)
