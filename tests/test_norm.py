"""The RMSNorm ops' public API on the CPU (jax_mamba2/norm.py): argument checks, the "xla" path against the
float64 reference, what "auto" picks without a GPU, empty inputs, and an explicit kernel backend that cannot run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_mamba2
from jax_mamba2 import norm_reference
from jax_mamba2.flax_layers.norm import RMSNorm
from tests._helpers import rel_l2

X = jax.random.normal(jax.random.key(0), (3, 5, 32), jnp.float32)
Z = jax.random.normal(jax.random.key(1), X.shape, jnp.float32)
W = 1 + 0.1 * jax.random.normal(jax.random.key(2), (32,))


@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("group_size", [None, 8])
def test_xla_and_auto_on_cpu_are_the_reference(group_size, norm_before_gate):
    """Without a GPU "auto" traces the reference alone (no platform switch, no custom VJP)."""
    options = dict(group_size=group_size, norm_before_gate=norm_before_gate)
    want = jax.jit(lambda x, z, w: norm_reference.rms_norm(x, w, z, eps=1e-5, **options))(X, Z, W)
    for backend in ("xla", "auto"):
        op = jax.jit(lambda x, z, w, backend=backend: jax_mamba2.rms_norm(x, w, z, **options, backend=backend))
        assert rel_l2(op(X, Z, W), want) == 0.0
        jaxpr = str(jax.make_jaxpr(op)(X, Z, W))
        assert "custom_vjp" not in jaxpr and "platform_index" not in jaxpr


def test_add_rms_norm_matches_its_definition_in_float64():
    """h = x + residual (added in float64, kept in float64), out = rms_norm(h); gradients through both."""
    with jax.enable_x64(True):
        x, r, w = (a.astype(jnp.float64) for a in (X, Z, W))

        def f(x, r, w):
            out, h = jax_mamba2.add_rms_norm(x, r, w, eps=1e-6, backend="xla")
            return jnp.sum(out * jnp.cos(x)) + jnp.sum(h ** 2)

        def g(x, r, w):
            h = x + r
            return jnp.sum(norm_reference.rms_norm(h, w, eps=1e-6) * jnp.cos(x)) + jnp.sum(h ** 2)

        for got, want in zip(jax.grad(f, argnums=(0, 1, 2))(x, r, w), jax.grad(g, argnums=(0, 1, 2))(x, r, w)):
            assert rel_l2(got, want) < 1e-14


def test_add_rms_norm_dtypes():
    out, h = jax_mamba2.add_rms_norm(X.astype(jnp.bfloat16), Z, W, residual_dtype=jnp.float32)
    assert out.dtype == jnp.bfloat16 and h.dtype == jnp.float32
    out = jax_mamba2.add_rms_norm(X.astype(jnp.bfloat16), Z.astype(jnp.bfloat16), W, out_dtype=jnp.float32,
                                  return_residual=False)
    assert out.dtype == jnp.float32


def test_add_rms_norm_rounds_the_output_once_under_a_narrower_residual_stream():
    """A bfloat16 residual stream under a float32 output: h is rounded to bfloat16, normalized in float32 and the
    output rounded once, to float32 (as the kernels store it), not to the stream's bfloat16 first."""
    out, h = jax_mamba2.add_rms_norm(X, Z, W, residual_dtype=jnp.bfloat16, out_dtype=jnp.float32, backend="xla")
    assert h.dtype == jnp.bfloat16 and out.dtype == jnp.float32
    h64 = np.asarray(h.astype(jnp.float32), np.float64)
    want = h64 / np.sqrt(np.mean(h64 ** 2, axis=-1, keepdims=True) + 1e-5) * np.asarray(W, np.float64)
    assert rel_l2(out, want) < 1e-6


@pytest.mark.parametrize("x_dtype, residual_dtype, out_dtype", [
    (jnp.bfloat16, jnp.float32, None), (jnp.float32, jnp.bfloat16, jnp.float32), (jnp.float32, None, None)])
def test_add_rms_norm_without_a_residual_is_the_add_of_a_zero_stream(x_dtype, residual_dtype, out_dtype):
    """residual=None (mamba_ssm's first block): h = x in residual_dtype and out its norm, outputs and gradients
    those of adding a zero residual stream of that dtype, read from x alone."""
    x = X.astype(x_dtype)
    dtype = x_dtype if residual_dtype is None else residual_dtype
    zeros = jnp.zeros(x.shape, dtype)
    options = dict(eps=1e-5, residual_dtype=residual_dtype, out_dtype=out_dtype, backend="xla")

    def loss(f):
        def value(x, w):
            out, h = f(x, w)
            assert h.dtype == dtype and out.dtype == (out_dtype or x_dtype)
            return jnp.sum(out.astype(jnp.float32) * jnp.cos(X)) + jnp.sum(h.astype(jnp.float32) ** 2)
        return jax.value_and_grad(value, argnums=(0, 1))

    got = loss(lambda x, w: jax_mamba2.add_rms_norm(x, None, w, **options))(x, W)
    want = loss(lambda x, w: jax_mamba2.add_rms_norm(x, zeros, w, **options))(x, W)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and rel_l2(a, b) == 0.0
    # No zeros are added where the stream holds x (a narrower one adds them: its add keeps dx in x's precision).
    eqns = jax.make_jaxpr(lambda x: jax_mamba2.add_rms_norm(x, None, W, **options))(x).jaxpr.eqns
    adds = [e for e in eqns if e.primitive.name == "add" and all(v.aval.shape == x.shape for v in e.invars)]
    assert bool(adds) == (jnp.promote_types(x.dtype, dtype) != dtype)


def test_empty_inputs_give_empty_outputs():
    x = jnp.zeros((0, 32), jnp.bfloat16)
    assert jax_mamba2.rms_norm(x, W, x).shape == (0, 32)
    out, h = jax_mamba2.add_rms_norm(x, x.astype(jnp.float32), W)
    assert out.shape == h.shape == (0, 32)


def test_sum_groups_runs_the_xla_path_and_a_named_kernel_backend_refuses_it():
    """A group split across devices: the reference's sum_groups hook under "auto" and "xla"; a kernel backend
    asked for by name never falls back, so it refuses; the layer (whose backend names every other call's
    kernels) runs such a group on XLA."""
    half = (X[..., :16], W[:16])
    want = norm_reference.rms_norm(jnp.concatenate([X[..., :16]] * 2, -1), jnp.concatenate([W[:16]] * 2), eps=1e-5)
    for backend in ("auto", "xla"):
        doubled = jax_mamba2.rms_norm(*half, group_size=32, sum_groups=lambda s: 2 * s, backend=backend)
        assert rel_l2(doubled, want[..., :16]) < 1e-6
    for backend in ("cutile", "cutile_callback"):
        with pytest.raises(ValueError, match=rf"rms_norm: backend='{backend}' cannot run sum_groups"):
            jax_mamba2.rms_norm(*half, group_size=32, sum_groups=lambda s: 2 * s, backend=backend)
    with pytest.raises(ValueError, match=r"rms_norm: backend='scan' must be one of 'auto', 'xla'"):
        jax_mamba2.rms_norm(*half, group_size=32, sum_groups=lambda s: 2 * s, backend="scan")
    layer = RMSNorm(X.shape[-1], backend="cutile", rngs=nnx.Rngs(0))  # no GPU here: the kernels could not run
    layer.scale[...] = W
    want = norm_reference.rms_norm(X, W, eps=1e-5)
    assert rel_l2(layer(X, sum_groups=lambda s: s), want) < 1e-6  # the whole group on this "device"


def test_explicit_kernel_backend_without_gpu_says_why():
    pytest.importorskip("cuda.tile")
    with pytest.raises(ValueError, match=r"rms_norm\(backend='cutile'\) cannot run this call: no CUDA device"):
        jax_mamba2.rms_norm(X, W, backend="cutile")
    with pytest.raises(ValueError, match=r"add_rms_norm\(backend='cutile_callback'\) cannot run this call: x is "
                                         r"float64"):
        with jax.enable_x64(True):
            jax_mamba2.add_rms_norm(X.astype(jnp.float64), Z, W, backend="cutile_callback")


def test_eps_as_a_concrete_scalar_array_is_the_same_number():
    """eps read off a model's parameters or a config as a 0-d array (NumPy or JAX) is taken as its value."""
    want = jax_mamba2.rms_norm(X, W, Z, eps=1e-5, backend="xla")
    for eps in (np.float32(1e-5), jnp.float32(1e-5), np.array(1e-5)):
        np.testing.assert_array_equal(jax_mamba2.rms_norm(X, W, Z, eps=eps, backend="xla"), want)
    bf16 = jnp.bfloat16(1e-5)  # a dtype NumPy's number types leave out
    np.testing.assert_array_equal(jax_mamba2.rms_norm(X, W, Z, eps=bf16, backend="xla"),
                                  jax_mamba2.rms_norm(X, W, Z, eps=float(bf16), backend="xla"))


@pytest.mark.parametrize("call,error,message", [
    (lambda: jax_mamba2.rms_norm(X, W[:16]), ValueError, r"rms_norm: weight.shape=\(16,\) must be \(features,\)"),
    (lambda: jax_mamba2.rms_norm(X, W, Z[..., :8]), ValueError, r"rms_norm: z.shape=\(3, 5, 8\) must be x.shape"),
    (lambda: jax_mamba2.rms_norm(X.astype(jnp.int32), W), TypeError, r"rms_norm: x.dtype=int32 must be one of"),
    (lambda: jax_mamba2.rms_norm(X, W, group_size=5), ValueError,
     r"rms_norm: group_size=5 must be a positive divisor of features=32"),
    (lambda: jax_mamba2.rms_norm(X, W, group_size=2.0), TypeError, r"rms_norm: group_size=2.0 must be an int"),
    (lambda: jax_mamba2.rms_norm(X, W, eps=0.0), ValueError, r"rms_norm: eps=0.0 must be a positive finite float"),
    (lambda: jax_mamba2.rms_norm(X, W, eps=True), TypeError, r"rms_norm: eps=True must be a positive finite float"),
    (lambda: jax_mamba2.rms_norm(X, W, eps=jnp.zeros(())), ValueError, r"rms_norm: eps=0.0 must be a positive"),
    (lambda: jax_mamba2.rms_norm(X, W, backend="scan"), ValueError, r"rms_norm: backend='scan' must be one of"),
    (lambda: jax_mamba2.rms_norm(X, W, sum_groups=3), TypeError, r"rms_norm: sum_groups=3 must be a callable"),
    (lambda: jax_mamba2.add_rms_norm(X, Z[:1], W), ValueError, r"add_rms_norm: residual.shape=\(1, 5, 32\) must be"),
    (lambda: jax_mamba2.add_rms_norm(X, Z, W, residual_dtype=jnp.int8), TypeError,
     r"add_rms_norm: residual_dtype=int8 must be one of"),
    (lambda: jax_mamba2.add_rms_norm(X, Z, np.ones(32, np.int32)), TypeError, r"add_rms_norm: weight.dtype=int32 must"),
    (lambda: jax_mamba2.rms_norm(X[..., :0], W[:0]), ValueError, r"rms_norm: x.shape=\(3, 5, 0\) must be \(\.\.\., "
     r"features\) with features >= 1"),
    (lambda: jax_mamba2.rms_norm(X, W, Z, norm_before_gate="no"), TypeError,
     r"rms_norm: norm_before_gate='no' must be a bool"),
    (lambda: jax_mamba2.add_rms_norm(X, Z, W, return_residual="no"), TypeError,
     r"add_rms_norm: return_residual='no' must be a bool"),
])
def test_invalid_arguments_raise_naming_them(call, error, message):
    with pytest.raises(error, match=message):
        call()
