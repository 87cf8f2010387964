"""The language model on the cuTile backend (run on the H200; skipped elsewhere): forward, cached decode
and gradients agree with the pure-JAX backend, under nnx.jit and the loop over layers."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel, generate
from tests._helpers import rel_l2

pytestmark = pytest.mark.gpu

# Sizes the kernels take: headdim and dstate powers of two >= 16, chunk 64; 8 heads in 2 groups.
CONFIG = Mamba2Config(d_model=256, n_layer=2, vocab_size=256, pad_vocab_size_multiple=8,
                      ssm_cfg=dict(d_state=64, headdim=64, ngroups=2, chunk_size=64))
BATCH, SEQLEN = 2, 150


def _models():
    return {backend: Mamba2LMHeadModel(CONFIG, backend=backend, rngs=nnx.Rngs(0))
            for backend in ("cutile", "xla")}


def _ids(seed=0, length=SEQLEN):
    return jax.random.randint(jax.random.key(seed), (BATCH, length), 0, CONFIG.vocab_size)


def test_lm_cutile_forward_matches_xla():
    models, ids = _models(), _ids()
    logits = {b: nnx.jit(lambda m, i: m(i))(m, ids) for b, m in models.items()}
    assert rel_l2(logits["cutile"], logits["xla"]) < 5e-3


def test_lm_cutile_prefill_and_decode_steps_match_full_forward():
    model, ids = _models()["cutile"], _ids(1)
    full = nnx.jit(lambda m, i: m(i))(model, ids)
    logits, cache = nnx.jit(lambda m, i: m.prefill(i))(model, ids[:, :100])
    step = nnx.jit(lambda m, token, cache: m.step(token, cache))
    pieces = [logits]
    for t in range(100, SEQLEN):
        logits, cache = step(model, ids[:, t], cache)
        pieces.append(logits[:, None])
    assert rel_l2(jnp.concatenate(pieces, axis=1), full) < 5e-3


def test_lm_cutile_grads_match_xla():
    models, ids = _models(), _ids(2)

    def loss(model):
        logits = model(ids[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1))

    grads = {b: nnx.to_flat_state(nnx.jit(nnx.grad(loss))(m)) for b, m in models.items()}
    for (path, g_cutile), (_, g_xla) in zip(grads["cutile"], grads["xla"]):
        assert rel_l2(g_cutile[...], g_xla[...]) < 2e-2, path


def test_lm_cutile_grads_with_nnx_remat_match_plain():
    """nnx.remat around each block (remat=True, and "matmuls", which keeps in_proj's output) replays the cuTile
    forward in the backward pass, which recomputes the states the kernel VJP saves, so the gradients are the plain model's up to the rounding of the replayed XLA ops
    (norms, projections: fused differently under remat). The SSD op alone is bitwise equal under
    jax.checkpoint (tests/bridge); the xla backend is the control."""
    ids = _ids(4)

    def loss(model):
        logits = model(ids[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1))

    for backend in ("xla", "cutile"):
        grads = [nnx.to_flat_state(nnx.jit(nnx.grad(loss))(
            Mamba2LMHeadModel(CONFIG, backend=backend, deterministic_backward=True, remat=remat,
                              rngs=nnx.Rngs(0))))
            for remat in (False, True, "matmuls")]
        for (path, g_plain), (_, g_remat), (_, g_matmuls) in zip(*grads):
            assert rel_l2(g_remat[...], g_plain[...]) < 2e-3, (backend, path, rel_l2(g_remat[...], g_plain[...]))
            assert rel_l2(g_matmuls[...], g_plain[...]) < 2e-3, (backend, path, "matmuls")


def test_lm_cutile_generate_runs_greedy():
    model = _models()["cutile"]
    tokens = generate(model, _ids(3, length=8), max_new_tokens=16)
    assert tokens.shape[0] == BATCH and tokens.shape[-1] >= 16
    np.testing.assert_array_equal(tokens, generate(model, _ids(3, length=8), max_new_tokens=16))


def test_the_layer_scan_stacks_its_residuals_without_filling_them():
    """The compiled training step of the layer scan (one GPU) holds no constant fill of an (n_layer, ...) buffer:
    the stacks of the backward's residuals and of the parameters' gradients are allocations the loops write
    whole; its gradients are those of the blocks unrolled."""
    config = CONFIG.replace(n_layer=3)  # a leading axis no other array of the step has
    ids = _ids(5)

    def loss(model):
        return model.loss(ids)

    scanned, unrolled = (Mamba2LMHeadModel(config, backend="cutile", scan_layers=flag, rngs=nnx.Rngs(0))
                         for flag in (True, False))
    graphdef, state = nnx.split(scanned)
    program = jax.jit(jax.grad(lambda state: nnx.merge(graphdef, state).loss(ids))).lower(state).compile().as_text()
    # A fill: a broadcast, or a fusion of no operands (XLA's fused broadcast of a constant), of an (3, ...) array.
    fills = [line.strip()[:160] for line in program.splitlines()
             if re.search(r"= \(?[a-z0-9]+\[3,[^=]*\s(broadcast\(|fusion\(\))", line)]
    assert not fills, fills
    want = nnx.to_flat_state(nnx.jit(nnx.grad(loss))(unrolled))
    for (path, got), (_, expected) in zip(nnx.to_flat_state(nnx.jit(nnx.grad(loss))(scanned)), want):
        assert rel_l2(got[...], expected[...]) < 2e-3, path


def test_the_layer_scans_products_are_cublas_calls_under_the_models_compiler_options():
    """Compiled with `compiler_options()`, the layer scan's training step runs no matrix product as a Triton GEMM
    fusion (each is a cuBLAS call) and computes the gradients of the step compiled with XLA's defaults (up to the
    rounding of products that may run other kernels, TF32 ones among them)."""
    model = Mamba2LMHeadModel(CONFIG.replace(n_layer=3), backend="cutile", rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    ids = _ids(6)
    grad = jax.grad(lambda state: nnx.merge(graphdef, state).loss(ids))
    steps = {name: jax.jit(grad, compiler_options=options).lower(state).compile()
             for name, options in (("model", model.compiler_options()), ("defaults", {}))}
    program = steps["model"].as_text()
    assert "__triton_gemm" not in program and "__cublas$" in program
    got, want = (nnx.to_flat_state(steps[name](state)) for name in ("model", "defaults"))
    for (path, g), (_, w) in zip(got, want):
        assert rel_l2(g[...], w[...]) < 2e-3, path
