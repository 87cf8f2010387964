"""The LM loss's softmax on the kernel path end to end on the CPU: chunked_cross_entropy(backend="cutile"), whose
plans (bridge/loss_ops.py) run block by block on the NumPy emulator in float64 through jax.pure_callback.
Checked against the float64 plain loss and the xla backend, with ignored and out-of-range labels, bfloat16
logits, and composed with jit, grad, vmap, jax.checkpoint and shard_map over a data axis."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

pytest.importorskip("cuda.tile")

from jax_mamba2.bridge import loss_ops  # noqa: E402
from jax_mamba2 import cross_entropy as loss  # noqa: E402
from jax_mamba2.cross_entropy import chunked_cross_entropy  # noqa: E402
from tests._helpers import rel_l2  # noqa: E402
from tests.bridge._emulated_backend import emulate_layer_kernels  # noqa: E402

TOKENS, D, PADDED_VOCAB, VOCAB, CHUNK = 26, 16, 200, 190, 8  # 4 chunks, the last partial
# The arrays between the plans and XLA are float32 (the emulated kernels compute in float64).
TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def emulated_kernels(monkeypatch):
    """backend="cutile" runs the emulated plans, as if on a GPU."""
    emulate_layer_kernels(monkeypatch, loss.OP, loss_ops)


def _problem(seed, tokens=TOKENS):
    keys = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(keys[0], (tokens, D), jnp.float32)
    weight = 0.5 * jax.random.normal(keys[1], (D, PADDED_VOCAB), jnp.float32)
    labels = jax.random.randint(keys[2], (tokens,), 0, VOCAB).at[::5].set(-100)
    return hidden, weight, labels


def _plain_loss_float64(hidden, weight, labels, embedding=False):
    """The whole batch's logits in float64, softmax over the first VOCAB columns, mean over counted tokens."""
    with jax.enable_x64(True):
        def plain(h, w):
            logits = (h @ (w.T if embedding else w))[..., :VOCAB]
            counted = labels != -100
            per_token = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(counted, labels, 0))
            return jnp.sum(jnp.where(counted, per_token, 0.0)) / jnp.sum(counted)

        value, grads = jax.value_and_grad(plain, argnums=(0, 1))(*(jnp.asarray(a, jnp.float64)
                                                                 for a in (hidden, weight)))
        return float(value), tuple(np.asarray(g) for g in grads)


def _value_and_grads(backend, hidden, weight, labels, layout="head_weight", **options):
    def f(h, w, ids):  # the labels traced, as in a training step: a concrete label out of range would raise
        return chunked_cross_entropy(h, ids, **{layout: w}, vocab_size=VOCAB, chunk_tokens=CHUNK,
                                     backend=backend, **options)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(hidden, weight, labels)


@pytest.mark.parametrize("layout", ["head_weight", "embedding"])
def test_emulated_loss_and_gradients_match_float64_reference(layout):
    hidden, weight, labels = _problem(0)
    weight = weight.T if layout == "embedding" else weight
    value, grads = _value_and_grads("cutile", hidden, weight, labels, layout)
    want, want_grads = _plain_loss_float64(hidden, weight, labels, embedding=layout == "embedding")
    assert abs(float(value) - want) < TOLERANCE * abs(want)
    assert max(rel_l2(g, w) for g, w in zip(grads, want_grads)) < TOLERANCE


def test_emulated_bfloat16_logits_and_operands_match_float64_reference_over_the_rounded_logits():
    """bf16 matmul operands and bf16 logits: the kernels' softmax of the logits as stored (rounded to bf16) is
    the float64 one to f32 rounding; the gradients carry bf16 dlogits (~2^-9 relative). (XLA's own fusions may
    skip the bf16 round trip of the logits on the CPU, where it allows excess precision, so the xla backend is
    no reference here.)"""
    hidden, weight, labels = _problem(1)
    value, grads = _value_and_grads("cutile", hidden, weight, labels, dtype=jnp.bfloat16,
                                    logits_dtype=jnp.bfloat16)
    with jax.enable_x64(True):
        h64, w64 = (jnp.asarray(a.astype(jnp.bfloat16), jnp.float64) for a in (hidden, weight))
        rounded = (h64 @ w64).astype(jnp.bfloat16).astype(jnp.float64)
        want, _ = _plain_loss_float64(rounded, jnp.eye(PADDED_VOCAB, dtype=jnp.float64), labels)
    _, want_grads = _plain_loss_float64(hidden.astype(jnp.bfloat16), weight.astype(jnp.bfloat16), labels)
    assert abs(float(value) - want) < 1e-5 * abs(want)
    assert max(rel_l2(g, w) for g, w in zip(grads, want_grads)) < 2e-2


def test_emulated_out_of_range_label_is_nan_in_its_row_only():
    hidden, weight, labels = _problem(2)
    bad = labels.at[3].set(VOCAB + 2)  # a padding column: counted, out of range
    value, (dhidden, dweight) = _value_and_grads("cutile", hidden, weight, bad)
    assert np.isnan(float(value)) and np.isnan(np.asarray(dhidden[3])).all()
    assert np.isfinite(np.asarray(dhidden[np.arange(TOKENS) != 3])).all()
    # The NaN row's dlogits (every column, as the xla backend's) reach the whole weight gradient.
    _, want_grads = _value_and_grads("xla", hidden, weight, bad)
    for got, want in zip((dhidden, dweight), want_grads):
        assert np.array_equal(np.isnan(np.asarray(got)), np.isnan(np.asarray(want)))


def test_emulated_vmap_of_checkpointed_gradients_matches_the_xla_backend():
    hidden, weight, labels = _problem(3)
    hiddens, label_sets = jnp.stack([hidden, 2 * hidden]), jnp.stack([labels, labels[::-1]])

    def grads(backend):
        def f(h, w, y):
            return chunked_cross_entropy(h, y, head_weight=w, vocab_size=VOCAB, chunk_tokens=CHUNK, backend=backend)
        return jax.jit(jax.vmap(jax.grad(jax.checkpoint(f), argnums=(0, 1)), in_axes=(0, None, 0)))(
            hiddens, weight, label_sets)

    assert max(rel_l2(g, w) for g, w in zip(grads("cutile"), grads("xla"))) < TOLERANCE


def test_emulated_shard_map_over_a_data_axis_matches_float64_reference():
    """Tokens split over two devices, the weight replicated: the pmean of the shards' means and its gradients
    (the weight's summed over the shards by cross_entropy.py's custom VJP)."""
    hidden, weight, _ = _problem(4, tokens=32)
    labels = jax.random.randint(jax.random.key(5), (32,), 0, VOCAB)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))

    def sharded(hidden, weight):
        def per_shard(hidden, labels):
            local = chunked_cross_entropy(hidden, labels, head_weight=weight, vocab_size=VOCAB, chunk_tokens=CHUNK,
                                          backend="cutile")
            return jax.lax.pmean(local, "data")
        return jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P())(hidden, labels)

    value, grads = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1)))(hidden, weight)
    want, want_grads = _plain_loss_float64(hidden, weight, labels)
    assert abs(float(value) - want) < TOLERANCE * abs(want)
    assert max(rel_l2(g, w) for g, w in zip(grads, want_grads)) < TOLERANCE


def test_auto_puts_the_kernels_behind_platform_dependent_and_runs_xla_on_the_cpu():
    """With the kernels runnable, "auto" traces both branches behind lax.platform_dependent; on the CPU the
    program runs the xla one (the same value and gradients as backend="xla")."""
    hidden, weight, labels = _problem(6)

    def f(h, w):
        return chunked_cross_entropy(h, labels, head_weight=w, vocab_size=VOCAB, chunk_tokens=CHUNK, backend="auto")

    assert "platform_index" in str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(hidden, weight))
    (value, grads), (want, want_grads) = (_value_and_grads(b, hidden, weight, labels) for b in ("auto", "xla"))
    assert float(value) == float(want)
    assert all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(grads, want_grads))


def test_emulated_per_token_losses_and_their_gradients_match_the_xla_backend():
    """reduction="none" on the kernels: each token's loss, and the gradients of a weighted sum of them (a
    cotangent per token into the backward kernel), as on the xla backend."""
    hidden, weight, labels = _problem(2)
    token_weights = jax.random.uniform(jax.random.key(3), labels.shape)

    def per_token(backend):
        return lambda h, w: chunked_cross_entropy(h, labels, head_weight=w, vocab_size=VOCAB, chunk_tokens=CHUNK,
                                                  reduction="none", backend=backend)
    got, want = (jax.jit(per_token(b))(hidden, weight) for b in ("cutile", "xla"))
    assert got.shape == labels.shape and rel_l2(got, want) < TOLERANCE
    grads, want_grads = (jax.jit(jax.grad(lambda h, w: jnp.sum(token_weights * per_token(b)(h, w)),
                                          argnums=(0, 1)))(hidden, weight) for b in ("cutile", "xla"))
    assert max(rel_l2(g, w) for g, w in zip(grads, want_grads)) < TOLERANCE
