"""Decoding in the parameters' own dtype, and prefill through the full-sequence SSD (programs traced on the CPU).

- A bfloat16-parameter model's token step converts no weight matrix; a float32-parameter model computing
  in bfloat16 does, until `cast_params` (or `load_pretrained(..., param_dtype=)`) converts it once.
- `generate` runs its prompt through the chunked SSD (the cuTile forward kernels, or the xla path's chunks),
  never token by token, and its decode loop through the O(1) step.
- Greedy tokens with bfloat16 parameters are the argmax of the uncached forward (up to exact ties).
The cuTile programs are traced for sm_90 (`aot.cuda_target`), which needs no GPU.
"""
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_mamba2.flax_layers import (Mamba2Config, Mamba2LMHeadModel, cast_params, generate, load_pretrained,
                                    save_pretrained)
from tests.flax_layers._programs import cutile_launches, loop_lengths, walk, weight_conversions

# Kernel-compatible sizes (headdim and d_state powers of two >= 16): 4 heads, 3 layers, chunks of 8.
# A projection of the fused step: the norm kernel, then the product kernel.
PROJECTION = ["decode_norm_kernel", "decode_project_kernel"]
# out_proj: its product alone (the mixer step sums the gated norm's squares; the product normalizes).
OUT_PROJ = ["decode_project_kernel"]
CONFIG = Mamba2Config(d_model=32, n_layer=3, vocab_size=64, ssm_cfg=dict(d_state=16, headdim=16, chunk_size=8))
BATCH = 3  # no weight has an axis of 3, so a converted (3, ...) array is an activation
PROMPT_LEN, NEW_TOKENS = 40, 7  # 5 chunks of 8; the decode loop runs 6 steps: no loop length repeats


def _traced_for(backend):
    """A context in which `backend` traces as on an H200 (cutile), or a no-op."""
    if backend != "cutile":
        return contextlib.nullcontext()
    aot = pytest.importorskip("jax_mamba2.bridge.aot")
    return aot.cuda_target("sm_90")


def _model(backend="xla", **kwargs):
    return Mamba2LMHeadModel(CONFIG, backend=backend, rngs=nnx.Rngs(0), **kwargs)


def _step_jaxpr(model):
    graphdef, state = nnx.split(model)

    def step(state, token, cache):
        return nnx.merge(graphdef, state).step(token, cache)

    return jax.make_jaxpr(step)(state, jnp.zeros((BATCH,), jnp.int32), model.init_cache(BATCH))


def _prompt(seed=0, length=PROMPT_LEN):
    return jax.random.randint(jax.random.key(seed), (BATCH, length), 0, CONFIG.vocab_size)


@pytest.mark.parametrize("backend", ["xla", "cutile"])
def test_bf16_parameter_decode_step_converts_no_weight(backend):
    with _traced_for(backend):
        model = _model(backend, param_dtype=jnp.bfloat16)
        jaxpr = _step_jaxpr(model)
    assert weight_conversions(jaxpr, model) == []
    if backend == "cutile":  # four fused launches per layer, two for the final norm and the head
        launches = cutile_launches(jaxpr)
        assert [name for name, _ in launches] == (
            [*PROJECTION, "mixer_step_kernel", *OUT_PROJ] * CONFIG.n_layer
            + PROJECTION)
        assert all(loops == () for _, loops in launches)  # the layers unrolled on their stacked parameters
        # The kernels read the bf16 scales, conv weights, A_log, dt_bias and D as they are, stacked: nothing of
        # any parameter is converted, sliced out of its stack or copied before a launch.
        params = jax.tree.leaves(nnx.state(model, nnx.Param))
        shapes = {tuple(p.shape) for p in params} | {tuple(p.shape[1:]) for p in params}
        assert weight_conversions(jaxpr, model, shapes) == []
        sliced = [eqn for eqn, _ in walk(jaxpr) if eqn.primitive.name in ("slice", "dynamic_slice", "gather")
                  and tuple(eqn.invars[0].aval.shape) in shapes]
        assert [eqn.invars[0].aval.shape for eqn in sliced] == [model.embedding.embedding.shape]  # the lookup


def test_float32_parameters_under_bf16_compute_convert_once_with_cast_params():
    model = _model(dtype=jnp.bfloat16)
    converted = {shape for shape, _, to in weight_conversions(_step_jaxpr(model), model) if to == "bfloat16"}
    # Every step converts the embedding (tied head) and both projections: what cast_params removes.
    assert {(64, 32), (32, 164), (64, 32)} <= converted
    cast = cast_params(model, jnp.bfloat16)
    assert weight_conversions(_step_jaxpr(cast), cast) == []
    for (path, before), after in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                     jax.tree.leaves(nnx.state(cast, nnx.Param))):
        assert before[...].dtype == jnp.float32, path  # the original model is untouched
        assert after.dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(np.asarray(after, np.float32),
                                      np.asarray(before[...].astype(jnp.bfloat16), np.float32))
    assert cast.init_cache(BATCH).ssm_state.dtype == jnp.bfloat16


def test_cast_params_rejects_what_the_ops_could_not_run():
    for dtype in (jnp.int32, jnp.float8_e4m3fn, "foo"):
        with pytest.raises(TypeError, match=r"cast_params: dtype=.* must be"):
            cast_params(_model(), dtype)
    with pytest.raises(TypeError, match=r"cast_params: dtype=None must be one of bfloat16, float16, float32, float64"):
        cast_params(_model(), None)
    with pytest.raises(TypeError, match=r"cast_params: model must be an nnx.Module, got dict"):
        cast_params({"a": jnp.ones(2)}, jnp.bfloat16)


def test_cast_params_of_an_abstract_model_is_the_abstract_cast_model():
    """An `nnx.eval_shape` model casts to the abstract model of the cast one (its parameters `ShapeDtypeStruct`s
    of the new dtype, the same shardings), which a cast model's state then fills."""
    abstract = nnx.eval_shape(lambda: _model())
    cast = cast_params(abstract, jnp.bfloat16)
    concrete = cast_params(_model(), jnp.bfloat16)
    want = jax.tree.leaves(nnx.eval_shape(lambda: concrete))
    got = jax.tree.leaves(nnx.state(cast))
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in got)
    assert [(leaf.shape, leaf.dtype, leaf.sharding) for leaf in got] == [
        (leaf.shape, leaf.dtype, leaf.sharding) for leaf in want]
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(abstract))} == {jnp.dtype(jnp.float32)}  # untouched
    nnx.update(cast, nnx.state(concrete))
    ids = jax.random.randint(jax.random.key(3), (BATCH, 6), 0, CONFIG.vocab_size)
    np.testing.assert_array_equal(np.asarray(cast(ids), np.float32), np.asarray(concrete(ids), np.float32))


def test_a_model_without_a_compute_dtype_computes_in_its_cast_parameters_dtype():
    """dtype=None infers the computation dtype from the parameters, the embedding's lookup included: cast to bf16,
    the model computes as one built with bf16 parameters (the same weights) does."""
    model = _model()  # float32 parameters, dtype None
    cast = cast_params(model, jnp.bfloat16)
    built = Mamba2LMHeadModel(model.config, backend="xla", param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    nnx.update(built, nnx.state(cast, nnx.Param))
    ids = jax.random.randint(jax.random.key(3), (BATCH, 6), 0, model.config.vocab_size)
    assert cast.embedding(ids).dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(cast(ids), np.float32), np.asarray(built(ids), np.float32))
    assert model(ids).dtype == jnp.float32  # the original keeps its float32 computation


def test_load_pretrained_in_bf16_decodes_without_weight_conversions(tmp_path):
    model = _model()
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, param_dtype=jnp.bfloat16, backend="xla")
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(loaded, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    assert weight_conversions(_step_jaxpr(loaded), loaded) == []
    np.testing.assert_array_equal(
        np.asarray(loaded.layers.mixer.in_proj.kernel[...], np.float32),
        np.asarray(model.layers.mixer.in_proj.kernel[...].astype(jnp.bfloat16), np.float32))


@pytest.mark.parametrize("scan_layers, controls", [
    (True, {}), (False, {}),
    (True, dict(prompt_lengths=[1, 17, PROMPT_LEN], eos_token_id=3, temperature=0.8, top_p=0.9,
                repetition_penalty=1.2, rng=jax.random.key(0))),
], ids=["scan", "unrolled", "padded_prompts_until_eos_sampled"])
def test_generate_prefills_with_the_cutile_forward_kernels_and_decodes_with_the_fused_step(scan_layers, controls):
    """Also with left-padded prompts (the prefill's seq_idx) and the decode loop that stops at eos."""
    with _traced_for("cutile"):
        model = _model("cutile", param_dtype=jnp.bfloat16, scan_layers=scan_layers)
        jaxpr = jax.make_jaxpr(lambda prompt: generate(model, prompt, NEW_TOKENS, **controls))(_prompt())
    decode = ("while", None) if "eos_token_id" in controls else ("scan", NEW_TOKENS - 1)
    launches = cutile_launches(jaxpr)
    prefill = [name for name, loops in launches if decode not in loops]
    steps = [name for name, loops in launches if loops == (decode,)]
    # Once for the whole prompt (in the scan over layers, or once per layer unrolled): the norms, the conv of
    # [x, B, C] (one launch), and one launch per stage of the SSD's forward plan; per token, with no loop over
    # the layers: four fused launches per layer and two for the head; no backward kernel.
    assert prefill == (["rms_norm_fwd_kernel", "causal_conv1d_fwd_kernel", "chunk_cumsum_fwd_kernel",
                        "chunk_state_fwd_kernel", "chunk_scan_fwd_kernel", "rms_norm_fwd_kernel"]
                       * (1 if scan_layers else CONFIG.n_layer) + ["rms_norm_fwd_kernel"])
    assert steps == ([*PROJECTION, "mixer_step_kernel", *OUT_PROJ] * CONFIG.n_layer
                     + PROJECTION)
    assert len(steps) + len(prefill) == len(launches)
    assert ("scan", PROMPT_LEN) not in loop_lengths(jaxpr)


def test_the_step_is_fused_at_every_batch_and_composed_with_an_mlp_branch():
    """On one device the fused step runs at any batch (four launches per layer up to GATED_NORM_IN_MIXER_ROWS rows,
    then five: out_proj's norm its own launch again; two for the head); a mixer with the gated MLP branch takes the
    composed step (the norms' kernels and the SSD's step kernel in the scan over layers, the final norm's)."""
    from jax_mamba2.flax_layers.mamba2 import GATED_NORM_IN_MIXER_ROWS

    mlp = dataclasses.replace(CONFIG, ssm_cfg={**CONFIG.ssm_cfg, "d_ssm": CONFIG.d_model})
    fused = [*PROJECTION, "mixer_step_kernel", *OUT_PROJ] * CONFIG.n_layer + PROJECTION
    many_rows = [*PROJECTION, "mixer_step_kernel", *PROJECTION] * CONFIG.n_layer + PROJECTION
    composed = ["rms_norm_fwd_kernel", "state_update_kernel", "rms_norm_fwd_kernel", "rms_norm_fwd_kernel"]
    with _traced_for("cutile"):
        for config, batch, expected in ((CONFIG, 1, fused), (CONFIG, GATED_NORM_IN_MIXER_ROWS, fused),
                                        (CONFIG, GATED_NORM_IN_MIXER_ROWS + 1, many_rows), (CONFIG, 300, many_rows),
                                        (mlp, 1, composed)):
            model = Mamba2LMHeadModel(config, backend="cutile", param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
            graphdef, state = nnx.split(model)
            jaxpr = jax.make_jaxpr(lambda s, t, c: nnx.merge(graphdef, s).step(t, c))(
                state, jnp.zeros((batch,), jnp.int32), model.init_cache(batch))
            assert [name for name, _ in cutile_launches(jaxpr)] == expected, (config.ssm_cfg, batch)


def test_the_token_step_exports_with_a_symbolic_batch():
    """jax.export of the LM's token step with the batch a symbolic dimension ("auto": the xla step, the kernels
    being compiled per shape): the exported step equals the direct one at a batch inside the gated norm's few-row
    form and at one past it."""
    from jax_mamba2.flax_layers.mamba2 import GATED_NORM_IN_MIXER_ROWS

    model = _model("auto")
    graphdef, state = nnx.split(model)

    def step(state, token, cache):
        return nnx.merge(graphdef, state).step(token, cache)

    batch, = jax.export.symbolic_shape("batch")
    cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[:1] + (batch,) + a.shape[2:], a.dtype),
                         model.init_cache(1))
    exported = jax.export.export(jax.jit(step))(state, jax.ShapeDtypeStruct((batch,), jnp.int32), cache)
    for rows in (2, GATED_NORM_IN_MIXER_ROWS + 1):
        tokens = jax.random.randint(jax.random.key(rows), (rows,), 0, CONFIG.vocab_size)
        _, cache = model.prefill(jax.random.randint(jax.random.key(0), (rows, 5), 0, CONFIG.vocab_size),
                                 model.init_cache(rows))
        for got, want in zip(jax.tree.leaves(exported.call(state, tokens, cache)),
                             jax.tree.leaves(step(state, tokens, cache))):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["xla", "cutile"])
def test_the_token_step_updates_the_conv_state_stack_rather_than_stacking_the_layers(backend):
    """The fused step treats the conv-state stack as it does the SSM state's: each layer's mixer step rewrites its
    x channels in the stack (the kernel in place), and one dynamic-update-slice writes every layer's B and C windows
    at the end; no concatenate builds the stack (a pass over all of it per token)."""
    with _traced_for(backend):
        model = _model(backend, param_dtype=jnp.bfloat16)
        jaxpr = _step_jaxpr(model)
    conv_shape = model.init_cache(BATCH).conv_state.shape
    mixer = model.layers.mixer
    windows = (CONFIG.n_layer, BATCH, 2 * mixer.ngroups * mixer.d_state, mixer.d_conv)
    ops = [(eqn.primitive.name, tuple(eqn.outvars[0].aval.shape), [tuple(v.aval.shape) for v in eqn.invars])
           for eqn, _ in walk(jaxpr)]
    assert not [op for op in ops if op[0] == "concatenate" and op[1] == conv_shape]
    writes = [op for op in ops if op[0] == "dynamic_update_slice" and op[1] == conv_shape and op[2][1] == windows]
    assert len(writes) == 1, ops


def test_out_proj_split_partials_are_summed_by_the_next_norm_not_a_launch_of_their_own():
    """Where the defaults split out_proj's K over blocks (a few rows, a narrow product), the step launches no sum of
    its partial products: the next layer's norm kernel (and the head's) sums them; in_proj's and the head's own
    splits are still summed by a launch each. out_proj has no norm launch: the mixer step sums the gated norm's
    squares and out_proj's product normalizes."""
    from jax_mamba2.kernels import decode_projection

    config = Mamba2Config(d_model=256, n_layer=2, vocab_size=256, pad_vocab_size_multiple=8,
                          ssm_cfg=dict(d_state=64, headdim=64, chunk_size=64))
    with _traced_for("cutile"):
        model = Mamba2LMHeadModel(config, backend="cutile", param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda s, t, c: nnx.merge(graphdef, s).step(t, c))(
            state, jnp.zeros((1,), jnp.int32), model.init_cache(1))

    def split(features, out_features):
        dims = decode_projection.ProjectionDims(rows=1, features=features, out_features=out_features,
                                                weight_dtype="bfloat16")
        return decode_projection.split_k(dims, decode_projection.projection_default_config(dims)) > 1

    mixer = model.layers.mixer
    assert split(*mixer.out_proj.kernel.shape[-2:])  # the case this test is about
    summed = ["decode_split_sum_kernel"]
    in_proj = PROJECTION + (summed if split(*mixer.in_proj.kernel.shape[-2:]) else [])
    head = PROJECTION + (summed if split(config.d_model, model.embedding.embedding.shape[0]) else [])
    expected = [*in_proj, "mixer_step_kernel", *OUT_PROJ] * config.n_layer + head
    assert [name for name, _ in cutile_launches(jaxpr)] == expected


def test_generate_prefills_through_the_chunked_xla_path_not_token_by_token():
    model = _model("xla", param_dtype=jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda prompt: generate(model, prompt, NEW_TOKENS))(_prompt())
    lengths = loop_lengths(jaxpr)
    nchunks = PROMPT_LEN // CONFIG.mixer_options["chunk_size"]
    # The layers (prefill and each decode step), the state passing over the prompt's chunks, the decode loop.
    assert sorted(set(lengths)) == sorted({("scan", CONFIG.n_layer), ("scan", nchunks), ("scan", NEW_TOKENS - 1)})
    assert lengths.count(("scan", nchunks)) == 1


@pytest.mark.slow
def test_greedy_tokens_are_the_uncached_forward_argmax_with_bf16_parameters_up_to_ties():
    """In bfloat16 the forward's logits tie often (this tiny model's are ~0.1, 2**-9 apart at best), and
    argmax takes the first of equal values: every generated token is the forward's argmax or ties with it.
    (float32 parameters: test_lm.py checks exact equality.)"""
    model, prompt_len = _model(param_dtype=jnp.bfloat16), 5
    forward = nnx.jit(lambda m, ids: m(ids))
    matches = []
    for seed in range(2):
        tokens = generate(model, _prompt(seed, prompt_len), 12)
        logits = forward(model, tokens[:, :-1])[:, prompt_len - 1:, :CONFIG.vocab_size]
        tokens = tokens[:, prompt_len:]
        assert logits.dtype == jnp.bfloat16
        chosen = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
        np.testing.assert_array_equal(chosen, logits.max(axis=-1))
        matches.append(np.asarray(jnp.argmax(logits, axis=-1) == tokens))
    assert np.mean(matches) > 0.9
