"""Compiling the configs of a tune space concurrently, before the search times them.

`cuda.tile.tune.exhaustive_search` compiles each config at its first launch, one after another, and
cuda-tile's JIT compiles under one process-wide lock, tileiras included, so a stage's space waits for each
compile in turn (docs/design.md §7). Here each config's
launch is first *recorded*: launched with `TileKernel._compile` (what cuda-tile's launch calls on a miss of
its in-memory cache) replaced by a recorder that keeps the `KernelSignature` the launch derived from its
arguments and raises before anything compiles or runs. The recorded signatures then compile on a thread
pool, each front end (Python to Tile IR bytecode) under cuda-tile's lock and each tileiras outside it, as
`compile_ahead` does for lowering, through the same disk cache. The search then runs with `_compile`
answering from those results; a launch not recorded compiles as it would have.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
from typing import Callable, Iterable, Iterator, NamedTuple, Optional

import cuda.tile as ct
from cuda.tile._compile import compile_tile, format_sm_arch, get_compute_capability

from jax_mamba2.bridge import _compat

# The class whose `_compile` cuda-tile's launch calls (every `@ct.kernel` and `replace_hints` result).
KERNEL_CLASS = ct.kernel
# launch(kernel, grid, args): one launch as the search will make it (`ct.launch` on its stream).
LaunchFn = Callable[[object, tuple, tuple], None]


class _Recorded(Exception):
    """Raised in place of a compile: the recorded launch stops before it runs."""


class RecordedCompile(NamedTuple):
    """What one launch asked cuda-tile to compile: the kernel, the signature its arguments gave, the tile
    context and the compute capability (None: the current device's)."""

    kernel: object
    signature: object
    context: object
    compute_capability: Optional[tuple]


def _key(kernel, signature, compute_capability) -> tuple:
    # A kernel and its replace_hints copies share the Python function; their options tell them apart. A
    # signature holds unhashable constraints: its repr (every field, constants included) stands for it.
    return kernel._annotated_function.pyfunc, kernel._compiler_options, repr(signature), compute_capability


@contextlib.contextmanager
def _compile_replaced(replacement) -> Iterator[Callable]:
    """`KERNEL_CLASS._compile` is `replacement` for the duration; yields the original."""
    original = KERNEL_CLASS._compile
    KERNEL_CLASS._compile = replacement
    try:
        yield original
    finally:
        KERNEL_CLASS._compile = original


def record_compiles(launches: Iterable[tuple], launch: LaunchFn) -> list[RecordedCompile]:
    """The compile each (kernel, grid, args) launch asks for, recorded without compiling or running it.

    Each launch takes a `replace_hints()` copy of its kernel, whose in-memory cache is empty, so that the
    launch asks for its compile even where the kernel itself compiled it before (and never runs). A launch
    that fails before it asks (its arguments do not fit the kernel) records nothing: the search reports it."""
    recorded = []

    def recorder(kernel, signature, context, compute_capability=None):
        recorded.append(RecordedCompile(kernel, signature, context, compute_capability))
        raise _Recorded

    with _compile_replaced(recorder):
        for kernel, grid, args in launches:
            try:
                launch(kernel.replace_hints(), grid, args)
            except Exception:  # noqa: BLE001  _Recorded as the launch re-raises it, or a launch the search reports
                pass
    return recorded


def compile_recorded(request: RecordedCompile) -> tuple:
    """What `_compile` returns for `request` — (cubin, symbol, None, library lifecycle providers) — with
    tileiras run outside cuda-tile's lock (through its disk cache, under the key its JIT uses)."""
    kernel = request.kernel
    arch = format_sm_arch(*(request.compute_capability or get_compute_capability()))
    result = compile_tile(kernel._annotated_function, (request.signature,), arch, kernel._compiler_options,
                          request.context, return_bytecode=True, return_cubin=False)
    [signature] = result.kernel_signatures
    cubin = _compat.tileiras(bytes(result.bytecode), kernel._compiler_options, arch, signature.symbol)
    return cubin, signature.symbol, None, tuple(result.library_lifecycle_providers)


@contextlib.contextmanager
def compiled_ahead(launches: Iterable[tuple], launch: LaunchFn, max_workers: Optional[int] = None) -> Iterator[int]:
    """Compiles every (kernel, grid, args) launch concurrently, then answers their compiles for the duration.

    Yields the number of compiles prepared. A compile that failed raises its error again when the search
    asks for it (not compiled twice); a compile nothing recorded runs as cuda-tile's own.
    """
    recorded = record_compiles(launches, launch)
    unique = {_key(r.kernel, r.signature, r.compute_capability): r for r in recorded}
    workers = max(1, min(len(unique), max_workers or os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="cutile-tune-compile") as pool:
        futures = {key: pool.submit(compile_recorded, request) for key, request in unique.items()}
    original = KERNEL_CLASS._compile

    def answer(kernel, signature, context, compute_capability=None):
        future = futures.get(_key(kernel, signature, compute_capability))
        if future is None:
            return original(kernel, signature, context, compute_capability)
        return future.result()  # re-raises the compile's error

    with _compile_replaced(answer):
        yield len(futures)
