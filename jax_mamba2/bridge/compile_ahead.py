"""Compiles the cuTile kernels of a program concurrently, while it is lowered.

`cutile_call` compiles a kernel to a cubin inside its lowering rule, one launch after another, so a program
of many distinct kernels (the LM's training step) waited for each compile in turn. Each compile has two
parts, cuTile's Python front end (Tile IR bytecode, under a process-wide lock and the GIL) and tileiras
(a subprocess, the larger part: docs/design.md, "Compile time"). Here the plan executor *notes* every launch
while the program is traced (its constraints, computed as the lowering will compute them); at the first
compile the lowering asks for, every noted launch not yet compiled is submitted to a thread pool. The
front ends still run one at a time, but each tileiras runs beside the next front ends and the other
tileiras, and the lowering takes each cubin as it is ready.

A cubin is compiled once per key, cuda.tile.jax's own (the kernel object, the constraints of its
arguments), however many layers or call sites launch it; the LM's layers are one loop body, traced once,
anyway. A noted launch that is never lowered (a program only traced, e.g. by `jax.make_jaxpr`)
costs nothing until some later lowering, which compiles it with the rest.

`compile_log()` lists what this process compiled (kernel, seconds), for benchmarks.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import os
import threading
import time
from typing import Callable, Iterator

from cuda.tile.compilation import export_kernel

from jax_mamba2.bridge import _compat

# compile_fn(kernel, constraints, arch) -> (symbol, cubin)
CompileFn = Callable[..., tuple[str, bytes]]


def compile_cubin(kernel, constraints, arch: str) -> tuple[str, bytes]:
    """(symbol, cubin) of `kernel` for `constraints` on `arch`, as cuda.tile.jax compiles it at lowering:
    the front end (cuTile's lock) to Tile IR bytecode, then tileiras outside that lock."""
    signature = _compat.kernel_signature(kernel, constraints)
    bytecode = io.BytesIO()
    export_kernel(kernel, [signature], bytecode, gpu_code=arch, output_format="tileir_bytecode")
    return signature.symbol, _compat.tileiras(bytecode.getvalue(), kernel._compiler_options, arch, signature.symbol)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One cubin compiled in this process: the kernel function's name, its arch, and the seconds it took."""

    kernel: str
    arch: str
    seconds: float


class KernelCompiler:
    """Notes launches at trace time and compiles them on a thread pool when a lowering first needs one.

    Args:
      compile_fn: compile_fn(kernel, constraints, arch) -> (symbol, cubin) (default: `compile_cubin`).
      max_workers: compiles at once (default: the machine's CPU count).
    """

    def __init__(self, compile_fn: CompileFn = compile_cubin, max_workers: int | None = None):
        self._compile_fn = compile_fn
        self._max_workers = max_workers or os.cpu_count() or 1
        self._lock = threading.Lock()
        # cuda.tile.jax's key -> (kernel, constraints), in the order noted; (arch, that key) -> its compile.
        self._pending: dict[tuple, tuple] = {}
        self._futures: dict[tuple, concurrent.futures.Future] = {}
        self._log: list[Compiled] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def note(self, kernel, args) -> None:
        """Records a `cutile_call(grid, kernel, args)` about to be traced, for a later lowering (no compile
        starts before a lowering asks for one, nor needs a GPU: the lowering's arch applies)."""
        constraints = _compat.launch_constraints(kernel, args)
        with self._lock:
            self._pending.setdefault(_compat.compile_key(kernel, constraints), (kernel, constraints))

    def compile(self, kernel, constraints) -> tuple[str, bytes]:
        """(symbol, cubin): what a lowering calls on a miss of cuda.tile.jax's cache. Submits every noted
        launch to the pool, then waits for this one, or compiles it in this thread if no worker has begun
        it (the pool may be busy with launches the lowering needs later, or never). A compile that failed
        is tried again, as cuda.tile.jax would."""
        arch = _compat.sm_arch()
        key = (arch, _compat.compile_key(kernel, constraints))
        with self._lock:
            self._pending.pop(key[1], None)
            future = self._futures.get(key)
            inline = future is None or future.cancel() or (future.done() and future.exception() is not None)
            if inline:  # a running future: no other caller cancels it in turn
                future = self._futures[key] = concurrent.futures.Future()
                future.set_running_or_notify_cancel()
            for other, (other_kernel, other_constraints) in self._pending.items():
                if (arch, other) not in self._futures:
                    self._submit((arch, other), other_kernel, other_constraints)
            self._pending.clear()
        if inline:
            try:
                future.set_result(self._run(arch, kernel, constraints))
            except BaseException as error:  # noqa: BLE001  re-raised below, to every caller waiting for it
                future.set_exception(error)
        return future.result()

    def discard_pending(self) -> None:
        """Forgets the launches noted but not yet submitted: programs that were traced and will not be
        lowered (so that a later lowering does not compile their kernels too)."""
        with self._lock:
            self._pending.clear()

    def compile_log(self) -> list[Compiled]:
        """The cubins compiled so far, in the order they finished."""
        with self._lock:
            return list(self._log)

    def _submit(self, key: tuple, kernel, constraints) -> None:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(self._max_workers,
                                                                   thread_name_prefix="cutile-compile")
        self._futures[key] = self._executor.submit(self._run, key[0], kernel, constraints)

    def _run(self, arch: str, kernel, constraints) -> tuple[str, bytes]:
        began = time.perf_counter()
        result = self._compile_fn(kernel, constraints, arch)
        record = Compiled(kernel._annotated_function.pyfunc.__name__, arch, time.perf_counter() - began)
        with self._lock:
            self._log.append(record)
        return result


_active = KernelCompiler()


def note(kernel, args) -> None:
    """`KernelCompiler.note` on the active compiler."""
    _active.note(kernel, args)


def discard_pending() -> None:
    """`KernelCompiler.discard_pending` on the active compiler."""
    _active.discard_pending()


def compile_log() -> list[Compiled]:
    """The cubins the active compiler has compiled in this process."""
    return _active.compile_log()


@contextlib.contextmanager
def using(compiler: KernelCompiler) -> Iterator[KernelCompiler]:
    """Makes `compiler` the active one for the duration, with cuda.tile.jax's in-process cache emptied
    (so that every kernel is compiled by it) and restored after (so that its cubins stay its own)."""
    global _active
    previous, _active = _active, compiler
    try:
        with _compat.empty_lowering_cache():
            yield compiler
    finally:
        _active = previous


_compat.route_lowering_compiles(lambda kernel, constraints: _active.compile(kernel, constraints))
