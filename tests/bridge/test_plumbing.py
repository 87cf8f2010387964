"""The cuTile backends' JAX plumbing, traced on CPU: custom calls, vmap folding, grad, shard_map types.

Lowering a cutile_call needs a GPU, but tracing does not: these tests check the jaxprs the bridge builds.
"""
import jax
import jax.extend
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, PartitionSpec as P

pytest.importorskip("cuda.tile")

from jax_mamba2 import op  # noqa: E402
from tests._helpers import make_ssd_args  # noqa: E402

assert "cutile" in op.available_backends(), op._load_optional_backends()

DIMS = dict(batch=2, seqlen=96, nheads=4, headdim=16, ngroups=2, dstate=16)


def _cutile_ssd(x, dt, A, B, C, *, chunk_size=64, **kwargs):
    """`ssd(backend="cutile")` without the GPU check (tracing only)."""
    static = op.SSDStatic(chunk_size, kwargs.pop("dt_softplus", False), (0.0, float("inf")))
    inputs = op.SSDInputs(x, dt, A, B, C, kwargs.get("D"), kwargs.get("z"), kwargs.get("dt_bias"),
                          kwargs.get("initial_states"), kwargs.get("seq_idx"))
    return op._run_backend(op._BACKENDS["cutile"], inputs, static)


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
    assert [c.params["kernel"]._annotated_function.pyfunc.__name__ for c in calls] == [
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
    assert cumsum.params["kernel"]._annotated_function.pyfunc.__name__ == "chunk_cumsum_fwd_kernel"
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
    return [c.params["kernel"]._annotated_function.pyfunc.__name__ for c in _cutile_calls(jaxpr)]


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


@pytest.mark.parametrize("layout", ["staged", "fused"])
def test_cutile_grad_reads_the_states_the_forward_saved_unless_asked_to_recompute(monkeypatch, layout):
    """The custom VJP's forward saves the chunk-entry states (the fused kernel stores them as a third
    output; 128 chains make the fused layout) and the chunk quantities, so the backward has no chunk_state
    or chunk_cumsum recompute; with JAX_MAMBA2_RECOMPUTE_STATES=1 it saves only the inputs and recomputes
    them."""
    dims = dict(DIMS, nheads=64, headdim=64) if layout == "fused" else DIMS
    args, kwargs = make_ssd_args(6, **dims, dtype=jnp.bfloat16)
    def grad():  # a new function per trace: JAX reuses a function's trace (the env is read at tracing)
        return jax.grad(lambda x: jnp.sum(_cutile_ssd(x, *args[1:])[0].astype(jnp.float32) ** 2))
    forward_kernel = "fused_scan_fwd_kernel" if layout == "fused" else "chunk_scan_fwd_kernel"

    calls = _cutile_calls(jax.make_jaxpr(grad())(args[0]))
    names = [c.params["kernel"]._annotated_function.pyfunc.__name__ for c in calls]
    assert forward_kernel in names and "chunk_scan_bwd_dx_kernel" in names
    assert names.count("chunk_state_fwd_kernel") == (1 if layout == "staged" else 0), names
    assert names.count("chunk_cumsum_fwd_kernel") == 1, names
    if layout == "fused":
        (fused,) = [c for c in calls if c.params["kernel"]._annotated_function.pyfunc.__name__ == forward_kernel]
        b, L, H, P, N = dims["batch"], dims["seqlen"], dims["nheads"], dims["headdim"], dims["dstate"]
        assert (b, -(-L // 64), H, P, N) in [tuple(v.aval.shape) for v in fused.outvars]

    monkeypatch.setenv("JAX_MAMBA2_RECOMPUTE_STATES", "1")
    names = _kernel_names(jax.make_jaxpr(grad())(args[0]))
    assert names.count("chunk_state_fwd_kernel") == (2 if layout == "staged" else 1), names
    assert names.count("chunk_cumsum_fwd_kernel") == 2, names


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


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
def test_cutile_step_traces_the_state_update_into_a_new_state(backend):
    args, kwargs = make_ssd_args(5, batch=3, seqlen=1, nheads=4, headdim=16, ngroups=2, dstate=16,
                                 dtype=jnp.bfloat16, D="head", z=True, dt_bias=True, initial_states=True)
    x, dt, A, B, C = (a[:, 0] if a.ndim >= 3 else a for a in args)
    state = kwargs["initial_states"]
    step = op._BACKENDS[backend].step
    jaxpr = jax.make_jaxpr(lambda s, x: step(s, x, dt, A, B, C, kwargs["D"], kwargs["z"][:, 0],
                                             kwargs["dt_bias"], True, (0.0, float("inf"))))(state, x)
    y, new_state = jaxpr.out_avals
    assert (y.shape, y.dtype) == (x.shape, jnp.bfloat16)
    assert (new_state.shape, new_state.dtype) == (state.shape, state.dtype)
    text = str(jaxpr)
    assert ("cutile_call_ffi" in text) if backend == "cutile" else ("buffer_callback" in text)
