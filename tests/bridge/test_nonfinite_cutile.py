"""NaN and inf through the cuTile backend, on the NumPy emulator (CPU) and on the GPU, against the float64
scan (see tests/_nonfinite_checks.py).

The kernels do not confine a non-finite value to its sequence: they mix the tokens of a 64-token chunk in
matrix products (the intra-chunk scores times x, the chunk state as x times the weighted B, the entry state
times C, and their transposes in the backward), where a token's 0 weight times another's NaN is NaN, so a
NaN reaches the whole chunk and, through the chunk states, the rest of the batch row. The confinement tests
are strict xfails that record this; what does hold is that batch rows stay apart.
"""
import functools

import numpy as np
import pytest

import jax_mamba2

pytest.importorskip("cuda.tile")

from jax_mamba2 import backends, op  # noqa: E402
from tests._helpers import TOLERANCE  # noqa: E402
from tests._nonfinite_checks import FLOAT_ARGS, SPOILS, assert_confined_like_scan, make_problem, \
    outputs_and_grads, scan_oracle  # noqa: E402
from tests.bridge._emulated_backend import EMULATED  # noqa: E402

KERNELS_MIX_A_CHUNK = pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="the kernels' matrix products carry a masked-out NaN across the tokens of a chunk")
CASES = ["x_nan", "initial_states_nan", "cotangent_nan"]


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setitem(backends._REGISTRY["ssd"], EMULATED.name, EMULATED)
    return functools.partial(jax_mamba2.ssd, chunk_size=64, return_final_states=True, backend=EMULATED.name)


def _check_confined(ssd_fn, case, tolerance):
    spoil = SPOILS[case]
    inputs, weights = make_problem(0, spoil=spoil)
    got = outputs_and_grads(ssd_fn, inputs, weights, nonlinear=True)
    spoiled = {} if spoil.name == "weight_y" else {spoil.name: spoil.index}
    assert_confined_like_scan(got, scan_oracle(inputs, weights, nonlinear=True), spoiled, tolerance,
                              inputs["seq_idx"])


@KERNELS_MIX_A_CHUNK
@pytest.mark.parametrize("case", CASES)
def test_emulated_cutile_confines_nonfinite_values_like_the_scan(emulated, case):
    _check_confined(emulated, case, 1e-4)  # float64 kernels, float32 arrays between them and XLA


@pytest.mark.parametrize("case", CASES)
def test_emulated_cutile_keeps_nonfinite_values_in_their_batch_row(emulated, case):
    """Every spoil is in row 0: row 1's outputs and the row-1 entries of every per-row gradient stay finite."""
    inputs, weights = make_problem(0, spoil=SPOILS[case])
    (y, final), grads = outputs_and_grads(emulated, inputs, weights, nonlinear=True)
    assert np.isfinite(np.asarray(y[1])).all() and np.isfinite(np.asarray(final[1])).all()
    for name in FLOAT_ARGS:
        if name not in ("A", "D", "dt_bias"):  # shared by the rows
            assert np.isfinite(np.asarray(grads[name][1])).all(), name
    assert not np.isfinite(np.asarray(y[0])).all() or case == "cotangent_nan"


@pytest.mark.gpu
@KERNELS_MIX_A_CHUNK
@pytest.mark.parametrize("case", CASES)
def test_cutile_confines_nonfinite_values_like_the_scan(case):
    ssd = functools.partial(jax_mamba2.ssd, chunk_size=64, return_final_states=True, backend="cutile")
    _check_confined(ssd, case, TOLERANCE["kernel_bwd"]["float32"])
