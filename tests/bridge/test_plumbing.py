"""The cuTile backends' JAX plumbing, traced on CPU: custom calls, vmap folding, grad, shard_map types.

Lowering a cutile_call needs a GPU, but tracing does not: these tests check the jaxprs the bridge builds.
"""
import jax
import jax.extend
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, PartitionSpec as P

pytest.importorskip("cuda.tile")

import jax_mamba2  # noqa: E402
from jax_mamba2 import backends, op  # noqa: E402
from jax_mamba2.bridge import ops  # noqa: E402
from tests._helpers import make_ssd_args  # noqa: E402

assert "cutile" in backends.registered(), backends.backend_status()["cutile"].reason

DIMS = dict(batch=2, seqlen=96, nheads=4, headdim=16, ngroups=2, dstate=16)


def _cutile_ssd(x, dt, A, B, C, *, chunk_size=64, save_chunk_states=True, **kwargs):
    """`ssd(backend="cutile")` without the GPU check (tracing only)."""
    static = op.SSDStatic(chunk_size, kwargs.pop("dt_softplus", False), (0.0, float("inf")),
                          save_chunk_states=save_chunk_states)
    inputs = op.SSDInputs(x, dt, A, B, C, kwargs.get("D"), kwargs.get("z"), kwargs.get("dt_bias"),
                          kwargs.get("initial_states"), kwargs.get("seq_idx"))
    return op._run_backend(backends.get("cutile", "test"), inputs, static)


def _kernel_name(call) -> str:
    """The kernel function a cutile_call equation launches."""
    return call.params["kernel"]._annotated_function.pyfunc.__name__


def _cutile_calls(jaxpr) -> list:
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "cutile_call_ffi":
                found.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)
    visit(jaxpr.jaxpr)
    return found


def test_cutile_forward_is_three_kernel_calls_with_every_feature():
    args, kwargs = make_ssd_args(0, **DIMS, D="head", z=True, dt_bias=True, dt_softplus=True,
                                 initial_states=True, seq_idx=[50, 46], dtype=jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda *a: _cutile_ssd(*a, **kwargs))(*args)
    calls = _cutile_calls(jaxpr)
    assert [_kernel_name(c) for c in calls] == [
        "chunk_cumsum_fwd_kernel", "chunk_state_fwd_kernel", "chunk_scan_fwd_kernel"]
    y, final = jaxpr.out_avals
    assert (y.shape, y.dtype) == (args[0].shape, jnp.bfloat16)
    assert (final.shape, final.dtype) == ((2, 4, 16, 16), jnp.float32)


@pytest.mark.parametrize("chunk_size", [16, 64, 128, 256])
def test_cutile_runs_its_kernels_at_chunk_64_whatever_chunk_size(chunk_size):
    """The chunk quantities (batch, nheads, nchunks, chunk) come out at chunk 64 (problem.KERNEL_CHUNK_SIZE)."""
    args, kwargs = make_ssd_args(0, **DIMS, dt_softplus=True, dtype=jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda *a: _cutile_ssd(*a, chunk_size=chunk_size, **kwargs))(*args)
    cumsum = _cutile_calls(jaxpr)[0]
    assert _kernel_name(cumsum) == "chunk_cumsum_fwd_kernel"
    assert {tuple(v.aval.shape) for v in cumsum.outvars} == {(2, 4, 2, 64)}


def test_cutile_vmap_folds_into_kernel_batch():
    args, kwargs = make_ssd_args(1, **DIMS)
    xs = jnp.stack([args[0]] * 3)
    jaxpr = jax.make_jaxpr(jax.vmap(lambda x: _cutile_ssd(x, *args[1:], **kwargs)))(xs)
    calls = _cutile_calls(jaxpr)
    assert len(calls) == 3, "vmap must fold into one launch per stage, not loop"
    out_shapes = {tuple(v.aval.shape) for c in calls for v in c.outvars}
    assert (3 * 2, 96, 4, 16) in out_shapes
    assert jaxpr.out_avals[0].shape == (3, 2, 96, 4, 16)


def test_cutile_vmap_over_per_head_params_maps_items():
    args, kwargs = make_ssd_args(2, **DIMS)
    As = jnp.stack([args[2], 2 * args[2]])
    f = lambda A: _cutile_ssd(args[0], args[1], A, *args[3:], **kwargs)
    jaxpr = jax.make_jaxpr(jax.vmap(f))(As)
    assert jaxpr.out_avals[0].shape == (2, 2, 96, 4, 16)
    assert len(_cutile_calls(jaxpr)) == 3  # inside one lax.map body


def _kernel_names(jaxpr) -> list[str]:
    return [_kernel_name(c) for c in _cutile_calls(jaxpr)]


def test_cutile_grad_runs_forward_then_backward_kernels():
    args, kwargs = make_ssd_args(3, **DIMS, initial_states=True)

    def loss(x, h0):
        y, final = _cutile_ssd(x, *args[1:], initial_states=h0)
        return jnp.sum(y ** 2) + jnp.sum(final)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(args[0], kwargs["initial_states"])
    names = _kernel_names(jaxpr)
    assert names[:3] == ["chunk_cumsum_fwd_kernel", "chunk_state_fwd_kernel", "chunk_scan_fwd_kernel"]
    assert len(names) > 3 and all(n.endswith("_kernel") for n in names)
    assert any("bwd" in n for n in names[3:]), names
    assert [a.shape for a in jaxpr.out_avals] == [args[0].shape, (2, 4, 16, 16)]


def test_cutile_vmap_of_grad_maps_backward_items():
    args, kwargs = make_ssd_args(4, **DIMS)
    xs = jnp.stack([args[0], -args[0]])
    grad = jax.grad(lambda x: jnp.sum(_cutile_ssd(x, *args[1:])[0] ** 2))
    jaxpr = jax.make_jaxpr(jax.vmap(grad))(xs)
    assert jaxpr.out_avals[0].shape == xs.shape
    assert any("bwd" in n for n in _kernel_names(jaxpr))


def test_cutile_vmap_of_grad_with_a_gate_maps_the_gate_around_the_kernels():
    args, kwargs = make_ssd_args(11, **DIMS, z=True)
    xs, zs = (jnp.stack([a, -a]) for a in (args[0], kwargs["z"]))
    grad = jax.grad(lambda x, z: jnp.sum(_cutile_ssd(x, *args[1:], z=z)[0] ** 2), argnums=(0, 1))
    jaxpr = jax.make_jaxpr(jax.vmap(grad))(xs, zs)
    assert [a.shape for a in jaxpr.out_avals] == [xs.shape, zs.shape]
    names = _kernel_names(jaxpr)
    assert "chunk_scan_bwd_dc_kernel" in names and "chunk_scan_fwd_kernel" in names


@pytest.mark.parametrize("layout", ["staged", "fused"])
def test_cutile_grad_reads_the_states_the_forward_saved_unless_asked_to_recompute(layout):
    """The custom VJP's forward saves the chunk-entry states (the fused kernel stores them as a third
    output; 128 chains make the fused layout) and the chunk quantities, so the backward has no chunk_state
    or chunk_cumsum recompute; with save_chunk_states=False it saves only the inputs and recomputes them."""
    dims = dict(DIMS, nheads=64, headdim=64) if layout == "fused" else DIMS
    args, kwargs = make_ssd_args(6, **dims, dtype=jnp.bfloat16)

    def grad(save_chunk_states=True):
        return jax.grad(lambda x: jnp.sum(_cutile_ssd(x, *args[1:], save_chunk_states=save_chunk_states)[0]
                                          .astype(jnp.float32) ** 2))
    forward_kernel = "fused_scan_fwd_kernel" if layout == "fused" else "chunk_scan_fwd_kernel"

    calls = _cutile_calls(jax.make_jaxpr(grad())(args[0]))
    names = [_kernel_name(c) for c in calls]
    assert forward_kernel in names and "chunk_scan_bwd_dx_kernel" in names
    assert names.count("chunk_state_fwd_kernel") == (1 if layout == "staged" else 0), names
    assert names.count("chunk_cumsum_fwd_kernel") == 1, names
    if layout == "fused":
        (fused,) = [c for c in calls if _kernel_name(c) == forward_kernel]
        b, L, H, P, N = dims["batch"], dims["seqlen"], dims["nheads"], dims["headdim"], dims["dstate"]
        assert (b, -(-L // 64), H, P, N) in [tuple(v.aval.shape) for v in fused.outvars]

    names = _kernel_names(jax.make_jaxpr(grad(save_chunk_states=False))(args[0]))
    assert names.count("chunk_state_fwd_kernel") == (2 if layout == "staged" else 1), names
    assert names.count("chunk_cumsum_fwd_kernel") == 2, names


def _kernel_operand_shapes(jaxpr) -> list:
    return [(_kernel_name(c), [tuple(v.aval.shape) for v in c.invars])
            for c in _cutile_calls(jaxpr)]


@pytest.mark.parametrize("save_chunk_states", [True, False], ids=["saved", "recomputed"])
def test_cutile_differentiated_gate_runs_outside_the_kernels(save_chunk_states):
    """A forward alone applies z in its output kernel. Differentiated, the kernels and their operands are
    those of the gate-free call (z never reaches one): the gate and its VJP are XLA elementwise ops on the
    pre-gate output, which the forward saved; with save_chunk_states=False the custom VJP's forward
    is the gated forward and the backward runs the gate-free saving forward again (for the pre-gate output and
    the chunk states), then the backward kernels of a call that saved them."""
    args, kwargs = make_ssd_args(8, **DIMS, z=True, dtype=jnp.bfloat16)
    z = kwargs["z"]

    def trace(gate, grad=True, save_chunk_states=True):
        def loss(x, z):
            y = _cutile_ssd(x, *args[1:], z=z if gate else None, save_chunk_states=save_chunk_states)[0]
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)) if grad else loss)(args[0], z)

    forward_names = ["chunk_cumsum_fwd_kernel", "chunk_state_fwd_kernel", "chunk_scan_fwd_kernel"]
    gated_forward, plain_forward = (_kernel_operand_shapes(trace(gate, grad=False)) for gate in (True, False))
    assert [name for name, _ in gated_forward] == [name for name, _ in plain_forward] == forward_names
    # The output kernel's z operand: z itself, not the (1, 1, 1, 1) dummy.
    assert gated_forward[2][1].count(z.shape) == plain_forward[2][1].count(z.shape) + 1
    plain = _kernel_operand_shapes(trace(False))
    assert "chunk_state_fwd_kernel" not in [name for name, _ in plain[3:]]  # the saved states are read
    gated = _kernel_operand_shapes(trace(True, save_chunk_states=save_chunk_states))
    assert gated == (plain if save_chunk_states else gated_forward + plain)
    assert [a.shape for a in trace(True).out_avals] == [(), args[0].shape, z.shape]


def test_gate_vjp_matches_autodiff_of_the_gate():
    """ops._gate_vjp against jax.vjp of y * silu(z), in f32 and bf16, with z far in both tails."""
    ky, kz, kd = jax.random.split(jax.random.PRNGKey(9), 3)
    y = jax.random.normal(ky, (2, 8, 3, 16), jnp.float32)
    z = 4.0 * jax.random.normal(kz, y.shape, jnp.float32).at[0, 0, 0, :2].set(jnp.array([-200.0, 200.0]))
    dout = jax.random.normal(kd, y.shape, jnp.float32)
    out, vjp = jax.vjp(lambda y, z: y * jax.nn.silu(z), y, z)
    want_dy, want_dz = vjp(dout)
    for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)):
        cast = [a.astype(dtype) for a in (y, z, dout)]
        got_dy, got_dz = ops._gate_vjp(*cast)
        assert got_dy.dtype == got_dz.dtype == dtype
        for got, want in ((ops._gate(cast[0], cast[1]), out), (got_dy, want_dy), (got_dz, want_dz)):
            got = got.astype(jnp.float32)
            assert bool(jnp.all(jnp.isfinite(got)))
            assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < tol


def test_cutile_outputs_keep_shard_map_varying_axes():
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))
    args, kwargs = make_ssd_args(4, **DIMS)
    x, dt, A, B, C = args
    seen = {}

    def per_shard(x, dt, B, C):
        y, final = _cutile_ssd(x, dt, A, B, C)
        seen["y"], seen["final"] = jax.typeof(y), jax.typeof(final)
        return y

    def loss(x, A):
        f = jax.shard_map(lambda x, dt, B, C: _cutile_ssd(x, dt, A, B, C)[0], mesh=mesh,
                          in_specs=P("data"), out_specs=P("data"))
        return jnp.sum(f(x, dt, B, C) ** 2)

    jax.make_jaxpr(jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(
        x, dt, B, C)
    assert seen["y"].manual_axis_type.varying == frozenset({"data"})
    assert seen["final"].manual_axis_type.varying == frozenset({"data"})
    # The gradient of a replicated parameter (A) through the kernel must type-check under shard_map.
    grads = jax.make_jaxpr(jax.grad(loss, argnums=1))(x, A)
    assert grads.out_avals[0].shape == A.shape


def test_cutile_gate_gradients_type_check_under_shard_map():
    """The gate's VJP (outside the kernels) gives z a cotangent varying as z does, and a replicated D the sum
    over shards."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))
    args, kwargs = make_ssd_args(10, **DIMS, D="head", z=True)
    x, dt, A, B, C = args

    def loss(z, D):
        f = jax.shard_map(lambda x, dt, B, C, z: _cutile_ssd(x, dt, A, B, C, D=D, z=z)[0], mesh=mesh,
                          in_specs=P("data"), out_specs=P("data"))
        return jnp.sum(f(x, dt, B, C, z) ** 2)

    grads = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(kwargs["z"], kwargs["D"])
    assert [a.shape for a in grads.out_avals] == [kwargs["z"].shape, kwargs["D"].shape]


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
def test_cutile_step_traces_the_state_update_into_a_new_state(backend):
    args, kwargs = make_ssd_args(5, batch=3, seqlen=1, nheads=4, headdim=16, ngroups=2, dstate=16,
                                 dtype=jnp.bfloat16, D="head", z=True, dt_bias=True, initial_states=True)
    x, dt, A, B, C = (a[:, 0] if a.ndim >= 3 else a for a in args)
    state = kwargs["initial_states"]
    step = backends.get(backend, "test").step
    jaxpr = jax.make_jaxpr(lambda s, x: step(s, x, dt, A, B, C, kwargs["D"], kwargs["z"][:, 0],
                                             kwargs["dt_bias"], True, (0.0, float("inf"))))(state, x)
    y, new_state = jaxpr.out_avals
    assert (y.shape, y.dtype) == (x.shape, jnp.bfloat16)
    assert (new_state.shape, new_state.dtype) == (state.shape, state.dtype)
    text = str(jaxpr)
    assert ("cutile_call_ffi" in text) if backend == "cutile" else ("buffer_callback" in text)


def _per_device_calls():
    """(name, fn(backend) -> f(varying, *replicated), varying (2, ...), replicated): op calls with one argument that
    differs between the devices (a per-device parameter, the rest replicated), one mixer kernel per op."""
    from tests.kernels._decode_checks import MIXER_CASES, mixer_inputs

    keys = jax.random.split(jax.random.key(12), 6)
    state, x = jax.random.normal(keys[0], (2, 4, 16, 16)), jax.random.normal(keys[1], (2, 4, 16))
    dt, B = jax.random.normal(keys[2], (2, 4)), jax.random.normal(keys[3], (2, 2, 16))
    A = -jnp.exp(jax.random.uniform(keys[4], (2, 4)))
    rows, weight, norm_weight = jnp.ones((3, 64)), jax.random.normal(keys[5], (2, 64, 32)), jnp.ones((2, 64))
    mixer = MIXER_CASES["gated_norm_mixer"]
    m = {k: None if v is None else jnp.asarray(v) for k, v in mixer_inputs(mixer, seed=12).items()}
    names = ("zxbcdt", "conv_state", "ssm_state", "conv_weight", "conv_bias", "dt_bias", "D")

    def mixer_step(backend):
        def f(A_log, *arrays):
            a = dict(zip(names, arrays))
            return jax_mamba2.mixer_step(*(a[n] for n in names[:5]), A_log, a["dt_bias"], a["D"],
                                         **mixer.layout(), layer=1, backend=backend)
        return f
    return {
        "ssd_step per-device A": (lambda backend: lambda A, state, x: jax_mamba2.ssd_step(
            state, x, dt, A, B, B, dt_softplus=True, backend=backend), A, (state, x)),
        "norm_project per-device norm weight": (lambda backend: lambda w, x: jax_mamba2.norm_project(
            x, weight[0], norm_weight=w, backend=backend), norm_weight, (rows,)),
        "norm_project per-device weight, residual stream": (lambda backend: lambda w, x, r: jax_mamba2.norm_project(
            x, w, norm_weight=norm_weight[0], residual=r, residual_dtype=jnp.float32, backend=backend), weight,
            (rows, rows)),
        "add_rms_norm per-device weight": (lambda backend: lambda w, x, r: jax_mamba2.add_rms_norm(
            x, r, w, backend=backend), norm_weight, (rows, rows)),
        "mixer_step per-device A_log": (mixer_step, jnp.stack([m["A_log"]] * 2), tuple(m[n] for n in names)),
        "conv split per-device kernel, passed-through channels": (
            lambda backend: lambda k, x: jax_mamba2.causal_conv1d_silu_split(
                x, k, channel_offset=16, split=(16, 16), pass_through=True, backend=backend),
            jnp.ones((2, 4, 32)), (jnp.ones((2, 7, 64)),)),
    }


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
@pytest.mark.parametrize("name", list(_per_device_calls()))
def test_kernel_outputs_vary_over_the_mesh_axes_of_what_they_are_computed_from(monkeypatch, name, backend):
    """cutile_call's outputs carry no varying axes, which the bridge gives them back: inside shard_map each output of
    a kernel op varies over the mesh axes the xla path's does, those of the inputs it is computed from. So over a
    per-device parameter's (typed replicated, a psum would multiply one device's value by the axis size, and
    out_specs P() would pass it), and not over a weight's for the residual stream or the channels passed through
    (typed varying, shard_map would refuse them replicated)."""
    from jax_mamba2.bridge import decode_ops, norm_ops, problem
    for module in (problem, norm_ops, decode_ops):  # trace the kernels without a GPU
        monkeypatch.setattr(module, "gpu_unavailable_reason", lambda: None)
    fn, varying, replicated = _per_device_calls()[name]
    mesh = jax.make_mesh((2,), ("m",), axis_types=(AxisType.Auto,))

    def output_axes(backend):
        seen = []

        def per_device(item, *arrays):
            outputs = fn(backend)(item[0], *arrays)
            seen.extend(None if o is None else jax.typeof(o).manual_axis_type.varying
                        for o in jax.tree.leaves(outputs, is_leaf=lambda o: o is None))
            return jnp.zeros(())
        jax.make_jaxpr(jax.shard_map(per_device, mesh=mesh, in_specs=(P("m"),) + (P(),) * len(replicated),
                                     out_specs=P()))(varying, *replicated)
        return seen
    got, want = output_axes(backend), output_axes("xla")
    assert got == want and frozenset({"m"}) in want, (got, want)
