"""Tests of the pure-JAX SSD reference paths (jax_mamba2/reference.py).

The oracle of last resort is `_ssd_numpy_loop`, an independent float64 NumPy loop over tokens written here.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jax_mamba2 import reference

BATCH, NHEADS, HEADDIM, DSTATE = 2, 4, 3, 5
DT_LIMIT = (0.1, 1.2)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _rel_l2(actual, expected) -> float:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def _make_inputs(seed, *, seqlen, ngroups=1, batch=BATCH, nheads=NHEADS, headdim=HEADDIM, dstate=DSTATE,
                 D_shape=None, with_z=False, transform_dt=False, with_initial_states=False,
                 dtype=jnp.float64, param_dtype=None):
    """Random SSD operands: ((x, dt, A, B, C), keyword options) for `ssd_scan`/`ssd_chunked`.

    transform_dt adds dt_bias, softplus and DT_LIMIT (raw dt ~ U(-3, 1)); otherwise dt ~ U(1e-3, 0.5).
    A, D, dt_bias and initial_states use param_dtype (default: dtype).
    """
    param_dtype = param_dtype or dtype
    keys = jax.random.split(jax.random.PRNGKey(seed), 9)
    x = jax.random.normal(keys[0], (batch, seqlen, nheads, headdim), dtype)
    dt_range = (-3.0, 1.0) if transform_dt else (1e-3, 0.5)
    dt = jax.random.uniform(keys[1], (batch, seqlen, nheads), dtype, *dt_range)
    A = -jnp.exp(jax.random.uniform(keys[2], (nheads,), param_dtype, -2.0, 1.0))
    B = jax.random.normal(keys[3], (batch, seqlen, ngroups, dstate), dtype)
    C = jax.random.normal(keys[4], (batch, seqlen, ngroups, dstate), dtype)
    options = {}
    if D_shape == "head":
        options["D"] = jax.random.normal(keys[5], (nheads,), param_dtype)
    elif D_shape == "headdim":
        options["D"] = jax.random.normal(keys[5], (nheads, headdim), param_dtype)
    if with_z:
        options["z"] = jax.random.normal(keys[6], (batch, seqlen, nheads, headdim), dtype)
    if transform_dt:
        options["dt_bias"] = jax.random.uniform(keys[7], (nheads,), param_dtype, -0.5, 0.5)
        options["dt_softplus"] = True
        options["dt_limit"] = DT_LIMIT
    if with_initial_states:
        options["initial_states"] = jax.random.normal(keys[8], (batch, nheads, headdim, dstate), param_dtype)
    return (x, dt, A, B, C), options


def _ssd_numpy_loop(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                    dt_limit=(0.0, np.inf), initial_states=None, seq_idx=None):
    """The SSD recurrence token by token in float64 NumPy; returns (y, final_states)."""
    x, dt, A, B, C = (np.asarray(a, np.float64) for a in (x, dt, A, B, C))
    batch, seqlen, nheads, headdim = x.shape
    heads_per_group = nheads // B.shape[2]
    delta = dt + (0.0 if dt_bias is None else np.asarray(dt_bias, np.float64))
    if dt_softplus:
        delta = np.logaddexp(0.0, delta)
    delta = np.clip(delta, *dt_limit)
    if initial_states is None:
        h = np.zeros((batch, nheads, headdim, B.shape[3]))
    else:
        h = np.array(initial_states, np.float64)
    y = np.zeros_like(x)
    for b in range(batch):
        previous_id = 0
        for t in range(seqlen):
            if seq_idx is not None:
                if seq_idx[b, t] != previous_id:
                    h[b] = 0.0
                previous_id = seq_idx[b, t]
            for head in range(nheads):
                group = head // heads_per_group
                d = delta[b, t, head]
                h[b, head] = np.exp(d * A[head]) * h[b, head] + d * np.outer(x[b, t, head], B[b, t, group])
                y[b, t, head] = h[b, head] @ C[b, t, group]
    if D is not None:
        D = np.asarray(D, np.float64)
        y = y + (D[:, None] if D.ndim == 1 else D) * x
    if z is not None:
        z = np.asarray(z, np.float64)
        y = y * z / (1.0 + np.exp(-z))
    return y, h


# Packed rows for seqlen 48, chunk 16. Row 0 starts with id 0 and continues across the first chunk boundary,
# then a boundary falls exactly on a chunk boundary (32). Row 1 starts with id 1 (initial states must not
# reach it), changes id exactly at a chunk boundary (16), holds a sequence that starts and ends inside a chunk,
# and ends mid-chunk.
_SEQ_IDX_48 = np.array([[0] * 20 + [1] * 12 + [2] * 16,
                        [1] * 16 + [2] * 2 + [3] * 5 + [4] * 25], np.int32)
# seqlen 37 (not a multiple of 16): the last sequence of each row lives in the partial last chunk.
_SEQ_IDX_37 = np.array([[0] * 30 + [1] * 7,
                        [0] * 5 + [1] * 27 + [2] * 3 + [3] * 2], np.int32)

_CASES = {
    "L37_Q16_G1_Dhead": dict(seqlen=37, chunk_size=16, ngroups=1, D_shape="head"),
    "L64_Q16_G2_Dheaddim_z": dict(seqlen=64, chunk_size=16, ngroups=2, D_shape="headdim", with_z=True),
    "L1_Q16_GH_init": dict(seqlen=1, chunk_size=16, ngroups=NHEADS, with_initial_states=True),
    "L37_Q8_dt_bias_softplus_limit": dict(seqlen=37, chunk_size=8, ngroups=2, transform_dt=True),
    "L48_Q16_init_final": dict(seqlen=48, chunk_size=16, ngroups=1, with_initial_states=True),
    "L48_Q16_seq_idx_init": dict(seqlen=48, chunk_size=16, ngroups=2, with_initial_states=True,
                                 seq_idx=_SEQ_IDX_48),
    "L37_Q16_all_features": dict(seqlen=37, chunk_size=16, ngroups=2, D_shape="headdim", with_z=True,
                                 transform_dt=True, with_initial_states=True, seq_idx=_SEQ_IDX_37),
}


def _case_inputs(case, seed=0, **overrides):
    """Inputs for a _CASES entry: ((x, dt, A, B, C), options incl. seq_idx, chunk_size)."""
    case = dict(case, **overrides)
    chunk_size = case.pop("chunk_size")
    seq_idx = case.pop("seq_idx", None)
    args, options = _make_inputs(seed, **case)
    if seq_idx is not None:
        options["seq_idx"] = jnp.asarray(seq_idx)
    return args, options, chunk_size


_STATIC = ("chunk_size", "dt_softplus", "dt_limit")
_ssd_chunked_jit = jax.jit(reference.ssd_chunked, static_argnames=_STATIC)
_ssd_scan_jit = jax.jit(reference.ssd_scan, static_argnames=_STATIC[1:])


@pytest.mark.parametrize("case", list(_CASES.values()), ids=list(_CASES))
def test_ssd_scan_matches_numpy_loop(x64, case):
    args, options, _ = _case_inputs(case)
    y, final_states = _ssd_scan_jit(*args, **options)
    y_expected, final_expected = _ssd_numpy_loop(*args, **options)
    assert y.dtype == jnp.float64 and final_states.dtype == jnp.float64
    assert _rel_l2(y, y_expected) < 1e-12
    assert _rel_l2(final_states, final_expected) < 1e-12


@pytest.mark.parametrize("case", list(_CASES.values()), ids=list(_CASES))
def test_ssd_chunked_matches_scan_float64(x64, case):
    args, options, chunk_size = _case_inputs(case)
    y, final_states = _ssd_chunked_jit(*args, chunk_size=chunk_size, **options)
    y_scan, final_scan = _ssd_scan_jit(*args, **options)
    y_loop, final_loop = _ssd_numpy_loop(*args, **options)
    assert y.shape == args[0].shape and y.dtype == jnp.float64
    assert final_states.shape == (BATCH, NHEADS, HEADDIM, DSTATE) and final_states.dtype == jnp.float64
    assert _rel_l2(y, y_scan) < 1e-10
    assert _rel_l2(final_states, final_scan) < 1e-10
    assert _rel_l2(y, y_loop) < 1e-10
    assert _rel_l2(final_states, final_loop) < 1e-10


@pytest.mark.parametrize("dtype, y_tol", [(jnp.bfloat16, 1e-2), (jnp.float32, 1e-5)], ids=["bf16", "f32"])
def test_ssd_chunked_low_precision_matches_float64_scan(x64, dtype, y_tol):
    case = _CASES["L37_Q16_all_features"]
    args, options, chunk_size = _case_inputs(case, dtype=dtype, param_dtype=jnp.float32)
    y, final_states = _ssd_chunked_jit(*args, chunk_size=chunk_size, **options)
    as_f64 = functools.partial(jax.tree.map, lambda a: a.astype(jnp.float64) if a.dtype == dtype else a)
    options_f64 = {k: (as_f64(v) if isinstance(v, jax.Array) else v) for k, v in options.items()}
    y_expected, final_expected = _ssd_scan_jit(*as_f64(args), **options_f64)
    assert y.dtype == dtype and final_states.dtype == jnp.float32
    assert _rel_l2(y, y_expected) < y_tol
    # States never pass through dtype: only float32 accumulation error remains.
    assert _rel_l2(final_states, final_expected) < 1e-5


def _grad_inputs(seqlen):
    """Differentiable operands (x, dt, A, B, C, D, z, dt_bias, initial_states) with softplus and dt_limit."""
    (x, dt, A, B, C), options = _make_inputs(
        1, seqlen=seqlen, batch=2, nheads=2, headdim=2, dstate=3, ngroups=1, D_shape="headdim", with_z=True,
        transform_dt=True, with_initial_states=True)
    return (x, dt, A, B, C, options["D"], options["z"], options["dt_bias"], options["initial_states"])


def _as_differentiable(ssd_fn, **static):
    """Wraps ssd_fn into f(x, dt, A, B, C, D, z, dt_bias, initial_states) -> (y, final_states)."""
    def f(x, dt, A, B, C, D, z, dt_bias, initial_states):
        return ssd_fn(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True, dt_limit=DT_LIMIT,
                      initial_states=initial_states, **static)
    return f


def test_ssd_chunked_grads_match_finite_differences(x64):
    seq_idx = jnp.asarray([[0] * 6 + [1] * 7, [1] * 4 + [2] * 9], jnp.int32)  # seqlen 13, chunk 4
    f = _as_differentiable(reference.ssd_chunked, chunk_size=4, seq_idx=seq_idx)
    # The cotangent of check_grads covers both outputs, so the loss also flows through final_states.
    check_grads(jax.jit(f), _grad_inputs(13), order=1, modes=("rev",))


def test_ssd_scan_grads_match_finite_differences(x64):
    check_grads(jax.jit(_as_differentiable(reference.ssd_scan)), _grad_inputs(5), order=1, modes=("rev",))


def test_dt_transform_grad_finite_above_softplus_threshold(x64):
    dt = jnp.asarray([-50.0, -1.0, 19.5, 25.0, 800.0])
    grad = jax.grad(lambda v: reference.dt_transform(v, dt_softplus=True).sum())(dt)
    dt = np.asarray(dt)
    np.testing.assert_allclose(grad, np.where(dt <= 20.0, 1.0 / (1.0 + np.exp(-dt)), 1.0), rtol=1e-12)


def test_dt_transform_matches_softplus_and_clips_to_limit(x64):
    dt = jnp.linspace(-6.0, 30.0, 37)
    bias = jnp.asarray(0.25)
    delta = reference.dt_transform(dt[:, None], bias[None], dt_softplus=True, dt_limit=(0.01, 5.0))
    np.testing.assert_allclose(delta[:, 0], np.clip(np.logaddexp(0.0, np.asarray(dt + bias)), 0.01, 5.0),
                               rtol=1e-13)
    assert reference.dt_transform(jnp.ones((2, 3), jnp.bfloat16)).dtype == jnp.float32


def test_chunk_cumsum_pads_zero_dt_after_transform(x64):
    (_, dt, A, _, _), options = _make_inputs(2, seqlen=37, transform_dt=True)
    dt_out, dA_cumsum = reference.chunk_cumsum(dt, A, 16, options["dt_bias"], True, DT_LIMIT)
    assert dt_out.shape == dA_cumsum.shape == (BATCH, NHEADS, 3, 16)
    # 37 = 2 * 16 + 5: softplus of the raw zero padding would be log(2) + bias; it must be exactly 0.
    assert np.all(np.asarray(dt_out[:, :, 2, 5:]) == 0.0)
    np.testing.assert_array_equal(dA_cumsum[:, :, 2, -1], dA_cumsum[:, :, 2, 4])


def test_ssd_chunked_has_no_nchunks_squared_intermediate():
    nchunks = 7
    (x, dt, A, B, C), _ = _make_inputs(0, seqlen=4 * nchunks, dtype=jnp.float32)
    jaxpr = jax.make_jaxpr(functools.partial(reference.ssd_chunked, chunk_size=4))(x, dt, A, B, C)

    def shapes(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (v.aval.shape for v in eqn.outvars)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from shapes(inner)

    all_shapes = list(shapes(jaxpr.jaxpr))
    assert any(nchunks in shape for shape in all_shapes)
    assert not [shape for shape in all_shapes if list(shape).count(nchunks) > 1]


def test_ssd_chunked_caps_a_chunk_longer_than_the_sequence():
    """chunk_size 16384 at seqlen 48 runs at chunk 64 (the next power of two): the same program and
    results, no 16384 x 16384 intermediate, and the compiled temporaries of chunk 64."""
    (x, dt, A, B, C), _ = _make_inputs(0, seqlen=48, batch=1, dtype=jnp.float32)
    programs = {chunk: jax.jit(functools.partial(reference.ssd_chunked, chunk_size=chunk))
                for chunk in (64, 16384)}
    for got, want in zip(programs[16384](x, dt, A, B, C), programs[64](x, dt, A, B, C)):
        np.testing.assert_array_equal(got, want)
    jaxpr = jax.make_jaxpr(functools.partial(reference.ssd_chunked, chunk_size=16384))(x, dt, A, B, C)
    assert max(d for eqn in jaxpr.eqns for v in eqn.outvars for d in v.aval.shape) <= 64
    memory = [programs[c].lower(x, dt, A, B, C).compile().memory_analysis() for c in (64, 16384)]
    if all(m is not None for m in memory):  # None where the backend does not report it
        assert memory[1].temp_size_in_bytes == memory[0].temp_size_in_bytes


def test_ssd_step_chain_matches_scan_and_chunked(x64):
    case = dict(_CASES["L37_Q16_all_features"], seqlen=9, chunk_size=4)
    del case["seq_idx"]
    (x, dt, A, B, C), options, chunk_size = _case_inputs(case)
    y_scan, final_scan = _ssd_scan_jit(x, dt, A, B, C, **options)
    y_chunked, final_chunked = _ssd_chunked_jit(x, dt, A, B, C, chunk_size=chunk_size, **options)

    step_options = {k: v for k, v in options.items() if k not in ("initial_states", "z")}
    step = jax.jit(functools.partial(reference.ssd_step, A=A, **step_options))
    state = options["initial_states"]
    ys = []
    for t in range(x.shape[1]):
        y_t, state = step(state, x[:, t], dt[:, t], B=B[:, t], C=C[:, t], z=options["z"][:, t])
        ys.append(y_t)
    y_steps = jnp.stack(ys, axis=1)
    assert state.dtype == jnp.float64 and y_steps.dtype == jnp.float64
    for y_expected, final_expected in ((y_scan, final_scan), (y_chunked, final_chunked)):
        assert _rel_l2(y_steps, y_expected) < 1e-12
        assert _rel_l2(state, final_expected) < 1e-12


def test_ssd_step_keeps_state_dtype():
    (x, dt, A, B, C), _ = _make_inputs(3, seqlen=1, dtype=jnp.float32)
    state = jnp.ones((BATCH, NHEADS, HEADDIM, DSTATE), jnp.bfloat16)
    y, new_state = reference.ssd_step(state, x[:, 0].astype(jnp.bfloat16), dt[:, 0], A, B[:, 0], C[:, 0])
    assert y.dtype == jnp.bfloat16 and new_state.dtype == jnp.bfloat16


@pytest.mark.parametrize("ssd_fn", [functools.partial(reference.ssd_chunked, chunk_size=16), reference.ssd_scan],
                         ids=["chunked", "scan"])
def test_ssd_vmap_over_leading_axis_matches_loop(x64, ssd_fn):
    case = _CASES["L37_Q16_all_features"]
    batched = [_case_inputs(case, seed=seed)[:2] for seed in (10, 11)]
    (_, _, A, _, _), options = batched[0]
    per_item = ("x", "dt", "B", "C", "z", "initial_states", "seq_idx")

    def f(x, dt, B, C, z, initial_states, seq_idx):
        return ssd_fn(x, dt, A, B, C, D=options["D"], z=z, dt_bias=options["dt_bias"], dt_softplus=True,
                      dt_limit=DT_LIMIT, initial_states=initial_states, seq_idx=seq_idx)

    def operands(args, opts):
        named = dict(zip(("x", "dt", "A", "B", "C"), args), **opts)
        return [named[name] for name in per_item]

    stacked = [jnp.stack(items) for items in zip(*(operands(*item) for item in batched))]
    y_vmap, final_vmap = jax.jit(jax.vmap(f))(*stacked)
    for i, item in enumerate(batched):
        y_i, final_i = f(*operands(*item))
        assert _rel_l2(y_vmap[i], y_i) < 1e-13
        assert _rel_l2(final_vmap[i], final_i) < 1e-13
