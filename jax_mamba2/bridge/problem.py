"""From the op's arguments to what the cuTile kernels take: dims, dtypes, dummies, limits.

The kernels accept one layout (jax_mamba2/kernels/_common.py, kernels' module docs): x/B/C/z share one
dtype T in {bf16, f16, f32}; A, dt_bias, D (as (nheads, headdim)) are f32; absent optional arrays are
replaced by zeros (dt_bias, D) or tiny dummies that the kernel never reads (z, initial_states, seq_idx).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jax_mamba2.bridge import _compat
from jax_mamba2.kernels._common import KERNEL_DTYPES, SSDDims
from jax_mamba2.ssd_args import sequence_numbers

# The chunk the kernels run at, whatever chunk_size the caller asked for: the result is the same up to
# rounding, and 64 is the fastest of 64 / 128 / 256 (the fused forward and the head-summing backward passes
# exist only up to 64).
KERNEL_CHUNK_SIZE = 64
HEAD_DIMS = (16, 32, 64, 128, 256)  # headdim and dstate: powers of two in [16, 256]
MIN_COMPUTE_CAPABILITY = (9, 0)


def gpu_unavailable_reason() -> Optional[str]:
    """None when the kernels can target a GPU here (or `_compat.cuda_target` names one), else why not."""
    if _compat.cuda_target_override() is not None:
        return None
    return _local_gpu_unavailable_reason()


@functools.cache
def _local_gpu_unavailable_reason() -> Optional[str]:
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return f"no CUDA device is visible to JAX (jax.default_backend()={jax.default_backend()!r})"
    capability = getattr(devices[0], "compute_capability", None)
    if capability is not None:
        major, minor = (int(v) for v in str(capability).split(".")[:2])
        if (major, minor) < MIN_COMPUTE_CAPABILITY:
            return (f"the GPU has compute capability {capability}; the kernels target "
                    f"sm_{MIN_COMPUTE_CAPABILITY[0]}{MIN_COMPUTE_CAPABILITY[1]} (Hopper) and newer")
    return None


def symbolic_sizes_reason(**sizes) -> Optional[str]:
    """Why the kernels cannot run a problem whose sizes (name -> an int or a shape) include a symbolic one
    (jax.export's shape polymorphism): each launch is compiled for concrete shapes and grid, and the plans
    compare sizes, which a symbolic one leaves undecided (so "auto" could not fall back to xla)."""
    symbolic = [name for name, size in sizes.items()
                if any(jax.export.is_symbolic_dim(d) for d in (size if isinstance(size, tuple) else (size,)))]
    if symbolic:
        return (f"symbolic sizes ({', '.join(symbolic)}: a shape-polymorphic export); the kernels are compiled for "
                f"concrete shapes: use backend='xla'")
    return None


def shape_unsupported_reason(*, dtype, headdim: int, dstate: int) -> Optional[str]:
    """Why the kernels cannot take these shapes/dtypes (None when they can)."""
    name = jnp.dtype(dtype).name
    if name not in KERNEL_DTYPES:
        return (f"x.dtype={name} is not supported by the cuTile kernels (bfloat16, float16, float32); "
                f"use backend='xla' or cast")
    if headdim not in HEAD_DIMS:
        return f"headdim={headdim} must be a power of two in [16, 256]"
    if dstate not in HEAD_DIMS:
        return f"dstate={dstate} must be a power of two in [16, 256]"
    return None


def unsupported_reason(inputs, static) -> Optional[str]:
    """Why `ssd(..., backend="cutile")` cannot run this call (None when it can)."""
    # x and B hold every size of the problem (the op checked the other arrays against them).
    reason = symbolic_sizes_reason(x=inputs.x.shape, B=inputs.B.shape)
    if reason is not None:
        return reason
    for name in ("dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"):
        arr = getattr(inputs, name)
        if arr is not None and arr.dtype == jnp.float64:
            return f"{name} is float64; the kernels compute in float32: use backend='xla' or cast"
    reason = shape_unsupported_reason(dtype=inputs.x.dtype, headdim=inputs.x.shape[3],
                                      dstate=inputs.B.shape[3])
    return reason or gpu_unavailable_reason()


def kernel_dims(inputs, static) -> SSDDims:
    batch, seqlen, nheads, headdim = inputs.x.shape
    ngroups, dstate = inputs.B.shape[2:]
    dt_dtype = jnp.dtype(inputs.dt.dtype).name
    return SSDDims(
        batch=batch, seqlen=seqlen, nheads=nheads, headdim=headdim, ngroups=ngroups, dstate=dstate,
        chunk_size=KERNEL_CHUNK_SIZE, dtype=jnp.dtype(inputs.x.dtype).name,
        dt_dtype=dt_dtype if dt_dtype in (jnp.dtype(inputs.x.dtype).name, "float32") else "float32",
        has_z=inputs.z is not None, has_init=inputs.initial_states is not None,
        has_seq_idx=inputs.seq_idx is not None, dt_softplus=static.dt_softplus,
        dt_limit=tuple(static.dt_limit), has_reach=inputs.reach is not None)


class JaxArrays:
    """The array operations `kernel_inputs` needs, on JAX arrays (bridge/eager.py has torch's and CuPy's)."""

    @staticmethod
    def zeros(shape, dtype_name: str):
        return jnp.zeros(shape, dtype_name)

    @staticmethod
    def cast(arr, dtype_name: str):
        return arr.astype(dtype_name)

    sequence_numbers = staticmethod(sequence_numbers)


def per_head_dim_D(D, nheads: int, headdim: int, xp=JaxArrays):
    """D as the kernels take it: (nheads, headdim) f32, zeros when absent (arrays of `xp`, see kernel_inputs)."""
    if D is None:
        return xp.zeros((nheads, headdim), "float32")
    D = xp.cast(D, "float32")
    return D if D.ndim == 2 else xp.zeros((nheads, headdim), "float32") + D[:, None]


def kernel_inputs(inputs, dims: SSDDims, xp=JaxArrays) -> dict:
    """The forward plan's input arrays (names as in kernels.forward.forward_plan) and the backward's
    `dx_reach`, built with the array operations of `xp` (zeros(shape, dtype_name), cast(arr, dtype_name),
    sequence_numbers(seq_idx))
    from `inputs` (an SSDInputs; its `reach` and `dx_reach`, which only the op sets, are JAX arrays)."""
    T = dims.dtype
    return dict(
        x=xp.cast(inputs.x, T),
        dt=xp.cast(inputs.dt, dims.dt_dtype),
        A=xp.cast(inputs.A, "float32"),
        dt_bias=(xp.zeros((dims.nheads,), "float32") if inputs.dt_bias is None
                 else xp.cast(inputs.dt_bias, "float32")),
        B=xp.cast(inputs.B, T),
        C=xp.cast(inputs.C, T),
        D=per_head_dim_D(inputs.D, dims.nheads, dims.headdim, xp),
        z=xp.zeros((1, 1, 1, 1), T) if inputs.z is None else xp.cast(inputs.z, T),
        initial_states=(xp.zeros((1, 1, 1, 1), "float32") if inputs.initial_states is None
                        else xp.cast(inputs.initial_states, "float32")),
        # The sequences' numbers, not their ids: the chunked kernels hand a chunk's entering state to its tokens
        # whose id is the one before it, 0 before the first chunk (ssd_args.sequence_numbers says why).
        seq_idx=(xp.zeros((1, 1), "int32") if inputs.seq_idx is None else xp.sequence_numbers(inputs.seq_idx)),
        **{name: xp.zeros((1, 1, 1, 1), "float32") if getattr(inputs, name) is None
           else per_chunk_rows(getattr(inputs, name), dims) for name in ("reach", "dx_reach")},
    )


def per_chunk_rows(per_token_head, dims: SSDDims):
    """A (batch, seqlen, nheads) JAX array in the kernels' per-chunk layout (batch, nheads, nchunks, chunk_size)
    f32, zero past seqlen (where dt_out and dA_cumsum lie)."""
    pad = dims.nchunks * dims.chunk_size - dims.seqlen
    rows = jnp.pad(jnp.swapaxes(per_token_head.astype(jnp.float32), 1, 2), ((0, 0), (0, 0), (0, pad)))
    return rows.reshape(dims.batch, dims.nheads, dims.nchunks, dims.chunk_size)
