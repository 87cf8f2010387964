"""Every kernel compiles to an sm_90 cubin on this machine (no GPU needed), with the constraints JAX uses;
the SASS of the matmul stages uses Hopper wgmma (HGMMA) when cuobjdump is available."""
import dataclasses
import functools
import re

import pytest

from benchmarks.tools.sass import disassemble
from jax_mamba2.kernels import chunk_scan, chunk_state, chunk_state_bwd, export, fused_scan
from jax_mamba2.kernels._common import SSDDims, kernel_name
from jax_mamba2.kernels.backward import backward_arrays
from jax_mamba2.kernels.export import compile_launch
from jax_mamba2.kernels.forward import SAVED_FOR_BACKWARD, forward_arrays, forward_layouts, forward_plan
from jax_mamba2.kernels.state_update import state_update_inputs, state_update_plan
from tests.kernels._plan_checks import assert_plan_well_formed

_BASE = SSDDims(batch=2, seqlen=200, nheads=8, headdim=64, ngroups=2, dstate=64, chunk_size=64,
                dt_softplus=True)
PROBLEMS = {
    "bf16_plain": _BASE,
    "bf16_z_init_seq_idx_dt_limit": dataclasses.replace(_BASE, has_z=True, has_init=True, has_seq_idx=True,
                                                        dt_limit=(1e-3, 0.5)),
    "f32_z_init_seq_idx": dataclasses.replace(_BASE, dtype="float32", dt_dtype="float32", has_z=True,
                                              has_init=True, has_seq_idx=True),
    # The extremes of headdim / dstate (16 and 256) and float16.
    "f16_heads16_q128": dataclasses.replace(_BASE, dtype="float16", dt_dtype="float16", headdim=16, dstate=16,
                                            chunk_size=128, has_z=True),
    "bf16_heads256_q256": dataclasses.replace(_BASE, headdim=256, dstate=256, chunk_size=256, has_seq_idx=True),
    # x has 2^31 elements: the int64-indexed variants.
    "bf16_int64_index": dataclasses.replace(_BASE, batch=1, seqlen=1 << 20, nheads=32, chunk_size=256),
    "bf16_z_init_seq_idx": dataclasses.replace(_BASE, has_z=True, has_init=True, has_seq_idx=True),
    # 16 chunks of 8 chains: the segmented forward layout applies too.
    "bf16_segmented_z_init_seq_idx": dataclasses.replace(_BASE, batch=1, seqlen=16 * 64, has_z=True, has_init=True,
                                                         has_seq_idx=True),
}


@functools.cache
def _cubins(problem: str) -> dict[str, bytes]:
    """kernel name -> sm_90 cubin of every launch of the forward and decode plans of `problem`."""
    dims = PROBLEMS[problem]
    launches = [(launch, forward_arrays(dims, layout, save_states))
                for layout in forward_layouts(dims) for save_states in (False, True)
                for launch in forward_plan(dims, layout=layout, save_states=save_states).launches]
    step = state_update_plan(dims)
    launches.append((step.launches[0], {**state_update_inputs(dims, "float32"), **step.buffers}))
    return {kernel_name(launch.kernel): compile_launch(launch, arrays, "sm_90")[1]
            for launch, arrays in launches}


def plan_cubins(*plans_and_inputs) -> dict[str, bytes]:
    """kernel name -> sm_90 cubin of every launch of each (plan, its inputs' specs) pair."""
    return {kernel_name(launch.kernel): compile_launch(launch, {**inputs, **plan.buffers}, "sm_90")[1]
            for plan, inputs in plans_and_inputs for launch in plan.launches}


@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_forward_and_decode_plans_well_formed(problem):
    dims = PROBLEMS[problem]
    for layout in forward_layouts(dims):
        assert_plan_well_formed(forward_plan(dims, layout=layout))
        saving = forward_plan(dims, layout=layout, save_states=True)
        assert_plan_well_formed(saving)
        assert saving.outputs[2:] == SAVED_FOR_BACKWARD and saving.buffers["states"].shape == (
            dims.batch, dims.nchunks, dims.nheads, dims.headdim, dims.dstate)
    assert_plan_well_formed(state_update_plan(dims))


@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_kernels_compile_to_sm90_cubins(problem):
    cubins = _cubins(problem)
    layouts = forward_layouts(PROBLEMS[problem])
    fused = {"fused_scan_fwd_kernel"} if "fused" in layouts else set()
    segmented = {"segment_states_kernel"} if "segmented" in layouts else set()
    assert set(cubins) == {"chunk_cumsum_fwd_kernel", "chunk_state_fwd_kernel", "chunk_scan_fwd_kernel",
                           "state_update_kernel"} | fused | segmented
    for name, cubin in cubins.items():
        assert cubin[:4] == b"\x7fELF", name


def test_decode_step_compiles_with_bf16_parameters_per_head():
    """A bf16 model's decode step: dt_bias and D (one per head) in bf16, as the mixer holds them."""
    dims = PROBLEMS["bf16_plain"]
    step = state_update_plan(dims, d_per_channel=False)
    inputs = state_update_inputs(dims, "float32", param_dtype="bfloat16", d_per_channel=False)
    assert inputs["D"].shape == (dims.nheads,) and inputs["D"].dtype == inputs["dt_bias"].dtype == "bfloat16"
    cubin = plan_cubins((step, inputs))["state_update_kernel"]
    assert cubin[:4] == b"\x7fELF"


def sass_and_resources(cubin: bytes) -> tuple[str, str]:
    """(cuobjdump -sass, cuobjdump -res-usage) of `cubin`; skips the test without cuobjdump/nvdisasm."""
    try:
        return disassemble(cubin)
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("problem",
                         ["bf16_plain", "f32_z_init_seq_idx", "bf16_z_init_seq_idx"])
def test_matmul_stages_use_wgmma_and_tma(problem):
    for name in ("chunk_state_fwd_kernel", "chunk_scan_fwd_kernel"):
        sass, _ = sass_and_resources(_cubins(problem)[name])
        assert "HGMMA" in sass, f"{name} ({problem}) has no wgmma instruction"
        assert "UTMALDG" in sass, f"{name} ({problem}) has no TMA load"


def _state_pass_launches(dims, cfg):
    """{name: (launch, arrays)} of the forward and backward state passes of `dims` at `cfg`."""
    return {"chunk_state_fwd": (chunk_state.chunk_state_fwd_launch(dims, cfg), forward_arrays(dims)),
            "chunk_state_bwd": (chunk_state_bwd.chunk_state_bwd_launch(dims, cfg), backward_arrays(dims))}


@pytest.mark.parametrize("stage", ["chunk_state_fwd", "chunk_state_bwd"])
@pytest.mark.parametrize("latency", chunk_state.LOAD_LATENCIES)
def test_state_passes_at_occupancy_4_fit_four_blocks_per_sm_without_spills(latency, stage):
    """What chunk_state_fwd_configs says of its occupancy-4 entries (the default tile of both state
    passes): <= 64 registers, no local-memory spills, and shared memory for four blocks in an SM's 228 KB."""
    dims = dataclasses.replace(_BASE, batch=4, seqlen=8192, nheads=32, dstate=128, chunk_size=64)
    cfg = chunk_state.ChunkStateConfig(BLOCK_P=64, BLOCK_N=32, LOAD_LAT=latency, OCCUPANCY=4)
    launch, arrays = _state_pass_launches(dims, cfg)[stage]
    _, cubin = compile_launch(launch, arrays, "sm_90")
    sass, resources = sass_and_resources(cubin)
    usage = dict(re.findall(r"(REG|SHARED|LOCAL):(\d+)", resources))
    assert int(usage["REG"]) <= 64 and int(usage["LOCAL"]) == 0 and "LDL" not in sass
    assert 4 * (int(usage["SHARED"]) + 1024) <= 228 * 1024, usage


def assert_spill_free_with_wgmma_and_tma(launch, arrays):
    """The launch's sm_90 SASS has wgmma and TMA loads, and neither local memory nor a stack."""
    _, cubin = compile_launch(launch, arrays, "sm_90")
    sass, resources = sass_and_resources(cubin)
    usage = dict(re.findall(r"(LOCAL|STACK):(\d+)", resources))
    assert "HGMMA" in sass and "UTMALDG" in sass, launch.args
    assert int(usage["LOCAL"]) == 0 and int(usage["STACK"]) == 0, (launch.args, usage)


def _assert_chunk_scan_spill_free_with_wgmma_and_tma(dims, cfg):
    assert_spill_free_with_wgmma_and_tma(chunk_scan.chunk_scan_fwd_launch(dims, cfg), forward_arrays(dims))


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("block_n", [32, 64])
def test_chunk_scan_state_loop_uses_wgmma_and_tma_without_spills(block_n, heads):
    """chunk_scan's state-loop configs at the H200 benchmark shape: wgmma, TMA loads, no local memory."""
    dims = dataclasses.replace(_BASE, batch=4, seqlen=8192, nheads=32, ngroups=1, dstate=128, chunk_size=64)
    cfg = chunk_scan.ChunkScanConfig(BLOCK_M=64, BLOCK_K=64, BLOCK_N=block_n, BLOCK_P=64, HEADS=heads)
    assert cfg in chunk_scan.chunk_scan_fwd_configs(dims)
    _assert_chunk_scan_spill_free_with_wgmma_and_tma(dims, cfg)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("dstate", [16, 256])
def test_chunk_scan_default_at_chunk_64_is_a_spill_free_state_loop(dstate, dtype):
    """What chunk_scan_fwd_default_config says: at chunk 64 with 16-bit inputs the default is the state
    loop, and it stays spill-free at the extremes of dstate (every key-loop config spills at 256)."""
    dims = dataclasses.replace(_BASE, batch=4, seqlen=8192, nheads=32, ngroups=1, dstate=dstate, chunk_size=64,
                               dtype=dtype, dt_dtype=dtype, has_z=True, has_seq_idx=True)
    cfg = chunk_scan.chunk_scan_fwd_default_config(dims)
    assert cfg.BLOCK_N == min(64, dstate) and cfg.HEADS == 2
    _assert_chunk_scan_spill_free_with_wgmma_and_tma(dims, cfg)


def test_export_cli_refuses_an_output_path_that_is_a_file(tmp_path, capsys):
    (tmp_path / "cubins").write_text("")
    with pytest.raises(SystemExit):
        export.main(["--out", str(tmp_path / "cubins"), "--quick"])
    assert re.search(r"--out=.*cubins is a file; it must be a directory", capsys.readouterr().err)


def test_export_quick_set_is_bf16_and_f32_with_flags_off_and_on():
    problems = list(export._problems(quick=True))
    assert [(dims.dtype, dims.has_z, dims.has_init, dims.has_seq_idx) for dims in problems] == [
        ("bfloat16", False, False, False), ("bfloat16", True, True, True),
        ("float32", False, False, False), ("float32", True, True, True)]
    assert {(dims.headdim, dims.dstate, dims.chunk_size) for dims in problems} == {(64, 64, 64)}


def test_export_cli_quick_writes_cubins_and_manifest(tmp_path, capsys, monkeypatch):
    """The CLI on the quick set's first problem (its four take ~3 minutes to compile on two cores; each kernel
    is compiled for sm_90 by the tests below anyway): every kernel the op launches, a cubin each, listed."""
    first = next(export._problems(quick=True))
    monkeypatch.setattr(export, "_problems", lambda quick: iter([first]))
    assert export.main(["--arch", "sm_90", "--out", str(tmp_path), "--quick"]) == 0
    manifest = (tmp_path / "manifest.tsv").read_text().split()
    files = sorted(p.name for p in tmp_path.glob("*.cubin"))
    assert files and sorted(manifest[0::2]) == files
    assert {name.split("_kernel_")[0] for name in files} == {
        "chunk_cumsum_fwd", "chunk_state_fwd", "chunk_scan_fwd", "fused_scan_fwd", "segment_states",
        "state_update", "chunk_scan_bwd_dc", "chunk_state_bwd", "chunk_scan_bwd_dx", "chunk_cumsum_bwd",
        "param_grads_bwd"}
    assert capsys.readouterr().out.count(".cubin") == len(files)


# (dstate, z/init/seq_idx, write_states). With every feature, tileiras 13.4 gives the x-weighted default of
# dstate 128 a 16-byte stack (56 with the states stored), so that is not claimed.
_FUSED_SPILL_FREE = [(dstate, features, write_states) for dstate in (64, 256) for features in (False, True)
                     for write_states in (False, True)] + [(128, False, False), (128, False, True)]


@pytest.mark.parametrize("dstate,features,write_states", _FUSED_SPILL_FREE)
def test_fused_scan_default_uses_wgmma_and_tma_without_spills(dstate, features, write_states):
    """The fused forward's default tile (a [dstate, 64] state per block, occupancy 1) at the H200
    benchmark shape, with or without storing every chunk-entry state for the backward: wgmma, TMA loads,
    no local memory and no stack."""
    dims = dataclasses.replace(_BASE, batch=4, seqlen=8192, nheads=32, ngroups=1, dstate=dstate, chunk_size=64,
                               has_z=features, has_init=features, has_seq_idx=features)
    cfg = fused_scan.fused_scan_fwd_default_config(dims)
    assert (cfg.BLOCK_P, cfg.OCCUPANCY) == (64, 1) and cfg in fused_scan.fused_scan_fwd_configs(dims)
    assert_spill_free_with_wgmma_and_tma(fused_scan.fused_scan_fwd_launch(dims, cfg, write_states=write_states),
                                         forward_arrays(dims, "fused", write_states))


def test_fused_scan_wide_state_with_8_worker_warps_has_no_stack():
    """The tune space's 256 x 64 state (dstate 256, 64 columns) with 8 worker warps: spill-free at latency 4."""
    dims = dataclasses.replace(_BASE, batch=4, seqlen=8192, nheads=32, ngroups=1, dstate=256, chunk_size=64)
    cfg = fused_scan.FusedScanConfig(BLOCK_P=64, LOAD_LAT=4, OCCUPANCY=1, WORKER_WARPS=8)
    assert cfg in fused_scan.fused_scan_fwd_configs(dims)
    assert_spill_free_with_wgmma_and_tma(fused_scan.fused_scan_fwd_launch(dims, cfg),
                                         forward_arrays(dims, "fused"))
