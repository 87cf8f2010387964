"""Every public op under the JAX transformations the per-op tests leave out, on the xla path and on the kernels
(every plan run on the NumPy emulator of tests/kernels/_cutile_emulator.py): vmap over a non-leading axis (in and
out) of the outputs and of the gradients, the gradient of a vmapped loss, remat that saves nothing, jax.eval_shape of
the outputs and the gradients, bfloat16 inputs beside float32 parameters, and forward mode (jvp, linearize) where
an op's path supports it (the pure-JAX paths without a custom VJP), a TypeError naming forward mode where not."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

import jax_mamba2
from jax_mamba2 import backends, conv1d, cross_entropy, decode, norm
from jax_mamba2.projection import project
from tests._helpers import make_ssd_args, rel_l2
from tests.kernels._conv_checks import make_conv_args
from tests.kernels._decode_checks import MIXER_CASES, PROJECTION_CASES, mixer_inputs, projection_inputs

# The emulated kernels' arrays between the plans and XLA are float32 (against the xla path's float32 math).
TOLERANCE = 1e-4


def _jnp(arrays: dict) -> dict:
    return {k: None if v is None else jnp.asarray(v) for k, v in arrays.items()}


def _ssd():
    args, kw = make_ssd_args(3, batch=1, seqlen=16, nheads=2, headdim=16, ngroups=1, dstate=16, D="head", z=True,
                             dt_bias=True, dt_softplus=True, initial_states=True, seq_idx=[6, 10])
    seq_idx = kw.pop("seq_idx")

    def op(backend):
        def f(x, dt, A, B, C, D, z, dt_bias, h0):
            return jax_mamba2.ssd(x, dt, A, B, C, 8, D=D, z=z, dt_bias=dt_bias, dt_softplus=True, initial_states=h0,
                       seq_idx=seq_idx, return_final_states=True, backend=backend)
        return f
    return op, (*args, kw["D"], kw["z"], kw["dt_bias"], kw["initial_states"])


def _ssd_step():
    keys = jax.random.split(jax.random.key(4), 8)
    state, x = jax.random.normal(keys[0], (2, 4, 16, 16)), jax.random.normal(keys[1], (2, 4, 16))
    dt, A = jax.random.normal(keys[2], (2, 4)), -jnp.exp(jax.random.uniform(keys[3], (4,)))
    B, C = jax.random.normal(keys[4], (2, 2, 16)), jax.random.normal(keys[5], (2, 2, 16))
    D, dt_bias = jax.random.normal(keys[6], (4, 16)), 0.3 * jax.random.normal(keys[7], (4,))

    def op(backend):
        def f(x, state, dt, A, B, C, D, dt_bias):
            return jax_mamba2.ssd_step(state, x, dt, A, B, C, D=D, z=x, dt_bias=dt_bias, dt_softplus=True,
                                       dt_limit=(0.01, 5.0), backend=backend)
        return f
    return op, (x, state, dt, A, B, C, D, dt_bias)


def _conv():
    x, kernel, bias, init, _, _ = make_conv_args(5, seqlen=19, channels=24, init_width=3)

    def op(backend):
        def f(x, kernel, bias, init):
            return jax_mamba2.causal_conv1d_silu(x, kernel, bias, initial_states=init, return_final_states=True,
                                                 backend=backend)
        return f
    return op, (x, kernel, bias, init)


def _conv_split():
    x, kernel, bias, _, seq_idx, _ = make_conv_args(6, seqlen=19, channels=24, seq_idx=[7, 12])
    wide = jnp.concatenate([x[..., :8], x, -x[..., :16]], axis=-1)

    def op(backend):
        def f(x, kernel, bias):
            return jax_mamba2.causal_conv1d_silu_split(x, kernel, bias, channel_offset=8, split=(16, 4, 4),
                                                       seq_idx=seq_idx, pass_through=True, backend=backend)
        return f
    return op, (wide, kernel, bias)


def _rms_norm():
    keys = jax.random.split(jax.random.key(7), 3)
    x, z = jax.random.normal(keys[0], (2, 6, 48)), jax.random.normal(keys[1], (2, 6, 48))
    weight = 1 + 0.1 * jax.random.normal(keys[2], (48,))

    def op(backend):
        def f(x, z, weight):
            return jax_mamba2.rms_norm(x, weight, z, group_size=16, backend=backend)
        return f
    return op, (x, z, weight)


def _add_rms_norm():
    keys = jax.random.split(jax.random.key(8), 3)
    x, residual = jax.random.normal(keys[0], (2, 6, 48)), jax.random.normal(keys[1], (2, 6, 48))
    weight = 1 + 0.1 * jax.random.normal(keys[2], (48,))

    def op(backend):
        def f(x, residual, weight):
            return jax_mamba2.add_rms_norm(x, residual, weight, residual_dtype=jnp.float32, backend=backend)
        return f
    return op, (x, residual, weight)


def _cross_entropy():
    keys = jax.random.split(jax.random.key(9), 3)
    hidden, weight = jax.random.normal(keys[0], (2, 12, 32)), 0.2 * jax.random.normal(keys[1], (32, 100))
    labels = jax.random.randint(keys[2], (2, 12), 0, 90).at[0, 3].set(-100)

    def op(backend):
        def f(hidden, weight):
            return jax_mamba2.chunked_cross_entropy(hidden, labels, head_weight=weight, vocab_size=90, chunk_tokens=8,
                                                    reduction="none", backend=backend)
        return f
    return op, (hidden, weight)


def _norm_project():
    case = PROJECTION_CASES["add_norm_in_proj"]
    a = _jnp(projection_inputs(case, seed=10))

    def op(backend):
        def f(x, residual, norm_weight, weight):
            return jax_mamba2.norm_project(x, weight, norm_weight=norm_weight, residual=residual,
                                           residual_dtype=jnp.float32, layer=case.layer, backend=backend)
        return f
    return op, (a["x"], a["residual"], a["norm_weight"], a["weight"])


def _mixer_step():
    case = MIXER_CASES["gate_in_step"]
    a = _jnp(mixer_inputs(case, seed=11))
    names = ("zxbcdt", "conv_state", "ssm_state", "conv_weight", "A_log", "dt_bias", "D")

    def op(backend):
        def f(zxbcdt, conv_state, ssm_state, conv_weight, A_log, dt_bias, D):
            return jax_mamba2.mixer_step(zxbcdt, conv_state, ssm_state, conv_weight, None, A_log, dt_bias, D,
                                         **case.layout(), layer=case.layer, backend=backend)
        return f
    return op, tuple(a[n] for n in names)


def _project():
    keys = jax.random.split(jax.random.key(12), 2)

    def op(backend):
        assert backend == "xla"  # pure JAX, no backends
        return functools.partial(project, dtype=jnp.float32)
    return op, (jax.random.normal(keys[0], (1, 16)), jax.random.normal(keys[1], (16, 24)))


# name -> () -> (op(backend) -> f(*float args) -> outputs, float args): the first argument has rows to map over.
OPS = {"ssd": _ssd, "ssd_step": _ssd_step, "causal_conv1d_silu": _conv, "causal_conv1d_silu_split": _conv_split,
       "rms_norm": _rms_norm, "add_rms_norm": _add_rms_norm, "chunked_cross_entropy": _cross_entropy,
       "norm_project": _norm_project, "mixer_step": _mixer_step}
KERNEL_OPS = list(OPS)
OPS["project"] = _project
# The ops whose pure-JAX path has a custom VJP (reverse mode only): the SSD's confinement of non-finite values, the
# loss's gradient taken in its forward.
REVERSE_ONLY = {"ssd", "chunked_cross_entropy"}


@pytest.fixture
def kernels_emulated(monkeypatch):
    """backend="cutile" of every op runs its plans on the emulator, as if on a GPU."""
    pytest.importorskip("cuda.tile")
    from jax_mamba2.bridge import conv_ops, decode_ops, loss_ops, norm_ops
    from tests.bridge._emulated_backend import EMULATED, emulate_layer_kernels
    from tests.kernels import _cutile_emulator as emulator

    monkeypatch.setitem(backends._REGISTRY["ssd"], "cutile", dataclasses.replace(EMULATED, name="cutile"))
    monkeypatch.setitem(backends._REGISTRY[conv1d.OP], "cutile", backends.LayerBackend(
        "cutile", conv_ops.ConvKernels("cutile_emulated", emulator.jax_run_plan), backends.always_supported))
    for op, module in ((norm.OP, norm_ops), (cross_entropy.OP, loss_ops), (decode.OP, decode_ops)):
        emulate_layer_kernels(monkeypatch, op, module)


def _loss(f):
    """A scalar of every output, whose cotangents differ from entry to entry."""
    def loss(*args):
        return sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in jax.tree.leaves(f(*args)))
    return loss


def _stack(items):
    return jax.tree.map(lambda *a: jnp.stack(a), *items)


def _assert_close(got, want, tolerance=TOLERANCE):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    errors = [rel_l2(g, w) for g, w in zip(got, want)]
    assert max(errors) < tolerance, errors


def _cases(ops):
    return [pytest.param(name, backend, id=f"{name}-{backend}") for name in ops for backend in ("xla", "cutile")
            if backend == "xla" or name in KERNEL_OPS]


def _backend(request, backend):
    if backend == "cutile":
        request.getfixturevalue("kernels_emulated")
    return backend


@pytest.mark.parametrize("name, backend", _cases(OPS))
def test_vmap_over_a_non_leading_axis_and_the_gradient_of_a_vmapped_loss(request, name, backend):
    """The first argument mapped over its axis 1 (the outputs over their axis 1), its gradients mapped the same way
    with the other arguments shared (whose gradients on the kernels sum each item's apart), and the gradient of a
    weighted sum of the items' losses: each equals a loop over the items."""
    op, args = OPS[name]()
    f, first = op(_backend(request, backend)), args[0]
    items = jnp.stack([first, -0.5 * first])
    mapped = jnp.moveaxis(items, 0, 1)
    got = jax.jit(jax.vmap(lambda a: f(a, *args[1:]), in_axes=1, out_axes=1))(mapped)
    _assert_close(got, jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), _stack([jax.jit(f)(a, *args[1:]) for a in items])))
    argnums = tuple(range(len(args)))
    grad = jax.jit(jax.grad(_loss(f), argnums=argnums))
    got = jax.jit(jax.vmap(lambda a: grad(a, *args[1:]), in_axes=1))(mapped)
    _assert_close(got, _stack([grad(a, *args[1:]) for a in items]))

    def weighted(items, *rest):
        return jnp.sum(jax.vmap(lambda a: _loss(f)(a, *rest))(items) * jnp.array([1.0, -2.0]))
    got = jax.jit(jax.grad(weighted, argnums=argnums))(items, *args[1:])
    first, second = grad(items[0], *args[1:]), grad(items[1], *args[1:])
    _assert_close(got, [jnp.stack([first[0], -2 * second[0]]), *(a - 2 * b for a, b in zip(first[1:], second[1:]))])


@pytest.mark.parametrize("name, backend", _cases(KERNEL_OPS))
def test_remat_that_saves_nothing_and_eval_shape_match_the_plain_gradients(request, name, backend):
    """jax.checkpoint with the nothing_saveable policy (the backward reruns the forward, kernels included) gives the
    gradients of the plain call; jax.eval_shape of the outputs and of the gradients gives the xla path's shapes and
    dtypes (without running a kernel)."""
    op, args = OPS[name]()
    f = op(_backend(request, backend))
    grad = jax.grad(_loss(f), argnums=tuple(range(len(args))))
    remat = jax.grad(jax.checkpoint(_loss(f), policy=jax.checkpoint_policies.nothing_saveable),
                     argnums=tuple(range(len(args))))
    _assert_close(jax.jit(remat)(*args), jax.jit(grad)(*args), 1e-6)
    xla = op("xla")
    for got, want in ((jax.eval_shape(f, *args), jax.eval_shape(xla, *args)),
                      (jax.eval_shape(grad, *args), [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args])):
        assert [(s.shape, s.dtype) for s in jax.tree.leaves(got)] == [(s.shape, s.dtype) for s in jax.tree.leaves(want)]


# (backend, op, argument) of the arguments a path rounds to the activations' dtype.
_KERNEL_ROUNDED = {("cutile", "ssd", i) for i in (3, 4, 6)}


@pytest.mark.parametrize("name, backend", _cases(KERNEL_OPS))
def test_bfloat16_inputs_beside_float32_parameters(request, name, backend):
    """The first argument (the activations) in bfloat16, the others as they are (float32 parameters, states): the
    outputs compute, each gradient comes back in its argument's dtype and near the float32 call's."""
    op, args = OPS[name]()
    f = op(_backend(request, backend))
    mixed = (args[0].astype(jnp.bfloat16), *args[1:])
    jax.jit(f)(*mixed)
    argnums = tuple(range(len(args)))
    got = jax.jit(jax.grad(_loss(f), argnums=argnums))(*mixed)
    assert [g.dtype for g in got] == [a.dtype for a in mixed]
    # The float32 call at the values the path computes with: the SSD's kernels take B, C and z in x's dtype.
    rounded = [a.astype(jnp.bfloat16).astype(a.dtype) if i == 0 or (backend, name, i) in _KERNEL_ROUNDED else a
               for i, a in enumerate(args)]
    _assert_close(got, jax.jit(jax.grad(_loss(op("xla")), argnums=argnums))(*rounded), 5e-2)


@pytest.mark.parametrize("name", list(OPS))
def test_forward_mode_where_the_path_has_it_and_a_type_error_where_not(request, name):
    """jax.jvp and jax.linearize on the pure-JAX path: the tangent of the loss is the gradient's inner product with
    the tangents (the SSD's on "scan", its float64-capable oracle). The xla paths with a custom VJP, and every
    kernel backend, are reverse mode only: JAX raises TypeError naming forward mode."""
    op, args = OPS[name]()
    backend = "scan" if name == "ssd" else "xla"
    tangents = tuple(jax.random.normal(jax.random.key(i), a.shape, a.dtype) for i, a in enumerate(args))
    loss = _loss(op(backend))
    gradient = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)
    want = sum(jnp.vdot(g, t) for g, t in zip(gradient, tangents))
    if name != "chunked_cross_entropy":  # the one op without a pure-JAX path of forward mode
        assert rel_l2(jax.jit(lambda a, t: jax.jvp(loss, a, t)[1])(args, tangents), want) < 1e-5
        assert rel_l2(jax.jit(lambda a, t: jax.linearize(loss, *a)[1](*t))(args, tangents), want) < 1e-5
    reverse_only = ["xla"] if name in REVERSE_ONLY else []
    if name in KERNEL_OPS:
        request.getfixturevalue("kernels_emulated")
        reverse_only.append("cutile")
    for backend in reverse_only:
        with pytest.raises(TypeError, match="forward-mode"):
            jax.jvp(_loss(op(backend)), args, tangents)
