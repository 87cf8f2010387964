"""The RMSNorm ops' kernel path end to end on the CPU: jax_mamba2.rms_norm / add_rms_norm with backend="cutile",
whose plans (bridge/norm_ops.py) run block by block on the NumPy emulator in float64 through jax.pure_callback.
Checked against the float64 reference, and composed with jit, grad, vmap, shard_map over a data axis and
nnx.remat, and inside the LM block (both of its norms on the kernels)."""
import contextlib
import dataclasses
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import AxisType, PartitionSpec as P

pytest.importorskip("cuda.tile")

import jax_mamba2  # noqa: E402
from jax_mamba2 import backends, norm  # noqa: E402
from jax_mamba2.bridge import norm_ops  # noqa: E402
from jax_mamba2.kernels.rms_norm import NormConfig  # noqa: E402
from jax_mamba2.flax_layers import Mamba2Block, Mamba2Config  # noqa: E402
from tests._helpers import rel_l2  # noqa: E402
from tests.bridge._emulated_backend import emulate_layer_kernels  # noqa: E402
from tests.kernels import _cutile_emulator as emulator  # noqa: E402
from tests.kernels._norm_checks import CASES, EPS, make_inputs, oracle  # noqa: E402

# The arrays between the plans and XLA are float32 (the emulated kernels compute in float64).
TOLERANCE = 2e-6


@pytest.fixture(autouse=True)
def emulated_kernels(monkeypatch):
    """backend="cutile" runs the emulated plans, as if on a GPU."""
    emulate_layer_kernels(monkeypatch, norm.OP, norm_ops)


def _op(case):
    """(x, z, residual, weight) -> (out, residual_out or None) of the case on backend="cutile"."""
    def op(x, z, residual, weight):
        if case.residual:
            return jax_mamba2.add_rms_norm(x, residual, weight, eps=EPS, residual_dtype=jnp.float32, backend="cutile")
        return jax_mamba2.rms_norm(x, weight, z, eps=EPS, group_size=case.group_size,
                                   norm_before_gate=case.norm_before_gate, backend="cutile"), None
    return op


def _primals(arrays):
    return tuple(None if arrays.get(n) is None else jnp.asarray(arrays[n]) for n in ("x", "z", "residual", "weight"))


def _forward_and_vjp(case, arrays):
    """(primals, f): the case's primals and f(*primals) -> (outputs, their VJP of the case's cotangents)."""
    cotangents = (jnp.asarray(arrays["dout"]), None if not case.residual else jnp.asarray(arrays["dresidual_out"]))

    def forward_and_vjp(*primals):
        outputs, vjp = jax.vjp(_op(case), *primals)
        return outputs, vjp(cotangents)
    return _primals(arrays), forward_and_vjp


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_op_forward_and_gradients_match_float64_reference(name):
    case = CASES[name]
    arrays = make_inputs(case, seed=3)
    primals, forward_and_vjp = _forward_and_vjp(case, arrays)
    forward_and_vjp = jax.jit(forward_and_vjp)
    (out, residual_out), (dx, dz, dresidual, dweight) = forward_and_vjp(*primals)
    assert "pure_callback" in str(jax.make_jaxpr(forward_and_vjp)(*primals))  # the kernels ran, not XLA
    want = oracle(case, arrays)
    got = dict(out=out, residual_out=residual_out, dx=dx, dz=dz, dresidual=dresidual, dweight=dweight)
    errors = {k: rel_l2(got[k], want[k]) for k in want}
    assert max(errors.values()) < TOLERANCE, errors
    assert {k for k, v in got.items() if v is not None} == set(want)


@pytest.mark.parametrize("x_dtype, residual_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)])
def test_emulated_add_rms_norm_without_a_residual_matches_the_xla_path(x_dtype, residual_dtype):
    """residual=None on the kernels (a plain norm of x, or of x rounded to a narrower stream, no residual read):
    outputs and gradients as the xla path's, and the kernels ran."""
    arrays = make_inputs(CASES[next(iter(CASES))], seed=5)
    x, weight = jnp.asarray(arrays["x"]).astype(x_dtype), jnp.asarray(arrays["weight"])
    cotangent = jnp.cos(x.astype(jnp.float32))

    def grads(backend):
        def value(x, weight):
            out, h = jax_mamba2.add_rms_norm(x, None, weight, eps=EPS, residual_dtype=residual_dtype,
                                             out_dtype=jnp.float32, backend=backend)
            return jnp.sum(out * cotangent) + jnp.sum(h.astype(jnp.float32) ** 2)
        return jax.jit(jax.value_and_grad(value, argnums=(0, 1)))

    assert "pure_callback" in str(jax.make_jaxpr(grads("cutile"))(x, weight))
    got, want = grads("cutile")(x, weight), grads("xla")(x, weight)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        # a bfloat16 x or stream: h's rounding from the emulator's float64 sum or XLA's float32 one may differ
        assert a.dtype == b.dtype and rel_l2(a, b) < (TOLERANCE if x_dtype == residual_dtype else 4e-3)

    def zero_stream(x, weight):  # the kernels' add + norm of a zero stream: what residual=None stands for
        out, h = jax_mamba2.add_rms_norm(x, jnp.zeros(x.shape, residual_dtype), weight, eps=EPS,
                                         residual_dtype=residual_dtype, out_dtype=jnp.float32, backend="cutile")
        return jnp.sum(out * cotangent) + jnp.sum(h.astype(jnp.float32) ** 2)

    zeros = jax.jit(jax.value_and_grad(zero_stream, argnums=(0, 1)))(x, weight)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(zeros)):
        assert a.dtype == b.dtype and rel_l2(a, b) == 0.0


def test_emulated_final_norm_without_its_residual_matches_float64_reference():
    """add_rms_norm(return_residual=False), the LM's final norm: the backward gets a zero residual cotangent."""
    case = CASES["add_norm"]
    arrays = make_inputs(case, seed=13)
    x, _, residual, w = _primals(arrays)

    def loss(x, residual, w):
        out = jax_mamba2.add_rms_norm(x, residual, w, eps=EPS, residual_dtype=jnp.float32, return_residual=False,
                                      backend="cutile")
        return jnp.sum(out * jnp.asarray(arrays["dout"]))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, residual, w)
    want = oracle(case, {**arrays, "dresidual_out": np.zeros_like(arrays["dresidual_out"])})
    errors = {n: rel_l2(g, want[n]) for n, g in zip(("dx", "dresidual", "dweight"), grads)}
    assert max(errors.values()) < TOLERANCE, errors


def test_emulated_add_norm_in_the_kernels_dtypes_matches_xla_under_a_narrower_residual_stream(monkeypatch):
    """A bfloat16 residual stream under a float32 output, the plan run in the kernels' own dtypes (the float64
    emulation would not round h): the kernel and the xla path both normalize the rounded h and round the output
    once."""
    monkeypatch.setitem(backends._REGISTRY[norm.OP], "cutile", backends.LayerBackend(
        "cutile", norm_ops.make_kernels(functools.partial(emulator.jax_run_plan, float64=False)),
        norm_ops.unsupported_reason, auto_priority=2))
    arrays = make_inputs(CASES["add_norm"], seed=19)
    x, _, residual, w = _primals(arrays)
    got = {b: jax_mamba2.add_rms_norm(x, residual, w, eps=EPS, residual_dtype=jnp.bfloat16, out_dtype=jnp.float32,
                                      backend=b) for b in ("cutile", "xla")}
    np.testing.assert_array_equal(got["cutile"][1], got["xla"][1])
    assert got["cutile"][0].dtype == got["xla"][0].dtype == jnp.float32
    assert rel_l2(got["cutile"][0], got["xla"][0]) < 1e-6


def test_emulated_op_vmap_of_forward_and_gradients_matches_a_loop():
    """vmap folds the mapped axis into the kernels' rows (forward) or maps the backward items; a batched
    weight maps the forward too."""
    case = CASES["gate_before_groups3"]
    arrays = make_inputs(case, seed=5)
    x, z, _, w = _primals(arrays)
    xs, zs, ws = jnp.stack([x, 0.5 * x]), jnp.stack([z, -z]), jnp.stack([w, 2 * w])

    def loss(x, z, w):
        return jnp.sum(_op(case)(x, z, None, w)[0] * jnp.asarray(arrays["dout"]))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    for in_axes, weights in (((0, 0, None), w), ((0, 0, 0), ws)):
        mapped_out = jax.vmap(lambda x, z, w: _op(case)(x, z, None, w)[0], in_axes)(xs, zs, weights)
        mapped_grads = jax.vmap(grad, in_axes)(xs, zs, weights)
        for i in range(2):
            wi = weights if in_axes[2] is None else weights[i]
            assert rel_l2(mapped_out[i], _op(case)(xs[i], zs[i], None, wi)[0]) < 1e-6
            for got, want in zip(mapped_grads, grad(xs[i], zs[i], wi)):
                assert rel_l2(got[i], want) < 1e-6


@pytest.mark.parametrize("name", ["gate_before_groups3", "add_norm"])
def test_emulated_kernels_in_a_chosen_config_match_float64_reference_also_vmapped(monkeypatch, name):
    """make_kernels(run_plan, config): the plans of every call, the vmapped forward's folded rows included, take
    the config the function chooses for their dims (4 rows per block, latency hints, one program per SM)."""
    chosen = []

    def config(dims):
        chosen.append(dims.rows)
        return NormConfig(BLOCK_ROWS=4, FWD_OCCUPANCY=2, BWD_OCCUPANCY=1, FWD_LATENCY=2, BWD_LATENCY=3)

    monkeypatch.setitem(backends._REGISTRY[norm.OP], "cutile", backends.LayerBackend(
        "cutile", norm_ops.make_kernels(emulator.jax_run_plan, config), norm_ops.unsupported_reason, auto_priority=2))
    case = CASES[name]
    arrays = make_inputs(case, seed=17)
    primals, forward_and_vjp = _forward_and_vjp(case, arrays)
    (out, residual_out), (dx, dz, dresidual, dweight) = jax.jit(forward_and_vjp)(*primals)
    got = dict(out=out, residual_out=residual_out, dx=dx, dz=dz, dresidual=dresidual, dweight=dweight)
    want = oracle(case, arrays)
    errors = {k: rel_l2(got[k], want[k]) for k in want}
    assert max(errors.values()) < TOLERANCE, errors
    assert chosen == [case.rows, case.rows]  # the forward's plan and the backward's
    stacked = jax.jit(jax.vmap(lambda *p: _op(case)(*p)[0], in_axes=(0, 0, 0, None)))(
        *(None if a is None else jnp.stack([a, -a]) for a in primals[:3]), primals[3])
    assert chosen[-1] == 2 * case.rows  # one launch on the folded rows
    assert rel_l2(stacked[0], want["out"]) < TOLERANCE


@pytest.mark.parametrize("name", ["gate_after_groups3", "add_norm"])
def test_emulated_op_gradients_under_shard_map_match_float64_reference(name):
    """Rows split over two devices by shard_map: the kernels run per shard and the replicated weight's
    gradient is the sum of the shards' (the plain norm's x and the add + norm's residual are split too)."""
    case = dataclasses.replace(CASES[name], rows=38)
    arrays = make_inputs(case, seed=9)
    x, z, residual, w = _primals(arrays)
    dout = jnp.asarray(arrays["dout"])
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))

    def loss(x, z, residual, w):
        def per_shard(x, z, residual, dout):
            out, h = _op(case)(x, z, residual, w)
            local = jnp.sum(out * dout) + (0.0 if h is None else jnp.sum(h * dout))
            return jax.lax.psum(local, "data")
        return jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P())(x, z, residual, dout)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, z, residual, w)
    want = oracle(case, {**arrays, "dresidual_out": arrays["dout"]} if case.residual else arrays)
    names = ("dx", "dz", "dresidual", "dweight")
    errors = {n: rel_l2(g, want[n]) for n, g in zip(names, grads) if n in want}
    assert max(errors.values()) < TOLERANCE, errors


def test_emulated_block_norms_under_remat_match_the_xla_block():
    """A Mamba2Block with both norms (the add + norm and the mixer's gated norm) on the kernels, its forward and
    parameter gradients under nnx.remat, against the same block on pure JAX."""
    config = Mamba2Config(d_model=32, n_layer=1, vocab_size=8,
                          ssm_cfg=dict(d_state=8, headdim=8, ngroups=2, chunk_size=8))
    reference = Mamba2Block(config, backend="xla", rngs=nnx.Rngs(0))
    kernels = Mamba2Block(config, backend="xla", rngs=nnx.Rngs(0))
    kernels.norm.backend = kernels.mixer.norm.backend = "cutile"
    hidden = jax.random.normal(jax.random.key(1), (2, 12, 32))
    residual = jax.random.normal(jax.random.key(2), (2, 12, 32))

    def loss(block, hidden, residual):
        out, new_residual = nnx.remat(lambda b, h, r: b(h, r))(block, hidden, residual)
        return jnp.sum(out * jnp.cos(hidden)) + jnp.sum(new_residual ** 2)

    (value, grads), (want_value, want_grads) = (
        nnx.jit(nnx.value_and_grad(loss))(block, hidden, residual) for block in (kernels, reference))
    assert rel_l2(value, want_value) < 1e-5
    flat, want_flat = (jax.tree.leaves(nnx.state(g, nnx.Param)) for g in (grads, want_grads))
    assert len(flat) == len(want_flat) and max(rel_l2(g, w) for g, w in zip(flat, want_flat)) < 1e-4
    graphdef, state = nnx.split(kernels)
    jaxpr = str(jax.make_jaxpr(lambda s, h, r: loss(nnx.merge(graphdef, s), h, r))(state, hidden, residual))
    assert jaxpr.count("pure_callback") >= 2  # both norms ran on the kernels


@pytest.mark.parametrize("name", ["gate_before_groups3", "add_norm"])
def test_emulated_op_takes_a_bf16_weight_without_converting_it(name):
    """A bf16 model's norm scale reaches the kernels as it is: the traced program converts no (features,)
    array (the kernels widen the weight as they load it), and the weight's gradient comes back in bf16."""
    case = dataclasses.replace(CASES[name], dtype="bfloat16", weight_dtype="bfloat16")
    arrays = make_inputs(case, seed=21)
    primals, forward_and_vjp = _forward_and_vjp(case, arrays)
    jaxpr = jax.make_jaxpr(forward_and_vjp)(*primals)
    weight_converts = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "convert_element_type"
                       and e.invars[0].aval.shape == (case.features,)]
    assert weight_converts == []
    (out, residual_out), (dx, dz, dresidual, dweight) = jax.jit(forward_and_vjp)(*primals)
    assert dweight.dtype == jnp.bfloat16
    got = dict(out=out, residual_out=residual_out, dx=dx, dz=dz, dresidual=dresidual, dweight=dweight)
    want = oracle(case, arrays)
    errors = {k: rel_l2(got[k], want[k]) for k in want}
    assert max(errors.values()) < 2e-2, errors


def _z_source(z, offset: int, extra: int = 6):
    """A wider array whose columns [offset, offset + features) are z and whose others are NaN (a read there
    would poison the gradients)."""
    source = jnp.full((*z.shape[:-1], offset + z.shape[-1] + extra), jnp.nan, z.dtype)
    return source.at[..., offset:offset + z.shape[-1]].set(z)


@pytest.mark.parametrize("name, offset", [("gate_before_groups3", 3), ("gate_after_one_group", 0),
                                          ("gate_before_group24", 8)])
def test_emulated_gate_read_again_from_a_wider_array_matches_float64_reference(name, offset):
    """rms_norm(z_kept_in=(source, offset)): the backward reads z from the source's columns and keeps the source,
    not z; values and gradients are the float64 reference's, also under vmap (the source mapped with the rows)."""
    case = CASES[name]
    arrays = make_inputs(case, seed=21)
    x, z, _, w = _primals(arrays)
    dout = jnp.asarray(arrays["dout"])

    def loss(x, z, w, source):
        out = jax_mamba2.rms_norm(x, w, z, eps=EPS, group_size=case.group_size,
                                  norm_before_gate=case.norm_before_gate, z_kept_in=(source, offset),
                                  backend="cutile")
        return jnp.sum(out * dout)

    source = _z_source(z, offset)
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, z, w, source)
    want = oracle(case, arrays)
    assert rel_l2(value, jnp.sum(want["out"] * arrays["dout"])) < TOLERANCE
    errors = {n: rel_l2(g, want[n]) for n, g in zip(("dx", "dz", "dweight"), grads)}
    assert max(errors.values()) < TOLERANCE, errors
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(lambda x, w, source: loss(x, source[..., offset:offset + z.shape[-1]], w, source),
                              x, w, source)
    lines = printed.getvalue().splitlines()
    made = [line for line in lines if f"[{case.rows},{case.features}]" in line and "output of" in line]
    assert made == []  # no z (a slice of the source) is kept
    assert any(f"[{case.rows},{source.shape[-1]}] from the argument source" in line for line in lines)
    mapped = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.stack([a, -a]) for a in (x, z, w, source)))
    for i, sign in enumerate((1, -1)):
        for got, want_grad in zip(mapped, jax.grad(loss, argnums=(0, 1, 2))(sign * x, sign * z, sign * w,
                                                                            sign * source)):
            assert rel_l2(got[i], want_grad) < 1e-6


@pytest.mark.parametrize("z_kept_in, error, message", [
    (lambda x, z: (z, 0), ValueError, None),
    (lambda x, z: (jnp.zeros((3, 60)), 0), ValueError, r"z_kept_in\[0\] has shape \(3, 60\)"),
    (lambda x, z: (jnp.zeros((x.shape[0], 60)), 13), ValueError,
     r"z_kept_in\[1\]=13 must be an int with 0 <= offset and offset \+ features=48 <= columns=60"),
    (lambda x, z: (jnp.zeros((x.shape[0], 60)), -1), ValueError, r"z_kept_in\[1\]=-1"),
    (lambda x, z: jnp.zeros((x.shape[0], 60)), TypeError,
     r"z_kept_in must be a pair \(source array, column offset\), got ArrayImpl"),
])
def test_rms_norm_checks_z_kept_in(z_kept_in, error, message):
    case = CASES["gate_before_groups3"]
    x, z, _, w = _primals(make_inputs(case, seed=1))
    call = lambda: jax_mamba2.rms_norm(x, w, z, group_size=16, z_kept_in=z_kept_in(x, z))  # noqa: E731
    if message is None:  # z itself, whole: accepted
        assert call().shape == x.shape
        return
    with pytest.raises(error, match=message):
        call()
    with pytest.raises(ValueError, match="z_kept_in needs z"):
        jax_mamba2.rms_norm(x, w, None, z_kept_in=(jnp.zeros_like(x), 0))
