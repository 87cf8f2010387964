"""NaN and inf through the cuTile backend, on the NumPy emulator (CPU) and on the GPU, against the float64
scan (see tests/_nonfinite_checks.py).

The kernels alone do not confine a non-finite value to its sequence: they mix the tokens of a 64-token
chunk in matrix products, where a token's 0 weight times another's NaN is NaN. The op runs them on the finite
part of their inputs (and in the backward of their cotangents) and adds a per-(token, head) term that is NaN
where the recurrence carries a non-finite input (jax_mamba2/op.py), so through `ssd` a NaN stays where the
recurrence puts it, and an all-finite call returns the kernels' outputs themselves.
"""
import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import AxisType, PartitionSpec as P

import jax_mamba2

pytest.importorskip("cuda.tile")

from jax_mamba2 import backends, op, reference  # noqa: E402
from jax_mamba2.bridge import ops  # noqa: E402
from tests._helpers import TOLERANCE  # noqa: E402
from tests._nonfinite_checks import FLOAT_ARGS, SPOILS, Spoil, assert_confined_like_scan, \
    assert_d_gradient_takes_the_finite_part, assert_negative_step_confined_like_a_nonfinite_dt, \
    assert_packed_reproduction_confined, make_problem, outputs_and_grads, scan_oracle  # noqa: E402
from tests.bridge._emulated_backend import EMULATED  # noqa: E402
from tests.kernels import _cutile_emulator as emulator  # noqa: E402

CASES = ["x_nan", "x_inf", "dt_nan", "dt_inf", "B_nan", "C_nan", "z_nan", "initial_states_nan",
         "cotangent_nan"]
EMULATED_TOLERANCE = 1e-4  # float64 kernels, float32 arrays between them and XLA
# On the GPU the kernels' float32 products take TF32 operands (as mamba_ssm's Triton dots): the summed per-head
# gradients (dA) of the kernels or of an xla path at the GPU's default precision land near 7e-3 of the scan's.
GPU_TOLERANCE = 2 * TOLERANCE["kernel_bwd"]["float32"]


@pytest.fixture(autouse=True)
def _register_emulated(monkeypatch):
    monkeypatch.setitem(backends._REGISTRY["ssd"], EMULATED.name, EMULATED)


EMULATED_SSD = functools.partial(jax_mamba2.ssd, chunk_size=64, return_final_states=True, backend=EMULATED.name)
CUTILE_SSD = functools.partial(jax_mamba2.ssd, chunk_size=64, return_final_states=True, backend="cutile")
CALLBACK_SSD = functools.partial(jax_mamba2.ssd, chunk_size=64, return_final_states=True,
                                 backend="cutile_callback")


def _check_confined(ssd_fn, spoil, tolerance, *, segmented=True, seed=0):
    inputs, weights = make_problem(seed, segmented=segmented, spoil=spoil)
    got = outputs_and_grads(ssd_fn, inputs, weights, nonlinear=True)
    spoiled = {} if spoil.name == "weight_y" else {spoil.name: spoil.index}
    assert_confined_like_scan(got, scan_oracle(inputs, weights, nonlinear=True), spoiled, tolerance,
                              inputs["seq_idx"])
    return got


def _remat_ssd(*args, **kwargs):
    return jax.checkpoint(lambda *a: EMULATED_SSD(*a, **kwargs))(*args)


def _sharded_ssd(x, dt, A, B, C, *, D, z, dt_bias, initial_states, seq_idx, **static):
    """The batch rows on two devices: the finite parts and the reach term run per shard."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))

    def per_shard(x, dt, B, C, z, initial_states, seq_idx):
        return EMULATED_SSD(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                            seq_idx=seq_idx, **static)
    return jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(
        x, dt, B, C, z, initial_states, seq_idx)


@pytest.mark.parametrize("case", CASES)
def test_emulated_cutile_confines_nonfinite_values_like_the_scan(case):
    _check_confined(EMULATED_SSD, SPOILS[case], EMULATED_TOLERANCE)


@pytest.mark.parametrize("nonlinear", [False, True], ids=["linear_loss", "sin_loss"])
def test_emulated_cutile_d_gradient_takes_the_finite_part_of_a_nonfinite_x(nonlinear):
    """The kernels' D gradient, of the finite part of x and of the cotangents, which the xla path's matches."""
    assert_d_gradient_takes_the_finite_part(EMULATED_SSD, EMULATED_TOLERANCE, nonlinear=nonlinear)


def test_emulated_cutile_negative_step_under_jit_is_a_nonfinite_dt_as_on_the_scan():
    """The confinement takes a negative Δ as NaN, so the kernels, which clamp decays to exp(<= 0) as the xla
    path, agree with the scan and the xla path there."""
    assert_negative_step_confined_like_a_nonfinite_dt(EMULATED_SSD, EMULATED_TOLERANCE)


@pytest.mark.parametrize("ssd_fn", [_remat_ssd, _sharded_ssd], ids=["remat", "shard_map"])
def test_emulated_cutile_confines_nonfinite_values_under_remat_and_shard_map(ssd_fn):
    _check_confined(ssd_fn, SPOILS["x_nan"], EMULATED_TOLERANCE)


def test_emulated_cutile_nan_without_seq_idx_spares_the_earlier_tokens_of_its_chunk():
    spoil = Spoil("x", (1, 37, 0, 0))  # inside the kernels' first 64-token chunk
    (y, _), _ = _check_confined(EMULATED_SSD, spoil, EMULATED_TOLERANCE, segmented=False, seed=1)
    assert np.isfinite(np.asarray(y[1, :37])).all() and not np.isfinite(np.asarray(y[1, 37:, 0])).any()
    assert np.isfinite(np.asarray(y[0])).all()


def test_emulated_cutile_nan_in_one_packed_sequence_leaves_the_next_finite():
    """The reproduction of the issue's packed-sequence leak (`assert_packed_reproduction_confined`)."""
    assert_packed_reproduction_confined(EMULATED_SSD, headdim=16, dstate=16)


def _equations(jaxpr):
    """Every equation of a (closed) jaxpr, its sub-jaxprs' included."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _equations(sub)


def _primitives(jaxpr) -> set:
    """The names of every primitive in a (closed) jaxpr, its sub-jaxprs included."""
    return {eqn.primitive.name for eqn in _equations(jaxpr)}


def _kernel_outputs_and_grads(inputs, weights):
    """The emulated kernels' forward and backward called directly (no finite parts, no reach term), as
    `outputs_and_grads`."""
    static = op.SSDStatic(64, True, (0.0, float("inf")))
    float_args = {name: inputs[name] for name in FLOAT_ARGS}
    ssd_inputs = op.SSDInputs(**float_args, seq_idx=inputs["seq_idx"])
    outputs = EMULATED.forward(ssd_inputs, static)
    (y, final), saved = EMULATED.forward_saving(ssd_inputs, static)
    grads = EMULATED.backward(ssd_inputs, static, jnp.cos(y) * weights["y"], jnp.cos(final) * weights["final"],
                              saved)
    return outputs, {name: getattr(grads, name) for name in FLOAT_ARGS}


def test_emulated_cutile_all_finite_call_returns_the_kernels_outputs_bit_for_bit():
    """An all-finite call gets the kernels' own outputs and gradients (the reach term adds exact zeros), not
    the xla path's (which differ from them in rounding); the program holds no conditional."""
    inputs, weights = make_problem(2)
    got = outputs_and_grads(EMULATED_SSD, inputs, weights, nonlinear=True)
    kernels = jax.jit(_kernel_outputs_and_grads)(inputs, weights)
    xla = outputs_and_grads(functools.partial(EMULATED_SSD, backend="xla", chunk_size=64), inputs, weights,
                            nonlinear=True)
    for got_leaf, kernel_leaf, xla_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(kernels),
                                               jax.tree.leaves(xla)):
        np.testing.assert_array_equal(got_leaf, kernel_leaf)
        assert np.isfinite(np.asarray(got_leaf)).all()
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(xla)))
    program = jax.make_jaxpr(functools.partial(outputs_and_grads, EMULATED_SSD, nonlinear=True))(inputs, weights)
    assert "cond" not in _primitives(program.jaxpr)


def test_emulated_cutile_backward_checks_its_cotangents_and_not_the_inputs_again():
    """The gradient's program tests x, B and C for finiteness once each (their finite parts, in the forward)
    and the cotangent of y (x's shape) once (in the backward): the backward keeps the forward's finite parts."""
    inputs, _ = make_problem(4)

    def loss(x, dt, A, B, C):
        y, final = EMULATED_SSD(x, dt, A, B, C, D=inputs["D"], dt_bias=inputs["dt_bias"], dt_softplus=True,
                                seq_idx=inputs["seq_idx"])
        return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.sin(final))
    program = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*(inputs[n] for n in ("x", "dt", "A", "B", "C")))
    checked = [eqn.invars[0].aval.shape for eqn in _equations(program.jaxpr) if eqn.primitive.name == "is_finite"]
    assert checked.count(inputs["x"].shape) == 2, checked  # x, then dy
    assert checked.count(inputs["B"].shape) == 2, checked  # B and C


def test_emulated_cutile_confinement_leaves_y_and_dx_to_the_kernels():
    """Against the unconfined program, the confinement's gradient program adds x-sized XLA ops only for the finite
    parts of x and of dy (a select each) and x's marks: no x-sized addition, so the reach term reaches y and its
    VJP dx inside the kernels that write them, not in passes over y and dx."""
    x = jnp.ones((2, 64, 4, 16), jnp.bfloat16)
    dt, A, B = jnp.ones((2, 64, 4)), -jnp.ones((4,)), jnp.ones((2, 64, 1, 16), jnp.bfloat16)

    def x_sized_ops(check_finite):
        def objective(x):
            y = EMULATED_SSD(x, dt, A, B, B, dt_softplus=True, check_finite=check_finite)[0]
            return jnp.sum(y.astype(jnp.float32) ** 2)
        program = jax.make_jaxpr(jax.grad(objective))(x)
        return collections.Counter(eqn.primitive.name for eqn in _equations(program.jaxpr)
                                   if any(getattr(v.aval, "shape", None) == x.shape for v in eqn.outvars))

    added = x_sized_ops(True) - x_sized_ops(False)
    assert added["select_n"] == 2 and added["is_finite"] == 2, added
    assert not {"add", "add_any", "sub"} & set(added), added


def test_emulated_cutile_vmap_confines_per_item():
    """Under vmap a NaN in one item stays where the scan puts it while the other item matches its own call."""
    clean, _ = make_problem(3)
    spoiled, _ = make_problem(3, spoil=SPOILS["x_nan"])
    stacked = jax.tree.map(lambda *a: None if a[0] is None else jnp.stack(a), clean, spoiled,
                           is_leaf=lambda v: v is None)

    def run(inputs):
        return EMULATED_SSD(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], D=inputs["D"],
                            z=inputs["z"], dt_bias=inputs["dt_bias"], dt_softplus=True,
                            initial_states=inputs["initial_states"], seq_idx=inputs["seq_idx"])

    mapped = jax.jit(jax.vmap(run))
    y, final = mapped(stacked)
    for i, item in enumerate((clean, spoiled)):
        want_y, want_final = jax.jit(run)(item)
        np.testing.assert_array_equal(np.isfinite(y[i]), np.isfinite(want_y))
        np.testing.assert_array_equal(np.isfinite(final[i]), np.isfinite(want_final))
        finite = np.isfinite(np.asarray(want_y))
        np.testing.assert_allclose(np.asarray(y[i])[finite], np.asarray(want_y)[finite], rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(y[0])).all() and not np.isfinite(np.asarray(y[1])).all()


def test_emulated_cutile_vmap_of_the_gradient_confines_per_item():
    """Under vmap of the gradient (the reach term and its share of dx mapped with the items) each item's
    gradients are those of its own call: the clean item's bit for bit, the spoiled one's non-finite where its
    own are."""
    clean, weights = make_problem(5)
    spoiled, _ = make_problem(5, spoil=SPOILS["cotangent_nan"])
    spoiled = dict(spoiled, x=spoiled["x"].at[0, 27, 1, 3].set(jnp.nan))
    stacked = {name: None if clean[name] is None else jnp.stack([clean[name], spoiled[name]]) for name in clean}

    def grads(inputs):
        def objective(x, dt, B, C):
            y, final = EMULATED_SSD(x, dt, inputs["A"], B, C, D=inputs["D"], z=inputs["z"],
                                    dt_bias=inputs["dt_bias"], dt_softplus=True,
                                    initial_states=inputs["initial_states"], seq_idx=inputs["seq_idx"])
            return jnp.sum(jnp.sin(y) * weights["y"]) + jnp.sum(final * weights["final"])
        return jax.grad(objective, argnums=(0, 1, 2, 3))(inputs["x"], inputs["dt"], inputs["B"], inputs["C"])

    mapped = jax.jit(jax.vmap(grads))(stacked)
    for i, item in enumerate((clean, spoiled)):
        for got, want in zip(mapped, jax.jit(grads)(item)):
            got, want = np.asarray(got[i]), np.asarray(want)
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
            if i == 0:
                np.testing.assert_array_equal(got, want)
            np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)
    assert all(np.isfinite(np.asarray(g[0])).all() for g in mapped)
    assert not np.isfinite(np.asarray(mapped[0][1])).all()


@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.01, 0.5)], ids=["no_limit", "dt_limit"])
def test_emulated_cutile_step_keeps_a_nonfinite_value_in_its_batch_row_and_head(dt_limit):
    """The decode kernel computes each (batch row, head) on its own: a NaN time step of one head of row 0
    stays in that head's y and state, exactly where the reference step puts it; also through the clip of a
    dt_limit (whose min and max, cuTile's, would return the bound for a NaN unless told to propagate it)."""
    keys = jax.random.split(jax.random.PRNGKey(4), 6)
    batch, nheads, headdim, ngroups, dstate = 2, 4, 16, 2, 16
    state = jax.random.normal(keys[0], (batch, nheads, headdim, dstate))
    x = jax.random.normal(keys[1], (batch, nheads, headdim))
    dt = jax.random.uniform(keys[2], (batch, nheads), minval=-3.0, maxval=1.0).at[0, 1].set(jnp.nan)
    A = -jnp.exp(jax.random.uniform(keys[3], (nheads,), minval=-2.0, maxval=1.0))
    B, C = (jax.random.normal(k, (batch, ngroups, dstate)) for k in keys[4:])
    args = (state, x, dt, A, B, C, jnp.ones((nheads,)), None, None, True, dt_limit)
    y, new_state = jax.jit(lambda *a: ops.make_step(emulator.jax_run_plan)(*a, *args[9:]))(*args[:9])
    want_y, want_state = reference.ssd_step(*args[:6], D=args[6], dt_softplus=True, dt_limit=dt_limit)
    for got, want in ((y, want_y), (new_state, want_state)):
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        assert not np.isfinite(want[0, 1]).any() and np.isfinite(np.delete(want, 1, axis=1)).all()
        np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("ssd_fn", [CUTILE_SSD, CALLBACK_SSD], ids=["cutile", "cutile_callback"])
@pytest.mark.parametrize("case", CASES)
def test_cutile_confines_nonfinite_values_like_the_scan(case, ssd_fn):
    _check_confined(ssd_fn, SPOILS[case], GPU_TOLERANCE)


@pytest.mark.gpu
def test_cutile_nan_without_seq_idx_spares_the_earlier_tokens_of_its_chunk():
    spoil = Spoil("x", (1, 37, 0, 0))
    (y, _), _ = _check_confined(CUTILE_SSD, spoil, GPU_TOLERANCE, segmented=False, seed=1)
    assert np.isfinite(np.asarray(y[1, :37])).all() and not np.isfinite(np.asarray(y[1, 37:, 0])).any()


@pytest.mark.gpu
def test_cutile_all_finite_call_returns_the_kernels_outputs_bit_for_bit():
    """As the emulated test: through `ssd` the kernels' outputs and gradients, bit for bit, and not the xla
    path's. The kernels' float atomics are the only run-to-run difference: deterministic_backward."""
    inputs, weights = make_problem(2)
    float_args = {name: inputs[name] for name in FLOAT_ARGS}
    kernel = backends.get("cutile", "test")
    static = op.SSDStatic(64, True, (0.0, float("inf")), deterministic_backward=True)

    @jax.jit
    def kernels_alone(float_args, seq_idx, weights):
        ssd_inputs = op.SSDInputs(**float_args, seq_idx=seq_idx)
        outputs = kernel.forward(ssd_inputs, static)
        (y, final), saved = kernel.forward_saving(ssd_inputs, static)
        grads = kernel.backward(ssd_inputs, static, jnp.cos(y) * weights["y"],
                                jnp.cos(final) * weights["final"], saved)
        return outputs, {name: getattr(grads, name) for name in FLOAT_ARGS}

    ssd = functools.partial(CUTILE_SSD, deterministic_backward=True)
    got = outputs_and_grads(ssd, inputs, weights, nonlinear=True)
    for got_leaf, kernel_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(kernels_alone(float_args,
                                                                                     inputs["seq_idx"],
                                                                                     weights))):
        np.testing.assert_array_equal(got_leaf, kernel_leaf)


def test_emulated_cutile_confinement_reserves_no_second_program():
    """The confinement's temporaries in a compiled forward + backward are a few activations (finite parts, the
    reach term), not a recompute's: XLA's temporary memory grows by under 4 times x's bytes with it (a branch to
    the xla path, which the op once held, reserved 30 times at this shape). Emulated kernels: their own
    intermediates are not XLA's, so the difference is the confinement alone. On the CPU the program is compiled
    without XLA:CPU's YNNPACK reduction fusions: they take f32 operands, so XLA materializes f32 copies of the bf16
    arrays they reduce, which a GPU's reduction fusions read in place."""
    batch, seqlen, nheads, headdim, dstate = 2, 512, 8, 32, 64
    S = jax.ShapeDtypeStruct
    x = S((batch, seqlen, nheads, headdim), jnp.bfloat16)
    args = (x, S((batch, seqlen, nheads), jnp.float32), S((nheads,), jnp.float32),
            S((batch, seqlen, 1, dstate), jnp.bfloat16), S((batch, seqlen, 1, dstate), jnp.bfloat16),
            S((nheads,), jnp.float32), S((nheads,), jnp.float32), x)

    def temp_bytes(check_finite):
        def forward_backward(x, dt, A, B, C, D, dt_bias, dy):
            def ssd(x, dt, A, B, C, D, dt_bias):
                return jax_mamba2.ssd(x, dt, A, B, C, 64, D=D, dt_bias=dt_bias, dt_softplus=True,
                                      backend=EMULATED.name, check_finite=check_finite)
            y, vjp = jax.vjp(ssd, x, dt, A, B, C, D, dt_bias)
            return y, vjp(dy)
        options = {"xla_cpu_experimental_ynn_fusion_type": ""} if jax.default_backend() == "cpu" else {}
        return jax.jit(forward_backward).lower(*args).compile(options).memory_analysis().temp_size_in_bytes

    x_bytes = np.prod(x.shape) * x.dtype.itemsize
    assert 0 < temp_bytes(True) - temp_bytes(False) < 4 * x_bytes


def _check_clipped_infinite_dt(ssd_fn, tolerance):
    """An infinite dt whose Δ dt_limit makes finite (+inf -> the limit's max, -inf -> softplus 0 -> its min) is an
    ordinary time step, as in the recurrence: outputs and gradients finite and equal to the float64 scan's."""
    inputs, weights = make_problem(5)
    inputs["dt"] = inputs["dt"].at[0, 27, 0].set(jnp.inf).at[1, 50, 3].set(-jnp.inf)
    options = dict(D=inputs["D"], z=inputs["z"], dt_bias=inputs["dt_bias"], dt_softplus=True, dt_limit=(0.001, 0.5),
                   initial_states=inputs["initial_states"], seq_idx=inputs["seq_idx"])

    def loss_and_outputs(ssd_fn, x, dt, B, C):
        y, final = ssd_fn(x, dt, inputs["A"], B, C, **options)
        loss = jnp.sum(jnp.sin(y.astype(final.dtype)) * weights["y"]) + jnp.sum(final * weights["final"])
        return loss, (y, final)

    def run(ssd_fn, arrays):
        return jax.jit(jax.grad(functools.partial(loss_and_outputs, ssd_fn), argnums=(0, 1, 2, 3), has_aux=True))(
            *arrays)

    arrays = [inputs[n] for n in ("x", "dt", "B", "C")]
    got = run(ssd_fn, arrays)
    with jax.enable_x64(True):
        want = jax.tree.map(np.asarray, run(reference.ssd_scan, [a.astype(jnp.float64) for a in arrays]))
    for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        got_leaf = np.asarray(got_leaf, np.float64)
        assert np.isfinite(got_leaf).all() and np.isfinite(want_leaf).all()
        error = np.linalg.norm(got_leaf - want_leaf) / np.linalg.norm(want_leaf)
        assert error < tolerance, error


def test_emulated_cutile_infinite_dt_that_the_limit_clips_is_a_finite_step_like_the_scan():
    _check_clipped_infinite_dt(EMULATED_SSD, EMULATED_TOLERANCE)


@pytest.mark.gpu
def test_cutile_infinite_dt_that_the_limit_clips_is_a_finite_step_like_the_scan():
    _check_clipped_infinite_dt(CUTILE_SSD, GPU_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("nonlinear", [False, True], ids=["linear_loss", "sin_loss"])
def test_cutile_d_gradient_takes_the_finite_part_of_a_nonfinite_x(nonlinear):
    assert_d_gradient_takes_the_finite_part(CUTILE_SSD, GPU_TOLERANCE, nonlinear=nonlinear)


@pytest.mark.gpu
def test_cutile_negative_step_under_jit_is_a_nonfinite_dt_as_on_the_scan():
    assert_negative_step_confined_like_a_nonfinite_dt(CUTILE_SSD, GPU_TOLERANCE)
