"""The backward plan is well formed, and every kernel of it compiles to an sm_90 cubin on this machine (no
GPU needed) with the constraints JAX uses; the matmul stages' SASS uses Hopper wgmma when cuobjdump is
available."""
import dataclasses
import functools

import pytest

from jax_mamba2.kernels._block_pass_config import adds_atomically
from jax_mamba2.kernels._common import SSDDims
from jax_mamba2.kernels.backward import (
    BACKWARD_INPUTS, BACKWARD_OUTPUTS, backward_arrays, backward_plan, group_heads_per_block)
from jax_mamba2.kernels.chunk_state import ChunkStateConfig
from jax_mamba2.kernels.export import compile_launch
from jax_mamba2.kernels.forward import SAVED_FOR_BACKWARD, forward_plan
from tests.kernels._plan_checks import assert_plan_well_formed, kernel_name
from tests.kernels.test_compile import assert_spill_free_with_wgmma_and_tma, sass_and_resources

_BASE = SSDDims(batch=2, seqlen=200, nheads=8, headdim=64, ngroups=2, dstate=64, chunk_size=64,
                dt_softplus=True)
_ALL_FLAGS = dict(has_init=True, has_seq_idx=True, dt_limit=(1e-3, 0.5))
_ATOMIC, _DETERMINISTIC = dict(deterministic=False), dict(deterministic=True)
# (dims, backward_plan keywords): bf16 and f32 (tf32 mma), flags all off / all on, both reduction modes,
# and atomic blocks spanning several heads.
PROBLEMS = {
    "bf16_plain_atomic": (_BASE, _ATOMIC),
    "bf16_init_seq_idx_dt_limit_deterministic": (dataclasses.replace(_BASE, **_ALL_FLAGS), _DETERMINISTIC),
    "f32_init_seq_idx_atomic": (dataclasses.replace(_BASE, dtype="float32", dt_dtype="float32",
                                                      **_ALL_FLAGS), _ATOMIC),
    "f32_plain_deterministic": (dataclasses.replace(_BASE, dtype="float32", dt_dtype="float32"), _DETERMINISTIC),
    "bf16_seq_idx_2_heads_per_atomic_block": (dataclasses.replace(_BASE, **_ALL_FLAGS),
                                                dict(deterministic=False, atomic_heads_per_block=2)),
}
KERNELS = {"chunk_cumsum_fwd_kernel", "chunk_state_fwd_kernel", "chunk_scan_bwd_dc_kernel",
           "chunk_state_bwd_kernel", "chunk_scan_bwd_dx_kernel", "chunk_cumsum_bwd_kernel",
           "param_grads_bwd_kernel"}
# Structure-only problems: awkward shapes and the int64-indexed variants (x has 2^31 elements).
PLAN_PROBLEMS = {
    **{name: dims for name, (dims, _) in PROBLEMS.items()},
    "odd_heads_partial_chunk_q256": SSDDims(batch=3, seqlen=1000, nheads=24, headdim=256, ngroups=8,
                                            dstate=256, chunk_size=256),
    "one_head_per_group_int64_index": SSDDims(batch=1, seqlen=1 << 20, nheads=32, headdim=64, ngroups=32,
                                              dstate=64, chunk_size=256),
}


@functools.cache
def _cubins(problem: str) -> dict[str, bytes]:
    """kernel name -> sm_90 cubin of every launch of the backward plan of `problem`."""
    dims, keywords = PROBLEMS[problem]
    arrays = backward_arrays(dims, **keywords)
    plan = backward_plan(dims, **keywords)
    return {kernel_name(launch): compile_launch(launch, arrays, "sm_90")[1] for launch in plan.launches}


@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_backward_kernels_compile_to_sm90_cubins(problem):
    cubins = _cubins(problem)
    assert set(cubins) == KERNELS
    for name, cubin in cubins.items():
        assert cubin[:4] == b"\x7fELF", name


@pytest.mark.parametrize("problem", ["bf16_plain_atomic", "f32_init_seq_idx_atomic",
                                     "bf16_seq_idx_2_heads_per_atomic_block"])
def test_backward_matmul_stages_use_wgmma(problem):
    for name in ("chunk_scan_bwd_dc_kernel", "chunk_state_bwd_kernel", "chunk_scan_bwd_dx_kernel"):
        sass, _ = sass_and_resources(_cubins(problem)[name])
        assert "HGMMA" in sass, f"{name} ({problem}) has no wgmma instruction"


@pytest.mark.parametrize("saved_states", [False, True], ids=["recomputing", "saved_states"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("problem", list(PLAN_PROBLEMS))
def test_backward_plan_well_formed(problem, deterministic, saved_states):
    dims = PLAN_PROBLEMS[problem]
    plan = backward_plan(dims, deterministic=deterministic, saved_states=saved_states)
    assert plan.inputs == BACKWARD_INPUTS + (SAVED_FOR_BACKWARD if saved_states else ())
    assert plan.outputs == BACKWARD_OUTPUTS
    assert_plan_well_formed(plan)
    recomputed = {kernel_name(launch) for launch in plan.launches} & {"chunk_cumsum_fwd_kernel",
                                                                     "chunk_state_fwd_kernel"}
    assert recomputed == (set() if saved_states else {"chunk_cumsum_fwd_kernel", "chunk_state_fwd_kernel"})
    # dB/dC take atomic adds into zeroed f32 exactly when heads of a group are split over blocks; a block
    # owning its group stores them in x's dtype.
    atomic = adds_atomically(dims, group_heads_per_block(dims, deterministic))
    for buffer in ("dB", "dC"):
        assert plan.buffers[buffer].zero_init == atomic
        assert plan.buffers[buffer].dtype == ("float32" if atomic else dims.dtype)


def test_group_passes_take_a_group_of_any_size_whole():
    # 80 heads in one group: 512 blocks of a whole group for bwd_dc and bwd_dx (dB and dC stored in x's
    # dtype, no atomics).
    dims = SSDDims(batch=4, seqlen=8192, nheads=80, headdim=64, ngroups=1, dstate=128, chunk_size=64)
    assert group_heads_per_block(dims, False) == 80
    plan = backward_plan(dims)
    grids = {kernel_name(launch): launch.grid for launch in plan.launches}
    assert grids["chunk_scan_bwd_dc_kernel"] == grids["chunk_scan_bwd_dx_kernel"] == (128, 4)
    for buffer in ("dB", "dC"):
        assert (plan.buffers[buffer].dtype, plan.buffers[buffer].zero_init) == (dims.dtype, False)
    # Too few blocks for a whole group: the largest power of 2 that leaves enough, added atomically.
    small = dataclasses.replace(dims, seqlen=1024)
    assert group_heads_per_block(small, False) == 8
    dB = backward_plan(small).buffers["dB"]
    assert (dB.dtype, dB.zero_init) == ("float32", True)


def test_backward_plan_output_layouts():
    dims = dataclasses.replace(PROBLEMS["f32_init_seq_idx_atomic"][0], dtype="bfloat16", dt_dtype="bfloat16")
    b, L, H, P, G, N = dims.batch, dims.seqlen, dims.nheads, dims.headdim, dims.ngroups, dims.dstate
    want = {"dx": ((b, L, H, P), "bfloat16"), "ddt": ((b, L, H), "bfloat16"),
            "dA": ((H,), "float32"), "dB": ((b, L, G, N), "float32"), "dC": ((b, L, G, N), "float32"),
            "dD": ((H, P), "float32"), "ddt_bias": ((H,), "float32"),
            "dinitial_states": ((b, H, P, N), "float32")}
    buffers = backward_plan(dims).buffers
    assert {name: (buffers[name].shape, buffers[name].dtype) for name in BACKWARD_OUTPUTS} == want


def test_backward_plan_rejects_a_gate():
    with pytest.raises(ValueError, match=r"dims.has_z must be False"):
        backward_plan(dataclasses.replace(_BASE, has_z=True))


def test_backward_plan_rejects_unknown_stage():
    with pytest.raises(ValueError, match=r"configs keys=\['chunk_scan'\] must be among"):
        backward_plan(_BASE, {"chunk_scan": None})


def test_plans_reject_a_tile_that_does_not_divide_its_dimension():
    """A tile wider than its dimension (dstate 64 here) would leave part of the arrays to no block."""
    wide = ChunkStateConfig(BLOCK_P=64, BLOCK_N=128)
    with pytest.raises(ValueError, match=r"backward_plan: configs\['chunk_state_bwd'\]\.BLOCK_N=128 must divide "
                                         r"dstate=64"):
        backward_plan(_BASE, {"chunk_state_bwd": wide})
    with pytest.raises(ValueError, match=r"forward_plan: configs\['chunk_state'\]\.BLOCK_N=128 must divide"):
        forward_plan(_BASE, {"chunk_state": wide}, "staged")


@pytest.mark.parametrize("stage", ["chunk_scan_bwd_dc", "chunk_scan_bwd_dx"])
def test_whole_chunk_block_passes_at_dstate_64_compile_without_spills(stage):
    """The measured dstate-64 builds of the two block passes (whole chunks summing a group's heads, bf16, the
    forward's states saved): wgmma and TMA, no stack. Keeping tiles live to spare a reload spilled here before
    (docs/experiments.md)."""
    dims = SSDDims(batch=4, seqlen=8192, nheads=32, headdim=64, ngroups=1, dstate=64, chunk_size=64,
                   dtype="bfloat16", dt_dtype="bfloat16", dt_softplus=True)
    arrays = backward_arrays(dims, saved_states=True)
    launch = next(launch for launch in backward_plan(dims, saved_states=True).launches
                  if kernel_name(launch) == f"{stage}_kernel")
    assert_spill_free_with_wgmma_and_tma(launch, arrays)
