"""The cuTile SSD kernels outside jit, on CuPy, torch or JAX device arrays (zero copy via DLPack).

Work is enqueued on the caller's current stream (CuPy's or torch's), never synchronised on the host.
JAX inputs are viewed through DLPack as torch tensors when torch is installed (bfloat16 capable), else
as CuPy arrays; DLPack makes the consumer stream wait for JAX's producer, and the results go back to
JAX through DLPack the same way. Meant for debugging kernels and mixing frameworks; inside JAX
programs use `jax_mamba2.ssd(..., backend="cutile")`.
"""
from __future__ import annotations

import math
from typing import Any

import cuda.tile as ct

from jax_mamba2.checks import check_dt_limit, check_flag
from jax_mamba2.bridge import problem
from jax_mamba2.kernels import forward as forward_kernels
from jax_mamba2.kernels._common import Plan
from jax_mamba2.ssd_args import SSDInputs, SSDStatic, check_inputs


class ArrayNamespace:
    """The few array operations the eager path needs, for torch or CuPy."""

    def __init__(self, module_name: str):
        self.name = module_name
        if module_name == "torch":
            import torch
            self.module = torch
        else:
            import cupy
            self.module = cupy

    def dtype(self, name: str):
        if not hasattr(self.module, name):
            raise TypeError(f"eager ssd: {self.name} has no {name} arrays; pass torch tensors (or JAX "
                            f"arrays with torch installed) for {name}")
        return getattr(self.module, name)

    def empty(self, shape, dtype_name):
        if self.name == "torch":
            return self.module.empty(shape, dtype=self.dtype(dtype_name), device="cuda")
        return self.module.empty(shape, dtype=self.dtype(dtype_name))

    def zeros(self, shape, dtype_name):
        if self.name == "torch":
            return self.module.zeros(shape, dtype=self.dtype(dtype_name), device="cuda")
        return self.module.zeros(shape, dtype=self.dtype(dtype_name))

    def cast(self, arr, dtype_name):
        arr = arr.to(self.dtype(dtype_name)) if self.name == "torch" else arr.astype(dtype_name)
        return arr.contiguous() if self.name == "torch" else self.module.ascontiguousarray(arr)

    def sequence_numbers(self, seq_idx):
        """`ssd_args.sequence_numbers` of a (b, L) id array of this framework: int32, counted from 0."""
        if self.name == "torch":
            previous_ids = self.module.nn.functional.pad(seq_idx[:, :-1], (1, 0))
            return (seq_idx != previous_ids).cumsum(1, dtype=self.module.int32)
        previous_ids = self.module.pad(seq_idx[:, :-1], ((0, 0), (1, 0)))
        return self.module.cumsum(seq_idx != previous_ids, axis=1, dtype="int32")

    def stream(self):
        if self.name == "torch":
            return self.module.cuda.current_stream()
        return self.module.cuda.get_current_stream()

    def dtype_name(self, arr) -> str:
        return str(arr.dtype).removeprefix("torch.")


def _module_of(arr) -> str:
    module = type(arr).__module__.split(".")[0]
    return {"torch": "torch", "cupy": "cupy"}.get(module, "jax")


def _to_namespace(arr, xp: ArrayNamespace):
    return None if arr is None else xp.module.from_dlpack(arr)


def _shape_dtype(arr, xp: ArrayNamespace):
    """A framework-neutral stand-in (shape, numpy dtype) for the op's input checks."""
    import jax
    import numpy as np
    return jax.ShapeDtypeStruct(tuple(arr.shape), np.dtype(jax.numpy.dtype(xp.dtype_name(arr))))


def run_plan(plan: Plan, arrays: dict, xp: ArrayNamespace, stream=None) -> dict:
    """Runs `plan` with ct.launch on `stream` (default: the namespace's current stream)."""
    stream = xp.stream() if stream is None else stream
    env = dict(arrays)
    for name, buf in plan.buffers.items():
        env[name] = (xp.zeros if buf.zero_init else xp.empty)(buf.shape, buf.dtype)
    for launch in plan.launches:
        args = tuple(env[a] if isinstance(a, str) else a for a in launch.args)
        ct.launch(stream, launch.grid, launch.kernel, args)
    return {name: env[name] for name in plan.outputs}


def ssd(x, dt, A, B, C, chunk_size=256, *, D=None, z=None, dt_bias=None, dt_softplus=False,
        dt_limit=(0.0, math.inf), initial_states=None, seq_idx=None, return_final_states=False,
        stream: Any = None):
    """The forward of `jax_mamba2.ssd` on the cuTile kernels, eagerly, for CuPy / torch / JAX CUDA arrays.

    The arguments shared with `jax_mamba2.ssd` have its shapes, dtypes and meaning, and are checked as it checks
    them (shapes, dtypes, options; not the values: A <= 0, Δ >= 0 and an ordered seq_idx are the caller's); the
    results come back in x's framework. There is no backend to choose, no gradient, and the kernels run on the
    inputs as they are, as `ssd(..., check_finite=False)` runs them: a NaN or inf may reach the other tokens of
    its chunk and the packed sequences after it. `stream`: a torch/CuPy stream or raw handle; default the
    framework's current stream.
    """
    source = _module_of(x)
    if source == "jax":
        try:
            import torch  # noqa: F401
            xp = ArrayNamespace("torch")
        except ImportError:
            xp = ArrayNamespace("cupy")
    else:
        xp = ArrayNamespace(source)
    arrays = SSDInputs(*(_to_namespace(a, xp) for a in (x, dt, A, B, C, D, z, dt_bias, initial_states,
                                                               seq_idx)))
    stand_ins = SSDInputs(*(None if a is None else _shape_dtype(a, xp) for a in arrays))
    check_inputs(*stand_ins[:5], chunk_size, stand_ins.D, stand_ins.z, stand_ins.dt_bias,
                        stand_ins.initial_states, stand_ins.seq_idx)
    static = SSDStatic(int(chunk_size), check_flag("ssd", "dt_softplus", dt_softplus),
                              check_dt_limit("ssd", dt_limit))
    return_final_states = check_flag("ssd", "return_final_states", return_final_states)
    reason = problem.shape_unsupported_reason(dtype=stand_ins.x.dtype, headdim=stand_ins.x.shape[3],
                                              dstate=stand_ins.B.shape[3])
    if reason is not None:
        raise ValueError(f"eager ssd cannot run this call: {reason}")
    dims = problem.kernel_dims(stand_ins, static)
    out = run_plan(forward_kernels.forward_plan(dims), problem.kernel_inputs(arrays, dims, xp), xp, stream)
    y, final = out["out"], out["final_states"]
    if source == "jax":
        import jax.dlpack
        y, final = jax.dlpack.from_dlpack(y), jax.dlpack.from_dlpack(final)
    return (y, final) if return_final_states else y
