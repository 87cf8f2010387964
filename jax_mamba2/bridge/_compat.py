"""The few JAX and cuda-tile internals the bridge depends on, in one place (they move between releases)."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import cuda.tile._compile as cutile_compile

# Re-exported: the bridge's outputs and gradients under shard_map (pure JAX, shared with the layers' loss).
from jax_mamba2._vma import match_varying_axes, reduce_to_primal_axes, varying_axes  # noqa: F401

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
