"""A NumPy emulation of the cuda.tile ops our kernels use, to run their bodies block by block on CPU.

It checks what a compile cannot: index math, masks, padding, the order of a Launch's arguments. Inside
`emulated()` the `ct` name of every loaded `jax_mamba2.kernels` module is this module (or its float64
variant); `run_plan` then calls each launch's Python kernel function once per grid block, on NumPy arrays.
With `float64=True` every float dtype (tf32 included) is float64, so an algorithm's algebra can be checked
against a float64 reference to ~1e-10.

Semantics follow cuda/tile/_stub.py, made strict where the GPU would be silently wrong:
- `load` takes a tile index; out-of-bounds elements are 0 with PaddingMode.ZERO and NaN (ints: INT_MIN)
  without it, so an unpadded out-of-bounds read poisons the result; a tile lying wholly outside the
  array raises (undefined behaviour on the GPU).
- `store` drops out-of-bounds elements; plan buffers start as NaN, so a value never written shows up.
- `gather` / `scatter` take element indices: out of bounds (negative too) or masked off, a gather gives
  padding_value and a scatter writes nothing.
- `mma` requires equal operand dtypes and accumulates in float64 (then casts to the accumulator dtype).
- `tiled_view(...).atomic_store_add` adds in place; `run_plan` runs blocks one at a time in grid order, so no
  ordering is exercised.
- `atomic_add` is atomic under a lock; memory orders are accepted and not modelled (each block runs in one thread,
  which sees its own writes in order, and the lock orders the atomics). Kernels whose blocks wait on each other
  (a grid barrier) run with `run_concurrently`: every block a thread of its own.
Not emulated: tf32 rounding (tfloat32 is float32), latency/TMA hints, reduction order.
"""
import builtins
import contextlib
import functools
import itertools
import sys
import threading
import time
import types

import ml_dtypes
import numpy as np

from jax_mamba2.kernels._common import kernel_signature

float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
tfloat32 = float32
int32 = np.dtype(np.int32)
int64 = np.dtype(np.int64)

PaddingMode = types.SimpleNamespace(UNDETERMINED="undetermined", ZERO="zero")
MemoryOrder = types.SimpleNamespace(WEAK="weak", RELAXED="relaxed", ACQUIRE="acquire", RELEASE="release",
                                    ACQ_REL="acq_rel")
MemoryScope = types.SimpleNamespace(NONE="none", BLOCK="block", CLUSTER="cluster", DEVICE="device", SYS="sys")


class _BlockIndex(threading.local):
    """The running block's index and the grid, per thread (`run_concurrently` runs each block in a thread)."""

    block = (0, 0, 0)
    grid = (1, 1, 1)


_current = _BlockIndex()
_RUN_LOCK = threading.Lock()
_ATOMIC_LOCK = threading.Lock()


def bid(axis):
    return _current.block[axis]


def num_blocks(axis):
    return _current.grid[axis]


def cdiv(a, b):
    return -(-a // b)


def static_eval(value):
    return value


def _as_shape(shape):
    return tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)


def _tile_window(array, index, shape):
    """(in-bounds source slices, destination slices) of the tile `index` of `shape` in `array`."""
    index, shape = tuple(int(i) for i in _as_shape(index)), _as_shape(shape)
    assert len(index) == len(shape) == array.ndim, (index, shape, array.shape)
    src, dst = [], []
    for i, s, n in zip(index, shape, array.shape):
        start = i * s
        assert 0 <= start < n, f"tile {index} of shape {shape} lies outside array {array.shape}"
        stop = min(start + s, n)
        src.append(slice(start, stop))
        dst.append(slice(0, stop - start))
    return tuple(src), tuple(dst)


def load(array, index, shape, *, order="C", padding_mode=PaddingMode.UNDETERMINED, check_bounds=True,
         latency=None, allow_tma=None):
    assert order == "C", "the emulator only loads in C order"
    assert latency is None or 1 <= latency <= 10, latency
    shape = _as_shape(shape)
    if padding_mode == PaddingMode.ZERO:
        fill = 0
    else:
        fill = np.nan if np.issubdtype(array.dtype, np.floating) or array.dtype == bfloat16 \
            else np.iinfo(array.dtype).min
    tile = np.full(shape, fill, dtype=array.dtype)
    src, dst = _tile_window(array, index, shape)
    tile[dst] = array[src]
    return tile


def store(array, index, tile, *, order="C", check_bounds=True, latency=None, allow_tma=None):
    assert order == "C", "the emulator only stores in C order"
    tile = np.asarray(tile)
    src, dst = _tile_window(array, index, tile.shape)
    array[src] = tile[dst].astype(array.dtype)


def _element_indices(array, indices, mask):
    """(broadcast index arrays, in-bounds-and-mask selector) of a gather / scatter."""
    indices = indices if isinstance(indices, tuple) else (indices,)
    assert len(indices) == array.ndim, (len(indices), array.shape)
    indices = np.broadcast_arrays(*(np.asarray(i, np.int64) for i in indices))
    ok = np.ones(indices[0].shape, bool) if mask is None else np.broadcast_to(np.asarray(mask), indices[0].shape)
    for i, n in zip(indices, array.shape):
        ok = ok & (i >= 0) & (i < n)
    return indices, ok


def gather(array, indices, *, mask=None, padding_value=0, check_bounds=True, latency=None):
    """array[indices] element-wise; padding_value where masked off or out of bounds (negative too)."""
    indices, ok = _element_indices(array, indices, mask)
    tile = np.full(indices[0].shape, padding_value, dtype=array.dtype)
    tile[ok] = array[tuple(i[ok] for i in indices)]
    return tile


def scatter(array, indices, value, *, mask=None, check_bounds=True, latency=None):
    """array[indices] = value element-wise, dropping what is masked off or out of bounds."""
    indices, ok = _element_indices(array, indices, mask)
    value = np.broadcast_to(np.asarray(value), indices[0].shape)
    array[tuple(i[ok] for i in indices)] = value[ok].astype(array.dtype)


def atomic_add(array, indices, update, *, check_bounds=True, memory_order=None, memory_scope=None):
    """array[indices] += update element-wise and atomically; returns the elements before the addition."""
    indices, ok = _element_indices(array, indices, None)
    assert ok.all(), "an atomic out of bounds"
    with _ATOMIC_LOCK:
        old = array[indices].copy()
        array[indices] = old + np.asarray(update, array.dtype)
    return old


def static_iter(iterable):
    return iterable


def grid_dependency_control_wait():
    """Blocks run after every block of the launch before them here: nothing to wait for."""


def grid_dependency_control_launch_dependents():
    """Launches run one after another here: nothing to release."""


def zeros(shape, dtype):
    return np.zeros(_as_shape(shape), dtype)


def full(shape, fill_value, dtype):
    return np.full(_as_shape(shape), fill_value, dtype)


def arange(size, *, dtype, start=0, step=1):
    return (start + step * np.arange(size)).astype(dtype)


def where(cond, x, y):
    return np.where(cond, x, y)


def _quiet(fn):
    def wrapped(*args, **kwargs):
        with np.errstate(over="ignore", under="ignore"):
            return fn(*args, **kwargs)
    return wrapped


exp = _quiet(np.exp)


@_quiet
def exp2(x, *, flush_to_zero=False):
    y = np.exp2(x)
    return np.where(y < np.finfo(np.float32).tiny, np.zeros_like(y), y) if flush_to_zero else y


@_quiet
def truediv(x, y, *, rounding_mode=None, flush_to_zero=False):
    """x / y; the approximate (2 ulp) division of the GPU is within the f32 rounding of the checks."""
    return np.true_divide(x, y)


class RoundingMode:
    FULL = "full"
    APPROX = "approx"


log = _quiet(np.log)


@_quiet
def rsqrt(x, *, flush_to_zero=False):
    return 1 / np.sqrt(x)


def minimum(x, y, *, propagate_nan=False):
    """As cuTile's: a NaN operand gives the other one unless propagate_nan."""
    return (np.minimum if propagate_nan else np.fmin)(x, y)


def maximum(x, y, *, propagate_nan=False):
    """As cuTile's: a NaN operand gives the other one unless propagate_nan."""
    return (np.maximum if propagate_nan else np.fmax)(x, y)


def cumsum(x, axis=0, *, reverse=False):
    if reverse:
        return np.flip(np.cumsum(np.flip(x, axis), axis=axis, dtype=x.dtype), axis)
    return np.cumsum(x, axis=axis, dtype=x.dtype)


def sum(x, axis=None, *, keepdims=False):  # noqa: A001 - mirrors ct.sum
    return np.sum(x, axis=axis, keepdims=keepdims, dtype=x.dtype)


def max(x, axis=None, *, keepdims=False):  # noqa: A001 - mirrors ct.max
    return np.max(x, axis=axis, keepdims=keepdims)


def permute(x, axes):
    return np.transpose(x, axes)


def extract(x, index, shape):
    index, shape = _as_shape(index), _as_shape(shape)
    return x[tuple(slice(i * s, (i + 1) * s) for i, s in zip(index, shape))].copy()


def cat(tiles, axis):
    first, second = tiles
    assert first.shape == second.shape and first.dtype == second.dtype, "ct.cat takes two tiles of one shape"
    return np.concatenate((first, second), axis=axis)


def mma(x, y, acc):
    assert x.dtype == y.dtype, f"ct.mma operands must share a dtype, got {x.dtype} and {y.dtype}"
    assert acc.dtype == float32, acc.dtype
    return (x.astype(np.float64) @ y.astype(np.float64) + acc).astype(acc.dtype)


class _EmulatedArray(np.ndarray):
    """A NumPy array with the `slice`, `foreign_pointer` and `tiled_view(...).atomic_store_add` of a cuda.tile
    Array."""

    @property
    def foreign_pointer(self):
        """The array itself stands for its base pointer (`Array.from_foreign` views its memory)."""
        return self

    def slice(self, axis, start, stop):
        """The zero-copy view [start, stop) of `axis`, with cuda.tile's bounds (0 <= start < N, start <= stop
        <= N)."""
        axis = int(axis) % self.ndim
        start, stop = int(start), int(stop)
        assert 0 <= start < self.shape[axis] and start <= stop <= self.shape[axis], (axis, start, stop, self.shape)
        return self[(slice(None),) * axis + (slice(start, stop),)]

    def tiled_view(self, tile_shape, *, padding_mode=None, traversal_steps=None):
        assert traversal_steps is None
        return _TiledView(self, tuple(tile_shape))


class Array:
    """cuda.tile's Array where kernels call it: `Array.from_foreign`."""

    @staticmethod
    def from_foreign(pointer, shape, strides):
        """The array of `shape` and element `strides` at `pointer`'s address (a view of its memory), which must lie
        within the array the pointer came from (cuda.tile cannot check it; the GPU would read or write past it)."""
        shape = tuple(int(n) for n in shape)
        strides = tuple(int(n) for n in strides)
        assert pointer.flags.c_contiguous, "a foreign pointer of a contiguous array"
        last = builtins.sum((n - 1) * s for n, s in zip(shape, strides))  # this module's sum is ct.sum
        assert all(n > 0 for n in shape) and all(s >= 0 for s in strides) and last < pointer.size, (
            shape, strides, pointer.shape)
        view = np.lib.stride_tricks.as_strided(pointer, shape, tuple(s * pointer.itemsize for s in strides))
        return view.view(_EmulatedArray)


class _TiledView:
    def __init__(self, array, tile_shape):
        self.array, self.tile_shape = array, tile_shape

    def atomic_store_add(self, index, update):
        src, dst = _tile_window(self.array, index, self.tile_shape)
        self.array[src] += np.broadcast_to(update, self.tile_shape)[dst]


def _mma_float64(x, y, acc):
    assert x.dtype == y.dtype == acc.dtype == float64, (x.dtype, y.dtype, acc.dtype)
    return x @ y + acc


@functools.cache
def _float64_namespace():
    """This emulator with every float dtype (tf32 included) as float64."""
    ns = types.ModuleType("cutile_float64_emulator")
    ns.__dict__.update({k: v for k, v in globals().items() if not k.startswith("__")})
    ns.float16 = ns.bfloat16 = ns.float32 = ns.tfloat32 = float64
    ns.mma = _mma_float64
    return ns


@contextlib.contextmanager
def emulated(namespace=None, modules=()):
    """Within the block, every loaded jax_mamba2.kernels module, and the modules named in `modules` (e.g. a test's
    own kernel's), sees `namespace` (default: this emulator) as `ct`."""
    namespace = namespace or sys.modules[__name__]
    patched = {name: module for name, module in sys.modules.items()
               if (name.startswith("jax_mamba2.kernels") or name in modules) and hasattr(module, "ct")}
    originals = {name: module.ct for name, module in patched.items()}
    for module in patched.values():
        module.ct = namespace
    try:
        yield
    finally:
        for name, module in patched.items():
            module.ct = originals[name]


def _empty(shape, dtype):
    dtype = np.dtype(dtype) if dtype != "bfloat16" else bfloat16
    return np.full(shape, np.nan if dtype.kind == "f" or dtype == bfloat16 else np.iinfo(dtype).min, dtype)


def run_plan(plan, inputs, *, float64=False):
    """Runs every launch of `plan` on NumPy `inputs` (name -> array), in the arrays' own dtypes or, with
    `float64`, every float array and buffer as float64. Buffers start as NaN (ints: INT_MIN), or zeros
    where zero_init.

    Returns:
      name -> array for every input and buffer after the last launch.
    """
    def as_array(a):
        a = np.asarray(a)
        is_float = a.dtype.kind == "f" or a.dtype == bfloat16
        return (a.astype(np.float64) if float64 and is_float else a).view(_EmulatedArray)

    arrays = {name: as_array(a) for name, a in inputs.items()}
    for name, buf in plan.buffers.items():
        empty = _empty(buf.shape, "float64" if float64 and buf.dtype != "int32" else buf.dtype)
        arrays[name] = (np.zeros_like(empty) if buf.zero_init else empty).view(_EmulatedArray)
    for launch in plan.launches:
        launch_blocks(launch, [arrays[a] if isinstance(a, str) else a for a in launch.args], float64=float64)
    return {name: np.asarray(a) for name, a in arrays.items()}


def launch_blocks(launch, args, *, float64=False):
    """Runs one launch's blocks one after another on `args` (the kernel's arguments: NumPy arrays, written in
    place, and constants)."""
    pyfunc = kernel_signature(launch.kernel).pyfunc
    args = [np.asarray(a).view(_EmulatedArray) if isinstance(a, np.ndarray) else a for a in args]
    grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
    # One launch at a time: `emulated` swaps the kernel modules' `ct` for all threads, and host
    # callbacks (jax.pure_callback under shard_map) run on several threads at once.
    with _RUN_LOCK, emulated(_float64_namespace() if float64 else None, modules=(pyfunc.__module__,)):
        for block in itertools.product(*(range(n) for n in grid)):
            _current.block, _current.grid = block, grid
            pyfunc(*args)


def run_concurrently(pyfunc, args, grid, *, timeout_s=120.0):
    """Calls `pyfunc(*args)` (a kernel's Python function whose `ct` is this module) once per block of `grid`, every
    block in a thread of its own, all started before any is joined: what a kernel whose blocks wait for each other
    needs (on the GPU, every block resident at once). Raises if a block raised or is still running after
    `timeout_s` (a wait that never ends)."""
    grid = tuple(grid) + (1,) * (3 - len(grid))
    failures = []

    def run(block):
        _current.block, _current.grid = block, grid
        try:
            pyfunc(*args)
        except BaseException as e:  # noqa: BLE001  re-raised below, in the caller's thread
            failures.append((block, e))

    threads = [threading.Thread(target=run, args=(block,), daemon=True)
               for block in itertools.product(*(range(n) for n in grid))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(builtins.max(0.0, deadline - time.monotonic()))  # this module's max is ct.max
    stuck = [t for t in threads if t.is_alive()]
    assert not stuck, f"{len(stuck)} of {len(threads)} blocks still running after {timeout_s} s"
    if failures:
        raise failures[0][1]


def jax_run_plan(plan, arrays, *, float64=True):
    """A bridge RunPlan (jax_mamba2.bridge.ffi.run_plan's signature): `plan` on this emulator through
    `jax.pure_callback` (in float64 by default), its outputs cast to the plan's dtypes; inputs a launch writes
    are copied first, as the FFI path leaves the caller's arrays unchanged. Works under jit, vmap rules, shard_map
    (per shard) and remat like the FFI path."""
    import jax
    import jax.numpy as jnp

    names = list(plan.inputs)
    shapes = [jax.ShapeDtypeStruct(arrays[n].shape, arrays[n].dtype) if n in plan.inputs
              else jax.ShapeDtypeStruct(plan.buffers[n].shape, jnp.dtype(plan.buffers[n].dtype))
              for n in plan.outputs]

    written = {name for launch in plan.launches for name in launch.writes}

    def host(*values):
        # An input a launch writes (decode_mixer's state stacks) is an InputOutput of the FFI path: the kernel
        # writes a buffer XLA gives it, never the caller's array. The callback's arguments are read-only views
        # of JAX's arrays, which run_plan in the arrays' own dtypes would write (float64 mode converts, so copies,
        # every float input), so such inputs are copied.
        inputs = {n: np.array(v) if n in written else np.asarray(v) for n, v in zip(names, values)}
        out = run_plan(plan, inputs, float64=float64)
        return tuple(out[n].astype(s.dtype) for n, s in zip(plan.outputs, shapes))

    return dict(zip(plan.outputs, jax.pure_callback(host, shapes, *(arrays[n] for n in names))))
