"""The chunked LM-head cross-entropy (jax_mamba2/cross_entropy.py) and `Mamba2LMHeadModel.loss`: equal to the
plain loss over materialized logits and to its gradient in float64, composing with jit, grad, vmap,
jax.checkpoint and shard_map, and holding less memory than the plain loss (compiled memory analysis)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

from jax_mamba2 import chunked_cross_entropy
from jax_mamba2.flax_layers import Mamba2LMHeadModel, shard_model
from tests._helpers import rel_l2
from tests.flax_layers._programs import walk

TOKENS, D, PADDED_VOCAB, VOCAB = 70, 16, 40, 37


def plain_loss(hidden, weight, labels, *, vocab=VOCAB, embedding=False, ignore_index=-100):
    """The reference: the whole batch's logits, softmax over the first `vocab` columns, mean over the counted
    tokens."""
    logits = (hidden @ (weight.T if embedding else weight))[..., :vocab]
    counted = labels != ignore_index
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(counted, labels, 0))
    return jnp.sum(jnp.where(counted, per_token, 0.0)) / jnp.sum(counted)


def _problem(seed, tokens=TOKENS, dtype=jnp.float64):
    keys = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(keys[0], (tokens, D), dtype)
    weight = jax.random.normal(keys[1], (D, PADDED_VOCAB), dtype)
    labels = jax.random.randint(keys[2], (tokens,), 0, VOCAB).at[::7].set(-100)
    return hidden, weight, labels


def _assert_value_and_grads_equal(f, g, args, tolerance=1e-12):
    (value, grads), (want, want_grads) = (jax.value_and_grad(fn, argnums=(0, 1))(*args) for fn in (f, g))
    assert abs(float(value - want)) < tolerance * abs(float(want))
    for got, expected in zip(grads, want_grads):
        assert rel_l2(got, expected) < tolerance


@pytest.mark.parametrize("chunk_tokens", [16, 70, 4096], ids=["partial_last_chunk", "one_exact_chunk", "large"])
@pytest.mark.parametrize("layout", ["head_weight", "embedding"])
def test_chunked_loss_and_gradient_equal_the_plain_loss_in_float64(x64, layout, chunk_tokens):
    hidden, weight, labels = _problem(0)
    embedding = layout == "embedding"
    weight = weight.T if embedding else weight

    def chunked(hidden, weight):
        return chunked_cross_entropy(hidden, labels, **{layout: weight}, vocab_size=VOCAB, chunk_tokens=chunk_tokens)

    _assert_value_and_grads_equal(jax.jit(chunked), lambda h, w: plain_loss(h, w, labels, embedding=embedding),
                                  (hidden, weight))


def plain_per_token_loss(hidden, weight, labels, *, vocab=VOCAB, ignore_index=-100):
    """The reference's per-token losses, 0 where the label is ignored."""
    counted = labels != ignore_index
    per_token = optax.softmax_cross_entropy_with_integer_labels((hidden @ weight)[..., :vocab],
                                                               jnp.where(counted, labels, 0))
    return jnp.where(counted, per_token, 0.0)


@pytest.mark.parametrize("chunk_tokens", [16, 4096])
def test_sum_and_per_token_reductions_and_their_gradients_equal_the_plain_losses_in_float64(x64, chunk_tokens):
    """reduction="sum" and "none" (each token's loss, 0 where ignored), their values and the gradients of sum /
    of a weighted sum of the per-token losses (a cotangent per token)."""
    hidden, weight, labels = _problem(3)
    weights = jax.random.uniform(jax.random.key(4), labels.shape, jnp.float64)

    def chunked(reduction):
        return lambda h, w: chunked_cross_entropy(h, labels, head_weight=w, vocab_size=VOCAB,
                                                  chunk_tokens=chunk_tokens, reduction=reduction)
    per_token = jax.jit(chunked("none"))(hidden, weight)
    assert per_token.shape == labels.shape and per_token.dtype == jnp.float64
    np.testing.assert_allclose(per_token, plain_per_token_loss(hidden, weight, labels), rtol=1e-12, atol=1e-12)
    assert (per_token[labels == -100] == 0).all()
    _assert_value_and_grads_equal(jax.jit(chunked("sum")), lambda h, w: jnp.sum(plain_per_token_loss(h, w, labels)),
                                  (hidden, weight))
    _assert_value_and_grads_equal(lambda h, w: jnp.sum(weights * chunked("none")(h, w)),
                                  lambda h, w: jnp.sum(weights * plain_per_token_loss(h, w, labels)), (hidden, weight))
    batched = chunked_cross_entropy(hidden.reshape(7, 10, D), labels.reshape(7, 10), head_weight=weight,
                                    vocab_size=VOCAB, reduction="none")
    np.testing.assert_allclose(batched, per_token.reshape(7, 10), rtol=1e-12, atol=1e-12)
    assert chunked_cross_entropy(hidden[:0], labels[:0], head_weight=weight, reduction="none").shape == (0,)


def test_padded_columns_are_excluded_and_get_no_gradient(x64):
    """Against a plain loss over all padded columns (what HF's Mamba2ForCausalLM computes) the loss differs;
    the padding columns' weights get exactly zero gradient."""
    hidden, weight, labels = _problem(1)
    loss, grad = jax.value_and_grad(
        lambda w: chunked_cross_entropy(hidden, labels, head_weight=w, vocab_size=VOCAB, chunk_tokens=32))(weight)
    assert float(loss) < float(plain_loss(hidden, weight, labels, vocab=PADDED_VOCAB))
    assert np.all(np.asarray(grad[:, VOCAB:]) == 0) and np.all(np.abs(np.asarray(grad[:, :VOCAB])).sum(0) > 0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("layout", ["head_weight", "embedding"])
def test_a_non_finite_weight_in_the_padded_vocabulary_reaches_nothing(layout, reduction):
    """The padded vocabulary is outside the softmax: NaN and inf in its weights change neither the loss nor any
    gradient (its rows' included, zero), where 0 * inf in the hidden states' gradient product would make every
    token's NaN."""
    hidden, weight, labels = _problem(3, dtype=jnp.float32)
    poisoned = weight.at[:, VOCAB].set(jnp.nan).at[0, VOCAB + 1].set(jnp.inf)
    if layout == "embedding":
        weight, poisoned = weight.T, poisoned.T

    def value_and_grads(w):
        def loss(h, w):
            return jnp.sum(chunked_cross_entropy(h, labels, **{layout: w}, vocab_size=VOCAB, chunk_tokens=16,
                                                 reduction=reduction))
        return jax.value_and_grad(loss, argnums=(0, 1))(hidden, w)

    (want, (want_dh, want_dw)), (got, (dh, dw)) = value_and_grads(weight), value_and_grads(poisoned)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(dh, want_dh)
    np.testing.assert_array_equal(dw, want_dw)


@pytest.mark.parametrize("layout,reduction", [("head_weight", "mean"), ("embedding", "sum"), ("head_weight", "none")])
def test_the_vocabulary_is_padded_once_outside_the_chunk_loops(layout, reduction):
    """XLA's GPU compiler pads a product's contraction dimension to its multiple (16 at bf16): left to it, the
    hidden states' gradient product (contracting over the vocabulary) was padded in every chunk. The loss pads
    the weight once, so every product in the chunk loops sees a vocabulary multiple of 64 and no pad runs there.
    A mean or a sum takes its gradient in the forward's loop (the logits, dh and the weight's step: three products,
    the plain loss's count); per-token losses recompute the logits in the backward's (a fourth)."""
    hidden, weight, labels = _problem(2, dtype=jnp.float32)
    weight = weight.T if layout == "embedding" else weight

    def loss(hidden, weight):
        losses = chunked_cross_entropy(hidden, labels, **{layout: weight}, vocab_size=VOCAB, chunk_tokens=16,
                                       dtype=jnp.bfloat16, reduction=reduction)
        return losses.sum() if reduction == "none" else losses

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(hidden, weight)
    looped = [eqn for eqn, loops in walk(jaxpr) if loops]
    products = [eqn for eqn in looped if eqn.primitive.name == "dot_general"]
    assert len(products) == (4 if reduction == "none" else 3)
    for eqn in products:
        vocab_dims = [n for var in eqn.invars for n in var.aval.shape if n >= PADDED_VOCAB]
        assert vocab_dims and all(n == 64 for n in vocab_dims), (eqn, vocab_dims)
    assert not [eqn for eqn in looped if eqn.primitive.name == "pad"]
    grads = jax.grad(loss, argnums=1)(hidden, weight)
    assert grads.shape == weight.shape


def test_batched_shapes_ignored_labels_and_bad_labels(x64):
    hidden, weight, labels = _problem(2, tokens=2 * 35)
    batched = chunked_cross_entropy(hidden.reshape(2, 35, D), labels.reshape(2, 35), head_weight=weight,
                                    vocab_size=VOCAB, chunk_tokens=16)
    assert abs(float(batched - plain_loss(hidden, weight, labels))) < 1e-12
    none_counted = chunked_cross_entropy(hidden, jnp.full_like(labels, -100), head_weight=weight)
    assert float(none_counted) == 0.0
    out_of_range = labels.at[3].set(VOCAB)
    with pytest.raises(ValueError, match=r"chunked_cross_entropy: labels must be in \[0, vocab_size=%d\) or "
                       r"ignore_index=-100; labels\[3\]=%d \(1 ids out of range\)" % (VOCAB, VOCAB)):
        chunked_cross_entropy(hidden, out_of_range, head_weight=weight, vocab_size=VOCAB)
    # Traced (as in a training step), the label cannot be read: it scores NaN in its own row only.
    value, grad = jax.jit(jax.value_and_grad(lambda h, ids: chunked_cross_entropy(
        h, ids, head_weight=weight, vocab_size=VOCAB, chunk_tokens=16)))(hidden, out_of_range)
    assert np.isnan(float(value)) and np.isnan(np.asarray(grad[3])).all() and np.isfinite(np.asarray(grad[4])).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_non_finite_cotangent_leaves_ignored_tokens_gradients_zero(x64, reduction):
    """dloss = inf or NaN (a loss scaler's overflow): the counted tokens' gradients are non-finite, the ignored
    tokens' exact zeros (as the plain loss's), and with no token counted every gradient is zero."""
    hidden, weight, labels = _problem(6)

    def vjp(labels, dloss):
        loss, pullback = jax.vjp(lambda h, w: chunked_cross_entropy(h, labels, head_weight=w, vocab_size=VOCAB,
                                                                    chunk_tokens=16, reduction=reduction),
                                 hidden, weight)
        return pullback(jnp.full(loss.shape, dloss, jnp.float64))

    ignored = np.asarray(labels == -100)
    assert ignored.any() and not ignored.all()
    for dloss in (np.inf, np.nan):
        dhidden, dweight = vjp(labels, dloss)
        assert (np.asarray(dhidden)[ignored] == 0).all() and not np.isfinite(np.asarray(dhidden)[~ignored]).any()
        assert not np.isfinite(np.asarray(dweight)).all()
        dhidden, dweight = vjp(jnp.full_like(labels, -100), dloss)
        assert (np.asarray(dhidden) == 0).all() and (np.asarray(dweight) == 0).all()


def test_vmap_and_checkpoint_compose(x64):
    hidden, weight, labels = _problem(3)
    hiddens, label_sets = jnp.stack([hidden, 2 * hidden]), jnp.stack([labels, labels[::-1]])

    def chunked(h, w, y):
        return chunked_cross_entropy(h, y, head_weight=w, vocab_size=VOCAB, chunk_tokens=16)

    got = jax.vmap(jax.grad(jax.checkpoint(chunked), argnums=(0, 1)), in_axes=(0, None, 0))(hiddens, weight, label_sets)
    want = jax.vmap(jax.grad(plain_loss, argnums=(0, 1)), in_axes=(0, None, 0))(hiddens, weight, label_sets)
    assert max(rel_l2(g, w) for g, w in zip(got, want)) < 1e-12


def test_shard_map_over_a_data_axis_sums_the_weight_gradient(x64):
    """Tokens split over two devices, the weight replicated: each shard's mean, averaged with pmean, has the
    whole batch's value and gradients (the shards count equally many tokens)."""
    hidden, weight, _ = _problem(4, tokens=72)
    labels = jax.random.randint(jax.random.key(5), (72,), 0, VOCAB)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))

    def sharded(hidden, weight):
        def per_shard(hidden, labels):
            local = chunked_cross_entropy(hidden, labels, head_weight=weight, vocab_size=VOCAB, chunk_tokens=16)
            return jax.lax.pmean(local, "data")
        return jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P())(hidden, labels)

    _assert_value_and_grads_equal(jax.jit(sharded), lambda h, w: plain_loss(h, w, labels), (hidden, weight))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_shard_map_with_replicated_hidden_states_and_split_labels(x64, reduction):
    """The hidden states replicated, the labels split over the data axis: each shard's loss over all tokens
    with its own labels, their mean's gradient in the hidden states summed over the shards (a cotangent that
    varies over an axis its primal does not must be reduced to the primal's)."""
    hidden, weight, _ = _problem(4, tokens=36)
    labels = jax.random.randint(jax.random.key(7), (72,), 0, VOCAB)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))

    def sharded(hidden, weight):
        def per_shard(labels):
            local = chunked_cross_entropy(hidden, labels, head_weight=weight, vocab_size=VOCAB, chunk_tokens=16,
                                          reduction=reduction)
            local = local if reduction == "mean" else local.sum() / jnp.maximum(jnp.sum(labels != -100), 1)
            return jax.lax.pmean(local, "data")
        return jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P())(labels)

    def plain(hidden, weight):
        return (plain_loss(hidden, weight, labels[:36]) + plain_loss(hidden, weight, labels[36:])) / 2

    _assert_value_and_grads_equal(jax.jit(sharded), plain, (hidden, weight))


@pytest.mark.parametrize("layout", ["head_weight", "embedding"])
def test_bfloat16_logits_equal_the_plain_loss_over_rounded_logits(layout):
    """logits_dtype=bfloat16 (float32 operands): the loss and its gradients equal the plain loss over the float32
    logits rounded to bfloat16 and widened again (an autocast PyTorch LM's `logits.float()`), and differ from
    the float32-logits loss by about bfloat16's rounding. The rounding passes the gradient straight through:
    the float32 operands' dlogits stay float32 (bfloat16 operands round them anyway, as autocast does)."""
    hidden, weight, labels = _problem(5, dtype=jnp.float32)
    hidden = 4 * hidden  # logits of a few units, where bf16 rounding shows in the loss
    embedding = layout == "embedding"
    weight = weight.T if embedding else weight

    def rounded(h, w):
        logits = h @ (w.T if embedding else w)
        logits = logits + jax.lax.stop_gradient(logits.astype(jnp.bfloat16).astype(jnp.float32) - logits)
        return plain_loss(logits, jnp.eye(PADDED_VOCAB), labels)

    def chunked(h, w, logits_dtype):
        return chunked_cross_entropy(h, labels, **{layout: w}, vocab_size=VOCAB, chunk_tokens=16,
                                     logits_dtype=logits_dtype)

    (value, grads), (want, want_grads), (full, _) = (
        jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(hidden, weight) for fn in (
            lambda h, w: chunked(h, w, jnp.bfloat16), rounded, lambda h, w: chunked(h, w, None)))
    assert abs(float(value - want)) < 1e-5 * abs(float(want))
    for got, expected in zip(grads, want_grads):
        assert rel_l2(got, expected) < 1e-5
    assert 1e-6 < abs(float(value - full)) / abs(float(full)) < 1e-2


def test_compiled_peak_memory_is_a_fraction_of_the_plain_loss():
    """jit(value_and_grad) at 4096 tokens x 8000 words (bf16 hidden, f32 weight): the plain loss holds the
    whole batch's logits several times; the chunked one a 512-token chunk's logits and their gradient (on the
    CPU both in float32: XLA:CPU's product fusions take float32 operands)."""
    hidden = jax.ShapeDtypeStruct((4096, 64), jnp.bfloat16)
    weight = jax.ShapeDtypeStruct((64, 8000), jnp.float32)
    labels = jax.ShapeDtypeStruct((4096,), jnp.int32)

    def plain(h, w, y):
        logits = jnp.dot(h, w.astype(jnp.bfloat16)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def chunked(h, w, y):
        return chunked_cross_entropy(h, y, head_weight=w, chunk_tokens=512)

    temp = {name: jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(hidden, weight, labels).compile()
            .memory_analysis().temp_size_in_bytes for name, fn in (("plain", plain), ("chunked", chunked))}
    logits_bytes = 4096 * 8000 * 4
    chunk_logits_bytes = 512 * 8000 * 4
    assert temp["plain"] >= logits_bytes and temp["chunked"] < 2.5 * chunk_logits_bytes, temp


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(), TypeError, r"pass exactly one of head_weight=\(d, vocab\) or embedding=\(vocab, d\)"),
    (dict(head_weight=jnp.ones((8, 40))), ValueError, r"head_weight.shape=\(8, 40\) must be \(d, vocab\) with d="),
    (dict(embedding=jnp.ones((40, 8))), ValueError, r"embedding.shape=\(40, 8\) must be \(vocab, d\)"),
    (dict(head_weight=jnp.ones((16, 40)), vocab_size=41), ValueError, r"vocab_size=41 must be an int in \[1, 40\]"),
    (dict(head_weight=jnp.ones((16, 40)), chunk_tokens=0), ValueError, r"chunk_tokens=0 must be a positive int"),
    (dict(head_weight=jnp.ones((16, 40)), chunk_tokens=512.0), TypeError, r"chunk_tokens=512.0 must be a positive int"),
    (dict(head_weight=jnp.ones((16, 40)), vocab_size="40"), TypeError, r"vocab_size='40' must be an int in \[1, 40\]"),
    (dict(head_weight=jnp.ones((16, 40), jnp.int32)), TypeError, r"head_weight.dtype=int32 must be one of bfloat16"),
    (dict(head_weight=jnp.ones((16, 40), jnp.float8_e4m3fn)), TypeError,
     r"head_weight.dtype=float8_e4m3fn must be one of bfloat16, float16, float32, float64"),
    (dict(head_weight=jnp.ones((16, 40)), logits_dtype=jnp.int8), TypeError,
     r"logits_dtype=int8 must be one of bfloat16, float16, float32, float64"),
    (dict(head_weight=jnp.ones((16, 40)), logits_dtype="nope"), TypeError,
     r"logits_dtype='nope' must be a float dtype"),
    (dict(head_weight=jnp.ones((16, 40)), dtype="foo"), TypeError, r"dtype='foo' must be a float dtype"),
    (dict(head_weight=jnp.ones((16, 40)), ignore_index=2 ** 40), ValueError,
     r"ignore_index=1099511627776 must be in int32's range"),
    (dict(head_weight=jnp.ones((16, 40)), reduction="avg"), ValueError,
     r'reduction=\'avg\' must be "mean", "sum" or "none"'),
    (dict(head_weight=jnp.ones((16, 40)), reduction=["mean"]), TypeError,
     r'reduction=\[\'mean\'\] must be a str: "mean", "sum" or "none"'),
])
def test_invalid_arguments_raise_naming_them(kwargs, error, message):
    with pytest.raises(error, match=message):
        chunked_cross_entropy(jnp.ones((4, 16)), jnp.zeros((4,), jnp.int32), **kwargs)
    with pytest.raises(ValueError, match=r"labels.shape=\(3,\) must be hidden.shape\[:-1\]=\(4,\)"):
        chunked_cross_entropy(jnp.ones((4, 16)), jnp.zeros((3,), jnp.int32), head_weight=jnp.ones((16, 40)))
    with pytest.raises(ValueError, match=r"hidden.shape=\(\) must be \(..., d\)"):
        chunked_cross_entropy(jnp.ones(()), jnp.zeros((), jnp.int32), head_weight=jnp.ones((16, 40)))


def test_labels_int32_cannot_hold_are_out_of_range_not_wrapped(x64):
    """An int64 label past int32 scores NaN like any label past the vocabulary, not the label it would wrap to
    (2^32 + 1 -> 1) nor ignore_index (2^32 - 100 -> -100)."""
    hidden, weight = jnp.ones((3, 16)), jnp.ones((16, 40))
    for wrapping, dtype in ((2 ** 32 + 1, jnp.int64), (2 ** 32 - 100, jnp.int64), (2 ** 31 + 5, jnp.uint32)):
        for ignore_index in (-100, 40):  # 40: the weight's vocabulary, one past its last label
            labels = jnp.array([1, wrapping, 2], dtype)
            per_token = jax.jit(lambda ids: chunked_cross_entropy(  # traced: a concrete one raises
                hidden, ids, head_weight=weight, ignore_index=ignore_index, reduction="none"))(labels)
            assert np.isfinite(per_token[0]) and np.isnan(per_token[1]) and np.isfinite(per_token[2])


def test_lm_loss_labels_int32_cannot_hold_are_out_of_range_not_wrapped(x64, tiny_config):
    """A traced label past int32 scores NaN at its position as unshifted labels as well as shift_labels (the LM
    shifts labels in int32 itself), not the label it would wrap to (2^32 + 1 -> 1) nor ignore_index (2^32 - 100
    -> -100)."""
    model = Mamba2LMHeadModel(tiny_config.replace(n_layer=1), backend="xla", rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(3), (1, 4), 0, tiny_config.vocab_size)
    loss = nnx.jit(lambda m, ids, labels, shifted: m.loss(ids, **{"shift_labels" if shifted else "labels": labels},
                                                          reduction="none"), static_argnums=3)
    for wrapping, dtype in ((2 ** 32 + 1, jnp.int64), (2 ** 32 - 100, jnp.uint32)):
        labels = ids.astype(dtype).at[0, 2].set(wrapping)
        for shifted, position in ((False, 1), (True, 2)):
            per_token = loss(model, ids, labels, shifted)
            assert np.isnan(per_token[0, position]) and np.isfinite(np.delete(per_token[0], position)).all()


def test_lm_loss_leaves_the_first_column_of_unshifted_labels_unread(tiny_config):
    """labels[:, 0] is no target (position t scores labels[:, t + 1]): any value there, one past the vocabulary
    too, gives the loss of any other."""
    model = Mamba2LMHeadModel(tiny_config.replace(n_layer=1), backend="xla", rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(4), (2, 5), 0, tiny_config.vocab_size)
    np.testing.assert_array_equal(model.loss(ids, ids.at[:, 0].set(tiny_config.vocab_size + 7)), model.loss(ids))


def test_lm_loss_reads_concrete_labels_once(tiny_config, monkeypatch):
    """An eager loss checks its concrete labels against the vocabulary once (the model's check), not again in the
    loss op, which would read them back from the device a second time; the value is the op's."""
    from jax_mamba2 import checks, cross_entropy
    from jax_mamba2.flax_layers import lm
    model = Mamba2LMHeadModel(tiny_config.replace(n_layer=1), backend="xla", rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(5), (2, 9), 0, tiny_config.vocab_size)
    labels = jnp.roll(ids, 1, axis=1)
    names = []
    def counting(api, name, *args, **kwargs):
        names.append((api, name))
        return checks.check_token_ids_in_range(api, name, *args, **kwargs)
    for module in (lm, cross_entropy):
        monkeypatch.setattr(module, "check_token_ids_in_range", counting)
    for kwargs, name in ((dict(labels=labels), "labels[:, 1:]"), (dict(shift_labels=labels), "shift_labels")):
        names.clear()
        loss = model.loss(ids, **kwargs)
        assert names.count(("Mamba2LMHeadModel.loss", name)) == 1 and len(names) == 2, names  # and input_ids'
        targets = labels if "shift_labels" in kwargs else jnp.pad(labels[:, 1:], ((0, 0), (0, 1)),
                                                                   constant_values=-100)
        expected = chunked_cross_entropy(model._final_hidden(ids), targets, embedding=model.embedding.embedding[...],
                                         vocab_size=tiny_config.vocab_size)
        np.testing.assert_allclose(float(loss), float(expected), rtol=1e-6)


def test_lm_loss_takes_unsigned_labels_like_signed_ones(tiny_config):
    """Labels in uint8 shift like int32 ones: the padded last column holds ignore_index, which uint8 cannot."""
    model = Mamba2LMHeadModel(tiny_config.replace(n_layer=1), backend="xla", rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(2), (2, 12), 0, min(tiny_config.vocab_size, 256))
    unsigned, signed = (model.loss(ids, ids.astype(dtype)) for dtype in (jnp.uint8, jnp.int32))
    assert np.isfinite(float(unsigned)) and float(unsigned) == float(signed)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_lm_loss_equals_the_loss_of_its_logits_in_float64(x64, tiny_config, tied):
    """Mamba2LMHeadModel.loss against softmax cross-entropy over model(ids)'s first vocab_size columns, values and
    parameter gradients; HF-style labels (shifted inside, -100 ignored, default input_ids) and already-shifted
    targets."""
    config = tiny_config.replace(tie_embeddings=tied, n_layer=1)
    model = Mamba2LMHeadModel(config, backend="xla", param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, config.vocab_size)
    labels = ids.at[0, 5].set(-100)

    def shifted(labels):
        return jnp.pad(labels[:, 1:], ((0, 0), (0, 1)), constant_values=-100)

    def plain(model, labels):
        return plain_loss(model(ids), jnp.eye(config.padded_vocab_size), shifted(labels), vocab=config.vocab_size)

    grad = nnx.jit(nnx.value_and_grad(lambda m, loss: loss(m), argnums=0), static_argnums=1)
    (want, want_grads), (value, grads) = (grad(model, fn) for fn in (
        lambda m: plain(m, labels), lambda m: m.loss(ids, labels, chunk_tokens=10)))
    assert abs(float(value - want)) < 1e-12
    got, expected = (jax.tree.leaves(nnx.state(g, nnx.Param)) for g in (grads, want_grads))
    assert max(rel_l2(g, w) for g, w in zip(got, expected) if np.any(w)) < 1e-10
    pre_shifted, next_token, want_next_token = nnx.jit(lambda m: (
        m.loss(ids, shift_labels=shifted(labels)), m.loss(ids), plain(m, ids)))(model)
    assert abs(float(pre_shifted - want)) < 1e-12 and abs(float(next_token - want_next_token)) < 1e-12
    with pytest.raises(ValueError, match="pass labels \\(unshifted\\) or shift_labels, not both"):
        model.loss(ids, labels, shift_labels=labels)
    per_position = nnx.jit(lambda m: m.loss(ids, labels, reduction="none"))(model)
    counted = shifted(labels) != -100
    assert per_position.shape == ids.shape and (per_position[~counted] == 0).all()
    assert abs(float(jnp.sum(per_position) / jnp.sum(counted) - want)) < 1e-12


def test_backend_names_are_checked_and_a_kernel_backend_named_on_the_cpu_raises_saying_why():
    """A kernel backend asked for by name never falls back: on a machine without a GPU (or without cuda-tile) it
    raises before anything runs, naming the backend and the reason; an unknown name lists the known ones."""
    hidden, weight, labels = _problem(7, dtype=jnp.float32)
    for backend in ("cutile", "cutile_callback"):
        with pytest.raises(ValueError, match=rf"chunked_cross_entropy\(backend='{backend}'\) "
                                             r"(cannot run this call: no CUDA device|is unavailable: cuda-tile)"):
            chunked_cross_entropy(hidden, labels, head_weight=weight, vocab_size=VOCAB, backend=backend)
    with pytest.raises(ValueError, match=r"backend='nope' must be one of 'auto', 'xla'"):
        chunked_cross_entropy(hidden, labels, head_weight=weight, backend="nope")


def test_a_kernel_backend_rejects_float64_naming_the_dtype(x64):
    pytest.importorskip("cuda.tile")
    hidden, weight, labels = _problem(8)
    with pytest.raises(ValueError, match=r"cannot run this call: dtype is float64; the kernels take bfloat16"):
        chunked_cross_entropy(hidden, labels, head_weight=weight, logits_dtype=jnp.float32, backend="cutile")
    with pytest.raises(ValueError, match=r"cannot run this call: logits_dtype is float64"):
        chunked_cross_entropy(hidden, labels, head_weight=weight, backend="cutile")


def test_auto_lowers_on_the_cpu_and_equals_xla():
    """"auto" without a usable GPU is the xla path: the same value and gradients, and the program lowers."""
    hidden, weight, labels = _problem(9, dtype=jnp.float32)

    def value_and_grads(backend):
        return jax.jit(jax.value_and_grad(lambda h, w: chunked_cross_entropy(
            h, labels, head_weight=w, vocab_size=VOCAB, chunk_tokens=16, backend=backend), argnums=(0, 1)))

    assert "dot_general" in value_and_grads("auto").lower(hidden, weight).as_text()
    (value, grads), (want, want_grads) = (value_and_grads(b)(hidden, weight) for b in ("auto", "xla"))
    assert float(value) == float(want)
    assert all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(grads, want_grads))


@pytest.mark.parametrize("backend, follows", [("auto", "auto"), ("cutile", "auto"), ("cutile_callback", "auto"),
                                              ("xla", "xla"), ("scan", "xla")])
def test_lm_loss_backend_follows_the_model_unless_given(tiny_config, backend, follows):
    """By default the loss's softmax takes the kernels where they can run the call ("auto": e.g. not a float64
    logits_dtype) under a kernel backend, XLA under "xla" or "scan" (no softmax kernel there), and XLA in a
    model `shard_model` sharded; a loss_backend given is kept."""
    config = tiny_config.replace(n_layer=1)
    model = Mamba2LMHeadModel(config, backend=backend, rngs=nnx.Rngs(0))
    assert model.loss_backend is None and model.loss_softmax_backend() == follows
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    assert shard_model(model, mesh).loss_softmax_backend() == "xla"
    model = Mamba2LMHeadModel(config, backend=backend, loss_backend="cutile", rngs=nnx.Rngs(0))
    assert model.loss_backend == model.loss_softmax_backend() == "cutile"
    assert shard_model(model, mesh).loss_softmax_backend() == "cutile"


def test_lm_rejects_an_unknown_loss_backend(tiny_config):
    with pytest.raises(ValueError, match=r"Mamba2LMHeadModel: loss_backend='triton' must be one of 'auto', 'xla'"):
        Mamba2LMHeadModel(tiny_config.replace(n_layer=1), loss_backend="triton", rngs=nnx.Rngs(0))
