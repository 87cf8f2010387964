"""The fused decode-step kernel compiles to sm_90 cubins on this machine (no GPU needed) with the constraints
JAX uses, for the options that change its code; its plans are well formed."""
import dataclasses
import functools
import re

import pytest

from jax_mamba2.kernels.decode_step import DecodeStepDims, decode_step_inputs, decode_step_plan
from jax_mamba2.kernels.export import compile_launch
from tests.kernels._plan_checks import assert_plan_well_formed
from tests.kernels.test_compile import sass_and_resources

# The 24-layer LM's mixer (d_model 1024: 32 heads of 64, dstate 128, one group) at batch 1.
_LM = DecodeStepDims(batch=1, nheads=32, headdim=64, ngroups=1, dstate=128, d_conv=4)
PROBLEMS = {
    "lm_bf16_f32_states": _LM,
    "f32_norm_before_gate_hdim_D_limit_groups": dataclasses.replace(
        _LM, batch=3, ngroups=4, dtype="float32", norm_before_gate=True, D_has_hdim=True, dt_limit=(1e-3, 0.5)),
    "bf16_states_no_norm_no_bias_d_conv_3": dataclasses.replace(
        _LM, batch=2, ssm_state_dtype="bfloat16", conv_state_dtype="bfloat16", param_dtype="bfloat16",
        rmsnorm=False, has_conv_bias=False, d_conv=3),
    "f16_heads16_dstate256": dataclasses.replace(_LM, batch=2, nheads=8, headdim=16, dstate=256, ngroups=2,
                                                 dtype="float16"),
    # The SSM state has 2^31 elements: the int64-indexed variant.
    "bf16_int64_index": dataclasses.replace(_LM, batch=8192),
}


@functools.cache
def _cubin(problem: str) -> bytes:
    dims = PROBLEMS[problem]
    plan = decode_step_plan(dims)
    return compile_launch(plan.launches[0], {**decode_step_inputs(dims), **plan.buffers}, "sm_90")[1]


@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_decode_step_plan_well_formed(problem):
    assert_plan_well_formed(decode_step_plan(PROBLEMS[problem]))


@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_decode_step_kernel_compiles_to_sm90_cubin(problem):
    assert _cubin(problem)[:4] == b"\x7fELF"


def test_decode_step_kernel_at_the_lm_shape_has_no_local_memory():
    """No spills (local memory or stack) at the LM's default tile; needs cuobjdump (skipped without)."""
    sass, resources = sass_and_resources(_cubin("lm_bf16_f32_states"))
    usage = dict(re.findall(r"(LOCAL|STACK):(\d+)", resources))
    assert int(usage["LOCAL"]) == 0 and int(usage["STACK"]) == 0 and "LDL" not in sass, usage
