"""Config spaces and grids of the backward stages (no compile, no GPU)."""
import dataclasses

import pytest

from jax_mamba2.kernels import chunk_cumsum_bwd, chunk_scan_bwd_dc, chunk_scan_bwd_dx, chunk_state_bwd
from jax_mamba2.kernels import param_grads_bwd
from jax_mamba2.kernels._common import SSDDims, is_power_of_2
from jax_mamba2.kernels.backward import backward_plan

PROBLEMS = {
    "small_heads16": SSDDims(batch=1, seqlen=1, nheads=1, headdim=16, ngroups=1, dstate=16, chunk_size=64),
    "odd_heads_q128_f32": SSDDims(batch=3, seqlen=1000, nheads=24, headdim=64, ngroups=8, dstate=128,
                                  chunk_size=128, dtype="float32"),
    "wide_q256": SSDDims(batch=2, seqlen=4096, nheads=80, headdim=256, ngroups=1, dstate=256,
                         chunk_size=256, has_init=True, has_seq_idx=True),
}
STAGES = {
    "chunk_scan_bwd_dc": (chunk_scan_bwd_dc.chunk_scan_bwd_dc_configs,
                          chunk_scan_bwd_dc.chunk_scan_bwd_dc_default_config),
    "chunk_state_bwd": (chunk_state_bwd.chunk_state_bwd_configs, chunk_state_bwd.chunk_state_bwd_default_config),
    "chunk_scan_bwd_dx": (chunk_scan_bwd_dx.chunk_scan_bwd_dx_configs,
                          chunk_scan_bwd_dx.chunk_scan_bwd_dx_default_config),
    "chunk_cumsum_bwd": (chunk_cumsum_bwd.chunk_cumsum_bwd_configs, chunk_cumsum_bwd.chunk_cumsum_bwd_default_config),
    "param_grads_bwd": (param_grads_bwd.param_grads_bwd_configs, param_grads_bwd.param_grads_bwd_default_config),
}
# Tile fields and the dimension each must divide (None: only a power of two).
_DIVIDES = {"BLOCK_P": "headdim", "BLOCK_N": "dstate", "BLOCK_M": "chunk_size", "BLOCK_K": "chunk_size",
            "BLOCK_H": None, "BLOCK_R": None}


@pytest.mark.parametrize("problem", list(PROBLEMS))
@pytest.mark.parametrize("stage", list(STAGES))
def test_backward_stage_configs_valid_and_contain_default(stage, problem):
    configs_fn, default_fn = STAGES[stage]
    dims = PROBLEMS[problem]
    space = configs_fn(dims)
    assert 0 < len(space) <= 24 and len(set(space)) == len(space)
    assert default_fn(dims) in space
    for cfg in space:
        for field in dataclasses.fields(cfg):
            value = getattr(cfg, field.name)
            if field.name in _DIVIDES:
                assert is_power_of_2(value), (cfg, field.name)
                if _DIVIDES[field.name]:
                    assert getattr(dims, _DIVIDES[field.name]) % value == 0, (cfg, field.name)
        assert 1 <= getattr(cfg, "LOAD_LAT", 1) <= 10
    # Every configuration of the space makes a plan (the other stages at their defaults).
    backward_plan(dims, {stage: space[-1]})


@pytest.mark.parametrize("stage", list(STAGES))
def test_backward_stage_configs_reject_unknown_arch(stage):
    with pytest.raises(ValueError, match="arch='sm_80' must be one of"):
        STAGES[stage][0](PROBLEMS["small_heads16"], "sm_80")
