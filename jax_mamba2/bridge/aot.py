"""Ahead-of-time lowering of JAX programs that use the cuTile backends, on any machine.

`export_for_cuda(fun, *args)` lowers `fun` for CUDA with `jax.export`, compiling every cuTile kernel it
launches to cubins for `arch` with the local tileiras: no GPU is needed, the kernels get exactly the
constraints JAX derives at lowering, and the serialized program carries the cubins. Load it on the GPU
with `jax.export.deserialize(...)` after `import jax_mamba2.bridge` (which registers the FFI target of its
launches, CUTILE_CUSTOM_CALL).

Example:
  >>> exported = export_for_cuda(lambda x, dt, A, B, C: jax_mamba2.ssd(x, dt, A, B, C, 64), *args)  # doctest: +SKIP
  >>> blob = exported.serialize()  # ship to the GPU machine (needs the flatbuffers package)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Callable

import jax
from jax import export

from jax_mamba2.bridge._compat import COMMAND_BUFFER_TARGET, cuda_target
from jax_mamba2.kernels._common import SUPPORTED_ARCHS

# The custom-call target of every cuTile launch of this package (registered by jax_mamba2.bridge).
CUTILE_CUSTOM_CALL = COMMAND_BUFFER_TARGET

__all__ = ["export_for_cuda", "cuda_target", "CUTILE_CUSTOM_CALL", "SUPPORTED_ARCHS"]


def export_for_cuda(fun: Callable, *args, arch: str = "sm_90", **kwargs) -> export.Exported:
    """`jax.export` of `jax.jit(fun)(*args, **kwargs)` for the CUDA platform, cuTile kernels compiled for
    `arch`. Inside, `ssd(backend="auto")` and `backend="cutile"` choose the kernels as on that GPU. A `fun`
    that is already jitted is exported as it is, with its static arguments, donations and shardings.

    JAX's in-memory caches are cleared first and again after (`jax.clear_caches()`): no trace or lowering this
    process made for another target (its GPU's, or another export's) is reused with this target's kernels, and
    none made for this target is reused by the process's own later calls (which on a machine without a GPU would
    lower the kernels for the CPU instead of raising the ValueError of `backend="cutile"`).

    Raises:
      ValueError: for an arch outside SUPPORTED_ARCHS, or a `fun` that launches kernels from a host callback
        (`backend="cutile_callback"`), which `jax.export` cannot serialize.
    """
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"export_for_cuda: arch={arch!r} must be one of {SUPPORTED_ARCHS}")
    # jax.jit of a jitted function would trace its static arguments and drop its donations and shardings.
    jitted = fun if isinstance(fun, jax.stages.Wrapped) else jax.jit(fun)
    jax.clear_caches()
    try:
        with cuda_target(arch):
            return export.export(
                jitted, platforms=["cuda"],
                disabled_checks=[export.DisabledSafetyCheck.custom_call(CUTILE_CUSTOM_CALL)],
            )(*args, **kwargs)
    except NotImplementedError as e:
        if "host_callbacks" not in str(e):
            raise
        raise ValueError("export_for_cuda: fun launches kernels from a host callback (backend="
                         "'cutile_callback'), which jax.export cannot serialize; export it with backend='cutile' "
                         "or 'auto' (the same kernels as XLA custom calls)") from e
    finally:
        jax.clear_caches()
