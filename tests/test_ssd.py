"""The public op: checks, dispatch, and the custom VJP / vmap plumbing of opaque backends (CPU)."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mamba2
from jax_mamba2 import backends, ssd
from tests._helpers import make_ssd_args, rel_l2

SMALL = dict(batch=2, seqlen=40, nheads=4, headdim=8, ngroups=2, dstate=8)


def test_ssd_backends_always_include_reference_paths():
    assert {"xla", "scan"} <= set(jax_mamba2.available_backends())


def test_ssd_xla_matches_scan_with_every_feature():
    args, kwargs = make_ssd_args(0, **SMALL, D="headdim", z=True, dt_bias=True, dt_softplus=True,
                                 dt_limit=(0.01, 2.0), initial_states=True, seq_idx=[15, 16, 9])
    y_xla, f_xla = jax_mamba2.ssd(*args, 16, **kwargs, return_final_states=True, backend="xla")
    y_scan, f_scan = jax_mamba2.ssd(*args, 16, **kwargs, return_final_states=True, backend="scan")
    assert y_xla.shape == args[0].shape and y_xla.dtype == args[0].dtype
    assert f_xla.shape == (2, 4, 8, 8) and f_xla.dtype == jnp.float32
    assert rel_l2(y_xla, y_scan) < 1e-5 and rel_l2(f_xla, f_scan) < 1e-5


def test_ssd_auto_on_cpu_runs_xla_path():
    args, kwargs = make_ssd_args(1, **SMALL)
    jaxpr = str(jax.make_jaxpr(lambda *a: jax_mamba2.ssd(*a, 16, **kwargs))(*args))
    assert "cutile" not in jaxpr
    np.testing.assert_allclose(jax_mamba2.ssd(*args, 16, **kwargs),
                               jax_mamba2.ssd(*args, 16, **kwargs, backend="xla"), rtol=1e-6)


def test_ssd_returns_final_states_only_when_asked():
    args, kwargs = make_ssd_args(2, **SMALL)

    def call(return_final_states):  # jitted: the eager path is another test's
        return jax.jit(lambda *a: jax_mamba2.ssd(*a, 16, **kwargs, backend="xla",
                                                 return_final_states=return_final_states))(*args)
    assert isinstance(call(False), jax.Array)
    assert len(call(True)) == 2


@pytest.mark.parametrize("seqlen", [0])
def test_ssd_empty_sequence_returns_initial_states(seqlen):
    args, kwargs = make_ssd_args(3, **{**SMALL, "seqlen": 8}, initial_states=True)
    args = tuple(a[:, :seqlen] if a.ndim >= 3 else a for a in args)
    y, final = jax_mamba2.ssd(*args, 16, **kwargs, backend="xla", return_final_states=True)
    assert y.shape == (2, 0, 4, 8)
    np.testing.assert_array_equal(final, kwargs["initial_states"])


def _bad_call(**changes):
    args, kwargs = make_ssd_args(4, **SMALL, D="head", z=True, dt_bias=True, dt_softplus=True,
                                 initial_states=True, seq_idx=[20, 20])
    call = dict(zip("x dt A B C".split(), args), chunk_size=16, **kwargs)
    call.update(changes)
    return call


@pytest.mark.parametrize("changes, error, message", [
    (dict(x=jnp.ones((2, 40, 4))), ValueError, r"x.shape=\(2, 40, 4\) must be \(batch, seqlen"),
    (dict(x=jnp.ones((2, 40, 4, 8), jnp.int32)), TypeError, r"x.dtype=int32 must be one of"),
    (dict(dt=jnp.ones((2, 40, 3))), ValueError, r"dt.shape=\(2, 40, 3\) must be \(batch, seqlen, nheads\)"),
    (dict(A=jnp.ones((3,))), ValueError, r"A.shape=\(3,\) must be \(nheads,\)=\(4,\)"),
    (dict(B=jnp.ones((2, 40, 3, 8)), C=jnp.ones((2, 40, 3, 8))), ValueError,
     r"nheads=4 must be divisible by ngroups=3"),
    (dict(B=jnp.ones((2, 40, 2))), ValueError, r"B.shape=\(2, 40, 2\) must be \(batch, seqlen, ngroups"),
    (dict(B=jnp.ones((2, 40, 2, 0)), C=jnp.ones((2, 40, 2, 0)), initial_states=None), ValueError,
     r"ssd: dstate=0 must be at least 1"),
    (dict(x=jnp.ones((2, 40, 4, 0)), z=None, D=None, initial_states=None), ValueError,
     r"ssd: headdim=0 must be at least 1"),
    (dict(C=jnp.ones((2, 40, 2, 4))), ValueError, r"C.shape=\(2, 40, 2, 4\) must be"),
    (dict(chunk_size=24), ValueError, r"chunk_size=24 must be a power of two"),
    (dict(chunk_size=16.0), TypeError, r"chunk_size=16.0 must be an int"),
    (dict(D=jnp.ones((4, 3))), ValueError, r"D.shape=\(4, 3\) must be \(nheads,\)=\(4,\) or"),
    (dict(D=1.0), TypeError, r"ssd: D must be an array, got float"),
    (dict(z=jnp.ones((2, 40, 4, 4))), ValueError, r"z.shape=\(2, 40, 4, 4\) must be x.shape"),
    (dict(dt_bias=jnp.ones((2,))), ValueError, r"dt_bias.shape=\(2,\) must be \(nheads,\)"),
    (dict(initial_states=jnp.ones((2, 4, 8))), ValueError,
     r"initial_states.shape=\(2, 4, 8\) must be \(batch, nheads, headdim, dstate\)"),
    (dict(seq_idx=jnp.ones((2, 40), jnp.float32)), TypeError, r"seq_idx.dtype=float32 must be an integer"),
    (dict(seq_idx=jnp.ones((2, 39), jnp.int32)), ValueError, r"seq_idx.shape=\(2, 39\) must be"),
    (dict(dt_limit=(1.0, 0.5)), ValueError, r"dt_limit=\(1.0, 0.5\) must satisfy 0 <= min <= max"),
    (dict(dt_limit=(math.inf, math.inf)), ValueError, r"dt_limit=\(inf, inf\) must satisfy .* min finite"),
    (dict(dt_limit=0.5), TypeError, r"dt_limit=0.5 must be a pair of floats"),
    (dict(dt_limit={0.0, 1.0}), TypeError, r"dt_limit=\{0.0, 1.0\} must be a pair of floats"),
    (dict(dt_limit=("0", "1")), TypeError, r"dt_limit=\('0', '1'\) must be a pair of floats"),
    (dict(dt_softplus="no"), TypeError, r"ssd: dt_softplus='no' must be a bool"),
    (dict(return_final_states="no"), TypeError, r"ssd: return_final_states='no' must be a bool"),
    (dict(backend="triton"), ValueError, r"backend='triton' must be one of 'auto', 'xla', 'scan'"),
    (dict(deterministic_backward=1), TypeError, r"deterministic_backward=1 must be a bool"),
    (dict(save_chunk_states="no"), TypeError, r"save_chunk_states='no' must be a bool"),
    (dict(check_finite=None), TypeError, r"check_finite=None must be a bool"),
    (dict(A=jnp.array([-1.0, 0.5, -2.0, 0.0])), ValueError, r"ssd: A must be <= 0 .* got max\(A\)=0.5"),
    (dict(x=None), TypeError, r"ssd: x must be an array of shape \(batch, seqlen, nheads, headdim\), got NoneType"),
    # A NaN elsewhere (data, confined to its sequence) does not hide the value that breaks the precondition.
    (dict(A=jnp.array([jnp.nan, 0.5, -2.0, 0.0])), ValueError, r"ssd: A must be <= 0 .* got max\(A\)=0.5"),
    (dict(dt_softplus=False, dt_bias=None, dt=jnp.full((2, 40, 4), 0.5).at[0, 0, 0].set(jnp.nan).at[1, 5, 1].set(-1)),
     ValueError, r"ssd: dt must be >= 0 .* got min\(dt\)=-1"),
    (dict(dt_softplus=False, dt=jnp.full((2, 40, 4), -0.75)), ValueError,
     r"ssd: dt \+ dt_bias must be >= 0 without dt_softplus or a dt_limit .* got min\(dt \+ dt_bias\)=-0\.7"),
    (dict(dt_softplus=False, dt_bias=None, dt=jnp.full((2, 40, 4), -0.25)), ValueError,
     r"ssd: dt must be >= 0 .* got min\(dt\)=-0.25"),
    (dict(seq_idx=jnp.asarray(np.r_[[0] * 20, [1] * 10, [0] * 10][None].repeat(2, 0), jnp.int32)), ValueError,
     r"ssd: seq_idx must be nondecreasing along seqlen; seq_idx\[0, 30\]=0 follows 1"),
    # Compared, not subtracted: no wrap-around in unsigned or narrow dtypes.
    (dict(seq_idx=jnp.asarray(np.r_[[0] * 20, [1] * 10, [0] * 10][None].repeat(2, 0), jnp.uint32)), ValueError,
     r"ssd: seq_idx must be nondecreasing along seqlen; seq_idx\[0, 30\]=0 follows 1"),
])
def test_ssd_rejects_bad_arguments(changes, error, message):
    call = _bad_call(**changes)
    with pytest.raises(error, match=message):
        jax_mamba2.ssd(**call)


def test_ssd_orders_seq_idx_of_any_integer_dtype_without_wrapping_around():
    """A nondecreasing int8 seq_idx whose steps exceed int8's range is accepted (and runs as int32's)."""
    base = _bad_call()
    ids = np.r_[[-100] * 20, [100] * 20][None].repeat(2, 0)
    got = jax_mamba2.ssd(**dict(base, seq_idx=jnp.asarray(ids, jnp.int8)), backend="xla")
    np.testing.assert_array_equal(got, jax_mamba2.ssd(**dict(base, seq_idx=jnp.asarray(ids, jnp.int32)),
                                                      backend="xla"))


def test_seq_idx_ids_jax_would_wrap_are_refused_and_ids_it_keeps_run_whatever_their_size():
    """With x64 off, JAX narrows an int64 array to int32: an id of 2**32 would become 0 and two packed sequences
    join. The ops refuse such ids up front. Ids JAX keeps (uint32 of 2**31; int64 of 2**32 with x64 on) run: the
    ops compare ids in their own dtype and the kernels take the sequences' numbers, so they equal small ids."""
    base = _bad_call()
    x = np.ones((2, 40, 8), np.float32)
    kernel = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(4, 8)
    ids = np.zeros((2, 40), np.int64)
    ids[:, 20:] = 2 ** 32
    message = (r"seq_idx must hold ids int32 holds \(JAX's dtype for its int64\), in \[-2147483648, 2147483647\]; "
               r"got ids from 0 to 4294967296")
    with pytest.raises(ValueError, match=r"ssd: " + message):
        jax_mamba2.ssd(**dict(base, seq_idx=ids), backend="xla")
    with pytest.raises(ValueError, match=r"causal_conv1d_silu: " + message):
        jax_mamba2.causal_conv1d_silu(x, kernel, seq_idx=ids)
    small = np.where(ids > 0, 1, 0).astype(np.int32)
    want_y = jax_mamba2.ssd(**dict(base, seq_idx=small), backend="xla")
    want_conv = jax_mamba2.causal_conv1d_silu(x, kernel, seq_idx=small, backend="xla")
    unsigned = np.where(ids > 0, 2 ** 31, 0).astype(np.uint32)
    np.testing.assert_array_equal(jax_mamba2.ssd(**dict(base, seq_idx=unsigned), backend="xla"), want_y)
    np.testing.assert_array_equal(jax_mamba2.causal_conv1d_silu(x, kernel, seq_idx=unsigned, backend="xla"), want_conv)
    with jax.enable_x64(True):
        np.testing.assert_array_equal(jax_mamba2.ssd(**dict(base, seq_idx=ids), backend="xla"), want_y)
        np.testing.assert_array_equal(jax_mamba2.causal_conv1d_silu(x, kernel, seq_idx=ids, backend="xla"),
                                      want_conv)


def test_ssd_accepts_values_within_the_preconditions():
    """A == 0 (no decay); negative raw dt that the softplus or a dt_limit turns into Δ >= 0."""
    base = _bad_call()
    ok = [dict(A=jnp.zeros((4,))), dict(dt=-jnp.ones((2, 40, 4))),
          dict(dt_softplus=False, dt=-jnp.ones((2, 40, 4)), dt_limit=(0.01, 1.0))]
    for changes in ok:
        y = jax_mamba2.ssd(**dict(base, **changes), backend="xla")
        assert bool(jnp.all(jnp.isfinite(y))), changes


def test_ssd_does_not_check_the_values_of_traced_arrays():
    """Under jit the preconditions cannot be read: a positive A goes unchecked, as documented."""
    call = _bad_call()
    A = -call.pop("A")
    y = jax.jit(lambda A: jax_mamba2.ssd(A=A, **call, backend="xla"))(A)
    assert y.shape == call["x"].shape
    with pytest.raises(ValueError, match="A must be <= 0"):
        jax_mamba2.ssd(A=A, **call, backend="xla")


def test_ssd_step_rejects_values_outside_the_preconditions():
    state, x, dt = jnp.ones((2, 4, 8, 8)), jnp.ones((2, 4, 8)), jnp.ones((2, 4))
    B = C = jnp.ones((2, 1, 8))
    with pytest.raises(ValueError, match=r"ssd_step: A must be <= 0"):
        jax_mamba2.ssd_step(state, x, dt, jnp.ones((4,)), B, C)
    with pytest.raises(ValueError, match=r"ssd_step: A must be <= 0"):
        jax_mamba2.ssd_step(state, x, dt, jnp.ones((4,)).at[0].set(jnp.nan), B, C)
    with pytest.raises(ValueError, match=r"ssd_step: dt must be >= 0"):
        jax_mamba2.ssd_step(state, x, -dt, -jnp.ones((4,)), B, C)
    y, _ = jax_mamba2.ssd_step(state, x, -dt, -jnp.ones((4,)), B, C, dt_softplus=True)
    assert y.shape == x.shape


def test_ssd_cutile_without_gpu_says_why():
    args, kwargs = make_ssd_args(5, **SMALL)
    with pytest.raises(ValueError, match=r"ssd\(backend='cutile'\) (cannot run this call|is unavailable)"):
        jax_mamba2.ssd(*args, 64, **kwargs, backend="cutile")


# An opaque backend: JAX must not differentiate or batch through it, so `ssd` wraps it in a custom_vjp.
# It reuses the xla forward, so every gradient must equal the xla backend's.
@pytest.fixture
def opaque_backend(monkeypatch):
    xla = backends.get("xla", "test")
    calls = []

    def forward(inputs, static):
        calls.append(static)
        return xla.forward(inputs, static)

    backend = dataclasses.replace(xla, name="opaque_test", forward=forward, differentiable=False,
                                  step=None)
    monkeypatch.setitem(backends._REGISTRY["ssd"], backend.name, backend)
    yield calls


def test_ssd_opaque_backend_grad_matches_xla(opaque_backend):
    args, kwargs = make_ssd_args(6, **SMALL, D="head", z=True, dt_bias=True, dt_softplus=True,
                                 initial_states=True, seq_idx=[25, 15])

    def loss(backend, x, dt, A, B, C, D, z, dt_bias, h0):
        kw = dict(kwargs, D=D, z=z, dt_bias=dt_bias, initial_states=h0)
        y, final = jax_mamba2.ssd(x, dt, A, B, C, 16, **kw, return_final_states=True, backend=backend)
        return jnp.sum(y * jnp.cos(y)) + jnp.sum(final ** 2)

    operands = (*args, kwargs["D"], kwargs["z"], kwargs["dt_bias"], kwargs["initial_states"])
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(1, 10))), static_argnums=0)
    for g_opaque, g_xla in zip(grads("opaque_test", *operands), grads("xla", *operands)):
        assert rel_l2(g_opaque, g_xla) < 1e-5
    assert opaque_backend, "the opaque forward was never called"


def test_ssd_opaque_backend_vmap_matches_loop(opaque_backend):
    args, kwargs = make_ssd_args(7, **SMALL)
    xs = jnp.stack([args[0], 2 * args[0], -args[0]])
    f = lambda x: jax_mamba2.ssd(x, *args[1:], 16, **kwargs, backend="opaque_test")
    np.testing.assert_allclose(jax.vmap(f)(xs), jnp.stack([f(x) for x in xs]), rtol=1e-5, atol=1e-5)


def test_ssd_step_chain_equals_full_forward():
    args, kwargs = make_ssd_args(8, **SMALL, D="head", z=True, dt_bias=True, dt_softplus=True,
                                 initial_states=True)
    x, dt, A, B, C = args
    y_full, f_full = jax_mamba2.ssd(*args, 16, **kwargs, return_final_states=True, backend="xla")
    state = kwargs["initial_states"]
    ys = []
    for t in range(x.shape[1]):
        y_t, state = jax_mamba2.ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D=kwargs["D"],
                                         z=kwargs["z"][:, t], dt_bias=kwargs["dt_bias"],
                                         dt_softplus=True)
        ys.append(y_t)
    assert rel_l2(jnp.stack(ys, 1), y_full) < 1e-5 and rel_l2(state, f_full) < 1e-5


@pytest.mark.parametrize("chunk_size", [8, 64])
def test_initial_states_reach_only_a_first_sequence_of_id_0_whatever_the_chunk(chunk_size):
    """A row whose first sequence has an id other than 0 (-1): the state restarts at token 0, and the sequence 0
    after it in the same chunk takes no initial state; the xla path equals the scan in values and gradients at any
    chunk size. Also for ids that decrease (traced, so unchecked): both restart where the id changes."""
    args, kwargs = make_ssd_args(62, **SMALL, D="head", initial_states=True)
    init = kwargs.pop("initial_states")
    seq_idx = jnp.asarray(np.stack([np.repeat([-1, 0], [10, 30]), np.repeat([0, 3], [5, 35])]), jnp.int32)

    @functools.partial(jax.jit, static_argnames="backend")
    def outputs_and_gradients(args, init, seq_idx, backend):
        def loss(args, init):
            y, final = ssd(*args, chunk_size, **kwargs, initial_states=init, seq_idx=seq_idx,
                           return_final_states=True, backend=backend)
            return jnp.sum(y * jnp.sin(y)) + jnp.sum(final ** 2), (y, final)
        return jax.grad(loss, argnums=(0, 1), has_aux=True)(args, init)

    for ids in (seq_idx, seq_idx.at[1, 20:].set(1)):
        (grads, (y, final)) = outputs_and_gradients(args, init, ids, "xla")
        (want_grads, (want_y, want_final)) = outputs_and_gradients(args, init, ids, "scan")
        assert rel_l2(y, want_y) < 1e-5 and rel_l2(final, want_final) < 1e-5
        assert max(rel_l2(g, w) for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads))) < 1e-5
    np.testing.assert_array_equal(want_grads[1][:1], 0.0)  # row 0's first sequence, of id -1, reads no state


def test_ssd_step_rejects_bad_state():
    with pytest.raises(ValueError, match=r"ssd_step: state.shape=\(2, 4, 8\) must be"):
        jax_mamba2.ssd_step(jnp.ones((2, 4, 8)), jnp.ones((2, 4, 8)), jnp.ones((2, 4)), -jnp.ones(4),
                            jnp.ones((2, 1, 8)), jnp.ones((2, 1, 8)))
    with pytest.raises(ValueError, match=r"ssd_step: dstate=0 must be at least 1"):
        jax_mamba2.ssd_step(jnp.ones((2, 4, 8, 0)), jnp.ones((2, 4, 8)), jnp.ones((2, 4)), -jnp.ones(4),
                            jnp.ones((2, 1, 0)), jnp.ones((2, 1, 0)))
    with pytest.raises(ValueError, match=r"ssd_step: nheads=0 must be at least 1"):
        jax_mamba2.ssd_step(jnp.ones((2, 0, 8, 4)), jnp.ones((2, 0, 8)), jnp.ones((2, 0)), -jnp.ones(0),
                            jnp.ones((2, 1, 4)), jnp.ones((2, 1, 4)))


def test_autotune_rejects_what_is_not_a_program():
    with pytest.raises(TypeError, match=r"autotune: fn=5 must be a callable"):
        jax_mamba2.autotune(5)


@pytest.mark.parametrize("backend", ["xla", "scan"])
def test_a_time_step_on_a_dt_limit_bound_keeps_its_whole_gradient(backend):
    """As mamba_ssm's backward and the kernels': the gradient of a Δ is zero only strictly outside dt_limit (a clip
    would halve it on the bound)."""
    (x, dt, A, B, C), _ = make_ssd_args(61, seqlen=16, nheads=2, headdim=8, dstate=8)
    low, high = 0.1, 0.4
    dt = dt.at[0, 3, 0].set(low).at[1, 5, 1].set(high)

    def loss(dt, limit):
        return jnp.sum(ssd(x, dt, A, B, C, 8, dt_limit=limit, backend=backend) ** 2)
    clipped = jax.grad(loss)(dt, (low, high))
    unclipped = jax.grad(loss)(jnp.clip(dt, low, high), (0.0, math.inf))
    for index in ((0, 3, 0), (1, 5, 1)):
        assert float(clipped[index]) == pytest.approx(float(unclipped[index]), rel=1e-5)
    outside = dt < low
    assert bool(outside.any()) and bool((jnp.where(outside, clipped, 0.0) == 0.0).all())


def test_the_xla_path_exports_with_a_symbolic_sequence_length():
    """jax.export with seqlen a symbolic dimension: the chunk size stays as given (it shrinks only for a seqlen known
    when tracing), and the exported program equals the direct call at two lengths."""
    (x, dt, A, B, C), _ = make_ssd_args(62, seqlen=40, nheads=2, headdim=8, dstate=8)
    batch, seqlen = jax.export.symbolic_shape("batch, seqlen")
    shapes = [jax.ShapeDtypeStruct((batch, seqlen) + a.shape[2:], a.dtype) for a in (x, dt)]
    shapes[2:2] = [jax.ShapeDtypeStruct(A.shape, A.dtype)]
    shapes += [jax.ShapeDtypeStruct((batch, seqlen) + a.shape[2:], a.dtype) for a in (B, C)]

    def forward(*args):
        return ssd(*args, 16, dt_softplus=True, backend="xla")
    exported = jax.export.deserialize(jax.export.export(jax.jit(forward))(*shapes).serialize())
    for length in (40, 13):
        args = (x[:, :length], dt[:, :length], A, B[:, :length], C[:, :length])
        assert rel_l2(exported.call(*args), forward(*args)) < 1e-6


def test_the_xla_path_follows_explicitly_sharded_heads_and_groups():
    """Inputs sharded over heads (and so groups) on a mesh of explicit axes, the default of jax.make_mesh: the
    output and the gradients keep that sharding and equal the unsharded call's."""
    mesh = jax.make_mesh((4,), ("h",), axis_types=(jax.sharding.AxisType.Explicit,))
    (x, dt, A, B, C), kwargs = make_ssd_args(63, seqlen=24, nheads=8, headdim=4, ngroups=4, dstate=8, D="head")
    heads = jax.sharding.PartitionSpec(None, None, "h")
    specs = (heads, heads, jax.sharding.PartitionSpec("h"), heads, heads)
    sharded = [jax.device_put(a, jax.sharding.NamedSharding(mesh, s)) for a, s in zip((x, dt, A, B, C), specs)]

    def loss(x, B, *rest):
        return jnp.sum(ssd(x, rest[0], rest[1], B, rest[2], 8, backend="xla", **kwargs) ** 2)
    y = jax.jit(lambda *a: ssd(*a, 8, backend="xla", **kwargs))(*sharded)
    assert tuple(y.sharding.spec)[:3] == tuple(heads)
    assert rel_l2(y, ssd(x, dt, A, B, C, 8, backend="xla", **kwargs)) < 1e-6
    order = lambda a: (a[0], a[3], a[1], a[2], a[4])  # x, B, dt, A, C
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(*order(sharded))
    expected = jax.grad(loss, argnums=(0, 1))(*order((x, dt, A, B, C)))
    for actual, want in zip(grads, expected):
        assert rel_l2(actual, want) < 1e-5
