"""AdamW's update kernel (kernels/adamw.py) run block by block on the NumPy emulator of cuda.tile against
`jax_mamba2.adamw_reference` in float64: sizes that are not a multiple of the block (the last block's tail masked),
weight decay on and off, a clipping gradient scale, float32 and bfloat16 arrays in their dtypes (moments in
another dtype than the parameter), a NaN gradient confined to its element, and the plan's in-place outputs."""
import numpy as np
import pytest

pytest.importorskip("cuda.tile")

from jax_mamba2.kernels.adamw import (  # noqa: E402
    ADAMW_INPUTS, ADAMW_OUTPUTS, AdamWConfig, AdamWDims, adamw_plan, needs_int64_index)
from jax_mamba2.bridge.adamw_ops import adamw_dims  # noqa: E402
from tests.kernels import _cutile_emulator as emulator  # noqa: E402
from tests.kernels._adamw_checks import make_inputs, oracle, output_error, step_error  # noqa: E402
from tests.kernels._plan_checks import assert_plan_well_formed  # noqa: E402


def _run(arrays, decay, cfg=None, *, float64):
    plan = adamw_plan(adamw_dims(*(arrays[n] for n in ("param", "grad", "mu", "nu")), decay=decay), cfg)
    # Copies: the plan writes its inputs in place, and the emulator runs in the arrays' own memory.
    out = emulator.run_plan(plan, {n: arrays[n].copy() for n in ADAMW_INPUTS}, float64=float64)
    return {n: out[n] for n in ADAMW_OUTPUTS}


@pytest.mark.parametrize("size,block", [(1000, 128), (4096, 1024), (5000, None)])
@pytest.mark.parametrize("decay", [True, False])
def test_emulated_kernel_matches_float64_reference(size, block, decay):
    """In float64 the kernel's arithmetic is the reference's: a difference beyond rounding is a bug."""
    arrays = make_inputs(size, seed=size + decay)
    got = _run(arrays, decay, None if block is None else AdamWConfig(BLOCK=block), float64=True)
    assert step_error(got, arrays, oracle(arrays, decay)) < 1e-13


def test_weight_decay_moves_only_the_decayed_step():
    arrays = make_inputs(777, seed=1)
    with_decay, without = (_run(arrays, decay, float64=True) for decay in (True, False))
    assert np.array_equal(with_decay["mu"], without["mu"]) and np.array_equal(with_decay["nu"], without["nu"])
    assert not np.allclose(with_decay["param"], without["param"], rtol=0, atol=1e-9)


@pytest.mark.parametrize("dtypes,tolerance", [
    (("float32",) * 4, 1e-6),
    (("bfloat16",) * 4, 5e-3),
    (("bfloat16", "bfloat16", "float32", "float32"), 5e-3),
], ids=["f32", "bf16", "bf16_params_f32_moments"])
def test_emulated_kernel_in_its_dtypes_matches_float64_reference(dtypes, tolerance):
    """f32 arithmetic, each output rounded once to its array's dtype (bf16: up to 2^-9 relative, more than a
    step's size, so the outputs are compared rather than the step)."""
    arrays = make_inputs(3000, seed=5, dtypes=dtypes)
    got = _run(arrays, True, AdamWConfig(BLOCK=512), float64=False)
    for name, dtype in zip(("param", "mu", "nu"), (dtypes[0], dtypes[2], dtypes[3])):
        assert str(got[name].dtype) == dtype, name
    assert output_error(got, oracle(arrays, True)) < tolerance


def test_nan_gradient_reaches_only_its_element():
    arrays = make_inputs(600, seed=2)
    arrays["grad"][123] = np.nan
    got = _run(arrays, True, AdamWConfig(BLOCK=128), float64=False)
    for name in ADAMW_OUTPUTS:
        bad = ~np.isfinite(got[name])
        assert bad[123] and bad.sum() == 1, name


def test_plan_writes_in_place():
    plan = adamw_plan(AdamWDims(size=10_000))
    assert_plan_well_formed(plan)
    assert plan.buffers == {} and set(plan.outputs) <= set(plan.inputs)
    (launch,) = plan.launches
    assert launch.grid == (-(-10_000 // AdamWConfig().BLOCK),) and set(launch.writes) == set(ADAMW_OUTPUTS)
    assert not needs_int64_index(AdamWDims(size=1 << 30), AdamWConfig())
    assert needs_int64_index(AdamWDims(size=(1 << 31) - 100), AdamWConfig())


@pytest.mark.parametrize("field,value", [("BLOCK", 100), ("BLOCK", 64), ("OCCUPANCY", 0)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        AdamWConfig(**{field: value})
