"""The decode ops' kernels on the GPU (run on the H200; skipped elsewhere): jax_mamba2.norm_project and mixer_step
with the "cutile" and "cutile_callback" backends against the float64 reference on fresh random inputs, at the test
cases and at the LM's decode shapes (24 stacked layers of d_model 1024, the tied 50280-row head, batches 1 to
256); and the LM's fused step over many tokens (the SSM state stack updated in place, launch after launch)
against the same model on xla.

    python -m pytest -m gpu tests/test_decode_ops_gpu.py
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_mamba2
from jax_mamba2 import backends, decode
from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel, generate
from tests._helpers import rel_l2
from tests.kernels._decode_checks import (MIXER_CASES, PROJECTION_CASES, MixerCase, ProjectionCase,
                                          assert_lm_steps_match, mixer_inputs, mixer_oracle, projection_inputs,
                                          projection_oracle)
from tests.test_decode_ops import project, step

pytestmark = pytest.mark.gpu

# float32 products run as TF32 on the kernels (as mamba_ssm's Triton); bf16 arrays round every output.
TOLERANCE = {"float32": 2e-3, "bfloat16": 2e-2}
LM_PROJECTIONS = {
    "in_proj_add_norm": ProjectionCase(rows=1, features=1024, out_features=4384, layers=24, layer=7, residual="add",
                                       dtype="bfloat16", weight_dtype="bfloat16"),
    "in_proj_first_block_b64": ProjectionCase(rows=64, features=1024, out_features=4384, layers=24, layer=0,
                                              residual="first", dtype="bfloat16", weight_dtype="bfloat16"),
    "out_proj_gated_b256": ProjectionCase(rows=256, features=2048, out_features=1024, layers=24, layer=23,
                                          gate="before", z_offset=0, dtype="bfloat16", weight_dtype="float32"),
    # float32 weights at 64 rows: the default splits out_proj's K in 4 (decode_projection.projection_default_config)
    "out_proj_gated_b64_f32_weights": ProjectionCase(rows=64, features=2048, out_features=1024, layers=24, layer=11,
                                                     gate="before", z_offset=0, dtype="bfloat16",
                                                     weight_dtype="float32"),
    # float32 weights at 48 rows: in_proj runs one 64-row block with the weight first (its last 16 rows padding)
    "in_proj_add_norm_b48_f32_weights": ProjectionCase(rows=48, features=1024, out_features=4384, layers=24, layer=9,
                                                       residual="add", dtype="bfloat16", weight_dtype="float32"),
    "tied_head_b8": ProjectionCase(rows=8, features=1024, out_features=50280, layers=1, layer=0, residual="add",
                                   transpose_weight=True, dtype="bfloat16", weight_dtype="bfloat16"),
}
LM_MIXERS = {
    "mixer_b1": MixerCase(rows=1, nheads=32, headdim=64, ngroups=1, dstate=128, layers=24, layer=5,
                          dtype="bfloat16", state_dtype="bfloat16"),
    "mixer_b64_f32_state": MixerCase(rows=64, nheads=32, headdim=64, ngroups=1, dstate=128, layers=4, layer=3,
                                     dtype="bfloat16", state_dtype="float32"),
}


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
@pytest.mark.parametrize("name", list(PROJECTION_CASES) + list(LM_PROJECTIONS))
def test_norm_project_matches_float64_reference(name, backend):
    case = {**PROJECTION_CASES, **LM_PROJECTIONS}[name]
    arrays = projection_inputs(case, seed=41)
    got = project(case, arrays, layer=case.layer, backend=backend)
    want = projection_oracle(case, arrays)
    errors = {k: rel_l2(got[k], want[k]) for k in want}
    assert max(errors.values()) < TOLERANCE[case.dtype], errors


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
@pytest.mark.parametrize("name", list(MIXER_CASES) + list(LM_MIXERS))
def test_mixer_step_matches_float64_reference(name, backend):
    case = {**MIXER_CASES, **LM_MIXERS}[name]
    arrays = mixer_inputs(case, seed=42)
    got = step(case, arrays, layer=case.layer, backend=backend)
    want = mixer_oracle(case, arrays)
    others = [i for i in range(case.layers) if i != case.layer]
    np.testing.assert_array_equal(np.asarray(got["ssm_state"])[others], arrays["ssm_state"][others])
    errors = {k: rel_l2(got[k], want[k]) for k in want}
    assert max(errors.values()) < TOLERANCE[case.dtype], errors


def test_mixer_step_indexes_a_state_stack_past_int32_with_64_bit_offsets():
    """mamba2-370m's SSM state stack at 256 rows has 3.2e9 elements: the step launches its int64-indexed kernel.
    Here a bf16 stack of 2^31 + 2^24 elements (4.3 GB), stepped at its last layer (offsets past 2^31), matches the
    float64 reference of that layer alone, and a layer below it keeps its state."""
    case = MixerCase(rows=64, nheads=32, headdim=64, ngroups=1, dstate=128, layers=1, layer=0, dtype="bfloat16",
                     state_dtype="bfloat16")
    arrays = mixer_inputs(case, seed=43)
    layers = (1 << 31) // (case.rows * case.nheads * case.headdim * case.dstate) + 1
    stacked = {k: None if v is None else jnp.concatenate([jnp.broadcast_to(jnp.asarray(v)[:1] * 0.5,
                                                                           (layers - 1, *v.shape[1:])),
                                                          jnp.asarray(v)])
               for k, v in arrays.items() if k != "zxbcdt"}
    assert stacked["ssm_state"].size > 1 << 31
    below = np.asarray(stacked["ssm_state"][layers - 2, :2])
    y, ssm_state, conv_state = jax_mamba2.mixer_step(
        jnp.asarray(arrays["zxbcdt"]), *(stacked[k] for k in ("conv_state", "ssm_state", "conv_weight", "conv_bias",
                                                              "A_log", "dt_bias", "D")),
        **case.layout(), layer=layers - 1, backend="cutile")
    want = mixer_oracle(case, arrays)
    got = {"y": y, "ssm_state": ssm_state[layers - 1:], "new_conv_state": conv_state[layers - 1]}
    np.testing.assert_array_equal(np.asarray(ssm_state[layers - 2, :2]), below)
    errors = {k: rel_l2(got[k], want[k]) for k in want}
    assert max(errors.values()) < TOLERANCE[case.dtype], errors


CONFIG = Mamba2Config(d_model=256, n_layer=4, vocab_size=512, pad_vocab_size_multiple=8,
                      ssm_cfg=dict(d_state=64, headdim=64, chunk_size=64))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_fused_decode_matches_xla_over_many_tokens(scan_layers):
    """float32 parameters, 48 greedy tokens: each token of the fused cuTile step is the argmax of the uncached
    xla forward (up to the products' TF32 rounding), and fed the same tokens, the fused step's logits and final
    decode state match the xla step's (an in-place update that lost a write or raced would drift)."""
    models = {b: Mamba2LMHeadModel(CONFIG, backend=b, scan_layers=scan_layers, rngs=nnx.Rngs(0))
              for b in ("cutile", "xla")}
    prompt_len = 20
    prompt = jax.random.randint(jax.random.key(3), (3, prompt_len), 0, CONFIG.vocab_size)
    tokens = generate(models["cutile"], prompt, 48)
    logits = nnx.jit(lambda m, ids: m(ids))(models["xla"], tokens[:, :-1])[:, prompt_len - 1:, :CONFIG.vocab_size]
    chosen = jnp.take_along_axis(logits, tokens[:, prompt_len:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(chosen, logits.max(axis=-1), rtol=0, atol=2e-3 * float(jnp.abs(logits).max()))

    assert_lm_steps_match(models, {b: m.prefill(prompt)[1] for b, m in models.items()}, tokens[:, prompt_len:].T,
                          2e-3, donate=True)


def _cutile_decode_configs(**configs):
    """backend="cutile" of the decode ops with the tiles that `configs` (decode_ops.make_kernels' config functions)
    choose, inside the block."""
    from jax_mamba2.bridge import decode_ops, ffi  # needs cuda.tile: imported where the tests run

    return backends.kernels_replaced(decode.OP, "cutile", decode_ops.make_kernels(ffi.run_plan, **configs))


def _assert_close(got, want, dtype):
    errors = {k: rel_l2(got[k], want[k]) for k in want}
    assert max(errors.values()) < TOLERANCE[dtype], errors


@pytest.mark.parametrize("split_k", [2, 4])
@pytest.mark.parametrize("name", ["in_proj_add_norm", "out_proj_gated_b256"])
def test_norm_project_with_split_k_matches_float64_reference(name, split_k):
    """K split over blocks (f32 partials summed by a second launch) at the LM's shapes."""
    from jax_mamba2.kernels import decode_projection

    case = LM_PROJECTIONS[name]
    arrays = projection_inputs(case, seed=43)
    config = decode_projection.ProjectionConfig(BLOCK_N=64, SPLIT_K=split_k)
    with _cutile_decode_configs(projection_config=lambda dims: config):
        got = project(case, arrays, layer=case.layer, backend="cutile")
    _assert_close(got, projection_oracle(case, arrays), case.dtype)


@pytest.mark.parametrize("name", ["in_proj_add_norm_b48_f32_weights", "out_proj_gated_b64_f32_weights",
                                  "in_proj_first_block_b64"])
def test_norm_project_with_the_weight_first_matches_float64_reference(name):
    """The product taken with the weight as the tensor cores' first operand (WEIGHT_FIRST: wgmma on 64-row blocks,
    float32 weights rounded in registers) at the LM's shapes: float32 weights at 48 rows (a partial block) and at
    64 with the gate, bf16 weights at 64 rows of the first block."""
    from jax_mamba2.kernels import decode_projection

    case = LM_PROJECTIONS[name]
    arrays = projection_inputs(case, seed=45)
    config = decode_projection.ProjectionConfig(BLOCK_N=64, LATENCY=2, OCCUPANCY=2, BLOCK_M=64, WEIGHT_FIRST=True)
    with _cutile_decode_configs(projection_config=lambda dims: config):
        got = project(case, arrays, layer=case.layer, backend="cutile")
    _assert_close(got, projection_oracle(case, arrays), case.dtype)


@pytest.mark.parametrize("heads", [2, 4, 8])
@pytest.mark.parametrize("name", ["mixer_b64_f32_state", "mixer_b256"])
def test_mixer_step_with_several_heads_per_block_matches_float64_reference(name, heads):
    """Blocks of HEADS heads one after the other (their group's B and C convolved once) at the LM's shapes."""
    from jax_mamba2.kernels import decode_mixer

    case = {**LM_MIXERS, "mixer_b256": dataclasses.replace(LM_MIXERS["mixer_b1"], rows=256, layers=3, layer=2)}[name]
    arrays = mixer_inputs(case, seed=44)
    with _cutile_decode_configs(mixer_config=lambda dims: dataclasses.replace(
            decode_mixer.mixer_step_default_config(dims), HEADS=heads)):
        got = step(case, arrays, layer=case.layer, backend="cutile")
    _assert_close(got, mixer_oracle(case, arrays), case.dtype)
