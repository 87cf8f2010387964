"""The decode kernels' plans (kernels/decode_projection.py, decode_mixer.py) run block by block on the NumPy emulator
of cuda.tile against the float64 reference (jax_mamba2.decode_reference) on fresh random inputs: every norm and
gate placement, groups, the residual stream written with and without an input, bias, a transposed (tied) weight,
two row blocks, columns past the last full tile, a conv of width 3, groups of one head, and the layer picked out
of stacked arrays (the other layers' SSM states untouched); in float64 (the algebra) and in the arrays' own dtypes
(the roundings)."""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

ct = pytest.importorskip("cuda.tile")

from jax_mamba2.bridge import decode_ops  # noqa: E402
from jax_mamba2.kernels import decode_mixer, decode_projection  # noqa: E402
from jax_mamba2.kernels._common import INDEPENDENT, WAITS_AND_RELEASES, kernel_name  # noqa: E402
from tests._helpers import rel_l2  # noqa: E402
from tests.kernels import _cutile_emulator as emulator  # noqa: E402
from tests.kernels._decode_checks import (MIXER_CASES, PROJECTION_CASES, mixer_inputs, mixer_oracle,  # noqa: E402
                                          projection_inputs, projection_oracle)
from tests.kernels._plan_checks import assert_plan_well_formed  # noqa: E402

# Float64 emulation checks the algebra; the arrays' own dtypes check the roundings.
TOLERANCE = {True: 1e-12, False: {"float32": 1e-5, "bfloat16": 2e-2}}


def _projection_dims(case, arrays):
    norm_weight = arrays["norm_weight"]
    group = case.group_size or case.features
    if norm_weight is not None:
        norm_weight = norm_weight.reshape(case.layers, case.features // group, group)
    kw = case.kwargs()
    return decode_ops.projection_dims(
        arrays["x"], arrays["residual"], arrays["z"], norm_weight, arrays["weight"], arrays["bias"],
        group_size=group, norm_before_gate=kw["norm_before_gate"], eps=1e-5, z_offset=case.z_offset,
        transpose_weight=case.transpose_weight, residual_dtype=kw["residual_dtype"],
        dtype=np.dtype(case.dtype) if case.dtype != "bfloat16" else arrays["x"].dtype)


def run_projection(case, arrays, cfg=None, *, float64=True) -> dict:
    dims = _projection_dims(case, arrays)
    assert decode_projection.projection_unsupported_reason(dims) is None
    plan = decode_projection.norm_project_plan(dims, cfg)
    out = emulator.run_plan(plan, _plan_inputs(case, arrays, dims), float64=float64)
    result = {"out": out["out"]}
    if dims.write_residual:
        result["residual_out"] = out["residual_out"]
    return result


def mixer_dims(case, arrays, **layout):
    """The kernel's problem for a mixer case's arrays, in the case's layout (updated by `layout`)."""
    return decode_ops.mixer_dims(*(arrays[k] for k in ("zxbcdt", "conv_state", "conv_weight", "conv_bias", "A_log",
                                                       "dt_bias", "D", "ssm_state")), **{**case.layout(), **layout})


def run_mixer(case, arrays, cfg=None, *, float64=True, **layout) -> dict:
    """The plan's outputs (with sum_squares where a norm_z_offset in `layout` asks for them)."""
    dims = mixer_dims(case, arrays, **layout)
    assert decode_mixer.mixer_step_unsupported_reason(dims) is None
    plan = decode_mixer.mixer_step_plan(dims, cfg)
    inputs = dict(arrays, layer_index=np.array([case.layer], np.int32))
    if inputs["conv_bias"] is None:
        inputs["conv_bias"] = np.zeros((1, 1), np.float32)
    for name in ("ssm_state", "conv_state"):  # written in place
        inputs[name] = inputs[name].copy()
    out = emulator.run_plan(plan, inputs, float64=float64)
    # The layer's new conv state: x's channels rewritten in the stack, B's and C's windows apart; no other layer's
    # conv state touched.
    others = [i for i in range(case.layers) if i != case.layer]
    np.testing.assert_array_equal(out["conv_state"][others], arrays["conv_state"][others])
    assert out["group_windows"].shape == (case.rows, 2 * case.ngroups * case.dstate, case.d_conv)
    new_conv_state = np.concatenate([out["conv_state"][case.layer][:, :case.d_ssm], out["group_windows"]], axis=1)
    result = {"y": out["y"].reshape(case.rows, -1), "ssm_state": out["ssm_state"], "new_conv_state": new_conv_state}
    if dims.has_sum_squares:
        result[decode_mixer.SUM_SQUARES_OUTPUT] = out[decode_mixer.SUM_SQUARES_OUTPUT]
    return result


def _assert_close(got, want, tolerance):
    assert set(got) == set(want)
    errors = {name: rel_l2(got[name], want[name]) for name in want}
    assert max(errors.values()) < tolerance, errors


@pytest.mark.parametrize("float64", [True, False])
@pytest.mark.parametrize("name", list(PROJECTION_CASES))
def test_projection_matches_float64_reference(name, float64):
    case = PROJECTION_CASES[name]
    arrays = projection_inputs(case, seed=11)
    tolerance = TOLERANCE[True] if float64 else TOLERANCE[False][case.dtype]
    _assert_close(run_projection(case, arrays, float64=float64), projection_oracle(case, arrays), tolerance)


@pytest.mark.parametrize("name, cfg", [
    ("gated_norm_out_proj", decode_projection.ProjectionConfig(BLOCK_N=16, BLOCK_K=16, LATENCY=0)),
    ("gated_norm_out_proj", decode_projection.ProjectionConfig(BLOCK_N=64, BLOCK_K=64, LATENCY=2)),
    ("gated_norm_out_proj", decode_projection.ProjectionConfig(BLOCK_N=32, BLOCK_K=32, BLOCK_M=1)),
    ("gated_norm_out_proj", decode_projection.ProjectionConfig(BLOCK_N=16, BLOCK_K=32, BLOCK_M=2)),
    ("gated_norm_out_proj", decode_projection.ProjectionConfig(BLOCK_N=16, BLOCK_K=16, SPLIT_K=2)),
    ("gated_norm_out_proj", decode_projection.ProjectionConfig(BLOCK_N=16, BLOCK_K=16, SPLIT_K=8)),
    ("plain_with_bias", decode_projection.ProjectionConfig(BLOCK_N=32, BLOCK_K=16, SPLIT_K=2)),
    ("tied_head", decode_projection.ProjectionConfig(BLOCK_N=32, BLOCK_K=32, SPLIT_K=2)),
    ("add_norm_in_proj", decode_projection.ProjectionConfig(BLOCK_N=64, BLOCK_K=32, WEIGHT_FIRST=True)),
    ("gated_norm_out_proj", decode_projection.ProjectionConfig(BLOCK_N=16, BLOCK_K=16, WEIGHT_FIRST=True)),
    ("plain_with_bias", decode_projection.ProjectionConfig(BLOCK_N=32, BLOCK_K=16, SPLIT_K=2, WEIGHT_FIRST=True)),
    ("tied_head", decode_projection.ProjectionConfig(BLOCK_N=32, BLOCK_K=32, WEIGHT_FIRST=True)),
    ("two_row_blocks", decode_projection.ProjectionConfig(BLOCK_N=16, BLOCK_K=16, BLOCK_M=64, WEIGHT_FIRST=True))])
def test_projection_tiles_and_hints_leave_the_values(name, cfg):
    """K steps of several per row and of the whole row, blocks of fewer rows than the case has (1-row blocks run
    without tensor cores), and K split over 2 or 4 blocks (8 asked of 4 steps: lowered to 4), the bias and a
    transposed weight with it; the product with the weight as the first operand (WEIGHT_FIRST) after the norm's
    launch (plain and gated), with a split K and its bias, the transposed weight and two blocks of rows (the
    norm from the mixer step's sums of squares: the test of those below)."""
    case = PROJECTION_CASES[name]
    arrays = projection_inputs(case, seed=12)
    _assert_close(run_projection(case, arrays, cfg), projection_oracle(case, arrays), TOLERANCE[True])


@pytest.mark.parametrize("nheads, groups, norm_before_gate, z_pad", [(8, 1, False, 0), (8, 1, True, 128),
                                                                      (16, 2, True, 128)])
def test_a_dependent_product_normalizing_from_the_sums_of_squares_takes_half_steps_and_leaves_the_values(
        nheads, groups, norm_before_gate, z_pad):
    """out_proj's product as the LM runs it (normalizing the mixer step's gated output from its sums of squares;
    with the gate after the norm, read from a K step into its array; one group or two), launched as a
    programmatic dependent: its 128-feature K steps taken as two of 64 each."""
    case = dataclasses.replace(MIXER_CASES["gated_norm_mixer"], nheads=nheads)
    arrays = mixer_inputs(case, seed=33)
    cfg = decode_projection.ProjectionConfig(BLOCK_N=16, BLOCK_K=128)
    assert case.d_ssm // groups % cfg.BLOCK_K == 0
    _, out, want, _, _ = _gated_norm_after_mixer(case, arrays, norm_before_gate=norm_before_gate,
                                                 group_size=case.d_ssm // groups, projection_cfg=cfg,
                                                 dependent=WAITS_AND_RELEASES, z_pad=z_pad)
    assert rel_l2(out, want) < TOLERANCE[True]


@pytest.mark.parametrize("name, features, cfg, halves", [
    ("plain_with_bias", 256, decode_projection.ProjectionConfig(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2), 2),
    ("gated_norm_out_proj", 256, decode_projection.ProjectionConfig(BLOCK_N=16, BLOCK_K=128, SPLIT_K=2), 2),
    ("tied_head", 208, decode_projection.ProjectionConfig(BLOCK_N=32, BLOCK_K=128), 2),
    ("add_norm_in_proj", 256, decode_projection.ProjectionConfig(BLOCK_N=64, BLOCK_K=128, BLOCK_M=16,
                                                                 WEIGHT_FIRST=True), 2),
    ("add_norm_in_proj", 160, decode_projection.ProjectionConfig(BLOCK_N=64, BLOCK_K=128), 1),
    ("add_norm_in_proj", 256, decode_projection.ProjectionConfig(BLOCK_N=64, BLOCK_K=64), 1)])
def test_dependent_builds_take_half_k_steps_and_leave_the_values(name, features, cfg, halves):
    """A product launched as a programmatic dependent takes each K step of 128 features as two of 64 (tileiras
    spills the other build): with K split, the gate, a transposed weight, a last half step partly past K and the
    weight as the first operand; not where a half step would lie wholly past K (160 features), nor below
    128-feature steps. (Whether the kernel takes the half steps its plan asks for, the emulator cannot tell: the
    values are the same; the compile tests see it.)"""
    case = dataclasses.replace(PROJECTION_CASES[name], features=features)
    arrays = projection_inputs(case, seed=14)
    dims = _projection_dims(case, arrays)
    assert decode_projection.projection_unsupported_reason(dims) is None
    plan = decode_projection.norm_project_plan(dims, cfg)
    assert decode_projection._dependent_halves(dims, cfg) == halves
    dependent = dataclasses.replace(plan, launches=tuple(launch.dependent(WAITS_AND_RELEASES)
                                                         for launch in plan.launches))
    out = emulator.run_plan(dependent, _plan_inputs(case, arrays, dims), float64=True)
    want = projection_oracle(case, arrays)
    _assert_close({name: out[name] for name in want}, want, TOLERANCE[True])


@pytest.mark.parametrize("name, cfg", [
    ("gated_norm_out_proj", decode_projection.ProjectionConfig(BLOCK_N=16, BLOCK_K=16, SPLIT_K=4)),
    ("gated_norm_out_proj", decode_projection.ProjectionConfig(BLOCK_N=16, BLOCK_K=16)),
    ("plain_with_bias", decode_projection.ProjectionConfig(BLOCK_N=32, BLOCK_K=16, SPLIT_K=2)),
    ("tied_head", decode_projection.ProjectionConfig(BLOCK_N=32, BLOCK_K=32, SPLIT_K=2)),
    ("plain_with_bias", decode_projection.ProjectionConfig(BLOCK_N=32, BLOCK_K=16, SPLIT_K=2, WEIGHT_FIRST=True))])
def test_projection_partial_sums_out_add_up_to_the_output(name, cfg):
    """With out_parts the plan's output is the product's partial sums, one per split of K (one unsplit), the
    bias in the first: one launch fewer than summing them, and their sum is the projection's output."""
    case = PROJECTION_CASES[name]
    arrays = projection_inputs(case, seed=13)
    dims = dataclasses.replace(_projection_dims(case, arrays), out_parts=True)
    plan = decode_projection.norm_project_plan(dims, cfg)
    assert "decode_split_sum_kernel" not in [kernel_name(launch.kernel) for launch in plan.launches]
    out = emulator.run_plan(plan, _plan_inputs(case, arrays, dims), float64=True)
    parts = decode_projection.output_parts(dims, cfg)
    assert plan.outputs[0] == "partials" and out["partials"].shape == (parts, case.rows, case.out_features)
    np.testing.assert_allclose(out["partials"].sum(axis=0), projection_oracle(case, arrays)["out"], rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("float64", [True, False])
@pytest.mark.parametrize("name", ["add_norm_in_proj", "first_block_in_proj", "tied_head", "bf16"])
def test_projection_norm_sums_partial_sums_of_x(name, float64):
    """x given as three float32 partial sums (what the previous projection's out_parts wrote): the norm kernel sums
    them and rounds the sum to x's dtype, then runs as with x itself."""
    case = PROJECTION_CASES[name]
    arrays = projection_inputs(case, seed=14)
    rng = np.random.default_rng(15)
    parts = rng.standard_normal((3, case.rows, case.features)).astype(np.float32)
    x = parts.astype(np.float64).sum(axis=0)  # in float64 emulation the sum is not rounded
    if not float64:
        x = x.astype(np.float32).astype(arrays["x"].dtype)
    dims = dataclasses.replace(_projection_dims(case, arrays), x_parts=3)
    got = emulator.run_plan(decode_projection.norm_project_plan(dims), _plan_inputs(case, {**arrays, "x": parts}, dims),
                            float64=float64)
    want = projection_oracle(case, {**arrays, "x": x})
    tolerance = TOLERANCE[True] if float64 else TOLERANCE[False][case.dtype]
    _assert_close({name: got[name] for name in want}, want, tolerance)


def _plan_inputs(case, arrays, dims) -> dict:
    """The plan's inputs of `dims` from a case's arrays: dummies for absent ones, the case's layer."""
    specs = decode_projection.norm_project_inputs(dims)
    inputs = {name: np.zeros(spec.shape, np.float32) if arrays.get(name) is None else arrays[name]
              for name, spec in specs.items() if name != "layer_index"}
    inputs["norm_weight"] = inputs["norm_weight"].reshape(specs["norm_weight"].shape)
    inputs["layer_index"] = np.array([case.layer], np.int32)
    for name, spec in specs.items():
        assert inputs[name].shape == spec.shape, (name, inputs[name].shape, spec.shape)
    return inputs


@pytest.mark.parametrize("float64", [True, False])
@pytest.mark.parametrize("name", list(MIXER_CASES))
def test_mixer_step_matches_float64_reference(name, float64):
    case = MIXER_CASES[name]
    arrays = mixer_inputs(case, seed=21)
    got = run_mixer(case, arrays, float64=float64)
    want = mixer_oracle(case, arrays)
    others = [i for i in range(case.layers) if i != case.layer]
    np.testing.assert_array_equal(got["ssm_state"][others], arrays["ssm_state"][others])  # untouched
    tolerance = TOLERANCE[True] if float64 else TOLERANCE[False][case.dtype]
    _assert_close(got, want, tolerance)


def test_mixer_step_takes_float32_conv_parameters_unrounded_to_bfloat16():
    """The step's conv on bf16 zxbcdt with a float32 conv weight and bias that bf16 cannot hold, in the arrays' own
    dtypes: the parameters enter the f32 sum as they are (as the full-sequence conv takes them), so y and the SSM
    state match the float64 reference of the float32 parameters within the step's bf16 roundings, and miss the
    reference of them rounded to bf16 by far more. The layer's window (the state's columns and the token) is
    constant per channel and the taps ~256 large sum to ~1, so the pre-activation is small against terms whose
    bf16 rounding would show."""
    case = MIXER_CASES["bf16"]
    arrays = mixer_inputs(case, seed=24)
    rng = np.random.default_rng(24)
    layer, xbc_offset = case.layer, case.layout()["xbc_offset"]
    xbc = arrays["zxbcdt"][:, xbc_offset:xbc_offset + case.conv_dim]
    arrays["conv_state"][layer] = xbc[:, :, None]
    taps = 256 * rng.standard_normal((case.d_conv - 1, case.conv_dim))
    last = -taps.sum(axis=0, keepdims=True) + rng.standard_normal((1, case.conv_dim))
    arrays["conv_weight"][layer] = np.concatenate([taps, last])
    rounded = {name: arrays[name].astype(ml_dtypes.bfloat16).astype(np.float32)
               for name in ("conv_weight", "conv_bias")}
    assert not any((rounded[name][layer] == arrays[name][layer]).any() for name in rounded)
    got = run_mixer(case, arrays, float64=False)
    want, other = mixer_oracle(case, arrays), mixer_oracle(case, {**arrays, **rounded})
    for name in ("y", "ssm_state"):
        error, rounded_error = rel_l2(got[name], want[name]), rel_l2(got[name], other[name])
        assert error < TOLERANCE[False]["bfloat16"] and 8 * error < rounded_error, (name, error, rounded_error)


@pytest.mark.parametrize("name", ["gate_in_step", "gated_norm_mixer"])
@pytest.mark.parametrize("block_p,heads", [(4, 1), (16, 1), (4, 2), (16, 4)])
def test_mixer_step_tiles_and_heads_per_block_leave_the_values(name, block_p, heads):
    """State tiles of BLOCK_P rows, and blocks running HEADS heads of a group one after the other (B's and C's conv
    shared), give the same step (the norm's sums of squares too: one per head and state tile either way)."""
    case = MIXER_CASES[name]
    arrays = mixer_inputs(case, seed=22)
    cfg = decode_mixer.MixerStepConfig(BLOCK_P=block_p, HEADS=heads)
    _assert_close(run_mixer(case, arrays, cfg), mixer_oracle(case, arrays), TOLERANCE[True])
    if heads == 1:
        return  # one head per block is what the rest compares against
    # The gated norm's input and its sums of squares (one per head and state tile): as one head per block gives.
    norm = dict(z_offset=None, norm_z_offset=0)
    got = run_mixer(case, arrays, cfg, **norm)
    want = run_mixer(case, arrays, decode_mixer.MixerStepConfig(BLOCK_P=block_p), **norm)
    assert decode_mixer.SUM_SQUARES_OUTPUT in got
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_mixer_step_heads_per_block_must_divide_a_group():
    case = MIXER_CASES["gate_in_step"]  # 8 heads in 2 groups
    dims = mixer_dims(case, mixer_inputs(case, seed=0))
    with pytest.raises(ValueError, match="HEADS=8 must divide the heads of a group"):
        decode_mixer.mixer_step_plan(dims, decode_mixer.MixerStepConfig(HEADS=8))
    with pytest.raises(ValueError, match="HEADS=3 must be a power of two"):
        decode_mixer.MixerStepConfig(HEADS=3)


@pytest.mark.parametrize("layer_view", [True, False])
@pytest.mark.parametrize("heads", [1, 4])
def test_the_int64_indexed_mixer_step_matches_float64_reference(monkeypatch, heads, layer_view):
    """The kernel a state stack past int32 offsets launches (decode_mixer.needs_int64_index), here forced at a
    small stack, with one or several heads per block, its layer's SSM state addressed through a view of its own
    (`views_the_layer_state`: one layer under 2^31 elements) or in the stack: the same values as the int32
    one's."""
    monkeypatch.setattr(decode_mixer, "needs_int64_index", lambda dims: True)
    if not layer_view:
        monkeypatch.setattr(decode_mixer, "views_the_layer_state", lambda dims: False)
    case = MIXER_CASES["gated_norm_mixer"]
    arrays = mixer_inputs(case, seed=23)
    dims = mixer_dims(case, arrays)
    cfg = decode_mixer.MixerStepConfig(HEADS=heads)
    launch = decode_mixer.mixer_step_plan(dims, cfg).launches[0]
    assert launch.kernel._annotated_function.pyfunc.__annotations__["ssm_state"] is ct.IndexedWithInt64
    assert launch.args[-2] is layer_view  # STATE_VIEW
    _assert_close(run_mixer(case, arrays, cfg), mixer_oracle(case, arrays), TOLERANCE[True])


def test_plans_are_well_formed():
    for name, case in PROJECTION_CASES.items():
        dims = _projection_dims(case, projection_inputs(case, seed=0))
        assert_plan_well_formed(decode_projection.norm_project_plan(dims))
    for case in MIXER_CASES.values():
        arrays = mixer_inputs(case, seed=0)
        dims = mixer_dims(case, arrays)
        assert_plan_well_formed(decode_mixer.mixer_step_plan(dims))


def test_unsupported_layouts_say_why():
    case = PROJECTION_CASES["add_norm_in_proj"]
    dims = _projection_dims(case, projection_inputs(case, seed=0))
    assert "multiples of 16" in decode_projection.projection_unsupported_reason(dataclasses.replace(dims, features=60))
    assert "come with the norm" in decode_projection.projection_unsupported_reason(
        dataclasses.replace(dims, has_norm=False))
    mixer = decode_mixer.MixerStepDims(rows=1, nheads=4, headdim=16, ngroups=1, dstate=16, in_width=200,
                                       xbc_offset=64, dt_offset=160)
    assert decode_mixer.mixer_step_unsupported_reason(mixer) is None
    assert "offset" in decode_mixer.mixer_step_unsupported_reason(dataclasses.replace(mixer, xbc_offset=72))
    assert "headdim=12" in decode_mixer.mixer_step_unsupported_reason(dataclasses.replace(mixer, headdim=12))
    with pytest.raises(ValueError, match="BLOCK_N=24"):
        decode_projection.ProjectionConfig(BLOCK_N=24)
    with pytest.raises(ValueError, match="SPLIT_K=3"):
        decode_projection.ProjectionConfig(SPLIT_K=3)
    with pytest.raises(TypeError, match="WEIGHT_FIRST=1 must be a bool"):
        decode_projection.ProjectionConfig(WEIGHT_FIRST=1)


def test_split_k_is_lowered_to_divide_the_k_steps():
    dims = decode_projection.ProjectionDims(rows=1, features=64, out_features=32)
    split = [decode_projection.split_k(dims, decode_projection.ProjectionConfig(BLOCK_K=16, SPLIT_K=s))
             for s in (1, 2, 4, 8)]
    assert split == [1, 2, 4, 4]  # 4 K steps
    odd = dataclasses.replace(dims, features=48)  # 3 K steps: no split runs the same steps
    plan = decode_projection.norm_project_plan(odd, decode_projection.ProjectionConfig(BLOCK_K=16, SPLIT_K=4))
    assert decode_projection.split_k(odd, decode_projection.ProjectionConfig(BLOCK_K=16, SPLIT_K=4)) == 1
    assert [kernel_name(launch.kernel) for launch in plan.launches] == ["decode_project_kernel"]
    # 4 K steps of 32 over 112 features: the last would end past K and the splits' pieces of K differ (the op's VJP
    # takes them equal), so no split; over 128 features they are equal
    config = decode_projection.ProjectionConfig(BLOCK_K=32, SPLIT_K=4)
    assert decode_projection.split_k(dataclasses.replace(dims, features=112), config) == 1
    assert decode_projection.split_k(dataclasses.replace(dims, features=128), config) == 4


def test_default_projection_config_splits_k_only_of_a_narrow_product_of_few_rows():
    """out_proj of the LM at d_model 1024 (2048 -> 1024) splits K in 8 over 64-column blocks at 1 and 8 rows, and
    with float32 weights in 4 up to 64 rows (64 columns up to 8, 32 above); in_proj (1024 -> 4384, 69 blocks of
    64), the head and bfloat16 at 64 rows keep one block per column block, in_proj with float32 weights at 33-64
    rows takes the weight as the first operand, a narrower float32 product two blocks of 32 rows."""
    def config(rows, features, out_features, weight_dtype="bfloat16"):
        return decode_projection.projection_default_config(decode_projection.ProjectionDims(
            rows=rows, features=features, out_features=out_features, weight_dtype=weight_dtype))

    assert config(1, 2048, 1024) == decode_projection.ProjectionConfig(BLOCK_N=64, BLOCK_K=128, SPLIT_K=8)
    assert config(8, 2048, 1024, "float32") == decode_projection.ProjectionConfig(BLOCK_N=64, BLOCK_K=64, SPLIT_K=4)
    assert config(1, 4096, 2048).SPLIT_K == 4  # 32 blocks of 64 (mamba2-1.3b's out_proj): four splits fit a wave
    assert config(1, 1536, 4000).SPLIT_K == 2  # 63 blocks of 64: two splits fit a wave, four do not
    for rows, features, out_features in ((1, 1024, 4384), (64, 2048, 1024), (1, 1024, 50280)):
        assert config(rows, features, out_features).SPLIT_K == 1
    # float32 weights split up to one block of rows: 32 blocks of 32 columns in 4, 64 blocks (d_model 2048) in 2
    assert config(64, 2048, 1024, "float32") == decode_projection.ProjectionConfig(BLOCK_N=32, BLOCK_K=128, SPLIT_K=4)
    assert config(16, 4096, 2048, "float32").SPLIT_K == 2
    for rows, features, out_features in ((64, 1024, 4384), (65, 2048, 1024), (256, 2048, 1024)):
        assert config(rows, features, out_features, "float32").SPLIT_K == 1
    # A wide float32 product of 33-64 rows: the weight first on one 64-row block, two blocks per SM (in_proj from
    # d_model 1024); a narrower one (mamba2-2.7b's out_proj, mamba2-130m's in_proj) two 32-row blocks per column
    weight_first = decode_projection.ProjectionConfig(BLOCK_N=64, BLOCK_K=64, OCCUPANCY=2, BLOCK_M=64,
                                                      WEIGHT_FIRST=True)
    for rows, features, out_features in ((64, 1024, 4384), (48, 1536, 6448), (64, 2048, 8512), (64, 2560, 10576)):
        assert config(rows, features, out_features, "float32") == weight_first
    halves = decode_projection.ProjectionConfig(BLOCK_N=64, BLOCK_K=128, BLOCK_M=32, OCCUPANCY=2)
    for rows, features, out_features in ((64, 5120, 2560), (40, 768, 3352)):
        assert config(rows, features, out_features, "float32") == halves
    for rows, features, out_features, dtype in ((32, 1024, 4384, "float32"), (64, 1024, 4384, "bfloat16"),
                                                (65, 1024, 4384, "float32"), (64, 1024, 50280, "float32")):
        assert config(rows, features, out_features, dtype).BLOCK_M is None  # the last: the tied head


def _gated_norm_after_mixer(case, arrays, *, norm_before_gate, group_size, mixer_cfg=None, projection_cfg=None,
                            out_features=40, float64=True, dependent=INDEPENDENT, z_pad=0):
    """The mixer step with the gated norm's gate (norm_z_offset), then out_proj normalizing its rows (the step's y:
    the norm's input, gated unless norm_before_gate, the product then reading the gate z_pad columns into its
    array) from the step's sums of squares (norm_parts), its launches built at DEPENDENT level `dependent`:
    (mixer outputs, the projection's out, its float64 oracle, the sums' oracle, the norm input's oracle)."""
    layout = dict(z_offset=None, norm_z_offset=0, norm_before_gate=norm_before_gate)
    mixed = run_mixer(case, arrays, mixer_cfg, float64=float64, **layout)
    parts = decode_mixer.sum_squares_parts(mixer_dims(case, arrays, **layout), mixer_cfg)
    assert mixed["sum_squares"].shape == (case.rows, parts)

    norm_input = mixed["y"].reshape(case.rows, case.d_ssm)
    assert norm_input.dtype == np.float32 or float64
    rng = np.random.default_rng(31)
    norm_weight = (1 + 0.5 * rng.standard_normal((case.layers, case.d_ssm))).astype(np.float32)
    weight = (rng.standard_normal((case.layers, case.d_ssm, out_features)) / np.sqrt(case.d_ssm)).astype(np.float32)
    projection = decode_projection.ProjectionDims(
        rows=case.rows, features=case.d_ssm, out_features=out_features, layers=case.layers,
        ngroups=case.d_ssm // group_size, group_size=group_size, has_norm=True,
        z_width=z_pad + case.in_width if norm_before_gate else 0, z_offset=z_pad, norm_before_gate=norm_before_gate,
        dtype="float32", out_dtype=case.dtype, weight_dtype="float32", z_dtype=case.dtype,
        norm_parts=parts // (case.d_ssm // group_size))
    assert decode_projection.projection_unsupported_reason(projection) is None
    plan = decode_projection.norm_project_plan(projection, projection_cfg)
    plan = dataclasses.replace(plan, launches=tuple(launch.dependent(dependent) for launch in plan.launches))
    assert "decode_norm_kernel" not in [kernel_name(launch.kernel) for launch in plan.launches]
    out = emulator.run_plan(plan, dict(
        layer_index=np.array([case.layer], np.int32), x=norm_input, residual=np.zeros((1, 1), np.float32),
        z=np.pad(arrays["zxbcdt"], ((0, 0), (z_pad, 0)), constant_values=np.nan) if norm_before_gate
        else np.zeros((1, 1), np.float32),
        norm_weight=norm_weight.reshape(case.layers, -1, group_size), weight=weight,
        bias=np.zeros((1, 1), np.float32), sum_squares=mixed["sum_squares"]), float64=float64)["out"]

    z = np.asarray(arrays["zxbcdt"], np.float64)[:, :case.d_ssm]
    y64 = mixer_oracle(case, arrays)["y"]
    gated = y64 if norm_before_gate else y64 * z / (1 + np.exp(-z))
    sums = (gated ** 2).reshape(case.rows, parts, -1).sum(axis=-1)
    with_weights = dict(x=y64, weight=weight[case.layer].astype(np.float64), z=z,
                        norm_weight=norm_weight[case.layer].astype(np.float64))
    want = projection_oracle(
        dataclasses.replace(PROJECTION_CASES["gated_norm_out_proj"], rows=case.rows, features=case.d_ssm,
                            out_features=out_features, layers=1, layer=0, group_size=group_size, z_offset=0,
                            gate="after" if norm_before_gate else "before"),
        {**{k: v[None] if k in ("weight", "norm_weight") else v for k, v in with_weights.items()},
         "residual": None, "bias": None,
         "z": np.concatenate([z, np.zeros((case.rows, 16))], axis=1)})["out"]
    return mixed, out, want, sums, gated


@pytest.mark.parametrize("float64", [True, False])
@pytest.mark.parametrize("nheads, norm_before_gate, group_size, mixer_cfg, projection_cfg", [
    (6, False, 48, None, None),  # 3 parts per group: gathered, not a tile
    (6, True, 96, None, None),  # one group of 6 parts: a tile padded with zeros
    (8, False, 64, None, None),
    (8, True, 128, None, None),
    (8, False, 128, decode_mixer.MixerStepConfig(BLOCK_P=4),
     decode_projection.ProjectionConfig(BLOCK_N=16, BLOCK_K=32, SPLIT_K=2)),
    (8, False, 32, decode_mixer.MixerStepConfig(BLOCK_P=8),
     decode_projection.ProjectionConfig(BLOCK_N=32, BLOCK_K=16, SPLIT_K=4)),
    (8, True, 64, None, decode_projection.ProjectionConfig(BLOCK_N=16, BLOCK_K=32, WEIGHT_FIRST=True))])
def test_the_mixer_s_sums_of_squares_let_out_proj_normalize_without_a_norm_launch(
        float64, nheads, norm_before_gate, group_size, mixer_cfg, projection_cfg):
    """The mixer step writes each block's sum of squares of its gated output (norm_z_offset); out_proj's product,
    given them (norm_parts), normalizes its rows as it loads them: the gated norm + out_proj of the reference
    without the norm's launch, at one and several groups, the gate before or after the norm, several pieces per
    head and K steps per group, and groups whose parts do not fill a tile; the last with the weight as the
    product's first operand."""
    case = dataclasses.replace(MIXER_CASES["gated_norm_mixer"], nheads=nheads)
    arrays = mixer_inputs(case, seed=32)
    mixed, out, want, sums, gated = _gated_norm_after_mixer(
        case, arrays, norm_before_gate=norm_before_gate, group_size=group_size, mixer_cfg=mixer_cfg,
        projection_cfg=projection_cfg, float64=float64)
    tolerance = TOLERANCE[True] if float64 else TOLERANCE[False][case.dtype]
    assert rel_l2(mixed["sum_squares"], sums) < tolerance
    assert rel_l2(mixed["y"].reshape(case.rows, -1), gated) < tolerance
    assert rel_l2(out, want) < tolerance
    _assert_close({k: mixed[k] for k in ("ssm_state", "new_conv_state")},
                  {k: v for k, v in mixer_oracle(case, arrays).items() if k != "y"}, tolerance)
