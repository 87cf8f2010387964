"""shard_map's varying manual axes (vma) of values that custom calls and custom VJPs produce.

Inside `jax.shard_map`, every value's type records the mesh axes it varies over. Opaque kernels lose that type
and custom VJPs must return cotangents of their primals' types, so these helpers restore or reduce it (see
notes jax_bridge.md §7).
"""
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


def reduce_to_primal_axes(cotangents, primals):
    """Sums each cotangent over the manual axes its primal does not vary over.

    A parameter replicated across shard_map's shards gets the sum of every shard's partial gradient,
    which is what JAX's own transpose of an implicit pcast does for differentiable code.
    """
    def reduce(ct, primal):
        if ct is None or primal is None:
            return ct
        extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
        return jax.lax.psum(ct, extra) if extra else ct

    return jax.tree.map(reduce, cotangents, primals, is_leaf=lambda v: v is None)
