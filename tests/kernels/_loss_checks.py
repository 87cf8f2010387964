"""Cases, inputs and the float64 oracle of the LM loss's softmax kernels (kernels/cross_entropy.py,
cross_entropy_bwd.py), shared by their emulator and GPU tests. The oracle is loss.py's xla path in float64."""
import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_mamba2 import cross_entropy as loss
from jax_mamba2.kernels.cross_entropy import CrossEntropyConfig, CrossEntropyDims

IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class LossCase:
    """One chunk's softmax: (rows, padded_vocab) logits in `dtype`, the softmax over the first vocab_size
    columns, dlogits in `grad_dtype`; `config` None for the default tiles."""

    rows: int
    padded_vocab: int
    vocab_size: int
    dtype: str = "float32"
    grad_dtype: str = "float32"
    config: Optional[CrossEntropyConfig] = None

    def dims(self) -> CrossEntropyDims:
        return CrossEntropyDims(rows=self.rows, padded_vocab=self.padded_vocab, vocab_size=self.vocab_size,
                                ignore_index=IGNORE_INDEX, dtype=self.dtype, grad_dtype=self.grad_dtype)


def _config(block_rows, block_v, latency=0):
    return CrossEntropyConfig(BLOCK_ROWS=block_rows, BLOCK_V=block_v, FWD_OCCUPANCY=4, BWD_OCCUPANCY=4,
                              FWD_LATENCY=latency, BWD_LATENCY=latency)


# A vocabulary that is not a multiple of the tile, padded columns (one column tile wholly in the padding),
# no padding, several rows per block with a partial last row block, latency hints, the default tiles.
CASES = {
    "padded_vocab_tiles_of_64": LossCase(rows=9, padded_vocab=200, vocab_size=190, config=_config(1, 64)),
    "no_padding_tiles_of_32": LossCase(rows=6, padded_vocab=100, vocab_size=100, config=_config(1, 32)),
    "rows_per_block_4_latency": LossCase(rows=11, padded_vocab=136, vocab_size=130, config=_config(4, 32, 3)),
    "default_tiles": LossCase(rows=8, padded_vocab=304, vocab_size=300),
}


def _as(values: np.ndarray, dtype: str) -> np.ndarray:
    return values.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))


def make_inputs(case: LossCase, seed: int) -> dict[str, np.ndarray]:
    """Random logits (scaled like an LM's, std 3), labels with ignored rows and counted labels out of range
    (negative, in the padding columns, past the padded vocabulary), and a per-row cotangent scale."""
    rng = np.random.default_rng(seed)
    logits = _as(3.0 * rng.standard_normal((case.rows, case.padded_vocab)), case.dtype)
    labels = rng.integers(0, case.vocab_size, case.rows).astype(np.int32)
    specials = [IGNORE_INDEX, -5, case.vocab_size - 1, case.padded_vocab + 10, 0, IGNORE_INDEX]
    if case.vocab_size < case.padded_vocab:
        specials.append(case.vocab_size)  # the first padding column: counted, out of range
    specials = specials[:max(0, case.rows - 2)]  # rows 0 and the last keep random in-range labels
    labels[1:1 + len(specials)] = specials
    scale = (0.5 + rng.random(case.rows)).astype(np.float32)
    return dict(logits=logits, labels=labels, scale=scale)


def _static(case: LossCase):
    return loss._LossStatic(chunk_tokens=case.rows, ignore_index=IGNORE_INDEX, vocab_size=case.vocab_size,
                            embedding_layout=False, dtype="float64", logits_dtype="float64")


def oracle(case: LossCase, arrays: dict) -> dict[str, np.ndarray]:
    """loss.py's xla softmax in float64 on the same (rounded) logits: "lse", "loss" (rows,) and "dlogits"
    (rows, padded_vocab) for the arrays' labels and scale."""
    static = _static(case)
    with jax.enable_x64(True):
        logits = jnp.asarray(np.asarray(arrays["logits"], np.float64))
        labels = jnp.asarray(arrays["labels"])
        lse, per_token = loss._xla_softmax_loss(static, logits, labels)
        dlogits = loss._xla_softmax_grad(static, logits, labels, lse,
                                         jnp.asarray(np.asarray(arrays["scale"], np.float64)))
        return dict(lse=np.asarray(lse), loss=np.asarray(per_token), dlogits=np.asarray(dlogits))


def nan_rows(case: LossCase, labels: np.ndarray) -> np.ndarray:
    """The rows whose loss and gradient are NaN: counted labels outside [0, vocab_size)."""
    return (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= case.vocab_size))


def assert_close(got: dict, want: dict, tolerance: float) -> None:
    """The oracle's non-finite values (NaN, +-inf) exactly where it has them, and the rest within `tolerance` by
    relative L2 per output."""
    errors = {}
    for name, expected in want.items():
        actual = np.asarray(got[name], np.float64)
        expected = np.asarray(expected, np.float64)
        assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
        finite = np.isfinite(expected)
        assert np.array_equal(actual[~finite], expected[~finite], equal_nan=True), name
        errors[name] = float(np.linalg.norm(actual[finite] - expected[finite]) /
                             max(np.linalg.norm(expected[finite]), 1e-300))
    assert max(errors.values()) < tolerance, errors
