"""The RMSNorm kernels' forward and backward plans, run block by block on the NumPy emulator of cuda.tile
(tests/kernels/_cutile_emulator.py) against the float64 reference (jax_mamba2.norm_reference) on fresh random
inputs: every gate placement, several groups, a group that is not a power of two, odd row counts, the residual
add + norm, and the backward's persistent loop over several row blocks per block."""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("cuda.tile")

from jax_mamba2.kernels.rms_norm import (NormConfig, norm_default_config, rms_norm_fwd_inputs,  # noqa: E402
                                         rms_norm_fwd_plan)
from jax_mamba2.kernels.rms_norm_bwd import (  # noqa: E402
    bwd_programs, dx_is_dresidual, rms_norm_bwd_inputs, rms_norm_bwd_plan)
from tests._helpers import rel_l2  # noqa: E402
from tests.kernels import _cutile_emulator as emulator  # noqa: E402
from tests.kernels._norm_checks import CASES, NormCase, make_inputs, oracle  # noqa: E402
from tests.kernels._plan_checks import assert_plan_well_formed  # noqa: E402


def _rows(dims, a):
    return a.reshape(dims.rows, dims.ngroups, dims.group_size)


def _dummy(dtype):
    return np.zeros((1, 1, 1), dtype)


def run_kernels(case: NormCase, arrays: dict, cfg=None, *, float64: bool = True) -> dict:
    """The forward then the backward plan on the emulator -> out, residual_out, dx, dz, dresidual, dweight as
    (rows, features) / (features,) arrays (absent ones left out)."""
    dims = case.dims()
    x_dtype = arrays["x"].dtype
    fwd = emulator.run_plan(rms_norm_fwd_plan(dims, cfg), dict(
        x=_rows(dims, arrays["x"]), z=_rows(dims, arrays["z"]) if case.gate else _dummy(x_dtype),
        residual=_rows(dims, arrays["residual"]) if case.residual else _dummy(x_dtype),
        weight=arrays["weight"].reshape(dims.ngroups, dims.group_size)), float64=float64)
    bwd = emulator.run_plan(rms_norm_bwd_plan(dims, cfg), dict(
        x=fwd["residual_out"] if case.residual else _rows(dims, arrays["x"]),
        z=_rows(dims, arrays["z"]) if case.gate else _dummy(x_dtype),
        weight=arrays["weight"].reshape(dims.ngroups, dims.group_size), dout=_rows(dims, arrays["dout"]),
        # residual_out's cotangent, updated in place into the residual's (a copy: the oracle reads the original)
        **({"dresidual": _rows(dims, arrays["dresidual_out"]).copy()} if case.residual else {})), float64=float64)
    shape = (case.rows, case.features)
    dx = bwd["dresidual" if dx_is_dresidual(dims) else "dx"]  # as the bridge reads it
    result = dict(out=fwd["out"].reshape(shape), dx=dx.reshape(shape),
                  dweight=bwd["dweight"].reshape(case.features))
    if case.gate:
        result["dz"] = bwd["dz"].reshape(shape)
    if case.residual:
        result["residual_out"] = fwd["residual_out"].reshape(shape)
        result["dresidual"] = bwd["dresidual"].reshape(shape)
    return result


def assert_matches_oracle(case, arrays, got, tolerance):
    want = oracle(case, arrays)
    assert set(got) == set(want)
    errors = {name: rel_l2(got[name], want[name]) for name in want}
    assert max(errors.values()) < tolerance, errors


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_forward_and_backward_match_float64_reference(name):
    """In float64 the kernels' algebra is exact to ~1e-15: what differs from the reference is a bug."""
    case = CASES[name]
    arrays = make_inputs(case, seed=hash(name) % 1000)
    assert_matches_oracle(case, arrays, run_kernels(case, arrays), 1e-10)


@pytest.mark.parametrize("name", ["gate_before_groups3", "gate_after_groups3", "add_norm"])
def test_emulated_backward_loops_over_row_blocks(name):
    """One row per block at occupancy 1 on 300 rows: 132 / ngroups programs each walk two or three row blocks
    (the persistent loop and the weight gradient's partial sums), the last program fewer."""
    case = dataclasses.replace(CASES[name], rows=300)
    cfg = NormConfig(BLOCK_ROWS=1, FWD_OCCUPANCY=1, BWD_OCCUPANCY=1)
    dims = case.dims()
    assert bwd_programs(dims, cfg) < dims.rows
    arrays = make_inputs(case, seed=7)
    assert_matches_oracle(case, arrays, run_kernels(case, arrays, cfg), 1e-10)


@pytest.mark.parametrize("dtype,tolerance", [("bfloat16", 2e-2), ("float16", 3e-3), ("float32", 1e-5)])
@pytest.mark.parametrize("name", ["gate_before_groups3", "gate_after_one_group", "add_norm"])
def test_emulated_kernels_in_their_dtypes_match_float64_reference(name, dtype, tolerance):
    """The arrays in their own dtypes (f32 math on 16-bit inputs, the residual stream rounded to float32)."""
    case = dataclasses.replace(CASES[name], dtype=dtype)
    arrays = make_inputs(case, seed=11)
    got = run_kernels(case, arrays, float64=False)
    assert got["out"].dtype == (ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
    assert got["dx"].dtype == got["out"].dtype and got["dweight"].dtype == np.float32
    assert_matches_oracle(case, arrays, got, tolerance)


@pytest.mark.parametrize("weight_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["gate_before_groups3", "add_norm"])
def test_emulated_kernels_take_the_weight_in_its_own_16_bit_dtype(name, weight_dtype):
    """A bf16 model's norm scale goes to the kernels as it is (no conversion before the launch): they widen it
    as they load it, and the weight gradient comes out in f32 (the op rounds it to the weight's dtype)."""
    case = dataclasses.replace(CASES[name], dtype="bfloat16", weight_dtype=weight_dtype)
    dims = case.dims()
    assert rms_norm_fwd_inputs(dims)["weight"].dtype == rms_norm_bwd_inputs(dims)["weight"].dtype == weight_dtype
    arrays = make_inputs(case, seed=13)
    assert arrays["weight"].dtype == (ml_dtypes.bfloat16 if weight_dtype == "bfloat16" else np.float16)
    got = run_kernels(case, arrays, float64=False)
    assert got["dweight"].dtype == np.float32
    assert_matches_oracle(case, arrays, got, 2e-2)


@pytest.mark.parametrize("name", list(CASES))
def test_norm_plans_well_formed(name):
    dims = CASES[name].dims()
    for plan in (rms_norm_fwd_plan(dims), rms_norm_bwd_plan(dims)):
        assert_plan_well_formed(plan)
    # The add + norm's backward turns residual_out's cotangent into the residual's in place: one array in and
    # out, so that a layer loop carries it in one buffer.
    in_place = set(rms_norm_bwd_plan(dims).inputs) & set(rms_norm_bwd_plan(dims).outputs)
    assert in_place == ({"dresidual"} if CASES[name].residual else set())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_add_norm_backward_writes_dx_apart_only_in_another_dtype_than_the_stream(dtype):
    """dx and dresidual are the same values: with x in the residual stream's float32 the plan writes them once
    (its "dx" a (1, 1, 1) dummy the kernel never stores, dx read from dresidual); with bf16 x, dx is a buffer of
    its own in x's dtype. The emulated gradients match the float64 reference either way."""
    case = dataclasses.replace(CASES["add_norm"], dtype=dtype)
    dims = case.dims()
    plan = rms_norm_bwd_plan(dims)
    assert dx_is_dresidual(dims) == (dtype == "float32")
    assert plan.buffers["dx"].shape == ((1, 1, 1) if dtype == "float32" else dims.row_shape())
    arrays = make_inputs(case, seed=23)
    got = run_kernels(case, arrays, float64=False)
    assert got["dx"].dtype == (np.float32 if dtype == "float32" else ml_dtypes.bfloat16)
    assert_matches_oracle(case, arrays, got, 1e-5 if dtype == "float32" else 2e-2)


@pytest.mark.parametrize("case,rows,occupancies", [
    (NormCase(rows=100, features=2048, gate="before"), 1, (8, 2)),
    (NormCase(rows=100, features=64, gate="after"), 32, (8, 2)),
    (NormCase(rows=100, features=8192, gate="before"), 1, (2, 1)),
    (NormCase(rows=100, features=1024, residual=True), 2, (8, 4)),
], ids=["gated_2048", "gated_64", "gated_8192", "add_norm_1024"])
def test_default_config_fills_a_tile_of_2048_values(case, rows, occupancies):
    """The documented defaults: rows up to 2048 values per tile, the occupancies that compile spill-free."""
    cfg = norm_default_config(case.dims())
    assert (cfg.BLOCK_ROWS, (cfg.FWD_OCCUPANCY, cfg.BWD_OCCUPANCY)) == (rows, occupancies)


@pytest.mark.parametrize("name", ["gate_before_groups3", "gate_after_one_group", "add_norm"])
def test_emulated_configs_with_latency_hints_and_wider_blocks_match_float64_reference(name):
    """What the benchmark sweeps: 4 rows per block (the last one partial) and latency hints on the loads; at
    occupancy 1 the backward's 132 / ngroups programs walk 151 row blocks (some two, the loop's prefetch)."""
    case = dataclasses.replace(CASES[name], rows=601)
    cfg = NormConfig(BLOCK_ROWS=4, FWD_OCCUPANCY=4, BWD_OCCUPANCY=1, FWD_LATENCY=3, BWD_LATENCY=4)
    assert bwd_programs(case.dims(), cfg) < 151
    arrays = make_inputs(case, seed=5)
    assert_matches_oracle(case, arrays, run_kernels(case, arrays, cfg), 1e-10)


@pytest.mark.parametrize("field,value,expected", [
    ("BLOCK_ROWS", 3, "BLOCK_ROWS=3 must be a power of two <= 64"),
    ("BLOCK_ROWS", 128, "BLOCK_ROWS=128 must be a power of two <= 64"),
    ("BWD_OCCUPANCY", 0, r"BWD_OCCUPANCY=0 must be in \[1, 32\]"),
    ("FWD_LATENCY", 11, r"FWD_LATENCY=11 must be 0 \(no hint\) or in \[1, 10\]"),
])
def test_config_rejects_invalid_fields_naming_them(field, value, expected):
    fields = dict(BLOCK_ROWS=1, FWD_OCCUPANCY=8, BWD_OCCUPANCY=2)
    with pytest.raises(ValueError, match=expected):
        NormConfig(**{**fields, field: value})


def test_emulated_add_norm_backward_without_the_residual_cotangent_matches_float64_reference():
    """has_dresidual_out=False (the final norm, whose residual stream feeds nothing): "dresidual" is a buffer the
    kernel writes without reading it (the emulator fills buffers with NaN, so a read would show), and the
    gradients are those of a zero residual cotangent."""
    case = CASES["add_norm"]
    dims = case.dims()
    arrays = {**make_inputs(case, seed=19)}
    arrays["dresidual_out"] = np.zeros_like(arrays["dresidual_out"])
    want = oracle(case, arrays)
    plan = rms_norm_bwd_plan(dims, has_dresidual_out=False)
    assert_plan_well_formed(plan)
    assert "dresidual" not in plan.inputs and "dresidual" in plan.buffers
    bwd = emulator.run_plan(plan, dict(
        x=want["residual_out"].reshape(dims.rows, 1, dims.group_size), z=_dummy(np.float32),
        weight=arrays["weight"].reshape(1, -1), dout=_rows(dims, arrays["dout"])), float64=True)
    assert dx_is_dresidual(dims)  # f32 x and stream: dx is dresidual, the plan's "dx" a dummy
    got = dict(dx=bwd["dresidual"].reshape(want["dx"].shape), dresidual=bwd["dresidual"].reshape(want["dx"].shape),
               dweight=bwd["dweight"].reshape(-1))
    errors = {name: rel_l2(got[name], want[name]) for name in got}
    assert max(errors.values()) < 1e-10, errors


@pytest.mark.parametrize("offset", [0, 5])
@pytest.mark.parametrize("name", ["gate_before_groups3", "gate_after_groups3", "gate_before_group24",
                                  "gate_after_one_group"])
def test_emulated_backward_reads_the_gate_from_columns_of_a_wider_array(name, offset):
    """z_columns / z_offset: the backward reads z from columns [offset, offset + features) of a wider array
    (in_proj's output in the mixer) whose other columns are NaN, so a read outside the window poisons the
    result; the gradients are the float64 reference's."""
    case = CASES[name]
    arrays = make_inputs(case, seed=23)
    columns = offset + case.features + 7
    dims = dataclasses.replace(case.dims(), z_columns=columns, z_offset=offset)
    source = np.full((case.rows, columns), np.nan, arrays["z"].dtype)
    source[:, offset:offset + case.features] = arrays["z"]
    plan = rms_norm_bwd_plan(dims)
    assert_plan_well_formed(plan)
    assert rms_norm_bwd_inputs(dims)["z"].shape == (case.rows, columns)
    bwd = emulator.run_plan(plan, dict(
        x=_rows(dims, arrays["x"]), z=source, weight=arrays["weight"].reshape(dims.ngroups, dims.group_size),
        dout=_rows(dims, arrays["dout"])), float64=True)
    want = oracle(case, arrays)
    shape = (case.rows, case.features)
    got = dict(dx=bwd["dx"].reshape(shape), dz=bwd["dz"].reshape(shape), dweight=bwd["dweight"].reshape(-1))
    errors = {k: rel_l2(got[k], want[k]) for k in got}
    assert max(errors.values()) < 1e-10, errors
