"""NaN and inf stay where the recurrence puts them on the xla path (`reference.ssd_chunked`): a
non-finite input reaches its own sequence from its token on, never an earlier token of its chunk, another
packed sequence or their gradients; a non-finite initial state reaches only the first sequence.
"""
import functools

import numpy as np
import pytest

import jax_mamba2
from tests._nonfinite_checks import SPOILS, Spoil, assert_confined_like_scan, assert_packed_reproduction_confined, \
    make_problem, outputs_and_grads, scan_oracle

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
