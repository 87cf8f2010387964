"""The decode ops' kernel path end to end on the CPU: jax_mamba2.norm_project / mixer_step with backend="cutile",
whose plans (bridge/decode_ops.py) run block by block on the NumPy emulator in float64 through jax.pure_callback
(the mixer step also in the arrays' own dtypes, against the float64 reference).
Checked against the xla path, with gradients (the reference's VJP), vmap (rows folded into one launch), jit, and
inside the layers: `Mamba2.step` and the LM's fused step over several tokens (the SSM state stack threaded
through every layer's launch) against the same models on xla, and `generate` with every op of the LM emulated."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("cuda.tile")

import jax_mamba2  # noqa: E402
from jax_mamba2 import backends, conv1d, decode, decode_reference, norm  # noqa: E402
from jax_mamba2.bridge import conv_ops, decode_ops, norm_ops  # noqa: E402
from jax_mamba2.flax_layers import Mamba2, Mamba2Config, Mamba2LMHeadModel, generate  # noqa: E402
from jax_mamba2.kernels import decode_mixer, decode_projection  # noqa: E402
from tests._helpers import rel_l2  # noqa: E402
from tests.bridge._emulated_backend import EMULATED, emulate_layer_kernels  # noqa: E402
from tests.kernels import _cutile_emulator as emulator  # noqa: E402
from tests.kernels._decode_checks import (MIXER_CASES, PROJECTION_CASES, assert_lm_steps_match,  # noqa: E402
                                          mixer_inputs, mixer_oracle, projection_inputs)
from tests.test_decode_ops import gated_norm_chain, project, step  # noqa: E402

# The arrays between the plans and XLA are in their own dtypes (the emulated kernels compute in float64).
TOLERANCE = {"float32": 2e-6, "bfloat16": 1e-2}


@pytest.fixture(autouse=True)
def emulated_kernels(monkeypatch):
    """backend="cutile" runs the emulated plans, as if on a GPU."""
    emulate_layer_kernels(monkeypatch, decode.OP, decode_ops)


def _callbacks(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("pure_callback")


@pytest.mark.parametrize("name", list(PROJECTION_CASES))
def test_emulated_norm_project_matches_xla(name):
    case = PROJECTION_CASES[name]
    arrays = projection_inputs(case, seed=31)
    got, want = (project(case, arrays, layer=case.layer, backend=b) for b in ("cutile", "xla"))
    assert max(rel_l2(got[k], want[k]) for k in want) < TOLERANCE[case.dtype]
    assert all(got[k].dtype == want[k].dtype for k in want)


@pytest.mark.parametrize("name", list(MIXER_CASES))
def test_emulated_mixer_step_matches_xla(name):
    case = MIXER_CASES[name]
    arrays = mixer_inputs(case, seed=32)
    got, want = (step(case, arrays, layer=case.layer, backend=b) for b in ("cutile", "xla"))
    assert max(rel_l2(got[k], want[k]) for k in want) < TOLERANCE[case.dtype]
    assert all(got[k].dtype == want[k].dtype for k in want)


# The plans run in the arrays' own dtypes against the float64 reference: their roundings.
OWN_DTYPES_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


@pytest.mark.parametrize("name, param_dtype", [("gated_norm_mixer", "float32"), ("gate_in_step", "float32"),
                                               ("bf16", "float32"), ("bf16", "bfloat16"), ("bf16", "mixed")])
def test_emulated_mixer_step_in_the_kernels_dtypes_matches_float64_reference(name, param_dtype):
    """mixer_step's plan through jax.pure_callback with the emulator in the arrays' own dtypes (float32; bfloat16
    tokens and states under float32 or bfloat16 parameters): the kernel writes the SSM and conv state stacks in
    place, which the FFI passes as buffers of the launch's own (InputOutput) and the callback receives as read-only
    views of JAX's arrays. y and both stacks match the float64 reference within the dtypes' roundings, and the
    caller's arrays are left as they were. "mixed": bfloat16 parameters but a float32 conv bias, which the plan
    declares and reads in its own dtype."""
    case = MIXER_CASES[name]
    arrays = mixer_inputs(case, seed=34)
    for key in ("conv_weight", "conv_bias", "A_log", "dt_bias", "D"):
        if arrays[key] is not None:
            wide = param_dtype == "float32" or (param_dtype == "mixed" and key == "conv_bias")
            arrays[key] = arrays[key].astype(np.float32 if wide else ml_dtypes.bfloat16)
    names = ("zxbcdt", "conv_state", "ssm_state", "conv_weight", "conv_bias", "A_log", "dt_bias", "D")
    args = [None if arrays[n] is None else jnp.asarray(arrays[n]) for n in names]
    kernels = decode_ops.make_kernels(functools.partial(emulator.jax_run_plan, float64=False))
    with backends.kernels_replaced(decode.OP, "cutile", kernels):
        y, ssm_state, conv_state = jax_mamba2.mixer_step(*args, **case.layout(), layer=case.layer, backend="cutile")
    if param_dtype == "mixed":
        zxbcdt, conv_state_in, ssm_state_in, *params = args
        dims = decode_ops.mixer_dims(zxbcdt, conv_state_in, *params, ssm_state_in, **case.layout())
        assert decode_mixer.mixer_step_inputs(dims)["conv_bias"].dtype == "float32"
    got = {"y": y, "ssm_state": ssm_state, "new_conv_state": conv_state[case.layer]}
    want = mixer_oracle(case, arrays)
    errors = {k: rel_l2(np.asarray(got[k], np.float64), want[k]) for k in want}
    assert max(errors.values()) < OWN_DTYPES_TOLERANCE[case.dtype], errors
    assert ssm_state.dtype == conv_state.dtype == jnp.dtype(case.state_dtype)
    for n, a in zip(names, args):
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), arrays[n], err_msg=n)


def test_emulated_mixer_step_keeps_a_nan_time_step_through_the_dt_limit():
    """A NaN dt of one head of row 0 makes that head's y and state NaN, as on xla, also through the clip of the
    step's dt_limit (whose min and max, cuTile's, would return the bound for a NaN unless told to propagate it)."""
    case = MIXER_CASES["gate_in_step"]  # dt_limit (0.01, 0.5)
    arrays = mixer_inputs(case, seed=33)
    arrays["zxbcdt"][0, case.layout()["dt_offset"] + 1] = np.nan
    got, want = (step(case, arrays, layer=case.layer, backend=b) for b in ("cutile", "xla"))
    assert np.isnan(want["y"][0]).any()
    for k in want:
        np.testing.assert_array_equal(np.isnan(got[k]), np.isnan(want[k]))


def test_emulated_gradients_are_the_xla_paths():
    case = PROJECTION_CASES["gated_norm_out_proj"]
    a = {k: None if v is None else jnp.asarray(v) for k, v in projection_inputs(case, seed=33).items()}

    def loss(backend):
        def f(x, weight, norm_weight, z):
            out = jax_mamba2.norm_project(x, weight, norm_weight=norm_weight, z=z, layer=case.layer, backend=backend,
                                          **{k: v for k, v in case.kwargs().items() if k != "residual_dtype"})
            return jnp.sum(jnp.sin(out))
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))

    args = (a["x"], a["weight"], a["norm_weight"], a["z"])
    assert _callbacks(loss("cutile"), *args) == 1  # the kernel ran forward; the VJP is the reference's
    for got, want in zip(loss("cutile")(*args), loss("xla")(*args)):
        assert rel_l2(got, want) < 1e-5


def test_emulated_vmap_folds_the_rows_into_one_launch():
    case = PROJECTION_CASES["add_norm_in_proj"]
    a = {k: None if v is None else jnp.asarray(v) for k, v in projection_inputs(case, seed=34).items()}

    def one(x, residual, backend="cutile"):
        return jax_mamba2.norm_project(x, a["weight"], norm_weight=a["norm_weight"], residual=residual,
                                       residual_dtype=jnp.float32, layer=case.layer, backend=backend)
    xs, residuals = jnp.stack([a["x"], -a["x"]]), jnp.stack([a["residual"], 0.5 * a["residual"]])
    batched = jax.jit(jax.vmap(one))
    assert _callbacks(batched, xs, residuals) == 1
    got = batched(xs, residuals)
    for i in range(2):
        for g, w in zip(got, one(xs[i], residuals[i], "xla")):
            assert rel_l2(g[i], w) < 1e-6


def test_emulated_partial_sums_match_xla_also_under_vmap():
    """out_proj's partial sums out of the kernels (K split in 4 at these 3 rows: 4 parts, no launch to sum them)
    and into the next projection's norm kernel give the xla path's values, also with the rows under vmap (the
    parts axis kept ahead of the folded rows)."""
    keys = jax.random.split(jax.random.key(35), 7)
    x, z = jax.random.normal(keys[0], (3, 512)), jax.random.normal(keys[1], (3, 512))
    norm_weight = 1 + 0.5 * jax.random.normal(keys[2], (3, 512))
    weight = jax.random.normal(keys[3], (3, 512, 1024)) / 24  # out_proj's shape class: its K split at a few rows
    in_weight = jax.random.normal(keys[4], (3, 1024, 96)) / 32

    def chain(x, z, residual, backend):
        parts = jax_mamba2.norm_project(x, weight, norm_weight=norm_weight, z=z, group_size=256, layer=1,
                                        return_partials=True, backend=backend)
        out = jax_mamba2.norm_project(parts, in_weight, norm_weight=jnp.ones((3, 1024)), residual=residual,
                                      residual_dtype=jnp.float32, x_dtype=jnp.float32, layer=1, backend=backend)
        return parts.shape[0], out
    residual = jax.random.normal(keys[5], (3, 1024))
    (parts, got), (_, want) = (chain(x, z, residual, backend) for backend in ("cutile", "xla"))
    assert parts == 4
    for g, w in zip(got, want):
        assert rel_l2(g, w) < 1e-6
    xs, zs, rs = jnp.stack([x, -x]), jnp.stack([z, z]), jnp.stack([residual, 2 * residual])
    batched = jax.vmap(lambda x, z, r: chain(x, z, r, "cutile")[1])(xs, zs, rs)
    for i in range(2):
        for g, w in zip(batched, chain(xs[i], zs[i], rs[i], "xla")[1]):
            assert rel_l2(g[i], w) < 1e-6



def test_emulated_gradients_of_partial_sums_are_each_piece_s_of_k():
    """The kernels' partial sums (K split in 4 at these 2 rows) differentiate as what they are, each the product
    over its quarter of K (the bias in the first): under cotangents that differ between the parts, the gradients are
    the reference's split into the same pieces (not the unsplit sum's, whose one part would not even take them);
    through a chain that sums the parts (the LM's out_proj into the next norm) they are the xla path's; also under
    vmap, whose folded rows may split K otherwise."""
    keys = jax.random.split(jax.random.key(36), 6)
    x, z = jax.random.normal(keys[0], (2, 256)), jax.random.normal(keys[1], (2, 256))
    norm_weight = 1 + 0.5 * jax.random.normal(keys[2], (2, 256))
    weight = jax.random.normal(keys[3], (2, 256, 1024)) / 16
    bias = jax.random.normal(keys[4], (2, 1024))

    def parts(x, z, weight, bias, backend="cutile"):
        return jax_mamba2.norm_project(x, weight, norm_weight=norm_weight, z=z, bias=bias, group_size=128, layer=1,
                                       return_partials=True, backend=backend)
    args = (x, z, weight, bias)
    assert parts(*args).shape == (4, 2, 1024)
    cotangent = jax.random.normal(keys[5], (4, 2, 1024))
    split_reference = decode_reference.norm_project(x, weight[1], norm_weight=norm_weight[1], z=z, group_size=128,
                                                    bias=bias[1], partials=True, parts=4)[0]
    assert rel_l2(parts(*args), split_reference) < 1e-6
    got = jax.vjp(parts, *args)[1](cotangent)
    want = jax.vjp(lambda x, z, w, b: decode_reference.norm_project(
        x, w[1], norm_weight=norm_weight[1], z=z, group_size=128, bias=b[1], partials=True, parts=4)[0], *args)[1](
        cotangent)
    for g, w in zip(got, want):
        assert rel_l2(g, w) < 1e-5

    def summed(x, z, weight, bias, backend="cutile"):
        return jnp.sum(jnp.sin(parts(x, z, weight, bias, backend).sum(axis=0)))
    for g, w in zip(jax.grad(summed, argnums=(0, 1, 2, 3))(*args), jax.grad(summed, argnums=(0, 1, 2, 3))(
            *args, backend="xla")):
        assert rel_l2(g, w) < 1e-5
    xs = jnp.stack([x, -x, 2 * x, x, 0.5 * x])  # 10 rows folded: another split than 2 rows'
    mapped = jax.vmap(jax.grad(summed), in_axes=(1, None, None, None))(jnp.moveaxis(xs, 0, 1), z, weight, bias)
    for i in range(len(xs)):
        assert rel_l2(mapped[i], jax.grad(summed)(xs[i], z, weight, bias, backend="xla")) < 1e-5


CONFIG = Mamba2Config(d_model=32, n_layer=3, vocab_size=64, ssm_cfg=dict(d_state=16, headdim=16, chunk_size=8))


def test_emulated_mixer_step_matches_xla_over_several_tokens():
    layers = {b: Mamba2(32, d_state=16, headdim=16, chunk_size=8, backend=b, rngs=nnx.Rngs(0))
              for b in ("cutile", "xla")}
    tokens = jax.random.normal(jax.random.key(1), (4, 2, 32))
    caches = {b: layers[b].init_cache(2) for b in layers}
    for token in tokens:
        outs = {}
        for b, layer in layers.items():
            outs[b], caches[b] = layer.step(token, caches[b])
        assert rel_l2(outs["cutile"], outs["xla"]) < 1e-5
    for got, want in zip(caches["cutile"], caches["xla"]):
        assert rel_l2(got, want) < 1e-5


# Wide enough that the default projections of two rows split K (out_proj's 256 features: 4 steps of 64 in f32).
SPLIT_CONFIG = Mamba2Config(d_model=128, n_layer=2, vocab_size=256,
                            ssm_cfg=dict(d_state=16, headdim=16, chunk_size=8))


@pytest.mark.parametrize("config, batch, out_proj_splits", [(CONFIG, 2, 1), (SPLIT_CONFIG, 2, 4), (CONFIG, 9, 1),
                                                             (SPLIT_CONFIG, 9, 2)],
                         ids=["one_k_step", "k_split", "norm_launch", "k_split_norm_launch"])
def test_emulated_lm_step_matches_xla_over_several_tokens(config, batch, out_proj_splits):
    """The fused step's launches thread the stacked SSM state through all layers, token after token (with the
    projections' K split over blocks and summed where the defaults split it; from 9 rows with the gated norm's
    own launch, where float32 out_proj of SPLIT_CONFIG splits its 2 K steps of 128)."""
    models = {b: Mamba2LMHeadModel(config, backend=b, rngs=nnx.Rngs(0)) for b in ("cutile", "xla")}
    out_proj = models["cutile"].layers.mixer.out_proj.kernel
    dims = decode_projection.ProjectionDims(rows=batch, features=out_proj.shape[-2],
                                            out_features=out_proj.shape[-1], weight_dtype=out_proj.dtype.name)
    splits = decode_projection.split_k(dims, decode_projection.projection_default_config(dims))
    assert splits == out_proj_splits
    tokens = jax.random.randint(jax.random.key(2), (4, batch), 0, config.vocab_size)
    assert_lm_steps_match(models, {b: m.init_cache(batch) for b, m in models.items()}, tokens, 1e-5)
    graphdef, state = nnx.split(models["cutile"])
    jaxpr = jax.make_jaxpr(lambda s, t, c: nnx.merge(graphdef, s).step(t, c))(
        state, tokens[0], models["cutile"].init_cache(batch))
    assert str(jaxpr).count("pure_callback") == 3 * config.n_layer + 1


def test_emulated_lm_step_of_float32_parameters_with_a_bfloat16_cache_matches_xla():
    """The fused step with a decode state in another dtype than the parameters (`generate(cache_dtype=...)`):
    float32 weights, bfloat16 conv windows and SSM state, token after token."""
    models = {b: Mamba2LMHeadModel(SPLIT_CONFIG, backend=b, rngs=nnx.Rngs(0)) for b in ("cutile", "xla")}
    assert models["cutile"].layers.mixer.in_proj.kernel.dtype == jnp.float32
    caches = {b: m.init_cache(2, jnp.bfloat16) for b, m in models.items()}
    assert {a.dtype for a in jax.tree.leaves(caches["cutile"])} == {jnp.dtype(jnp.bfloat16)}
    tokens = jax.random.randint(jax.random.key(4), (3, 2), 0, SPLIT_CONFIG.vocab_size)
    assert_lm_steps_match(models, caches, tokens, TOLERANCE["bfloat16"])


@pytest.mark.parametrize("heads", [2, 4])
def test_emulated_lm_step_with_several_heads_per_mixer_block_matches_xla(heads):
    """The fused step with mixer-step blocks of HEADS heads (`MixerStepConfig.HEADS`; CONFIG has 4 heads in one
    group), token after token."""
    def mixer_config(dims):
        return dataclasses.replace(decode_mixer.mixer_step_default_config(dims), HEADS=heads)

    models = {b: Mamba2LMHeadModel(CONFIG, backend=b, rngs=nnx.Rngs(0)) for b in ("cutile", "xla")}
    tokens = jax.random.randint(jax.random.key(3), (3, 2), 0, CONFIG.vocab_size)
    with backends.kernels_replaced(decode.OP, "cutile",
                                   decode_ops.make_kernels(emulator.jax_run_plan, mixer_config=mixer_config)):
        assert_lm_steps_match(models, {b: m.init_cache(2) for b, m in models.items()}, tokens, 1e-5)


@pytest.mark.parametrize("norm_before_gate, group_size", [(False, 64), (True, 128)])
def test_emulated_sums_of_squares_into_out_proj_match_xla_also_under_vmap(norm_before_gate, group_size):
    """The mixer step's sums of squares (one per kernel block) and out_proj normalizing from them in its product
    give the xla path's values (one sum per group there), also with the rows under vmap (folded into one launch)."""
    case = MIXER_CASES["gated_norm_mixer"]
    arrays = mixer_inputs(case, seed=46)
    got, want = (gated_norm_chain(case, arrays, norm_before_gate=norm_before_gate, group_size=group_size,
                                  backend=b) for b in ("cutile", "xla"))
    assert got[0].shape[1] % want[0].shape[1] == 0 and got[0].shape[1] > want[0].shape[1]
    assert rel_l2(got[0].reshape(case.rows, want[0].shape[1], -1).sum(-1), want[0]) < TOLERANCE["float32"]
    assert rel_l2(got[1], want[1]) < TOLERANCE["float32"]
    sums, y = got[0], jax.random.normal(jax.random.key(47), (2, case.rows, case.d_ssm))
    weight = jax.random.normal(jax.random.key(48), (case.d_ssm, 24))
    z = jnp.asarray(arrays["zxbcdt"])

    def project_(y, sums, backend):
        return jax_mamba2.norm_project(y, weight, norm_weight=jnp.ones((case.d_ssm,)), z=z, z_offset=0,
                                       group_size=group_size, norm_before_gate=norm_before_gate, sum_squares=sums,
                                       backend=backend)
    batched = jax.vmap(lambda y, s: project_(y, s, "cutile"))(y, jnp.stack([sums, 2 * sums]))
    for i, s in enumerate((sums, 2 * sums)):
        assert rel_l2(batched[i], project_(y[i], s, "xla")) < TOLERANCE["float32"]


def test_emulated_gradients_through_the_sums_of_squares_are_the_xla_paths():
    case = MIXER_CASES["gated_norm_mixer"]
    arrays = mixer_inputs(case, seed=49)

    def grad(backend):
        def loss(zxbcdt):
            _, out = gated_norm_chain(case, {**arrays, "zxbcdt": zxbcdt}, norm_before_gate=False, group_size=64,
                                      backend=backend)
            return jnp.sum(jnp.sin(out))
        return jax.grad(loss)(jnp.asarray(arrays["zxbcdt"]))
    assert rel_l2(grad("cutile"), grad("xla")) < 1e-5


@pytest.fixture
def every_kernel_emulated(monkeypatch):
    """backend="cutile" of every op of the LM (SSD, conv, norms, decode) runs the emulated plans."""
    monkeypatch.setitem(backends._REGISTRY["ssd"], "cutile", dataclasses.replace(EMULATED, name="cutile"))
    monkeypatch.setitem(backends._REGISTRY[conv1d.OP], "cutile", backends.LayerBackend(
        "cutile", conv_ops.ConvKernels("cutile_emulated", emulator.jax_run_plan), backends.always_supported,
        auto_priority=2))
    emulate_layer_kernels(monkeypatch, norm.OP, norm_ops)


def test_emulated_generate_of_left_padded_prompts_until_eos_matches_xla(every_kernel_emulated):
    """generate on the kernels end to end: left-padded prompts prefilled by the forward kernels with seq_idx
    (the conv's and the SSD's), then the fused step in the decode loop that stops at eos, sampled with a
    repetition penalty: the tokens of the same model on the xla path."""
    models = {b: Mamba2LMHeadModel(CONFIG, backend=b, rngs=nnx.Rngs(0)) for b in ("cutile", "xla")}
    prompt = jax.random.randint(jax.random.key(3), (3, 20), 0, CONFIG.vocab_size)
    controls = dict(prompt_lengths=[2, 20, 11], temperature=0.7, top_k=16, repetition_penalty=1.3,
                    rng=jax.random.key(4))
    free = generate(models["xla"], prompt, 8, **controls)
    eos = int(free[1, 23])
    tokens = {b: generate(m, prompt, 8, eos_token_id=eos, **controls) for b, m in models.items()}
    assert str(jax.make_jaxpr(lambda p: generate(models["cutile"], p, 8, **controls))(prompt)).count(
        "pure_callback") > 0  # the kernels ran
    np.testing.assert_array_equal(tokens["cutile"], tokens["xla"])
    assert (np.asarray(tokens["xla"])[1, 24:] == eos).all()
