"""The fused decode-step kernel (kernels/decode_step.py) run block by block on the NumPy emulator of cuda.tile,
against the float64 composition of the reference pieces (conv1d step, ssd_step, rms_norm) on fresh random
inputs: the x/B/C channel slices and the shifted conv window, the group norm's partial sums and the last
arrival's rescale, every option. (The compiled kernel is checked by tests/test_decode_step_gpu.py.)"""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jax_mamba2 import decode_step
from jax_mamba2.bridge import decode_ops
from jax_mamba2.kernels._common import Buffer
from jax_mamba2.kernels.decode_step import decode_step_default_config, decode_step_plan
from tests._decode_step_helpers import decode_step_float64, make_decode_args
from tests._helpers import TOLERANCE, rel_l2
from tests.kernels._cutile_emulator import run_plan
from tests.kernels._plan_checks import assert_plan_well_formed

LIMIT = (0.01, 1.0)
# Every (norm_before_gate, ngroups, D) with dt_limit and conv_bias paired so that each of their four
# combinations occurs twice; then no norm, and the conv widths 1 to 3 (padded windows).
CASES = {
    "gate_after_g1_Dhead_bias": dict(ngroups=1),
    "gate_after_g1_Dhdim_limit": dict(ngroups=1, D="headdim", dt_limit=LIMIT, conv_bias=False),
    "gate_after_g2_Dhead_limit_nobias": dict(dt_limit=LIMIT, conv_bias=False),
    "gate_after_g2_Dhdim_limit": dict(D="headdim", dt_limit=LIMIT),
    "gate_before_g1_Dhead_nobias": dict(norm_before_gate=True, ngroups=1, conv_bias=False),
    "gate_before_g1_Dhdim_limit": dict(norm_before_gate=True, ngroups=1, D="headdim", dt_limit=LIMIT),
    "gate_before_g2_Dhead_limit": dict(norm_before_gate=True, dt_limit=LIMIT),
    "gate_before_g2_Dhdim_nobias": dict(norm_before_gate=True, D="headdim", conv_bias=False),
    "no_norm_g1": dict(rmsnorm=False, ngroups=1, dt_limit=LIMIT),
    "no_norm_g2_no_D": dict(rmsnorm=False, D=None),
    "d_conv_1": dict(d_conv=1),
    "d_conv_2_g4": dict(d_conv=2, nheads=8, ngroups=4, norm_before_gate=True),
    "d_conv_3_hdim": dict(d_conv=3, D="headdim", dt_limit=LIMIT),
}


def _emulated(args, kwargs, options, *, float64: bool):
    """The plan of this call on the emulator (float64: every float array and buffer as float64) -> outputs."""
    inputs, static, _ = decode_step.pack_arguments(*args, **kwargs, **options)
    plan, arrays = decode_ops.kernel_plan(inputs, static)
    assert_plan_well_formed(plan)
    out = run_plan(plan, {name: np.asarray(a) for name, a in arrays.items()}, float64=float64)
    return tuple(out[name] for name in plan.outputs)


@pytest.mark.parametrize("case", list(CASES))
def test_decode_step_plan_emulated_float64_matches_reference_composition(case):
    args, kwargs, options = make_decode_args(sum(map(ord, case)), **CASES[case])
    got = _emulated(args, kwargs, options, float64=True)
    want = decode_step_float64(args, kwargs, options)
    errors = {name: rel_l2(g, w) for name, g, w in zip(("y", "conv_state", "ssm_state"), got, want)}
    assert max(errors.values()) < 1e-12, errors


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_decode_step_plan_emulated_bf16_within_kernel_tolerance(state_dtype):
    """In the arrays' own dtypes (bf16 activations, the math in f32 as on the GPU): within the forward
    kernels' bf16 tolerance of the float64 composition, the states in their dtype."""
    args, kwargs, options = make_decode_args(7, dtype=jnp.bfloat16, state_dtype=jnp.dtype(state_dtype),
                                             dt_limit=LIMIT)
    got = _emulated(args, kwargs, options, float64=False)
    want = decode_step_float64(args, kwargs, options)
    assert [g.dtype for g in got] == [jnp.bfloat16, jnp.dtype(state_dtype), jnp.dtype(state_dtype)]
    errors = {name: rel_l2(g, w) for name, g, w in zip(("y", "conv_state", "ssm_state"), got, want)}
    assert max(errors.values()) < TOLERANCE["kernel_fwd"]["bfloat16"], errors


def test_decode_step_plan_group_norm_workspace_and_counters():
    """With the norm: one zeroed arrival counter per (batch row, group) and one partial sum per block of a
    group; without it, (1, ...) dummies and nothing to zero."""
    args, kwargs, options = make_decode_args(3, nheads=8, ngroups=2, headdim=32, dstate=64)
    inputs, static, _ = decode_step.pack_arguments(*args, **kwargs, **options)
    dims = decode_ops.kernel_dims(inputs, static)
    block_p = decode_step_default_config(dims).BLOCK_P
    plan = decode_step_plan(dims)
    assert plan.launches[0].grid == (2 * 8, 32 // block_p)
    assert plan.buffers["arrivals"] == Buffer((2, 2), "int32", zero_init=True)
    assert plan.buffers["sumsq"].shape == (2, 2, 4 * 32 // block_p)
    plain = decode_step_plan(dataclasses.replace(dims, rmsnorm=False))
    assert not any(buf.zero_init for buf in plain.buffers.values())
    assert plain.buffers["unscaled"].shape == (1, 1) and plain.buffers["sumsq"].shape == (1, 1, 1)
