"""The few JAX and cuda-tile internals the bridge depends on, in one place (they move between releases)."""
from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import cuda.tile as ct
import cuda.tile._cext as cutile_cext
import cuda.tile._compile as cutile_compile
import jax
from cuda.tile._cext import default_tile_context
from cuda.tile.compilation import ConstantConstraint, KernelSignature
from cuda.tile.jax import InputOutput, OutputPlaceholder
from cuda.tile.jax import _jax as cutile_jax
from jax.interpreters import mlir
from jax._src.lib.mlir import ir
from jaxlib.xla_client import CustomCallTargetTraits

# Re-exported: the bridge's outputs and gradients under shard_map (pure JAX, shared with the layers' loss).
from jax_mamba2._vma import match_varying_axes, reduce_to_primal_axes, varying_axes  # noqa: F401

_cuda_target: Optional[str] = None


def cuda_target_override() -> Optional[str]:
    """The sm arch set by `cuda_target`, or None."""
    return _cuda_target


# cuda.tile.jax's compiled kernels, one cache per target arch: its own cache is keyed by kernel and constraints,
# not by the arch it compiled for.
_COMPILE_CACHES: dict[Optional[str], dict] = {}


@contextlib.contextmanager
def cuda_target(arch: str) -> Iterator[None]:
    """Makes cuTile compile for `arch` without asking the local GPU (there may be none).

    cuda.tile.jax compiles each kernel for `cuda.tile._compile.get_sm_arch()`, which queries device 0
    through libcuda; this swaps that private function for the duration (cuda-tile 1.7), and cuda.tile.jax's
    cache of compiled kernels for one of `arch`'s (the local GPU's cache is restored after).
    """
    global _cuda_target
    previous_target, previous_query = _cuda_target, cutile_compile.get_sm_arch
    previous_cache = _COMPILE_CACHES.setdefault(previous_target, cutile_jax._COMPILE_CACHE)
    _cuda_target = arch
    cutile_compile.get_sm_arch = lambda *args, **kwargs: arch
    cutile_jax._COMPILE_CACHE = _COMPILE_CACHES.setdefault(arch, {})
    try:
        yield
    finally:
        _cuda_target, cutile_compile.get_sm_arch = previous_target, previous_query
        cutile_jax._COMPILE_CACHE = previous_cache


# --- Compiling the kernels of cutile_call lowerings (cuda-tile 1.7: cuda/tile/jax/_jax.py, _compile.py) ---

def launch_constraints(kernel, args) -> tuple:
    """The parameter constraints `cutile_call`'s lowering compiles `kernel` with, for these call arguments.

    `args` are the positional arguments of `cutile_call(grid, kernel, args)` as the plan executor builds
    them: JAX arrays (tracers included), `OutputPlaceholder`s, `InputOutput`s and constants, never tuples.
    Built with cuda.tile.jax's own `_array_constraint`, so that these constraints, and `compile_key` of
    them, are the ones the lowering derives from the avals later.
    """
    # An array passed for several parameters is one alias group, named by its first input position.
    inputs = [a.array if isinstance(a, InputOutput) else a for a in args if isinstance(a, (InputOutput, jax.Array))]
    positions: dict[int, list[int]] = {}
    for position, array in enumerate(inputs):
        positions.setdefault(id(array), []).append(position)

    constraints = []
    for arg, node in zip(args, kernel._annotated_function.parameter_annotations, strict=True):
        if isinstance(arg, (bool, int, float)):
            constraints.append(ConstantConstraint(arg))
            continue
        wide = node.array is not None and node.array.index_dtype == ct.int64
        array = arg.array if isinstance(arg, InputOutput) else arg
        shared = None if isinstance(arg, OutputPlaceholder) else positions[id(array)]
        group = f"G{shared[0]}" if shared and len(shared) > 1 else None
        constraints.append(cutile_jax._array_constraint(
            jax.ShapeDtypeStruct(array.shape, array.dtype), ct.int64 if wide else ct.int32, group))
    return tuple(constraints)


def compile_key(kernel, constraints) -> tuple:
    """The key under which cuda.tile.jax memoizes the cubin of (kernel, constraints) in the process."""
    return id(kernel), tuple(cutile_jax._constraint_cache_key(c) for c in constraints)


def kernel_signature(kernel, constraints):
    """The `KernelSignature` (calling convention, mangled symbol) cuda.tile.jax compiles `kernel` with."""
    return KernelSignature(list(constraints), cutile_jax._calling_convention_for(constraints)).with_mangled_symbol(
        kernel._annotated_function.pyfunc.__name__)


def sm_arch() -> str:
    """The arch cuda.tile.jax compiles for now: the local GPU's, or the one `cuda_target` set."""
    return cutile_compile.get_sm_arch()


def tileiras(bytecode: bytes, compiler_options, arch: str, symbol: str) -> bytes:
    """The cubin tileiras makes of Tile IR `bytecode`, through cuda-tile's disk cache.

    This is the second half of `cuda.tile._compile.compile_tile` (cache key, lookup, tileiras, store),
    which runs the whole compile under one process-wide lock; called on its own, tileiras runs outside
    that lock, so several compile at once. It passes tileiras no --preview or -l flags: none of the kernels
    makes the foreign calls that need them.
    """
    config = default_tile_context.config
    version = cutile_compile._get_compiler_version_string()
    opt_level, device_debug = cutile_compile._tileiras_effective_opt_and_device_debug(compiler_options, arch)
    key = None
    if config.cache_dir is not None and version is not None:
        key = cutile_compile.cache_key(version, arch, opt_level, bytes(bytecode), device_debug)
        cubin = cutile_compile.cache_lookup(config.cache_dir, key)
        if cubin is not None:
            return cubin
    with tempfile.TemporaryDirectory(dir=config.temp_dir) as folder:
        source = Path(folder) / f"{symbol[:64]}.bytecode"
        source.write_bytes(bytecode)
        began = time.perf_counter()
        cubin = cutile_compile.compile_cubin(
            str(source), compiler_options, arch, timeout_sec=config.compiler_timeout_sec).read_bytes()
        seconds = time.perf_counter() - began
    if key is not None:
        metadata = cutile_compile.MetadataV1(
            kernel_names=[symbol], compiler_version=version.strip(), compilation_timestamp=time.time(),
            compilation_time_seconds=seconds, remarks="")
        cutile_compile.cache_store(config.cache_dir, key, cubin, metadata.to_dict())
        cutile_compile.evict_lru(config.cache_dir, config.cache_size_limit)
    return cubin


def route_lowering_compiles(compile_kernel: Callable) -> None:
    """Makes every `cutile_call` lowering compile through `compile_kernel(kernel, constraints) ->
    (symbol, cubin)` on a miss of cuda.tile.jax's in-process cache (which still memoizes the result)."""
    cutile_jax.compile_kernel = compile_kernel


@contextlib.contextmanager
def empty_lowering_cache() -> Iterator[None]:
    """cuda.tile.jax's in-process cubin cache emptied for the duration (tests), restored after."""
    saved = dict(cutile_jax._COMPILE_CACHE)
    cutile_jax._COMPILE_CACHE.clear()
    try:
        yield
    finally:
        cutile_jax._COMPILE_CACHE.clear()
        cutile_jax._COMPILE_CACHE.update(saved)


# --- Launches XLA may record into its command buffers (cuda-tile 1.7: cuda/tile/jax/_jax.py, register_ffi) ---

COMMAND_BUFFER_TARGET = "jax_mamba2_cutile_launch"
_OUR_KERNELS = "jax_mamba2."


def register_command_buffer_launches() -> None:
    """Lets XLA record this package's cuTile launches into its command buffers (CUDA graphs).

    cuda.tile.jax registers its FFI launch handler ("cutile_launch") without the command-buffer trait, so XLA
    launches each of its custom calls on its own from the host and cuts every command buffer there. Here the
    same handler (it only launches the kernel on the stream it is given, which a stream capture records) is
    registered a second time as COMMAND_BUFFER_TARGET with that trait, and cuda.tile.jax's lowering rule is
    wrapped so that the calls of this package's kernels name it: a sequence of them and XLA's own kernels then
    becomes one graph launch wherever XLA's flags enable command buffers for custom calls (the default). Other
    libraries' cuTile kernels keep their target. A program lowered so needs this module imported (it registers
    the target) wherever it is deserialized and run.
    """
    handler = cutile_cext.xla_ffi_get_call_handler()
    jax.ffi.register_ffi_target(COMMAND_BUFFER_TARGET, {"instantiate": handler, "execute": handler},
                                platform="CUDA", traits=CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE)
    lower = cutile_jax._cutile_call_ffi_p_lower

    def lowering(ctx, *args, kernel, **params):
        results = lower(ctx, *args, kernel=kernel, **params)
        if kernel._annotated_function.pyfunc.__module__.startswith(_OUR_KERNELS):
            results[0].owner.attributes["call_target_name"] = ir.StringAttr.get(COMMAND_BUFFER_TARGET)
        return results

    mlir.register_lowering(cutile_jax.cutile_call_ffi_p, lowering, platform="cuda")
