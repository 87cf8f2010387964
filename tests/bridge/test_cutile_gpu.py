"""The cuTile backends on the GPU against the float64 scan oracle (run on the H200; skipped elsewhere)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mamba2
from benchmarks.lm_bench import RECORD_EVERY_COMMAND, cutile_launches
from jax_mamba2 import reference
from jax_mamba2.bridge.aot import CUTILE_CUSTOM_CALL
from tests._helpers import TOLERANCE, make_ssd_args, rel_l2, to_float64

pytestmark = pytest.mark.gpu

FEATURES = {
    "plain": dict(),
    "all_options": dict(D="headdim", z=True, dt_bias=True, dt_softplus=True, dt_limit=(1e-3, 2.0)),
    "D_head_init": dict(D="head", initial_states=True),
    "seq_idx_init": dict(initial_states=True, seq_idx=[70, 58, 72]),
    "groups": dict(ngroups=2, D="head", z=True),
}


def _oracle(args, kwargs):
    with jax.enable_x64(True):
        args64, kwargs64 = to_float64((args, kwargs))
        y, final = reference.ssd_scan(*args64, **kwargs64)
        return np.asarray(y), np.asarray(final)


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_cutile_matches_float64_scan(backend, dtype, feature):
    opts = dict(FEATURES[feature])
    ngroups = opts.pop("ngroups", 1)
    # seqlen 200 with chunk 64: a partial last chunk.
    args, kwargs = make_ssd_args(11, batch=2, seqlen=200, nheads=4, headdim=64, ngroups=ngroups,
                                 dstate=64, dtype=jnp.dtype(dtype), **opts)
    run = jax.jit(lambda *a: jax_mamba2.ssd(*a, 64, **kwargs, return_final_states=True,
                                           backend=backend))
    y, final = run(*args)
    y_ref, final_ref = _oracle(args, kwargs)
    tol = TOLERANCE["kernel_fwd"][dtype]
    assert y.dtype == args[0].dtype and final.dtype == jnp.float32
    assert rel_l2(y, y_ref) <= tol, rel_l2(y, y_ref)
    assert rel_l2(final, final_ref) <= tol, rel_l2(final, final_ref)


@pytest.mark.parametrize("layout", ["fused", "segmented"])
def test_cutile_fused_forward_layouts_match_float64_scan(monkeypatch, request, layout):
    """The fused and segmented forward layouts (picked by default only for >= FUSED_MIN_BLOCKS chains,
    or fewer chains of >= 2 MIN_SEGMENT_CHUNKS chunks) forced on a small problem with every feature
    (segmented: 7 chunks in 4 segments, seq_idx changing inside and across them), inside jit, and its
    gradients (the backward reads the states the fused kernel stored). The two cases differ in seqlen:
    JAX caches the traced op per shape, which would replay the first case's plan."""
    from jax_mamba2.bridge import tuning
    from jax_mamba2.kernels import forward, fused_scan
    layouts = []
    pick = forward.forward_layout
    tuning.clear_memory()            # no layout choice made before (or forced here) outlives the test
    request.addfinalizer(tuning.clear_memory)
    if layout == "fused":
        monkeypatch.setattr(fused_scan, "FUSED_MIN_BLOCKS", 1)
    else:
        monkeypatch.setattr(fused_scan, "FUSED_MIN_BLOCKS", 10 ** 6)
        monkeypatch.setattr(fused_scan, "MIN_SEGMENT_CHUNKS", 1)
    monkeypatch.setattr(forward, "forward_layout", lambda dims: layouts.append(pick(dims)) or layouts[-1])
    seq_idx = [100, 33, 200] if layout == "fused" else [100, 97, 200]
    args, kwargs = make_ssd_args(31, batch=2, seqlen=sum(seq_idx), nheads=6, headdim=64, ngroups=3, dstate=128,
                                 dtype=jnp.bfloat16, D="headdim", z=True, dt_bias=True, dt_softplus=True,
                                 initial_states=True, seq_idx=seq_idx)
    _check_forward_and_grads(args, kwargs)
    assert layouts and set(layouts) == {layout}


def _check_forward_and_grads(args, kwargs):
    """ssd(backend="cutile") in jit, y, final states and the gradients of x, dt, A, B, C against the float64
    scan (bf16 tolerances)."""
    y, final = jax.jit(lambda *a: jax_mamba2.ssd(*a, 64, **kwargs, return_final_states=True,
                                                 backend="cutile"))(*args)
    y_ref, final_ref = _oracle(args, kwargs)
    tol = TOLERANCE["kernel_fwd"]["bfloat16"]
    errors = (rel_l2(y, y_ref), rel_l2(final, final_ref))
    assert max(errors) <= tol, errors

    def loss(fn, *operands):             # linear in (y, final): no amplified rounding differences
        y, final = fn(*operands)
        return jnp.sum(y.astype(jnp.float32) * y_ref) + jnp.sum(final * final_ref)

    cutile = lambda *a: jax_mamba2.ssd(*a, 64, **kwargs, return_final_states=True, backend="cutile")  # noqa: E731
    grads = jax.jit(jax.grad(functools.partial(loss, cutile), argnums=(0, 1, 2, 3, 4)))(*args)
    with jax.enable_x64(True):
        args64, kwargs64 = to_float64((args, kwargs))
        scan = lambda *a: reference.ssd_scan(*a, **kwargs64)  # noqa: E731
        expected = jax.grad(functools.partial(loss, scan), argnums=(0, 1, 2, 3, 4))(*args64)
    for name, g, r in zip(["x", "dt", "A", "B", "C"], grads, expected):
        assert rel_l2(g, r) <= TOLERANCE["kernel_bwd"]["bfloat16"], (name, rel_l2(g, r))


def test_cutile_fused_joint_output_default_matches_float64_scan(monkeypatch, request):
    """dstate = chunk size, no z or seq_idx: the fused default computes each chunk's output as one product
    (JOINT_OUTPUT); forward and gradients through the op (the differentiated call's saving forward runs
    it too), forced into the fused layout on a small problem."""
    from jax_mamba2.bridge import tuning
    from jax_mamba2.kernels import forward, fused_scan
    from jax_mamba2.kernels._common import SSDDims
    tuning.clear_memory()
    request.addfinalizer(tuning.clear_memory)
    monkeypatch.setattr(fused_scan, "FUSED_MIN_BLOCKS", 1)
    layouts = []
    pick = forward.forward_layout
    monkeypatch.setattr(forward, "forward_layout", lambda dims: layouts.append(pick(dims)) or layouts[-1])
    dims = SSDDims(batch=2, seqlen=300, nheads=4, headdim=64, ngroups=1, dstate=64, chunk_size=64,
                   dtype="bfloat16", dt_dtype="bfloat16", has_init=True, dt_softplus=True)
    assert fused_scan.fused_scan_fwd_default_config(dims).JOINT_OUTPUT
    args, kwargs = make_ssd_args(32, batch=2, seqlen=300, nheads=4, headdim=64, dstate=64, dtype=jnp.bfloat16,
                                 D="head", dt_bias=True, dt_softplus=True, initial_states=True)
    _check_forward_and_grads(args, kwargs)
    assert layouts and set(layouts) == {"fused"}


@pytest.mark.parametrize("chunk_size", [64, 128, 256])
def test_cutile_chunk_sizes_and_headdim_dstate(chunk_size):
    args, kwargs = make_ssd_args(12, batch=1, seqlen=700, nheads=2, headdim=128, dstate=32,
                                 dtype=jnp.bfloat16, dt_softplus=True, dt_bias=True, D="head")
    y, final = jax.jit(lambda *a: jax_mamba2.ssd(*a, chunk_size, **kwargs, return_final_states=True,
                                                 backend="cutile"))(*args)
    y_ref, final_ref = _oracle(args, kwargs)
    assert rel_l2(y, y_ref) <= 2e-2 and rel_l2(final, final_ref) <= 2e-2


def test_cutile_ffi_and_callback_agree_bitwise():
    args, kwargs = make_ssd_args(13, batch=2, seqlen=256, nheads=4, headdim=64, dstate=128,
                                 dtype=jnp.bfloat16, z=True, D="head", dt_softplus=True)
    outs = [jax.jit(functools.partial(jax_mamba2.ssd, chunk_size=64, **kwargs, backend=b,
                                      return_final_states=True))(*args)
            for b in ("cutile", "cutile_callback")]
    np.testing.assert_array_equal(np.asarray(outs[0][0], np.float32), np.asarray(outs[1][0], np.float32))
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_cutile_auto_picks_kernel_and_matches_xla():
    args, kwargs = make_ssd_args(14, batch=2, seqlen=256, nheads=4, headdim=64, dstate=64)
    f = jax.jit(lambda *a: jax_mamba2.ssd(*a, 64, **kwargs))
    assert CUTILE_CUSTOM_CALL in f.lower(*args).as_text()
    y_xla = jax_mamba2.ssd(*args, 64, **kwargs, backend="xla")
    assert rel_l2(f(*args), y_xla) < 5e-3


GRAD_FEATURES = {
    "gate_bias_init": dict(D="head", z=True, dt_bias=True, dt_softplus=True, initial_states=True),
    "limit_headdimD_groups": dict(D="headdim", dt_bias=True, dt_softplus=True, dt_limit=(0.05, 1.5),
                                  ngroups=2, initial_states=True),
    "seq_idx": dict(D="head", z=True, initial_states=True, seq_idx=[37, 64, 59]),
}


_GRAD_OPTIONALS = ("D", "z", "dt_bias", "initial_states")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("feature", list(GRAD_FEATURES))
def test_cutile_grad_matches_float64_scan_grad(feature, dtype):
    _check_cutile_grad_against_float64_scan(feature, dtype)


def _check_cutile_grad_against_float64_scan(feature, dtype, **options):
    """options: keyword options of the cutile ssd call (deterministic_backward, save_chunk_states,
    check_finite)."""
    opts = dict(GRAD_FEATURES[feature])
    args, kwargs = make_ssd_args(15, batch=2, seqlen=160, nheads=4, headdim=64, dstate=64,
                                 dtype=jnp.dtype(dtype), **opts)
    names = [n for n in _GRAD_OPTIONALS if n in kwargs]
    optionals = tuple(kwargs.pop(n) for n in names)
    kwargs_static = dict(kwargs)
    weights = (jax.random.normal(jax.random.PRNGKey(5), args[0].shape),
               jax.random.normal(jax.random.PRNGKey(6), (2, 4, 64, 64)))

    def loss(backend, *operands):
        kw = dict(kwargs_static, **dict(zip(names, operands[5:])))
        fn = reference.ssd_scan if backend == "scan" else functools.partial(
            jax_mamba2.ssd, chunk_size=64, return_final_states=True, backend=backend, **options)
        y, final = fn(*operands[:5], **kw)
        return jnp.sum(y.astype(jnp.float32) * weights[0]) + jnp.sum(final * weights[1])

    operands = (*args, *optionals)
    argnums = tuple(range(1, len(operands) + 1))
    grads = jax.jit(jax.grad(loss, argnums=argnums), static_argnums=0)("cutile", *operands)
    with jax.enable_x64(True):
        expected = jax.grad(loss, argnums=argnums)("scan", *to_float64(operands))
    tol = TOLERANCE["kernel_bwd"][dtype]
    for name, g, r, primal in zip(["x", "dt", "A", "B", "C", *names], grads, expected, operands):
        assert g.dtype == primal.dtype, name
        assert rel_l2(g, r) <= tol, (name, rel_l2(g, r))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cutile_grad_recomputing_the_states_matches_float64_scan_grad(dtype):
    """save_chunk_states=False: the forward saves only its inputs, the backward recomputes."""
    _check_cutile_grad_against_float64_scan("seq_idx", dtype, save_chunk_states=False)


def test_cutile_grad_without_the_finiteness_check_matches_float64_scan_grad():
    """check_finite=False: the same kernels on the arrays as they are (no finite parts, no reach term)."""
    _check_cutile_grad_against_float64_scan("seq_idx", "bfloat16", check_finite=False)


def test_cutile_deterministic_backward_is_bitwise_reproducible():
    args, kwargs = make_ssd_args(21, batch=2, seqlen=256, nheads=8, headdim=64, ngroups=2, dstate=64,
                                 dtype=jnp.bfloat16, D="head", z=True, dt_softplus=True)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(jax_mamba2.ssd(*a, 64, **kwargs, backend="cutile",
                                                              deterministic_backward=True)
                                               .astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3, 4)))
    runs = [jax.device_get(grad(*args)) for _ in range(5)]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_with_no_batch_dims_saveable"])
def test_cutile_grad_under_jax_checkpoint_equals_plain_grad(policy):
    """Rematerialisation replays the forward; the kernel backward sees the same inputs, so with the
    deterministic backward the gradients are bitwise those of the plain program."""
    args, kwargs = make_ssd_args(22, batch=2, seqlen=192, nheads=4, headdim=64, dstate=64,
                                 dtype=jnp.bfloat16, D="head", dt_bias=True, dt_softplus=True)
    w = jax.random.normal(jax.random.PRNGKey(7), (64, 64), jnp.bfloat16)

    def loss(x, *rest):
        h = jnp.tanh(x @ w)   # a dot for the policy to save or drop
        y = jax_mamba2.ssd(h, *rest, 64, **kwargs, backend="cutile", deterministic_backward=True)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    remat = jax.checkpoint(loss, policy=getattr(jax.checkpoint_policies, policy))
    plain, rematted = (jax.device_get(jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(*args))
                       for f in (loss, remat))
    for a, b in zip(plain, rematted):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_cutile_decode_steps_inside_a_layer_scan_match_reference():
    """Chained decode steps of a stack of layers (lax.scan over the layer axis, as the LM's cached decode)."""
    layers, steps = 3, 4
    args, kwargs = make_ssd_args(23, batch=2, seqlen=steps, nheads=4, headdim=64, ngroups=2, dstate=64,
                                 D="head", dt_bias=True, dt_softplus=True)
    x, dt, A, B, C = args
    states = jax.random.normal(jax.random.PRNGKey(8), (layers, 2, 4, 64, 64))

    def decode(step_fn, states):
        ys = []
        for t in range(steps):
            def layer(carry, state):
                y, new_state = step_fn(state, carry, dt[:, t], A, B[:, t], C[:, t], **kwargs)
                return y, new_state
            y, states = jax.lax.scan(layer, x[:, t], states)
            ys.append(y)
        return jnp.stack(ys, axis=1), states

    got = jax.jit(lambda s: decode(functools.partial(jax_mamba2.ssd_step, backend="cutile"), s))(states)
    want = decode(reference.ssd_step, states)
    for g, w in zip(got, want):
        assert rel_l2(g, w) <= 1e-5, rel_l2(g, w)


def test_cutile_vmap_matches_loop():
    args, kwargs = make_ssd_args(16, batch=2, seqlen=128, nheads=4, headdim=64, dstate=64)
    xs = jnp.stack([args[0], -args[0], 0.5 * args[0]])
    f = jax.jit(jax.vmap(lambda x: jax_mamba2.ssd(x, *args[1:], 64, **kwargs, backend="cutile")))
    expected = jnp.stack([jax_mamba2.ssd(x, *args[1:], 64, **kwargs, backend="cutile") for x in xs])
    np.testing.assert_allclose(f(xs), expected, rtol=1e-5, atol=1e-5)


def test_cutile_shard_map_grad_of_replicated_param():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    args, kwargs = make_ssd_args(17, batch=2, seqlen=128, nheads=4, headdim=64, dstate=64)
    x, dt, A, B, C = args
    P = jax.sharding.PartitionSpec

    w = jax.random.normal(jax.random.PRNGKey(7), x.shape)

    def loss(A, backend):
        f = jax.shard_map(lambda x, dt, B, C: jax_mamba2.ssd(x, dt, A, B, C, 64, backend=backend),
                          mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        return jnp.sum(f(x, dt, B, C) * w)

    g_cutile = jax.jit(jax.grad(loss), static_argnums=1)(A, "cutile")
    g_xla = jax.jit(jax.grad(loss), static_argnums=1)(A, "xla")
    assert rel_l2(g_cutile, g_xla) < TOLERANCE["kernel_bwd"]["float32"]


@pytest.mark.parametrize("source", ["cupy", "jax"])
def test_cutile_eager_matches_jit(source):
    from jax_mamba2.bridge import eager
    args, kwargs = make_ssd_args(18, batch=2, seqlen=192, nheads=4, headdim=64, dstate=64,
                                 dtype=jnp.float16, D="head", dt_softplus=True)
    expected = jax.jit(lambda *a: jax_mamba2.ssd(*a, 64, **kwargs, backend="cutile"))(*args)
    if source == "cupy":
        cupy = pytest.importorskip("cupy")
        conv = lambda a: cupy.from_dlpack(a) if isinstance(a, jax.Array) else a
        y = eager.ssd(*map(conv, args), 64, **{k: conv(v) for k, v in kwargs.items()})
        y = np.asarray(cupy.asnumpy(y), np.float32)
    else:
        y = np.asarray(eager.ssd(*args, 64, **kwargs), np.float32)
    np.testing.assert_allclose(y, np.asarray(expected, np.float32), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dt_range, A_range", [((1e-4, 1e-3), (-1e-3, -1e-2)), ((1.0, 10.0), (-5.0, -20.0))])
def test_cutile_finite_for_extreme_dt_and_A(dt_range, A_range):
    args, kwargs = make_ssd_args(19, batch=1, seqlen=512, nheads=4, headdim=64, dstate=64,
                                 dtype=jnp.bfloat16, initial_states=True)
    x, _, _, B, C = args
    dt = jax.random.uniform(jax.random.PRNGKey(1), (1, 512, 4), jnp.float32, *dt_range)
    A = jax.random.uniform(jax.random.PRNGKey(2), (4,), jnp.float32, A_range[1], A_range[0])
    y, final = jax_mamba2.ssd(x, dt, A, B, C, 128, **kwargs, return_final_states=True, backend="cutile")
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32)))) and bool(jnp.all(jnp.isfinite(final)))
    y_ref, final_ref = _oracle((x, dt, A, B, C), kwargs)
    assert rel_l2(y, y_ref) <= 2e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cutile_step_matches_reference_step(dtype):
    args, kwargs = make_ssd_args(20, batch=3, seqlen=1, nheads=4, headdim=64, ngroups=2, dstate=64,
                                 dtype=jnp.dtype(dtype), D="head", z=True, dt_bias=True,
                                 dt_softplus=True, initial_states=True)
    x, dt, A, B, C = (a[:, 0] if a.ndim >= 3 else a for a in args)
    state = kwargs.pop("initial_states")
    kwargs["z"] = kwargs["z"][:, 0]
    y, new_state = jax.jit(lambda *a: jax_mamba2.ssd_step(*a, **kwargs, backend="cutile"))(
        state, x, dt, A, B, C)
    y_ref, state_ref = reference.ssd_step(state, x, dt, A, B, C, **kwargs)
    assert rel_l2(y, y_ref) <= TOLERANCE["kernel_fwd"][dtype]
    assert rel_l2(new_state, state_ref) <= 1e-5


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
def test_cutile_step_gradients_are_the_reference_steps(backend):
    """The decode kernel has no backward kernel: its gradients are the pure-JAX step's."""
    args, kwargs = make_ssd_args(22, batch=3, seqlen=1, nheads=4, headdim=64, ngroups=2, dstate=64,
                                 dtype=jnp.float32, D="head", z=True, dt_bias=True, dt_softplus=True,
                                 initial_states=True)
    x, dt, A, B, C = (a[:, 0] if a.ndim >= 3 else a for a in args)
    state = kwargs.pop("initial_states")
    kwargs["z"] = kwargs["z"][:, 0]

    def loss(backend, state, x, dt, A, B, C):
        y, new_state = jax_mamba2.ssd_step(state, x, dt, A, B, C, **kwargs, backend=backend)
        return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.cos(new_state))

    got, want = (jax.jit(jax.grad(functools.partial(loss, b), argnums=tuple(range(6))))(state, x, dt, A, B, C)
                 for b in (backend, "xla"))
    for g, w in zip(got, want):
        assert rel_l2(g, w) <= 1e-5


def test_cutile_step_vmaps_over_rows_and_over_per_item_parameters():
    """vmap of the decode step: mapped rows fold into one launch; a mapped A maps the items."""
    args, kwargs = make_ssd_args(21, batch=2, seqlen=1, nheads=4, headdim=64, ngroups=2, dstate=64,
                                 dtype=jnp.bfloat16, D="head", z=False, dt_bias=True, dt_softplus=True,
                                 initial_states=True)
    x, dt, A, B, C = (a[:, 0] if a.ndim >= 3 else a for a in args)
    state = kwargs.pop("initial_states")

    def step(state, x, dt, A, B, C):
        return jax_mamba2.ssd_step(state, x, dt, A, B, C, **kwargs, backend="cutile")

    rows = (jnp.stack([state, -state]), jnp.stack([x, 0.5 * x]), jnp.stack([dt, dt]), jnp.stack([A, 0.5 * A]),
            jnp.stack([B, -B]), jnp.stack([C, C]))
    for A_axis in (None, 0):
        in_axes = (0, 0, 0, A_axis, 0, 0)
        mapped_args = (*rows[:3], A if A_axis is None else rows[3], *rows[4:])
        mapped = jax.jit(jax.vmap(step, in_axes))(*mapped_args)
        for i in range(2):
            one = reference.ssd_step(*(a if axis is None else a[i] for a, axis in zip(mapped_args, in_axes)),
                                     **kwargs)
            assert rel_l2(mapped[0][i], one[0]) <= TOLERANCE["kernel_fwd"]["bfloat16"]
            assert rel_l2(mapped[1][i], one[1]) <= 1e-5


@pytest.mark.slow
def test_cutile_autotune_tunes_a_training_step_ahead_of_time_and_the_step_stays_correct(monkeypatch, tmp_path):
    """jax_mamba2.autotune on the GPU (a fresh cache, $JAX_MAMBA2_AUTOTUNE=0): every plan of a loss-and-grad
    step is tuned (each stage measured here, or found tuned), the cache file holds them, and the step then
    traced with the tuned configs matches the float64 scan's forward and gradients."""
    from jax_mamba2.bridge import tuning
    from jax_mamba2.bridge.tuning import cache_keys, lookup
    monkeypatch.setenv(cache_keys.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setenv(lookup.ENV_AUTOTUNE, "0")
    lookup.autotune_enabled.cache_clear()
    tuning.clear_memory()
    try:
        # 1 x 4096 x 32 (token, head) pairs: the smallest problem tuned.
        args, kwargs = make_ssd_args(41, batch=1, seqlen=4096, nheads=32, headdim=64, dstate=64,
                                     dtype=jnp.bfloat16, dt_softplus=True)
        weights = jax.random.normal(jax.random.PRNGKey(42), args[0].shape)

        # The weights are an argument, not a constant of the program: XLA would fold the backward's
        # finiteness check of a constant cotangent at compile time, for tens of seconds.
        def loss(fn, weights, *operands):
            return jnp.sum(fn(*operands).astype(jnp.float32) * weights)

        cutile = lambda *a: jax_mamba2.ssd(*a, 64, **kwargs, backend="cutile")  # noqa: E731
        step = jax.jit(jax.value_and_grad(functools.partial(loss, cutile), argnums=(1, 2, 3, 4, 5)))
        plans = jax_mamba2.autotune(step, weights, *args)
        assert [p.request.backward for p in plans] == [False, True]
        assert all(source in ("tuned", "disk") for p in plans for source in p.sources.values()), plans
        assert list(tmp_path.glob("*.json"))
        value, grads = step(weights, *args)
        with jax.enable_x64(True):
            args64, kwargs64 = to_float64((args, kwargs))
            scan = lambda *a: reference.ssd_scan(*a, **kwargs64)[0]  # noqa: E731
            want_value, want_grads = jax.value_and_grad(functools.partial(loss, scan), argnums=(1, 2, 3, 4, 5))(
                weights, *args64)
        assert rel_l2(value, want_value) <= TOLERANCE["kernel_fwd"]["bfloat16"]
        for name, g, r in zip(["x", "dt", "A", "B", "C"], grads, want_grads):
            assert rel_l2(g, r) <= TOLERANCE["kernel_bwd"]["bfloat16"], (name, rel_l2(g, r))
    finally:
        tuning.clear_memory()
        lookup.autotune_enabled.cache_clear()


def test_the_kernels_give_the_same_values_whatever_xla_records_into_command_buffers():
    """The forward and backward kernels, launched through the package's command-buffer target, give the same values
    (deterministic backward) when XLA records every run of commands into command buffers (CUDA graphs) and with
    command buffers off."""
    args, kwargs = make_ssd_args(16, batch=2, seqlen=256, nheads=4, headdim=64, dstate=64)

    def loss(*args):
        y = jax_mamba2.ssd(*args, 64, **kwargs, backend="cutile", check_finite=False, deterministic_backward=True)
        return jnp.sum(y.astype(jnp.float32) ** 2)
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args)
    recorded = lowered.compile({**RECORD_EVERY_COMMAND, "xla_gpu_graph_min_graph_size": 1})
    launched = lowered.compile({"xla_gpu_enable_command_buffer": ""})
    assert len(cutile_launches(recorded.as_text(), CUTILE_CUSTOM_CALL)) >= 2
    for a, b in zip(jax.tree.leaves(recorded(*args)), jax.tree.leaves(launched(*args))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
