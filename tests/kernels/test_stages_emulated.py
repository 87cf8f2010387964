"""The kernel plans run on CPU through the NumPy emulation of cuda.tile, checked stage by stage against
the float64 reference: index math, masks, padding of partial chunks, seq_idx rules and argument order.
(Numerics of the real compiled kernels are checked by test_stages_gpu.py.)"""
import pytest

from tests.kernels._cutile_emulator import run_plan
from tests.kernels._stage_checks import Case, check_forward, check_state_update
from jax_mamba2.kernels.chunk_scan import ChunkScanConfig
from jax_mamba2.kernels.chunk_state import ChunkStateConfig

CASES = {
    "one_partial_chunk": Case(seqlen=37),
    "partial_last_chunk_groups_z_init": Case(seqlen=150, nheads=4, ngroups=2, z=True, initial_states=True),
    "seq_idx_across_chunks": Case(seqlen=150, seq_lens=(10, 70, 3, 67), initial_states=True),
    "chunk128_row_and_key_blocks": Case(
        seqlen=300, chunk_size=128, ngroups=4, seq_lens=(128, 1, 171), dt_limit=(0.05, 0.5),
        configs=(("chunk_scan", ChunkScanConfig(BLOCK_M=64, BLOCK_K=32, BLOCK_P=16)),
                 ("chunk_state", ChunkStateConfig(BLOCK_P=16, BLOCK_N=16)))),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_forward_plan_emulated_matches_reference(case, dtype):
    check_forward(run_plan, CASES[case], dtype)


@pytest.mark.parametrize("dtype,state_dtype", [("float32", "float32"), ("bfloat16", "bfloat16")])
def test_state_update_plan_emulated_matches_reference(dtype, state_dtype):
    check_state_update(run_plan, dtype, state_dtype)
