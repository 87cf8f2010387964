"""Kernel config lookup: cache keys, the on-disk cache, concurrent writers, env switches, fallbacks.

Tuning itself needs a GPU; here the GPU identity and the tuner (or the search, launches and array
library under it) are replaced by fakes, so the lookup order, the file format, the locking and what
each timed launch is given are checked on CPU.
"""
import contextlib
import dataclasses
import json
import multiprocessing
import time
import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

ct = pytest.importorskip("cuda.tile")

from jax_mamba2 import op  # noqa: E402
from jax_mamba2.bridge import problem, tuning  # noqa: E402
from jax_mamba2.kernels._common import SSDDims  # noqa: E402
from jax_mamba2.kernels.backward import BACKWARD_STAGES, backward_inputs, backward_plan  # noqa: E402
from jax_mamba2.kernels.forward import FORWARD_LAYOUTS, forward_inputs, forward_layout, forward_plan  # noqa: E402
from jax_mamba2.kernels.stage_spaces import STAGE_SPACES  # noqa: E402
from tests._helpers import make_ssd_args  # noqa: E402

DIMS = SSDDims(batch=4, seqlen=8192, nheads=32, headdim=64, ngroups=1, dstate=128, chunk_size=256)
# Half the batch: the atomic backward splits each group over two blocks (see backward.group_heads_per_block).
GROUP_SPLIT_DIMS = dataclasses.replace(DIMS, batch=2)
FORWARD_STAGES = FORWARD_LAYOUTS["staged"]      # DIMS's layout (chunk 256)
FAKE_GPU = tuning.GpuIdentity(name="NVIDIA H200", arch="sm_90")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache directory, tuning enabled, a fake H200, and no process-local choices."""
    monkeypatch.setenv(tuning.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setenv(tuning.ENV_AUTOTUNE, "1")
    monkeypatch.setattr(tuning, "_gpu_identity", lambda: FAKE_GPU)
    monkeypatch.setattr(tuning, "_array_library_missing_reason", lambda: None)
    tuning.clear_memory()
    yield tmp_path
    tuning.clear_memory()


def _non_default_config(stage, dims):
    spec = STAGE_SPACES[stage]
    default = spec.default_config(dims)
    return next(c for c in reversed(spec.configs(dims, "sm_90")) if c != default)


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
    assert tuning.stage_key("chunk_state", DIMS) == (
        "chunk_state/chunk_size=256,headdim=64,dstate=128,dtype=bfloat16,has_init=False,"
        "has_seq_idx=False,index64=False,work=128")
    # seqlen is not a chunk_state key field and batch * nheads stays 128: same key.
    same = dataclasses.replace(DIMS, seqlen=2048)
    assert tuning.stage_key("chunk_state", same) == tuning.stage_key("chunk_state", DIMS)
    for field, value in [("dstate", 64), ("dtype", "float16"), ("has_z", True), ("chunk_size", 128)]:
        changed = dataclasses.replace(DIMS, **{field: value})
        assert tuning.stage_key("chunk_scan", changed) != tuning.stage_key("chunk_scan", DIMS), field
    # The work bucket: 4x the chunks is a new bucket for chunk_scan, not for chunk_state.
    longer = dataclasses.replace(DIMS, seqlen=4 * DIMS.seqlen)
    assert tuning.stage_key("chunk_scan", longer) != tuning.stage_key("chunk_scan", DIMS)
    assert tuning.stage_key("chunk_state", longer) == tuning.stage_key("chunk_state", DIMS)


def test_cache_path_names_gpu_versions_and_kernel_source(cache_dir):
    name = tuning.cache_path(FAKE_GPU).name
    assert tuning.cache_path(FAKE_GPU).parent == cache_dir
    assert name.startswith("NVIDIA_H200-sm_90-cuda_tile_") and "-jax_mamba2_" in name
    assert "-kernels_" in name and name.endswith(".json")


def test_forward_configs_tunes_once_then_reads_disk(cache_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(tuning, "_tune_stages", _fake_tuner(calls))
    configs = tuning.forward_configs(DIMS)
    expected = {s: _non_default_config(s, DIMS) for s in FORWARD_STAGES}
    assert configs == expected
    assert calls == [list(FORWARD_STAGES)]
    assert {r["source"] for r in tuning.tune_report(DIMS).values()} == {"tuned"}

    stored = json.loads(tuning.cache_path(FAKE_GPU).read_text())
    assert stored["schema"] == tuning.CACHE_SCHEMA
    assert set(stored["entries"]) == {tuning.stage_key(s, DIMS) for s in FORWARD_STAGES}

    # A new process (no memory): the disk answers and nothing is tuned.
    tuning.clear_memory()
    monkeypatch.setattr(tuning, "_tune_stages", _refuse_tuning)
    assert tuning.forward_configs(DIMS) == expected
    report = tuning.tune_report(DIMS)
    assert {r["source"] for r in report.values()} == {"disk"}
    assert report["chunk_scan"]["config"] == dataclasses.asdict(expected["chunk_scan"])


def test_forward_configs_retunes_only_stale_entries(cache_dir, monkeypatch):
    monkeypatch.setattr(tuning, "_tune_stages", _fake_tuner([]))
    tuning.forward_configs(DIMS)
    path = tuning.cache_path(FAKE_GPU)
    stored = json.loads(path.read_text())
    stored["entries"][tuning.stage_key("chunk_scan", DIMS)]["config"] = {"NO_SUCH_FIELD": 1}
    path.write_text(json.dumps(stored))

    tuning.clear_memory()
    calls = []
    monkeypatch.setattr(tuning, "_tune_stages", _fake_tuner(calls))
    sources = {s: r["source"] for s, r in tuning.tune_report(DIMS).items()}
    assert calls == [["chunk_scan"]]
    assert sources == {"chunk_cumsum": "disk", "chunk_state": "disk", "chunk_scan": "tuned"}


def test_stage_key_names_heads_per_block_where_deterministic_changes_the_launch():
    # 32 heads in one group, half DIMS' batch: deterministic mode gives a block the whole group, the atomic
    # mode 16 heads (the most that leave backward.MIN_GROUP_PASS_BLOCKS blocks).
    grouped = GROUP_SPLIT_DIMS
    assert tuning.stage_key("chunk_scan_bwd_dc", grouped) == (
        "chunk_scan_bwd_dc/chunk_size=256,headdim=64,dstate=128,heads_per_group=32,dtype=bfloat16,"
        "has_seq_idx=False,heads_per_block=16,index64=False,work=128")
    assert tuning.stage_key("chunk_scan_bwd_dx", grouped, deterministic=True).endswith(
        "heads_per_block=32,index64=False,work=64")
    # At DIMS' batch the atomic mode gives a block the whole group too: one launch, one key, in both modes.
    assert tuning.stage_key("chunk_scan_bwd_dc", DIMS) == tuning.stage_key("chunk_scan_bwd_dc", DIMS, True)
    for stage in BACKWARD_STAGES:
        differs = tuning.stage_key(stage, grouped) != tuning.stage_key(stage, grouped, True)
        assert differs == (stage in ("chunk_scan_bwd_dc", "chunk_scan_bwd_dx")), stage
    # One head per group: both modes launch the same kernels, so they share every key.
    per_head = dataclasses.replace(DIMS, ngroups=DIMS.nheads)
    assert all(tuning.stage_key(s, per_head) == tuning.stage_key(s, per_head, True) for s in BACKWARD_STAGES)


def test_backward_configs_reuse_forward_recompute_configs_and_tune_the_rest_once(cache_dir, monkeypatch):
    calls, given = [], []
    monkeypatch.setattr(tuning, "_tune_stages", _fake_tuner(calls, given))
    forward = tuning.forward_configs(DIMS)
    backward = tuning.backward_configs(DIMS)
    assert calls == [list(FORWARD_STAGES), BACKWARD_OWN]
    assert backward == {**{s: forward[s] for s in ("chunk_cumsum", "chunk_state")},
                        **{s: _non_default_config(s, DIMS) for s in BACKWARD_OWN}}
    # The backward stages were tuned after the forward's recompute configs, the others at defaults.
    assert given[1] == {**{s: forward[s] for s in ("chunk_cumsum", "chunk_state")},
                        **{s: STAGE_SPACES[s].default_config(DIMS) for s in BACKWARD_OWN}}
    stored = json.loads(tuning.cache_path(FAKE_GPU).read_text())["entries"]
    assert set(stored) == {tuning.stage_key(s, DIMS) for s in FORWARD_STAGES + BACKWARD_STAGES}

    # A new process: the disk answers for both passes.
    tuning.clear_memory()
    monkeypatch.setattr(tuning, "_tune_stages", _refuse_tuning)
    assert tuning.backward_configs(DIMS) == backward
    assert {r["source"] for r in tuning.tune_report(DIMS, backward=True).values()} == {"disk"}


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

    monkeypatch.setattr(tuning, "_tune_stages", tune_stages)
    forward = tuning.forward_configs(fused_dims)
    # staged: 3 stages x 1 us; fused: 1 + fused_us. chunk_cumsum is tuned once and shared.
    assert calls == [["chunk_cumsum", "chunk_state", "chunk_scan"], ["fused_scan"]]
    assert set(forward) == set(FORWARD_LAYOUTS[want])
    assert len(forward_plan(fused_dims, forward).launches) == len(FORWARD_LAYOUTS[want])
    # The backward's recompute takes the forward's chunk_cumsum and the chunk_state tuned with the
    # staged layout (from the cache), tuning only its own stages.
    backward = tuning.backward_configs(fused_dims)
    assert calls[2:] == [BACKWARD_OWN]
    assert backward["chunk_cumsum"] == forward["chunk_cumsum"]
    assert backward["chunk_state"] == _non_default_config("chunk_state", fused_dims)
    # A new process reads both layouts from disk and makes the same choice.
    tuning.clear_memory()
    monkeypatch.setattr(tuning, "_tune_stages", _refuse_tuning)
    assert tuning.forward_configs(fused_dims) == forward


def test_forward_configs_without_measurements_follow_the_layout_rule(cache_dir, monkeypatch):
    monkeypatch.setenv(tuning.ENV_AUTOTUNE, "0")
    fused_dims = dataclasses.replace(DIMS, chunk_size=64)
    assert set(tuning.forward_configs(fused_dims)) == set(FORWARD_LAYOUTS["fused"])
    few_chains = dataclasses.replace(fused_dims, batch=1)
    assert set(tuning.forward_configs(few_chains)) == set(FORWARD_LAYOUTS[forward_layout(few_chains)])
    assert set(tuning.forward_configs(dataclasses.replace(fused_dims, dtype="float32", dt_dtype="float32"))
               ) == set(FORWARD_LAYOUTS["staged"])


def test_backward_configs_deterministic_tunes_only_the_group_reducing_stages_again(cache_dir, monkeypatch):
    monkeypatch.setattr(tuning, "_tune_stages", _fake_tuner([]))
    tuning.backward_configs(GROUP_SPLIT_DIMS, deterministic=False)
    tuning.clear_memory()
    calls = []
    monkeypatch.setattr(tuning, "_tune_stages", _fake_tuner(calls))
    report = tuning.tune_report(GROUP_SPLIT_DIMS, backward=True, deterministic=True)
    assert calls == [["chunk_scan_bwd_dc", "chunk_scan_bwd_dx"]]
    tuned = {s for s, r in report.items() if r["source"] == "tuned"}
    assert tuned == {"chunk_scan_bwd_dc", "chunk_scan_bwd_dx"}
    assert "heads_per_block=32" in report["chunk_scan_bwd_dc"]["key"]


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

    fake_ct = types.SimpleNamespace(launch=launch, compiler_timeout=lambda s: contextlib.nullcontext(),
                                    tune=types.SimpleNamespace(exhaustive_search=exhaustive_search))
    monkeypatch.setattr(tuning, "ct", fake_ct)
    monkeypatch.setattr(tuning, "_array_library", lambda: _FAKE_LIBRARY)

    start = {s: STAGE_SPACES[s].default_config(dims) for s in BACKWARD_STAGES}
    spec = tuning._BACKWARD[False]
    entries = dict(tuning._tune_stages(dims, spec, BACKWARD_OWN, start, "sm_90"))
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
        kind, runs = events[i]
        i += 1
        assert kind == "search" and list(runs) == tuning._search_space(stage, dims, "sm_90")
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
    monkeypatch.setenv(tuning.ENV_AUTOTUNE, "0")
    monkeypatch.setattr(tuning, "_tune_stages", _refuse_tuning)
    report = tuning.tune_report(DIMS, backward=backward)
    assert tuple(report) == (BACKWARD_STAGES if backward else FORWARD_STAGES)
    for stage, r in report.items():
        assert r["source"] == "default" and r["reason"] == f"{tuning.ENV_AUTOTUNE}=0"
        assert r["config"] == dataclasses.asdict(STAGE_SPACES[stage].default_config(DIMS))
    assert not list(cache_dir.iterdir())


def test_configs_without_gpu_use_defaults(cache_dir, monkeypatch):
    monkeypatch.setattr(tuning, "_gpu_identity", lambda: None)
    monkeypatch.setattr(tuning, "_tune_stages", _refuse_tuning)
    defaults = {s: spec.default_config(DIMS) for s, spec in STAGE_SPACES.items()}
    assert tuning.forward_configs(DIMS) == {s: defaults[s] for s in FORWARD_STAGES}
    assert tuning.backward_configs(DIMS, deterministic=True) == {s: defaults[s] for s in BACKWARD_STAGES}
    assert not list(cache_dir.iterdir())


@pytest.mark.parametrize("backward", [False, True])
def test_configs_tuning_failure_warns_and_uses_defaults(cache_dir, monkeypatch, backward):
    def broken(dims, spec, stages, configs, arch):
        raise RuntimeError("out of memory")
        yield  # a generator, like the real tuner

    monkeypatch.setattr(tuning, "_tune_stages", broken)
    with pytest.warns(RuntimeWarning, match="autotuning .* failed .*out of memory"):
        report = tuning.tune_report(DIMS, backward=backward)
    assert {r["source"] for r in report.values()} == {"default"}
    assert tuning._TuningCache(tuning.cache_path(FAKE_GPU)).read() == {}


def test_autotune_env_rejects_other_values(monkeypatch):
    monkeypatch.setenv(tuning.ENV_AUTOTUNE, "yes")
    with pytest.raises(ValueError, match="JAX_MAMBA2_AUTOTUNE='yes' must be '0' or '1'"):
        tuning.autotune_enabled()


def test_tuning_cache_ignores_corrupt_and_foreign_files(tmp_path):
    path = tmp_path / "cache.json"
    cache = tuning._TuningCache(path)
    path.write_text("{not json")
    assert cache.read() == {}
    path.write_text(json.dumps({"schema": tuning.CACHE_SCHEMA + 1, "entries": {"k": {}}}))
    assert cache.read() == {}
    assert cache.fill(["k"], lambda keys: iter([("k", {"config": {}})])) == {"k": {"config": {}}}
    assert cache.read() == {"k": {"config": {}}}


def _fill_from_process(path, key, log_path, barrier):
    """Worker: tunes `key` slowly into the shared cache, logging each tuning it actually runs."""
    def slow_tune(keys):
        with open(log_path, "a") as log:
            log.write(f"{key}\n")
        time.sleep(0.3)  # long enough that an unlocked writer would interleave
        for k in keys:
            yield k, {"config": {"by": key}}

    barrier.wait()
    tuning._TuningCache(path).fill([key], slow_tune)


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
    assert set(tuning._TuningCache(path).read()) == {"stage_a/x=1", "stage_b/x=2"}
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
    for stage, spec in STAGE_SPACES.items():
        space = tuning._search_space(stage, dims, "sm_90")
        assert 1 <= len(space) <= (25 if chunk_size == 256 else 27), (stage, len(space))
        assert len(set(space)) == len(space)
        own = spec.configs(dims, "sm_90")
        assert not own or spec.default_config(dims) in own, stage


def test_cutile_forward_traces_with_the_configs_forward_configs_returns(monkeypatch):
    """The bridge builds its plan from `forward_configs` (checked on the traced kernel grids)."""
    args, kwargs = make_ssd_args(0, batch=2, seqlen=128, nheads=4, headdim=32, dstate=32)
    dims = SSDDims(batch=2, seqlen=128, nheads=4, headdim=32, ngroups=1, dstate=32, chunk_size=64)
    chosen = {s: _non_default_config(s, dims) for s in FORWARD_STAGES}
    monkeypatch.setattr(tuning, "forward_configs", lambda d: chosen)
    static = op.SSDStatic(64, False, (0.0, float("inf")))
    inputs = op.SSDInputs(*args, None, None, None, None, None)
    jaxpr = jax.make_jaxpr(lambda inp: op._run_backend(op._BACKENDS["cutile"], inp, static))(inputs)
    grids = [tuple(e.params["grid"]) for e in _cutile_calls(jaxpr.jaxpr)]
    expected = [launch.grid for launch in forward_plan(dims, chosen).launches]
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
    backward = op._BACKENDS["cutile"].backward
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
        inputs = tuning.random_inputs(dims, backward=backward)
        assert list(inputs) == list(specs)
        for name, buf in specs.items():
            assert (inputs[name].shape, inputs[name].dtype) == (buf.shape, jnp.dtype(buf.dtype)), name
    arrays = tuning.random_inputs(dims, backward=True)
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
        seen.update(tuning.random_inputs(dims))
        return x

    jax.jit(traced)(jnp.zeros(()))
    assert all(not isinstance(a, jax.core.Tracer) for a in seen.values())
    assert float(seen["x"].astype(jnp.float32).std()) > 0.5


def test_forward_configs_small_problems_use_defaults_untuned(cache_dir, monkeypatch):
    monkeypatch.setattr(tuning, "_tune_stages", _refuse_tuning)
    small = dataclasses.replace(DIMS, batch=1, seqlen=1024, nheads=8)
    report = tuning.tune_report(small)
    assert {r["source"] for r in report.values()} == {"default"}
    assert "too small to be worth tuning" in report["chunk_scan"]["reason"]


def test_forward_layout_times_report_what_the_layout_choice_compares(cache_dir, monkeypatch):
    fused_dims = dataclasses.replace(DIMS, chunk_size=64)
    monkeypatch.setenv(tuning.ENV_AUTOTUNE, "0")
    assert tuning.forward_layout_times(fused_dims) == {"staged": None, "fused": None}   # defaults: no times
    monkeypatch.setenv(tuning.ENV_AUTOTUNE, "1")
    tuning.clear_memory()
    monkeypatch.setattr(tuning, "_tune_stages", _fake_tuner([]))   # 1 us per stage
    assert tuning.forward_layout_times(fused_dims) == {"staged": 3.0, "fused": 2.0}
    assert set(tuning.forward_configs(fused_dims)) == set(FORWARD_LAYOUTS["fused"])
