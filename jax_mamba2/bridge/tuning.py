"""Kernel configs per problem for the SSD forward and backward: in-process dict -> on-disk cache -> autotune.

`forward_configs(dims)` returns the forward's layout and the config of each of its stages
(FORWARD_LAYOUTS[layout]; where several layouts can run a problem, each is resolved and the one whose
stages measured faster in sum wins, else kernels.forward.forward_layout's rule) and
`backward_configs(dims, deterministic)` that of every backward stage (kernels.backward.BACKWARD_STAGES)
for this problem on this GPU. Lookup order, per stage:

1. an in-process dict;
2. a JSON file in `$JAX_MAMBA2_CACHE_DIR` (default `~/.cache/jax_mamba2/`), one file per GPU name,
   cuda-tile version, jax-mamba2 version and a fingerprint of the kernels' source (a changed kernel
   must not inherit configs tuned for the old one);
3. if `$JAX_MAMBA2_AUTOTUNE` is unset or "1" and a CUDA GPU with torch or CuPy is present: tune now
   with `cuda.tile.tune.exhaustive_search` on random inputs of the problem's shapes (`random_inputs`,
   viewed zero-copy as torch/CuPy arrays), store the winner and what every config measured, and use
   it;
4. otherwise (tuning off, no GPU, neither torch nor CuPy, or a problem under MIN_TUNED_TOKEN_HEADS
   (token, head) pairs, which is launch-bound) the stage's default config (its kernels Stage declaration).

The backward's recompute stages (chunk_cumsum, chunk_state) take the forward's configs when the forward
runs them (one cache entry serves both passes); under the fused forward layout chunk_state is looked up
or tuned with the backward. Its own stages are tuned in plan order, each on the intermediates of the
stages before it run with their chosen configs (so chunk_cumsum_bwd is timed reading the ddA layouts
of the chosen chunk_scan_bwd_dc and chunk_state_bwd tilings, although its key does not name them).

`JAX_MAMBA2_AUTOTUNE=0` turns off tuning, not the cache: point `JAX_MAMBA2_CACHE_DIR` at an empty
directory as well to get the defaults everywhere.

Cache keys name the stage, the SSDDims fields its kernel specialises on (its Stage's key_fields), the
heads per block of the backward's group-reducing stages (which deterministic mode changes), the index
width, and a power-of-two bucket of the stage's independent work items. Batch and seqlen are
deliberately not in the keys (as in mamba_ssm's Triton autotune keys): only their bucket is, so a
training run with varying lengths tunes once per bucket, not once per call.

Tuning runs in Python when `ssd` (or its VJP) is first traced for a problem, outside the traced
computation, on a side stream. Every timed run sees its buffers as the plan would: a buffer the plan
zero-initialises (the atomic dB/dC sums) is zeroed before each run that writes it, and a config that
changes a buffer's shape (BLOCK_M of ddA_intra) gets a scratch buffer of that shape. Writers hold an
fcntl lock on `<file>.lock`, re-read the file under it, tune only the keys still missing and replace
the file atomically (temp file + os.replace), so concurrent processes never corrupt it nor tune one
key twice; readers need no lock. A tuning failure (no memory, a compiler error in every config) warns
and falls back to the defaults: it never breaks the program.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Optional

import cuda.tile as ct
import jax
import jax.numpy as jnp

from jax_mamba2.kernels import _common
from jax_mamba2.kernels import backward as backward_kernels
from jax_mamba2.kernels import forward as forward_kernels
from jax_mamba2.kernels._common import SUPPORTED_ARCHS, Buffer, Launch, Plan, SSDDims

logger = logging.getLogger(__name__)

ENV_AUTOTUNE = "JAX_MAMBA2_AUTOTUNE"
ENV_CACHE_DIR = "JAX_MAMBA2_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/jax_mamba2")
# Per tileiras run; a config whose compile takes longer is a spill case not worth waiting for.
COMPILE_TIMEOUT_S = 30.0
# Problems with fewer (token, head) pairs use the defaults untuned: they are launch-bound (a few us
# per kernel), and tuning one costs minutes of compiles, which would dominate small jobs and tests.
MIN_TUNED_TOKEN_HEADS = 1 << 17
CACHE_SCHEMA = 1


# Every stage the plans run, by name: its declaration (config type, space, default, key fields).
_STAGES = {**forward_kernels.STAGES, **backward_kernels.STAGES}


@dataclasses.dataclass(frozen=True)
class _PlanSpec:
    """A plan the tuner resolves stage by stage: the forward, or the backward in one determinism mode.

    `stages` are in launch order (stage i is launch i of `plan(dims, configs)`); `inputs(dims)` gives
    the shape and dtype of the plan's inputs.
    """

    stages: tuple[str, ...]
    plan: Callable[[SSDDims, Mapping[str, Any]], Plan]
    inputs: Callable[[SSDDims], dict[str, Buffer]]
    deterministic: bool = False


_FORWARD = {
    layout: _PlanSpec(stages, functools.partial(forward_kernels.forward_plan, layout=layout),
                      forward_kernels.forward_inputs)
    for layout, stages in forward_kernels.FORWARD_LAYOUTS.items()}
_BACKWARD = {
    det: _PlanSpec(backward_kernels.BACKWARD_STAGES,
                   functools.partial(backward_kernels.backward_plan, deterministic=det),
                   backward_kernels.backward_inputs, deterministic=det)
    for det in (False, True)}
# The backward stages that recompute forward quantities: they take the forward's configs.
_RECOMPUTED = tuple(s for s in backward_kernels.STAGES if s in forward_kernels.STAGES)


class GpuIdentity(NamedTuple):
    """The GPU configs are tuned for: its name (e.g. "NVIDIA H200") and arch (e.g. "sm_90")."""

    name: str
    arch: str


@dataclasses.dataclass(frozen=True)
class StageChoice:
    """What `forward_configs` or `backward_configs` chose for one stage and where it came from.

    source: "tuned" (measured in this process), "disk" (read from the cache file), or "default"
    (`reason` says why no tuned config was used). `entry` is the cache entry (config fields,
    measurements) for tuned/disk choices, None for defaults.
    """

    stage: str
    key: str
    config: Any
    source: str
    reason: Optional[str] = None
    entry: Optional[dict] = None


# (cache file, key) -> choice: every process-local hit, so disk is read once per key.
_MEMORY: dict[tuple[str, str], StageChoice] = {}
_MEMORY_LOCK = threading.RLock()


# ----------------------------------------------------------------------------------------------
# Keys and files
# ----------------------------------------------------------------------------------------------

def stage_key(stage: str, dims: SSDDims, deterministic: bool = False) -> str:
    """The cache key of `stage` for `dims`, e.g. "chunk_state/chunk_size=256,headdim=64,...,work=128".

    `deterministic` (the backward's mode) only changes the key of stages whose launch it changes.
    """
    spec = _STAGES[stage]
    fields = [f"{name}={getattr(dims, name)}" for name in spec.key_fields]
    work = spec.work_items(dims)
    if spec.blocks_span_heads:
        heads_per_block = backward_kernels.group_heads_per_block(dims, deterministic)
        fields.append(f"heads_per_block={heads_per_block}")
        work //= heads_per_block
    fields.append(f"index64={_common.needs_int64_index(dims)}")
    fields.append(f"work={_common.next_power_of_2(work)}")
    return f"{stage}/" + ",".join(fields)


def _package_version() -> str:
    try:
        return importlib.metadata.version("jax-mamba2")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "src"


def _kernels_fingerprint() -> str:
    """A hash of the kernels' source: tuned configs are only valid for the code they ran."""
    digest = hashlib.sha256()
    for path in sorted(Path(_common.__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def cache_dir() -> Path:
    """`$JAX_MAMBA2_CACHE_DIR`, else ~/.cache/jax_mamba2."""
    return Path(os.environ.get(ENV_CACHE_DIR) or DEFAULT_CACHE_DIR).expanduser()


def cache_path(gpu: GpuIdentity) -> Path:
    """The cache file for `gpu` with this cuda-tile, jax-mamba2 and kernel source."""
    gpu_slug = re.sub(r"[^A-Za-z0-9.]+", "_", gpu.name).strip("_")
    name = (f"{gpu_slug}-{gpu.arch}-cuda_tile_{ct.__version__}-jax_mamba2_{_package_version()}"
            f"-kernels_{_kernels_fingerprint()}.json")
    return cache_dir() / name


def autotune_enabled() -> bool:
    """Whether `$JAX_MAMBA2_AUTOTUNE` allows tuning (unset or "1"; "0" disables)."""
    value = os.environ.get(ENV_AUTOTUNE, "1")
    if value not in ("0", "1"):
        raise ValueError(f"jax_mamba2 tuning: {ENV_AUTOTUNE}={value!r} must be '0' or '1'")
    return value == "1"


def _gpu_identity() -> Optional[GpuIdentity]:
    """The default JAX GPU's name and arch, or None without a CUDA device."""
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        return None
    major, minor = str(device.compute_capability).split(".")[:2]
    return GpuIdentity(name=device.device_kind, arch=f"sm_{major}{minor}")


class _TuningCache:
    """One JSON file of tuned entries ({"schema", "entries": {key: entry}}), shared by processes."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def read(self) -> dict[str, dict]:
        """The stored entries ({} when the file is missing, unreadable or of another schema)."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("schema") != CACHE_SCHEMA:
            return {}
        return dict(data.get("entries", {}))

    @contextlib.contextmanager
    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write(self, entries: dict[str, dict]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"schema": CACHE_SCHEMA, "entries": entries}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def fill(self, keys: Iterable[str], tune: Callable[[list[str]], Iterator[tuple[str, dict]]],
             usable: Callable[[str, dict], bool] = lambda key, entry: True) -> dict[str, dict]:
        """Entries for `keys`, tuning the missing (or not `usable`) ones under the file lock.

        Under the lock the file is re-read (another process may have tuned meanwhile); `tune(missing)`
        yields (key, entry) pairs, each stored as soon as it arrives. Returns the entries of `keys`
        that exist afterwards.
        """
        keys = list(keys)
        with self._locked():
            entries = self.read()
            missing = [k for k in keys if k not in entries or not usable(k, entries[k])]
            if missing:
                for key, entry in tune(missing):
                    entries[key] = entry
                    self._write(entries)
        return {k: entries[k] for k in keys if k in entries}


# ----------------------------------------------------------------------------------------------
# Tuning on the GPU
# ----------------------------------------------------------------------------------------------

def _config_fields(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _config_from_entry(stage: str, dims: SSDDims, entry: dict):
    """The stored config as the stage's dataclass, or None if it no longer fits the class."""
    cls = _STAGES[stage].config_type
    try:
        return cls(**entry["config"])
    except (KeyError, TypeError):
        return None


def _search_space(stage: str, dims: SSDDims, arch: str) -> list:
    spec = _STAGES[stage]
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


def _array_library():
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
    return {"config": _config_fields(measurement.config), "mean_us": measurement.mean_us,
            "error_us": measurement.error_margin_us, "samples": measurement.num_samples}


def _tune_one(stage: str, dims: SSDDims, timed: Mapping[Any, _TimedLaunch], library, stream) -> dict:
    """Runs exhaustive_search over `timed` (config -> its launch) on the GPU; returns the cache entry."""
    from tqdm.auto import tqdm

    space = list(timed)
    with tqdm(total=len(space), desc=f"jax_mamba2 tuning {stage}", unit="config") as bar:
        def kernel_of(cfg):  # called once per config, before its compile: drives the bar
            bar.update(1)
            return timed[cfg].launch.kernel

        def args_of(cfg):  # called before every run of `cfg`
            _zero_on_stream(timed[cfg].zeroed, library, stream)
            return _launch_args(timed[cfg].launch, timed[cfg].arrays)

        start = time.perf_counter()
        with ct.compiler_timeout(COMPILE_TIMEOUT_S):
            result = ct.tune.exhaustive_search(
                space, stream, lambda cfg: timed[cfg].launch.grid, kernel_of, args_of, quiet=True)
        seconds = time.perf_counter() - start
    logger.info("jax_mamba2 tuning %s for %s:\n%s", stage, dims, result.summary())
    default = _STAGES[stage].default(dims)
    default_us = next((m.mean_us for m in result.successes if m.config == default), None)
    return {
        "config": _config_fields(result.best.config),
        "mean_us": result.best.mean_us,
        "default_mean_us": default_us,
        "measured": sorted((_measurement_record(m) for m in result.successes),
                           key=lambda r: r["mean_us"]),
        "failures": [{"config": _config_fields(cfg), "error": f"{exc.__name__}: {msg}"[:500]}
                     for cfg, exc, msg in result.failures],
        "tuned_on": {k: (list(v) if isinstance(v, tuple) else v)
                     for k, v in dataclasses.asdict(dims).items()},
        "tuning_s": seconds,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _tune_stages(dims: SSDDims, spec: _PlanSpec, stages: list[str], configs: Mapping[str, Any],
                 arch: str) -> Iterator[tuple[str, dict]]:
    """Tunes `stages` of `spec`'s plan (in plan order) on the GPU; yields (stage, entry) as each finishes.

    `configs` holds the config of every stage of the plan (the starting point for those tuned). Before
    a stage is tuned, the stages before it run with their configs (the winners, for those just tuned),
    so it is timed on real intermediate inputs; a stage writes only its own buffers, so re-running it
    leaves the inputs of the others valid. Everything runs on a side stream, synchronised at the end.
    """
    library = _array_library()
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
                 for cfg in _search_space(stage, dims, arch)}
        entry = _tune_one(stage, dims, timed, library, stream)
        configs[stage] = _config_from_entry(stage, dims, entry)
        yield stage, entry
    stream.synchronize()


def _array_library_missing_reason() -> Optional[str]:
    if _array_library() is None:
        return "neither torch nor CuPy is installed (pip install 'jax-mamba2[cuda]')"
    return None


# ----------------------------------------------------------------------------------------------
# Lookup
# ----------------------------------------------------------------------------------------------

def _tuning_disabled_reason(dims: SSDDims) -> Optional[str]:
    if not autotune_enabled():
        return f"{ENV_AUTOTUNE}=0"
    token_heads = dims.batch * dims.seqlen * dims.nheads
    if token_heads < MIN_TUNED_TOKEN_HEADS:
        return (f"batch * seqlen * nheads={token_heads} is below {MIN_TUNED_TOKEN_HEADS}: "
                f"too small to be worth tuning")
    return _array_library_missing_reason()


def _default_choices(dims: SSDDims, stages: Iterable[str], reason: str,
                     keys: dict[str, str]) -> dict[str, StageChoice]:
    return {s: StageChoice(s, keys[s], _STAGES[s].default(dims), "default", reason=reason)
            for s in stages}


def _stored_choice(stage: str, dims: SSDDims, key: str, entry: dict, source: str):
    config = _config_from_entry(stage, dims, entry)
    return None if config is None else StageChoice(stage, key, config, source, entry=entry)


def _resolve(dims: SSDDims, spec: _PlanSpec,
             given: Optional[Mapping[str, StageChoice]] = None) -> dict[str, StageChoice]:
    """The choice of every stage of `spec`: `given` ones as they are, the others looked up or tuned."""
    given = dict(given or {})
    own = [s for s in spec.stages if s not in given]
    keys = {s: stage_key(s, dims, spec.deterministic) for s in own}
    gpu = _gpu_identity()
    if gpu is None:
        choices = _default_choices(dims, own, "no CUDA GPU is visible to JAX", keys)
    elif gpu.arch not in SUPPORTED_ARCHS:
        choices = _default_choices(dims, own, f"no tuning space for arch={gpu.arch}", keys)
    else:
        choices = _lookup(dims, spec, given, keys, gpu)
    choices.update(given)
    return {s: choices[s] for s in spec.stages}


def _lookup(dims: SSDDims, spec: _PlanSpec, given: Mapping[str, StageChoice], keys: dict[str, str],
            gpu: GpuIdentity) -> dict[str, StageChoice]:
    """Choices for the stages of `keys`: memory, then disk, then tuning, else defaults."""
    path = cache_path(gpu)
    with _MEMORY_LOCK:
        choices = {s: _MEMORY[(str(path), k)] for s, k in keys.items() if (str(path), k) in _MEMORY}
        if len(choices) < len(keys):
            cache = _TuningCache(path)
            stored = cache.read()
            for stage, key in keys.items():
                if stage not in choices and key in stored:
                    choice = _stored_choice(stage, dims, key, stored[key], "disk")
                    if choice is not None:
                        choices[stage] = choice
            missing = [s for s in keys if s not in choices]
            reason = _tuning_disabled_reason(dims)
            if missing and reason is None:
                known = {s: c.config for s, c in {**given, **choices}.items()}
                configs = {s: known[s] if s in known else _STAGES[s].default(dims)
                           for s in spec.stages}
                choices.update(_tune_into_cache(cache, dims, spec, missing, keys, configs, gpu.arch))
            for choice in choices.values():
                _MEMORY[(str(path), choice.key)] = choice
            missing = [s for s in keys if s not in choices]
            choices.update(_default_choices(dims, missing, reason or "tuning failed", keys))
    return choices


def _tune_into_cache(cache: _TuningCache, dims: SSDDims, spec: _PlanSpec, stages: list[str],
                     keys: dict[str, str], configs: dict[str, Any], arch: str) -> dict[str, StageChoice]:
    """Tunes `stages` into `cache` (or reads what another process stored meanwhile)."""
    stage_of = {keys[s]: s for s in stages}
    tuned_here = set()

    def tune(missing_keys):
        tuned_here.update(missing_keys)
        for stage, entry in _tune_stages(dims, spec, [stage_of[k] for k in missing_keys], configs, arch):
            yield keys[stage], entry

    try:
        entries = cache.fill(
            stage_of, tune,
            usable=lambda key, entry: _config_from_entry(stage_of[key], dims, entry) is not None)
    except Exception as e:  # noqa: BLE001  tuning is an optimisation: never fail the program
        warnings.warn(f"jax_mamba2: autotuning {sorted(stages)} failed ({type(e).__name__}: {e}); "
                      f"using the default configs", RuntimeWarning, stacklevel=2)
        return {}
    choices = {}
    for key, entry in entries.items():
        source = "tuned" if key in tuned_here else "disk"
        choice = _stored_choice(stage_of[key], dims, key, entry, source)
        if choice is not None:
            choices[stage_of[key]] = choice
    return choices


def _plan_us(choices: Mapping[str, StageChoice]) -> Optional[float]:
    """The summed measured time of a plan's stages (us), or None if any stage has no measurement."""
    times = [(c.entry or {}).get("mean_us") for c in choices.values()]
    return None if any(t is None for t in times) else sum(times)


def _layout_choices(dims: SSDDims) -> dict[str, dict[str, StageChoice]]:
    """The stage choices of every layout the op may run `dims` in (looked up, tuned, or defaulted)."""
    return {layout: _resolve(dims, _FORWARD[layout]) for layout in forward_kernels.forward_layouts(dims)}


def _forward_choices(dims: SSDDims) -> tuple[str, dict[str, StageChoice]]:
    """The forward's faster layout and its stage choices: when every layout has a measured time for
    every stage (tuned here or read from the cache), the one with the smaller sum of its stages' times;
    otherwise `forward_layout`'s rule decides."""
    layouts = _layout_choices(dims)
    times = {layout: _plan_us(choices) for layout, choices in layouts.items()}
    if len(layouts) > 1 and None not in times.values():
        layout = min(times, key=times.get)
    else:
        layout = forward_kernels.forward_layout(dims)
    return layout, layouts[layout]


def forward_layout_times(dims: SSDDims) -> dict[str, Optional[float]]:
    """What `forward_configs` compares: per layout that can run `dims`, the summed measured time of its
    stages' chosen configs (us), None where a stage has no measurement (tuning off or no GPU)."""
    return {layout: _plan_us(choices) for layout, choices in _layout_choices(dims).items()}


def _choices(dims: SSDDims, backward: bool, deterministic: bool) -> dict[str, StageChoice]:
    _, forward = _forward_choices(dims)
    if not backward:
        return forward
    return _resolve(dims, _BACKWARD[deterministic], {s: forward[s] for s in _RECOMPUTED if s in forward})


def forward_configs(dims: SSDDims) -> forward_kernels.ForwardConfigs:
    """The forward's layout and the config of each of its stages for `dims` on this GPU (see the module
    docstring).

    Args:
      dims: the problem, as `kernels.forward.forward_plan` takes it.

    Returns:
      (layout, {stage: config} for every stage of that layout), ready for
      `forward_plan(dims, configs, layout)`.

    Raises:
      ValueError: when $JAX_MAMBA2_AUTOTUNE is neither "0" nor "1".
    """
    layout, choices = _forward_choices(dims)
    return forward_kernels.ForwardConfigs(layout, {stage: choice.config for stage, choice in choices.items()})


def backward_configs(dims: SSDDims, deterministic: bool = False) -> dict[str, Any]:
    """The config of every backward stage for `dims` on this GPU (see the module docstring).

    The recompute stages (chunk_cumsum, chunk_state) get `forward_configs(dims)`'s configs where the
    forward has them.

    Args:
      dims: the problem, as `kernels.backward.backward_plan` takes it.
      deterministic: the plan's mode (it changes the launches of the group-reducing stages, so they
        are tuned per mode when a group has several heads).

    Returns:
      {stage: config} for every stage of kernels.backward.BACKWARD_STAGES, ready for
      `backward_plan(dims, configs, deterministic=deterministic)`.

    Raises:
      ValueError: when $JAX_MAMBA2_AUTOTUNE is neither "0" nor "1".
    """
    return {stage: choice.config for stage, choice in _choices(dims, True, deterministic).items()}


def tune_report(dims: SSDDims, *, backward: bool = False, deterministic: bool = False) -> dict[str, dict]:
    """What `forward_configs(dims)` (or `backward_configs(dims, deterministic)` with `backward`) uses
    and what was measured, per stage (JSON-ready).

    Each value has "key", "source" ("tuned", "disk" or "default"), "reason" (for defaults), "config"
    (field dict) and, for tuned or cached choices, the cache entry's "mean_us", "default_mean_us",
    "measured" (every config's mean/error in us), "failures" and "tuning_s".
    """
    report = {}
    for stage, choice in _choices(dims, backward, deterministic).items():
        report[stage] = {"key": choice.key, "source": choice.source, "reason": choice.reason,
                         **(choice.entry or {}), "config": _config_fields(choice.config)}
    return report


def clear_memory() -> None:
    """Forgets the in-process choices (the next lookup reads the disk cache again)."""
    with _MEMORY_LOCK:
        _MEMORY.clear()
