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

# The SSD and the layer ops' kernels on the two executors; "auto" prefers "cutile".
for _name, _run_plan, _priority in (("cutile", ffi.run_plan, 2), ("cutile_callback", callback.run_plan, 0)):
    backends.register_backend(backends.Backend(
        name=_name, forward=ops.make_forward(_run_plan), forward_saving=ops.make_forward_saving(_run_plan),
        unsupported_reason=problem.unsupported_reason, backward=ops.make_backward(_run_plan),
        step=ops.make_step(_run_plan), step_unsupported_reason=ops.step_unsupported_reason,
        auto_priority=_priority, unavailable_reason=problem.gpu_unavailable_reason))
    for _op, _ops_module in (("causal_conv1d", conv_ops), ("rms_norm", norm_ops), ("cross_entropy", loss_ops),
                             ("decode", decode_ops)):
        backends.register_backend(backends.LayerBackend(_name, _ops_module.KERNELS[_name],
                                                        _ops_module.unsupported_reason, auto_priority=_priority),
                                  op=_op)
del _name, _run_plan, _priority, _op, _ops_module
