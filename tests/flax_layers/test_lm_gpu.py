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


def _projections_sliced_in_place(program: str) -> list[str]:
    """The op names of the layers' projections (`project`'s einsum, "...d,de->...e") that the compiled `program` runs
    as a cuBLAS call inside a dynamic-slice fusion: reading their operand from, or writing their result into, a
    slice of a loop's buffer in place, where otherwise the slice is copied."""
    names, fused = [], False
    for line in program.splitlines():
        if not line.startswith(" "):  # a computation's header (or its closing brace)
            fused = line.startswith("%dynamic-slice-fusion")
        elif fused and 'custom_call_target="__cublas' in line:
            name = re.search(r'op_name="([^"]*)"', line)
            if name and "...d,de->...e" in name.group(1):
                names.append(name.group(1))
    return names


def test_the_layer_scans_projections_read_and_write_its_stacks_in_place_under_the_models_compiler_options():
    """Compiled with `compiler_options()` (no Triton GEMM fusions), the layer scan's projections are cuBLAS calls that
    XLA slices the loop's stacks for in place, in the forward loop and in the backward's weight gradients (which read
    the saved inputs through no optimization barrier); with XLA's defaults fewer are. The gradients equal those of
    the defaults' step up to the rounding of products that may run other kernels."""
    model = Mamba2LMHeadModel(CONFIG.replace(n_layer=3), backend="cutile", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    ids = _ids(6)
    grad = jax.grad(lambda state: nnx.merge(graphdef, state).loss(ids))
    steps = {name: jax.jit(grad, compiler_options=options).lower(state).compile()
             for name, options in (("model", model.compiler_options()), ("defaults", {}))}
    in_place = {name: _projections_sliced_in_place(step.as_text()) for name, step in steps.items()}
    backward = [name for name in in_place["model"] if "transpose(jvp())/while" in name]
    assert len(in_place["model"]) >= 4 and len(backward) >= 2, in_place["model"]
    assert len(in_place["defaults"]) < len(in_place["model"]), in_place
    got, want = (nnx.to_flat_state(steps[name](state)) for name in ("model", "defaults"))
    for (path, g), (_, w) in zip(got, want):
        assert rel_l2(g[...], w[...]) < 2e-3, path
