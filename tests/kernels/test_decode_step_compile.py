"""The fused decode step kernel compiles to sm_90 cubins on this machine (no GPU needed) with the constraints
JAX uses, for the LM's decode shapes at batch 1 and 64 and for every option, and its default tiles keep
everything in registers (no local memory, no stack)."""
import dataclasses
import functools
import re

import pytest

pytest.importorskip("cuda.tile")

from benchmarks.tools.sass import disassemble  # noqa: E402
from jax_mamba2.kernels.decode_step import DecodeStepDims, decode_step_inputs, decode_step_plan  # noqa: E402
from jax_mamba2.kernels.export import compile_launch  # noqa: E402
from tests.kernels._plan_checks import kernel_name  # noqa: E402

# The mixer of the LM at d_model 1024: 32 heads of 64, d_state 128, one group; bf16 compute.
_LM = DecodeStepDims(batch=1, nheads=32, headdim=64, ngroups=1, dstate=128, d_conv=4)
PROBLEMS = {
    "lm_batch1_f32_params": (_LM, "float32"),
    "lm_batch64_bf16_params": (dataclasses.replace(_LM, batch=64, conv_state_dtype="bfloat16",
                                                   ssm_state_dtype="bfloat16", conv_weight_dtype="bfloat16"),
                               "bfloat16"),
    "f32_groups_options": (dataclasses.replace(_LM, batch=3, ngroups=4, dtype="float32", D_has_hdim=True,
                                               norm_before_gate=True, dt_limit=(0.001, 0.1), d_mlp=256,
                                               has_conv_bias=False), "float32"),
    "no_norm_no_D_width2": (dataclasses.replace(_LM, batch=8, rmsnorm=False, has_D=False, has_dt_bias=False,
                                                d_conv=2), "bfloat16"),
}


@functools.cache
def _cubin(problem: str) -> bytes:
    dims, param_dtype = PROBLEMS[problem]
    plan = decode_step_plan(dims)
    (launch,) = plan.launches
    assert kernel_name(launch) == "decode_step_kernel"
    _, cubin = compile_launch(launch, {**decode_step_inputs(dims, param_dtype), **plan.buffers}, "sm_90")
    return cubin


@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_decode_step_kernel_compiles_to_an_sm90_cubin(problem):
    assert _cubin(problem)[:4] == b"\x7fELF"


@pytest.mark.parametrize("problem", ["lm_batch1_f32_params", "lm_batch64_bf16_params"])
def test_decode_step_default_tiles_are_spill_free(problem):
    try:
        sass, resources = disassemble(_cubin(problem))
    except FileNotFoundError as e:
        pytest.skip(str(e))
    usage = {k: int(v) for k, v in re.findall(r"(REG|SHARED|LOCAL|STACK):(\d+)", resources)}
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0 and "LDL" not in sass, usage
