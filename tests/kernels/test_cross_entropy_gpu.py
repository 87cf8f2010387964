"""The LM loss's softmax kernels on the GPU (run on the H200; skipped elsewhere): the kernels at the LM's chunk
(2048 x 50280, bf16) against loss.py's xla softmax in float64, and chunked_cross_entropy with the "cutile" and
"cutile_callback" backends, forward and gradients against the float64 reference, under jit, grad, vmap and
jax.checkpoint; the LM's loss on the kernels against its loss on XLA's softmax.

    python -m pytest -m gpu tests/kernels/test_cross_entropy_gpu.py
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_mamba2 import chunked_cross_entropy
from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel
from tests._helpers import rel_l2
from tests.kernels._loss_checks import LossCase, assert_close, make_inputs, oracle

pytestmark = pytest.mark.gpu

LM_CHUNK = LossCase(rows=2048, padded_vocab=50288, vocab_size=50280, dtype="bfloat16", grad_dtype="bfloat16")
# Outputs in f32 (lse, loss) are f32 sums over bf16 logits; dlogits are rounded to bf16.
TOLERANCE = {"lse": 1e-6, "loss": 1e-6, "dlogits": 1e-2}


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
@pytest.mark.parametrize("case", [LM_CHUNK, dataclasses.replace(LM_CHUNK, dtype="float32", grad_dtype="float32")],
                         ids=["bf16", "f32"])
def test_kernels_at_the_lm_chunk_match_float64_reference(case, backend):
    """The forward and backward kernels on one chunk: ignored rows zero, out-of-range labels NaN, the rest within
    f32 (bf16 for dlogits) rounding of the float64 softmax of the same logits."""
    from jax_mamba2.bridge import loss_ops

    kernels = loss_ops.KERNELS[backend]
    arrays = make_inputs(case, seed=0)
    dims = case.dims()

    @jax.jit
    def run(logits, labels, scale):
        lse, loss = kernels.forward(dims, logits, labels)
        return lse, loss, kernels.backward(dims, logits, labels, lse, scale)

    lse, loss, dlogits = run(*(jnp.asarray(arrays[n]) for n in ("logits", "labels", "scale")))
    want = oracle(case, arrays)
    tolerance = TOLERANCE if case.dtype == "bfloat16" else {**TOLERANCE, "dlogits": 1e-5}
    for name, got in (("lse", lse), ("loss", loss), ("dlogits", dlogits)):
        assert_close({name: np.asarray(got.astype(jnp.float32))}, {name: want[name]}, tolerance[name])


def _problem(seed, tokens, d, padded_vocab):
    """hidden (tokens, d), weight (d, padded_vocab) f32 (logits of a few units), labels in the first
    padded_vocab - 8 columns (the vocabulary), every ninth ignored."""
    keys = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(keys[0], (tokens, d), jnp.float32)
    weight = jax.random.normal(keys[1], (d, padded_vocab), jnp.float32) / np.sqrt(d) * 3
    labels = jax.random.randint(keys[2], (tokens,), 0, padded_vocab - 8).at[::9].set(-100)
    return hidden, weight, labels


def _plain_loss(logits, labels, vocab):
    """The mean over counted tokens of the softmax cross-entropy over the first `vocab` columns."""
    counted = labels != -100
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits[..., :vocab], jnp.where(counted, labels, 0))
    return jnp.sum(jnp.where(counted, per_token, 0.0)) / jnp.sum(counted)


def _float64_reference(hidden, weight, labels, vocab):
    """(loss, (dhidden, dweight)) of the whole batch's float64 logits over the first `vocab` columns."""
    with jax.enable_x64(True):
        value, grads = jax.jit(jax.value_and_grad(lambda h, w: _plain_loss(h @ w, labels, vocab), argnums=(0, 1)))(
            jnp.asarray(hidden, jnp.float64), jnp.asarray(weight, jnp.float64))
        return float(value), tuple(np.asarray(g) for g in grads)


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
def test_loss_at_the_lm_shape_matches_float64_reference(backend):
    """Two chunks of 2048 tokens at the 50280-word vocabulary (padded to 50288), float32 logits and operands."""
    hidden, weight, labels = _problem(1, tokens=4096, d=256, padded_vocab=50288)
    with jax.default_matmul_precision("float32"):  # not the GPU's default TF32 products (2^-11 apart)
        value, grads = jax.jit(jax.value_and_grad(lambda h, w: chunked_cross_entropy(
            h, labels, head_weight=w, vocab_size=50280, backend=backend), argnums=(0, 1)))(hidden, weight)
    want, want_grads = _float64_reference(hidden, weight, labels, 50280)
    assert abs(float(value) - want) < 1e-5 * abs(want)
    assert max(rel_l2(g, w) for g, w in zip(grads, want_grads)) < 1e-4


def test_bf16_loss_at_the_lm_shape_matches_the_float64_softmax_of_its_logits():
    """bf16 operands and logits (the LM benchmark's setting): the loss equals the float64 softmax of the stored
    bf16 logits; the gradients carry bf16 dlogits."""
    hidden, weight, labels = _problem(2, tokens=4096, d=256, padded_vocab=50288)
    h16, w16 = hidden.astype(jnp.bfloat16), weight.astype(jnp.bfloat16)
    value, grads = jax.jit(jax.value_and_grad(lambda h, w: chunked_cross_entropy(
        h, labels, head_weight=w, vocab_size=50280, dtype=jnp.bfloat16, logits_dtype=jnp.bfloat16,
        backend="cutile"), argnums=(0, 1)))(h16, w16)
    rounded = jax.jit(lambda h, w: jax.lax.dot_general(h, w, (((1,), (0,)), ((), ())),
                                                       preferred_element_type=jnp.bfloat16))(h16, w16)
    with jax.enable_x64(True):
        want = float(jax.jit(_plain_loss, static_argnums=2)(jnp.asarray(rounded, jnp.float64), labels, 50280))
    _, want_grads = _float64_reference(h16.astype(jnp.float32), w16.astype(jnp.float32), labels, 50280)
    assert abs(float(value) - want) < 1e-5 * abs(want)
    assert max(rel_l2(g, w) for g, w in zip(grads, want_grads)) < 2e-2


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
def test_jit_grad_vmap_and_checkpoint_compose_like_xla(backend):
    """grad of a checkpointed loss, vmapped over two batches (the head weight shared), equals XLA's softmax."""
    hidden, weight, labels = _problem(3, tokens=600, d=64, padded_vocab=1008)
    hiddens, label_sets = jnp.stack([hidden, 2 * hidden]), jnp.stack([labels, labels[::-1]])

    def grads(backend):
        def f(h, w, y):
            return chunked_cross_entropy(h, y, head_weight=w, vocab_size=1000, chunk_tokens=256, backend=backend)
        # float32 products: under TF32 a last-bit difference of a dlogit can round a product's input apart.
        with jax.default_matmul_precision("float32"):
            return jax.jit(jax.vmap(jax.grad(jax.checkpoint(f), argnums=(0, 1)), in_axes=(0, None, 0)))(
                hiddens, weight, label_sets)

    assert max(rel_l2(g, w) for g, w in zip(grads(backend), grads("xla"))) < 1e-5


def test_lm_loss_runs_on_the_kernels_and_matches_the_xla_softmax():
    """A bf16 LM with float32 logits: its compiled training step holds the loss kernels' custom calls, and its
    loss and gradients equal those of the same model with the softmax on XLA."""
    config = Mamba2Config(d_model=256, n_layer=2, vocab_size=1000, pad_vocab_size_multiple=16,
                          ssm_cfg=dict(d_state=64, headdim=64, ngroups=2, chunk_size=64))
    ids = jax.random.randint(jax.random.key(3), (2, 256), 0, config.vocab_size)
    model = Mamba2LMHeadModel(config, backend="cutile", loss_backend="cutile", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert model.loss_backend == "cutile"
    graphdef, state = nnx.split(model)
    hlo = jax.jit(lambda s: nnx.value_and_grad(lambda m: m.loss(ids))(nnx.merge(graphdef, s))).lower(
        state).compile().as_text()
    for kernel in ("cross_entropy_fwd_kernel", "cross_entropy_bwd_kernel"):
        assert kernel in hlo, kernel
    step = nnx.jit(nnx.value_and_grad(lambda m: m.loss(ids, chunk_tokens=128)))
    loss, grads = step(model)
    model.loss_backend = "xla"
    want, want_grads = step(model)
    assert abs(float(loss) - float(want)) < 1e-5 * abs(float(want))
    for (path, g), (_, w) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(want_grads)):
        assert rel_l2(g[...], w[...]) < 3e-3, path
