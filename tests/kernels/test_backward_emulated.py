"""The backward plan's exact blockwise algorithm, proven on CPU in float64 before any GPU run.

Every launch of `backward_plan` (the forward recompute included) runs block by block on NumPy through the
cuda.tile emulator of tests/kernels/_cutile_emulator.py, with every float dtype mapped to float64, so the
kernels' index math, masks, partial chunks, seq_idx rules, head splits and the stable dA_cumsum algebra
are checked against `jax.vjp` of the float64 `reference.ssd_scan` to ~1e-10: any derivation error shows
as an O(1) mismatch. (Rounding of the compiled kernels is checked by test_backward_gpu.py.)
"""
import dataclasses

import pytest

from jax_mamba2.kernels.chunk_cumsum_bwd import ChunkCumsumBwdConfig
from jax_mamba2.kernels.chunk_scan_bwd_dc import ChunkScanBwdDcConfig
from jax_mamba2.kernels.chunk_scan_bwd_dx import ChunkScanBwdDxConfig
from jax_mamba2.kernels.chunk_state import ChunkStateConfig
from jax_mamba2.kernels.chunk_state_bwd import ChunkStateBwdConfig
from jax_mamba2.kernels.param_grads_bwd import ParamGradsBwdConfig
from tests._helpers import TOLERANCE
from tests.kernels import _cutile_emulator as emulator
from tests.kernels._backward_checks import BackwardCase, check_backward, check_backward_reach

# Tiny heads, chunks of 16 and small blocks, so that chunks hold several row/key blocks, key steps both
# shorter and longer than row blocks, several state tiles, and head blocks that do not divide nheads.
_SMALL = dict(batch=2, headdim=8, dstate=16, chunk_size=16, configs=(
    ("chunk_state", ChunkStateConfig(BLOCK_P=4, BLOCK_N=8)),
    ("chunk_scan_bwd_dc", ChunkScanBwdDcConfig(BLOCK_M=8, BLOCK_K=4)),
    ("chunk_state_bwd", ChunkStateBwdConfig(BLOCK_P=4, BLOCK_N=4)),
    ("chunk_scan_bwd_dx", ChunkScanBwdDxConfig(BLOCK_M=4, BLOCK_K=8)),
    ("chunk_cumsum_bwd", ChunkCumsumBwdConfig(BLOCK_H=2)),
    ("param_grads_bwd", ParamGradsBwdConfig(BLOCK_H=2, BLOCK_R=4)),
))


def _run_plan_float64(plan, inputs):
    return emulator.run_plan(plan, inputs, float64=True)


def _run_plan_native(plan, inputs):
    return emulator.run_plan(plan, inputs)


CASES = {
    "partial_chunk_init_groups": BackwardCase(seqlen=37, **_SMALL),
    "seq_idx_dt_limit_odd_heads": BackwardCase(seqlen=50, nheads=3, ngroups=1, dt_limit=(0.05, 0.6),
                                               seq_lens=(5, 11, 16, 18), **_SMALL),
    "one_token": BackwardCase(seqlen=1, **_SMALL),
    "whole_chunks_plain_dt": BackwardCase(seqlen=32, ngroups=4, initial_states=False,
                                          dt_softplus=False, **_SMALL),
    "seq_idx_with_initial_states": BackwardCase(seqlen=50, nheads=3, ngroups=1,
                                                seq_lens=(5, 11, 16, 18), **_SMALL),
    "one_partial_chunk": BackwardCase(seqlen=9, **_SMALL),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_backward_plan_emulated_float64_matches_scan_vjp(case):
    check_backward(_run_plan_float64, CASES[case], "float32", 1e-10)


@pytest.mark.parametrize("case", ["partial_chunk_init_groups", "seq_idx_dt_limit_odd_heads"])
def test_backward_plan_emulated_adds_the_reach_to_the_rows_of_dx(case):
    check_backward_reach(_run_plan_native, CASES[case], "float32")


def test_backward_plan_emulated_deterministic_mode_matches_scan_vjp():
    check_backward(_run_plan_float64, CASES["partial_chunk_init_groups"], "float32", 1e-10,
                   deterministic=True)


def test_backward_plan_emulated_atomic_blocks_of_several_heads_match_scan_vjp():
    case = BackwardCase(seqlen=37, nheads=8, ngroups=2, **_SMALL)     # 4 heads per group, 2 per block
    check_backward(_run_plan_float64, case, "float32", 1e-10, atomic_heads_per_block=2)


@pytest.mark.parametrize("layout,seqlen", [("fused", 150), ("segmented", 600)])
def test_backward_plan_emulated_with_states_saved_by_the_fused_forward_matches_scan_vjp(layout, seqlen):
    """The fused kernels' stored chunk-entry states replace the backward's recompute exactly (seq_idx
    resets, a partial last chunk; 38 chunks of 16 make four segments)."""
    case = BackwardCase(seqlen=seqlen, nheads=4, ngroups=2, seq_lens=(40, seqlen - 80, 40),
                        **{**_SMALL, "headdim": 16})
    check_backward(_run_plan_float64, case, "float32", 1e-10, states_from=layout)


def _summing_heads(**case):
    """A case whose block passes own whole chunks and sum their heads' dCB (SUM_HEADS)."""
    tiles = ChunkScanBwdDcConfig(BLOCK_M=16, BLOCK_K=16, SUM_HEADS=True)
    configs = tuple((stage, tiles if stage in ("chunk_scan_bwd_dc", "chunk_scan_bwd_dx") else cfg)
                    for stage, cfg in _SMALL["configs"])
    return BackwardCase(**{**_SMALL, "configs": configs, **case})


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_backward_plan_emulated_summing_heads_matches_scan_vjp(deterministic):
    """4 heads per group (2 per atomic block), seq_idx resets, a gate, a partial last chunk."""
    case = _summing_heads(seqlen=50, nheads=8, ngroups=2, seq_lens=(5, 11, 16, 18))
    check_backward(_run_plan_float64, case, "float32", 1e-10, deterministic=deterministic,
                   **({} if deterministic else {"atomic_heads_per_block": 2}))


@pytest.mark.parametrize("block_m", [16, 8], ids=["whole_chunk", "half_chunk_rows"])
def test_backward_plan_emulated_one_key_block_row_pass_matches_scan_vjp(block_m):
    """bwd_dc with the chunk as its one key block (R^intra as one product), per head, with blocks of the
    whole chunk or of half its rows; seq_idx resets, a gate, a partial last chunk."""
    configs = tuple((stage, ChunkScanBwdDcConfig(BLOCK_M=block_m, BLOCK_K=16) if stage == "chunk_scan_bwd_dc"
                     else cfg) for stage, cfg in _SMALL["configs"])
    case = BackwardCase(**{**_SMALL, "configs": configs}, seqlen=50, nheads=4, ngroups=2, seq_lens=(5, 11, 16, 18))
    check_backward(_run_plan_float64, case, "float32", 1e-10)


def test_backward_plan_emulated_bf16_within_kernel_tolerance():
    """The kernels' rounding points (bf16 operands, f32 accumulation) at the default tile sizes keep every
    gradient within the GPU tolerance (tf32 is not emulated, so this is the bf16 check)."""
    case = BackwardCase(seqlen=150, nheads=4, ngroups=2, headdim=32, dstate=32, seq_lens=(40, 70, 40))
    check_backward(_run_plan_native, case, "bfloat16", TOLERANCE["kernel_bwd"]["bfloat16"])
    summing = dataclasses.replace(case, chunk_size=32, configs=tuple(
        (stage, ChunkScanBwdDcConfig(BLOCK_M=32, BLOCK_K=32, SUM_HEADS=True))
        for stage in ("chunk_scan_bwd_dc", "chunk_scan_bwd_dx")))
    check_backward(_run_plan_native, summing, "bfloat16", TOLERANCE["kernel_bwd"]["bfloat16"])
    # A block owning its whole group stores dB/dC rounded to bf16 itself (no f32 buffer, no cast after).
    check_backward(_run_plan_native, summing, "bfloat16", TOLERANCE["kernel_bwd"]["bfloat16"], deterministic=True)
