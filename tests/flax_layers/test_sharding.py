"""Tests of shard_model on 8 fake CPU devices (tests/conftest.py sets XLA_FLAGS): mostly a (data=2, model=4) mesh."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_mamba2.flax_layers import Mamba2, Mamba2Block, Mamba2LMHeadModel, generate, shard_model
from jax_mamba2.flax_layers.partition import HeadShard, Segment
from tests.flax_layers._programs import walk

BATCH, SEQLEN = 4, 12


@pytest.fixture
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _model(config):
    return Mamba2LMHeadModel(config, backend="xla", rngs=nnx.Rngs(0))


def _ids(config, mesh, length=SEQLEN, batch=BATCH):
    ids = jax.random.randint(jax.random.key(0), (batch, length), 0, config.vocab_size)
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


@pytest.mark.parametrize("remat", [False, "matmuls"])
def test_shard_model_grads_match_single_device_with_groups_split(tiny_config, mesh, remat):
    """Also with remat="matmuls" on the sharded model (in_proj's pieces of each shard kept, the rest replayed)."""
    config = tiny_config.replace(n_layer=2, ssm_cfg={**tiny_config.ssm_cfg, "ngroups": 4})  # 1 group per shard
    ids, sharded_ids = _ids(config, mesh)

    def loss(model, ids):
        logits = model(ids[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1))

    value_and_grad = nnx.jit(nnx.value_and_grad(loss))
    expected_loss, expected_grads = value_and_grad(_model(config), ids)
    sharded = shard_model(Mamba2LMHeadModel(config, backend="xla", remat=remat, rngs=nnx.Rngs(0)), mesh)
    sharded_loss, sharded_grads = value_and_grad(sharded, sharded_ids)
    np.testing.assert_allclose(sharded_loss, expected_loss, rtol=1e-6)
    for (path, g), e in zip(nnx.to_flat_state(sharded_grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(g[...], e, rtol=1e-4, atol=1e-7, err_msg=str(path))


def test_shard_model_packed_sequences_match_single_device(tiny_config, mesh):
    """seq_idx through the head-parallel mixers: the loss of packed rows, its gradients and a prefill."""
    ids, sharded_ids = _ids(tiny_config, mesh)
    seq_idx = jnp.asarray(np.repeat([[0] * 5 + [1] * 4 + [2] * 3], BATCH, axis=0), jnp.int32)
    sharded_seq_idx = jax.device_put(seq_idx, NamedSharding(mesh, P("data")))

    def loss(model, ids, seq_idx):
        return model.loss(ids, seq_idx=seq_idx)

    def prefill(model, ids, seq_idx):
        return model.prefill(ids, seq_idx=seq_idx)

    model = _model(tiny_config)
    (expected_loss, expected_grads), expected_prefill = (nnx.jit(nnx.value_and_grad(loss))(model, ids, seq_idx),
                                                         nnx.jit(prefill)(model, ids, seq_idx))
    shard_model(model, mesh)
    sharded_loss, sharded_grads = nnx.jit(nnx.value_and_grad(loss))(model, sharded_ids, sharded_seq_idx)
    np.testing.assert_allclose(sharded_loss, expected_loss, rtol=1e-6)
    for (path, g), e in zip(nnx.to_flat_state(sharded_grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(g[...], e, rtol=1e-4, atol=1e-7, err_msg=str(path))
    for got, want in zip(jax.tree.leaves(nnx.jit(prefill)(model, sharded_ids, sharded_seq_idx)),
                         jax.tree.leaves(expected_prefill)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_shape, ngroups, tie_embeddings, vocab_multiple", [
    ((8, 1), 2, True, 8),  # all data: the mixers name no model axis
    ((1, 8), 8, False, 1),  # all model, one group per shard (B/C split like the heads); 61 columns: head whole
    ((1, 8), 1, False, 8),  # all model, one group over every shard; 64 columns: head split over the vocabulary
], ids=["data=8", "model=8-ngroups8-untied-whole", "model=8-ngroups1-untied-split"])
def test_shard_model_loss_and_grads_match_single_device_on_a_mesh_of_one_axis(
        tiny_config, mesh_shape, ngroups, tie_embeddings, vocab_multiple):
    """The loss and its gradients with all 8 devices on the data axis or on the model axis: the groups split
    with the heads or one spanning every shard, and an untied LM head split over the vocabulary or (a padded
    vocabulary the model axis does not divide) whole on every shard."""
    mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    config = tiny_config.replace(n_layer=1, tie_embeddings=tie_embeddings, pad_vocab_size_multiple=vocab_multiple,
                                 ssm_cfg={**tiny_config.ssm_cfg, "ngroups": ngroups})
    ids, sharded_ids = _ids(config, mesh, batch=8)
    value_and_grad = nnx.jit(nnx.value_and_grad(lambda model, ids: model.loss(ids)))
    expected_loss, expected_grads = value_and_grad(_model(config), ids)
    sharded = shard_model(_model(config), mesh)
    if not tie_embeddings:
        split = config.padded_vocab_size % mesh.shape["model"] == 0
        assert sharded.lm_head.kernel.sharding.spec == (P(None, "model") if split else P(None, None))
    sharded_loss, sharded_grads = value_and_grad(sharded, sharded_ids)
    np.testing.assert_allclose(sharded_loss, expected_loss, rtol=1e-6)
    _assert_grads_match(sharded_grads, expected_grads)


@pytest.mark.parametrize("backend, remat", [("xla", "matmuls"), ("scan", True)])
def test_shard_model_packed_sequences_match_single_device_with_the_layers_unrolled(tiny_config, mesh, backend,
                                                                                   remat):
    """seq_idx through the unrolled blocks (scan_layers=False) under remat, on the xla and scan SSD backends: the
    loss of packed rows and its gradients, against one device's layer loop without remat."""
    config = tiny_config.replace(n_layer=2)
    ids, sharded_ids = _ids(config, mesh)
    seq_idx = jnp.asarray(np.repeat([[0] * 5 + [1] * 4 + [2] * 3], BATCH, axis=0), jnp.int32)
    sharded_seq_idx = jax.device_put(seq_idx, NamedSharding(mesh, P("data")))
    value_and_grad = nnx.jit(nnx.value_and_grad(lambda model, ids, seq_idx: model.loss(ids, seq_idx=seq_idx)))
    expected_loss, expected_grads = value_and_grad(Mamba2LMHeadModel(config, backend=backend, rngs=nnx.Rngs(0)), ids,
                                                   seq_idx)
    sharded = shard_model(Mamba2LMHeadModel(config, backend=backend, scan_layers=False, remat=remat,
                                            rngs=nnx.Rngs(0)), mesh)
    sharded_loss, sharded_grads = value_and_grad(sharded, sharded_ids, sharded_seq_idx)
    np.testing.assert_allclose(sharded_loss, expected_loss, rtol=1e-6)
    _assert_grads_match(sharded_grads, expected_grads)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (8, 1)], ids=["data=2,model=4", "data=8"])
@pytest.mark.parametrize("reduction, chunk_tokens", [("mean", 16), ("sum", 7), ("none", 16)])
def test_a_sharded_loss_of_several_chunks_takes_each_shards_rows_and_gathers_no_activation(
        tiny_config, mesh_shape, reduction, chunk_tokens):
    """A loss of more chunks than one (8 x 16 tokens: a chunk a row, or 7 tokens that straddle the rows): each
    device takes the loss of its own rows (no all-gather of the hidden states onto every device, which XLA made
    for the loop over chunks along the data-split token axis), with one device's values and gradients; the mean
    over every shard's scored tokens (the first two rows score none)."""
    mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    config = tiny_config.replace(n_layer=1)
    ids, sharded_ids = _ids(config, mesh, length=16, batch=8)
    labels = ids.at[:2].set(-100)

    def loss(model, ids, labels):
        return jnp.sum(model.loss(ids, labels, chunk_tokens=chunk_tokens, reduction=reduction))

    expected_loss, expected_grads = nnx.value_and_grad(loss)(_model(config), ids, labels)
    graphdef, state = nnx.split(shard_model(_model(config), mesh))
    step = jax.jit(jax.value_and_grad(lambda state, ids, labels: loss(nnx.merge(graphdef, state), ids, labels)))
    sharded_labels = jax.device_put(labels, NamedSharding(mesh, P("data")))
    assert "all-gather" not in step.lower(state, sharded_ids, sharded_labels).compile().as_text()
    sharded_loss, sharded_grads = step(state, sharded_ids, sharded_labels)
    np.testing.assert_allclose(sharded_loss, expected_loss, rtol=1e-6)
    _assert_grads_match(sharded_grads, expected_grads)


def _assert_grads_match(sharded_grads, expected_grads, rtol=5e-5):
    """Relative L2 error of every gradient leaf, at most rtol. Element-wise, an atol that passes the embedding's
    entries summed with cancellation (their f32 rounding reaches 1e-7 to 4e-7 on entries near 1e-3) would pass
    the gradients of A_log and dt_bias (entries of 1e-6 to 1e-4) on its own. D's with one head per group is the
    farthest (about 1e-5: as far as one device's f32 gradient is from float64's there)."""
    for (path, g), e in zip(nnx.to_flat_state(sharded_grads), jax.tree.leaves(expected_grads)):
        assert np.linalg.norm(g[...] - e) <= rtol * np.linalg.norm(e), path


def test_shard_model_generates_left_padded_prompts_like_one_device(tiny_config, mesh):
    """generate(prompt_lengths=) on the head-parallel model (the composed step): the one-device tokens."""
    prompt = np.asarray(jax.random.randint(jax.random.key(1), (BATCH, 7), 0, tiny_config.vocab_size))
    model = _model(tiny_config)
    want = np.asarray(generate(model, prompt, 5, prompt_lengths=[1, 3, 7, 2]))
    shard_model(model, mesh)
    np.testing.assert_array_equal(generate(model, prompt, 5, prompt_lengths=[1, 3, 7, 2]), want)


def test_a_sharded_block_takes_no_residual_as_one_device_does(tiny_config, mesh):
    """Mamba2Block(hidden, None) with the block sharded: its norm runs per shard of the rows with no residual, and
    the block's outputs are those of one device (and of a zero stream)."""
    block = Mamba2Block(tiny_config, backend="xla", rngs=nnx.Rngs(0))
    hidden = jax.random.normal(jax.random.key(4), (BATCH, SEQLEN, tiny_config.d_model))
    want = block(hidden, None)
    sharded = shard_model(block, mesh)
    got = sharded(jax.device_put(hidden, NamedSharding(mesh, P("data"))), None)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for a, b in zip(got, sharded(hidden, jnp.zeros_like(hidden))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
    with pytest.raises(ValueError, match=r"shard_model: data_axis and model_axis must be different mesh axes; "
                                         r"both are 'model'"):
        shard_model(_model(tiny_config), mesh, data_axis="model", model_axis="model")


def test_shard_model_names_the_axis_argument_the_mesh_lacks(tiny_config, mesh):
    """An axis name the mesh does not have: the error names the argument that gave it and the mesh's axes, and the
    model is left as it was."""
    model = _model(tiny_config.replace(n_layer=1))
    for kwargs in (dict(data_axis="batch"), dict(model_axis="tp")):
        (name, axis), = kwargs.items()
        with pytest.raises(ValueError, match=re.escape(f"shard_model: {name}={axis!r} must be an axis of the mesh, "
                                                       "one of mesh.axis_names=('data', 'model')")):
            shard_model(model, mesh, **kwargs)
    data_only = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match=re.escape("shard_model: model_axis='model' must be an axis of the mesh")):
        shard_model(model, data_only)
    assert model.layers.mixer.mesh_axes is None and model.norm_f.mesh_axes is None


def test_shard_model_checks_every_mixer_before_it_changes_any(mesh):
    """A module whose second mixer the model axis cannot split is refused and left as it was: its first mixer is
    not half-sharded."""
    class Two(nnx.Module):
        def __init__(self):
            self.a = Mamba2(32, d_state=8, headdim=16, chunk_size=8, backend="xla", rngs=nnx.Rngs(0))  # 4 heads
            self.b = Mamba2(32, d_state=8, headdim=32, chunk_size=8, backend="xla", rngs=nnx.Rngs(1))  # 2 heads

    two = Two()
    with pytest.raises(ValueError, match=r"shard_model: nheads=2 and d_model=32 must be divisible by"):
        shard_model(two, mesh)
    assert two.a.mesh_axes is None and two.b.mesh_axes is None
    assert two.a(jnp.ones((3, 8, 32))).shape == (3, 8, 32)  # still a one-device layer: any batch
    with pytest.raises(TypeError, match=r"shard_model: data_axis=\['model'\] must be the name of a mesh axis"):
        shard_model(two, mesh, data_axis=["model"])


def test_a_sharded_model_names_a_batch_the_data_axis_does_not_split(tiny_config, mesh):
    """A batch of 3 rows on a data axis of 2: every entry point says so, naming its own argument, before tracing."""
    model = shard_model(_model(tiny_config.replace(n_layer=1)), mesh)
    ids = jnp.zeros((3, 8), jnp.int32)
    divisible = r"\.shape\[0\]=3 \(the batch\) must be divisible by 2, the size of the mesh axis 'data'"
    for call, api in ((lambda: model(ids), "Mamba2LMHeadModel.__call__: input_ids"),
                      (lambda: model.loss(ids), "Mamba2LMHeadModel.loss: input_ids"),
                      (lambda: model.prefill(ids), "Mamba2LMHeadModel.prefill: input_ids"),
                      (lambda: generate(model, ids, 2), "generate: prompt_ids")):
        with pytest.raises(ValueError, match=re.escape(api) + divisible):
            call()
    hidden = jnp.zeros((3, 8, tiny_config.d_model))
    with pytest.raises(ValueError, match=re.escape("Mamba2.__call__: hidden_states") + divisible):
        model.layers.mixer(hidden)
    with pytest.raises(ValueError, match=re.escape("Mamba2Block.__call__: hidden_states") + divisible):
        model.layers(hidden, hidden)


def test_shard_model_empty_sequence_gives_empty_logits(tiny_config, mesh):
    model = shard_model(_model(tiny_config.replace(n_layer=1)), mesh)
    _, sharded_ids = _ids(tiny_config, mesh, length=0)
    logits = model(sharded_ids)
    assert logits.shape == (BATCH, 0, tiny_config.padded_vocab_size)
@pytest.mark.parametrize("tokens, collective", [(3, "reduce-scatter"), (12, "all-to-all")])
def test_head_shard_project_moves_activations_for_few_tokens_and_weights_for_many(tokens, collective):
    # in_proj's product on 2 devices: below d_in tokens the partial products are reduce-scattered, from d_in
    # on the kernel's columns come by an all-to-all; both give each device its pieces, and the same gradients.
    d_in, size = 8, 2
    segments = (Segment(6, True), Segment(4, False), Segment(2, True))  # sharded, replicated, sharded
    mesh = jax.make_mesh((size,), ("model",), axis_types=(AxisType.Auto,), devices=jax.devices()[:size])
    inputs, kernel, weights = (jax.random.normal(k, shape) for k, shape in zip(
        jax.random.split(jax.random.key(0), 3), [(tokens, d_in), (d_in, 12), (size, tokens, 3 + 4 + 1)]))

    def per_device(inputs, kernel_rows):
        return jnp.concatenate(HeadShard("model", size).project(inputs, kernel_rows, segments), axis=-1)[None]

    project = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("model", None)), out_specs=P("model"))

    def expected(inputs, kernel):  # device r: block r of each sharded segment, the replicated one whole
        full = jnp.split(inputs @ kernel, [6, 10], axis=-1)
        return jnp.stack([jnp.concatenate([full[0][:, 3 * r:3 * r + 3], full[1], full[2][:, r:r + 1]], axis=-1)
                          for r in range(size)])

    hlo = jax.jit(project).lower(inputs, kernel).compile().as_text()
    assert collective in hlo and "all-gather" not in hlo
    np.testing.assert_allclose(project(inputs, kernel), expected(inputs, kernel), rtol=1e-5, atol=1e-6)
    grads = jax.grad(lambda *a: jnp.sum(project(*a) * weights), argnums=(0, 1))(inputs, kernel)
    expected_grads = jax.grad(lambda *a: jnp.sum(expected(*a) * weights), argnums=(0, 1))(inputs, kernel)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_shard_model_runs_the_norms_outside_the_mixers_per_shard_of_the_rows(tiny_config, mesh):
    """The blocks' add + norm and the final norm run inside shard_maps of their own over the data axis (each
    device normalizes its rows: the norm kernels' custom calls have no partitioning rule, so left to XLA they
    would get every row); the mixer's gated norm runs inside the mixer's shard_map."""
    model = shard_model(_model(tiny_config), mesh)
    assert model.layers.norm.mesh_axes.data_axis == "data" and model.layers.norm.mesh_axes.model_axis is None
    assert model.norm_f.mesh_axes is not None and model.layers.mixer.norm.mesh_axes is None
    _, sharded_ids = _ids(tiny_config, mesh)
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda state, ids: nnx.merge(graphdef, state).loss(ids))(state, sharded_ids)
    row_maps = [(loops, eqn.params["out_specs"]) for eqn, loops in walk(jaxpr) if eqn.primitive.name == "shard_map"
                and eqn.params["in_specs"] == (P("data"), P("data"), P())]
    assert row_maps == [((("scan", tiny_config.n_layer),), (P("data"), P("data"))), ((), (P("data"),))], row_maps


def test_shard_model_on_a_model_axis_of_size_one_is_data_parallel(tiny_config):
    # A size-1 model axis is not named inside the mixers: values there are then not typed as varying over
    # it, and shard_map accepts the replicated outputs.
    mesh = jax.make_mesh((2, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:2])
    config = tiny_config.replace(n_layer=1)
    ids, _ = _ids(config, mesh)
    expected = nnx.jit(lambda m, ids: m(ids))(_model(config), ids)
    model = shard_model(_model(config), mesh)
    assert model.layers.mixer.mesh_axes.model_axis is None
    logits = nnx.jit(lambda m, ids: m(ids))(model, jax.device_put(ids, NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
