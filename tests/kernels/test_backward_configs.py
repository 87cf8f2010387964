"""Config spaces and grids of the backward stages (no compile, no GPU)."""
import dataclasses

import pytest

from jax_mamba2.kernels import backward, forward
from jax_mamba2.kernels._common import SSDDims, is_power_of_2
from jax_mamba2.kernels.backward import backward_plan

PROBLEMS = {
    "small_heads16": SSDDims(batch=1, seqlen=1, nheads=1, headdim=16, ngroups=1, dstate=16, chunk_size=64),
    "odd_heads_q128_f32": SSDDims(batch=3, seqlen=1000, nheads=24, headdim=64, ngroups=8, dstate=128,
                                  chunk_size=128, dtype="float32"),
    "wide_q256": SSDDims(batch=2, seqlen=4096, nheads=80, headdim=256, ngroups=1, dstate=256,
                         chunk_size=256, has_init=True, has_seq_idx=True),
}
# The backward's own stages (the recomputed forward ones are checked with the forward's), as declared.
STAGES = {name: stage for name, stage in backward.STAGES.items() if name not in forward.STAGES}
# Tile fields and the dimension each must divide (None: only a power of two).
_DIVIDES = {"BLOCK_P": "headdim", "BLOCK_N": "dstate", "BLOCK_M": "chunk_size", "BLOCK_K": "chunk_size",
            "BLOCK_H": None, "BLOCK_R": None}


@pytest.mark.parametrize("problem", list(PROBLEMS))
@pytest.mark.parametrize("stage", list(STAGES))
def test_backward_stage_configs_valid_and_contain_default(stage, problem):
    configs_fn, default_fn = STAGES[stage].space, STAGES[stage].default
    dims = PROBLEMS[problem]
    space = configs_fn(dims, "sm_90")
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
        STAGES[stage].space(PROBLEMS["small_heads16"], "sm_80")
