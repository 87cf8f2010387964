"""Runs the cuTile kernels from JAX; importing it registers the "cutile" backends of every op (`ssd`, the conv,
the norms, the LM loss's softmax).

  cutile           each kernel launch is an XLA FFI custom call (cuda.tile.jax.cutile_call) on XLA's
                   stream; compiled when the program is lowered; CUDA-graph compatible.
  cutile_callback  the whole plan runs in one jax.experimental.buffer_callback: XLA's device buffers go
                   to ct.launch zero-copy on the callback's stream.
  eager            (module) the same kernels on CuPy / torch / JAX device arrays outside jit.

Raises ImportError when cuda-tile is not installed; `jax_mamba2.ssd` then offers only "xla"/"scan".
The names of these backends are declared in `jax_mamba2.backends.OPTIONAL_BACKENDS`.
"""
try:
    import cuda.tile  # noqa: F401
except ModuleNotFoundError as e:
    if e.name not in ("cuda", "cuda.tile"):
        raise
    raise ModuleNotFoundError("cuda-tile is not installed (pip install 'jax-mamba2[cuda]')", name=e.name) from e

from jax_mamba2 import backends
from jax_mamba2.bridge import callback, conv_ops, decode_ops, ffi, loss_ops, norm_ops, ops, problem

backends.register_backend(backends.Backend(
    name="cutile", forward=ops.make_forward(ffi.run_plan),
    forward_saving=ops.make_forward_saving(ffi.run_plan),
    unsupported_reason=problem.unsupported_reason, backward=ops.make_backward(ffi.run_plan),
    step=ops.make_step(ffi.run_plan), step_unsupported_reason=ops.step_unsupported_reason,
    auto_priority=2, unavailable_reason=problem.gpu_unavailable_reason))
backends.register_backend(backends.Backend(
    name="cutile_callback", forward=ops.make_forward(callback.run_plan),
    forward_saving=ops.make_forward_saving(callback.run_plan),
    unsupported_reason=problem.unsupported_reason, backward=ops.make_backward(callback.run_plan),
    step=ops.make_step(callback.run_plan),
    step_unsupported_reason=ops.step_unsupported_reason, unavailable_reason=problem.gpu_unavailable_reason))

# The layer ops' kernels, on the same two executors; "auto" prefers "cutile", as for the SSD.
backends.register_backend(backends.LayerBackend("cutile", conv_ops.BACKENDS["cutile"], conv_ops.unsupported_reason,
                                                auto_priority=2), op="causal_conv1d")
backends.register_backend(backends.LayerBackend("cutile_callback", conv_ops.BACKENDS["cutile_callback"],
                                                conv_ops.unsupported_reason), op="causal_conv1d")
backends.register_backend(backends.LayerBackend("cutile", norm_ops.KERNELS["cutile"], norm_ops.unsupported_reason,
                                                auto_priority=2), op="rms_norm")
backends.register_backend(backends.LayerBackend("cutile_callback", norm_ops.KERNELS["cutile_callback"],
                                                norm_ops.unsupported_reason), op="rms_norm")
backends.register_backend(backends.LayerBackend("cutile", loss_ops.KERNELS["cutile"], loss_ops.unsupported_reason,
                                                auto_priority=2), op="cross_entropy")
backends.register_backend(backends.LayerBackend("cutile_callback", loss_ops.KERNELS["cutile_callback"],
                                                loss_ops.unsupported_reason), op="cross_entropy")
backends.register_backend(backends.LayerBackend("cutile", decode_ops.KERNELS["cutile"], decode_ops.unsupported_reason,
                                                auto_priority=2), op="decode")
backends.register_backend(backends.LayerBackend("cutile_callback", decode_ops.KERNELS["cutile_callback"],
                                                decode_ops.unsupported_reason), op="decode")
