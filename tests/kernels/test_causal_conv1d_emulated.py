"""kernels/causal_conv1d*.py block by block on the NumPy emulator (tests/kernels/_cutile_emulator.py), against the
float64 reference on fresh random inputs: in float64 (the algebra, index math, halos, masks and partials to
~1e-13) and in the kernels' own dtypes (bf16 / f32 rounding); also with the mixer's layout (the channels read
at an offset of a wider input, the outputs and their cotangents in pieces)."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("cuda.tile")

from jax_mamba2.kernels import causal_conv1d as conv_fwd  # noqa: E402
from jax_mamba2.kernels import causal_conv1d_bwd as conv_bwd  # noqa: E402
from tests._helpers import rel_l2  # noqa: E402
from tests.kernels import _cutile_emulator as emulator  # noqa: E402
from tests.kernels._conv_checks import (float64_reference, make_cancelling_args, make_conv_args,  # noqa: E402
                                        rounding_errors)
from tests.kernels._plan_checks import assert_plan_well_formed  # noqa: E402

# Small tiles so that short sequences span several blocks, segments and steps: 4-token steps, 3 per segment.
SMALL_BWD = conv_bwd.ConvBwdConfig(BLOCK_L=4, SEGMENT_TILES=3, BLOCK_C=16, REDUCE_BLOCK_C=16)
SMALL_FWD = conv_fwd.ConvFwdConfig(BLOCK_L=4, BLOCK_C=16)
# The forward walking segments of 3 steps: the 37-token sequences end mid-segment and mid-step, the halo carried
# across steps, the last step's prefetch past seqlen.
SMALL_SEGMENTED_FWD = dataclasses.replace(SMALL_FWD, SEGMENT_TILES=3)
FWD_CONFIGS = {"tiles": SMALL_FWD, "segments": SMALL_SEGMENTED_FWD}


def _dims(x, kernel, init, seq_idx, silu=True, layout=None):
    batch, seqlen, channels = x.shape
    in_offset, in_width, split = layout or (0, 0, ())
    return conv_fwd.ConvDims(batch=batch, seqlen=seqlen, channels=channels, width=kernel.shape[0],
                             dtype=jnp.dtype(x.dtype).name, init_width=0 if init is None else init.shape[-1],
                             has_seq_idx=seq_idx is not None, silu=silu, in_offset=in_offset, in_width=in_width,
                             split=split)


def _pieces(a, dims):
    """`a` (batch, seqlen, channels) split like the outputs, with the dummies past them."""
    pieces = np.split(np.asarray(a), np.cumsum(dims.pieces)[:-1], axis=-1)
    return pieces + [np.zeros((1, 1, 1), a.dtype)] * (conv_fwd.MAX_OUTPUTS - len(pieces))


def _source(x, dims, seed=11):
    """x inside random channels of dims.source_width at dims.in_offset (what the kernels must not read)."""
    if dims.source_width == dims.channels:
        return np.asarray(x)
    wide = np.random.default_rng(seed).standard_normal(x.shape[:2] + (dims.source_width,)).astype(x.dtype)
    wide[..., dims.in_offset:dims.in_offset + dims.channels] = np.asarray(x)
    return wide


def _plan_inputs(dims, x, kernel, bias, init, seq_idx, dy=None):
    """What the bridge passes (bridge/conv_ops.py `_kernel_arrays`), as NumPy arrays."""
    arrays = dict(
        x=_source(x, dims), weight=kernel.astype(jnp.float32),
        bias=jnp.zeros(x.shape[-1:], jnp.float32) if bias is None else bias.astype(jnp.float32),
        initial_states=jnp.zeros((1, 1, 1), x.dtype) if init is None else init,
        seq_idx=jnp.zeros((1, 1), jnp.int32) if seq_idx is None else seq_idx)
    if dy is not None:
        arrays.update(zip(conv_bwd.COTANGENTS, _pieces(dy, dims)))
        arrays.update({name: np.zeros(buf.shape, x.dtype)
                       for name, buf in conv_bwd.passed_cotangent_arrays(dims).items()})
    return {name: np.asarray(a) for name, a in arrays.items()}


def _run(args, *, float64, silu=True, fwd_cfg=SMALL_FWD, bwd_cfg=SMALL_BWD, items=1, layout=None):
    """(y, the backward's outputs) of the plans: y is the outputs' pieces concatenated."""
    x, kernel, bias, init, seq_idx, dy = args
    dims = _dims(x, kernel, init, seq_idx, silu, layout)
    fwd_plan = conv_fwd.conv_fwd_plan(dims, fwd_cfg)
    bwd_plan = conv_bwd.conv_bwd_plan(dims, bwd_cfg, items=items)
    assert_plan_well_formed(fwd_plan)
    assert_plan_well_formed(bwd_plan)
    out = emulator.run_plan(fwd_plan, _plan_inputs(dims, *args[:5]), float64=float64)
    assert fwd_plan.outputs == conv_fwd.CONV_OUTPUTS[:len(dims.pieces)]
    for name, width in zip(fwd_plan.outputs, dims.pieces):
        assert out[name].shape == x.shape[:2] + (width,), name
    y = np.concatenate([out[name] for name in fwd_plan.outputs], axis=-1)
    return y, emulator.run_plan(bwd_plan, _plan_inputs(dims, *args), float64=float64)


def _errors(args, y, out, silu=True):
    want_y, (dx, dkernel, dbias, dinit) = float64_reference(*args, silu=silu)
    errors = {"y": rel_l2(y, want_y), "dx": rel_l2(out["dx"], dx), "dkernel": rel_l2(out["dweight"][0], dkernel)}
    if dbias is not None:
        errors["dbias"] = rel_l2(out["dbias"][0], dbias)
    if dinit is not None:
        errors["dinit"] = rel_l2(out["dinitial_states"], dinit)
    return errors


CASES = {
    "plain": dict(),
    "no_bias": dict(bias=False),
    "seq_idx": dict(seq_idx=[5, 1, 12, 19]),      # a 1-token sequence, boundaries inside and across steps
    "init_dconv_minus_1": dict(init_width=3),
    "init_dconv": dict(init_width=4),
    "width_2": dict(d_conv=2),
    "width_3_seq_idx": dict(d_conv=3, seq_idx=[20, 17]),
    "width_1": dict(d_conv=1),
    "channels_3_blocks": dict(channels=37),     # 3 channel blocks of 16, the last one partial
    "seqlen_shorter_than_halo": dict(seqlen=2, init_width=3),
}


@pytest.mark.parametrize("fwd", list(FWD_CONFIGS))
@pytest.mark.parametrize("case", list(CASES))
def test_conv_kernels_match_float64_reference_in_float64(case, fwd):
    args = make_conv_args(1, **CASES[case])
    errors = _errors(args, *_run(args, float64=True, fwd_cfg=FWD_CONFIGS[fwd]))
    assert max(errors.values()) < 1e-12, errors


# (in_offset, in_width, split) with the small tiles' 16 channels per block: x inside a wider input (in_proj's
# [z, xBC, dt]) and written as pieces, blocks straddling one or two splits, a piece narrower than a block,
# a piece ending mid-block and the input ending with the conv's channels.
LAYOUTS = {
    "mixer": (24, 80, (24, 8, 8)),
    "two_pieces_unaligned_offset": (5, 50, (19, 21)),
    "one_piece_at_the_end": (10, 50, ()),
    "three_pieces_in_one_block": (0, 40, (3, 2, 35)),
}


@pytest.mark.parametrize("fwd", list(FWD_CONFIGS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", ["plain", "seq_idx", "init_dconv"])
def test_conv_kernels_in_the_mixer_layout_match_float64_reference(layout, case, fwd):
    args = make_conv_args(6, **CASES[case])
    errors = _errors(args, *_run(args, float64=True, layout=LAYOUTS[layout], fwd_cfg=FWD_CONFIGS[fwd]))
    assert max(errors.values()) < 1e-12, errors


# The LM's layout scaled down, at the default tiles: 1024 channels before the window (one copy block) and 16
# after it (a copy block mostly outside dt).
# The LM's layout scaled down: (conv options, channel layout).
_LM_SCALED = (dict(batch=1, seqlen=40, channels=1280, seq_idx=[25, 15]), (1024, 1024 + 1280 + 16, (1024, 128, 128)))
# (conv options, channel layout, forward tiles: a FWD_CONFIGS key, or None for both defaults)
PASS_THROUGH_CASES = {
    **{name: (CASES["seq_idx"], layout, "tiles") for name, layout in LAYOUTS.items()},
    "mixer_segmented_forward": (CASES["seq_idx"], LAYOUTS["mixer"], "segments"),
    "lm_scaled_default_tiles": (*_LM_SCALED, None),
}


@pytest.mark.parametrize("layout", list(PASS_THROUGH_CASES))
def test_conv_kernels_pass_the_other_channels_through(layout):
    """With pass_through the forward also copies x's channels before and after the window to their own arrays,
    and the backward's dx is x's whole cotangent: the conv's dx in the window and the given cotangents of the
    channels before and after it, copies bit for bit (one side is absent in two of the layouts)."""
    options, channel_layout, fwd = PASS_THROUGH_CASES[layout]
    args = make_conv_args(8, **options)
    x, kernel, bias, init, seq_idx, dy = args
    dims = dataclasses.replace(_dims(x, kernel, init, seq_idx, layout=channel_layout), pass_through=True)
    if fwd is None:
        fwd_cfg, bwd_cfg = conv_fwd.conv_fwd_default_config(dims), conv_bwd.conv_bwd_default_config(dims)
    else:
        fwd_cfg, bwd_cfg = FWD_CONFIGS[fwd], SMALL_BWD
    before, after = dims.outside_widths
    fwd_plan = conv_fwd.conv_fwd_plan(dims, fwd_cfg)
    assert_plan_well_formed(fwd_plan)
    inputs = _plan_inputs(dims, *args)
    out = emulator.run_plan(fwd_plan, inputs, float64=True)
    assert fwd_plan.outputs == conv_fwd.CONV_OUTPUTS[:len(dims.pieces)] + (("before",) if before else ()) + (
        ("after",) if after else ())
    if before:
        np.testing.assert_array_equal(out["before"], inputs["x"][..., :before])
    if after:
        np.testing.assert_array_equal(out["after"], inputs["x"][..., before + dims.channels:])
    want_y, (want_dx, want_dkernel, want_dbias, _) = float64_reference(*args)
    y = np.concatenate([out[name] for name in conv_fwd.CONV_OUTPUTS[:len(dims.pieces)]], axis=-1)
    assert rel_l2(y, want_y) < 1e-12

    rng = np.random.default_rng(9)
    passed = {name: (rng.standard_normal(buf.shape).astype(np.float64) if buf.shape != (1, 1, 1)
                     else np.zeros((1, 1, 1)))
              for name, buf in conv_bwd.passed_cotangent_arrays(dims).items()}
    plan = conv_bwd.conv_bwd_plan(dims, bwd_cfg)
    assert_plan_well_formed(plan)
    out = emulator.run_plan(plan, {**inputs, **passed}, float64=True)
    assert out["dx"].shape == x.shape[:2] + (dims.source_width,)
    if before:
        np.testing.assert_array_equal(out["dx"][..., :before], passed["dbefore"])
    if after:
        np.testing.assert_array_equal(out["dx"][..., before + dims.channels:], passed["dafter"])
    assert rel_l2(out["dx"][..., before:before + dims.channels], want_dx) < 1e-12
    assert rel_l2(out["dweight"][0], want_dkernel) < 1e-12 and rel_l2(out["dbias"][0], want_dbias) < 1e-12


def test_conv_weight_partials_reduce_in_tiles_that_stay_within_an_item():
    assert [conv_bwd.reduce_part_tile(n) for n in (64, 48, 12, 3, 1)] == [16, 16, 4, 1, 1]


def test_conv_kernels_in_the_mixer_layout_at_default_tiles_match_float64_reference():
    """The LM's layout scaled down: [z, x, B, C, dt] with x of 1024 channels and B, C of 128 (the default
    512-channel forward block and 256-channel backward block straddle B and C)."""
    args = make_conv_args(7, **_LM_SCALED[0])
    layout = _LM_SCALED[1]
    dims = _dims(*(args[i] for i in (0, 1, 3, 4)), layout=layout)
    errors = _errors(args, *_run(args, float64=True, fwd_cfg=conv_fwd.conv_fwd_default_config(dims),
                                 bwd_cfg=conv_bwd.conv_bwd_default_config(dims), layout=layout))
    assert max(errors.values()) < 1e-12, errors


@pytest.mark.parametrize("layout,message", [
    ((30, 60, ()), "in_offset=30 . channels=40 must be within in_width=60"),
    ((0, 0, (20, 10)), r"split=\(20, 10\) must be 1 to 3 positive widths summing to channels=40"),
    ((0, 0, (10, 10, 10, 10)), "must be 1 to 3 positive widths"),
])
def test_conv_plans_reject_a_layout_that_does_not_fit(layout, message):
    dims = conv_fwd.ConvDims(batch=1, seqlen=8, channels=40, width=4, in_offset=layout[0], in_width=layout[1],
                             split=layout[2])
    for plan in (conv_fwd.conv_fwd_plan, conv_bwd.conv_bwd_plan):
        with pytest.raises(ValueError, match=message):
            plan(dims)


@pytest.mark.parametrize("silu", [True, False], ids=["silu", "no_activation"])
def test_conv_kernels_without_activation_match_float64_reference(silu):
    args = make_conv_args(2, seq_idx=[30, 7])
    errors = _errors(args, *_run(args, float64=True, silu=silu), silu=silu)
    assert max(errors.values()) < 1e-12, errors


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-6), (jnp.bfloat16, 5e-3)], ids=["f32", "bf16"])
def test_conv_kernels_in_their_dtype_match_float64_reference(dtype, tolerance):
    """The kernels' own rounding: f32 accumulation, one rounding of y / dx to x's dtype (the reference rounds
    the pre-activation first, so bf16 differs by ~its ulp)."""
    args = make_conv_args(3, dtype=dtype, init_width=4)
    errors = _errors(args, *_run(args, float64=False))
    assert max(errors.values()) < tolerance, errors


@pytest.mark.parametrize("layout", [None, "mixer"])
def test_conv_kernels_take_float32_parameters_with_bfloat16_x(layout):
    """The plans declare the weight and bias float32 whatever x's dtype (`conv_arrays`, what the bridge passes):
    run in their own dtypes on bf16 x with a float32 kernel and bias that bf16 cannot hold, the sums take the
    parameters unrounded, so y and every gradient match the float64 reference of the float32 parameters within
    bf16's rounding of the outputs and miss that of them rounded to bf16 by far more (`make_cancelling_args`),
    also in the mixer's layout (an offset into a wider x, the outputs in pieces)."""
    args = make_cancelling_args(52, channels=40)
    x, kernel, _, init, seq_idx, _ = args
    declared = conv_fwd.conv_arrays(_dims(x, kernel, init, seq_idx, layout=LAYOUTS.get(layout)))
    assert declared["x"].dtype == "bfloat16" and declared["weight"].dtype == declared["bias"].dtype == "float32"
    y, out = _run(args, float64=False, layout=LAYOUTS.get(layout))
    errors = rounding_errors((y, out["dx"], out["dweight"][0], out["dbias"][0], out["dinitial_states"]), args)
    for name, (error, rounded_error) in errors.items():
        assert error < 2e-2 and 8 * error < rounded_error, (name, errors)


@pytest.mark.parametrize("min_blocks", [1, conv_fwd.MIN_BLOCKS])
def test_conv_kernels_at_default_tiles_match_float64_reference(min_blocks, monkeypatch):
    """The default configs at an odd seqlen with a partial last step, 600 channels (2 forward, 5 backward channel
    blocks): with MIN_BLOCKS lowered to 1, the segments of a large grid (the forward's 16 steps of 8 tokens over
    three segments, the backward's 32 over two); as it is, this small grid's one tile per block forward."""
    monkeypatch.setattr(conv_fwd, "MIN_BLOCKS", min_blocks)
    args = make_conv_args(4, batch=1, seqlen=301, channels=600, seq_idx=[255, 46])
    dims = _dims(*(args[i] for i in (0, 1, 3, 4)))
    fwd_cfg, bwd_cfg = conv_fwd.conv_fwd_default_config(dims), conv_bwd.conv_bwd_default_config(dims)
    segmented = min_blocks == 1
    assert (fwd_cfg.SEGMENT_TILES, fwd_cfg.BLOCK_L) == ((16, 8) if segmented else (1, 16)), fwd_cfg
    assert bwd_cfg.SEGMENT_TILES == (32 if segmented else 1), bwd_cfg
    errors = _errors(args, *_run(args, float64=True, fwd_cfg=fwd_cfg, bwd_cfg=bwd_cfg))
    assert max(errors.values()) < 1e-12, errors


def test_conv_backward_sums_weight_gradients_per_item():
    """items=2 (vmap folds its axis into the batch): item i's dweight / dbias sum only its batch rows."""
    args = make_conv_args(5, batch=4)
    x, kernel, bias, _, _, dy = args
    _, out = _run(args, float64=True, items=2)
    for item in range(2):
        rows = slice(2 * item, 2 * item + 2)
        _, (_, dkernel, dbias, _) = float64_reference(x[rows], kernel, bias, None, None, dy[rows])
        assert rel_l2(out["dweight"][item], dkernel) < 1e-12
        assert rel_l2(out["dbias"][item], dbias) < 1e-12


def test_conv_backward_plan_rejects_items_not_dividing_batch():
    dims = conv_fwd.ConvDims(batch=3, seqlen=8, channels=16, width=4)
    with pytest.raises(ValueError, match="items=2 must divide batch=3"):
        conv_bwd.conv_bwd_plan(dims, items=2)


def test_conv_default_configs_fit_the_problem():
    """Channel tiles narrow to the channels; both passes' segments shorten until the grid has MIN_BLOCKS blocks
    (the layer's 256 [B, C] channels at (8, 2048): 128 tokens backward, 64 forward; one tile for a short
    sequence), and stay at 256 / 128 tokens for the LM's x."""
    narrow = conv_fwd.ConvDims(batch=1, seqlen=8, channels=40, width=4)
    narrow_fwd = conv_fwd.conv_fwd_default_config(narrow)  # one tile per block: 16 rows at occupancy 3
    assert (narrow_fwd.BLOCK_L, narrow_fwd.BLOCK_C, narrow_fwd.SEGMENT_TILES, narrow_fwd.OCCUPANCY) == (16, 64, 1, 3)
    lm = conv_fwd.ConvDims(batch=8, seqlen=2048, channels=2304, width=4)
    lm_fwd = conv_fwd.conv_fwd_default_config(lm)
    assert (lm_fwd.BLOCK_L, lm_fwd.BLOCK_C, lm_fwd.SEGMENT_TILES, lm_fwd.OCCUPANCY) == (8, 512, 16, 4)
    lm_cfg = conv_bwd.conv_bwd_default_config(lm)
    assert (lm_cfg.BLOCK_L, lm_cfg.BLOCK_C, lm_cfg.segment, lm_cfg.OCCUPANCY) == (8, 128, 256, 4)
    bc = dataclasses.replace(lm, channels=256)
    cfg = conv_bwd.conv_bwd_default_config(bc)
    assert cfg.segment == 128 and np.prod(conv_bwd.conv_bwd_grid(bc, cfg)) == conv_fwd.MIN_BLOCKS
    fwd_cfg = conv_fwd.conv_fwd_default_config(bc)
    assert fwd_cfg.SEGMENT_TILES == 8 and np.prod(conv_fwd.conv_fwd_grid(bc, fwd_cfg)) == conv_fwd.MIN_BLOCKS


@pytest.mark.parametrize("cfg,message", [
    (dataclasses.replace(SMALL_BWD, BLOCK_L=2), "BLOCK_L=2 must be at least width - 1=3"),
])
def test_conv_backward_plan_rejects_invalid_tiles(cfg, message):
    dims = conv_fwd.ConvDims(batch=1, seqlen=8, channels=16, width=4)
    with pytest.raises(ValueError, match=message):
        conv_bwd.conv_bwd_plan(dims, cfg)


@pytest.mark.parametrize("config", [conv_fwd.ConvFwdConfig, conv_bwd.ConvBwdConfig])
def test_conv_configs_name_the_field_that_is_not_a_positive_int_or_power_of_two(config):
    fields = {"BLOCK_L": 8, "BLOCK_C": 64, "OCCUPANCY": 2, "SEGMENT_TILES": 4}
    if config is conv_bwd.ConvBwdConfig:
        fields["REDUCE_BLOCK_C"] = 32
    name = config.__name__
    with pytest.raises(TypeError, match=rf"{name}: SEGMENT_TILES=2.0 must be an int"):
        config(**{**fields, "SEGMENT_TILES": 2.0})
    with pytest.raises(TypeError, match=rf"{name}: OCCUPANCY=True must be an int"):
        config(**{**fields, "OCCUPANCY": True})
    with pytest.raises(ValueError, match=rf"{name}: BLOCK_L=0 must be at least 1"):
        config(**{**fields, "BLOCK_L": 0})
    with pytest.raises(ValueError, match=rf"{name}: BLOCK_C=24 must be a power of two"):
        config(**{**fields, "BLOCK_C": 24})
    if config is conv_bwd.ConvBwdConfig:
        with pytest.raises(ValueError, match=r"ConvBwdConfig: REDUCE_BLOCK_C=48 must be a power of two"):
            config(**{**fields, "REDUCE_BLOCK_C": 48})
    assert type(config(**{**fields, "BLOCK_L": np.int64(8)}).BLOCK_L) is int  # a NumPy integer is stored as an int
