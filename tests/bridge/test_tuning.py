"""Kernel config lookup: cache keys, the on-disk cache, concurrent writers, env switches, fallbacks.

Tuning itself needs a GPU; here the GPU identity and the tuner are replaced by fakes, so the lookup
order, the file format and the locking are checked on CPU.
"""
import dataclasses
import json
import multiprocessing
import time

import jax
import jax.extend
import jax.numpy as jnp
import pytest

pytest.importorskip("cuda.tile")

from jax_mamba2 import op  # noqa: E402
from jax_mamba2.bridge import tuning  # noqa: E402
from jax_mamba2.kernels._common import SSDDims  # noqa: E402
from jax_mamba2.kernels.forward import FORWARD_STAGES, forward_arrays  # noqa: E402
from tests._helpers import make_ssd_args  # noqa: E402

DIMS = SSDDims(batch=4, seqlen=8192, nheads=32, headdim=64, ngroups=1, dstate=128, chunk_size=256)
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
    spec = tuning._STAGES[stage]
    default = spec.default_config(dims)
    return next(c for c in reversed(spec.configs(dims, "sm_90")) if c != default)


def _fake_tuner(calls):
    """A `_tune_stages` stand-in that records its calls and picks a non-default config per stage."""
    def tune_stages(dims, stages, arch):
        calls.append(list(stages))
        for stage in stages:
            cfg = _non_default_config(stage, dims)
            yield stage, {"config": dataclasses.asdict(cfg), "mean_us": 1.0, "measured": []}
    return tune_stages


def _refuse_tuning(dims, stages, arch):
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


def test_forward_configs_env_off_uses_defaults(cache_dir, monkeypatch):
    monkeypatch.setenv(tuning.ENV_AUTOTUNE, "0")
    monkeypatch.setattr(tuning, "_tune_stages", _refuse_tuning)
    report = tuning.tune_report(DIMS)
    for stage, spec in tuning._STAGES.items():
        assert report[stage]["source"] == "default"
        assert report[stage]["reason"] == f"{tuning.ENV_AUTOTUNE}=0"
        assert report[stage]["config"] == dataclasses.asdict(spec.default_config(DIMS))
    assert not list(cache_dir.iterdir())


def test_forward_configs_without_gpu_uses_defaults(cache_dir, monkeypatch):
    monkeypatch.setattr(tuning, "_gpu_identity", lambda: None)
    monkeypatch.setattr(tuning, "_tune_stages", _refuse_tuning)
    configs = tuning.forward_configs(DIMS)
    assert configs == {s: spec.default_config(DIMS) for s, spec in tuning._STAGES.items()}
    assert not list(cache_dir.iterdir())


def test_forward_configs_tuning_failure_warns_and_uses_defaults(cache_dir, monkeypatch):
    def broken(dims, stages, arch):
        raise RuntimeError("out of memory")
        yield  # a generator, like the real tuner

    monkeypatch.setattr(tuning, "_tune_stages", broken)
    with pytest.warns(RuntimeWarning, match="autotuning .* failed .*out of memory"):
        report = tuning.tune_report(DIMS)
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


@pytest.mark.parametrize("shape", [(4, 2048, 32, 64, 128, 1), (4, 8192, 80, 64, 256, 8),
                                   (1, 131072, 32, 128, 64, 1)])
def test_search_spaces_stay_small_and_contain_default(shape):
    b, L, H, P, N, G = shape
    dims = SSDDims(batch=b, seqlen=L, nheads=H, headdim=P, ngroups=G, dstate=N, chunk_size=256)
    for stage, spec in tuning._STAGES.items():
        space = tuning._search_space(stage, dims, "sm_90")
        assert 1 <= len(space) <= 25, (stage, len(space))
        assert spec.default_config(dims) in space and len(set(space)) == len(space)


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
    expected = [tuning._STAGES[s].launch(dims, chosen[s]).grid for s in FORWARD_STAGES]
    assert grids == [g + (1,) * (3 - len(g)) for g in expected]  # cutile_call pads grids to 3-D


def _cutile_calls(jaxpr) -> list:
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cutile_call_ffi":
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.extend(_cutile_calls(sub))
    return found


def test_random_problem_matches_plan_arrays_with_realistic_values():
    dims = SSDDims(batch=2, seqlen=100, nheads=4, headdim=16, ngroups=2, dstate=16, chunk_size=64,
                   has_z=True, has_init=True, has_seq_idx=True)
    arrays = tuning.random_problem(dims)
    for name, buf in forward_arrays(dims).items():
        assert (arrays[name].shape, arrays[name].dtype) == (buf.shape, jnp.dtype(buf.dtype)), name
    # Without dt_softplus, dt is Δ itself: softplus(N(-3, 1)), positive with median ~0.05.
    assert bool(jnp.all(arrays["dt"] > 0)) and 0.02 < float(jnp.median(arrays["dt"])) < 0.1
    assert bool(jnp.all(arrays["A"] < 0))
    ids = arrays["seq_idx"]
    assert bool(jnp.all(jnp.diff(ids, axis=1) >= 0)) and set(map(int, jnp.unique(ids))) == {0, 1, 2, 3}
    assert float(jnp.abs(arrays["x"].astype(jnp.float32)).mean()) > 0.5


def test_random_problem_is_concrete_inside_a_jit_trace():
    """Tuning runs while `ssd` is traced: its arrays must be real device arrays, not tracers."""
    dims = SSDDims(batch=1, seqlen=64, nheads=2, headdim=16, ngroups=1, dstate=16, chunk_size=64)
    seen = {}

    def traced(x):
        seen.update(tuning.random_problem(dims))
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
