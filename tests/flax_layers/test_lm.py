"""Tests of Mamba2Block, Mamba2LMHeadModel and generate (jax_mamba2/flax_layers/lm.py)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_mamba2.flax_layers import Mamba2LMHeadModel, generate

BATCH, SEQLEN = 2, 12


def _model(config, backend="xla", **kwargs):
    return Mamba2LMHeadModel(config, backend=backend, rngs=nnx.Rngs(0), **kwargs)


def _token_ids(config, seed=0, shape=(BATCH, SEQLEN)):
    return jax.random.randint(jax.random.key(seed), shape, 0, config.vocab_size)


def test_lm_shapes_dtypes_and_init(tiny_config):
    model = _model(tiny_config)
    assert model.lm_head is None  # tied
    layers = nnx.state(model.layers, nnx.Param)
    assert all(leaf.shape[0] == tiny_config.n_layer for leaf in jax.tree.leaves(layers))
    assert model.embedding.embedding.shape == (64, 32)  # 61 padded to a multiple of 8
    assert abs(float(jnp.std(model.embedding.embedding[...])) - 0.02) < 0.002
    bound = 1 / math.sqrt(2 * 32) / math.sqrt(tiny_config.n_layer)  # PyTorch init / sqrt(n_layer)
    out_proj = np.asarray(model.layers.mixer.out_proj.kernel[...])
    assert np.abs(out_proj).max() <= bound and np.abs(out_proj).max() > 0.9 * bound

    ids = _token_ids(tiny_config)
    logits = nnx.jit(lambda m, ids: m(ids))(model, ids)
    assert logits.shape == (BATCH, SEQLEN, 64) and logits.dtype == jnp.float32

    half = _model(tiny_config.replace(tie_embeddings=False), dtype=jnp.bfloat16)
    assert half.lm_head.kernel.shape == (32, 64)
    logits, cache = nnx.jit(lambda m, ids: m.prefill(ids))(half, ids)
    assert logits.dtype == jnp.bfloat16 and bool(jnp.isfinite(logits.astype(jnp.float32)).all())
    assert cache.conv_state.shape == (tiny_config.n_layer, BATCH, 64 + 2 * 2 * 8, 4)
    assert cache.ssm_state.shape == (tiny_config.n_layer, BATCH, 8, 8, 8)
    assert cache.ssm_state.dtype == jnp.float32


def test_lm_prefill_then_steps_match_forward(tiny_config):
    model = _model(tiny_config)
    ids = _token_ids(tiny_config, seed=1)
    full = nnx.jit(lambda m, ids: m(ids))(model, ids)
    logits, cache = nnx.jit(lambda m, ids: m.prefill(ids))(model, ids[:, :5])
    pieces = [logits]
    step = nnx.jit(lambda m, token, cache: m.step(token, cache))
    for t in range(5, SEQLEN):
        logits, cache = step(model, ids[:, t], cache)
        pieces.append(logits[:, None])
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, rtol=1e-5, atol=1e-5)


def test_lm_grads_finite_and_equal_with_remat(tiny_config):
    ids = _token_ids(tiny_config, seed=2)

    def loss(model):
        logits = model(ids[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1))

    # The "scan" backend keeps the two backward compilations short; the mixer test covers "xla" grads.
    grads = nnx.jit(nnx.grad(loss))(_model(tiny_config, backend="scan"))
    remat_grads = nnx.jit(nnx.grad(loss))(_model(tiny_config, backend="scan", remat=True))
    for (path, g), r in zip(nnx.to_flat_state(grads), jax.tree.leaves(remat_grads)):
        assert bool(jnp.isfinite(g[...]).all()) and float(jnp.abs(g[...]).max()) > 0, path
        np.testing.assert_allclose(r, g[...], rtol=1e-4, atol=1e-6)


def test_lm_generate_greedy_is_deterministic_and_follows_forward_argmax(tiny_config):
    model = _model(tiny_config)
    prompt = _token_ids(tiny_config, seed=3, shape=(BATCH, 4))
    tokens = generate(model, prompt, 6)
    assert tokens.shape == (BATCH, 10) and tokens.dtype == jnp.int32
    np.testing.assert_array_equal(tokens[:, :4], prompt)
    np.testing.assert_array_equal(generate(model, prompt, 6), tokens)
    logits = nnx.jit(lambda m, ids: m(ids))(model, tokens[:, :-1])
    np.testing.assert_array_equal(jnp.argmax(logits[:, 3:, :tiny_config.vocab_size], axis=-1), tokens[:, 4:])


def test_lm_generate_sampling_respects_top_k(tiny_config):
    model = _model(tiny_config)
    prompt = _token_ids(tiny_config, seed=4, shape=(BATCH, 4))
    top_k = 3
    tokens = generate(model, prompt, 8, temperature=2.0, top_k=top_k, rng=jax.random.key(0))
    other = generate(model, prompt, 8, temperature=2.0, top_k=top_k, rng=jax.random.key(1))
    assert not np.array_equal(tokens, other)  # the key matters
    logits = nnx.jit(lambda m, ids: m(ids))(model, tokens[:, :-1])[:, 3:, :tiny_config.vocab_size]
    ranks = jnp.sum(logits > jnp.take_along_axis(logits, tokens[:, 4:, None], axis=-1), axis=-1)
    assert int(ranks.max()) < top_k  # every sampled token is among the top_k of its logits
    assert int(tokens.max()) < tiny_config.vocab_size
    np.testing.assert_array_equal(
        generate(model, prompt, 8, temperature=1.0, top_k=1, rng=jax.random.key(0)), generate(model, prompt, 8))


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), r"generate: max_new_tokens=0 must be a positive int"),
    (dict(temperature=-1.0), r"generate: temperature=-1.0 must be >= 0"),
    (dict(temperature=1.0, top_k=0, rng=jax.random.key(0)), r"generate: top_k=0 must be in \[1, vocab_size=61\]"),
    (dict(temperature=1.0), r"generate: rng=None must be a jax.random.key when temperature > 0"),
])
def test_lm_generate_rejects_bad_arguments(tiny_config, kwargs, message):
    model = _model(tiny_config)
    with pytest.raises(ValueError, match=message):
        generate(model, jnp.zeros((1, 3), jnp.int32), **{"max_new_tokens": 2, **kwargs})
