"""The decode kernels compile to sm_90 cubins on this machine (no GPU needed) with the constraints JAX uses, and at
the decode shapes of the LM benchmark's model (d_model 1024: in_proj 1024 x 4384, out_proj 2048 x 1024, the tied
head 50280 x 1024, 24 stacked layers) their default configurations run without spilling registers."""
import dataclasses
import re

import pytest

ct = pytest.importorskip("cuda.tile")

from benchmarks.tools.sass import resource_usage  # noqa: E402
from jax_mamba2.flax_layers.mamba2 import GATED_NORM_IN_MIXER_ROWS  # noqa: E402
from jax_mamba2.kernels._common import INDEPENDENT, WAITS_AND_RELEASES  # noqa: E402
from jax_mamba2.kernels import decode_mixer, decode_projection  # noqa: E402
from jax_mamba2.kernels.decode_mixer import MixerStepDims  # noqa: E402
from jax_mamba2.kernels.decode_projection import ProjectionDims  # noqa: E402
from tests.kernels.test_compile import plan_cubins  # noqa: E402

LAYERS = 24


def _projections(rows: int, param_dtype: str) -> dict[str, ProjectionDims]:
    """The LM's fused step: out_proj returns its partial sums, which the next in_proj's (or the head's) norm sums;
    up to GATED_NORM_IN_MIXER_ROWS rows it normalizes the mixer step's gated output (float32) from the step's sums
    of squares, else its gated norm is a launch of its own."""
    common = dict(rows=rows, layers=LAYERS, weight_dtype=param_dtype, norm_weight_dtype=param_dtype)
    if rows <= GATED_NORM_IN_MIXER_ROWS:
        out_proj = ProjectionDims(features=2048, out_features=1024, has_norm=True, out_parts=True, dtype="float32",
                                  norm_parts=decode_mixer.sum_squares_parts(_mixer(rows, param_dtype)), **common)
    else:
        out_proj = ProjectionDims(features=2048, out_features=1024, has_norm=True, z_width=4384, out_parts=True,
                                  **common)
    parts = decode_projection.output_parts(out_proj)
    return {
        "in_proj": ProjectionDims(features=1024, out_features=4384, has_norm=True, has_residual=True,
                                  write_residual=True, residual_dtype="float32", residual_in_dtype="float32",
                                  x_parts=parts, **common),
        "out_proj": out_proj,
        "head": ProjectionDims(**{**common, "layers": 1}, features=1024, out_features=50280, has_norm=True,
                               has_residual=True, write_residual=True, residual_dtype="float32",
                               residual_in_dtype="float32", transpose_weight=True, x_parts=parts),
    }


def _mixer(rows: int, param_dtype: str) -> MixerStepDims:
    return MixerStepDims(rows=rows, nheads=32, headdim=64, ngroups=1, dstate=128, in_width=4384, xbc_offset=2048,
                         dt_offset=4352, norm_z_offset=0 if rows <= GATED_NORM_IN_MIXER_ROWS else None, layers=LAYERS,
                         conv_state_dtype=param_dtype,
                         ssm_state_dtype=param_dtype,
                         conv_weight_dtype=param_dtype, A_log_dtype=param_dtype, dt_bias_dtype=param_dtype,
                         D_dtype=param_dtype)


def _dependent(plan, level: int):
    return dataclasses.replace(plan, launches=tuple(launch.dependent(level) for launch in plan.launches))


def _cubins(rows: int, param_dtype: str, dependent: int = INDEPENDENT) -> dict[str, bytes]:
    """The token step's cubins; `dependent`: the DEPENDENT constant of every launch (the merged token step's
    programmatic dependent launches)."""
    cubins = {}
    for name, dims in _projections(rows, param_dtype).items():
        assert decode_projection.projection_unsupported_reason(dims) is None
        plan = _dependent(decode_projection.norm_project_plan(dims), dependent)
        for kernel, cubin in plan_cubins((plan, decode_projection.norm_project_inputs(dims))).items():
            cubins[f"{name} {kernel}"] = cubin
    dims = _mixer(rows, param_dtype)
    assert decode_mixer.mixer_step_unsupported_reason(dims) is None
    plan = _dependent(decode_mixer.mixer_step_plan(dims), dependent)
    cubins["mixer"] = plan_cubins((plan, decode_mixer.mixer_step_inputs(dims)))["mixer_step_kernel"]
    return cubins


def _assert_spill_free(cubins):
    """No stack frame and no local memory: nothing spilled (read from the resource usage: nvdisasm cannot
    disassemble every one of these cubins)."""
    for name, cubin in cubins.items():
        assert cubin[:4] == b"\x7fELF", name
        try:
            resources = resource_usage(cubin)
        except FileNotFoundError as e:
            pytest.skip(str(e))
        usage = dict(re.findall(r"(LOCAL|STACK):(\d+)", resources))
        assert int(usage["LOCAL"]) == 0 and int(usage["STACK"]) == 0, (name, usage)


def test_default_configs_compile_spill_free_at_batch_one_bf16():
    _assert_spill_free(_cubins(1, "bfloat16"))


@pytest.mark.slow
@pytest.mark.parametrize("rows, param_dtype", [(64, "bfloat16"), (256, "bfloat16"), (1, "float32"), (64, "float32")])
def test_default_configs_compile_spill_free(rows, param_dtype):
    _assert_spill_free(_cubins(rows, param_dtype))


def test_split_k_products_compile_spill_free():
    """out_proj's product with K split over 8 blocks at one row (normalizing its rows; its default) and 4 at 64,
    and the sum of the splits; the norm kernels. (At 32 columns the normalizing product's float32 rows take it past the
    registers: 312 bytes of stack.)"""
    cubins = {}
    for rows in (1, 64):
        dims = dataclasses.replace(_projections(rows, "bfloat16")["out_proj"], out_parts=False)  # their sum's launch
        cfg = decode_projection.ProjectionConfig(BLOCK_N=32 if rows > GATED_NORM_IN_MIXER_ROWS else 64,
                                                 SPLIT_K=decode_projection.MAX_NARROW_SPLITS if rows == 1 else 4)
        plan = decode_projection.norm_project_plan(dims, cfg)
        for kernel, cubin in plan_cubins((plan, decode_projection.norm_project_inputs(dims))).items():
            cubins[f"{rows} {kernel}"] = cubin
        in_proj = _projections(rows, "bfloat16")["in_proj"]
        cubins[f"{rows} decode_norm_kernel"] = plan_cubins((decode_projection.norm_project_plan(in_proj),
                                                            decode_projection.norm_project_inputs(in_proj)))[
            "decode_norm_kernel"]
    assert {name.split()[1] for name in cubins} == {"decode_norm_kernel", "decode_project_kernel",
                                                    "decode_split_sum_kernel"}
    _assert_spill_free(cubins)


@pytest.mark.parametrize("rows, state_dtype, nheads, ngroups, heads", [
    (64, "bfloat16", 32, 1, 4), (256, "bfloat16", 32, 1, 8), (64, "float32", 32, 1, 8), (256, "float32", 32, 1, 8),
    (8, "bfloat16", 32, 1, 1), (32, "bfloat16", 32, 1, 2), (64, "bfloat16", 48, 1, 8), (256, "bfloat16", 24, 2, 4),
    (256, "bfloat16", 36, 3, 4), (256, "bfloat16", 40, 8, 1)])
def test_the_mixer_step_default_takes_several_heads_per_block_where_blocks_are_to_spare(
        rows, state_dtype, nheads, ngroups, heads):
    """The most heads of one group (up to 8, dividing the group's) that leave two blocks per SM of an H200: d1024's
    32 heads of 64 x 128 take 4 per block at 64 rows (512 blocks; 8 would leave 256), 8 at 256; 8 rows keep one."""
    dims = dataclasses.replace(_mixer(rows, state_dtype), nheads=nheads, ngroups=ngroups,
                               xbc_offset=nheads * 64, dt_offset=nheads * 128 + 2 * ngroups * 128,
                               in_width=nheads * 128 + 2 * ngroups * 128 + nheads)
    cfg = decode_mixer.mixer_step_default_config(dims)
    assert cfg.HEADS == heads, cfg
    assert (nheads // ngroups) % cfg.HEADS == 0
    if heads > 1:
        assert rows * nheads * (64 // cfg.BLOCK_P) // cfg.HEADS >= 2 * decode_mixer.SM90_SMS
    decode_mixer.mixer_step_plan(dims, cfg)  # the plan accepts it


# Shared memory of an H200 SM available to its blocks.
SM90_SHARED_BYTES = 228 * 1024


@pytest.mark.parametrize("rows, state_dtype", [(64, "bfloat16"), (64, "float32"), (8, "float32")])
def test_the_mixer_step_default_fits_its_occupancy(rows, state_dtype):
    """The default block's shared memory and registers let OCCUPANCY blocks share an SM: a whole head of an f32
    state would hold 83.7 KB, so the occupancy hint could not be met (the compiler then takes 255 registers)."""
    dims = _mixer(rows, state_dtype)
    cfg = decode_mixer.mixer_step_default_config(dims)
    cubin = plan_cubins((decode_mixer.mixer_step_plan(dims, cfg), decode_mixer.mixer_step_inputs(dims)))[
        "mixer_step_kernel"]
    try:
        usage = {k: int(v) for k, v in re.findall(r"(REG|SHARED):(\d+)", resource_usage(cubin))}
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert usage["SHARED"] * cfg.OCCUPANCY <= SM90_SHARED_BYTES, (cfg, usage)
    assert usage["REG"] * 128 * cfg.OCCUPANCY <= 65536, (cfg, usage)


@pytest.mark.slow
@pytest.mark.parametrize("rows, state_dtype", [(256, "bfloat16"), (64, "float32")])
def test_mixer_steps_of_several_heads_per_block_compile_spill_free_at_their_occupancy(rows, state_dtype):
    """2, 4 or 8 heads per block (HEADS, one after the other) at the default tiles: no spills, and occupancy 4's
    blocks still fit an SM."""
    dims = _mixer(rows, state_dtype)
    for heads in (2, 4, 8):
        cfg = dataclasses.replace(decode_mixer.mixer_step_default_config(dims), HEADS=heads)
        cubin = plan_cubins((decode_mixer.mixer_step_plan(dims, cfg), decode_mixer.mixer_step_inputs(dims)))[
            "mixer_step_kernel"]
        _assert_spill_free({f"HEADS={heads}": cubin})
        usage = {k: int(v) for k, v in re.findall(r"(REG|SHARED):(\d+)", resource_usage(cubin))}
        assert usage["SHARED"] * cfg.OCCUPANCY <= SM90_SHARED_BYTES, (cfg, usage)


def test_dependent_builds_wait_for_their_predecessor_and_release_their_successor():
    """With DEPENDENT = WAITS_AND_RELEASES (the merged token step's launches) every decode kernel of the batch-1
    step waits for its predecessor (griddepcontrol.wait: ACQBULK) and releases its successor (PREEXIT); at
    INDEPENDENT (every plan's) neither is built. With the waits at the kernels' tops, and its K steps halved,
    out_proj's product holds a stack frame of spilled registers (160 bytes with tileiras 13.4; 216 with whole
    steps; `benchmarks/tools/sass.py decode --dependent` counts the LDL / STL), no other kernel any; no local
    memory."""
    from benchmarks.tools import sass
    if sass.find_cuobjdump() is None:
        pytest.skip("cuobjdump/nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    for level, expected in ((INDEPENDENT, False), (WAITS_AND_RELEASES, True)):
        for name, cubin in _cubins(1, "bfloat16", level).items():
            opcodes = {text.split()[0].split(".")[0] for _, text in sass.instructions(sass.disassemble(cubin)[0])}
            assert ("ACQBULK" in opcodes, "PREEXIT" in opcodes) == (expected,) * 2, name
            usage = {k: int(v) for k, v in re.findall(r"(LOCAL|STACK):(\d+)", resource_usage(cubin))}
            assert usage["LOCAL"] == 0 and usage["STACK"] <= (192 if name.startswith("out_proj") else 0), \
                (name, usage)


def test_dependent_products_of_the_wider_lm_take_half_steps_without_spills():
    """At d_model 2048 (mamba2-1.3b) out_proj's product in the LM's form at one row (normalizing the mixer step's
    gated output; `sass.decode_out_proj_forms`, float32 norm weights), built as a programmatic dependent, spilled
    with 128-feature K steps (a 352-byte stack, 2.3x the shared memory); its half steps build as the FFI path's
    build does, with no stack and less shared memory than it. (The emulator cannot tell whether the half steps
    are taken: their values are the same.)"""
    from benchmarks.tools import sass
    dims = sass.decode_out_proj_forms(1, d_model=2048)["mixer_gated"]
    usage = {}
    for level in (INDEPENDENT, WAITS_AND_RELEASES):
        try:
            resources = resource_usage(sass.decode_product_cubin(dims, level))
        except FileNotFoundError as e:
            pytest.skip(str(e))
        usage[level] = {k: int(v) for k, v in re.findall(r"(STACK|SHARED):(\d+)", resources)}
    assert usage[WAITS_AND_RELEASES]["STACK"] == usage[INDEPENDENT]["STACK"] == 0, usage
    assert usage[WAITS_AND_RELEASES]["SHARED"] <= usage[INDEPENDENT]["SHARED"], usage


def test_the_normalizing_product_leaves_the_gate_to_the_mixer_step():
    """out_proj's product normalizing the mixer step's gated input runs no sigmoid per element: its SASS has about
    the plain product's MUFU count and half the instructions of the form that gates in the product, whose every
    column block repeats the gate (why the mixer step gates the norm's input: docs/design.md §8)."""
    from benchmarks.tools import sass
    if sass.find_cuobjdump() is None:
        pytest.skip("cuobjdump/nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    counts = {form: sass.instruction_counts(sass.disassemble(sass.decode_product_cubin(dims))[0])
              for form, dims in sass.decode_out_proj_forms(1).items()}
    assert counts["mixer_gated"]["MUFU"] <= counts["plain"]["MUFU"] + 8 < counts["gated"]["MUFU"], counts
    assert counts["mixer_gated"]["instructions"] < 0.6 * counts["gated"]["instructions"], counts


def test_the_mixer_step_takes_64_bit_offsets_into_stacks_past_int32():
    """mamba2-370m's SSM state stack at 256 rows (48 layers x 256 x 2048 x 128 = 3.2e9 elements) would overflow
    int32 offsets: its plan launches the int64-indexed kernel; 24 layers stay int32. One layer's state (67M
    elements) is addressed as an array of its own, so the kernel keeps the int32 kernel's bulk tensor copies of
    the state tiles (as many TMA loads and stores, about the same shared memory) and its heads per block,
    spill-free."""
    from benchmarks.tools import sass

    int32_dims = _mixer(256, "bfloat16")
    dims = dataclasses.replace(int32_dims, layers=48)
    assert decode_mixer.needs_int64_index(dims) and not decode_mixer.needs_int64_index(int32_dims)
    assert decode_mixer.views_the_layer_state(dims)
    assert not decode_mixer.views_the_layer_state(dataclasses.replace(dims, rows=8192))  # a layer past 2^31
    assert decode_mixer.mixer_step_unsupported_reason(dims) is None
    cfg = decode_mixer.mixer_step_default_config(dims)
    assert cfg == decode_mixer.mixer_step_default_config(int32_dims) and cfg.HEADS > 1
    plan = decode_mixer.mixer_step_plan(dims)
    annotations = plan.launches[0].kernel._annotated_function.pyfunc.__annotations__
    assert annotations["ssm_state"] is ct.IndexedWithInt64 and annotations["conv_state"] is ct.IndexedWithInt64
    cubins = {name: plan_cubins((decode_mixer.mixer_step_plan(d, cfg), decode_mixer.mixer_step_inputs(d)))[
        "mixer_step_kernel"] for name, d in (("int32", int32_dims), ("int64", dims))}
    _assert_spill_free(cubins)
    if sass.find_cuobjdump() is None:
        pytest.skip("cuobjdump/nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    tma = {name: tuple(len(re.findall(rf"\b{op}\b", sass.disassemble(cubin)[0])) for op in ("UTMALDG", "UTMASTG"))
           for name, cubin in cubins.items()}
    assert tma["int64"] == tma["int32"] and min(tma["int32"]) > 0, tma
    shared = {name: int(re.search(r"SHARED:(\d+)", resource_usage(cubin)).group(1)) for name, cubin in cubins.items()}
    assert abs(shared["int64"] - shared["int32"]) < 1024, shared


def test_the_mixer_steps_conv_window_stores_are_plain_stores():
    """The conv windows' stores are never bulk tensor copies (TMA): with f32 windows of d_conv 4 (16-byte rows, TMA
    by default) the launch hung on the GPU with them. The f32 build of d_conv 4 has as many TMA stores as that of
    d_conv 3 (12-byte rows, never TMA), and no fence between the windows' gathers and a TMA store to the same
    stack."""
    from benchmarks.tools import sass
    if sass.find_cuobjdump() is None:
        pytest.skip("cuobjdump/nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    counts = {}
    for d_conv in (3, 4):
        dims = MixerStepDims(rows=2, nheads=8, headdim=16, ngroups=2, dstate=16, in_width=2 * 128 + 64 + 8,
                             xbc_offset=128, dt_offset=128 + 192, layers=3, d_conv=d_conv, dtype="float32",
                             conv_state_dtype="float32", ssm_state_dtype="float32")
        listing = sass.disassemble(plan_cubins((decode_mixer.mixer_step_plan(dims),
                                                decode_mixer.mixer_step_inputs(dims)))["mixer_step_kernel"])[0]
        counts[d_conv] = {op: len(re.findall(rf"\b{re.escape(op)}\b", listing))
                          for op in ("UTMASTG", "FENCE.VIEW.ASYNC.G")}
    assert counts[4] == counts[3] and counts[4]["FENCE.VIEW.ASYNC.G"] == 0, counts
    assert counts[4]["UTMASTG"] > 0, counts  # the state's and y's stores stay TMA


@pytest.mark.parametrize("d_model, d_in_proj", [(1024, 4384), (2048, 8512)])
def test_the_weight_first_product_of_float32_weights_takes_wgmma(d_model, d_in_proj):
    """in_proj with float32 weights at 64 rows: the default, a block of 64 rows with the weight as the first
    operand (WEIGHT_FIRST), runs wgmma (HGMMA), where two 32-row blocks per column block run mma.sync (HMMA), both
    within two blocks per SM (128 registers, at most half the shared memory) and without local memory."""
    from benchmarks.tools.sass import disassemble

    dims = ProjectionDims(rows=64, features=d_model, out_features=d_in_proj, layers=48, has_norm=True,
                          weight_dtype="float32")
    assert decode_projection.projection_default_config(dims).WEIGHT_FIRST
    for cfg, product in ((decode_projection.ProjectionConfig(BLOCK_N=64, BLOCK_M=32, OCCUPANCY=2), "HMMA"),
                         (decode_projection.projection_default_config(dims), "HGMMA")):
        cubin = plan_cubins((decode_projection.norm_project_plan(dims, cfg),
                             decode_projection.norm_project_inputs(dims)))["decode_project_kernel"]
        try:
            sass, resources = disassemble(cubin)
        except FileNotFoundError as e:
            pytest.skip(str(e))
        usage = {k: int(v) for k, v in re.findall(r"(REG|SHARED|LOCAL):(\d+)", resources)}
        other = "HGMMA" if product == "HMMA" else "HMMA"
        assert re.search(rf"\b{product}\b", sass) and not re.search(rf"\b{other}\b", sass), cfg
        assert usage["LOCAL"] == 0 and usage["REG"] <= 128 and usage["SHARED"] <= 113 * 1024, (cfg, usage)
