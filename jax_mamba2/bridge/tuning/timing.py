"""Timing the configs of a stage on the GPU: its plan run on random inputs through torch or CuPy arrays.

Tuning runs in Python when `ssd` (or its VJP) is traced, outside the traced computation, on a side stream,
with `cuda.tile.tune.exhaustive_search` on random inputs of the problem's shapes (`random_inputs`, viewed
zero-copy as torch/CuPy arrays). A plan's stages are tuned in order, each on the intermediates of the
stages before it run with their chosen configs (so chunk_cumsum_bwd is timed reading the ddA layouts of the
chosen chunk_scan_bwd_dc and chunk_state_bwd tilings, although its key does not name them). Every timed run
sees its buffers as the plan would: a buffer the plan zero-initialises (the atomic dB/dC sums) is zeroed
before each run that writes it, and a config that changes a buffer's shape (BLOCK_M of ddA_intra) gets a
scratch buffer of that shape.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib
import logging
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import cuda.tile as ct
import jax
import jax.numpy as jnp

from jax_mamba2.bridge.tuning import precompile
from jax_mamba2.bridge.tuning.cache_keys import STAGES
from jax_mamba2.kernels import backward as backward_kernels
from jax_mamba2.kernels import forward as forward_kernels
from jax_mamba2.kernels._common import Buffer, Launch, Plan, SSDDims

logger = logging.getLogger(__name__)

# Per tileiras run; a config whose compile takes longer is a spill case not worth waiting for.
COMPILE_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """A plan the tuner resolves stage by stage: the forward in one layout, or the backward in one mode.

    `stages` are in launch order (stage i is launch i of `plan(dims, configs)`); `inputs(dims)` gives
    the shape and dtype of the plan's inputs.
    """

    stages: tuple[str, ...]
    plan: Callable[[SSDDims, Mapping[str, Any]], Plan]
    inputs: Callable[[SSDDims], dict[str, Buffer]]
    deterministic: bool = False


def config_fields(cfg) -> dict:
    """A config as the JSON object the cache stores."""
    return dataclasses.asdict(cfg)


def config_from_entry(stage: str, dims: SSDDims, entry: dict, arch: str):
    """The config a cache entry names, as the member of the stage's search space for `dims` and `arch`
    that equals it; None where it fits no member (fields of another config class, or values the space
    does not hold)."""
    try:
        config = STAGES[stage].config_type(**entry["config"])
    except (KeyError, TypeError, ValueError):
        return None
    space = search_space(stage, dims, arch)
    return space[space.index(config)] if config in space else None


def search_space(stage: str, dims: SSDDims, arch: str) -> list:
    """The configs the tuner times for `stage`: its space for `arch`, the default first where the space
    lacks it."""
    spec = STAGES[stage]
    space = list(dict.fromkeys(spec.space(dims, arch)))
    default = spec.default(dims)
    return space if default in space else [default, *space]


def random_inputs(dims: SSDDims, *, backward: bool = False, seed: int = 0) -> dict[str, jax.Array]:
    """Random inputs of the forward plan (kernels.forward.forward_inputs), or of the backward's.

    Values are realistic: Δ = softplus(N(-3, 1)) after the kernel's own dt transform (dt_bias = 0),
    A = -exp(U(-2, 1)), seq_idx four packed sequences of equal length, and every other input
    (x, B, C, z, D, initial_states, dout, dfinal_states) ~ N(0, 1). The arrays are concrete even when
    called while a jit is being traced (where tuning runs).
    """
    inputs = backward_kernels.backward_inputs if backward else forward_kernels.forward_inputs
    return _random_arrays(dims, inputs(dims), seed)


def _random_arrays(dims: SSDDims, buffers: Mapping[str, Buffer], seed: int = 0) -> dict[str, jax.Array]:
    with jax.ensure_compile_time_eval():
        keys = jax.random.split(jax.random.PRNGKey(seed), len(buffers))
        return {name: _random_input(name, buf, key, dims)
                for (name, buf), key in zip(buffers.items(), keys)}


def _random_input(name: str, buf: Buffer, key, dims: SSDDims) -> jax.Array:
    if name == "dt":
        raw = jax.random.normal(key, buf.shape, jnp.float32) - 3.0
        value = raw if dims.dt_softplus else jax.nn.softplus(raw)
    elif name == "A":
        value = -jnp.exp(jax.random.uniform(key, buf.shape, jnp.float32, -2.0, 1.0))
    elif name == "dt_bias":
        value = jnp.zeros(buf.shape, jnp.float32)
    elif name == "seq_idx":
        value = jnp.broadcast_to((jnp.arange(buf.shape[1]) * 4) // buf.shape[1], buf.shape)
    else:
        value = jax.random.normal(key, buf.shape, jnp.float32)
    return value.astype(buf.dtype)


def array_library():
    """torch if importable, else CuPy, else None: what ct.launch gets the tuning arrays as.

    torch comes first because ct.launch takes its bfloat16 tensors natively, while CuPy's bfloat16
    (through ml_dtypes) does not export through DLPack in every CuPy release.
    """
    for name in ("torch", "cupy"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def _device_views(arrays: dict[str, jax.Array], library) -> dict:
    """Zero-copy torch/CuPy views (DLPack) of JAX device arrays, for ct.launch."""
    jax.block_until_ready(arrays)
    return {name: library.from_dlpack(arr) for name, arr in arrays.items()}


def _side_stream(library):
    if library.__name__ == "torch":
        return library.cuda.Stream()
    return library.cuda.Stream(non_blocking=True)


def _zero_on_stream(views: Iterable, library, stream) -> None:
    """Zeroes torch/CuPy arrays in `stream` order (before the stream's next kernel)."""
    views = list(views)
    if not views:
        return
    if library.__name__ == "torch":
        with library.cuda.stream(stream):
            for view in views:
                view.zero_()
    else:
        with stream:
            for view in views:
                view.fill(0)


class _BufferPool:
    """Device buffers for the plans run while tuning, one per (name, shape, dtype).

    Plans that differ only in one stage's config share every buffer whose shape that config leaves
    unchanged; a config that changes a buffer's shape gets its own (scratch) buffer.
    """

    def __init__(self, library):
        self._library = library
        self._views: dict[tuple, Any] = {}

    def views(self, buffers: Mapping[str, Buffer]) -> dict:
        """{name: torch/CuPy view} for every buffer, allocating (as zeros) those not seen yet."""
        for name, buf in buffers.items():
            if (name, buf.shape, buf.dtype) not in self._views:
                with jax.ensure_compile_time_eval():
                    zeros = jnp.zeros(buf.shape, buf.dtype)
                self._views[(name, buf.shape, buf.dtype)] = _device_views({name: zeros},
                                                                         self._library)[name]
        return {name: self._views[(name, buf.shape, buf.dtype)] for name, buf in buffers.items()}


def _launch_args(launch: Launch, arrays: dict) -> tuple:
    return tuple(arrays[a] if isinstance(a, str) else a for a in launch.args)


@dataclasses.dataclass(frozen=True)
class _TimedLaunch:
    """One config of a stage, ready to time: its launch, the arrays it names, and those to zero
    before every run (the buffers it writes that the plan zero-initialises, e.g. atomic sums)."""

    launch: Launch
    arrays: dict
    zeroed: tuple


def _timed_launch(plan: Plan, index: int, inputs: dict, pool: _BufferPool) -> _TimedLaunch:
    launch = plan.launches[index]
    arrays = {**inputs, **pool.views(plan.buffers)}
    zeroed = tuple(arrays[name] for name in launch.writes
                   if name in plan.buffers and plan.buffers[name].zero_init)
    return _TimedLaunch(launch, arrays, zeroed)


def _measurement_record(measurement) -> dict:
    return {"config": config_fields(measurement.config), "mean_us": measurement.mean_us,
            "error_us": measurement.error_margin_us, "samples": measurement.num_samples}


class _LoggedProgress:
    """What stands in for a tqdm bar without tqdm: a log line at the start and at the end."""

    def __init__(self, total: int, desc: str, unit: str):
        self.total, self.desc, self.unit, self.n = total, desc, unit, 0

    def __enter__(self):
        logger.info("%s: %d %ss", self.desc, self.total, self.unit)
        return self

    def __exit__(self, *exc):
        logger.info("%s: %d of %d %ss done", self.desc, self.n, self.total, self.unit)
        return False

    def update(self, n: int = 1) -> None:
        self.n += n


def progress_bar(total: int, desc: str, unit: str):
    """A tqdm progress bar (a context manager with `update(n)`) where tqdm is installed, else log lines."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _LoggedProgress(total, desc, unit)
    return tqdm(total=total, desc=desc, unit=unit)


def _tune_one(stage: str, dims: SSDDims, timed: Mapping[Any, _TimedLaunch], library, stream) -> dict:
    """Runs exhaustive_search over `timed` (config -> its launch) on the GPU; returns the cache entry."""
    space = list(timed)
    with progress_bar(len(space), f"jax_mamba2 tuning {stage}", "config") as bar:
        def kernel_of(cfg):  # called once per config, before its compile: drives the bar
            bar.update(1)
            return timed[cfg].launch.kernel

        def args_of(cfg):  # called before every run of `cfg`
            _zero_on_stream(timed[cfg].zeroed, library, stream)
            return _launch_args(timed[cfg].launch, timed[cfg].arrays)

        start = time.perf_counter()
        with ct.compiler_timeout(COMPILE_TIMEOUT_S), precompile.compiled_ahead(
                [(t.launch.kernel, t.launch.grid, _launch_args(t.launch, t.arrays)) for t in timed.values()],
                lambda kernel, grid, args: ct.launch(stream, grid, kernel, args)):
            result = ct.tune.exhaustive_search(
                space, stream, lambda cfg: timed[cfg].launch.grid, kernel_of, args_of, quiet=True)
        seconds = time.perf_counter() - start
    logger.info("jax_mamba2 tuning %s for %s:\n%s", stage, dims, result.summary())
    default = STAGES[stage].default(dims)
    default_us = next((m.mean_us for m in result.successes if m.config == default), None)
    return {
        "config": config_fields(result.best.config),
        "mean_us": result.best.mean_us,
        "default_mean_us": default_us,
        "measured": sorted((_measurement_record(m) for m in result.successes),
                           key=lambda r: r["mean_us"]),
        "failures": [{"config": config_fields(cfg), "error": f"{exc.__name__}: {msg}"[:500]}
                     for cfg, exc, msg in result.failures],
        "tuned_on": {k: (list(v) if isinstance(v, tuple) else v)
                     for k, v in dataclasses.asdict(dims).items()},
        "tuning_s": seconds,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def tune_stages(dims: SSDDims, spec: PlanSpec, stages: list[str], configs: Mapping[str, Any],
                arch: str) -> Iterator[tuple[str, dict]]:
    """Tunes `stages` of `spec`'s plan (in plan order) on the GPU; yields (stage, entry) as each finishes.

    `configs` holds the config of every stage of the plan (the starting point for those tuned). Before
    a stage is tuned, the stages before it run with their configs (the winners, for those just tuned),
    so it is timed on real intermediate inputs; a stage writes only its own buffers, so re-running it
    leaves the inputs of the others valid. Everything runs on a side stream, synchronised at the end.
    """
    library = array_library()
    stream = _side_stream(library)
    inputs = _device_views(_random_arrays(dims, spec.inputs(dims)), library)
    pool = _BufferPool(library)
    configs = dict(configs)
    for index, stage in enumerate(spec.stages):
        if stage not in stages:
            continue
        base = spec.plan(dims, configs)
        arrays = {**inputs, **pool.views(base.buffers)}
        _zero_on_stream((arrays[n] for n, buf in base.buffers.items() if buf.zero_init), library, stream)
        for launch in base.launches[:index]:
            ct.launch(stream, launch.grid, launch.kernel, _launch_args(launch, arrays))
        timed = {cfg: _timed_launch(spec.plan(dims, {**configs, stage: cfg}), index, inputs, pool)
                 for cfg in search_space(stage, dims, arch)}
        entry = _tune_one(stage, dims, timed, library, stream)
        configs[stage] = config_from_entry(stage, dims, entry, arch)
        yield stage, entry
    stream.synchronize()


def array_library_missing_reason() -> Optional[str]:
    """Why tuning cannot time here for want of an array library (None when torch or CuPy is installed)."""
    if array_library() is None:
        return "neither torch nor CuPy is installed (pip install 'jax-mamba2[cuda]')"
    return None
