"""The compiled kernel plans on the GPU (ct.launch), checked stage by stage against the float64 reference.

Arrays live in torch tensors (CuPy has no bfloat16); every plan buffer starts as NaN so a value a kernel
never writes shows up as an error. Run with `python -m pytest -m gpu tests/kernels/test_stages_gpu.py`.
"""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from jax_mamba2.kernels import chunk_scan, chunk_state, fused_scan, state_update
from tests.kernels._stage_checks import (
    REACH_CASES, SMALL_CASES, Case, case_dims, check_forward, check_forward_reach, check_state_update, step_dims)

pytestmark = pytest.mark.gpu

# Model-sized problems on top of the small ones: Mamba2-like heads, every chunk size, long sequences.
LARGE_CASES = {
    "q256_p64_n128_groups_all_inputs": Case(
        seqlen=1000, chunk_size=256, nheads=8, headdim=64, ngroups=2, dstate=128, z=True, initial_states=True,
        seq_lens=(300, 200, 500)),
    "q64_p128_n64_long": Case(seqlen=4096 + 17, chunk_size=64, nheads=4, headdim=128, dstate=64),
    "q128_p64_n256_batch1": Case(seqlen=777, chunk_size=128, batch=1, nheads=6, headdim=64, ngroups=3,
                                 dstate=256, z=True),
    "fused_q64_p64_n128_groups_all_inputs": Case(
        seqlen=1000, nheads=8, headdim=64, ngroups=2, dstate=128, z=True, initial_states=True,
        seq_lens=(300, 200, 500), layout="fused"),
    "fused_q64_p128_n256_long": Case(seqlen=4096 + 17, nheads=4, headdim=128, dstate=256, layout="fused"),
    # The tune space's 256 x 64 state (8 worker warps) and dstate 64 with 8 worker warps.
    "fused_q64_p64_n256_wide_state_all_inputs": Case(
        seqlen=1000, nheads=4, headdim=64, dstate=256, z=True, initial_states=True, seq_lens=(300, 700),
        layout="fused", configs=(("fused_scan", fused_scan.FusedScanConfig(BLOCK_P=64, LOAD_LAT=4,
                                                                            WORKER_WARPS=8)),)),
    "fused_q64_p64_n64_8_worker_warps": Case(
        seqlen=1000, nheads=4, headdim=64, dstate=64, layout="fused",
        configs=(("fused_scan", fused_scan.FusedScanConfig(BLOCK_P=64, LOAD_LAT=6, WORKER_WARPS=8)),)),
    # The dstate-64 default (8 worker warps, two chunks per iteration): 18 chunks, sequences across a pair.
    "fused_q64_p64_n64_default_all_inputs": Case(
        seqlen=1100, nheads=4, headdim=64, dstate=64, z=True, initial_states=True, seq_lens=(300, 800),
        layout="fused"),
    # The output as one product (dstate == chunk): the dstate-64 default's form, and one chunk per iteration
    # with tileiras' warps, x weighted.
    "fused_q64_p64_n64_joint_output_pairs_all_inputs": Case(
        seqlen=1100, nheads=4, headdim=64, dstate=64, z=True, initial_states=True, seq_lens=(300, 800),
        layout="fused", configs=(("fused_scan", fused_scan.FusedScanConfig(
            BLOCK_P=64, LOAD_LAT=6, WORKER_WARPS=8, CHUNKS_PER_ITER=2, WEIGHT_X=False, JOINT_OUTPUT=True)),)),
    # The dstate-64 default without z and seq_idx (the joint output), fused and segmented.
    "fused_q64_p64_n64_default_init": Case(seqlen=1100, nheads=4, headdim=64, dstate=64, initial_states=True,
                                           layout="fused"),
    "segmented_q64_n64_default_init_groups": Case(seqlen=4096 + 17, nheads=4, headdim=64, ngroups=2, dstate=64,
                                                  initial_states=True, layout="segmented"),
    "fused_q64_p64_n64_joint_output_one_chunk_all_inputs": Case(
        seqlen=1100, nheads=4, headdim=64, dstate=64, z=True, initial_states=True, seq_lens=(300, 800),
        layout="fused", configs=(("fused_scan", fused_scan.FusedScanConfig(BLOCK_P=64, JOINT_OUTPUT=True)),)),
    # 65 chunks of 4 chains in 8 segments, sequences across segment boundaries.
    "segmented_q64_n128_long_seq_idx_all_inputs": Case(
        seqlen=4096 + 17, nheads=2, headdim=64, dstate=128, z=True, initial_states=True,
        seq_lens=(1000, 1048, 2065), layout="segmented"),
    # 258 chunks of 16 chains in 8 segments of 34, walked by segment_states in pieces of 17; a sequence
    # starts at a piece boundary (token 1088).
    "segmented_q64_n128_pieces_seq_idx": Case(
        seqlen=16384 + 100, nheads=8, headdim=64, dstate=128, seq_lens=(1088, 5000, 3, 10393),
        layout="segmented"),
}
SWEEP_CASE = Case(seqlen=600, chunk_size=128, nheads=4, headdim=64, ngroups=2, dstate=64, z=True,
                  initial_states=True, seq_lens=(200, 400))
# The fused layout takes chunks <= 64; at dstate 256 its space adds 64 columns of a 256 x 64 state.
FUSED_SWEEP_CASE = dataclasses.replace(SWEEP_CASE, chunk_size=64, dstate=128, layout="fused")
WIDE_STATE_SWEEP_CASE = dataclasses.replace(FUSED_SWEEP_CASE, dstate=256)
# dstate = chunk size: the space adds the output as one product.
JOINT_OUTPUT_SWEEP_CASE = dataclasses.replace(FUSED_SWEEP_CASE, dstate=64)


def _wide_state_configs(dims):
    return [cfg for cfg in fused_scan.fused_scan_fwd_configs(dims) if cfg.BLOCK_P * dims.dstate > fused_scan.MAX_STATE]


def _joint_output_configs(dims):
    return [cfg for cfg in fused_scan.fused_scan_fwd_configs(dims) if cfg.JOINT_OUTPUT]


def _torch():
    return pytest.importorskip("torch", reason="the GPU stage tests hold arrays in torch tensors")


def _to_device(array: np.ndarray):
    torch = _torch()
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.array(array)).cuda()  # a writable, contiguous copy


def _to_host(tensor) -> np.ndarray:
    torch = _torch()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return tensor.cpu().numpy()


def run_plan_gpu(plan, inputs):
    """Runs `plan` with ct.launch on torch's current stream; returns every array as NumPy."""
    import cuda.tile as ct
    torch = _torch()
    arrays = {name: _to_device(value) for name, value in inputs.items()}
    for name, buf in plan.buffers.items():
        dtype = getattr(torch, buf.dtype)
        arrays[name] = (torch.zeros(buf.shape, dtype=dtype, device="cuda") if buf.zero_init
                        else torch.full(buf.shape, float("nan"), dtype=dtype, device="cuda"))
    stream = torch.cuda.current_stream()
    for launch in plan.launches:
        ct.launch(stream, launch.grid, launch.kernel,
                  tuple(arrays[a] if isinstance(a, str) else a for a in launch.args))
    torch.cuda.synchronize()
    return {name: _to_host(value) for name, value in arrays.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", list(SMALL_CASES) + list(LARGE_CASES))
def test_forward_plan_gpu_matches_reference(case, dtype):
    check_forward(run_plan_gpu, {**SMALL_CASES, **LARGE_CASES}[case], dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(REACH_CASES) + ["fused_q64_p64_n128_groups_all_inputs",
                                                       "fused_q64_p64_n64_joint_output_pairs_all_inputs",
                                                       "segmented_q64_n128_long_seq_idx_all_inputs"])
def test_forward_plan_gpu_adds_the_reach_to_its_output_rows(case, dtype):
    check_forward_reach(run_plan_gpu, {**SMALL_CASES, **LARGE_CASES}[case], dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sweep", ["chunk_state", "chunk_scan", "fused_scan", "fused_scan_wide_state",
                                   "fused_scan_joint_output"])
def test_forward_plan_gpu_every_tuning_config_matches_reference(sweep, dtype):
    """Whatever the autotuner picks must be correct: sweep the stage's space (the others at default)."""
    stage, case, space = {
        "chunk_state": ("chunk_state", SWEEP_CASE, chunk_state.chunk_state_fwd_configs),
        "chunk_scan": ("chunk_scan", SWEEP_CASE, chunk_scan.chunk_scan_fwd_configs),
        "fused_scan": ("fused_scan", FUSED_SWEEP_CASE, fused_scan.fused_scan_fwd_configs),
        "fused_scan_wide_state": ("fused_scan", WIDE_STATE_SWEEP_CASE, _wide_state_configs),
        "fused_scan_joint_output": ("fused_scan", JOINT_OUTPUT_SWEEP_CASE, _joint_output_configs)}[sweep]
    configs = space(case_dims(case, dtype))
    assert configs
    for cfg in configs:
        check_forward(run_plan_gpu, dataclasses.replace(case, configs=((stage, cfg),)), dtype)


@pytest.mark.parametrize("dtype,state_dtype", [("float32", "float32"), ("bfloat16", "float32"),
                                               ("bfloat16", "bfloat16"), ("float16", "float16")])
def test_state_update_plan_gpu_matches_reference(dtype, state_dtype):
    check_state_update(run_plan_gpu, dtype, state_dtype)


@pytest.mark.parametrize("d_per_channel", [False, True])
def test_state_update_plan_gpu_takes_bf16_parameters_as_they_are(d_per_channel):
    check_state_update(run_plan_gpu, "bfloat16", "float32", param_dtype="bfloat16", d_per_channel=d_per_channel)


def test_state_update_plan_gpu_every_tuning_config_matches_reference():
    for cfg in state_update.state_update_configs(step_dims("bfloat16")):
        check_state_update(run_plan_gpu, "bfloat16", "float32", cfg=cfg)
