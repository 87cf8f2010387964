"""The decode ops (`jax_mamba2.norm_project`, `mixer_step`) on the CPU: the xla path against the float64 reference
on stacked and single-layer arrays, the layer as an int or a traced array, jit, vmap and grad, the checks that
name the argument, the backend choice ("auto" runs xla without a GPU; a named kernel backend says why not), and
jax.export with a symbolic number of rows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mamba2
from jax_mamba2 import backends
from tests._helpers import rel_l2
from tests.kernels._decode_checks import (MIXER_CASES, PROJECTION_CASES, mixer_inputs, mixer_oracle,
                                          projection_inputs, projection_oracle)

TOLERANCE = {"float32": 2e-6, "bfloat16": 2e-2}


def _jnp(arrays):
    return {k: None if v is None else jnp.asarray(v) for k, v in arrays.items()}


def project(case, arrays, *, layer=None, backend="xla"):
    """norm_project of a case's arrays -> {"out", "residual_out"?}; layer None: the case's layer as one."""
    a = _jnp(arrays)
    if layer is None:  # one layer's arrays, no stacks
        layer_arrays = {k: a[k] if k in ("x", "residual", "z") or a[k] is None else a[k][case.layer]
                        for k in a}
        a, layer = layer_arrays, None
    result = jax_mamba2.norm_project(
        a["x"], a["weight"], norm_weight=a["norm_weight"], residual=a["residual"], z=a["z"], bias=a["bias"],
        eps=1e-5, layer=layer, dtype=a["x"].dtype, backend=backend, **case.kwargs())
    out, residual_out = result if case.residual != "none" else (result, None)
    return {"out": out} if residual_out is None else {"out": out, "residual_out": residual_out}


def step(case, arrays, *, layer=None, backend="xla"):
    a = _jnp(arrays)
    names = ("zxbcdt", "conv_state", "ssm_state", "conv_weight", "conv_bias", "A_log", "dt_bias", "D")
    if layer is None:
        args = [a[n] if n == "zxbcdt" or a[n] is None else a[n][case.layer] for n in names]
    else:
        args = [a[n] for n in names]
    y, ssm_state, conv_state = jax_mamba2.mixer_step(*args, **case.layout(), layer=layer, backend=backend)
    if layer is not None:  # the stack, with the layer's conv state advanced
        conv_state = conv_state[layer]
    return {"y": y, "ssm_state": ssm_state, "new_conv_state": conv_state}


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("name", list(PROJECTION_CASES))
def test_norm_project_xla_matches_float64_reference(name, stacked):
    case = PROJECTION_CASES[name]
    arrays = projection_inputs(case, seed=1)
    got = project(case, arrays, layer=case.layer if stacked else None)
    want = projection_oracle(case, arrays)
    assert set(got) == set(want)
    assert got["out"].dtype == jnp.dtype(case.dtype) and got["out"].shape == want["out"].shape
    assert max(rel_l2(got[k], want[k]) for k in want) < TOLERANCE[case.dtype]


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("name", list(MIXER_CASES))
def test_mixer_step_xla_matches_float64_reference(name, stacked):
    case = MIXER_CASES[name]
    arrays = mixer_inputs(case, seed=2)
    got = step(case, arrays, layer=case.layer if stacked else None)
    want = mixer_oracle(case, arrays)
    if not stacked:
        want["ssm_state"] = want["ssm_state"][case.layer]
    assert got["ssm_state"].dtype == arrays["ssm_state"].dtype
    assert got["new_conv_state"].dtype == arrays["conv_state"].dtype
    assert max(rel_l2(got[k], want[k]) for k in want) < TOLERANCE[case.dtype]


def test_decode_ops_take_numpy_ints_for_their_layout():
    """The layout options (sizes, offsets, group sizes) as NumPy integers give the same step as Python ints."""
    case = MIXER_CASES["gated_norm_mixer"]
    a = _jnp(mixer_inputs(case, seed=3))
    args = [a[n] for n in ("zxbcdt", "conv_state", "ssm_state", "conv_weight", "conv_bias", "A_log", "dt_bias", "D")]
    layout = case.layout()
    numpy_layout = {k: np.int64(v) if isinstance(v, int) else v for k, v in layout.items()}
    for got, want in zip(jax_mamba2.mixer_step(*args, **numpy_layout, layer=case.layer),
                         jax_mamba2.mixer_step(*args, **layout, layer=case.layer)):
        np.testing.assert_array_equal(got, want)
    projection = PROJECTION_CASES["gated_norm_out_proj"]
    p = _jnp(projection_inputs(projection, seed=4))
    kwargs = dict(norm_weight=p["norm_weight"], z=p["z"], group_size=projection.group_size, layer=projection.layer,
                  dtype=p["x"].dtype)
    plain = jax_mamba2.norm_project(p["x"], p["weight"], z_offset=projection.z_offset, **kwargs)
    numpy_ints = jax_mamba2.norm_project(p["x"], p["weight"], z_offset=np.int64(projection.z_offset),
                                         **{**kwargs, "group_size": np.int64(projection.group_size)})
    np.testing.assert_array_equal(numpy_ints, plain)


@pytest.mark.parametrize("backend", ["xla", pytest.param("cutile", marks=pytest.mark.gpu)])
def test_group_windows_apart_leave_b_and_c_to_the_caller(backend):
    """With group_windows_apart the conv-state stack comes back with the layer's x channels advanced and its B and
    C channels as they were, their new windows apart; write_group_windows puts them in: the stack of the plain
    call."""
    if backend == "cutile":
        pytest.importorskip("cuda.tile")
    case = MIXER_CASES["gated_norm_mixer"]
    a = _jnp(mixer_inputs(case, seed=9))
    args = [a[n] for n in ("zxbcdt", "conv_state", "ssm_state", "conv_weight", "conv_bias", "A_log", "dt_bias", "D")]
    plain = jax_mamba2.mixer_step(*args, **case.layout(), layer=case.layer, backend=backend)
    y, ssm_state, conv_state, windows = jax_mamba2.mixer_step(*args, **case.layout(), layer=case.layer,
                                                              group_windows_apart=True, backend=backend)
    d_ssm = case.d_ssm
    assert windows.shape == (case.rows, 2 * case.ngroups * case.dstate, case.d_conv)
    assert windows.dtype == a["conv_state"].dtype
    np.testing.assert_array_equal(conv_state[:, :, d_ssm:], a["conv_state"][:, :, d_ssm:])
    others = np.array([i for i in range(case.layers) if i != case.layer])
    np.testing.assert_array_equal(plain[2][others], a["conv_state"][others])  # no other layer's conv state
    np.testing.assert_array_equal(windows, plain[2][case.layer, :, d_ssm:])
    whole = jax_mamba2.write_group_windows(conv_state, windows[None], d_ssm, case.layer)
    for got, want in zip((y, ssm_state, whole), plain):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="group_windows_apart=True needs the stacks of a `layer`"):
        jax_mamba2.mixer_step(a["zxbcdt"], *(x[0] for x in args[1:]), **case.layout(), group_windows_apart=True)
    layers, rows, conv_dim, d_conv = conv_state.shape
    for bad, message in [
            (dict(first_layer=layers), rf"first_layer={layers} must be in \[0, {layers}\)"),
            (dict(d_ssm=conv_dim), rf"d_ssm={conv_dim} must be in \[0, conv_dim={conv_dim}\)"),
            (dict(group_windows=windows[None, :, 1:]), r"group_windows.shape=.* must be \(n, rows, conv_dim - d_ssm"),
            (dict(conv_state=conv_state[0]), r"conv_state.shape=.* must be \(layers, rows, conv_dim, d_conv\)"),
            (dict(group_windows=jnp.repeat(windows[None], layers + 1, axis=0), first_layer=0),
             rf"group_windows.shape\[0\]={layers + 1} \(its layers\) must be at most conv_state.shape\[0\]={layers}")]:
        call = {**dict(conv_state=conv_state, group_windows=windows[None], d_ssm=d_ssm, first_layer=case.layer), **bad}
        with pytest.raises(ValueError, match="write_group_windows: " + message):
            jax_mamba2.write_group_windows(**call)
    for bad, message in [(dict(d_ssm=1.5), r"d_ssm=1.5 must be an int"),
                         (dict(first_layer=1.7), r"first_layer=1.7 must be an int or an integer scalar array"),
                         (dict(first_layer=jnp.array([1, 2])), r"first_layer=.* must be an int or an integer scalar")]:
        call = {**dict(conv_state=conv_state, group_windows=windows[None], d_ssm=d_ssm, first_layer=case.layer), **bad}
        with pytest.raises(TypeError, match="write_group_windows: " + message):
            jax_mamba2.write_group_windows(**call)
    # integer scalars of NumPy and JAX are ints here
    np.testing.assert_array_equal(jax_mamba2.write_group_windows(conv_state, windows[None], jnp.int32(d_ssm),
                                                                 np.int64(case.layer)), whole)


def test_a_traced_layer_picks_the_same_layer_as_an_int():
    case = PROJECTION_CASES["add_norm_in_proj"]
    arrays = _jnp(projection_inputs(case, seed=3))

    @jax.jit
    def traced(layer):
        return jax_mamba2.norm_project(arrays["x"], arrays["weight"], norm_weight=arrays["norm_weight"],
                                       residual=arrays["residual"], residual_dtype=jnp.float32, layer=layer)
    for layer in range(case.layers):
        want = project(case, projection_inputs(case, seed=3), layer=layer)
        got = traced(jnp.int32(layer))
        np.testing.assert_allclose(got[0], want["out"], rtol=1e-6, atol=1e-6)

    mixer = MIXER_CASES["gated_norm_mixer"]
    m = _jnp(mixer_inputs(mixer, seed=4))
    run = jax.jit(lambda layer: jax_mamba2.mixer_step(
        m["zxbcdt"], m["conv_state"], m["ssm_state"], m["conv_weight"], m["conv_bias"], m["A_log"], m["dt_bias"],
        m["D"], **mixer.layout(), layer=layer))
    y, state, conv = run(jnp.int32(2))
    for got, want in zip((y, state, conv[2]), step(mixer, mixer_inputs(mixer, seed=4), layer=2).values()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_vmap_over_rows_equals_the_loop():
    case = PROJECTION_CASES["gated_norm_out_proj"]
    a = _jnp(projection_inputs(case, seed=5))
    xs = jnp.stack([a["x"], 2 * a["x"]])
    zs = jnp.stack([a["z"], -a["z"]])

    def one(x, z):
        return jax_mamba2.norm_project(x, a["weight"], norm_weight=a["norm_weight"], z=z, layer=case.layer,
                                       **{k: v for k, v in case.kwargs().items() if k != "residual_dtype"})
    batched = jax.vmap(one)(xs, zs)
    for i in range(2):
        np.testing.assert_allclose(batched[i], one(xs[i], zs[i]), rtol=1e-6, atol=1e-6)


def test_gradients_flow_through_both_ops():
    case = PROJECTION_CASES["add_norm_in_proj"]
    a = _jnp(projection_inputs(case, seed=6))

    def loss(x, weight):
        out, h = jax_mamba2.norm_project(x, weight, norm_weight=a["norm_weight"], residual=a["residual"],
                                         residual_dtype=jnp.float32, layer=1)
        return jnp.sum(out ** 2) + jnp.sum(h)
    dx, dweight = jax.grad(loss, argnums=(0, 1))(a["x"], a["weight"])
    assert jnp.all(jnp.isfinite(dx)) and jnp.abs(dweight[1]).sum() > 0 and jnp.abs(dweight[0]).sum() == 0

    mixer = MIXER_CASES["gated_norm_mixer"]
    m = _jnp(mixer_inputs(mixer, seed=7))

    def mixer_loss(zxbcdt, ssm_state):
        y, state, conv = jax_mamba2.mixer_step(zxbcdt, m["conv_state"], ssm_state, m["conv_weight"],
                                               m["conv_bias"], m["A_log"], m["dt_bias"], m["D"], **mixer.layout(),
                                               layer=1)
        return jnp.sum(y ** 2) + jnp.sum(state[1] ** 2) + jnp.sum(conv)
    dz, dstate = jax.grad(mixer_loss, argnums=(0, 1))(m["zxbcdt"], m["ssm_state"])
    assert jnp.abs(dz).sum() > 0 and jnp.abs(dstate[1]).sum() > 0
    np.testing.assert_array_equal(dstate[0], 0)  # only layer 1's state is read


def test_auto_runs_xla_without_a_gpu_and_a_named_kernel_backend_says_why():
    case = PROJECTION_CASES["plain_with_bias"]
    arrays = projection_inputs(case, seed=8)
    np.testing.assert_array_equal(project(case, arrays, backend="auto")["out"],
                                  project(case, arrays, backend="xla")["out"])
    if backends.backend_status()["cutile"].runnable:
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match=r"norm_project\(backend='cutile'\)"):
        project(case, arrays, backend="cutile")
    mixer = MIXER_CASES["gated_norm_mixer"]
    with pytest.raises(ValueError, match=r"mixer_step\(backend='cutile'\)"):
        step(mixer, mixer_inputs(mixer, seed=8), backend="cutile")


def test_auto_exports_with_a_symbolic_number_of_rows():
    """jax.export with the rows a symbolic dimension: "auto" runs xla (the kernels, compiled per shape, cannot take
    it, and their checks cannot compare it), and the exported programs equal the direct calls at two row counts."""
    case = PROJECTION_CASES["add_norm_in_proj"]
    p = _jnp(projection_inputs(case, seed=10))
    mixer = MIXER_CASES["gated_norm_mixer"]
    m = _jnp(mixer_inputs(mixer, seed=10))
    rows, = jax.export.symbolic_shape("rows")

    def decode(x, residual, zxbcdt, conv_state, ssm_state):
        out, h = jax_mamba2.norm_project(x, p["weight"], norm_weight=p["norm_weight"], residual=residual,
                                         residual_dtype=jnp.float32, layer=case.layer)
        return (out, h, *jax_mamba2.mixer_step(zxbcdt, conv_state, ssm_state, m["conv_weight"], m["conv_bias"],
                                               m["A_log"], m["dt_bias"], m["D"], **mixer.layout(), layer=mixer.layer))

    arrays = (p["x"], p["residual"], m["zxbcdt"], m["conv_state"], m["ssm_state"])
    row_axes = (0, 0, 0, 1, 1)
    shapes = [jax.ShapeDtypeStruct(a.shape[:i] + (rows,) + a.shape[i + 1:], a.dtype) for a, i in zip(arrays, row_axes)]
    exported = jax.export.deserialize(jax.export.export(jax.jit(decode))(*shapes).serialize())
    for n in (2, 1):
        args = [jax.lax.slice_in_dim(a, 0, n, axis=i) for a, i in zip(arrays, row_axes)]
        for got, want in zip(exported.call(*args), decode(*args)):
            assert got.shape == want.shape and rel_l2(got, want) < 1e-6


def _projection_args():
    case = PROJECTION_CASES["add_norm_in_proj"]
    return _jnp(projection_inputs(case, seed=9))


@pytest.mark.parametrize("change, error, message", [
    (dict(x=jnp.ones((3,))), ValueError, r"x.shape=\(3,\) must be \(rows, features\)"),
    (dict(x=jnp.ones((3, 64), jnp.int32)), TypeError, "x.dtype=int32"),
    (dict(weight=jnp.ones((3, 63, 200))), ValueError, "features=64"),
    (dict(norm_weight=jnp.ones((3, 63))), ValueError, "norm_weight.shape"),
    (dict(residual_dtype=None), ValueError, "residual needs residual_dtype"),
    (dict(layer=3), ValueError, r"layer=3 must be in \[0, 3\)"),
    (dict(layer=1.0), TypeError, "layer=1.0 must be an int"),
    (dict(group_size=48), ValueError, "group_size=48 must be a positive divisor"),
    (dict(group_size=32, norm_weight=None, residual=None, residual_dtype=None), ValueError,
     "group_size groups the norm's features and needs norm_weight"),
    (dict(z=jnp.ones((3, 60))), ValueError, "z.shape"),
    (dict(bias=jnp.ones((200,))), ValueError, "bias.shape"),
    (dict(eps=0.0), ValueError, "eps=0.0 must be a positive finite float"),
    (dict(eps=True), TypeError, "eps=True must be a positive finite float"),
    (dict(eps=float("inf")), ValueError, "eps=inf must be"),
    (dict(eps="1e-5"), TypeError, "eps='1e-5' must be"),
    (dict(dtype=jnp.int8), TypeError, "dtype=int8"),
    (dict(backend="triton"), ValueError, "backend='triton' must be one of"),
    (dict(x=jnp.ones((2, 3, 64))), ValueError, "partial sums needs x_dtype"),
    (dict(x=jnp.ones((2, 3, 64), jnp.bfloat16), x_dtype=jnp.float32), TypeError, "must be float32"),
    (dict(x_dtype=jnp.float32), ValueError, "x_dtype=.* is for x given as partial sums"),
    (dict(return_partials=1), TypeError, "return_partials"),
    (dict(transpose_weight="yes"), TypeError, "transpose_weight='yes' must be a bool"),  # before the shape it reads
    (dict(x=jnp.ones((3, 0)), weight=jnp.ones((3, 0, 8)), norm_weight=None, residual=None, residual_dtype=None),
     ValueError, r"norm_project: x.shape=\(3, 0\) must have features >= 1"),
])
def test_norm_project_checks_name_the_argument(change, error, message):
    a = _projection_args()
    kwargs = dict(norm_weight=a["norm_weight"], residual=a["residual"], residual_dtype=jnp.float32, layer=1)
    kwargs.update({k: v for k, v in change.items() if k not in ("x", "weight")})
    with pytest.raises(error, match=message):
        jax_mamba2.norm_project(change.get("x", a["x"]), change.get("weight", a["weight"]), **kwargs)


@pytest.mark.parametrize("change, error, message", [
    (dict(nheads=6), ValueError, "nheads=6 must be a multiple of ngroups=4"),
    (dict(headdim=0), ValueError, "headdim=0 must be a positive int"),
    (dict(headdim=32.0), TypeError, "headdim=32.0 must be a positive int"),
    (dict(z_offset=1.5), TypeError, "z_offset=1.5 must be None or a non-negative int"),
    (dict(dt_offset=10_000), ValueError, r"dt's columns \[10000, 10004\) must lie inside"),
    (dict(z_offset=-1), ValueError, "z_offset=-1"),
    (dict(dt_limit=(0.5, 0.1)), ValueError, "dt_limit"),
    (dict(ssm_state=jnp.ones((3, 2, 4, 32, 16))), ValueError, "ssm_state.shape"),
    (dict(conv_state=jnp.ones((3, 2, 10, 4))), ValueError, "conv_state.shape"),
    (dict(conv_state=jnp.ones((3, 2, 384, 0)), conv_weight=jnp.ones((3, 0, 384))), ValueError,
     r"conv_state.shape=\(3, 2, 384, 0\) must have d_conv >= 1"),
    (dict(D=jnp.ones((3, 5))), ValueError, "D.shape"),
    (dict(A_log=jnp.ones((3, 4), jnp.int32)), TypeError, "A_log.dtype=int32"),
    (dict(layer=jnp.ones((2,), jnp.int32)), TypeError, "must be an int or an integer scalar array"),
    (dict(layer=jnp.ones((1,), jnp.int32)), TypeError, "must be an int or an integer scalar array"),
    (dict(layer=jnp.int32(5)), ValueError, r"mixer_step: layer=5 must be in \[0, 3\)"),
    (dict(conv_weight=jnp.float32(1.0)), ValueError, r"mixer_step: conv_weight.shape=\(\) must be \(layers, d_conv"),
    (dict(layer=jnp.array(-2)), ValueError, r"mixer_step: layer=-2 must be in \[0, 3\)"),
])
def test_mixer_step_checks_name_the_argument(change, error, message):
    case = MIXER_CASES["one_head_per_group"]
    a = _jnp(mixer_inputs(case, seed=10))
    layout = {**case.layout(), **{k: v for k, v in change.items() if k in case.layout()}}
    arrays = {k: change.get(k, a[k]) for k in a}
    with pytest.raises(error, match=message):
        jax_mamba2.mixer_step(arrays["zxbcdt"], arrays["conv_state"], arrays["ssm_state"], arrays["conv_weight"],
                              arrays["conv_bias"], arrays["A_log"], arrays["dt_bias"], arrays["D"], **layout,
                              layer=change.get("layer", 0))


def test_partial_sums_out_and_in_give_the_projections_values():
    """return_partials gives out_proj's output as float32 partial sums (one on xla) that round to out exactly; the
    next projection takes them as x (x_dtype: their sum's dtype) and returns what it returns for out itself."""
    out_case, in_case = PROJECTION_CASES["gated_norm_out_proj"], PROJECTION_CASES["add_norm_in_proj"]
    a, b = _jnp(projection_inputs(out_case, seed=41)), _jnp(projection_inputs(in_case, seed=42))
    gated = dict(norm_weight=a["norm_weight"], z=a["z"], eps=1e-5, layer=out_case.layer, dtype=jnp.bfloat16,
                 **out_case.kwargs())
    x = jnp.asarray(a["x"], jnp.bfloat16)
    out = jax_mamba2.norm_project(x, a["weight"], **gated)
    parts = jax_mamba2.norm_project(x, a["weight"], **gated, return_partials=True)
    assert parts.shape == (1, *out.shape) and parts.dtype == jnp.float32 and out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(parts.sum(axis=0).astype(out.dtype), np.float32),
                                  np.asarray(out, np.float32))
    weight = b["weight"][:, :48]  # in_proj of out_proj's 48 features
    nxt = dict(norm_weight=b["norm_weight"][:, :48], residual=b["residual"][:, :48], residual_dtype=jnp.float32,
               layer=in_case.layer)
    want = jax_mamba2.norm_project(out, weight, **nxt)
    split = jnp.stack([parts[0] - 1.0, jnp.ones_like(parts[0])])  # two parts, the same sum
    for given in (parts, split):
        got = jax_mamba2.norm_project(given, weight, **nxt, x_dtype=jnp.bfloat16)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-6, atol=1e-6)


def gated_norm_chain(case, arrays, *, norm_before_gate, group_size, backend="xla", use_sums=True):
    """The mixer step (with the gated norm's gate, norm_z_offset=0) and out_proj's gated norm + product on its y:
    (sum_squares, out). With use_sums, out_proj takes the step's sums of squares."""
    a = _jnp(arrays)
    names = ("zxbcdt", "conv_state", "ssm_state", "conv_weight", "conv_bias", "A_log", "dt_bias", "D")
    y, _, _, sums = jax_mamba2.mixer_step(*(a[n] for n in names), **{**case.layout(), "z_offset": None},
                                          norm_z_offset=0, norm_group_size=group_size,
                                          norm_before_gate=norm_before_gate, layer=case.layer, backend=backend)
    keys = jax.random.split(jax.random.key(43), 2)
    norm_weight = 1 + 0.5 * jax.random.normal(keys[0], (case.layers, case.d_ssm))
    weight = jax.random.normal(keys[1], (case.layers, case.d_ssm, 40)) / np.sqrt(case.d_ssm)
    if use_sums:  # y is the norm's input: gated unless the gate follows the norm
        z = a["zxbcdt"] if norm_before_gate else None
    else:  # the norm gates and sums y (in zxbcdt's dtype) itself
        y, z = step(case, arrays, layer=case.layer, backend=backend)["y"], a["zxbcdt"]
    out = jax_mamba2.norm_project(y, weight, norm_weight=norm_weight, z=z, z_offset=0, group_size=group_size,
                                  norm_before_gate=norm_before_gate, layer=case.layer,
                                  sum_squares=sums if use_sums else None, dtype=a["zxbcdt"].dtype, backend=backend)
    return sums, out


@pytest.mark.parametrize("norm_before_gate, group_size", [(False, 64), (True, 128), (False, 16)])
def test_the_mixer_s_sums_of_squares_give_out_proj_its_norm(norm_before_gate, group_size):
    """mixer_step(norm_z_offset=...) returns the gated norm's input (y gated by silu(z) unless norm_before_gate, in
    float32) and its sums of squares per group; norm_project given them (sum_squares) returns what it computes from
    y itself."""
    case = MIXER_CASES["gated_norm_mixer"]
    arrays = mixer_inputs(case, seed=44)
    sums, out = gated_norm_chain(case, arrays, norm_before_gate=norm_before_gate, group_size=group_size)
    y = step(case, arrays, layer=case.layer)["y"]
    z = jnp.asarray(arrays["zxbcdt"])[:, :case.d_ssm]
    gated = y if norm_before_gate else y * jax.nn.silu(z)
    a = _jnp(arrays)
    names = ("zxbcdt", "conv_state", "ssm_state", "conv_weight", "conv_bias", "A_log", "dt_bias", "D")
    norm_input = jax_mamba2.mixer_step(*(a[n] for n in names), **{**case.layout(), "z_offset": None},
                                       norm_z_offset=0, norm_group_size=group_size,
                                       norm_before_gate=norm_before_gate, layer=case.layer)[0]
    assert norm_input.dtype == jnp.float32
    np.testing.assert_allclose(norm_input, gated, rtol=1e-6, atol=1e-7)
    assert sums.shape == (case.rows, case.d_ssm // group_size) and sums.dtype == jnp.float32
    np.testing.assert_allclose(sums, jnp.square(gated).reshape(case.rows, -1, group_size).sum(-1), rtol=1e-6)
    _, itself = gated_norm_chain(case, arrays, norm_before_gate=norm_before_gate, group_size=group_size,
                                 use_sums=False)
    np.testing.assert_allclose(out, itself, rtol=1e-5, atol=1e-6)


def test_sum_squares_and_norm_z_offset_checks_name_the_argument():
    case = MIXER_CASES["gated_norm_mixer"]
    a = _jnp(mixer_inputs(case, seed=45))
    args = [a[n] for n in ("zxbcdt", "conv_state", "ssm_state", "conv_weight", "conv_bias", "A_log", "dt_bias", "D")]
    layout = {**case.layout(), "z_offset": None}
    with pytest.raises(ValueError, match="norm_z_offset=0 .* with no gate in the step"):
        jax_mamba2.mixer_step(*args, **{**layout, "z_offset": 0}, norm_z_offset=0, layer=1)
    with pytest.raises(ValueError, match="norm_group_size=24 must be a multiple of headdim=16"):
        jax_mamba2.mixer_step(*args, **layout, norm_z_offset=0, norm_group_size=24, layer=1)
    with pytest.raises(ValueError, match="describe the norm of norm_z_offset"):
        jax_mamba2.mixer_step(*args, **layout, norm_before_gate=True, layer=1)
    x, weight, norm_weight = jnp.ones((2, 64)), jnp.ones((64, 8)), jnp.ones((64,))
    with pytest.raises(TypeError, match="sum_squares must be float32"):
        jax_mamba2.norm_project(x, weight, norm_weight=norm_weight, sum_squares=jnp.ones((2, 4), jnp.bfloat16))
    for parts in (3, 0):  # no parts at all would read as a zero norm
        with pytest.raises(ValueError, match=rf"sum_squares.shape=\(2, {parts}\) must be \(rows=2, a positive multiple "
                                             r"of the norm's 2"):
            jax_mamba2.norm_project(x, weight, norm_weight=norm_weight, group_size=32,
                                    sum_squares=jnp.ones((2, parts)))
    with pytest.raises(ValueError, match="sum_squares are the statistics of a norm"):
        jax_mamba2.norm_project(x, weight, sum_squares=jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="sum_squares are the statistics of a norm"):
        jax_mamba2.norm_project(x, weight, norm_weight=norm_weight, residual_dtype=jnp.float32,
                                sum_squares=jnp.ones((2, 4)))


def test_gradients_through_the_sums_of_squares_are_the_norm_s():
    """The sums of squares are a function of y and z like the norm's own statistics: the gradient of out_proj's
    output through the mixer step and norm_project(sum_squares=...) is the one without them."""
    case = MIXER_CASES["gated_norm_mixer"]
    arrays = mixer_inputs(case, seed=48)

    def loss(zxbcdt, use_sums):
        _, out = gated_norm_chain(case, {**arrays, "zxbcdt": zxbcdt}, norm_before_gate=False, group_size=64,
                                  use_sums=use_sums)
        return jnp.sum(jnp.sin(out))
    zxbcdt = jnp.asarray(arrays["zxbcdt"])
    with_sums, without = (jax.grad(loss)(zxbcdt, use_sums) for use_sums in (True, False))
    assert float(jnp.abs(with_sums).max()) > 0
    np.testing.assert_allclose(with_sums, without, rtol=1e-4, atol=1e-5)
