"""Tests of the Mamba2 mixer (jax_mamba2/flax_layers/mamba2.py).

The oracle is `_mamba2_numpy`, an independent float64 NumPy implementation of mamba_ssm's Mamba2 forward
(in_proj, causal conv, token-by-token SSD recurrence, gated grouped RMSNorm, MLP branch, out_proj).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_mamba2.flax_layers import Mamba2, RMSNorm
from tests._helpers import rel_l2

D_MODEL, BATCH, SEQLEN = 32, 2, 13
TINY = dict(d_state=8, headdim=8, chunk_size=8)


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _mamba2_numpy(layer: Mamba2, u) -> np.ndarray:
    """mamba_ssm's Mamba2 forward (no cache) in float64 NumPy, from the layer's parameters."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    batch, seqlen, _ = u.shape
    d_mlp, d_ssm, H, P = layer.d_mlp, layer.d_ssm, layer.nheads, layer.headdim
    G, N = layer.ngroups, layer.d_state

    zxbcdt = f64(u) @ f64(layer.in_proj.kernel[...])
    if layer.in_proj.bias is not None:
        zxbcdt += f64(layer.in_proj.bias[...])
    z0, x0, z, xBC, dt = np.split(zxbcdt, np.cumsum([d_mlp, d_mlp, d_ssm, d_ssm + 2 * G * N]), axis=-1)

    kernel = f64(layer.conv1d.kernel[...])  # (d_conv, conv_dim)
    d_conv = kernel.shape[0]
    padded = np.pad(xBC, ((0, 0), (d_conv - 1, 0), (0, 0)))
    conv = sum(kernel[k] * padded[:, k:k + seqlen] for k in range(d_conv)) + f64(layer.conv1d.bias[...])
    x, B, C = np.split(_silu(conv), [d_ssm, d_ssm + G * N], axis=-1)
    x = x.reshape(batch, seqlen, H, P)
    group_of_head = np.arange(H) // (H // G)
    B = B.reshape(batch, seqlen, G, N)[:, :, group_of_head]  # (b, L, H, N)
    C = C.reshape(batch, seqlen, G, N)[:, :, group_of_head]

    A = -np.exp(f64(layer.A_log[...]))
    delta = np.clip(np.logaddexp(0.0, dt + f64(layer.dt_bias[...])), *layer.dt_limit)  # (b, L, H)
    D = f64(layer.D[...]).reshape(H, -1)  # (H, 1) or (H, P)
    state = np.zeros((batch, H, P, N))
    ys = []
    for t in range(seqlen):
        decay = np.exp(delta[:, t] * A)[..., None, None]
        state = decay * state + (delta[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append(np.einsum("bhpn,bhn->bhp", state, C[:, t]) + D * x[:, t])
    y = np.stack(ys, axis=1)  # (b, L, H, P)

    if not layer.rmsnorm:
        y = (y * _silu(z.reshape(y.shape))).reshape(batch, seqlen, d_ssm)
    else:
        y = y.reshape(batch, seqlen, d_ssm)
        gate = _silu(z)
        norm_before_gate = layer.norm.norm_before_gate
        if not norm_before_gate:
            y = y * gate
        grouped = y.reshape(batch, seqlen, G, d_ssm // G)
        grouped = grouped / np.sqrt(np.mean(grouped**2, axis=-1, keepdims=True) + 1e-5)
        y = grouped.reshape(y.shape) * f64(layer.norm.scale[...])
        if norm_before_gate:
            y = y * gate
    if d_mlp:
        y = np.concatenate([_silu(z0) * x0, y], axis=-1)
    out = y @ f64(layer.out_proj.kernel[...])
    if layer.out_proj.bias is not None:
        out += f64(layer.out_proj.bias[...])
    return out


def _inputs(seed, shape=(BATCH, SEQLEN, D_MODEL), dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def test_mamba2_param_and_output_shapes_and_dtypes():
    layer = Mamba2(D_MODEL, **TINY, ngroups=2, bias=True, backend="xla", rngs=nnx.Rngs(0))
    H, conv_dim, d_in_proj = 8, 64 + 2 * 2 * 8, 2 * 64 + 2 * 2 * 8 + 8
    shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
    assert shapes == {
        "in_proj": {"kernel": (D_MODEL, d_in_proj), "bias": (d_in_proj,)},
        "conv1d": {"kernel": (4, conv_dim), "bias": (conv_dim,)},
        "dt_bias": (H,), "A_log": (H,), "D": (H,), "norm": {"scale": (64,)},
        "out_proj": {"kernel": (64, D_MODEL), "bias": (D_MODEL,)},
    }
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(nnx.state(layer)))
    u = _inputs(0)
    out = nnx.jit(lambda m, u: m(u))(layer, u)
    assert out.shape == u.shape and out.dtype == jnp.float32

    half = Mamba2(D_MODEL, **TINY, dtype=jnp.bfloat16, backend="xla", rngs=nnx.Rngs(0))
    out, cache = nnx.jit(lambda m, u: m.prefill(u))(half, u)
    assert out.dtype == jnp.bfloat16 and out.shape == u.shape
    assert cache.conv_state.shape == (BATCH, 64 + 2 * 8, 4) and cache.conv_state.dtype == jnp.float32
    assert cache.ssm_state.shape == (BATCH, H, 8, 8) and cache.ssm_state.dtype == jnp.float32


def test_mamba2_init_matches_mamba_ssm_formulas():
    d_model, headdim = 64, 2  # 64 heads: enough samples for the ranges
    layer = Mamba2(d_model, d_state=4, headdim=headdim, dt_min=1e-3, dt_max=1e-1, rngs=nnx.Rngs(3))
    dt = np.logaddexp(0.0, np.asarray(layer.dt_bias[...], np.float64))
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-1 * (1 + 1e-5)
    assert dt.min() < 3e-3 and dt.max() > 3e-2  # log-uniform over two decades
    A = np.exp(np.asarray(layer.A_log[...], np.float64))
    assert A.min() >= 1 - 1e-6 and A.max() <= 16 + 1e-5 and A.max() - A.min() > 10
    np.testing.assert_array_equal(layer.D[...], 1.0)
    np.testing.assert_array_equal(layer.norm.scale[...], 1.0)
    for kernel, fan_in in ((layer.in_proj.kernel, d_model), (layer.out_proj.kernel, 2 * d_model),
                           (layer.conv1d.kernel, 4), (layer.conv1d.bias, 4)):
        values = np.asarray(kernel[...])
        bound = 1 / math.sqrt(fan_in)  # PyTorch default init: U(-bound, bound)
        assert np.abs(values).max() <= bound and np.abs(values).max() > 0.9 * bound

    floored = Mamba2(d_model, d_state=4, headdim=headdim, dt_min=1e-5, dt_max=1e-3, dt_init_floor=1e-4,
                     rngs=nnx.Rngs(3))
    dt = np.logaddexp(0.0, np.asarray(floored.dt_bias[...], np.float64))
    assert dt.min() >= 1e-4 * (1 - 1e-4) and np.isclose(dt, 1e-4, rtol=1e-4).sum() > 10


@pytest.mark.parametrize("options", [
    pytest.param(dict(ngroups=1), id="ngroups1"),
    pytest.param(dict(ngroups=2), id="ngroups2"),
    pytest.param(dict(ngroups=1, d_ssm=48), id="ngroups1_mlp"),
    pytest.param(dict(ngroups=2, d_ssm=48, norm_before_gate=True, D_has_hdim=True, bias=True,
                      dt_limit=(0.01, 0.05)), id="ngroups2_mlp_norm_before_gate_hdimD_bias_dtlimit"),
    pytest.param(dict(ngroups=2, rmsnorm=False), id="ngroups2_no_rmsnorm"),
])
def test_mamba2_matches_numpy_float64(x64, options):
    layer = Mamba2(D_MODEL, **TINY, **options, backend="scan", param_dtype=jnp.float64, rngs=nnx.Rngs(1))
    # Non-trivial D and norm scale so that both paths are exercised.
    layer.D[...] = jax.random.normal(jax.random.key(5), layer.D[...].shape, jnp.float64)
    if layer.rmsnorm:
        layer.norm.scale[...] = jax.random.uniform(jax.random.key(6), (layer.d_ssm,), jnp.float64, 0.5, 1.5)
    u = _inputs(2, dtype=jnp.float64)
    out = nnx.jit(lambda m, u: m(u))(layer, u)
    assert out.dtype == jnp.float64
    assert rel_l2(out, _mamba2_numpy(layer, u)) < 1e-12


def test_mamba2_prefill_then_steps_match_forward():
    layer = Mamba2(D_MODEL, **TINY, ngroups=2, backend="xla", rngs=nnx.Rngs(0))
    u = _inputs(1)
    full = nnx.jit(lambda m, u: m(u))(layer, u)
    assert rel_l2(full, _mamba2_numpy(layer, u)) < 1e-5  # the default chunked path in float32

    prefill = nnx.jit(lambda m, u, cache: m.prefill(u, cache))
    step = nnx.jit(lambda m, u, cache: m.step(u, cache))
    # A 2-token prompt (shorter than d_conv), 3 decode steps, a chunked-prefill continuation, 3 more steps.
    out, cache = prefill(layer, u[:, :2], None)
    pieces = [out]
    for t in range(2, 5):
        out, cache = step(layer, u[:, t], cache)
        pieces.append(out[:, None])
    out, cache = prefill(layer, u[:, 5:10], cache)
    pieces.append(out)
    for t in range(10, SEQLEN):
        out, cache = step(layer, u[:, t], cache)
        pieces.append(out[:, None])
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, rtol=1e-5, atol=1e-5)

    _, cache = prefill(layer, u[:, :2], None)
    xBC = (u[:, :2] @ layer.in_proj.kernel[...])[..., 64: 64 + layer.conv_dim]  # after z (d_ssm = 64)
    np.testing.assert_array_equal(cache.conv_state[..., :2], 0.0)  # left-zero-padded
    np.testing.assert_allclose(cache.conv_state[..., 2:], jnp.swapaxes(xBC, 1, 2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.float64])
def test_mamba2_steps_under_x64_match_forward(x64, param_dtype):
    """With jax_enable_x64 the fused step's layer index (int32) and the Python ints of its stack updates stay one
    dtype; float64 parameters also take the gated norm's float64 sums of squares."""
    layer = Mamba2(D_MODEL, **TINY, backend="scan", param_dtype=param_dtype, rngs=nnx.Rngs(0))
    u = _inputs(2).astype(param_dtype)
    out, cache = layer.prefill(u[:, :SEQLEN - 2])
    pieces = [out]
    for t in range(SEQLEN - 2, SEQLEN):
        y, cache = layer.step(u[:, t], cache)
        pieces.append(y[:, None])
    assert pieces[-1].dtype == param_dtype
    tolerance = 1e-5 if param_dtype == jnp.float32 else 1e-12
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), layer(u), rtol=tolerance, atol=tolerance)


def test_mamba2_seq_idx_equals_separate_sequences():
    layer = Mamba2(D_MODEL, **TINY, backend="xla", rngs=nnx.Rngs(0))
    u = _inputs(3, (1, SEQLEN, D_MODEL))
    cut = 6

    @nnx.jit
    def packed_and_separate(m, u):
        packed = m(u, seq_idx=(jnp.arange(SEQLEN) >= cut).astype(jnp.int32)[None])
        return packed, jnp.concatenate([m(u[:, :cut]), m(u[:, cut:])], axis=1)

    packed, separate = packed_and_separate(layer, u)
    np.testing.assert_allclose(packed, separate, rtol=1e-5, atol=1e-5)


def test_mamba2_grads_finite_under_jit_and_remat():
    layer = Mamba2(D_MODEL, **TINY, ngroups=2, backend="xla", rngs=nnx.Rngs(0))
    u = _inputs(4)

    def loss(module, u):
        return jnp.mean(module(u) ** 2)

    grads = nnx.jit(nnx.grad(loss))(layer, u)
    remat_grads = nnx.jit(nnx.grad(nnx.remat(loss)))(layer, u)
    for name, g in nnx.to_flat_state(grads):
        g = np.asarray(g[...])
        assert np.isfinite(g).all() and np.abs(g).max() > 0, name
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(remat_grads)):
        np.testing.assert_allclose(r, g, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("options, message", [
    (dict(d_ssm=60), r"Mamba2: d_ssm=60 must be a positive multiple of headdim=8"),
    (dict(ngroups=3), r"Mamba2: nheads=d_ssm//headdim=8 must be divisible by ngroups=3"),
    (dict(chunk_size=12), r"Mamba2: chunk_size=12 must be a power of two"),
    (dict(dt_min=0.5), r"Mamba2: dt_min=0.5, dt_max=0.1 must satisfy"),
    (dict(A_init_range=(0, 16)), r"Mamba2: A_init_range=\(0, 16\)"),
    (dict(backend="cuda"), r"Mamba2: backend='cuda' must be one of 'auto', 'xla'"),
])
def test_mamba2_rejects_bad_config(options, message):
    with pytest.raises(ValueError, match=message):
        Mamba2(D_MODEL, **{**TINY, **options}, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("rngs", [0, jax.random.key(0)])
def test_mamba2_and_rmsnorm_reject_rngs_that_are_no_nnx_rngs(rngs):
    with pytest.raises(TypeError, match=r"Mamba2: rngs must be an nnx.Rngs"):
        Mamba2(D_MODEL, **TINY, rngs=rngs)
    with pytest.raises(TypeError, match=r"RMSNorm: rngs must be an nnx.Rngs"):
        RMSNorm(8, rngs=rngs)


@pytest.mark.parametrize("options, error, message", [
    (dict(features=0), ValueError, r"RMSNorm: features=0 must be a positive int"),
    (dict(features=8.0), TypeError, r"RMSNorm: features=8.0 must be a positive int"),
    (dict(group_size=3), ValueError, r"RMSNorm: group_size=3 must be a positive divisor of features=8"),
    (dict(group_size=0), ValueError, r"RMSNorm: group_size=0 must be a positive int"),
    (dict(eps=0.0), ValueError, r"RMSNorm: eps=0.0 must be a positive finite float"),
    (dict(norm_before_gate=1), TypeError, r"RMSNorm: norm_before_gate=1 must be a bool"),
    (dict(param_dtype=jnp.int8), TypeError, r"RMSNorm: param_dtype=int8 must be one of bfloat16"),
    (dict(dtype="float8_e4m3fn"), TypeError, r"RMSNorm: dtype=float8_e4m3fn must be one of bfloat16"),
])
def test_rmsnorm_rejects_bad_options(options, error, message):
    with pytest.raises(error, match=message):
        RMSNorm(**{**dict(features=8), **options}, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("options, error, message", [
    (dict(dt_limit=1.0), TypeError, r"Mamba2: dt_limit=1.0 must be a pair of floats \(min, max\)"),
    (dict(dt_limit="01"), TypeError, r"Mamba2: dt_limit='01' must be a pair of floats"),
    (dict(dt_limit=(0.5, 0.1)), ValueError, r"Mamba2: dt_limit=\(0.5, 0.1\) must satisfy 0 <= min <= max"),
    (dict(dt_limit=(-1.0, math.inf)), ValueError, r"Mamba2: dt_limit=\(-1.0, inf\) must satisfy"),
    (dict(dt_limit=(math.inf, math.inf)), ValueError, r"Mamba2: dt_limit=\(inf, inf\) must satisfy .* min finite"),
    (dict(A_init_range=(1, math.inf)), ValueError, r"Mamba2: A_init_range=\(1, inf\) must be finite"),
    (dict(dt_max=math.inf), ValueError, r"Mamba2: dt_max=inf must be finite"),
    (dict(rmsnorm="false"), TypeError, r"Mamba2: rmsnorm='false' must be a bool"),
    (dict(bias="no"), TypeError, r"Mamba2: bias='no' must be a bool"),
    (dict(D_has_hdim=1), TypeError, r"Mamba2: D_has_hdim=1 must be a bool"),
    (dict(check_finite=None), TypeError, r"Mamba2: check_finite=None must be a bool"),
    (dict(d_state=True), TypeError, r"Mamba2: d_state=True must be a positive int"),
    (dict(d_state=0), ValueError, r"Mamba2: d_state=0 must be a positive int"),
    (dict(d_ssm=16.0), TypeError, r"Mamba2: d_ssm=16.0 must be a positive multiple of headdim"),
    (dict(dtype="foo"), TypeError, r"Mamba2: dtype='foo' must be a float dtype"),
    (dict(param_dtype=jnp.int32), TypeError, r"Mamba2: param_dtype=int32 must be one of bfloat16"),
    (dict(param_dtype=None), TypeError, r"Mamba2: param_dtype=None must be one of bfloat16"),
    (dict(A_init_range=16), TypeError, r"Mamba2: A_init_range=16 must be a pair of numbers"),
    (dict(dt_min="0.001"), TypeError, r"Mamba2: dt_min='0.001' must be a number"),
    (dict(dt_init_floor=None), TypeError, r"Mamba2: dt_init_floor=None must be a number"),
    (dict(conv_init=0.0), ValueError, r"Mamba2: conv_init=0.0 must be a positive finite float"),
    (dict(conv_init="0.1"), TypeError, r"Mamba2: conv_init='0.1' must be a positive finite float"),
])
def test_mamba2_rejects_bad_ranges(options, error, message):
    with pytest.raises(error, match=message):
        Mamba2(D_MODEL, **{**TINY, **options}, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("d_model, options, message", [
    pytest.param(2 ** 40, {}, r"d_model=1099511627776 must be a positive int of at most 2\*\*31 - 1 \(an array axis\)",
                 id="d_model"),
    pytest.param(64, dict(d_state=2 ** 40), r"d_state=1099511627776 must be a positive int of at most 2\*\*31 - 1",
                 id="d_state"),
    pytest.param(2 ** 30, {}, r"d_inner=expand\*d_model=2147483648 must be at most 2\*\*31 - 1", id="d_inner"),
    pytest.param(2 ** 28, dict(d_state=2 ** 29), r"d_in_proj=2\*d_inner\+2\*ngroups\*d_state\+nheads=\d+ must be at most",
                 id="d_in_proj"),
    # Each axis fits int32, but in_proj's weight would hold 2^60 elements, more than XLA can count the bytes of.
    pytest.param(2 ** 29 + 2 ** 28, dict(expand=1, headdim=2 ** 28 + 2 ** 27),
                 r"in_proj.kernel of shape \(d_model, d_in_proj\)=\(805306368, \d+\) would hold \d+ elements; an "
                 r"array holds at most 2\*\*60 - 1", id="in_proj_elements"),
])
def test_mamba2_rejects_sizes_no_array_holds_before_drawing_a_parameter(d_model, options, message):
    """Sizes JAX cannot index (an axis of 2^31 or more) or whose weights XLA cannot count the bytes of raise a
    ValueError naming the size and the bound before a parameter is drawn, not an error from deep inside JAX's
    random number generator (or XLA aborting the process)."""
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match=rf"^Mamba2: {message}"):
        Mamba2(d_model, **{"d_state": 8, "headdim": 8, **options}, rngs=rngs)
    assert rngs.params.count[...] == 0  # no key drawn


def test_mamba2_takes_numpy_ints_as_python_ints():
    """Sizes read off arrays or configs (NumPy ints) build the same layer as Python ints, stored as Python ints."""
    layer = Mamba2(np.int64(D_MODEL), d_state=np.int32(8), headdim=np.int64(8), chunk_size=np.int64(8),
                   d_ssm=np.int64(2 * D_MODEL), rngs=nnx.Rngs(0))
    want = Mamba2(D_MODEL, **TINY, rngs=nnx.Rngs(0))
    assert all(type(getattr(layer, name)) is int for name in ("d_model", "d_state", "headdim", "d_ssm", "nheads"))
    u = jax.random.normal(jax.random.key(1), (BATCH, SEQLEN, D_MODEL))
    np.testing.assert_array_equal(layer(u), want(u))


def test_mamba2_conv_init_bounds_the_conv_kernel_as_mamba_ssm():
    """conv_init (mamba_ssm's): the conv kernel starts uniform in [-conv_init, conv_init]; the bias keeps
    PyTorch's default bound 1/sqrt(d_conv), as does the kernel without it."""
    layer = Mamba2(D_MODEL, **TINY, conv_init=0.01, rngs=nnx.Rngs(0))
    kernel, bias = np.asarray(layer.conv1d.kernel[...]), np.asarray(layer.conv1d.bias[...])
    assert np.abs(kernel).max() <= 0.01 and np.abs(kernel).max() > 0.009 and kernel.min() < -0.009
    assert 0.2 < np.abs(bias).max() <= 1 / math.sqrt(layer.d_conv)
    default = np.asarray(Mamba2(D_MODEL, **TINY, rngs=nnx.Rngs(0)).conv1d.kernel[...])
    assert 0.2 < np.abs(default).max() <= 1 / math.sqrt(layer.d_conv)
    # Drawn in float32, then rounded: a bf16 kernel keeps the bound and many values (not bf16's 128 steps).
    bf16 = np.asarray(Mamba2(D_MODEL, **TINY, conv_init=0.02, param_dtype=jnp.bfloat16,
                             rngs=nnx.Rngs(0)).conv1d.kernel[...], np.float32)
    assert np.abs(bf16).max() <= float(jnp.bfloat16(0.02)) and len(np.unique(bf16)) > 150  # the bound, rounded


@pytest.fixture(scope="module")
def tiny_layer():
    return Mamba2(D_MODEL, **TINY, backend="xla", rngs=nnx.Rngs(0))  # 8 heads, conv_dim 64 + 2 * 8 = 80


def _cache_of(layer, batch=BATCH, **replace):
    return layer.init_cache(batch)._replace(**{k: jnp.zeros(v) for k, v in replace.items()})


@pytest.mark.parametrize("call, error, message", [
    pytest.param(lambda m: m(jnp.ones((BATCH, D_MODEL))), ValueError,
                 r"Mamba2.__call__: hidden_states.shape=\(2, 32\) must be \(batch, seqlen, d_model\)="
                 r"\(batch, seqlen, 32\)", id="call_2d"),
    pytest.param(lambda m: m(jnp.ones((BATCH, SEQLEN, 16))), ValueError,
                 r"Mamba2.__call__: hidden_states.shape=\(2, 13, 16\) must be .*\(batch, seqlen, 32\)",
                 id="call_wrong_d_model"),
    pytest.param(lambda m: m(jnp.ones((BATCH, SEQLEN, D_MODEL), jnp.int32)), TypeError,
                 r"Mamba2.__call__: hidden_states.dtype=int32 must be one of bfloat16, float16, float32, float64",
                 id="call_int"),
    pytest.param(lambda m: m(_inputs(0).astype(jnp.float8_e4m3fn)), TypeError,
                 r"Mamba2.__call__: hidden_states.dtype=float8_e4m3fn must be one of bfloat16", id="call_float8"),
    pytest.param(lambda m: m(np.ones((BATCH, SEQLEN, D_MODEL)).tolist()), TypeError,
                 r"Mamba2.__call__: hidden_states must be an array of shape .* got list", id="call_list"),
    pytest.param(lambda m: m(jnp.ones((BATCH, SEQLEN, D_MODEL)), seq_idx=jnp.zeros((1, SEQLEN), jnp.int32)),
                 ValueError, r"Mamba2.__call__: seq_idx.shape=\(1, 13\) must be \(batch, seqlen\)=\(2, 13\)",
                 id="seq_idx_batch"),
    pytest.param(lambda m: m(jnp.ones((BATCH, SEQLEN, D_MODEL)), seq_idx=jnp.zeros((BATCH, SEQLEN))),
                 TypeError, r"Mamba2.__call__: seq_idx.dtype=float32 must be integer", id="seq_idx_float"),
    pytest.param(lambda m: m(jnp.ones((BATCH, SEQLEN, D_MODEL)),
                             seq_idx=jnp.tile(jnp.arange(SEQLEN, dtype=jnp.int32)[::-1], (BATCH, 1))),
                 ValueError, rf"Mamba2.__call__: seq_idx must be nondecreasing along seqlen; "
                 rf"seq_idx\[0, 1\]={SEQLEN - 2} follows {SEQLEN - 1}",
                 id="seq_idx_decreasing"),
    pytest.param(lambda m: m.prefill(jnp.ones((BATCH, SEQLEN, D_MODEL)), m.init_cache(3)), ValueError,
                 r"Mamba2.prefill: cache.conv_state.shape=\(3, 80, 4\) must be \(batch, conv_dim, d_conv\)="
                 r"\(2, 80, 4\)", id="prefill_cache_batch"),
    pytest.param(lambda m: m.prefill(jnp.ones((BATCH, SEQLEN, D_MODEL)), _cache_of(m, ssm_state=(2, 8, 8, 16))),
                 ValueError, r"Mamba2.prefill: cache.ssm_state.shape=\(2, 8, 8, 16\) must be "
                 r"\(batch, nheads, headdim, d_state\)=\(2, 8, 8, 8\)", id="prefill_cache_d_state"),
    pytest.param(lambda m: m.prefill(jnp.ones((BATCH, SEQLEN, D_MODEL)), {"conv_state": 0}), TypeError,
                 r"Mamba2.prefill: cache must be a Mamba2Cache \(conv_state, ssm_state\), got dict",
                 id="prefill_cache_dict"),
    pytest.param(lambda m: m.prefill(jnp.ones((BATCH, D_MODEL))), ValueError,
                 r"Mamba2.prefill: hidden_states.shape=\(2, 32\) must be \(batch, seqlen, d_model\)",
                 id="prefill_2d"),
    pytest.param(lambda m: m.step(jnp.ones((BATCH, 1, D_MODEL)), m.init_cache(BATCH)), ValueError,
                 r"Mamba2.step: hidden_states.shape=\(2, 1, 32\) must be \(batch, d_model\)=\(batch, 32\)",
                 id="step_3d"),
    pytest.param(lambda m: m.step(jnp.ones((BATCH, D_MODEL)), m.init_cache(3)), ValueError,
                 r"Mamba2.step: cache.conv_state.shape=\(3, 80, 4\) must be .*=\(2, 80, 4\)", id="step_cache_batch"),
    pytest.param(lambda m: m.step(jnp.ones((BATCH, D_MODEL)), _cache_of(m, conv_state=(2, 80, 3))), ValueError,
                 r"Mamba2.step: cache.conv_state.shape=\(2, 80, 3\)", id="step_cache_d_conv"),
    pytest.param(lambda m: m.step(_inputs(1, (BATCH, D_MODEL)).astype(jnp.float8_e5m2), m.init_cache(BATCH)),
                 TypeError, r"Mamba2.step: hidden_states.dtype=float8_e5m2 must be one of bfloat16", id="step_float8"),
    pytest.param(lambda m: m.prefill(_inputs(2), m.init_cache(BATCH)._replace(
                     ssm_state=_inputs(3, (BATCH, 8, 8, 8)).astype(jnp.float8_e4m3fn))),
                 TypeError, r"Mamba2.prefill: cache.ssm_state.dtype=float8_e4m3fn must be one of bfloat16",
                 id="prefill_cache_float8_state"),
    pytest.param(lambda m: m.init_cache(-1), ValueError, r"Mamba2.init_cache: batch_size=-1 must be an int >= 0",
                 id="init_cache_negative"),
    pytest.param(lambda m: m.init_cache(2.0), TypeError, r"Mamba2.init_cache: batch_size=2.0 must be an int >= 0",
                 id="init_cache_float"),
    pytest.param(lambda m: m.init_cache(2, jnp.int32), TypeError,
                 r"Mamba2.init_cache: dtype=int32 must be one of bfloat16, float16, float32, float64",
                 id="init_cache_int"),
    pytest.param(lambda m: m.init_cache(2, "float8_e4m3fn"), TypeError,
                 r"Mamba2.init_cache: dtype=float8_e4m3fn must be one of bfloat16", id="init_cache_float8"),
    pytest.param(lambda m: m.prefill(jnp.ones((BATCH, 8, D_MODEL)), cache_dtype=jnp.float8_e5m2), TypeError,
                 r"Mamba2.prefill: cache_dtype=float8_e5m2 must be one of bfloat16", id="prefill_cache_float8"),
])
def test_mamba2_rejects_bad_inputs(tiny_layer, call, error, message):
    with pytest.raises(error, match=message):
        call(tiny_layer)


@pytest.mark.parametrize("backend", ["xla", "scan"])
def test_mamba2_empty_sequence_gives_empty_output_and_keeps_the_cache(backend):
    layer = Mamba2(D_MODEL, **TINY, ngroups=2, backend=backend, rngs=nnx.Rngs(0))
    empty = jnp.ones((BATCH, 0, D_MODEL))
    out = layer(empty, seq_idx=jnp.zeros((BATCH, 0), jnp.int32))
    assert out.shape == (BATCH, 0, D_MODEL) and out.dtype == jnp.float32
    cache = jax.tree.map(lambda a: jax.random.normal(jax.random.key(0), a.shape, a.dtype), layer.init_cache(BATCH))
    out, same = layer.prefill(empty, cache)
    assert out.shape == (BATCH, 0, D_MODEL)
    for kept, given in zip(same, cache):
        np.testing.assert_array_equal(kept, given)
    _, zeros = layer.prefill(empty)
    for state in zeros:
        np.testing.assert_array_equal(state, 0.0)
