"""Tests of Mamba2Block and Mamba2LMHeadModel (jax_mamba2/flax_layers/lm.py)."""
import contextlib
import dataclasses
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from jax_mamba2.flax_layers import Mamba2Block, Mamba2Config, Mamba2LMHeadModel, generate, save_pretrained, shard_model
from benchmarks.tools import saved_activations
from tests.flax_layers._programs import walk

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


def test_traced_ids_past_the_rows_give_nan_and_negative_ones_count_from_the_end(tiny_config):
    """Under jit the ids cannot be checked: what `__call__` documents for them. A negative id takes the row that
    many from the end of the padded embedding, a real token's unless it falls into the padding."""
    model = _model(tiny_config)  # 61 tokens padded to 64 rows
    logits = nnx.jit(lambda m, ids: m(ids))
    np.testing.assert_array_equal(logits(model, jnp.array([[-10, -1]])), logits(model, jnp.array([[54, 63]])))
    assert bool(jnp.isnan(logits(model, jnp.array([[64]]))).all())


def test_lm_bf16_embedding_starts_as_the_float32_one_rounded(tiny_config):
    """The embedding's N(0, 0.02) is drawn in float32 and rounded, as PyTorch initializes a bfloat16 module (and as
    the mixers' parameters are): drawn in bfloat16 the normal takes 128 values, none beyond 2.9 deviations."""
    wide = _model(tiny_config).embedding.embedding[...]
    half = _model(tiny_config, param_dtype=jnp.bfloat16).embedding.embedding[...]
    assert half.dtype == jnp.bfloat16
    np.testing.assert_array_equal(half, wide.astype(jnp.bfloat16))
    assert float(jnp.abs(half).max()) > 3 * 0.02 and np.unique(np.asarray(half, np.float32)).size > 1000


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


@pytest.mark.parametrize("ssm_cfg", [{}, dict(d_ssm=32)], ids=["fused_step", "composed_step"])
def test_a_model_closed_over_by_jax_transformations_prefills_and_steps(tiny_config, ssm_cfg):
    """jax.jit, jax.vmap, jax.checkpoint and jax.eval_shape of a function that closes over the model (as they take
    `__call__` and `loss`): prefill and step (the composed one, with the gated-MLP branch, loops over the layers as
    prefill does) give what the model passed as an argument to nnx.jit gives."""
    model = _model(tiny_config.replace(ssm_cfg={**tiny_config.ssm_cfg, **ssm_cfg}))
    ids = _token_ids(tiny_config, seed=2)
    want_prefill = nnx.jit(lambda m, ids: m.prefill(ids))(model, ids[:, :-1])
    want_step = nnx.jit(lambda m, token, cache: m.step(token, cache))(model, ids[:, -1], want_prefill[1])

    def prefill_and_step(ids):
        logits, cache = model.prefill(ids[:, :-1])
        return logits, model.step(ids[:, -1], cache)

    want = (want_prefill[0], want_step)
    for transformed in (jax.jit(prefill_and_step), jax.checkpoint(prefill_and_step),
                        lambda ids: jax.tree.map(lambda a: a[0], jax.vmap(prefill_and_step)(ids[None]))):
        for got, expected in zip(jax.tree.leaves(transformed(ids)), jax.tree.leaves(want)):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    shapes = jax.eval_shape(prefill_and_step, ids)
    assert [(s.shape, s.dtype) for s in jax.tree.leaves(shapes)] == [(a.shape, a.dtype) for a in jax.tree.leaves(want)]


@pytest.mark.parametrize("remat", [True, "matmuls"])
def test_lm_grads_finite_and_equal_with_remat(tiny_config, remat):
    ids = _token_ids(tiny_config, seed=2)

    def loss(model):
        logits = model(ids[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1))

    # The "scan" backend keeps the two backward compilations short; the mixer test covers "xla" grads.
    grads = nnx.jit(nnx.grad(loss))(_model(tiny_config, backend="scan"))
    remat_grads = nnx.jit(nnx.grad(loss))(_model(tiny_config, backend="scan", remat=remat))
    for (path, g), r in zip(nnx.to_flat_state(grads), jax.tree.leaves(remat_grads)):
        assert bool(jnp.isfinite(g[...]).all()) and float(jnp.abs(g[...]).max()) > 0, path
        np.testing.assert_allclose(r, g[...], rtol=1e-4, atol=1e-6)


def test_remat_matmuls_keeps_in_proj_output_for_the_backward_and_less_than_without_remat(tiny_config):
    """remat="matmuls" keeps in_proj's output and the blocks' inputs; True only the inputs; False all
    that the backward reads. Bytes of the activations the loss's backward keeps (the parameters left out)."""
    ids = _token_ids(tiny_config, seed=5)

    def saved(remat):
        graphdef, state = nnx.split(_model(tiny_config, remat=remat))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            print_saved_residuals(lambda state: nnx.merge(graphdef, state).loss(ids), state)
        return [s for s in saved_activations.parse_saved(printed.getvalue())
                if not s["source"].startswith("from the argument")]

    kept = {remat: saved(remat) for remat in (False, "matmuls", True)}
    total = {remat: sum(s["bytes"] for s in arrays) for remat, arrays in kept.items()}
    assert total[True] < total["matmuls"] < total[False]
    # in_proj's output of every layer, stacked by the layer scan: (n_layer, batch, seqlen, d_in_proj)
    mixer = _model(tiny_config).layers.mixer
    in_proj = (tiny_config.n_layer, *ids.shape, mixer.in_proj.kernel.shape[-1])
    assert [s["shape"] for s in kept["matmuls"]].count(in_proj) == 1
    assert in_proj not in [s["shape"] for s in kept[True]]
    with pytest.raises(ValueError, match='remat=\'dots\' must be False, "matmuls" or True'):
        _model(tiny_config, remat="dots")
    with pytest.raises(TypeError, match='remat=1 must be False, "matmuls" or True'):
        _model(tiny_config, remat=1)


@pytest.mark.parametrize("remat,given,saved", [
    (False, None, False), ("matmuls", None, True), (True, None, True), ("matmuls", False, False), (False, True, True)])
def test_chunk_states_are_kept_by_default_only_under_remat(tiny_config, remat, given, saved):
    """save_chunk_states=None (the default) keeps the SSD's chunk states under remat, where the replayed forward
    writes them right before the block's backward, and recomputes them without it; a bool is taken as given."""
    options = {} if given is None else dict(save_chunk_states=given)
    assert _model(tiny_config, remat=remat, **options).layers.mixer.save_chunk_states is saved
    with pytest.raises(TypeError, match="save_chunk_states='yes' must be a bool"):
        _model(tiny_config, save_chunk_states="yes")


@pytest.mark.parametrize("call,message", [
    (lambda: Mamba2Block({"d_model": 8}, rngs=nnx.Rngs(0)), r"Mamba2Block: config must be a Mamba2Config"),
    (lambda: Mamba2LMHeadModel({"d_model": 8}, rngs=nnx.Rngs(0)), r"Mamba2LMHeadModel: config must be a Mamba2Config"),
    (lambda: save_pretrained(object(), "unused"), r"save_pretrained: model must be a Mamba2LMHeadModel, got object"),
    (lambda: shard_model(object(), None), r"shard_model: model must be an nnx.Module, got object"),
])
def test_entry_points_reject_objects_of_the_wrong_type(call, message):
    with pytest.raises(TypeError, match=message):
        call()


@pytest.mark.parametrize("make", [Mamba2Block, Mamba2LMHeadModel])
@pytest.mark.parametrize("options,error,message", [
    (dict(rngs=0), TypeError, r"rngs must be an nnx.Rngs, e.g. nnx.Rngs\(0\); got int"),
    (dict(rngs=jax.random.key(0)), TypeError, r"rngs must be an nnx.Rngs"),
    (dict(param_dtype=jnp.int32), TypeError, r"param_dtype=int32 must be one of bfloat16, float16, float32, float64"),
    (dict(param_dtype="bf16"), TypeError, r"param_dtype='bf16' must be a float dtype"),
    (dict(dtype="float8_e4m3fn"), TypeError, r"dtype=float8_e4m3fn must be one of bfloat16"),
    (dict(backend="triton"), ValueError, r"backend='triton' must be one of 'auto', 'xla', 'scan'"),
    (dict(check_finite="yes"), TypeError, r"check_finite='yes' must be a bool"),
    (dict(deterministic_backward=1), TypeError, r"deterministic_backward=1 must be a bool"),
])
def test_constructors_check_their_options_before_building_anything(tiny_config, make, options, error, message):
    """Named by the constructor the user called, not by the mixers it builds, flax's initializers or the
    embedding's."""
    options = dict(dict(rngs=nnx.Rngs(0)), **options)
    with pytest.raises(error, match=f"{make.__name__}: {message}"):
        make(tiny_config, **options)


@pytest.fixture(scope="module")
def tiny_lm():
    """tiny_config's model: 3 layers, conv_dim = 64 + 2 * 2 * 8 = 96, 8 heads of headdim 8, d_state 8."""
    config = Mamba2Config(d_model=32, n_layer=3, vocab_size=61,
                          ssm_cfg=dict(d_state=8, headdim=8, ngroups=2, chunk_size=8))
    return _model(config)


def _lm_cache(model, batch=BATCH, **shapes):
    return model.init_cache(batch)._replace(**{k: jnp.zeros(v) for k, v in shapes.items()})


def _block(model):
    return Mamba2Block(model.config, backend="xla", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("call, error, message", [
    pytest.param(lambda m: m(jnp.zeros((BATCH, SEQLEN))), TypeError,
                 r"Mamba2LMHeadModel.__call__: input_ids.dtype=float32 must be integer", id="call_float"),
    pytest.param(lambda m: m(jnp.zeros((SEQLEN,), jnp.int32)), ValueError,
                 r"Mamba2LMHeadModel.__call__: input_ids.shape=\(12,\) must be \(batch, seqlen\)", id="call_1d"),
    pytest.param(lambda m: m.prefill(jnp.zeros((BATCH, SEQLEN, 1), jnp.int32)), ValueError,
                 r"Mamba2LMHeadModel.prefill: input_ids.shape=\(2, 12, 1\) must be \(batch, seqlen\)",
                 id="prefill_3d"),
    pytest.param(lambda m: m.prefill(jnp.zeros((BATCH, SEQLEN), jnp.int32), m.init_cache(3)), ValueError,
                 r"Mamba2LMHeadModel.prefill: cache.conv_state.shape=\(3, 3, 96, 4\) must be "
                 r"\(n_layer, batch, conv_dim, d_conv\)=\(3, 2, 96, 4\)", id="prefill_cache_batch"),
    pytest.param(lambda m: m.prefill(jnp.zeros((BATCH, SEQLEN), jnp.int32), m.layers.mixer.init_cache(BATCH)),
                 ValueError, r"Mamba2LMHeadModel.prefill: cache.conv_state.shape=\(2, 96, 4\) must be "
                 r"\(n_layer, batch, conv_dim, d_conv\)", id="prefill_one_layer_cache"),
    pytest.param(lambda m: m.step(jnp.zeros((BATCH, 1), jnp.int32), m.init_cache(BATCH)), ValueError,
                 r"Mamba2LMHeadModel.step: input_ids.shape=\(2, 1\) must be \(batch,\)$", id="step_2d"),
    pytest.param(lambda m: m.step(jnp.zeros((BATCH,), jnp.int32), _lm_cache(m, ssm_state=(2, BATCH, 8, 8, 8))),
                 ValueError, r"Mamba2LMHeadModel.step: cache.ssm_state.shape=\(2, 2, 8, 8, 8\) must be "
                 r"\(n_layer, batch, nheads, headdim, d_state\)=\(3, 2, 8, 8, 8\)", id="step_cache_n_layer"),
    pytest.param(lambda m: m.step(jnp.zeros((BATCH,)), m.init_cache(BATCH)), TypeError,
                 r"Mamba2LMHeadModel.step: input_ids.dtype=float32 must be integer", id="step_float"),
    pytest.param(lambda m: m(jnp.zeros((BATCH, SEQLEN), jnp.int32), seq_idx=jnp.zeros((BATCH, SEQLEN - 1), jnp.int32)),
                 ValueError, r"Mamba2LMHeadModel.__call__: seq_idx.shape=\(2, 11\) must be \(batch, seqlen\)=\(2, 12\)",
                 id="call_seq_idx_shape"),
    pytest.param(lambda m: m.loss(jnp.zeros((BATCH, SEQLEN), jnp.int32), seq_idx=jnp.zeros((BATCH, SEQLEN))),
                 TypeError, r"Mamba2LMHeadModel.loss: seq_idx.dtype=float32 must be integer", id="loss_seq_idx_float"),
    pytest.param(lambda m: m.loss(jnp.zeros((BATCH, SEQLEN), jnp.int32), jnp.zeros((BATCH, SEQLEN, 1), jnp.int32)),
                 ValueError, r"Mamba2LMHeadModel.loss: labels.shape=\(2, 12, 1\) must be \(batch, seqlen\)=\(2, 12\)",
                 id="loss_labels_3d"),
    pytest.param(lambda m: m.loss(jnp.zeros((BATCH, SEQLEN), jnp.int32), [[1] * SEQLEN] * BATCH), TypeError,
                 r"Mamba2LMHeadModel.loss: labels must be an array of shape \(batch, seqlen\)=\(2, 12\), got list",
                 id="loss_labels_list"),
    pytest.param(lambda m: m.loss(jnp.zeros((BATCH, SEQLEN), jnp.int32), ignore_index="x"), TypeError,
                 r"Mamba2LMHeadModel.loss: ignore_index='x' must be an int", id="loss_ignore_index"),
    pytest.param(lambda m: m.prefill(jnp.zeros((BATCH, SEQLEN), jnp.int32), m.init_cache(BATCH),
                                     seq_idx=jnp.zeros((BATCH, SEQLEN), jnp.int32)),
                 ValueError, r"Mamba2LMHeadModel.prefill: seq_idx needs cache=None", id="prefill_seq_idx_cache"),
    pytest.param(lambda m: m(jnp.full((BATCH, SEQLEN), 61, jnp.int32)), ValueError,
                 r"Mamba2LMHeadModel.__call__: input_ids must be in \[0, vocab_size=61\); input_ids\[0, 0\]=61",
                 id="call_id_past_vocab"),
    pytest.param(lambda m: m.step(jnp.full((BATCH,), -1, jnp.int32), m.init_cache(BATCH)), ValueError,
                 r"Mamba2LMHeadModel.step: input_ids must be in \[0, vocab_size=61\); input_ids\[0\]=-1", id="step_id"),
    pytest.param(lambda m: m.prefill(jnp.full((BATCH, SEQLEN), 99, jnp.int32)), ValueError,
                 r"Mamba2LMHeadModel.prefill: input_ids must be in \[0, vocab_size=61\)", id="prefill_id"),
    pytest.param(lambda m: m.loss(jnp.full((BATCH, SEQLEN), -3, jnp.int32)), ValueError,
                 r"Mamba2LMHeadModel.loss: input_ids must be in \[0, vocab_size=61\)", id="loss_id"),
    pytest.param(lambda m: m.loss(jnp.zeros((BATCH, SEQLEN), jnp.int32), jnp.zeros((BATCH, SEQLEN), jnp.int32)
                                  .at[0, 5].set(-100).at[1, 3].set(61)), ValueError,
                 r"Mamba2LMHeadModel.loss: labels\[:, 1:\] must be in \[0, vocab_size=61\) or ignore_index=-100; "
                 r"labels\[:, 1:\]\[1, 2\]=61 \(1 ids out of range\)", id="loss_label_past_vocab"),
    pytest.param(lambda m: m.loss(jnp.zeros((BATCH, SEQLEN), jnp.int32),
                                  shift_labels=jnp.full((BATCH, SEQLEN), -100, jnp.int32).at[0, 0].set(-1),
                                  ignore_index=-100), ValueError,
                 r"Mamba2LMHeadModel.loss: shift_labels must be in \[0, vocab_size=61\) or ignore_index=-100; "
                 r"shift_labels\[0, 0\]=-1", id="loss_shift_label_negative"),
    pytest.param(lambda m: m(jnp.zeros((BATCH, SEQLEN), jnp.int32), seq_idx=np.full((BATCH, SEQLEN), 2 ** 32)),
                 ValueError, r"Mamba2LMHeadModel.__call__: seq_idx must hold ids int32 holds", id="seq_idx_past_int32"),
    pytest.param(lambda m: m.init_cache(-1), ValueError,
                 r"Mamba2LMHeadModel.init_cache: batch_size=-1 must be an int >= 0", id="init_cache"),
    pytest.param(lambda m: _block(m)(jnp.ones((BATCH, SEQLEN, 32)), jnp.ones((BATCH, SEQLEN - 1, 32))), ValueError,
                 r"Mamba2Block.__call__: residual.shape=\(2, 11, 32\) must be \(batch, seqlen, d_model\)="
                 r"\(2, 12, 32\)", id="block_residual"),
    pytest.param(lambda m: _block(m).prefill(jnp.ones((BATCH, SEQLEN, 16)), jnp.ones((BATCH, SEQLEN, 16))),
                 ValueError, r"Mamba2Block.prefill: hidden_states.shape=\(2, 12, 16\) must be "
                 r"\(batch, seqlen, d_model\)=\(batch, seqlen, 32\)", id="block_prefill_d_model"),
    pytest.param(lambda m: _block(m).step(jnp.ones((BATCH, 32)), jnp.ones((BATCH, 32)), m.init_cache(BATCH)),
                 ValueError, r"Mamba2Block.step: cache.conv_state.shape=\(3, 2, 96, 4\) must be "
                 r"\(batch, conv_dim, d_conv\)=\(2, 96, 4\)", id="block_step_lm_cache"),
    pytest.param(lambda m: _block(m)(jax.random.normal(jax.random.key(0), (BATCH, SEQLEN, 32)),
                                     jax.random.normal(jax.random.key(1), (BATCH, SEQLEN, 32), jnp.float8_e4m3fn)),
                 TypeError, r"Mamba2Block.__call__: residual.dtype=float8_e4m3fn must be one of bfloat16, float16, "
                 r"float32, float64", id="block_residual_float8"),
    pytest.param(lambda m: m.step(jnp.zeros((BATCH,), jnp.int32), m.init_cache(BATCH)._replace(
                     conv_state=jax.random.normal(jax.random.key(2), (3, BATCH, 96, 4), jnp.float8_e5m2))),
                 TypeError, r"Mamba2LMHeadModel.step: cache.conv_state.dtype=float8_e5m2 must be one of bfloat16",
                 id="step_cache_float8"),
])
def test_lm_rejects_bad_inputs(tiny_lm, call, error, message):
    with pytest.raises(error, match=message):
        call(tiny_lm)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_block_without_a_residual_starts_the_stream_at_its_input(tiny_lm, dtype):
    """Mamba2Block(hidden, None) (mamba_ssm's first block): as with a zero residual stream of the stream's dtype
    (float32 under residual_in_fp32), for the sequence, the prefill and a step, in value and gradient."""
    block = _block(tiny_lm)
    hidden = jax.random.normal(jax.random.key(3), (BATCH, SEQLEN, 32), jnp.float32).astype(dtype)
    zeros = jnp.zeros(hidden.shape, jnp.float32)

    def loss(residual):
        def value(hidden):
            out, stream = block(hidden, None if residual is None else residual)
            assert stream.dtype == jnp.float32
            return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(stream * jnp.cos(stream))
        return jax.value_and_grad(value)(hidden)

    def assert_equal(got, want):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    assert_equal(loss(None), loss(zeros))
    cache = block.mixer.init_cache(BATCH)
    assert_equal(block.prefill(hidden, None, cache), block.prefill(hidden, zeros, cache))
    assert_equal(block.step(hidden[:, 0], None, cache), block.step(hidden[:, 0], zeros[:, 0], cache))


@pytest.mark.parametrize("options, error, message", [
    (dict(chunk_tokens=0), ValueError, r"Mamba2LMHeadModel.loss: chunk_tokens=0 must be a positive int"),
    (dict(logits_dtype=jnp.int32), TypeError, r"Mamba2LMHeadModel.loss: logits_dtype=int32 must be one of"),
    (dict(reduction="avg"), ValueError, r"Mamba2LMHeadModel.loss: reduction='avg' must be \"mean\""),
    (dict(reduction=("mean",)), TypeError, r"Mamba2LMHeadModel.loss: reduction=\('mean',\) must be a str"),
    (dict(backend="cutile"), ValueError, r"Mamba2LMHeadModel.loss\(backend='cutile'\) cannot run this call"),
])
def test_lm_loss_checks_its_options_before_the_forward_pass(tiny_lm, monkeypatch, options, error, message):
    """The loss's own options, and whether its backend can run, are refused (named as the method's) before the
    model's forward pass runs."""
    if options.get("backend") and jax.default_backend() == "gpu":
        pytest.skip("the cutile loss runs on a GPU")
    forward_passes = []
    monkeypatch.setattr(type(tiny_lm), "_final_hidden", lambda *args: forward_passes.append(args))
    if "backend" in options:
        monkeypatch.setattr(tiny_lm, "loss_backend", options.pop("backend"))
    with pytest.raises(error, match=message):
        tiny_lm.loss(jnp.zeros((BATCH, SEQLEN), jnp.int32), **options)
    assert forward_passes == []


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_loss_of_empty_sequences_scores_no_position(tiny_lm, reduction):
    """seqlen 0: no position to score, as the model's forward of it gives no logits (not an error about the
    labels the loss shifts internally)."""
    loss = tiny_lm.loss(jnp.zeros((BATCH, 0), jnp.int32), reduction=reduction)
    assert loss.shape == ((BATCH, 0) if reduction == "none" else ()) and not np.any(loss)


def test_lm_empty_sequence_gives_empty_logits_and_keeps_the_cache(tiny_lm):
    empty = jnp.zeros((BATCH, 0), jnp.int32)
    assert tiny_lm(empty).shape == (BATCH, 0, 64)
    cache = jax.tree.map(lambda a: jax.random.normal(jax.random.key(0), a.shape, a.dtype), tiny_lm.init_cache(BATCH))
    logits, same = tiny_lm.prefill(empty, cache)
    assert logits.shape == (BATCH, 0, 64)
    for kept, given in zip(same, cache):
        np.testing.assert_array_equal(kept, given)


def _assert_same_gradients(ids, scanned, *unrolled):
    def loss(model):
        return model.loss(ids)
    grads = nnx.jit(nnx.grad(loss))(scanned)
    for model in unrolled:
        for g, u in zip(jax.tree.leaves(nnx.state(grads)), jax.tree.leaves(nnx.state(nnx.jit(nnx.grad(loss))(model)))):
            np.testing.assert_allclose(u, g, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("options", [dict(), dict(scan_layers=False, remat=True)], ids=["scan", "unrolled_remat"])
def test_packed_sequences_compute_what_separate_rows_do(tiny_config, options):
    """Two sequences packed into one row with seq_idx: the logits of each are those of the sequence alone, and
    the packed loss (the boundary's target ignored) and its gradients are the separate losses' token-weighted
    mean."""
    model = _model(tiny_config, **options)
    first, second = _token_ids(tiny_config, seed=5, shape=(1, 5)), _token_ids(tiny_config, seed=6, shape=(1, 7))
    packed = jnp.concatenate([first, second], axis=1)
    seq_idx = jnp.asarray([[0] * 5 + [1] * 7], jnp.int32)
    forward = nnx.jit(lambda m, ids, seq_idx=None: m(ids, seq_idx=seq_idx))
    logits = forward(model, packed, seq_idx)
    np.testing.assert_allclose(logits[:, :5], forward(model, first), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logits[:, 5:], forward(model, second), rtol=1e-5, atol=1e-6)
    assert not np.allclose(forward(model, packed)[:, 5:], forward(model, second), atol=1e-4)  # unpacked: they mix

    labels = packed.at[:, 5].set(-100)  # position 4's target, the next sequence's first token

    def packed_loss(m):
        return m.loss(packed, labels, seq_idx=seq_idx)

    def separate_losses(m):  # 4 and 6 scored tokens
        return (4 * m.loss(first) + 6 * m.loss(second)) / 10
    (want, want_grads), (got, got_grads) = (nnx.jit(nnx.value_and_grad(f))(model)
                                            for f in (separate_losses, packed_loss))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(nnx.state(got_grads)), jax.tree.leaves(nnx.state(want_grads))):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("prompt_len", [6, 2], ids=["longer_than_the_conv", "shorter_than_the_conv"])
def test_prefill_with_seq_idx_continues_the_last_sequence_alone(tiny_config, prompt_len):
    """Padding as sequence 0 before the prompt: the cache (the SSM state, and the conv state whose columns
    before the prompt are zero, as after the prompt alone: d_conv is 4) and the logits of the prompt and of the
    next step are the unpadded prompt's."""
    model = _model(tiny_config)
    prompt = _token_ids(tiny_config, seed=7, shape=(BATCH, prompt_len))
    padding = _token_ids(tiny_config, seed=8, shape=(BATCH, 3))
    seq_idx = jnp.asarray([[0] * 3 + [1] * prompt_len] * BATCH, jnp.int32)
    prefill = nnx.jit(lambda m, ids, seq_idx=None: m.prefill(ids, seq_idx=seq_idx))
    (want_logits, want), (got_logits, got) = prefill(model, prompt), prefill(
        model, jnp.concatenate([padding, prompt], axis=1), seq_idx)
    np.testing.assert_allclose(got_logits[:, 3:], want_logits, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    step = nnx.jit(lambda m, token, cache: m.step(token, cache)[0])
    token = prompt[:, 0]
    np.testing.assert_allclose(step(model, token, got), step(model, token, want), rtol=1e-5, atol=1e-6)


def test_unrolled_layers_compute_what_the_layer_scan_does(tiny_config):
    """scan_layers=False: logits and gradients equal the layer scan's, and the traced forward holds no loop
    over the layers."""
    ids = _token_ids(tiny_config, seed=3)
    scanned, unrolled = (_model(tiny_config, scan_layers=flag) for flag in (True, False))
    forward = nnx.jit(lambda m, ids: m(ids))
    np.testing.assert_allclose(forward(unrolled, ids), forward(scanned, ids), rtol=1e-6, atol=1e-6)
    _assert_same_gradients(ids, scanned, unrolled)

    def layer_loops(model):  # scans of n_layer steps in the traced forward (the SSD's own scans are shorter)
        graphdef, state = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda state: nnx.merge(graphdef, state)(ids))(state)
        return str(jaxpr).count(f"length={tiny_config.n_layer}")
    assert layer_loops(scanned) >= 1 and layer_loops(unrolled) == 0
    with pytest.raises(TypeError, match="scan_layers=1 must be a bool"):
        _model(tiny_config, scan_layers=1)


def test_compiler_options_ask_cublas_products_for_the_layer_scan_alone(tiny_config):
    """The layer scan's step asks XLA for cuBLAS products (no Triton GEMM fusions: XLA slices its stacks in place
    for cuBLAS calls); unrolled layers ask nothing. Each call gives a new dict, and a jit given them
    compiles here (a CPU ignores GPU options) to the same loss."""
    ids = _token_ids(tiny_config, seed=4)
    scanned, unrolled = (_model(tiny_config, scan_layers=flag) for flag in (True, False))
    options = scanned.compiler_options()
    assert options == {"xla_gpu_enable_triton_gemm": False}
    assert unrolled.compiler_options() == {}
    options["xla_gpu_enable_triton_gemm"] = True
    assert scanned.compiler_options()["xla_gpu_enable_triton_gemm"] is False
    graphdef, state = nnx.split(scanned)

    def loss(state):
        return nnx.merge(graphdef, state).loss(ids)

    np.testing.assert_array_equal(jax.jit(loss, compiler_options=scanned.compiler_options())(state),
                                  jax.jit(loss)(state))


@pytest.mark.parametrize("remat", [False, "matmuls", True])
def test_the_layer_scans_backward_reads_its_stacks_through_no_optimization_barrier(tiny_config, remat):
    """Under the layer scan no value of the differentiated step passes an optimization barrier (the loop's backward
    evaluates the checkpoints' replays, the projections' kernel conversion and the blocks' remat, without CSE
    prevention), since XLA copies a barrier's operand out of its stack; unrolled, each replay keeps its barrier
    against being merged with the forward (the projections' two a layer, the block's under remat)."""
    ids = _token_ids(tiny_config, seed=5)

    def barriers(model):
        graphdef, state = nnx.split(model)
        step = jax.jit(jax.grad(lambda state: nnx.merge(graphdef, state).loss(ids)))
        return step.lower(state).as_text().count("stablehlo.optimization_barrier")

    kwargs = dict(remat=remat, dtype=jnp.bfloat16)  # float32 parameters: the products convert their kernels
    assert barriers(_model(tiny_config, scan_layers=True, **kwargs)) == 0
    assert barriers(_model(tiny_config, scan_layers=False, **kwargs)) == tiny_config.n_layer * (3 if remat else 2)


def test_unrolled_layers_remat_decode_and_generate_like_the_layer_scan(tiny_config):
    """scan_layers=False: gradients under remat, prefill + steps and greedy generation equal the layer
    scan's."""
    ids = _token_ids(tiny_config, seed=3)
    scanned, unrolled = (_model(tiny_config, scan_layers=flag) for flag in (True, False))
    _assert_same_gradients(ids, scanned, _model(tiny_config, scan_layers=False, remat=True))

    def prefill_then_steps(model):  # three decode steps after the prompt (each one more copy of the step)
        logits, cache = model.prefill(ids[:, :5])
        pieces = [logits]
        for t in range(5, 8):
            logits, cache = model.step(ids[:, t], cache)
            pieces.append(logits[:, None])
        return jnp.concatenate(pieces, axis=1), cache
    (want, want_cache), (got, got_cache) = (nnx.jit(prefill_then_steps)(m) for m in (scanned, unrolled))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert (generate(unrolled, ids[:1, :4], 6) == generate(scanned, ids[:1, :4], 6)).all()


def test_generate_carries_the_decode_state_without_stacking_it_per_token(tiny_config):
    """generate's decode loop never stacks (copies) the whole SSM state at a token: the fused step (one device,
    no MLP branch) carries the stacked state and updates each layer's entry in place, scanned or
    unrolled; the composed step of unrolled layers (here: a model with an MLP branch) carries each layer's state
    as its own array; the composed layer scan carries the stack."""
    ids = _token_ids(tiny_config, seed=4)[:2, :4]
    mlp_config = dataclasses.replace(tiny_config, ssm_cfg={**tiny_config.ssm_cfg, "d_ssm": tiny_config.d_model})

    def decode_loop_carry_shapes(model):  # the avals carried by generate's outer scan (the decode loop)
        graphdef, state = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda state: generate(nnx.merge(graphdef, state), ids, 5))(state)
        shapes = []
        for eqn, _ in walk(jaxpr):
            if eqn.primitive.name == "scan" and eqn.params["length"] == 4:  # the 4 decode steps after the first
                shapes.append([tuple(v.aval.shape) for v in eqn.invars[eqn.params["num_consts"]:]])
        assert len(shapes) == 1
        return shapes[0]

    for config, scan_layers, fused in ((tiny_config, True, True), (tiny_config, False, True),
                                       (mlp_config, True, False), (mlp_config, False, False)):
        model = _model(config, scan_layers=scan_layers)
        assert model.layers.mixer.decodes_fused() == fused
        ssm_shape = model.layers.mixer.init_cache(2).ssm_state.shape
        carry = decode_loop_carry_shapes(model)
        per_layer = not scan_layers and not fused
        assert carry.count(ssm_shape) == (config.n_layer if per_layer else 0), (scan_layers, fused)
        assert carry.count((config.n_layer, *ssm_shape)) == (0 if per_layer else 1), (scan_layers, fused)
