"""The config of each stage of a plan: in-process memory -> the cache file -> tune now -> the default.

Per stage, in order:

1. an in-process dict (every choice made in this process, so the disk is read once per key);
2. the cache file of this GPU and code version (`cache_keys`);
3. where tuning is on and a CUDA GPU with torch or CuPy is present: tune now (`timing`), store the winner
   and what every config measured, and use it;
4. otherwise (tuning off, no GPU, neither torch nor CuPy, or a problem under MIN_TUNED_TOKEN_HEADS
   (token, head) pairs, which is launch-bound) the stage's default config: its kernels Stage declaration's,
   the configuration measured best for that class of shapes on an H200 (sm_90), chosen in microseconds.

Tuning is off unless asked for: `$JAX_MAMBA2_AUTOTUNE=1` turns it on for the process (read once, at the
first lookup: set it before the first cutile call), and `jax_mamba2.autotune(fn, *args)` tunes the SSD
calls of one program ahead of time whatever the variable says (`tuning_on`). The cache file is read either
way: point `$JAX_MAMBA2_CACHE_DIR` at an empty directory to get the defaults everywhere. A tuning failure
(no memory, a compiler error in every config) warns once and falls back to the defaults: it never breaks the
program, and the defaults are remembered for the process as a tuned config is, so the failed stages are not
tuned again at the next trace (`clear_memory` forgets them).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import threading
import warnings
from typing import Any, Iterable, Iterator, Mapping, Optional

from jax_mamba2.bridge.tuning import cache_keys, timing
from jax_mamba2.bridge.tuning.cache_file import TuningCache
from jax_mamba2.bridge.tuning.cache_keys import STAGES, GpuIdentity, stage_key
from jax_mamba2.bridge.tuning.timing import PlanSpec, config_from_entry
from jax_mamba2.kernels._common import SUPPORTED_ARCHS, SSDDims

ENV_AUTOTUNE = "JAX_MAMBA2_AUTOTUNE"
# Problems with fewer (token, head) pairs use the defaults untuned: they are launch-bound (a few us
# per kernel), and tuning one costs minutes of compiles, which would dominate small jobs and tests.
MIN_TUNED_TOKEN_HEADS = 1 << 17


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
# Set by `tuning_on` for the lookups it encloses: whether to tune, whatever $JAX_MAMBA2_AUTOTUNE says.
_TUNING_ON: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar("jax_mamba2_tuning_on", default=None)


@functools.cache
def autotune_enabled() -> bool:
    """Whether `$JAX_MAMBA2_AUTOTUNE` turns tuning on for the process ("1"; unset or "0": off), read once.

    Raises:
      ValueError: when it is set to anything else.
    """
    value = os.environ.get(ENV_AUTOTUNE, "0")
    if value not in ("0", "1"):
        raise ValueError(f"jax_mamba2 tuning: {ENV_AUTOTUNE}={value!r} must be '0' or '1'")
    return value == "1"


@contextlib.contextmanager
def tuning_on(enabled: bool) -> Iterator[None]:
    """Within: lookups tune missing configs (`enabled`) or never do, whatever $JAX_MAMBA2_AUTOTUNE says."""
    token = _TUNING_ON.set(enabled)
    try:
        yield
    finally:
        _TUNING_ON.reset(token)


def tuning_unavailable_reason() -> Optional[str]:
    """Why nothing can be tuned in this process (None when a supported GPU and torch or CuPy are here)."""
    return _gpu_unsupported_reason(cache_keys.gpu_identity()) or timing.array_library_missing_reason()


def _gpu_unsupported_reason(gpu: Optional[GpuIdentity]) -> Optional[str]:
    if gpu is None:
        return "no CUDA GPU is visible to JAX"
    if gpu.arch not in SUPPORTED_ARCHS:
        return f"no tuning space for arch={gpu.arch}"
    return None


def _tuning_disabled_reason(dims: SSDDims) -> Optional[str]:
    enabled = _TUNING_ON.get()
    if enabled is None and not autotune_enabled():
        return (f"{ENV_AUTOTUNE}=0" if os.environ.get(ENV_AUTOTUNE) == "0" else
                f"autotuning is off ({ENV_AUTOTUNE}=1 or jax_mamba2.autotune turns it on)")
    if enabled is False:
        return "not tuned while jax_mamba2.autotune finds the SSD calls"
    token_heads = dims.batch * dims.seqlen * dims.nheads
    if token_heads < MIN_TUNED_TOKEN_HEADS:
        return (f"batch * seqlen * nheads={token_heads} is below {MIN_TUNED_TOKEN_HEADS}: "
                f"too small to be worth tuning")
    return timing.array_library_missing_reason()


def _default_choices(dims: SSDDims, stages: Iterable[str], reason: str,
                     keys: dict[str, str]) -> dict[str, StageChoice]:
    return {s: StageChoice(s, keys[s], STAGES[s].default(dims), "default", reason=reason)
            for s in stages}


def _stored_choice(stage: str, dims: SSDDims, key: str, entry: dict, source: str,
                   arch: str) -> Optional[StageChoice]:
    """The choice a stored entry makes, or None (with a warning) where its config fits no member of the
    stage's search space."""
    config = config_from_entry(stage, dims, entry, arch)
    if config is None:
        warnings.warn(f"jax_mamba2 tuning cache: entry {key!r} has config={entry.get('config')!r}, outside "
                      f"the tune space of {stage}; that entry is ignored", RuntimeWarning, stacklevel=2)
        return None
    return StageChoice(stage, key, config, source, entry=entry)


def resolve(dims: SSDDims, spec: PlanSpec,
            given: Optional[Mapping[str, StageChoice]] = None) -> dict[str, StageChoice]:
    """The choice of every stage of `spec`: `given` ones as they are, the others looked up or tuned."""
    given = dict(given or {})
    own = [s for s in spec.stages if s not in given]
    keys = {s: stage_key(s, dims, spec.deterministic) for s in own}
    gpu = cache_keys.gpu_identity()
    unsupported = _gpu_unsupported_reason(gpu)
    if unsupported is not None:
        choices = _default_choices(dims, own, unsupported, keys)
    else:
        choices = _lookup(dims, spec, given, keys, gpu)
    choices.update(given)
    return {s: choices[s] for s in spec.stages}


def _lookup(dims: SSDDims, spec: PlanSpec, given: Mapping[str, StageChoice], keys: dict[str, str],
            gpu: GpuIdentity) -> dict[str, StageChoice]:
    """Choices for the stages of `keys`: memory, then disk, then tuning, else defaults."""
    path = cache_keys.cache_path(gpu)
    with _MEMORY_LOCK:
        choices = {s: _MEMORY[(str(path), k)] for s, k in keys.items() if (str(path), k) in _MEMORY}
        if len(choices) < len(keys):
            cache = TuningCache(path)
            stored = cache.read()
            for stage, key in keys.items():
                if stage not in choices and key in stored:
                    choice = _stored_choice(stage, dims, key, stored[key], "disk", gpu.arch)
                    if choice is not None:
                        choices[stage] = choice
            missing = [s for s in keys if s not in choices]
            reason = _tuning_disabled_reason(dims)
            if missing and reason is None:
                known = {s: c.config for s, c in {**given, **choices}.items()}
                configs = {s: known[s] if s in known else STAGES[s].default(dims)
                           for s in spec.stages}
                tuned, failure = _tune_into_cache(cache, dims, spec, missing, keys, configs, gpu.arch)
                choices.update(tuned)
                # A failed stage takes its default, remembered with the tuned ones: each later trace of the
                # problem would otherwise tune it again (minutes of compiles) only to fail and warn again.
                failed = [s for s in missing if s not in tuned]
                choices.update(_default_choices(dims, failed, failure or "tuning failed", keys))
            for choice in choices.values():
                _MEMORY[(str(path), choice.key)] = choice
            # Not remembered: tuning is off or impossible for now, and `autotune` may tune them later.
            missing = [s for s in keys if s not in choices]
            choices.update(_default_choices(dims, missing, reason, keys))
    return choices


def _tune_into_cache(cache: TuningCache, dims: SSDDims, spec: PlanSpec, stages: list[str],
                     keys: dict[str, str], configs: dict[str, Any],
                     arch: str) -> tuple[dict[str, StageChoice], Optional[str]]:
    """Tunes `stages` into `cache` (or reads what another process stored meanwhile).

    Returns:
      (the choices of the stages tuned or read, why tuning failed or None): where the tuner raised (no memory,
      every config failing to compile), the stages it finished before are kept, and a warning names the rest.
    """
    stage_of = {keys[s]: s for s in stages}
    tuned_here = set()
    arrived = {}  # what the tuner yielded, kept should it fail on a later stage

    def tune(missing_keys):
        tuned_here.update(missing_keys)
        for stage, entry in timing.tune_stages(dims, spec, [stage_of[k] for k in missing_keys], configs, arch):
            arrived[keys[stage]] = entry
            yield keys[stage], entry

    failure = None
    try:
        entries = cache.fill(
            stage_of, tune,
            usable=lambda key, entry: config_from_entry(stage_of[key], dims, entry, arch) is not None)
    except Exception as e:  # noqa: BLE001  tuning is an optimisation: never fail the program
        failure = f"tuning failed ({type(e).__name__}: {e})"
        failed = sorted(s for s in stages if keys[s] not in arrived)
        warnings.warn(f"jax_mamba2: autotuning {failed} failed ({type(e).__name__}: {e}); they run their default "
                      "configs, and this process does not tune them again", RuntimeWarning, stacklevel=2)
        entries = arrived
    choices = {}
    for key, entry in entries.items():
        source = "tuned" if key in tuned_here else "disk"
        choice = _stored_choice(stage_of[key], dims, key, entry, source, arch)
        if choice is not None:
            choices[stage_of[key]] = choice
    return choices, failure


def clear_memory() -> None:
    """Forgets the in-process choices, failed tunings' defaults included (the next lookup reads the disk cache
    again, and tunes what it lacks where tuning is on)."""
    with _MEMORY_LOCK:
        _MEMORY.clear()
