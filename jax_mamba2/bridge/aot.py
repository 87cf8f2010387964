"""Ahead-of-time lowering of JAX programs that use the cuTile backends, on any machine.

`export_for_cuda(fun, *args)` lowers `fun` for CUDA with `jax.export`, compiling every cuTile kernel it
launches to cubins for `arch` with the local tileiras: no GPU is needed, the kernels get exactly the
constraints JAX derives at lowering, and the serialized program carries the cubins. Load it on the GPU
with `jax.export.deserialize(...)` after `import jax_mamba2.bridge` (which registers the FFI target of its
launches, CUTILE_CUSTOM_CALL).

Example:
  >>> exported = export_for_cuda(lambda x, dt, A, B, C: jax_mamba2.ssd(x, dt, A, B, C, 64), *args)
  >>> blob = exported.serialize()            # ship to the GPU machine (needs the flatbuffers package)
"""
from __future__ import annotations

from typing import Callable

import jax
from jax import export

from jax_mamba2.bridge._compat import COMMAND_BUFFER_TARGET, cuda_target

# The custom-call target of every cuTile launch of this package (registered by jax_mamba2.bridge).
CUTILE_CUSTOM_CALL = COMMAND_BUFFER_TARGET

__all__ = ["export_for_cuda", "cuda_target", "CUTILE_CUSTOM_CALL"]


def export_for_cuda(fun: Callable, *args, arch: str = "sm_90", **kwargs) -> export.Exported:
    """`jax.export` of `jax.jit(fun)(*args, **kwargs)` for the CUDA platform, cuTile kernels compiled for
    `arch`. Inside, `ssd(backend="auto")` and `backend="cutile"` choose the kernels as on that GPU."""
    with cuda_target(arch):
        return export.export(
            jax.jit(fun), platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(CUTILE_CUSTOM_CALL)],
        )(*args, **kwargs)
