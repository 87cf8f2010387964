"""The compiled backward plan on the GPU (ct.launch through torch) against jax.vjp of the float64 scan
oracle, every tuning configuration's correctness, and the bitwise reproducibility of the deterministic mode.

Every plan buffer starts as NaN, so a value a kernel never writes shows up as an error. Run with
`python -m pytest -m gpu tests/kernels/test_backward_gpu.py`.
"""
import dataclasses

import numpy as np
import pytest

from jax_mamba2.kernels import backward, chunk_scan_bwd_dc
from jax_mamba2.kernels._block_pass_config import BlockPassConfig
from jax_mamba2.kernels.backward import BACKWARD_OUTPUTS
from tests._helpers import TOLERANCE, rel_l2
from tests.kernels._backward_checks import (
    BackwardCase, backward_dims, check_backward, check_backward_reach, run_backward)
from tests.kernels.test_stages_gpu import run_plan_gpu

pytestmark = pytest.mark.gpu

CASES = {
    # seqlen 200, chunk 64: a partial last chunk; 2 heads per group share dB/dC.
    "partial_chunk_init_groups": BackwardCase(seqlen=200),
    # A sequence boundary exactly at a chunk boundary (64), one inside a chunk, a row starting at id 0.
    "seq_idx_dt_limit": BackwardCase(seqlen=300, nheads=6, ngroups=3, dt_limit=(0.01, 0.5),
                                     seq_lens=(64, 100, 36, 100)),
    # Four row blocks per chunk, Mamba-2-like head sizes.
    "q256_p64_n128_seq_idx": BackwardCase(seqlen=1000, chunk_size=256, nheads=8, headdim=64, dstate=128,
                                          seq_lens=(300, 200, 500)),
    # The "wide" tiles (64 x 32), dstate 256.
    "q128_p128_n256": BackwardCase(seqlen=333, chunk_size=128, batch=1, nheads=4, ngroups=1, headdim=128,
                                   dstate=256),
    # Long, tiny heads, no softplus / initial states.
    "q64_p16_n16_long_plain": BackwardCase(seqlen=2048 + 17, nheads=2, ngroups=1, headdim=16, dstate=16,
                                           initial_states=False, dt_softplus=False),
}
SWEEP_CASE = BackwardCase(seqlen=600, chunk_size=128, seq_lens=(200, 400))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", list(CASES))
def test_backward_plan_gpu_matches_scan_vjp(case, dtype):
    check_backward(run_plan_gpu, CASES[case], dtype, TOLERANCE["kernel_bwd"][dtype])


# States saved by the fused forward kernels: seq_idx resets with initial states and a gate (fused), and 33
# chunks of 8 chains (segmented: four segments of 9 chunks).
SAVED_STATES_CASES = {
    "fused": BackwardCase(seqlen=300, headdim=64, dstate=64, seq_lens=(100, 150, 50)),
    "segmented": BackwardCase(seqlen=2100, nheads=4, ngroups=1, headdim=64, dstate=128, seq_lens=(1000, 1100)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_backward_plan_gpu_adds_the_reach_to_the_rows_of_dx(case, dtype):
    check_backward_reach(run_plan_gpu, CASES[case], dtype, deterministic=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", list(SAVED_STATES_CASES))
def test_backward_plan_gpu_with_states_saved_by_the_fused_forward_matches_scan_vjp(layout, dtype):
    check_backward(run_plan_gpu, SAVED_STATES_CASES[layout], dtype, TOLERANCE["kernel_bwd"][dtype],
                   states_from=layout)


_SUMMING_HEADS = BlockPassConfig(BLOCK_M=64, BLOCK_K=64, SUM_HEADS=True)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_backward_plan_gpu_summing_heads_matches_scan_vjp(dtype, deterministic):
    """Whole-chunk block passes summing the dCB of a group's heads (4 per group) before one product."""
    case = BackwardCase(seqlen=300, nheads=8, ngroups=2, seq_lens=(64, 100, 36, 100),
                        configs=(("chunk_scan_bwd_dc", _SUMMING_HEADS), ("chunk_scan_bwd_dx", _SUMMING_HEADS)))
    check_backward(run_plan_gpu, case, dtype, TOLERANCE["kernel_bwd"][dtype], deterministic=deterministic)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block_m", [64, 32], ids=["whole_chunk", "half_chunk_rows"])
def test_backward_plan_gpu_one_key_block_row_pass_matches_scan_vjp(block_m, dtype):
    """bwd_dc per head with the chunk as its one key block (R^intra as one tf32 product)."""
    tiles = chunk_scan_bwd_dc.ChunkScanBwdDcConfig(BLOCK_M=block_m, BLOCK_K=64)
    case = BackwardCase(seqlen=300, nheads=8, ngroups=2, seq_lens=(64, 100, 36, 100),
                        configs=(("chunk_scan_bwd_dc", tiles),))
    check_backward(run_plan_gpu, case, dtype, TOLERANCE["kernel_bwd"][dtype])


def test_backward_plan_gpu_every_tile_config_matches_scan_vjp():
    """Whatever the autotuner picks must be correct: every distinct tiling of each stage's space (the
    others at their defaults); latency and occupancy hints do not change what is computed."""
    dims = backward_dims(SWEEP_CASE, "bfloat16")
    spaces = {stage: backward.STAGES[stage].space(dims, "sm_90")
              for stage in ("chunk_scan_bwd_dc", "chunk_state_bwd", "chunk_scan_bwd_dx")}
    for stage, space in spaces.items():
        tilings = {dataclasses.replace(cfg, LOAD_LAT=4, OCCUPANCY=1) for cfg in space}
        for cfg in sorted(tilings, key=repr):
            case = dataclasses.replace(SWEEP_CASE, configs=((stage, cfg),))
            check_backward(run_plan_gpu, case, "bfloat16", TOLERANCE["kernel_bwd"]["bfloat16"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backward_plan_gpu_deterministic_mode_is_bitwise_reproducible(dtype):
    case = CASES["partial_chunk_init_groups"]
    first, want = run_backward(run_plan_gpu, case, dtype, deterministic=True)
    errors = {name: rel_l2(np.asarray(first[name], np.float64), expected) for name, expected in want.items()}
    assert all(err <= TOLERANCE["kernel_bwd"][dtype] for err in errors.values()), errors
    for _ in range(4):
        again, _ = run_backward(run_plan_gpu, case, dtype, deterministic=True)
        differ = [name for name in BACKWARD_OUTPUTS
                  if not np.array_equal(np.asarray(again[name]).view(np.uint8),
                                        np.asarray(first[name]).view(np.uint8))]
        assert not differ, f"deterministic backward differs between runs in {differ}"
