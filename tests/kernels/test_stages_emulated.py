"""The kernel plans run on CPU through the NumPy emulation of cuda.tile, checked stage by stage against
the float64 reference: index math, masks, padding of partial chunks, seq_idx rules and argument order.
(Numerics of the real compiled kernels are checked by test_stages_gpu.py.)"""
import pytest

from tests.kernels._cutile_emulator import run_plan
from tests.kernels._stage_checks import REACH_CASES, SMALL_CASES, check_forward, check_forward_reach, check_state_update


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(SMALL_CASES))
def test_forward_plan_emulated_matches_reference(case, dtype):
    check_forward(run_plan, SMALL_CASES[case], dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", REACH_CASES)
def test_forward_plan_emulated_adds_the_reach_to_its_output_rows(case, dtype):
    check_forward_reach(run_plan, SMALL_CASES[case], dtype)


@pytest.mark.parametrize("dtype,state_dtype", [("float32", "float32"), ("bfloat16", "bfloat16")])
def test_state_update_plan_emulated_matches_reference(dtype, state_dtype):
    check_state_update(run_plan, dtype, state_dtype)


@pytest.mark.parametrize("param_dtype,d_per_channel", [("bfloat16", False), ("bfloat16", True), ("float32", False)])
def test_state_update_plan_emulated_takes_the_parameters_as_the_model_holds_them(param_dtype, d_per_channel):
    """dt_bias and D of a bf16 model read as they are (the kernel widens them), D per head or per channel."""
    check_state_update(run_plan, "bfloat16", "float32", param_dtype=param_dtype, d_per_channel=d_per_channel)
