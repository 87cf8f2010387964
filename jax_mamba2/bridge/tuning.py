"""Kernel configs per problem for the SSD forward: in-process dict -> on-disk cache -> autotune.

`forward_configs(dims)` returns the config of every forward stage (kernels.forward.FORWARD_STAGES) for
this problem on this GPU. Lookup order, per stage:

1. an in-process dict;
2. a JSON file in `$JAX_MAMBA2_CACHE_DIR` (default `~/.cache/jax_mamba2/`), one file per GPU name,
   cuda-tile version, jax-mamba2 version and a fingerprint of the kernels' source (a changed kernel
   must not inherit configs tuned for the old one);
3. if `$JAX_MAMBA2_AUTOTUNE` is unset or "1" and a CUDA GPU with torch or CuPy is present: tune now
   with `cuda.tile.tune.exhaustive_search` on random inputs of the problem's shapes (`random_problem`,
   viewed zero-copy as torch/CuPy arrays), store the winner and what every config measured, and use
   it;
4. otherwise (tuning off, no GPU, neither torch nor CuPy, or a problem under MIN_TUNED_TOKEN_HEADS
   (token, head) pairs, which is launch-bound) the stage's default config
   (`<stage>_fwd_default_config`).

`JAX_MAMBA2_AUTOTUNE=0` turns off tuning, not the cache: point `JAX_MAMBA2_CACHE_DIR` at an empty
directory as well to get the defaults everywhere.

Cache keys name the stage, the SSDDims fields that stage's kernel specialises on (see `_STAGES`), the
index width, and a power-of-two bucket of the stage's independent work items. Batch and seqlen are
deliberately not in the keys (as in mamba_ssm's Triton autotune keys): only their bucket is, so a
training run with varying lengths tunes once per bucket, not once per call.

Tuning runs in Python when `ssd` is first traced for a problem, outside the traced computation, on a
side stream. Writers hold an fcntl lock on `<file>.lock`, re-read the file under it, tune only
the keys still missing and replace the file atomically (temp file + os.replace), so concurrent
processes never corrupt it nor tune one key twice; readers need no lock. A tuning failure (no memory,
a compiler error in every config) warns and falls back to the defaults: it never breaks the program.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
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
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional

import cuda.tile as ct
import jax
import jax.numpy as jnp

from jax_mamba2.kernels import _common, chunk_cumsum, chunk_scan, chunk_state
from jax_mamba2.kernels import forward as forward_kernels
from jax_mamba2.kernels._common import SUPPORTED_ARCHS, Launch, SSDDims

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


@dataclasses.dataclass(frozen=True)
class _Stage:
    """How to tune one forward stage: its kernel module's config functions and cache-key fields."""

    configs: Callable[[SSDDims, str], list]
    default_config: Callable[[SSDDims], Any]
    launch: Callable[[SSDDims, Any], Launch]
    # SSDDims fields (or properties) the stage's kernel specialises on.
    key_fields: tuple[str, ...]
    # The stage's independent work items (its launch width before tiling), bucketed in the key.
    work_items: Callable[[SSDDims], int]


_STAGES = {
    "chunk_cumsum": _Stage(
        chunk_cumsum.chunk_cumsum_fwd_configs, chunk_cumsum.chunk_cumsum_fwd_default_config,
        chunk_cumsum.chunk_cumsum_fwd_launch,
        key_fields=("chunk_size", "nheads", "dt_dtype", "dt_softplus", "has_dt_limit"),
        work_items=lambda d: d.batch * d.nchunks * d.nheads),
    "chunk_state": _Stage(
        chunk_state.chunk_state_fwd_configs, chunk_state.chunk_state_fwd_default_config,
        chunk_state.chunk_state_fwd_launch,
        key_fields=("chunk_size", "headdim", "dstate", "dtype", "has_init", "has_seq_idx"),
        # One block walks all chunks of one (batch, head): the parallelism is batch * nheads.
        work_items=lambda d: d.batch * d.nheads),
    "chunk_scan": _Stage(
        chunk_scan.chunk_scan_fwd_configs, chunk_scan.chunk_scan_fwd_default_config,
        chunk_scan.chunk_scan_fwd_launch,
        key_fields=("chunk_size", "headdim", "dstate", "heads_per_group", "dtype", "has_z",
                    "has_seq_idx"),
        work_items=lambda d: d.batch * d.nchunks * d.nheads),
}
assert tuple(_STAGES) == forward_kernels.FORWARD_STAGES


class GpuIdentity(NamedTuple):
    """The GPU configs are tuned for: its name (e.g. "NVIDIA H200") and arch (e.g. "sm_90")."""

    name: str
    arch: str


@dataclasses.dataclass(frozen=True)
class StageChoice:
    """What `forward_configs` chose for one stage and where it came from.

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

def stage_key(stage: str, dims: SSDDims) -> str:
    """The cache key of `stage` for `dims`, e.g. "chunk_state/chunk_size=256,headdim=64,...,work=128"."""
    spec = _STAGES[stage]
    fields = [f"{name}={getattr(dims, name)}" for name in spec.key_fields]
    fields.append(f"index64={_common.needs_int64_index(dims)}")
    fields.append(f"work={_common.next_power_of_2(spec.work_items(dims))}")
    return f"{stage}/" + ",".join(fields)


def _package_version() -> str:
    try:
        return importlib.metadata.version("jax-mamba2")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "src"


def _kernels_fingerprint() -> str:
    """A hash of the forward kernels' source: tuned configs are only valid for the code they ran."""
    digest = hashlib.sha256()
    for module in (_common, chunk_cumsum, chunk_state, chunk_scan):
        digest.update(Path(module.__file__).read_bytes())
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
    cls = type(_STAGES[stage].default_config(dims))
    try:
        return cls(**entry["config"])
    except (KeyError, TypeError):
        return None


def _search_space(stage: str, dims: SSDDims, arch: str) -> list:
    spec = _STAGES[stage]
    space = list(dict.fromkeys(spec.configs(dims, arch)))
    default = spec.default_config(dims)
    return space if default in space else [default, *space]


def random_problem(dims: SSDDims, seed: int = 0) -> dict[str, jax.Array]:
    """Every array of the forward plan (kernels.forward.forward_arrays) as JAX arrays.

    Inputs get realistic random values: Δ = softplus(N(-3, 1)) after the kernel's own dt transform
    (dt_bias = 0), A = -exp(U(-2, 1)), x/B/C/z/D/initial_states ~ N(0, 1), and with seq_idx four
    packed sequences of equal length. Buffers (intermediates, outputs) are zeros. The arrays are
    concrete even when called while a jit is being traced (where tuning runs).
    """
    with jax.ensure_compile_time_eval():
        return _random_problem(dims, seed)


def _random_problem(dims: SSDDims, seed: int) -> dict[str, jax.Array]:
    arrays = {}
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), len(forward_kernels.FORWARD_INPUTS)))
    for name, buf in forward_kernels.forward_arrays(dims).items():
        dtype = jnp.dtype(buf.dtype)
        if name not in forward_kernels.FORWARD_INPUTS:
            arrays[name] = jnp.zeros(buf.shape, dtype)
            continue
        key = next(keys)
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
        arrays[name] = value.astype(dtype)
    return arrays


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


def _launch_args(launch: Launch, arrays: dict) -> tuple:
    return tuple(arrays[a] if isinstance(a, str) else a for a in launch.args)


def _measurement_record(measurement) -> dict:
    return {"config": _config_fields(measurement.config), "mean_us": measurement.mean_us,
            "error_us": measurement.error_margin_us, "samples": measurement.num_samples}


def _tune_one(stage: str, dims: SSDDims, arch: str, arrays: dict, stream, progress) -> dict:
    """Runs exhaustive_search over the stage's space on `arrays`; returns the cache entry."""
    from tqdm.auto import tqdm

    space = _search_space(stage, dims, arch)
    launches = {cfg: _STAGES[stage].launch(dims, cfg) for cfg in space}
    with tqdm(total=len(space), desc=f"jax_mamba2 tuning {stage}", unit="config",
              disable=not progress) as bar:
        def kernel_of(cfg):  # called once per config, before its compile: drives the bar
            bar.update(1)
            return launches[cfg].kernel

        start = time.perf_counter()
        with ct.compiler_timeout(COMPILE_TIMEOUT_S):
            result = ct.tune.exhaustive_search(
                space, stream, lambda cfg: launches[cfg].grid, kernel_of,
                lambda cfg: _launch_args(launches[cfg], arrays), quiet=True)
        seconds = time.perf_counter() - start
    logger.info("jax_mamba2 tuning %s for %s:\n%s", stage, dims, result.summary())
    default = _STAGES[stage].default_config(dims)
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


def _tune_stages(dims: SSDDims, stages: list[str], arch: str) -> Iterator[tuple[str, dict]]:
    """Tunes `stages` (in plan order) for `dims` on the GPU; yields (stage, entry) as each finishes.

    The whole default plan runs first so every stage tunes on real intermediate inputs (dA_cumsum,
    states); the stages write only their own outputs, so re-running one leaves the others' valid.
    Everything runs on a side stream, synchronised before returning.
    """
    library = _array_library()
    stream = _side_stream(library)
    arrays = _device_views(random_problem(dims), library)
    for launch in forward_kernels.forward_plan(dims).launches:
        ct.launch(stream, launch.grid, launch.kernel, _launch_args(launch, arrays))
    for stage in forward_kernels.FORWARD_STAGES:
        if stage in stages:
            yield stage, _tune_one(stage, dims, arch, arrays, stream, progress=True)
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
    return {s: StageChoice(s, keys[s], _STAGES[s].default_config(dims), "default", reason=reason)
            for s in stages}


def _stored_choice(stage: str, dims: SSDDims, key: str, entry: dict, source: str):
    config = _config_from_entry(stage, dims, entry)
    return None if config is None else StageChoice(stage, key, config, source, entry=entry)


def _resolve(dims: SSDDims) -> dict[str, StageChoice]:
    keys = {s: stage_key(s, dims) for s in _STAGES}
    gpu = _gpu_identity()
    if gpu is None:
        return _default_choices(dims, _STAGES, "no CUDA GPU is visible to JAX", keys)
    if gpu.arch not in SUPPORTED_ARCHS:
        return _default_choices(dims, _STAGES, f"no tuning space for arch={gpu.arch}", keys)
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
            missing = [s for s in _STAGES if s not in choices]
            reason = _tuning_disabled_reason(dims)
            if missing and reason is None:
                choices.update(_tune_into_cache(cache, dims, missing, keys, gpu.arch))
            for choice in choices.values():
                _MEMORY[(str(path), choice.key)] = choice
            missing = [s for s in _STAGES if s not in choices]
            choices.update(_default_choices(dims, missing, reason or "tuning failed", keys))
    return {s: choices[s] for s in _STAGES}


def _tune_into_cache(cache: _TuningCache, dims: SSDDims, stages: list[str], keys: dict[str, str],
                     arch: str) -> dict[str, StageChoice]:
    """Tunes `stages` into `cache` (or reads what another process stored meanwhile)."""
    stage_of = {keys[s]: s for s in stages}
    tuned_here = set()

    def tune(missing_keys):
        tuned_here.update(missing_keys)
        for stage, entry in _tune_stages(dims, [stage_of[k] for k in missing_keys], arch):
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


def forward_configs(dims: SSDDims) -> dict[str, Any]:
    """The config of every forward stage for `dims` on this GPU (see the module docstring).

    Args:
      dims: the problem, as `kernels.forward.forward_plan` takes it.

    Returns:
      {stage: config} for every stage of kernels.forward.FORWARD_STAGES, ready for
      `forward_plan(dims, configs)`.

    Raises:
      ValueError: when $JAX_MAMBA2_AUTOTUNE is neither "0" nor "1".
    """
    return {stage: choice.config for stage, choice in _resolve(dims).items()}


def tune_report(dims: SSDDims) -> dict[str, dict]:
    """What `forward_configs(dims)` uses and what was measured, per stage (JSON-ready).

    Each value has "key", "source" ("tuned", "disk" or "default"), "reason" (for defaults), "config"
    (field dict) and, for tuned or cached choices, the cache entry's "mean_us", "default_mean_us",
    "measured" (every config's mean/error in us), "failures" and "tuning_s".
    """
    report = {}
    for stage, choice in _resolve(dims).items():
        report[stage] = {"key": choice.key, "source": choice.source, "reason": choice.reason,
                         **(choice.entry or {}), "config": _config_fields(choice.config)}
    return report


def clear_memory() -> None:
    """Forgets the in-process choices (the next lookup reads the disk cache again)."""
    with _MEMORY_LOCK:
        _MEMORY.clear()
