"""The LM loss's softmax kernels (forward and backward plans) run block by block on the NumPy emulator of
cuda.tile (tests/kernels/_cutile_emulator.py) against loss.py's xla softmax in float64: a vocabulary that is
not a multiple of the tile, padded columns (a column tile wholly in the padding), several rows per block,
latency hints, ignored and out-of-range labels, bfloat16 and float32 logits, a NaN logit confined to its row."""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("cuda.tile")

from jax_mamba2.kernels.cross_entropy import (  # noqa: E402
    CrossEntropyConfig, CrossEntropyDims, cross_entropy_default_config, cross_entropy_fwd_plan, needs_int64_index)
from jax_mamba2.kernels.cross_entropy_bwd import cross_entropy_bwd_plan  # noqa: E402
from tests.kernels import _cutile_emulator as emulator  # noqa: E402
from tests.kernels._loss_checks import CASES, assert_close, make_inputs, nan_rows, oracle  # noqa: E402
from tests.kernels._plan_checks import assert_plan_well_formed  # noqa: E402


def run_kernels(case, arrays, *, float64: bool = True) -> dict:
    """The forward plan, then the backward plan on its lse -> lse, loss (rows,), dlogits (rows, padded_vocab)."""
    dims = case.dims()
    fwd = emulator.run_plan(cross_entropy_fwd_plan(dims, case.config),
                            dict(logits=arrays["logits"], labels=arrays["labels"]), float64=float64)
    bwd = emulator.run_plan(cross_entropy_bwd_plan(dims, case.config),
                            dict(logits=arrays["logits"], labels=arrays["labels"], lse=fwd["lse"],
                                 scale=arrays["scale"]), float64=float64)
    return dict(lse=fwd["lse"], loss=fwd["loss"], dlogits=bwd["dlogits"])


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_kernels_match_float64_reference(name):
    """In float64 the kernels' algebra (online logsumexp, masks) is exact to ~1e-15: a difference is a bug."""
    case = CASES[name]
    arrays = make_inputs(case, seed=sum(map(ord, name)))
    want = oracle(case, arrays)
    assert_close(run_kernels(case, arrays), want, 1e-12)
    # The cases hold ignored rows (zero loss and gradient) and NaN rows (counted labels out of range).
    ignored = arrays["labels"] == -100
    assert ignored.any() and nan_rows(case, arrays["labels"]).any()
    assert (want["loss"][ignored] == 0).all() and (want["dlogits"][ignored] == 0).all()


@pytest.mark.parametrize("dtype,grad_dtype,tolerance", [
    ("bfloat16", "bfloat16", {"lse": 1e-6, "loss": 1e-6, "dlogits": 1e-2}),
    ("float32", "float32", {"lse": 1e-6, "loss": 1e-6, "dlogits": 1e-5}),
    ("bfloat16", "float32", {"lse": 1e-6, "loss": 1e-6, "dlogits": 1e-5}),
])
@pytest.mark.parametrize("name", ["padded_vocab_tiles_of_64", "rows_per_block_4_latency"])
def test_emulated_kernels_in_their_dtypes_match_float64_reference(name, dtype, grad_dtype, tolerance):
    """f32 math on the stored logits; dlogits rounded to the matmul dtype (bf16: ~2^-9 relative)."""
    case = dataclasses.replace(CASES[name], dtype=dtype, grad_dtype=grad_dtype)
    arrays = make_inputs(case, seed=3)
    got = run_kernels(case, arrays, float64=False)
    assert got["lse"].dtype == got["loss"].dtype == np.float32
    assert got["dlogits"].dtype == (ml_dtypes.bfloat16 if grad_dtype == "bfloat16" else np.float32)
    want = oracle(case, arrays)
    for output, bound in tolerance.items():
        assert_close({output: got[output]}, {output: want[output]}, bound)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy on the non-finite inputs
def test_emulated_padding_columns_and_ignored_rows_are_exact_zeros_even_for_nonfinite_logits():
    """NaN / inf logits in the padding columns and in an ignored row: no NaN reaches the loss or dlogits."""
    case = CASES["padded_vocab_tiles_of_64"]
    arrays = make_inputs(case, seed=5)
    ignored = int(np.flatnonzero(arrays["labels"] == -100)[0])
    arrays["logits"][:, case.vocab_size:] = np.nan
    arrays["logits"][ignored, 3] = np.inf
    arrays["logits"][ignored, 4] = np.nan
    got = run_kernels(case, arrays)
    counted_ok = ~nan_rows(case, arrays["labels"])
    assert (got["dlogits"][counted_ok][:, case.vocab_size:] == 0).all()
    assert (got["dlogits"][ignored] == 0).all() and got["loss"][ignored] == 0
    want = oracle(case, arrays)
    assert_close(got, want, 1e-12)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy on the non-finite inputs
def test_emulated_row_of_minus_inf_logits_has_minus_inf_logsumexp_as_xla():
    """A counted row whose vocabulary logits are all -inf: lse = -inf (no NaN from the running max's start), and
    the NaN loss and gradient of XLA's -inf - (-inf); the other rows unchanged."""
    case = CASES["padded_vocab_tiles_of_64"]
    arrays = make_inputs(case, seed=4)
    row = 0  # a counted in-range row
    arrays["logits"][row, :case.vocab_size] = -np.inf
    got, want = run_kernels(case, arrays), oracle(case, arrays)
    assert got["lse"][row] == -np.inf and np.isnan(got["loss"][row])
    assert_close(got, want, 1e-12)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy on the non-finite inputs
def test_emulated_nan_logit_stays_in_its_row():
    """A NaN logit of a counted row makes that row's lse, loss and gradient NaN (its vocabulary columns; the
    padding columns stay 0) and no other row's."""
    case = CASES["rows_per_block_4_latency"]
    arrays = make_inputs(case, seed=9)
    row = case.rows - 1  # a counted in-range row, sharing its 4-row block with others
    assert 0 <= arrays["labels"][row] < case.vocab_size
    arrays["logits"][row, 7] = np.nan
    got = run_kernels(case, arrays)
    assert np.isnan(got["lse"][row]) and np.isnan(got["loss"][row])
    assert np.isnan(got["dlogits"][row, :case.vocab_size]).all() and (got["dlogits"][row, case.vocab_size:] == 0).all()
    others = ~nan_rows(case, arrays["labels"])
    others[row] = False
    assert np.isfinite(got["lse"][others]).all() and np.isfinite(got["dlogits"][others]).all()
    assert_close(got, oracle(case, arrays), 1e-12)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy on the non-finite inputs
def test_emulated_plans_read_only_the_vocabulary_columns_forward():
    """The forward reads the column tiles holding vocabulary columns only: NaN past them changes nothing."""
    case = CASES["padded_vocab_tiles_of_64"]  # vocab 190: tiles 0..2; tile 3 (columns 192..199) is padding
    arrays = make_inputs(case, seed=2)
    poisoned = {**arrays, "logits": arrays["logits"].copy()}
    poisoned["logits"][:, 192:] = np.nan
    clean, dirty = run_kernels(case, arrays), run_kernels(case, poisoned)
    assert np.array_equal(clean["lse"], dirty["lse"], equal_nan=True)
    assert np.array_equal(clean["dlogits"], dirty["dlogits"], equal_nan=True)


@pytest.mark.parametrize("name", list(CASES))
def test_loss_plans_well_formed(name):
    dims = CASES[name].dims()
    for plan in (cross_entropy_fwd_plan(dims), cross_entropy_bwd_plan(dims)):
        assert_plan_well_formed(plan)


def test_default_config_and_index_width():
    """One row per block in tiles of 8 KB of logits (2048 f32 columns, 4096 bf16 / f16; fewer for a small
    vocabulary); int64 indices past 2^31 logits."""
    lm = CrossEntropyDims(rows=2048, padded_vocab=50288, vocab_size=50280)
    assert cross_entropy_default_config(lm) == CrossEntropyConfig(BLOCK_ROWS=1, BLOCK_V=4096, FWD_OCCUPANCY=4,
                                                                  BWD_OCCUPANCY=4)
    for dtype, block_v in (("float32", 2048), ("float16", 4096)):
        assert cross_entropy_default_config(lm._replace(dtype=dtype)).BLOCK_V == block_v
    assert cross_entropy_default_config(lm._replace(vocab_size=100, padded_vocab=104)).BLOCK_V == 128
    assert not needs_int64_index(lm) and needs_int64_index(lm._replace(rows=1 << 16))


@pytest.mark.parametrize("field,value,expected", [
    ("BLOCK_ROWS", 3, "BLOCK_ROWS=3 must be a power of two <= 64"),
    ("BLOCK_V", 1000, r"BLOCK_V=1000 must be a power of two in \[16, 16384\]"),
    ("FWD_OCCUPANCY", 0, r"FWD_OCCUPANCY=0 must be in \[1, 32\]"),
    ("BWD_LATENCY", 11, r"BWD_LATENCY=11 must be 0 \(no hint\) or in \[1, 10\]"),
])
def test_config_rejects_invalid_fields_naming_them(field, value, expected):
    fields = dict(BLOCK_ROWS=1, BLOCK_V=2048, FWD_OCCUPANCY=8, BWD_OCCUPANCY=4)
    with pytest.raises(ValueError, match=expected):
        CrossEntropyConfig(**{**fields, field: value})
