"""Tests of shard_model on 8 fake CPU devices (tests/conftest.py sets XLA_FLAGS): a (data=2, model=4) mesh."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_mamba2.flax_layers import Mamba2LMHeadModel, shard_model

BATCH, SEQLEN = 4, 12


@pytest.fixture
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _model(config):
    return Mamba2LMHeadModel(config, backend="xla", rngs=nnx.Rngs(0))


def _ids(config, mesh, length=SEQLEN):
    ids = jax.random.randint(jax.random.key(0), (BATCH, length), 0, config.vocab_size)
    return ids, jax.device_put(ids, NamedSharding(mesh, P("data")))


def test_shard_model_lm_matches_single_device_without_all_gather(tiny_config, mesh):
    # tiny_config: 8 heads, ngroups=2 < 4 model shards, so B/C are replicated and each shard keeps its group.
    ids, sharded_ids = _ids(tiny_config, mesh)
    model = _model(tiny_config)
    expected = nnx.jit(lambda m, ids: m(ids))(model, ids)
    expected_prefill, cache = nnx.jit(lambda m, ids: m.prefill(ids))(model, ids[:, :-1])
    expected_step, _ = nnx.jit(lambda m, t, c: m.step(t, c))(model, ids[:, -1], cache)

    shard_model(model, mesh)
    assert model.layers.mixer.in_proj.kernel.sharding.spec == P(None, "model", None)
    assert model.layers.mixer.A_log.sharding.spec == P(None, "model")
    assert model.embedding.embedding.sharding.spec == P("model", None)

    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    hlo = forward.lower(state, sharded_ids).compile().as_text()
    assert not re.search(r"all-gather", hlo)
    assert re.search(r"reduce-scatter", hlo)  # in_proj's partial products, scattered to the heads' shards
    logits = forward(state, sharded_ids)
    assert logits.sharding.spec == P("data", None, "model")
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)

    prefill_logits, cache = nnx.jit(lambda m, ids: m.prefill(ids))(model, sharded_ids[:, :-1])
    step_logits, _ = nnx.jit(lambda m, t, c: m.step(t, c))(model, sharded_ids[:, -1], cache)
    np.testing.assert_allclose(prefill_logits, expected_prefill, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step_logits, expected_step, rtol=1e-5, atol=1e-5)


def test_shard_model_grads_match_single_device_with_groups_split(tiny_config, mesh):
    config = tiny_config.replace(n_layer=2, ssm_cfg={**tiny_config.ssm_cfg, "ngroups": 4})  # 1 group per shard
    ids, sharded_ids = _ids(config, mesh)

    def loss(model, ids):
        logits = model(ids[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1))

    value_and_grad = nnx.jit(nnx.value_and_grad(loss))
    expected_loss, expected_grads = value_and_grad(_model(config), ids)
    sharded_loss, sharded_grads = value_and_grad(shard_model(_model(config), mesh), sharded_ids)
    np.testing.assert_allclose(sharded_loss, expected_loss, rtol=1e-6)
    for (path, g), e in zip(nnx.to_flat_state(sharded_grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(g[...], e, rtol=1e-4, atol=1e-7, err_msg=str(path))


def test_shard_model_rejects_unsplittable_models(tiny_config, mesh):
    with pytest.raises(ValueError, match=r"shard_model: d_ssm=32 < d_inner=64 \(gated-MLP branch\)"):
        shard_model(_model(tiny_config.replace(ssm_cfg={**tiny_config.ssm_cfg, "d_ssm": 32})), mesh)
    three_shards = jax.make_mesh((2, 3), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                                 devices=jax.devices()[:6])
    with pytest.raises(ValueError, match=r"shard_model: ngroups=2 must divide the model axis size 3"):
        shard_model(_model(tiny_config.replace(d_model=48)), three_shards)  # 12 heads in 2 groups
    explicit = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match=r"shard_model: mesh axis 'data' has type .*Explicit"):
        shard_model(_model(tiny_config), explicit)


def test_shard_model_empty_sequence_gives_empty_logits(tiny_config, mesh):
    model = shard_model(_model(tiny_config.replace(n_layer=1)), mesh)
    _, sharded_ids = _ids(tiny_config, mesh, length=0)
    logits = model(sharded_ids)
    assert logits.shape == (BATCH, 0, tiny_config.padded_vocab_size)
