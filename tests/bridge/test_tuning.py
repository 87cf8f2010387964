"""Kernel config lookup: cache keys, the on-disk cache, concurrent writers, env switches, fallbacks, and
`jax_mamba2.autotune`'s discovery of a program's SSD plans.

Tuning itself needs a GPU; here the GPU identity and the tuner (or the search, launches and array
library under it) are replaced by fakes, so the lookup order, the file format, the locking and what
each timed launch is given are checked on CPU.
"""
import contextlib
import dataclasses
import json
import multiprocessing
import os
import stat
import time
import types
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

ct = pytest.importorskip("cuda.tile")

from benchmarks.ssd import forward_layout_times  # noqa: E402
import jax_mamba2  # noqa: E402
from jax_mamba2 import backends, op  # noqa: E402
from jax_mamba2.bridge import aot, problem, tuning  # noqa: E402
from jax_mamba2.bridge.tuning import cache_file, cache_keys, layout_choice, lookup, timing  # noqa: E402
from jax_mamba2.bridge.tuning.cache_keys import STAGES  # noqa: E402
from jax_mamba2.kernels._common import SSDDims  # noqa: E402
from jax_mamba2.kernels.backward import BACKWARD_STAGES, backward_inputs, backward_plan  # noqa: E402
from jax_mamba2.kernels.forward import (  # noqa: E402
    FORWARD_LAYOUTS, ForwardConfigs, forward_inputs, forward_layout, forward_layouts, forward_plan)
from tests._helpers import make_ssd_args  # noqa: E402

DIMS = SSDDims(batch=4, seqlen=8192, nheads=32, headdim=64, ngroups=1, dstate=128, chunk_size=256)
# Half the batch: the atomic backward splits each group over two blocks (see backward.group_heads_per_block).
GROUP_SPLIT_DIMS = dataclasses.replace(DIMS, batch=2)
FORWARD_STAGES = FORWARD_LAYOUTS["staged"]      # DIMS's layout (chunk 256)
FAKE_GPU = cache_keys.GpuIdentity(name="NVIDIA H200", arch="sm_90")


def _set_autotune(monkeypatch, value):
    """Sets $JAX_MAMBA2_AUTOTUNE (None: unsets it) and makes the lookup read it again (it reads it once)."""
    if value is None:
        monkeypatch.delenv(lookup.ENV_AUTOTUNE, raising=False)
    else:
        monkeypatch.setenv(lookup.ENV_AUTOTUNE, value)
    lookup.autotune_enabled.cache_clear()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache directory, tuning on ($JAX_MAMBA2_AUTOTUNE=1), a fake H200, and no process-local choices."""
    monkeypatch.setenv(cache_keys.ENV_CACHE_DIR, str(tmp_path))
    _set_autotune(monkeypatch, "1")
    monkeypatch.setattr(cache_keys, "gpu_identity", lambda: FAKE_GPU)
    monkeypatch.setattr(timing, "array_library_missing_reason", lambda: None)
    tuning.clear_memory()
    yield tmp_path
    tuning.clear_memory()
    lookup.autotune_enabled.cache_clear()


def _choices(dims, backward=False, deterministic=False):
    """{stage: StageChoice} of the forward (its chosen layout's stages) or of the backward in one mode."""
    if backward:
        return layout_choice.backward_choices(dims, deterministic)
    return layout_choice.forward_choices(dims)[1]


def _non_default_config(stage, dims):
    spec = STAGES[stage]
    default = spec.default(dims)
    return next(c for c in reversed(spec.space(dims, "sm_90")) if c != default)


BACKWARD_OWN = [s for s in BACKWARD_STAGES if s not in FORWARD_STAGES]


def _fake_tuner(calls, given=None):
    """A `_tune_stages` stand-in that records its calls (and, into `given`, the configs it starts
    from) and picks a non-default config per stage."""
    def tune_stages(dims, spec, stages, configs, arch):
        calls.append(list(stages))
        if given is not None:
            given.append(dict(configs))
        for stage in stages:
            cfg = _non_default_config(stage, dims)
            yield stage, {"config": dataclasses.asdict(cfg), "mean_us": 1.0, "measured": []}
    return tune_stages


def _refuse_tuning(dims, spec, stages, configs, arch):
    raise AssertionError("tuning must not run here")


def test_stage_key_is_stable_and_names_what_the_stage_specialises_on():
    assert cache_keys.stage_key("chunk_state", DIMS) == (
        "chunk_state/chunk_size=256,headdim=64,dstate=128,dtype=bfloat16,has_init=False,"
        "has_seq_idx=False,index64=False,work=128")
    # seqlen is not a chunk_state key field and batch * nheads stays 128: same key.
    same = dataclasses.replace(DIMS, seqlen=2048)
    assert cache_keys.stage_key("chunk_state", same) == cache_keys.stage_key("chunk_state", DIMS)
    for field, value in [("dstate", 64), ("dtype", "float16"), ("has_z", True), ("chunk_size", 128)]:
        changed = dataclasses.replace(DIMS, **{field: value})
        assert cache_keys.stage_key("chunk_scan", changed) != cache_keys.stage_key("chunk_scan", DIMS), field
    # The work bucket: 4x the chunks is a new bucket for chunk_scan, not for chunk_state.
    longer = dataclasses.replace(DIMS, seqlen=4 * DIMS.seqlen)
    assert cache_keys.stage_key("chunk_scan", longer) != cache_keys.stage_key("chunk_scan", DIMS)
    assert cache_keys.stage_key("chunk_state", longer) == cache_keys.stage_key("chunk_state", DIMS)


def test_cache_path_names_gpu_versions_and_kernel_source(cache_dir):
    name = cache_keys.cache_path(FAKE_GPU).name
    assert cache_keys.cache_path(FAKE_GPU).parent == cache_dir
    assert name.startswith("NVIDIA_H200-sm_90-cuda_tile_") and "-jax_mamba2_" in name
    assert "-kernels_" in name and name.endswith(".json")


def test_forward_configs_tunes_once_then_reads_disk(cache_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "tune_stages", _fake_tuner(calls))
    configs = tuning.forward_configs(DIMS)
    expected = {s: _non_default_config(s, DIMS) for s in FORWARD_STAGES}
    assert configs == ForwardConfigs("staged", expected)
    assert calls == [list(FORWARD_STAGES)]
    assert {c.source for c in _choices(DIMS).values()} == {"tuned"}

    stored = json.loads(cache_keys.cache_path(FAKE_GPU).read_text())
    assert stored["schema"] == cache_keys.CACHE_SCHEMA
    assert set(stored["entries"]) == {cache_keys.stage_key(s, DIMS) for s in FORWARD_STAGES}

    # A new process (no memory): the disk answers and nothing is tuned.
    tuning.clear_memory()
    monkeypatch.setattr(timing, "tune_stages", _refuse_tuning)
    assert tuning.forward_configs(DIMS) == ForwardConfigs("staged", expected)
    report = _choices(DIMS)
    assert {c.source for c in report.values()} == {"disk"}
    assert report["chunk_scan"].config == expected["chunk_scan"]


def _lower_case_fields(config: dict) -> dict:
    """`config` as cache schema 1 stored it: OCCUPANCY (and FusedScanConfig's flags) in lower case."""
    old = {"OCCUPANCY", "WORKER_WARPS", "CHUNKS_PER_ITER", "WEIGHT_X", "JOINT_OUTPUT"}
    return {name.lower() if name in old else name: value for name, value in config.items()}


@pytest.mark.parametrize("stale", ["unknown_field", "lower_case_fields"])
def test_forward_configs_retunes_only_stale_entries(cache_dir, monkeypatch, stale):
    """An entry whose config names fields its stage's config lacks (an unknown one, or the lower-case
    names of cache schema 1) is tuned again; the other entries are read."""
    monkeypatch.setattr(timing, "tune_stages", _fake_tuner([]))
    tuning.forward_configs(DIMS)
    path = cache_keys.cache_path(FAKE_GPU)
    stored = json.loads(path.read_text())
    entry = stored["entries"][cache_keys.stage_key("chunk_scan", DIMS)]
    entry["config"] = {"NO_SUCH_FIELD": 1} if stale == "unknown_field" else _lower_case_fields(entry["config"])
    assert stale == "unknown_field" or "occupancy" in entry["config"]
    path.write_text(json.dumps(stored))

    tuning.clear_memory()
    calls = []
    monkeypatch.setattr(timing, "tune_stages", _fake_tuner(calls))
    with pytest.warns(RuntimeWarning, match="outside the tune space of chunk_scan; that entry is ignored"):
        sources = {s: c.source for s, c in _choices(DIMS).items()}
    assert calls == [["chunk_scan"]]
    assert sources == {"chunk_cumsum": "disk", "chunk_state": "disk", "chunk_scan": "tuned"}


def test_stage_key_names_heads_per_block_where_deterministic_changes_the_launch():
    # 32 heads in one group, half DIMS' batch: deterministic mode gives a block the whole group, the atomic
    # mode 16 heads (the most that leave backward.MIN_GROUP_PASS_BLOCKS blocks).
    grouped = GROUP_SPLIT_DIMS
    assert cache_keys.stage_key("chunk_scan_bwd_dc", grouped) == (
        "chunk_scan_bwd_dc/chunk_size=256,headdim=64,dstate=128,heads_per_group=32,dtype=bfloat16,"
        "has_seq_idx=False,heads_per_block=16,index64=False,work=128")
    assert cache_keys.stage_key("chunk_scan_bwd_dx", grouped, deterministic=True).endswith(
        "heads_per_block=32,index64=False,work=64")
    # At DIMS' batch the atomic mode gives a block the whole group too: one launch, one key, in both modes.
    assert cache_keys.stage_key("chunk_scan_bwd_dc", DIMS) == cache_keys.stage_key("chunk_scan_bwd_dc", DIMS, True)
    for stage in BACKWARD_STAGES:
        differs = cache_keys.stage_key(stage, grouped) != cache_keys.stage_key(stage, grouped, True)
        assert differs == (stage in ("chunk_scan_bwd_dc", "chunk_scan_bwd_dx")), stage
    # One head per group: both modes launch the same kernels, so they share every key.
    per_head = dataclasses.replace(DIMS, ngroups=DIMS.nheads)
    assert all(cache_keys.stage_key(s, per_head) == cache_keys.stage_key(s, per_head, True) for s in BACKWARD_STAGES)


def test_backward_configs_reuse_forward_recompute_configs_and_tune_the_rest_once(cache_dir, monkeypatch):
    calls, given = [], []
    monkeypatch.setattr(timing, "tune_stages", _fake_tuner(calls, given))
    forward = tuning.forward_configs(DIMS).configs
    backward = tuning.backward_configs(DIMS)
    assert calls == [list(FORWARD_STAGES), BACKWARD_OWN]
    assert backward == {**{s: forward[s] for s in ("chunk_cumsum", "chunk_state")},
                        **{s: _non_default_config(s, DIMS) for s in BACKWARD_OWN}}
    # The backward stages were tuned after the forward's recompute configs, the others at defaults.
    assert given[1] == {**{s: forward[s] for s in ("chunk_cumsum", "chunk_state")},
                        **{s: STAGES[s].default(DIMS) for s in BACKWARD_OWN}}
    stored = json.loads(cache_keys.cache_path(FAKE_GPU).read_text())["entries"]
    assert set(stored) == {cache_keys.stage_key(s, DIMS) for s in FORWARD_STAGES + BACKWARD_STAGES}

    # A new process: the disk answers for both passes.
    tuning.clear_memory()
    monkeypatch.setattr(timing, "tune_stages", _refuse_tuning)
    assert tuning.backward_configs(DIMS) == backward
    assert {c.source for c in _choices(DIMS, backward=True).values()} == {"disk"}


@pytest.mark.parametrize("fused_us,want", [(1.0, "fused"), (5.0, "staged")])
def test_forward_configs_tune_both_layouts_and_keep_the_faster(cache_dir, monkeypatch, fused_us, want):
    fused_dims = dataclasses.replace(DIMS, chunk_size=64)
    assert forward_layout(fused_dims) == "fused"          # the rule's pick, without measurements
    calls = []
    times = {"fused_scan": fused_us}                       # every other stage measures 1 us

    def tune_stages(dims, spec, stages, configs, arch):
        calls.append(list(stages))
        for stage in stages:
            entry = {"config": dataclasses.asdict(_non_default_config(stage, dims)), "measured": []}
            yield stage, {**entry, "mean_us": times.get(stage, 1.0)}

    monkeypatch.setattr(timing, "tune_stages", tune_stages)
    forward = tuning.forward_configs(fused_dims)
    # staged: 3 stages x 1 us; fused: 1 + fused_us. chunk_cumsum is tuned once and shared.
    assert calls == [["chunk_cumsum", "chunk_state", "chunk_scan"], ["fused_scan"]]
    assert forward.layout == want and set(forward.configs) == set(FORWARD_LAYOUTS[want])
    assert len(forward_plan(fused_dims, forward.configs, forward.layout).launches) == len(FORWARD_LAYOUTS[want])
    # The backward's recompute takes the forward's chunk_cumsum and the chunk_state tuned with the
    # staged layout (from the cache), tuning only its own stages.
    backward = tuning.backward_configs(fused_dims)
    assert calls[2:] == [BACKWARD_OWN]
    assert backward["chunk_cumsum"] == forward.configs["chunk_cumsum"]
    assert backward["chunk_state"] == _non_default_config("chunk_state", fused_dims)
    # A new process reads both layouts from disk and makes the same choice.
    tuning.clear_memory()
    monkeypatch.setattr(timing, "tune_stages", _refuse_tuning)
    assert tuning.forward_configs(fused_dims) == forward


def test_forward_configs_without_measurements_follow_the_layout_rule(cache_dir, monkeypatch):
    _set_autotune(monkeypatch, "0")
    fused_dims = dataclasses.replace(DIMS, chunk_size=64)
    assert set(tuning.forward_configs(fused_dims).configs) == set(FORWARD_LAYOUTS["fused"])
    few_chains = dataclasses.replace(fused_dims, batch=1)
    assert set(tuning.forward_configs(few_chains).configs) == set(FORWARD_LAYOUTS[forward_layout(few_chains)])
    assert set(tuning.forward_configs(dataclasses.replace(fused_dims, dtype="float32", dt_dtype="float32")
                                      ).configs) == set(FORWARD_LAYOUTS["staged"])
    assert [tuning.forward_configs(d).layout for d in (fused_dims, few_chains)] == [
        "fused", forward_layout(few_chains)]


def test_backward_configs_deterministic_tunes_only_the_group_reducing_stages_again(cache_dir, monkeypatch):
    monkeypatch.setattr(timing, "tune_stages", _fake_tuner([]))
    tuning.backward_configs(GROUP_SPLIT_DIMS, deterministic=False)
    tuning.clear_memory()
    calls = []
    monkeypatch.setattr(timing, "tune_stages", _fake_tuner(calls))
    report = _choices(GROUP_SPLIT_DIMS, backward=True, deterministic=True)
    assert calls == [["chunk_scan_bwd_dc", "chunk_scan_bwd_dx"]]
    tuned = {s for s, c in report.items() if c.source == "tuned"}
    assert tuned == {"chunk_scan_bwd_dc", "chunk_scan_bwd_dx"}
    assert "heads_per_block=32" in report["chunk_scan_bwd_dc"].key


class _FakeStream:
    """A CuPy-like stream: a context manager that orders nothing (everything here is synchronous)."""

    def __init__(self, non_blocking=False):
        del non_blocking

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


# A CuPy-like array library over NumPy: `from_dlpack` gives a writable host copy.
_FAKE_LIBRARY = types.SimpleNamespace(__name__="cupy", from_dlpack=np.array,
                                      cuda=types.SimpleNamespace(Stream=_FakeStream))


def test_tune_stages_times_each_config_on_its_plan_buffers_and_rezeroes_atomic_sums(monkeypatch):
    """The real backward tuning loop with the GPU parts faked: what every launch and timed run gets."""
    dims = SSDDims(batch=1, seqlen=256, nheads=4, headdim=16, ngroups=2, dstate=16, chunk_size=128)
    events = []

    def launch(stream, grid, kernel, args):
        events.append(("launch", grid, kernel, [np.shape(a) for a in args]))

    def exhaustive_search(space, stream, grid_fn, kernel_fn, args_fn, quiet):
        runs = {}
        for cfg in space:
            kernel_fn(cfg)
            runs[cfg] = []
            for _ in range(2):  # each run sees its arrays, then "accumulates" into every one of them
                args = args_fn(cfg)
                runs[cfg].append((grid_fn(cfg), [np.shape(a) for a in args],
                                  [bool(np.all(a == 0)) if isinstance(a, np.ndarray) else None
                                   for a in args]))
                for a in args:
                    if isinstance(a, np.ndarray) and a.dtype == np.float32:
                        a += 1.0
        events.append(("search", runs))
        measured = [ct.tune.Measurement(config=c, mean_us=float(i), num_samples=5, error_margin_us=0.1)
                    for i, c in enumerate(reversed(space))]
        return ct.tune.TuningResult(best=measured[0], successes=measured, failures=[])

    def record_compiles(launches, launch_fn):  # what the search's concurrent compiles are given
        events.append(("precompile", [(grid, [np.shape(a) for a in args]) for _, grid, args in launches]))
        return []

    monkeypatch.setattr(timing.precompile, "record_compiles", record_compiles)
    fake_ct = types.SimpleNamespace(launch=launch, compiler_timeout=lambda s: contextlib.nullcontext(),
                                    tune=types.SimpleNamespace(exhaustive_search=exhaustive_search))
    monkeypatch.setattr(timing, "ct", fake_ct)
    monkeypatch.setattr(timing, "array_library", lambda: _FAKE_LIBRARY)

    start = {s: STAGES[s].default(dims) for s in BACKWARD_STAGES}
    spec = layout_choice.BACKWARD[False]
    entries = dict(timing.tune_stages(dims, spec, BACKWARD_OWN, start, "sm_90"))
    assert list(entries) == BACKWARD_OWN

    configs, i = dict(start), 0
    for index, stage in enumerate(BACKWARD_STAGES):
        if stage not in BACKWARD_OWN:
            continue
        # The stages before this one ran first, with the configs chosen so far, on buffers of their shapes.
        base = backward_plan(dims, configs)
        arrays = {**backward_inputs(dims), **base.buffers}
        for launch_ in base.launches[:index]:
            assert events[i][:3] == ("launch", launch_.grid, launch_.kernel), (stage, events[i][:3])
            assert events[i][3] == [arrays[a].shape if isinstance(a, str) else () for a in launch_.args]
            i += 1
        # Every config's launch of the stage was handed to the concurrent compiles first.
        expected = []
        for cfg in timing.search_space(stage, dims, "sm_90"):
            plan = backward_plan(dims, {**configs, stage: cfg})
            arrays = {**backward_inputs(dims), **plan.buffers}
            timed = plan.launches[index]
            expected.append((timed.grid, [arrays[a].shape if isinstance(a, str) else () for a in timed.args]))
        assert events[i] == ("precompile", expected), stage
        kind, runs = events[i + 1]
        i += 2
        assert kind == "search" and list(runs) == timing.search_space(stage, dims, "sm_90")
        for cfg, cfg_runs in runs.items():
            plan = backward_plan(dims, {**configs, stage: cfg})
            timed, arrays = plan.launches[index], {**backward_inputs(dims), **plan.buffers}
            for grid, shapes, zero in cfg_runs:
                assert grid == timed.grid
                assert shapes == [arrays[a].shape if isinstance(a, str) else () for a in timed.args]
                for position, name in enumerate(timed.args):
                    if name in ("dB", "dC"):  # atomic sums (2 heads per group): zero before every run
                        assert plan.buffers[name].zero_init and zero[position], (stage, cfg, name)
        # The fake search ranks the last config of the space first: it is the winner.
        assert entries[stage]["config"] == dataclasses.asdict(list(runs)[-1])
        configs[stage] = list(runs)[-1]
    assert i == len(events)
    # The intra-chunk passes were timed with 128-row blocks too (a differently shaped ddA_intra).
    assert configs["chunk_scan_bwd_dc"].BLOCK_M == 128


@pytest.mark.parametrize("backward", [False, True])
def test_configs_env_off_uses_defaults(cache_dir, monkeypatch, backward):
    _set_autotune(monkeypatch, "0")
    monkeypatch.setattr(timing, "tune_stages", _refuse_tuning)
    report = _choices(DIMS, backward=backward)
    assert tuple(report) == (BACKWARD_STAGES if backward else FORWARD_STAGES)
    for stage, r in report.items():
        assert r.source == "default" and r.reason == f"{lookup.ENV_AUTOTUNE}=0"
        assert r.config == STAGES[stage].default(DIMS)
    assert not list(cache_dir.iterdir())


def test_configs_without_gpu_use_defaults(cache_dir, monkeypatch):
    monkeypatch.setattr(cache_keys, "gpu_identity", lambda: None)
    monkeypatch.setattr(timing, "tune_stages", _refuse_tuning)
    defaults = {s: spec.default(DIMS) for s, spec in STAGES.items()}
    assert tuning.forward_configs(DIMS) == ForwardConfigs("staged", {s: defaults[s] for s in FORWARD_STAGES})
    assert tuning.backward_configs(DIMS, deterministic=True) == {s: defaults[s] for s in BACKWARD_STAGES}
    assert not list(cache_dir.iterdir())


@pytest.mark.parametrize("backward", [False, True])
def test_configs_tuning_failure_warns_and_uses_defaults(cache_dir, monkeypatch, backward):
    def broken(dims, spec, stages, configs, arch):
        raise RuntimeError("out of memory")
        yield  # a generator, like the real tuner

    monkeypatch.setattr(timing, "tune_stages", broken)
    with pytest.warns(RuntimeWarning, match="autotuning .* failed .*out of memory"):
        report = _choices(DIMS, backward=backward)
    assert {c.source for c in report.values()} == {"default"}
    assert cache_file.TuningCache(cache_keys.cache_path(FAKE_GPU)).read() == {}



def _calls_then(calls, tuned_first: int, error: Exception | None = None, config=None):
    """A `tune_stages` stand-in that records its calls, yields its first `tuned_first` stages (tuned to a
    non-default config, or to `config` where given), then raises `error` (as the real tuner does when every
    config of a stage fails: cuda.tile's search raises ValueError)."""
    def tune_stages(dims, spec, stages, configs, arch):
        calls.append(list(stages))
        for stage in stages[:tuned_first]:
            cfg = dataclasses.asdict(_non_default_config(stage, dims)) if config is None else config
            yield stage, {"config": cfg, "mean_us": 1.0, "measured": []}
        if error is not None:
            raise error
    return tune_stages


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("tuned_first", [0, 1])
def test_configs_tuning_failure_is_remembered_for_the_process(cache_dir, monkeypatch, backward, tuned_first):
    """A tuning that fails (here on the second stage, or the first) warns once: the stages it finished keep their
    configs, the others their defaults, and later traces of the problem take both from memory, neither tuning
    again (minutes of compiles, to fail again) nor warning; clear_memory forgets the failure."""
    calls = []
    monkeypatch.setattr(timing, "tune_stages", _calls_then(calls, tuned_first, ValueError("No valid config found")))
    with pytest.warns(RuntimeWarning, match=r"autotuning \[.*\] failed \(ValueError: No valid config found\)"):
        first = _choices(DIMS, backward=backward)
    assert calls and all(calls)
    monkeypatch.setattr(timing, "tune_stages", _refuse_tuning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning the second time
        assert _choices(DIMS, backward=backward) == first
        configs = (tuning.backward_configs(DIMS) if backward else tuning.forward_configs(DIMS).configs)
    assert configs == {stage: choice.config for stage, choice in first.items()}
    tuned = {stage for call in calls for stage in call[:tuned_first]}
    for stage, choice in first.items():
        if stage in tuned:
            assert choice.source == "tuned" and choice.config == _non_default_config(stage, DIMS)
        else:
            assert choice.source == "default" and choice.config == STAGES[stage].default(DIMS), stage
            assert choice.reason == "tuning failed (ValueError: No valid config found)"
    tuning.clear_memory()
    calls.clear()
    monkeypatch.setattr(timing, "tune_stages", _calls_then(calls, len(STAGES)))
    assert {c.source for c in _choices(DIMS, backward=backward).values()} <= {"tuned", "disk"}
    assert calls


def test_configs_tuned_to_a_config_outside_the_space_are_not_tuned_again(cache_dir, monkeypatch):
    """A tuner's winner that fits no member of the stage's space (its entry unusable) warns and the default runs;
    the next trace takes that from memory instead of finding the entry unusable on disk and tuning again."""
    calls = []
    monkeypatch.setattr(timing, "tune_stages", _calls_then(calls, len(STAGES), config={"BLOCK_NOT_A_FIELD": 1}))
    with pytest.warns(RuntimeWarning, match="outside the tune space"):
        first = _choices(DIMS)
    assert {c.source for c in first.values()} == {"default"} and len(calls) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _choices(DIMS) == first
    assert len(calls) == 1

def test_autotune_env_rejects_other_values(monkeypatch):
    _set_autotune(monkeypatch, "yes")
    with pytest.raises(ValueError, match="JAX_MAMBA2_AUTOTUNE='yes' must be '0' or '1'"):
        lookup.autotune_enabled()
    lookup.autotune_enabled.cache_clear()


def test_autotune_env_is_read_once_and_off_unless_set_to_1(monkeypatch):
    _set_autotune(monkeypatch, None)
    assert not lookup.autotune_enabled()
    monkeypatch.setenv(lookup.ENV_AUTOTUNE, "1")         # after the first read: no effect
    assert not lookup.autotune_enabled()
    _set_autotune(monkeypatch, "1")
    assert lookup.autotune_enabled()
    lookup.autotune_enabled.cache_clear()


def test_first_use_without_tuning_runs_the_defaults_in_milliseconds(cache_dir, monkeypatch):
    """$JAX_MAMBA2_AUTOTUNE unset: every stage of both passes takes its declared default (nothing is tuned,
    no file is written), the forward in the rule's layout, at the cost of a lookup."""
    _set_autotune(monkeypatch, None)
    monkeypatch.setattr(timing, "tune_stages", _refuse_tuning)
    fused_dims = dataclasses.replace(DIMS, chunk_size=64)
    cache_keys.kernels_fingerprint()                   # once per process (parsing the kernel sources)
    start = time.perf_counter()
    forward_cfgs, backward_cfgs = tuning.forward_configs(fused_dims), tuning.backward_configs(fused_dims)
    assert time.perf_counter() - start < 1.0
    assert forward_cfgs == ForwardConfigs(forward_layout(fused_dims), {
        s: STAGES[s].default(fused_dims) for s in FORWARD_LAYOUTS[forward_layout(fused_dims)]})
    assert backward_cfgs == {s: STAGES[s].default(fused_dims) for s in BACKWARD_STAGES}
    reasons = {c.reason for c in _choices(fused_dims).values()}
    assert reasons == {"autotuning is off (JAX_MAMBA2_AUTOTUNE=1 or jax_mamba2.autotune turns it on)"}
    assert not list(cache_dir.iterdir())


def _kernel_copy(tmp_path, name, edit=None):
    """A copy of the kernel modules in tmp_path/name, `edit(text) -> text` applied to fused_scan.py."""
    directory = tmp_path / name
    directory.mkdir()
    for path in cache_keys.KERNELS_DIR.glob("*.py"):
        text = path.read_text()
        (directory / path.name).write_text(edit(text) if edit and path.name == "fused_scan.py" else text)
    return directory


def test_cache_key_fingerprint_ignores_comments_and_docstrings_not_code(tmp_path):
    original = cache_keys.kernels_fingerprint(_kernel_copy(tmp_path, "original"))
    assert original == cache_keys.kernels_fingerprint(cache_keys.KERNELS_DIR)

    def reword(text):
        text = text.replace("# The chunk sizes the fused kernel takes", "# Chunk sizes the fused kernel\n# accepts")
        text = text.replace('"""Whether the fused kernel has a configuration',
                            '"""Whether the fused kernel has\n    a config')
        return text.replace("FUSED_CHUNK_SIZES = (16, 32, 64)", "FUSED_CHUNK_SIZES = (16,   32, 64)  # powers of 2")

    def recode(text):
        return text.replace("MAX_PIECE_CHUNKS = 32", "MAX_PIECE_CHUNKS = 16")

    assert reword(cache_keys.KERNELS_DIR.joinpath("fused_scan.py").read_text()) != \
        cache_keys.KERNELS_DIR.joinpath("fused_scan.py").read_text()
    assert cache_keys.kernels_fingerprint(_kernel_copy(tmp_path, "reworded", reword)) == original
    assert cache_keys.kernels_fingerprint(_kernel_copy(tmp_path, "recoded", recode)) != original


def test_tuning_cache_ignores_corrupt_and_foreign_files(tmp_path):
    path = tmp_path / "cache.json"
    cache = cache_file.TuningCache(path)
    assert cache.read() == {}                                   # no file yet: nothing to say
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="not readable as JSON .*; the file is ignored"):
        assert cache.read() == {}
    path.write_text("[" * 100_000 + "]" * 100_000)  # nesting too deep for the json module
    with pytest.warns(RuntimeWarning, match="not readable as JSON .*RecursionError.*; the file is ignored"):
        assert cache.read() == {}
    path.write_text(json.dumps({"schema": cache_keys.CACHE_SCHEMA + 1, "entries": {"k": {}}}))
    with pytest.warns(RuntimeWarning, match=f"schema={cache_keys.CACHE_SCHEMA + 1}, not {cache_keys.CACHE_SCHEMA}; "
                                            f"the file is ignored"):
        assert cache.read() == {}
    with pytest.warns(RuntimeWarning, match="the file is ignored"):  # the fill reads it again before replacing it
        assert cache.fill(["k"], lambda keys: iter([("k", {"config": {}})])) == {"k": {"config": {}}}
    assert cache.read() == {"k": {"config": {}}}


@pytest.mark.parametrize("data", [{"entries": 5}, {"schema": 1, "entries": 5}, [1, 2], {"schema": 1}])
def test_tuning_cache_ignores_files_of_another_shape(tmp_path, data):
    path = tmp_path / "cache.json"
    path.write_text(json.dumps(data))
    with pytest.warns(RuntimeWarning, match='not a JSON object with an "entries" object; the file is ignored'):
        assert cache_file.TuningCache(path).read() == {}


def test_tuning_cache_ignores_entries_of_another_shape_and_drops_them_on_the_next_write(tmp_path):
    path = tmp_path / "cache.json"
    good = {"config": {"BLOCK_H": 8}, "mean_us": 3.5, "default_mean_us": None}
    entries = {"good": good, "text_time": {"config": {}, "mean_us": "fast"},
               "none_time": {"config": {}, "mean_us": None}, "no_config": {"mean_us": 1.0},
               "list_config": {"config": [1]}, "not_object": 7, "bool_time": {"config": {}, "tuning_s": True},
               "inf_time": {"config": {}, "default_mean_us": 1e999},
               "huge_int_time": {"config": {}, "mean_us": 10 ** 400}}  # a JSON integer no float holds
    path.write_text(json.dumps({"schema": cache_keys.CACHE_SCHEMA, "entries": entries}))
    cache = cache_file.TuningCache(path)
    with pytest.warns(RuntimeWarning) as caught:
        assert cache.read() == {"good": good}
    messages = "\n".join(str(w.message) for w in caught)
    for key in set(entries) - {"good"}:
        assert f"entry {key!r}" in messages, key
    assert "mean_us='fast', not a finite number" in messages
    with pytest.warns(RuntimeWarning):
        cache.fill(["new"], lambda keys: iter([("new", {"config": {}})]))
    assert set(json.loads(path.read_text())["entries"]) == {"good", "new"}


def test_tuning_cache_files_take_the_permissions_the_umask_leaves(tmp_path):
    previous = os.umask(0o002)
    try:
        path = tmp_path / "sub" / "cache.json"
        cache_file.TuningCache(path).fill(["k"], lambda keys: iter([("k", {"config": {}})]))
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o664
    assert stat.S_IMODE(path.with_name("cache.json.lock").stat().st_mode) == 0o664
    assert sorted(p.name for p in path.parent.iterdir()) == ["cache.json", "cache.json.lock"]   # no temp file


@pytest.mark.parametrize("data", ['{"entries": 5}', '{"schema": 1, "entries": 5}', "[]", "{broken"])
def test_configs_survive_a_cache_file_of_another_shape(cache_dir, monkeypatch, data):
    """The lookup warns and goes on (tuning here, into a rewritten file), inside the trace of a call."""
    path = cache_keys.cache_path(FAKE_GPU)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data)
    monkeypatch.setattr(timing, "tune_stages", _fake_tuner([]))
    with pytest.warns(RuntimeWarning, match="the file is ignored"):
        assert tuning.forward_configs(DIMS).configs == {s: _non_default_config(s, DIMS) for s in FORWARD_STAGES}
    assert set(json.loads(path.read_text())["entries"]) == {cache_keys.stage_key(s, DIMS) for s in FORWARD_STAGES}


def test_configs_ignore_a_cache_file_of_schema_1_with_its_lower_case_config_fields(cache_dir, monkeypatch):
    """Schema 2 made every config field upper-case: a schema-1 file (occupancy, weight_x, ...) warns, is ignored
    as a whole and is rewritten with the stages tuned again."""
    assert cache_keys.CACHE_SCHEMA == 2
    monkeypatch.setattr(timing, "tune_stages", _fake_tuner([]))
    tuning.forward_configs(DIMS)
    path = cache_keys.cache_path(FAKE_GPU)
    stored = json.loads(path.read_text())
    for entry in stored["entries"].values():
        entry["config"] = _lower_case_fields(entry["config"])
    path.write_text(json.dumps({"schema": 1, "entries": stored["entries"]}))

    tuning.clear_memory()
    calls = []
    monkeypatch.setattr(timing, "tune_stages", _fake_tuner(calls))
    with pytest.warns(RuntimeWarning, match="schema=1, not 2; the file is ignored"):
        choices = _choices(DIMS)
    assert calls == [list(FORWARD_STAGES)]
    assert {c.source for c in choices.values()} == {"tuned"}
    rewritten = json.loads(path.read_text())
    assert rewritten["schema"] == 2
    assert all("OCCUPANCY" in entry["config"] and "occupancy" not in entry["config"]
               for entry in rewritten["entries"].values())


@pytest.mark.parametrize("autotune", ["0", "1"])
def test_configs_ignore_a_stored_time_that_is_no_number_and_a_config_outside_the_space(cache_dir, monkeypatch,
                                                                                       autotune):
    """A non-numeric time and a config the tune space does not hold (valid fields, another tile) are ignored
    with a warning: the stage is tuned again where tuning is on, else it runs its default."""
    monkeypatch.setattr(timing, "tune_stages", _fake_tuner([]))
    tuning.forward_configs(DIMS)
    path = cache_keys.cache_path(FAKE_GPU)
    stored = json.loads(path.read_text())
    stored["entries"][cache_keys.stage_key("chunk_state", DIMS)]["mean_us"] = "fast"
    outside = dataclasses.replace(STAGES["chunk_scan"].default(DIMS), BLOCK_M=48)
    stored["entries"][cache_keys.stage_key("chunk_scan", DIMS)]["config"] = dataclasses.asdict(outside)
    path.write_text(json.dumps(stored))

    tuning.clear_memory()
    _set_autotune(monkeypatch, autotune)
    calls = []
    monkeypatch.setattr(timing, "tune_stages", _fake_tuner(calls))
    with pytest.warns(RuntimeWarning) as caught:
        choices = _choices(DIMS)
    messages = "\n".join(str(w.message) for w in caught)
    assert "mean_us='fast', not a finite number; that entry is ignored" in messages
    assert "outside the tune space of chunk_scan; that entry is ignored" in messages
    assert choices["chunk_cumsum"].source == "disk"
    if autotune == "1":
        assert calls == [["chunk_state", "chunk_scan"]]
        assert {s: choices[s].source for s in ("chunk_state", "chunk_scan")} == {"chunk_state": "tuned",
                                                                                 "chunk_scan": "tuned"}
    else:
        assert calls == []
        assert {s: (choices[s].source, choices[s].config) for s in ("chunk_state", "chunk_scan")} == {
            s: ("default", STAGES[s].default(DIMS)) for s in ("chunk_state", "chunk_scan")}


def _fill_from_process(path, key, log_path, barrier):
    """Worker: tunes `key` slowly into the shared cache, logging each tuning it actually runs."""
    def slow_tune(keys):
        with open(log_path, "a") as log:
            log.write(f"{key}\n")
        time.sleep(0.3)  # long enough that an unlocked writer would interleave
        for k in keys:
            yield k, {"config": {"by": key}}

    barrier.wait()
    cache_file.TuningCache(path).fill([key], slow_tune)


def test_tuning_cache_concurrent_writers_keep_every_key_and_tune_each_once(tmp_path):
    path, log_path = tmp_path / "cache.json", tmp_path / "tunings.log"
    ctx = multiprocessing.get_context("spawn")
    keys = ["stage_a/x=1", "stage_b/x=2", "stage_a/x=1"]
    barrier = ctx.Barrier(len(keys))
    procs = [ctx.Process(target=_fill_from_process, args=(path, k, log_path, barrier)) for k in keys]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * len(keys)
    assert set(cache_file.TuningCache(path).read()) == {"stage_a/x=1", "stage_b/x=2"}
    assert sorted(log_path.read_text().split()) == ["stage_a/x=1", "stage_b/x=2"]


@pytest.mark.parametrize("chunk_size", [64, 256])
@pytest.mark.parametrize("shape", [(4, 2048, 32, 64, 128, 1), (4, 8192, 80, 64, 256, 8),
                                   (1, 131072, 32, 128, 64, 1)])
def test_search_spaces_stay_small_and_contain_default(shape, chunk_size):
    """Each stage's own space holds its default wherever it has configs (the tuner would add it, but
    then the default is a config the space's compile checks never saw). At most 25 configs at chunk 256
    (at chunk 64 the staged chunk_scan space of headdim 128 has 27)."""
    b, L, H, P, N, G = shape
    dims = SSDDims(batch=b, seqlen=L, nheads=H, headdim=P, ngroups=G, dstate=N, chunk_size=chunk_size)
    for stage, spec in STAGES.items():
        space = timing.search_space(stage, dims, "sm_90")
        assert 1 <= len(space) <= (25 if chunk_size == 256 else 27), (stage, len(space))
        assert len(set(space)) == len(space)
        own = spec.space(dims, "sm_90")
        assert not own or spec.default(dims) in own, stage


def test_cutile_forward_traces_with_the_configs_forward_configs_returns(monkeypatch):
    """The bridge builds its plan from `forward_configs` (checked on the traced kernel grids)."""
    args, kwargs = make_ssd_args(0, batch=2, seqlen=128, nheads=4, headdim=32, dstate=32)
    dims = SSDDims(batch=2, seqlen=128, nheads=4, headdim=32, ngroups=1, dstate=32, chunk_size=64)
    chosen = {s: _non_default_config(s, dims) for s in FORWARD_STAGES}
    monkeypatch.setattr(tuning, "forward_configs", lambda d: ForwardConfigs("staged", chosen))
    static = op.SSDStatic(64, False, (0.0, float("inf")))
    inputs = op.SSDInputs(*args, None, None, None, None, None)
    jaxpr = jax.make_jaxpr(lambda inp: op._run_backend(backends.get("cutile", "test"), inp, static))(inputs)
    grids = [tuple(e.params["grid"]) for e in _cutile_calls(jaxpr.jaxpr)]
    expected = [launch.grid for launch in forward_plan(dims, chosen, "staged").launches]
    assert grids == [g + (1,) * (3 - len(g)) for g in expected]  # cutile_call pads grids to 3-D


@pytest.mark.parametrize("deterministic", [False, True])
def test_cutile_backward_traces_with_the_configs_backward_configs_returns(monkeypatch, deterministic):
    """The bridge's backward builds its plan from `backward_configs` in the call's determinism mode (at
    the kernels' chunk, 64, for the op's chunk_size 128)."""
    args, kwargs = make_ssd_args(0, batch=2, seqlen=256, nheads=4, headdim=32, ngroups=2, dstate=32)
    dims = SSDDims(batch=2, seqlen=256, nheads=4, headdim=32, ngroups=2, dstate=32,
                   chunk_size=problem.KERNEL_CHUNK_SIZE, dtype="float32")
    chosen = {s: _non_default_config(s, dims) for s in BACKWARD_STAGES}
    seen = []
    monkeypatch.setattr(tuning, "backward_configs", lambda d, det: seen.append(det) or chosen)
    static = op.SSDStatic(128, False, (0.0, float("inf")), deterministic_backward=deterministic)
    inputs = op.SSDInputs(*args, None, None, None, None, None)
    dy, dfinal = jnp.ones_like(args[0]), jnp.ones((2, 4, 32, 32), jnp.float32)
    backward = backends.get("cutile", "test").backward
    jaxpr = jax.make_jaxpr(lambda inp, dy, df: backward(inp, static, dy, df))(inputs, dy, dfinal)
    grids = [tuple(e.params["grid"]) for e in _cutile_calls(jaxpr.jaxpr)]
    expected = [launch.grid for launch in backward_plan(dims, chosen, deterministic=deterministic).launches]
    assert seen == [deterministic]
    assert grids == [g + (1,) * (3 - len(g)) for g in expected]


def _cutile_calls(jaxpr) -> list:
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cutile_call_ffi":
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.extend(_cutile_calls(sub))
    return found


def test_random_inputs_match_plan_inputs_with_realistic_values():
    dims = SSDDims(batch=2, seqlen=100, nheads=4, headdim=16, ngroups=2, dstate=16, chunk_size=64,
                   has_z=True, has_init=True, has_seq_idx=True)
    for backward, specs in [(False, forward_inputs(dims)), (True, backward_inputs(dims))]:
        inputs = timing.random_inputs(dims, backward=backward)
        assert list(inputs) == list(specs)
        for name, buf in specs.items():
            assert (inputs[name].shape, inputs[name].dtype) == (buf.shape, jnp.dtype(buf.dtype)), name
    arrays = timing.random_inputs(dims, backward=True)
    assert float(jnp.abs(arrays["dout"].astype(jnp.float32)).mean()) > 0.5
    assert float(jnp.abs(arrays["dfinal_states"]).mean()) > 0.5
    # Without dt_softplus, dt is Δ itself: softplus(N(-3, 1)), positive with median ~0.05.
    assert bool(jnp.all(arrays["dt"] > 0)) and 0.02 < float(jnp.median(arrays["dt"])) < 0.1
    assert bool(jnp.all(arrays["A"] < 0))
    ids = arrays["seq_idx"]
    assert bool(jnp.all(jnp.diff(ids, axis=1) >= 0)) and set(map(int, jnp.unique(ids))) == {0, 1, 2, 3}
    assert float(jnp.abs(arrays["x"].astype(jnp.float32)).mean()) > 0.5


def test_random_inputs_are_concrete_inside_a_jit_trace():
    """Tuning runs while `ssd` is traced: its arrays must be real device arrays, not tracers."""
    dims = SSDDims(batch=1, seqlen=64, nheads=2, headdim=16, ngroups=1, dstate=16, chunk_size=64)
    seen = {}

    def traced(x):
        seen.update(timing.random_inputs(dims))
        return x

    jax.jit(traced)(jnp.zeros(()))
    assert all(not isinstance(a, jax.core.Tracer) for a in seen.values())
    assert float(seen["x"].astype(jnp.float32).std()) > 0.5


def test_forward_configs_small_problems_use_defaults_untuned(cache_dir, monkeypatch):
    monkeypatch.setattr(timing, "tune_stages", _refuse_tuning)
    small = dataclasses.replace(DIMS, batch=1, seqlen=1024, nheads=8)
    report = _choices(small)
    assert {c.source for c in report.values()} == {"default"}
    assert "too small to be worth tuning" in report["chunk_scan"].reason


def test_forward_layout_times_report_what_the_layout_choice_compares(cache_dir, monkeypatch):
    fused_dims = dataclasses.replace(DIMS, chunk_size=64)
    _set_autotune(monkeypatch, "0")
    assert forward_layout_times(fused_dims) == {"staged": None, "fused": None}   # defaults: no times
    _set_autotune(monkeypatch, "1")
    tuning.clear_memory()
    monkeypatch.setattr(timing, "tune_stages", _fake_tuner([]))   # 1 us per stage
    assert forward_layout_times(fused_dims) == {"staged": 3.0, "fused": 2.0}
    assert tuning.forward_configs(fused_dims).layout == "fused"


def _train_step_args(batch=4, seqlen=8192, nheads=32, headdim=64, dstate=128):
    """Abstract arguments of an SSD call big enough to be tuned (autotune traces, nothing runs)."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    return (jax.ShapeDtypeStruct((batch, seqlen, nheads, headdim), bf16),
            jax.ShapeDtypeStruct((batch, seqlen, nheads), f32), jax.ShapeDtypeStruct((nheads,), f32),
            jax.ShapeDtypeStruct((batch, seqlen, 1, dstate), bf16),
            jax.ShapeDtypeStruct((batch, seqlen, 1, dstate), bf16),
            jax.ShapeDtypeStruct((batch, seqlen, nheads, headdim), bf16))


def _cutile_loss(x, dt, A, B, C, z):
    y = jax_mamba2.ssd(x, dt, A, B, C, 256, z=z, dt_softplus=True, backend="cutile")
    return jnp.sum(y.astype(jnp.float32))


def test_autotune_finds_every_ssd_plan_of_a_program_and_tunes_each_ahead_of_time(cache_dir, monkeypatch):
    """A training step (forward in a loss, its gradient, and a forward alone of another shape) traced on the
    CPU for sm_90, the timing harness faked: autotune finds the differentiated call's gate-free saving
    forward, its backward and the plain forward, tunes each once (both layouts of the fused-capable ones)
    whatever $JAX_MAMBA2_AUTOTUNE says, clears JAX's caches (before finding, and after tuning since configs
    changed), and the later lookups answer from memory."""
    _set_autotune(monkeypatch, "0")
    calls = []
    monkeypatch.setattr(timing, "tune_stages", _fake_tuner(calls))
    cleared, clear_caches = [], jax.clear_caches
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(True) or clear_caches())
    args = _train_step_args()
    other = _train_step_args(batch=2)

    def step(args, other):
        loss, grads = jax.value_and_grad(_cutile_loss, argnums=(0, 1, 2, 3, 4))(*args)
        return loss, grads, _cutile_loss(*other)

    with aot.cuda_target("sm_90"):
        plans = jax_mamba2.autotune(jax.jit(step), args, other)
    dims = SSDDims(batch=4, seqlen=8192, nheads=32, headdim=64, ngroups=1, dstate=128,
                   chunk_size=problem.KERNEL_CHUNK_SIZE, dtype="bfloat16", dt_dtype="float32", dt_softplus=True)
    saving = dims                                              # differentiated: gate-free
    alone = dataclasses.replace(dims, batch=2, has_z=True)
    assert [p.request for p in plans] == [
        layout_choice.PlanRequest(saving), layout_choice.PlanRequest(saving, backward=True),
        layout_choice.PlanRequest(alone)]
    # The fake tuner measures 1 us per stage: the fused layout's two stages sum least.
    assert forward_layouts(saving) == ("staged", "fused") and "segmented" in forward_layouts(alone)
    assert [p.layout for p in plans] == ["fused", None, "fused"]
    assert all(set(p.sources.values()) <= {"tuned", "disk"} for p in plans)
    # Every layout of each forward is tuned once (chunk_cumsum shared), the backward's own stages once.
    own = [s for s in BACKWARD_STAGES if s not in FORWARD_LAYOUTS["staged"]]
    assert sorted(map(tuple, calls)) == sorted(
        [("chunk_cumsum", "chunk_state", "chunk_scan"), ("fused_scan",)] * 2 + [("segment_states", "segmented_scan"),
                                                                                 tuple(own)])
    assert plans[1].configs == {**{s: plans[1].configs[s] for s in ("chunk_cumsum", "chunk_state")},
                                **{s: _non_default_config(s, saving) for s in own}}
    assert len(cleared) == 2                  # before the discovery (no stale trace), after tuning
    # The later trace of the step reads the tuned configs from memory: nothing is tuned again.
    monkeypatch.setattr(timing, "tune_stages", _refuse_tuning)
    assert tuning.forward_configs(saving) == ForwardConfigs(plans[0].layout, plans[0].configs)
    assert tuning.backward_configs(saving) == plans[1].configs
    # A second autotune of the same program finds everything tuned: no search, no cache clearing.
    with aot.cuda_target("sm_90"):
        again = jax_mamba2.autotune(jax.jit(step), args, other)
    assert [p.configs for p in again] == [p.configs for p in plans] and len(cleared) == 3


def test_autotune_of_a_program_without_cutile_calls_tunes_nothing(cache_dir, monkeypatch):
    monkeypatch.setattr(timing, "tune_stages", _refuse_tuning)
    x = jnp.ones((1, 64, 2, 16))
    assert jax_mamba2.autotune(lambda x: jax_mamba2.ssd(x, x[..., 0], -jnp.ones(2), x[:, :, :1], x[:, :, :1], 64,
                                                        backend="xla"), x) == []


def test_autotune_says_why_it_cannot_tune_here(cache_dir, monkeypatch):
    monkeypatch.setattr(cache_keys, "gpu_identity", lambda: None)
    with aot.cuda_target("sm_90"), pytest.raises(RuntimeError, match="cannot tune the 1 SSD plans of the program "
                                                                     "here: no CUDA GPU is visible to JAX"):
        jax_mamba2.autotune(_cutile_loss, *_train_step_args())
