"""Config spaces, grids and launch argument tuples of every kernel stage (no compile, no GPU)."""
import dataclasses
import importlib
import inspect
import pkgutil

import pytest

from jax_mamba2.kernels import (chunk_cumsum, chunk_scan, chunk_state, chunk_state_bwd, forward, fused_scan,
                                state_update)
from jax_mamba2.kernels._common import SSDDims, is_power_of_2, kernel_signature, needs_int64_index
from jax_mamba2.kernels.forward import (
    FORWARD_LAYOUTS, FORWARD_STAGES, forward_arrays, forward_layout, forward_layouts, forward_plan)
from jax_mamba2.kernels.fused_scan import fused_segment_chunks, state_piece_chunks

PROBLEMS = {
    "small_heads16": SSDDims(batch=1, seqlen=1, nheads=1, headdim=16, ngroups=1, dstate=16, chunk_size=64),
    "odd_heads_q128": SSDDims(batch=3, seqlen=1000, nheads=24, headdim=64, ngroups=8, dstate=128,
                              chunk_size=128, dtype="float32"),
    "wide_q256": SSDDims(batch=2, seqlen=4096, nheads=80, headdim=256, ngroups=1, dstate=256,
                         chunk_size=256, has_z=True, has_init=True, has_seq_idx=True),
}
# The forward's stages and the decode step, as declared next to their kernels (the backward's own stages are
# checked in test_backward_configs.py).
STAGES = {**forward.STAGES, state_update.STATE_UPDATE_STAGE.name: state_update.STATE_UPDATE_STAGE}
# Tile fields and what each must divide (None: only a power of two).
_DIVIDES = {"BLOCK_P": "headdim", "BLOCK_N": "dstate", "BLOCK_M": "chunk_size", "BLOCK_K": "chunk_size",
            "BLOCK_H": None, "HEADS": None}


def _tiles(cfg):
    """The tile fields of `cfg` that are set (chunk_scan's BLOCK_N is 0 in its key-loop configs)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name in _DIVIDES and not (f.name == "BLOCK_N" and isinstance(cfg, chunk_scan.ChunkScanConfig)
                                           and cfg.BLOCK_N == 0)}


def _kernel_config_types() -> dict[str, type]:
    """Every config dataclass of the kernel modules (their classes named *Config), by qualified name."""
    import jax_mamba2.kernels as kernels
    found = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if dataclasses.is_dataclass(obj) and isinstance(obj, type) and obj.__name__.endswith("Config"):
                found[f"{obj.__module__}.{obj.__name__}"] = obj
    return found


def test_every_kernel_config_field_is_upper_case():
    """The naming rule of design.md §11: config fields are UPPER_CASE, as cuTile kernel constants are."""
    types = _kernel_config_types()
    assert {"jax_mamba2.kernels.fused_scan.FusedScanConfig", "jax_mamba2.kernels.rms_norm.NormConfig",
            "jax_mamba2.kernels._block_pass_config.BlockPassConfig"} <= set(types)
    lower = {name: [f.name for f in dataclasses.fields(cls) if f.name != f.name.upper()]
             for name, cls in types.items()}
    assert {name: fields for name, fields in lower.items() if fields} == {}


@pytest.mark.parametrize("problem", list(PROBLEMS), ids=list(PROBLEMS))
@pytest.mark.parametrize("stage", list(STAGES))
def test_stage_configs_valid_and_contain_default(stage, problem):
    configs_fn, default_fn = STAGES[stage].space, STAGES[stage].default
    dims = PROBLEMS[problem]
    space = configs_fn(dims, "sm_90")
    if STAGES[stage].config_type is fused_scan.FusedScanConfig and not fused_scan.fused_scan_supported(dims):
        assert space == []  # the fused kernel's stages (fused, segmented) have no space where it cannot run
        return
    assert 0 < len(space) <= 24 and len(set(space)) == len(space)
    assert default_fn(dims) in space
    for cfg in space:
        for name, value in _tiles(cfg).items():
            assert is_power_of_2(value), (cfg, name)
            if _DIVIDES[name]:
                assert getattr(dims, _DIVIDES[name]) % value == 0, (cfg, name)
        if isinstance(cfg, chunk_scan.ChunkScanConfig):
            keys_ok = cfg.BLOCK_K <= cfg.BLOCK_M if cfg.BLOCK_N == 0 else cfg.BLOCK_K == dims.chunk_size <= 128
            assert keys_ok and dims.heads_per_group % cfg.HEADS == 0, cfg
        assert 1 <= getattr(cfg, "LOAD_LAT", 1) <= 10


@pytest.mark.parametrize("configs_fn,default_fn,default_tile_occupancies", [
    (chunk_state.chunk_state_fwd_configs, chunk_state.chunk_state_fwd_default_config, (4,)),
    (chunk_state_bwd.chunk_state_bwd_configs, chunk_state_bwd.chunk_state_bwd_default_config, (4, 5))],
    ids=["chunk_state", "chunk_state_bwd"])
def test_state_pass_configs_try_every_tile_at_every_latency(configs_fn, default_fn, default_tile_occupancies):
    """Every tile at every latency hint at occupancy 2; the default tile at the higher occupancies too."""
    dims = dataclasses.replace(PROBLEMS["odd_heads_q128"], dtype="bfloat16")
    space, default = configs_fn(dims), default_fn(dims)
    tiles = {(c.BLOCK_P, c.BLOCK_N) for c in space}
    assert (default.BLOCK_P, default.BLOCK_N) in tiles and default.LOAD_LAT in chunk_state.LOAD_LATENCIES
    by_occupancy = {occ: sorted((c.BLOCK_P, c.BLOCK_N, c.LOAD_LAT) for c in space if c.OCCUPANCY == occ)
                    for occ in (2, *default_tile_occupancies)}
    assert by_occupancy[2] == sorted((bp, bn, lat) for bp, bn in tiles for lat in chunk_state.LOAD_LATENCIES)
    for occupancy in default_tile_occupancies:
        assert by_occupancy[occupancy] == [(default.BLOCK_P, default.BLOCK_N, lat)
                                           for lat in chunk_state.LOAD_LATENCIES]
    assert {c.OCCUPANCY for c in space} == {2, *default_tile_occupancies}


def test_reverse_state_pass_space_leaves_occupancy_5_to_16_bit_inputs():
    """f32 tiles spill at occupancy 5's 48 registers (sm_90 cubins)."""
    dims = PROBLEMS["odd_heads_q128"]
    assert dims.dtype == "float32" and {c.OCCUPANCY for c in chunk_state_bwd.chunk_state_bwd_configs(dims)} == {2, 4}


@pytest.mark.parametrize("nheads,dtype,occupancy", [(32, "bfloat16", 4), (80, "bfloat16", 5), (80, "float32", 4)])
def test_reverse_state_pass_default_takes_occupancy_5_where_it_saves_a_wave(nheads, dtype, occupancy):
    """batch 4, seqlen 8192, headdim 64, dstate 128: 512 blocks fill one wave at occupancy 4 (132 SMs);
    1280 blocks take 3 waves at occupancy 4 and 2 at 5 (16-bit inputs only: f32 tiles need more memory)."""
    dims = SSDDims(batch=4, seqlen=8192, nheads=nheads, headdim=64, ngroups=1, dstate=128, chunk_size=64,
                   dtype=dtype, dt_dtype=dtype, dt_softplus=True)
    cfg = chunk_state_bwd.chunk_state_bwd_default_config(dims)
    assert (cfg.BLOCK_P, cfg.BLOCK_N, cfg.OCCUPANCY) == (64, 32, occupancy)


@pytest.mark.parametrize("stage", list(STAGES))
def test_stage_configs_reject_unknown_arch(stage):
    with pytest.raises(ValueError, match="arch='sm_80' must be one of"):
        STAGES[stage].space(PROBLEMS["small_heads16"], "sm_80")


@pytest.mark.parametrize("problem", list(PROBLEMS), ids=list(PROBLEMS))
@pytest.mark.parametrize("stage", list(STAGES))
def test_stage_launch_args_match_kernel_parameters(stage, problem):
    configs_fn, launch_fn = STAGES[stage].space, STAGES[stage].launch
    dims = PROBLEMS[problem]
    arrays = {**forward_arrays(dims, "staged"), **forward_arrays(dims, "fused"),
              **state_update.state_update_inputs(dims), "y": None, "new_state": None}
    for cfg in configs_fn(dims, "sm_90"):
        launch = launch_fn(dims, cfg)
        annotations = kernel_signature(launch.kernel).parameter_annotations
        params = list(inspect.signature(kernel_signature(launch.kernel).pyfunc).parameters)
        assert len(launch.args) == len(params)
        for arg, name, annotation in zip(launch.args, params, annotations):
            # Arrays are passed by name, ct.Constant parameters by value.
            assert isinstance(arg, str) != annotation.constant, (name, arg)
            if isinstance(arg, str):
                assert arg in arrays, arg
        assert set(launch.writes) <= {a for a in launch.args if isinstance(a, str)}


def test_stage_grids_cover_the_problem():
    dims = PROBLEMS["odd_heads_q128"]  # nchunks 8, nheads 24 (not a power of two)
    assert chunk_cumsum.chunk_cumsum_fwd_grid(dims, chunk_cumsum.ChunkCumsumConfig(BLOCK_H=16)) == (8, 2, 3)
    assert chunk_state.chunk_state_fwd_grid(dims, chunk_state.ChunkStateConfig(BLOCK_P=32, BLOCK_N=64)) \
        == (3 * 24 * 2, 2)
    assert chunk_scan.chunk_scan_fwd_grid(
        dims, chunk_scan.ChunkScanConfig(BLOCK_M=64, BLOCK_P=32, HEADS=1)) == (24 * 2 * 2 * 8, 3)
    assert chunk_scan.chunk_scan_fwd_grid(  # 80 heads, headdim 256, chunk 256, 16 chunks
        PROBLEMS["wide_q256"], chunk_scan.ChunkScanConfig(BLOCK_M=64, BLOCK_P=64, HEADS=4)) \
        == (20 * 4 * 4 * 16, 2)
    assert state_update.state_update_grid(dims, state_update.StateUpdateConfig(BLOCK_P=16)) == (3 * 24, 4)


def test_forward_plan_wires_stages_in_order():
    dims = PROBLEMS["wide_q256"]
    plan = forward_plan(dims)
    assert plan.outputs == ("out", "final_states")
    written = [name for launch in plan.launches for name in launch.writes]
    assert written == ["dt_out", "dA_cumsum", "states", "final_states", "out"]
    assert plan.buffers["states"].shape == (2, 16, 80, 256, 256)
    assert plan.buffers["states"].dtype == dims.dtype
    custom = chunk_scan.ChunkScanConfig(BLOCK_M=128, BLOCK_K=32, BLOCK_P=64, HEADS=4)
    assert forward_plan(dims, {"chunk_scan": custom}).launches[2].args[13:18] == (4, 128, 32, 0, 64)
    with pytest.raises(ValueError, match="configs keys=\\['chunk_sacn'\\] must be among"):
        forward_plan(dims, {"chunk_sacn": custom})
    assert FORWARD_LAYOUTS == {"staged": ("chunk_cumsum", "chunk_state", "chunk_scan"),
                               "fused": ("chunk_cumsum", "fused_scan"),
                               "segmented": ("chunk_cumsum", "segment_states", "segmented_scan")}
    assert FORWARD_STAGES == ("chunk_cumsum", "chunk_state", "chunk_scan", "fused_scan", "segment_states",
                              "segmented_scan")


def test_fused_forward_plan_keeps_states_in_the_kernel_and_is_picked_by_its_rule():
    dims = SSDDims(batch=4, seqlen=8192, nheads=32, headdim=64, ngroups=1, dstate=128, chunk_size=64)
    assert forward_layout(dims) == "fused"
    plan = forward_plan(dims)
    assert [name for launch in plan.launches for name in launch.writes] == [
        "dt_out", "dA_cumsum", "out", "final_states"]
    # Unused dummies: the segment arrays, and the states unless the plan saves them for the backward.
    assert plan.buffers["states"].shape == plan.buffers["seg_states"].shape == (1, 1, 1, 1, 1)
    saving = forward_plan(dims, save_states=True)
    assert saving.launches[1].writes == ("out", "final_states", "states")
    assert saving.buffers["states"].shape == (4, 128, 32, 64, 128)
    cfg = fused_scan.fused_scan_fwd_default_config(dims)
    assert plan.launches[1].grid == (4 * 32, 64 // cfg.BLOCK_P, 1)
    # Too few chains and too few chunks to cut, f32, or a chunk the fused kernel does not take: staged.
    for other in (dataclasses.replace(dims, batch=1, seqlen=15 * 64), dataclasses.replace(dims, dtype="float32"),
                  dataclasses.replace(dims, chunk_size=128)):
        assert forward_layout(other) == "staged"
    with pytest.raises(ValueError, match="layout='fused' cannot run chunk_size=128"):
        forward_plan(dataclasses.replace(dims, chunk_size=128), layout="fused")
    # The layout is given with the configs (as the tuner returns them); without one, the rule picks it.
    staged = forward_plan(dims, {"chunk_scan": chunk_scan.chunk_scan_fwd_default_config(dims)}, "staged")
    assert "states" in staged.buffers and len(staged.launches) == 3
    assert len(forward_plan(dims, {"chunk_cumsum": None}).launches) == len(FORWARD_LAYOUTS["fused"])
    with pytest.raises(ValueError, match="configs keys=\\['chunk_scan'\\] must be among"):
        forward_plan(dims, {"chunk_scan": chunk_scan.chunk_scan_fwd_default_config(dims)})
    with pytest.raises(ValueError, match="configs keys=\\['fused_scan'\\] must be among"):
        forward_plan(dims, {"fused_scan": cfg}, layout="staged")


def test_needs_int64_index_selects_int64_kernels():
    small = PROBLEMS["wide_q256"]
    big = dataclasses.replace(small, batch=1, seqlen=1 << 20, nheads=32, headdim=64)  # x has 2^31 elements
    assert not needs_int64_index(small) and needs_int64_index(big)
    for dims, want in ((small, False), (big, True)):
        for launch in forward_plan(dims).launches:
            x_annotation = kernel_signature(launch.kernel).parameter_annotations[0]
            assert (x_annotation.array is not None) == want


def test_segmented_layout_cuts_few_long_chains_into_segments():
    """32 chains of 256 chunks: 4 segments of 64 chunks bring the fused chains to 128, and the rule
    picks the segmented layout (f32 stays staged); segment_states walks the first three in pieces of 32."""
    dims = SSDDims(batch=4, seqlen=16384, nheads=8, headdim=64, ngroups=1, dstate=128, chunk_size=64)
    assert forward_layouts(dims) == ("staged", "fused", "segmented")
    assert forward_layout(dims) == "segmented"
    assert forward_layout(dataclasses.replace(dims, dtype="float32", dt_dtype="float32")) == "staged"
    assert fused_segment_chunks(dims) == 64 and state_piece_chunks(dims) == 32
    plan = forward_plan(dims, layout="segmented")
    assert [launch.grid for launch in plan.launches[1:]] == [(32, 1, 6), (32, 1, 4)]
    assert plan.buffers["seg_states"].shape == (4, 6, 8, 64, 128)
    assert plan.buffers["seg_decay"].shape == (4, 8, 6)
    # Enough chains already, or too few chunks to cut: no segmented layout.
    for other in (dataclasses.replace(dims, batch=16), dataclasses.replace(dims, seqlen=15 * 64)):
        assert fused_segment_chunks(other) == 0 and "segmented" not in forward_layouts(other)


@pytest.mark.parametrize("dstate,features,want", [
    (64, {}, (64, 6, None, 1, False, True)), (64, {"has_z": True}, (64, 6, 8, 2, False, False)),
    (64, {"has_seq_idx": True}, (64, 6, 8, 2, False, False)), (128, {}, (64, 6, None, 1, True, False)),
    (256, {}, (64, 4, None, 1, True, False))])
def test_fused_scan_default_is_the_measured_best_and_in_the_space(dstate, features, want):
    """(BLOCK_P, LOAD_LAT, WORKER_WARPS, CHUNKS_PER_ITER, WEIGHT_X, JOINT_OUTPUT) of the default at headdim
    64: the best measured on the H200 per dstate (at dstate 64 the joint output only without z and seq_idx,
    whose builds of it spill). segment_states walks one chunk per iteration, in two products, whatever the
    fused default does."""
    dims = SSDDims(batch=4, seqlen=8192, nheads=32, headdim=64, ngroups=1, dstate=dstate, chunk_size=64,
                   **features)
    cfg = fused_scan.fused_scan_fwd_default_config(dims)
    assert (cfg.BLOCK_P, cfg.LOAD_LAT, cfg.WORKER_WARPS, cfg.CHUNKS_PER_ITER, cfg.WEIGHT_X, cfg.JOINT_OUTPUT) == want
    assert cfg.OCCUPANCY == 1 and cfg in fused_scan.fused_scan_fwd_configs(dims)
    states_default = fused_scan.segment_states_default_config(dims)
    assert (states_default.CHUNKS_PER_ITER, states_default.JOINT_OUTPUT) == (1, False)
    assert states_default.WEIGHT_X == cfg.WEIGHT_X
    assert {(c.CHUNKS_PER_ITER, c.JOINT_OUTPUT) for c in fused_scan.segment_states_configs(dims)} == {(1, False)}


def test_fused_scan_joint_output_needs_dstate_equal_to_the_chunk_size():
    dims = SSDDims(batch=1, seqlen=256, nheads=2, headdim=64, ngroups=1, dstate=128, chunk_size=64)
    assert not any(cfg.JOINT_OUTPUT for cfg in fused_scan.fused_scan_fwd_configs(dims))
    with pytest.raises(ValueError, match="JOINT_OUTPUT=True needs dstate == chunk_size, got dstate=128, chunk_size=64"):
        fused_scan.fused_scan_fwd_launch(dims, fused_scan.FusedScanConfig(JOINT_OUTPUT=True))


def test_fused_scan_default_at_dstate_256_with_seq_idx_takes_8_worker_warps():
    """With seq_idx tileiras puts the wide state's loop in one warpgroup (with a stack); 8 worker warps
    measured faster there."""
    dims = SSDDims(batch=4, seqlen=8192, nheads=32, headdim=64, ngroups=1, dstate=256, chunk_size=64,
                   has_seq_idx=True)
    cfg = fused_scan.fused_scan_fwd_default_config(dims)
    assert (cfg.BLOCK_P, cfg.LOAD_LAT, cfg.WORKER_WARPS, cfg.WEIGHT_X) == (64, 4, 8, True)
    assert cfg in fused_scan.fused_scan_fwd_configs(dims)


def test_fused_scan_config_takes_one_or_two_chunks_per_iteration():
    with pytest.raises(ValueError, match="CHUNKS_PER_ITER must be 1 or 2, got 3"):
        fused_scan.FusedScanConfig(CHUNKS_PER_ITER=3)


def test_every_stage_declaration_is_coherent():
    """Each plan stage is declared once, next to its kernel: its default is of its config type and in its
    space, its key fields are problem fields, and the plans key their configs by its name."""
    from jax_mamba2.kernels import backward
    stages = {**STAGES, **backward.STAGES}
    assert forward.FORWARD_STAGES == tuple(forward.STAGES) and backward.BACKWARD_STAGES == tuple(backward.STAGES)
    assert {s for layout in FORWARD_LAYOUTS.values() for s in layout} == set(forward.STAGES)
    dims = SSDDims(batch=4, seqlen=16384, nheads=8, headdim=64, ngroups=1, dstate=128, chunk_size=64)
    assert forward.forward_layouts(dims) == tuple(FORWARD_LAYOUTS)       # every stage has work here
    for name, stage in stages.items():
        assert stage.name == name
        default = stage.default(dims)
        assert isinstance(default, stage.config_type), name
        assert default in stage.space(dims, "sm_90"), name
        assert all(hasattr(dims, field) for field in stage.key_fields), name
        assert stage.work_items(dims) >= 1, name


def test_kernel_launch_orders_the_arguments_by_the_kernel_signature_and_checks_them():
    """Each parameter named once: arrays read the plan array of their name (or the one `arrays` gives),
    constants take their keyword's value, in the kernel's own order; a missing or unknown name is refused."""
    from jax_mamba2.kernels._common import kernel_launch
    from jax_mamba2.kernels.chunk_state_bwd import CHUNK_STATE_BWD_KERNELS
    kernel = CHUNK_STATE_BWD_KERNELS[0]
    constants = dict(CHUNK=64, BLOCK_P=64, BLOCK_N=32, SUM_ROWS=16, HAS_SEQ_IDX=False, LOAD_LAT=6)
    launch = kernel_launch(kernel, (4, 1), writes=("dstates",), arrays={"dy": "dout"}, **constants)
    assert launch.args == ("C", "dout", "dA_cumsum", "states", "seq_idx", "dfinal_states", "dstates",
                           "dinitial_states", "ddA_chunk", 64, 64, 32, 16, False, 6)
    with pytest.raises(TypeError, match="chunk_state_bwd_kernel needs a value for its constant LOAD_LAT"):
        kernel_launch(kernel, (4, 1), writes=(), **{k: v for k, v in constants.items() if k != "LOAD_LAT"})
    with pytest.raises(TypeError, match=r"chunk_state_bwd_kernel has no parameter \['BLOCK_Q'\]"):
        kernel_launch(kernel, (4, 1), writes=(), BLOCK_Q=1, **constants)
