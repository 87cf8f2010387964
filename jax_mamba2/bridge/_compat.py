"""The few JAX and cuda-tile internals the bridge depends on, in one place (they move between releases)."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import cuda.tile._compile as cutile_compile
import jax

_cuda_target: Optional[str] = None


def cuda_target_override() -> Optional[str]:
    """The sm arch set by `cuda_target`, or None."""
    return _cuda_target


@contextlib.contextmanager
def cuda_target(arch: str) -> Iterator[None]:
    """Makes cuTile compile for `arch` without asking the local GPU (there may be none).

    cuda.tile.jax compiles each kernel for `cuda.tile._compile.get_sm_arch()`, which queries device 0
    through libcuda; this swaps that private function for the duration (cuda-tile 1.7).
    """
    global _cuda_target
    previous_target, previous_query = _cuda_target, cutile_compile.get_sm_arch
    _cuda_target = arch
    cutile_compile.get_sm_arch = lambda *args, **kwargs: arch
    try:
        yield
    finally:
        _cuda_target, cutile_compile.get_sm_arch = previous_target, previous_query


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
    mis-sums) the gradients.
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
