"""kernels/causal_conv1d*.py block by block on the NumPy emulator (tests/kernels/_cutile_emulator.py), against the
float64 reference on fresh random inputs: in float64 (the algebra, index math, halos, masks and partials to
~1e-13) and in the kernels' own dtypes (bf16 / f32 rounding)."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("cuda.tile")

from jax_mamba2.kernels import causal_conv1d as conv_fwd  # noqa: E402
from jax_mamba2.kernels import causal_conv1d_bwd as conv_bwd  # noqa: E402
from tests._helpers import rel_l2  # noqa: E402
from tests.kernels import _cutile_emulator as emulator  # noqa: E402
from tests.kernels._conv_checks import float64_reference, make_conv_args  # noqa: E402
from tests.kernels._plan_checks import assert_plan_well_formed  # noqa: E402

# Small tiles so that short sequences span several blocks, segments and steps: 4-token steps, 3 per segment.
SMALL_BWD = conv_bwd.ConvBwdConfig(BLOCK_L=4, SEGMENT_TILES=3, BLOCK_C=16, REDUCE_BLOCK_C=16)
SMALL_FWD = conv_fwd.ConvFwdConfig(BLOCK_L=4, BLOCK_C=16)


def _dims(x, kernel, init, seq_idx, silu=True):
    batch, seqlen, channels = x.shape
    return conv_fwd.ConvDims(batch=batch, seqlen=seqlen, channels=channels, width=kernel.shape[0],
                             dtype=jnp.dtype(x.dtype).name, init_width=0 if init is None else init.shape[-1],
                             has_seq_idx=seq_idx is not None, silu=silu)


def _plan_inputs(x, kernel, bias, init, seq_idx, dy=None):
    """What the bridge passes (bridge/conv_ops.py `_kernel_arrays`), as NumPy arrays."""
    arrays = dict(
        x=x, weight=kernel.astype(x.dtype), bias=jnp.zeros(x.shape[-1:], x.dtype) if bias is None else bias,
        initial_states=jnp.zeros((1, 1, 1), x.dtype) if init is None else init,
        seq_idx=jnp.zeros((1, 1), jnp.int32) if seq_idx is None else seq_idx)
    if dy is not None:
        arrays["dy"] = dy
    return {name: np.asarray(a) for name, a in arrays.items()}


def _run(args, *, float64, silu=True, fwd_cfg=SMALL_FWD, bwd_cfg=SMALL_BWD, items=1):
    x, kernel, bias, init, seq_idx, dy = args
    dims = _dims(x, kernel, init, seq_idx, silu)
    fwd_plan = conv_fwd.conv_fwd_plan(dims, fwd_cfg)
    bwd_plan = conv_bwd.conv_bwd_plan(dims, bwd_cfg, items=items)
    assert_plan_well_formed(fwd_plan)
    assert_plan_well_formed(bwd_plan)
    y = emulator.run_plan(fwd_plan, _plan_inputs(*args[:5]), float64=float64)["y"]
    out = emulator.run_plan(bwd_plan, _plan_inputs(*args), float64=float64)
    return y, out


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


@pytest.mark.parametrize("case", list(CASES))
def test_conv_kernels_match_float64_reference_in_float64(case):
    args = make_conv_args(1, **CASES[case])
    errors = _errors(args, *_run(args, float64=True))
    assert max(errors.values()) < 1e-12, errors


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


def test_conv_kernels_at_default_tiles_match_float64_reference():
    """The default configs (16-token rows, 256-token segments, up to 512 / 256 channels): an odd seqlen
    spanning two segments with a partial last step, 600 channels (2 forward, 3 backward channel blocks)."""
    args = make_conv_args(4, batch=1, seqlen=301, channels=600, seq_idx=[255, 46])
    dims = _dims(*(args[i] for i in (0, 1, 3, 4)))
    errors = _errors(args, *_run(args, float64=True, fwd_cfg=conv_fwd.conv_fwd_default_config(dims),
                                 bwd_cfg=conv_bwd.conv_bwd_default_config(dims)))
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
    """Channel tiles narrow to the channels; the backward's segments shorten until the grid has MIN_BLOCKS
    blocks (the layer's 256 [B, C] channels at (8, 2048): 64 tokens), and stay at 256 tokens for the LM's x."""
    narrow = conv_fwd.ConvDims(batch=1, seqlen=8, channels=40, width=4)
    assert conv_fwd.conv_fwd_default_config(narrow).BLOCK_C == 64
    lm = conv_fwd.ConvDims(batch=8, seqlen=2048, channels=2304, width=4)
    assert conv_fwd.conv_fwd_default_config(lm).BLOCK_C == 512
    lm_cfg = conv_bwd.conv_bwd_default_config(lm)
    assert (lm_cfg.BLOCK_C, lm_cfg.segment) == (256, 256)
    bc = dataclasses.replace(lm, channels=256)
    cfg = conv_bwd.conv_bwd_default_config(bc)
    assert cfg.segment == 64 and np.prod(conv_bwd.conv_bwd_grid(bc, cfg)) == conv_bwd.MIN_BLOCKS
    assert conv_bwd.conv_bwd_default_config(dataclasses.replace(lm, has_seq_idx=True)).BLOCK_L == 8


@pytest.mark.parametrize("cfg,message", [
    (dataclasses.replace(SMALL_BWD, BLOCK_L=2), "BLOCK_L=2 must be at least width - 1=3"),
    (dataclasses.replace(SMALL_BWD, BLOCK_C=24), "BLOCK_C=24 must be a power of two"),
])
def test_conv_backward_plan_rejects_invalid_tiles(cfg, message):
    dims = conv_fwd.ConvDims(batch=1, seqlen=8, channels=16, width=4)
    with pytest.raises(ValueError, match=message):
        conv_bwd.conv_bwd_plan(dims, cfg)
