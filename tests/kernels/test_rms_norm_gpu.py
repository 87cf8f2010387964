"""The RMSNorm kernels on the GPU (run on the H200; skipped elsewhere): jax_mamba2.rms_norm / add_rms_norm with the
"cutile" and "cutile_callback" backends, forward and backward against the float64 reference on fresh random
inputs, at the test cases and at the LM's shapes; the weight gradient bitwise reproducible; the LM's norms
and loss on the kernels.

    python -m pytest -m gpu tests/kernels/test_rms_norm_gpu.py
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_mamba2
from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel
from tests._helpers import rel_l2
from tests.kernels._norm_checks import CASES, EPS, NormCase, make_inputs, oracle

pytestmark = pytest.mark.gpu

TOLERANCE = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}
LM_CASES = {
    "gated_before_16384x2048": NormCase(rows=16384, features=2048, gate="before", dtype="bfloat16"),
    "gated_after_16384x2048": NormCase(rows=16384, features=2048, gate="after", dtype="bfloat16"),
    "gated_before_8_groups": NormCase(rows=16384, features=2048, group_size=256, gate="before", dtype="bfloat16"),
    "add_norm_16384x1024": NormCase(rows=16384, features=1024, residual=True, dtype="bfloat16"),
}


def _forward_and_vjp(case, backend):
    def op(x, z, residual, weight):
        if case.residual:
            return jax_mamba2.add_rms_norm(x, residual, weight, eps=EPS, residual_dtype=jnp.float32, backend=backend)
        return jax_mamba2.rms_norm(x, weight, z, eps=EPS, group_size=case.group_size,
                                   norm_before_gate=case.norm_before_gate, backend=backend), None

    @jax.jit
    def run(primals, cotangents):
        outputs, vjp = jax.vjp(op, *primals)
        return outputs, vjp(cotangents)

    return run


def _check(case, backend, seed=0):
    arrays = make_inputs(case, seed)
    primals = tuple(None if arrays.get(n) is None else jnp.asarray(arrays[n])
                    for n in ("x", "z", "residual", "weight"))
    cotangents = (jnp.asarray(arrays["dout"]),
                  jnp.asarray(arrays["dresidual_out"]) if case.residual else None)
    (out, residual_out), (dx, dz, dresidual, dweight) = _forward_and_vjp(case, backend)(primals, cotangents)
    got = dict(out=out, residual_out=residual_out, dx=dx, dz=dz, dresidual=dresidual, dweight=dweight)
    want = oracle(case, arrays)
    errors = {k: rel_l2(got[k], want[k]) for k in want}
    assert max(errors.values()) < TOLERANCE[case.dtype], errors
    assert out.dtype == jnp.dtype(case.dtype) and dweight.dtype == jnp.dtype(case.weight_dtype)


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_float64_reference(name, dtype, backend):
    _check(dataclasses.replace(CASES[name], dtype=dtype), backend)


@pytest.mark.parametrize("name", ["gate_before_groups3", "add_norm"])
def test_kernels_take_a_bf16_weight_as_it_is(name):
    """A bf16 model's norm scale: the kernels read it in bf16 and its gradient comes back in bf16."""
    _check(dataclasses.replace(CASES[name], dtype="bfloat16", weight_dtype="bfloat16"), "cutile")


@pytest.mark.parametrize("name", list(LM_CASES))
def test_kernels_at_lm_shapes_match_float64_reference(name):
    _check(LM_CASES[name], "cutile", seed=1)


# Configs away from the default, as benchmarks/norm.py sweeps them: wider row blocks, other occupancies, latency
# hints on the forward's and the backward loop's loads.
SWEPT_CONFIGS = {
    "block_rows_x2_latency": dict(BLOCK_ROWS=2, FWD_OCCUPANCY=4, BWD_OCCUPANCY=2, FWD_LATENCY=3, BWD_LATENCY=4),
    "block_rows_x4_occupancy_1": dict(BLOCK_ROWS=4, FWD_OCCUPANCY=4, BWD_OCCUPANCY=1, FWD_LATENCY=0, BWD_LATENCY=2),
}


@pytest.mark.parametrize("config", list(SWEPT_CONFIGS))
@pytest.mark.parametrize("name", ["gated_before_16384x2048", "gated_after_16384x2048", "add_norm_16384x1024"])
def test_kernels_in_swept_configs_at_lm_shapes_match_float64_reference(monkeypatch, name, config):
    from jax_mamba2 import backends, norm
    from jax_mamba2.bridge import ffi, norm_ops
    from jax_mamba2.kernels.rms_norm import NormConfig

    cfg = NormConfig(**SWEPT_CONFIGS[config])
    monkeypatch.setitem(backends._REGISTRY[norm.OP], "cutile", backends.LayerBackend(
        "cutile", norm_ops.make_kernels(ffi.run_plan, lambda dims: cfg), norm_ops.unsupported_reason,
        auto_priority=2))
    _check(LM_CASES[name], "cutile", seed=4)


def test_final_norm_without_its_residual_skips_the_zero_cotangent_and_matches_float64_reference():
    """add_rms_norm(return_residual=False) at the LM's shape: the backward kernel runs without dresidual_out (a
    symbolic zero) and its gradients are those of a zero residual cotangent."""
    case = LM_CASES["add_norm_16384x1024"]
    arrays = make_inputs(case, seed=5)
    x, residual, w, dout = (jnp.asarray(arrays[n]) for n in ("x", "residual", "weight", "dout"))

    def loss(x, residual, w):
        out = jax_mamba2.add_rms_norm(x, residual, w, eps=EPS, residual_dtype=jnp.float32, return_residual=False,
                                      backend="cutile")
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, residual, w)
    want = oracle(case, {**arrays, "dresidual_out": np.zeros_like(arrays["dresidual_out"])})
    errors = {n: rel_l2(g, want[n]) for n, g in zip(("dx", "dresidual", "dweight"), grads)}
    assert max(errors.values()) < TOLERANCE[case.dtype], errors


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
def test_first_block_norm_without_a_residual_matches_the_zero_stream_reference(backend):
    """add_rms_norm(x, None, ...) at the LM's shape (bf16 x, float32 stream): the kernels normalize h = x in
    float32 with no residual read; outputs and gradients as the float64 reference of a zero residual stream."""
    case = LM_CASES["add_norm_16384x1024"]
    arrays = make_inputs(case, seed=6)
    x, w, dout, dh = (jnp.asarray(arrays[n]) for n in ("x", "weight", "dout", "dresidual_out"))

    def loss(x, w):
        out, h = jax_mamba2.add_rms_norm(x, None, w, eps=EPS, residual_dtype=jnp.float32, backend=backend)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)) + jnp.sum(h * dh.astype(jnp.float32))

    zero_stream = {**arrays, "residual": np.zeros_like(arrays["residual"])}
    want = oracle(case, zero_stream)
    out, h = jax.jit(lambda x, w: jax_mamba2.add_rms_norm(x, None, w, eps=EPS, residual_dtype=jnp.float32,
                                                           backend=backend))(x, w)
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    errors = {"out": rel_l2(out, want["out"]), "residual_out": rel_l2(h, want["residual_out"]),
              "dx": rel_l2(dx, want["dx"]), "dweight": rel_l2(dw, want["dweight"])}
    assert h.dtype == jnp.float32 and max(errors.values()) < TOLERANCE[case.dtype], errors


def test_weight_gradient_is_bitwise_reproducible():
    case = LM_CASES["gated_before_16384x2048"]
    arrays = make_inputs(case, seed=2)
    primals = (jnp.asarray(arrays["x"]), jnp.asarray(arrays["z"]), None, jnp.asarray(arrays["weight"]))
    run = _forward_and_vjp(case, "cutile")
    grads = [run(primals, (jnp.asarray(arrays["dout"]), None))[1] for _ in range(3)]
    for other in grads[1:]:
        assert np.array_equal(np.asarray(grads[0][3]), np.asarray(other[3]))


def test_lm_runs_its_norms_on_the_kernels_and_its_loss_matches_xla():
    """A bf16 LM: the compiled training step holds the norm kernels' custom calls, and its chunked loss and
    gradients agree with the pure-JAX backend's."""
    config = Mamba2Config(d_model=256, n_layer=2, vocab_size=1000, pad_vocab_size_multiple=16,
                          ssm_cfg=dict(d_state=64, headdim=64, ngroups=2, chunk_size=64))
    ids = jax.random.randint(jax.random.key(3), (2, 256), 0, config.vocab_size)
    results = {}
    for backend in ("cutile", "xla"):
        model = Mamba2LMHeadModel(config, backend=backend, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        step = nnx.jit(nnx.value_and_grad(lambda m: m.loss(ids, chunk_tokens=128)))
        results[backend] = step(model)
        if backend == "cutile":
            graphdef, state = nnx.split(model)
            hlo = jax.jit(lambda s: nnx.value_and_grad(lambda m: m.loss(ids))(nnx.merge(graphdef, s))).lower(
                state).compile().as_text()
            for kernel in ("rms_norm_fwd_kernel", "rms_norm_bwd_kernel", "rms_norm_dweight_kernel"):
                assert kernel in hlo, kernel
    (loss, grads), (want, want_grads) = results["cutile"], results["xla"]
    assert abs(float(loss) - float(want)) < 1e-2 * abs(float(want))
    for (path, g), (_, w) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(want_grads)):
        assert rel_l2(g[...], w[...]) < 3e-2, path


@pytest.mark.parametrize("offset, columns", [(0, 4384), (72, 2048 + 72 + 264), (3, 2048 + 3 + 262)])
def test_gate_read_again_from_in_proj_output_at_lm_shape(offset, columns):
    """z_kept_in: the backward reads z from columns of a wider bf16 array (in_proj's output: z first at d1024,
    4384 columns; a 16-byte-aligned offset; an odd offset in rows of an odd width, which TMA cannot address),
    whose other columns are NaN; the gradients are the float64 reference's."""
    case = LM_CASES["gated_before_16384x2048"]
    arrays = make_inputs(case, seed=2)
    x, z, w = (jnp.asarray(arrays[n]) for n in ("x", "z", "weight"))
    source = jnp.full((case.rows, columns), jnp.nan, z.dtype).at[:, offset:offset + case.features].set(z)

    @jax.jit
    def grads(x, z, w, source):
        def loss(x, z, w):
            out = jax_mamba2.rms_norm(x, w, z, eps=EPS, z_kept_in=(source, offset), backend="cutile")
            return jnp.sum(out.astype(jnp.float32) * jnp.asarray(arrays["dout"], jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(x, z, w)

    want = oracle(case, arrays)
    errors = {n: rel_l2(g, want[n]) for n, g in zip(("dx", "dz", "dweight"), grads(x, z, w, source))}
    assert max(errors.values()) < TOLERANCE["bfloat16"], errors
