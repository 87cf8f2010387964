"""benchmarks/tools/stages.py builds the forward and backward plans of every grid shape (timing needs a GPU)."""
import argparse
import dataclasses
import json
import sys
import types

import pytest

pytest.importorskip("cuda.tile")

from benchmarks.ssd import GRID, Shape  # noqa: E402
from benchmarks.tools import stages  # noqa: E402
from jax_mamba2.kernels import backward, forward  # noqa: E402


@pytest.mark.parametrize("shape", [Shape(*s) for s in GRID], ids=lambda s: s.label())
def test_stages_plans_cover_every_grid_shape(shape):
    dims = stages.dims_of(shape, 64)
    assert (dims.batch, dims.seqlen, dims.nheads, dims.headdim, dims.dstate, dims.ngroups) == tuple(shape)
    fwd, bwd = forward.forward_plan(dims), backward.backward_plan(dims)
    assert len(fwd.launches) == len(forward.FORWARD_LAYOUTS[forward.forward_layout(dims)])
    assert len(bwd.launches) == 7
    assert all(min(launch.grid) >= 1 for launch in fwd.launches + bwd.launches)


def test_bwd_variant_replaces_fields_of_the_stage_defaults():
    name, fields = stages.parse_variant(
        "wide:chunk_state_bwd.BLOCK_N=128,chunk_scan_bwd_dc.SUM_HEADS=1,chunk_scan_bwd_dc.BLOCK_K=64")
    assert name == "wide" and fields == {"chunk_state_bwd": {"BLOCK_N": 128},
                                         "chunk_scan_bwd_dc": {"SUM_HEADS": 1, "BLOCK_K": 64}}
    dims = stages.dims_of(Shape(4, 8192, 32, 64, 128, 1), 64)
    configs = stages.variant_configs(dims, fields)
    assert configs["chunk_state_bwd"].BLOCK_N == 128 and configs["chunk_scan_bwd_dc"].SUM_HEADS is True
    backward.backward_plan(dims, configs)


@pytest.mark.parametrize("text", ["nofields", "x:unknown_stage.BLOCK_N=1", "x:chunk_state_bwd.BLOCK_N"])
def test_bwd_variant_rejects_malformed_text(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected"):
        stages.parse_variant(text)


def test_bwd_variant_whose_tile_does_not_fit_is_refused_by_the_plan():
    _, fields = stages.parse_variant("wide:chunk_state_bwd.BLOCK_N=128")
    dims = stages.dims_of(Shape(4, 8192, 32, 64, 64, 1), 64)
    with pytest.raises(ValueError, match=r"configs\['chunk_state_bwd'\]\.BLOCK_N=128 must divide dstate=64"):
        backward.backward_plan(dims, stages.variant_configs(dims, fields))


def test_fwd_variant_builds_the_layout_its_stage_runs_in():
    name, fields = stages.parse_variant(
        "occ2:fused_scan.OCCUPANCY=2,fused_scan.LOAD_LAT=4,fused_scan.WORKER_WARPS=none", stages=forward.FORWARD_STAGES)
    dims = stages.dims_of(Shape(4, 8192, 80, 64, 64, 1), 64)
    configs = stages.variant_configs(dims, fields)
    default = forward.STAGES["fused_scan"].default(dims)
    assert configs["fused_scan"] == dataclasses.replace(default, OCCUPANCY=2, LOAD_LAT=4, WORKER_WARPS=None)
    plan = forward.forward_plan(dims, configs, stages.variant_layout(dims, configs))
    assert len(plan.launches) == len(forward.FORWARD_LAYOUTS["fused"])
    with pytest.raises(argparse.ArgumentTypeError, match="expected"):
        stages.parse_variant("occ2:chunk_scan_bwd_dc.OCCUPANCY=2", stages=forward.FORWARD_STAGES)


def test_features_set_the_problem_flags():
    dims = stages.dims_of(Shape(4, 8192, 32, 64, 64, 1), 64, ("z", "seq_idx"))
    assert (dims.has_z, dims.has_init, dims.has_seq_idx) == (True, False, True)


def test_main_builds_every_asked_plan_and_records_it(monkeypatch, tmp_path):
    """The plans main() times, with the launches' timing stubbed (it needs a GPU): a forward variant in its
    layout, the backward plans gate-free under --features z."""
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(from_dlpack=lambda value: value))
    monkeypatch.setattr(stages.timing, "random_inputs", lambda dims, backward=False: {})
    monkeypatch.setattr(stages, "time_launches", lambda plan, arrays, repeats: [
        {"kernel": launch.kernel._annotated_function.pyfunc.__name__, "grid": list(launch.grid), "ms_median": 1.0}
        for launch in plan.launches])
    stages.main(["--shapes", "4,8192,32,64,64,1", "--features", "z", "seq_idx", "--deterministic",
                 "--fwd-variant", "pairs:fused_scan.CHUNKS_PER_ITER=2,fused_scan.WORKER_WARPS=8",
                 "--bwd-variant", "occ2:chunk_state_bwd.OCCUPANCY=2", "--out", str(tmp_path)])
    records = json.loads(next(tmp_path.glob("ssd_stages_*.json")).read_text())
    plans = {(r["direction"], r["layout"]) for r in records}
    assert plans == {("fwd", "fused"), ("fwd_pairs", "fused"), ("bwd", None), ("bwd_deterministic", None),
                     ("bwd_occ2", None)}
    assert all(r["features"] == ["z", "seq_idx"] for r in records)
    assert {r["kernel"] for r in records if r["direction"] == "fwd_pairs"} == {
        "chunk_cumsum_fwd_kernel", "fused_scan_fwd_kernel"}
    variant = next(r["variant"] for r in records if r["direction"] == "fwd_pairs")
    assert variant == {"fused_scan": {"CHUNKS_PER_ITER": 2, "WORKER_WARPS": 8}}


def test_time_launches_warms_the_plan_up_before_timing_each_launch(monkeypatch):
    """The order of the launches (ct.launch stubbed, torch faked): the plan once, the plan back to back during
    the warm-up, then each launch `repeats` times alone."""
    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self, stream):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 0.5

    class Stream:
        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    cuda = types.SimpleNamespace(Stream=Stream, Event=Event, current_stream=lambda: None)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(stages.eager, "ArrayNamespace", lambda name: types.SimpleNamespace(
        zeros=lambda shape, dtype: "zeros", empty=lambda shape, dtype: "empty"))
    names = []
    monkeypatch.setattr(stages.ct, "launch", lambda stream, grid, kernel, args: names.append(
        kernel._annotated_function.pyfunc.__name__))
    plan = forward.forward_plan(stages.dims_of(Shape(4, 8192, 32, 64, 128, 1), 64))
    kernels = [launch.kernel._annotated_function.pyfunc.__name__ for launch in plan.launches]
    rows = stages.time_launches(plan, {name: "input" for name in plan.inputs}, repeats=3, warmup_s=0.0)
    timed = [name for name in kernels for _ in range(3)]
    warm = names[len(kernels):-len(timed)]
    assert names[:len(kernels)] == kernels and names[-len(timed):] == timed
    assert warm and warm == kernels * (len(warm) // len(kernels))
    assert [(row["kernel"], row["ms_median"]) for row in rows] == [(name, 0.5) for name in kernels]
