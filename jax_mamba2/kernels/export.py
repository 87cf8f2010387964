"""Ahead-of-time compilation of the plan kernels to cubins, on a machine with or without a GPU.

`launch_signature` builds, from the (shape, dtype) of every array a launch names, exactly the constraints
that `cuda.tile.jax.cutile_call` derives from JAX avals at lowering time (row-major contiguous, unit last
stride, size-1 dims constant, divisible-by-16 hints, 256-byte base alignment, the kernel's own index
width), so a cubin compiled here is the cubin JAX compiles on the GPU for arrays of those shapes.

Command line:
    python -m jax_mamba2.kernels.export --arch sm_90 --out DIR [--configs default|all] [--quick]
compiles the forward (every layout that applies, with and without saving the chunk-entry states for the
backward, with and without the op's reach term), backward (recomputing or reading those states; atomic and
deterministic) and decode kernels of a representative problem set (x/B/C dtype bf16/f16/f32, headdim and
dstate 64/128, chunk_size 64/128/256, the optional inputs all absent or all present,
dt_softplus on as in Mamba2) with the default configuration of every stage (`--configs all`: every
configuration of the autotune spaces), skipping duplicates, and prints one line per cubin: name, size,
compile seconds. DIR gets `<kernel>_<hash>.cubin` files and a `manifest.tsv` (file, symbol).
"""
import argparse
import dataclasses
import hashlib
import io
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Iterator, Mapping

import cuda.tile as ct
from cuda.tile.compilation import (
    ArrayConstraint, CallingConvention, ConstantConstraint, KernelSignature, export_kernel)

from jax_mamba2._files import write_atomically
from jax_mamba2.kernels import backward, forward, state_update
from jax_mamba2.kernels._common import SUPPORTED_ARCHS, Buffer, Launch, SSDDims, kernel_name, kernel_signature

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
    nodes = kernel_signature(kernel).parameter_annotations
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
    name = kernel_name(launch.kernel)
    return KernelSignature(params, convention).with_mangled_symbol(name)


def compile_launch(launch: Launch, arrays: Mapping[str, Buffer], arch: str = "sm_90") -> tuple[str, bytes]:
    """Compiles one launch; returns (symbol, cubin)."""
    signature = launch_signature(launch, arrays)
    buf = io.BytesIO()
    export_kernel(launch.kernel, [signature], buf, gpu_code=arch, output_format="cubin")
    return signature.symbol, buf.getvalue()


def _problems(quick: bool) -> Iterator[SSDDims]:
    """The representative problems: every dtype / head size / chunk size, flags all off or all on."""
    dtypes = ("bfloat16", "float32") if quick else ("bfloat16", "float16", "float32")
    sizes = (64,) if quick else (64, 128)
    chunks = (64,) if quick else (64, 128, 256)
    for dtype, headdim, dstate, chunk, flags in itertools.product(dtypes, sizes, sizes, chunks, (False, True)):
        # 16 chunks of 2 x 8 chains: every forward layout applies where chunk_size <= 64.
        yield SSDDims(batch=2, seqlen=16 * chunk, nheads=8, headdim=headdim, ngroups=1, dstate=dstate,
                      chunk_size=chunk, dtype=dtype, dt_dtype=dtype, has_z=flags, has_init=flags,
                      has_seq_idx=flags, dt_softplus=True)


def _forward_configs(dims: SSDDims, which: str, arch: str) -> Iterator[tuple[str, dict]]:
    """(layout, configs) of the forward plans to compile: every layout that can run `dims`; with "all",
    each stage's space on its own (the others at their defaults: the launches are independent), in the
    first of those layouts that has the stage."""
    layouts = forward.forward_layouts(dims)
    if which == "default":
        yield from ((layout, {}) for layout in layouts)
        return
    for name, stage in forward.STAGES.items():
        homes = [layout for layout in layouts if name in forward.FORWARD_LAYOUTS[layout]]
        for cfg in stage.space(dims, arch) if homes else ():
            yield homes[0], {name: cfg}


def _backward_configs(dims: SSDDims, which: str, arch: str) -> Iterator[dict]:
    """Configs of the backward plans to compile: the defaults, or each backward stage's space on its own
    (the forward stages it recomputes are compiled with the forward's)."""
    if which == "default":
        yield {}
        return
    for name, stage in backward.STAGES.items():
        if name not in forward.STAGES:
            yield from ({name: cfg} for cfg in stage.space(dims, arch))


def _launches(which: str, quick: bool, arch: str) -> Iterator[tuple[Launch, dict]]:
    """(launch, arrays) for every kernel the problem set uses."""
    for dims in _problems(quick):
        # A differentiated call runs the kernels gate-free (the gate's VJP is taken outside them).
        differentiated = dataclasses.replace(dims, has_z=False)
        for layout, configs in _forward_configs(dims, which, arch):
            # The op adds the reach term of its non-finite confinement (check_finite, the default) in the kernels.
            for (save_states, plan_dims), has_reach in itertools.product(((False, dims), (True, differentiated)),
                                                                        (False, True)):
                plan_dims = dataclasses.replace(plan_dims, has_reach=has_reach)
                for launch in forward.forward_plan(plan_dims, configs, layout, save_states).launches:
                    yield launch, forward.forward_arrays(plan_dims, layout, save_states)
        for configs in _backward_configs(differentiated, which, arch):
            for deterministic, saved_states in itertools.product((False, True), (False, True)):
                plan = backward.backward_plan(differentiated, configs, deterministic=deterministic,
                                              saved_states=saved_states)
                arrays = backward.backward_arrays(differentiated, configs, deterministic,
                                                  saved_states=saved_states)
                yield from ((launch, arrays) for launch in plan.launches)
        step_dims = dataclasses.replace(dims, seqlen=1, chunk_size=1, dt_dtype="float32", has_init=False,
                                        has_seq_idx=False)
        step_configs = [None] if which == "default" else state_update.STATE_UPDATE_STAGE.space(step_dims, arch)
        for cfg in step_configs:
            for state_dtype in sorted({"float32", dims.dtype}):
                for d_per_channel in (False, True):  # the mixer's D: one per head (mamba_ssm's default) or channel
                    plan = state_update.state_update_plan(step_dims, cfg, state_dtype, d_per_channel)
                    arrays = {**state_update.state_update_inputs(step_dims, state_dtype, d_per_channel=d_per_channel),
                              **plan.buffers}
                    yield plan.launches[0], arrays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_mamba2.kernels.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90", choices=SUPPORTED_ARCHS, help="GPU architecture")
    parser.add_argument("--out", required=True, help="output directory for the cubins")
    parser.add_argument("--configs", choices=("default", "all"), default="default",
                        help="default stage configurations, or every configuration of the tune spaces")
    parser.add_argument("--quick", action="store_true",
                        help="a small set for CI: bf16 and f32, headdim = dstate = chunk_size = 64")
    args = parser.parse_args(argv)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out={args.out} is a file; it must be a directory (created if missing)")
    os.makedirs(args.out, exist_ok=True)

    seen, manifest, start = set(), [], time.perf_counter()
    for launch, arrays in _launches(args.configs, args.quick, args.arch):
        signature = launch_signature(launch, arrays)
        # The symbol encodes the kernel, constraints and constants; the hints (occupancy) are not in it.
        key = (signature.symbol, repr(launch.kernel._compiler_options))
        if key in seen:
            continue
        seen.add(key)
        t0 = time.perf_counter()
        symbol, cubin = compile_launch(launch, arrays, args.arch)
        seconds = time.perf_counter() - t0
        name = f"{kernel_name(launch.kernel)}_{hashlib.sha1(repr(key).encode()).hexdigest()[:12]}.cubin"
        write_atomically(Path(args.out) / name, cubin)
        manifest.append(f"{name}\t{symbol}")
        print(f"{name}  {len(cubin):>8d} B  {seconds:6.2f} s", flush=True)
    write_atomically(Path(args.out) / "manifest.tsv", ("\n".join(manifest) + "\n").encode())
    print(f"{len(manifest)} cubins for {args.arch} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
