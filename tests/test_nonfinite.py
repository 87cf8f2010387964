"""NaN and inf stay where the recurrence puts them on the xla path (`reference.ssd_chunked`): a
non-finite input reaches its own sequence from its token on, never an earlier token of its chunk, another
packed sequence or their gradients; a non-finite initial state reaches only the first sequence.
"""
import functools

import numpy as np
import pytest

import jax_mamba2
from tests._nonfinite_checks import SPOILS, Spoil, assert_confined_like_scan, assert_d_gradient_takes_the_finite_part, \
    assert_negative_step_confined_like_a_nonfinite_dt, assert_packed_reproduction_confined, make_problem, \
    outputs_and_grads, scan_oracle

_XLA = functools.partial(jax_mamba2.ssd, chunk_size=16, return_final_states=True, backend="xla")
_CASES = [(name, True) for name in SPOILS] + [("x_nan", False), ("dt_inf", False)]


@pytest.mark.parametrize("case, nonlinear", _CASES,
                         ids=[f"{name}-{'sin' if nonlinear else 'linear'}_loss" for name, nonlinear in _CASES])
def test_xla_confines_nonfinite_values_like_the_scan(case, nonlinear):
    spoil = SPOILS[case]
    inputs, weights = make_problem(0, spoil=spoil)
    got = outputs_and_grads(_XLA, inputs, weights, nonlinear=nonlinear)
    spoiled = {} if spoil.name == "weight_y" else {spoil.name: spoil.index}
    assert_confined_like_scan(got, scan_oracle(inputs, weights, nonlinear=nonlinear), spoiled, 1e-4,
                              inputs["seq_idx"])


def test_xla_nan_without_seq_idx_spares_the_earlier_tokens_of_its_chunk():
    spoil = Spoil("x", (1, 37, 0, 0))  # chunk 32-47
    inputs, weights = make_problem(1, segmented=False, spoil=spoil)
    (y, _), _ = got = outputs_and_grads(_XLA, inputs, weights, nonlinear=True)
    assert np.isfinite(np.asarray(y[1, :37])).all() and not np.isfinite(np.asarray(y[1, 37:, 0])).any()
    assert_confined_like_scan(got, scan_oracle(inputs, weights, nonlinear=True), {"x": spoil.index}, 1e-4)


def test_xla_nan_in_one_packed_sequence_leaves_the_next_finite():
    """The reproduction of the issue's packed-sequence leak (`assert_packed_reproduction_confined`)."""
    assert_packed_reproduction_confined(_XLA, headdim=8, dstate=4)


@pytest.mark.parametrize("nonlinear", [False, True], ids=["linear_loss", "sin_loss"])
def test_xla_d_gradient_takes_the_finite_part_of_a_nonfinite_x_as_the_kernels(nonlinear):
    """D is shared by every sequence: a NaN in x of one of them leaves its gradient finite, the kernels' D gradient
    of x's finite part (the D skip of x itself would make it NaN)."""
    assert_d_gradient_takes_the_finite_part(_XLA, 1e-4, nonlinear=nonlinear)


def test_xla_negative_step_under_jit_is_a_nonfinite_dt_as_on_the_scan():
    """A negative Δ, unchecked under jit, is NaN on the scan and the xla path alike: the chunked algorithm, which
    clamps decays to exp(<= 0), cannot follow the growth that the recurrence would compute."""
    assert_negative_step_confined_like_a_nonfinite_dt(_XLA, 1e-4)


@pytest.mark.parametrize("backend", ["xla", "scan"])
def test_a_nonfinite_gate_leaves_the_earlier_tokens_gradients_finite(backend):
    """A NaN in z at token 5 with a loss of tokens 0-4 only: no gradient is NaN (the gate's backward takes z's finite
    part, as the kernels' does; 0 * silu(NaN) would carry a NaN to every earlier token's dx), and the gate keeps its
    forward-mode derivative on the scan."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(5), 4)
    x, z = (jax.random.normal(k, (1, 12, 2, 4)) for k in keys[:2])
    B, C = (jax.random.normal(k, (1, 12, 1, 4)) for k in keys[2:])
    z = z.at[0, 5, 0, 0].set(jnp.nan)
    A, dt, D = -jnp.ones(2), jnp.full((1, 12, 2), 0.3), jnp.ones(2)

    def head_of_row(x, A, D, z):
        return jax_mamba2.ssd(x, dt, A, B, C, 8, D=D, z=z, backend=backend)[:, :5].sum()
    grads = jax.grad(head_of_row, argnums=(0, 1, 2, 3))(x, A, D, z)
    for name, grad in zip(("x", "A", "D"), grads[:3]):
        assert bool(jnp.isfinite(grad).all()), name
    assert bool(jnp.isfinite(jnp.delete(grads[3].reshape(12, -1), 5, axis=0)).all())  # z's own token aside
    if backend == "scan":
        tangent = jax.jvp(lambda x: head_of_row(x, A, D, z), (x,), (jnp.ones_like(x),))[1]
        assert bool(jnp.isfinite(tangent))
