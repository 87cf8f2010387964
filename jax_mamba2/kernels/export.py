"""Ahead-of-time compilation of the plan kernels to cubins, on a machine with or without a GPU.

`launch_signature` builds, from the (shape, dtype) of every array a launch names, exactly the constraints
that `cuda.tile.jax.cutile_call` derives from JAX avals at lowering time (row-major contiguous, unit last
stride, size-1 dims constant, divisible-by-16 hints, 256-byte base alignment, the kernel's own index
width), so a cubin compiled here is the cubin JAX compiles on the GPU.

Command line:
    python -m jax_mamba2.kernels.export --arch sm_90 --out DIR [--configs default|all] [--quick]
prints one line per cubin: name, size, compile seconds.
"""
import argparse
import dataclasses
import io
import itertools
import math
import os
import sys
import time
from typing import Iterator, Mapping

import cuda.tile as ct
from cuda.tile.compilation import (
    ArrayConstraint, CallingConvention, ConstantConstraint, KernelSignature, export_kernel)

from jax_mamba2.kernels._common import Buffer, Launch, Plan, SSDDims

_CT_DTYPES = {
    "bfloat16": ct.bfloat16,
    "float16": ct.float16,
    "float32": ct.float32,
    "int32": ct.int32,
}
# What XLA guarantees for the base address of every buffer (cuda/tile/jax/_jax.py).
_XLA_BASE_ADDR_ALIGN = 256
_DIVISOR_16 = 16


def array_constraint(shape: tuple[int, ...], dtype: str, index_dtype=ct.int32) -> ArrayConstraint:
    """The constraint `cutile_call` builds for a row-major JAX array of `shape` and `dtype`.

    Args:
      shape: the array's shape.
      dtype: numpy-style dtype name, one of `_CT_DTYPES`.
      index_dtype: ct.int32 or ct.int64, the width the kernel parameter is annotated with.
    """
    ct_dtype = _CT_DTYPES[dtype]
    ndim = len(shape)
    strides = [1] * ndim
    for i in range(ndim - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    bits_16_bytes = _DIVISOR_16 * 8
    stride_divisor = bits_16_bytes // ct_dtype.bitwidth if bits_16_bytes % ct_dtype.bitwidth == 0 else 1
    return ArrayConstraint(
        dtype=ct_dtype,
        ndim=ndim,
        index_dtype=index_dtype,
        stride_lower_bound_incl=0,
        alias_groups=(),
        may_alias_internally=False,
        stride_constant=tuple(1 if s == 1 else None for s in strides),
        shape_constant=tuple(1 if d == 1 else None for d in shape),
        stride_divisible_by=tuple(stride_divisor if s % stride_divisor == 0 else 1 for s in strides),
        shape_divisible_by=tuple(_DIVISOR_16 if d % _DIVISOR_16 == 0 else 1 for d in shape),
        base_addr_divisible_by=_XLA_BASE_ADDR_ALIGN,
    )


def _kernel_index_dtypes(kernel) -> list:
    """Per parameter: the index dtype its annotation asks for (int32 unless ct.IndexedWithInt64)."""
    nodes = kernel._annotated_function.parameter_annotations
    return [ct.int64 if getattr(n, "array", None) is not None and n.array.index_dtype == ct.int64
            else ct.int32 for n in nodes]


def launch_signature(launch: Launch, arrays: Mapping[str, Buffer]) -> KernelSignature:
    """The signature `cutile_call` would compile `launch` with, given every named array's spec."""
    params = []
    for arg, index_dtype in zip(launch.args, _kernel_index_dtypes(launch.kernel), strict=True):
        if isinstance(arg, str):
            spec = arrays[arg]
            params.append(array_constraint(tuple(spec.shape), spec.dtype, index_dtype))
        else:
            params.append(ConstantConstraint(arg))
    # cutile_call switches to the v2 convention whenever a shape is constant (a size-1 dim).
    needs_v2 = any(isinstance(p, ArrayConstraint) and any(d is not None for d in p.shape_constant)
                   for p in params)
    convention = CallingConvention.cutile_python_v2() if needs_v2 else CallingConvention.cutile_python_v1()
    name = launch.kernel._annotated_function.pyfunc.__name__
    return KernelSignature(params, convention).with_mangled_symbol(name)


def compile_launch(launch: Launch, arrays: Mapping[str, Buffer], arch: str = "sm_90",
                   output_format: str = "cubin") -> tuple[str, bytes]:
    """Compiles one launch; returns (symbol, cubin or TileIR bytecode)."""
    signature = launch_signature(launch, arrays)
    buf = io.BytesIO()
    export_kernel(launch.kernel, [signature], buf, gpu_code=arch, output_format=output_format)
    return signature.symbol, buf.getvalue()
