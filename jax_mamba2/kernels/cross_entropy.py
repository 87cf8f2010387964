"""Forward of the LM loss's softmax: per row of a chunk's logits, the logsumexp and the loss, in one pass.

Mirrors the inner computation of `jax_mamba2.cross_entropy` (`chunk_loss`). Per row r with label y_r,
over the columns c < VOCAB (the columns past VOCAB are padding, excluded from the softmax), in f32:

    lse[r]    = log sum_c exp(logits[r, c])              (online: running max m, rescaled sum s)
    target[r] = logits[r, y_r]
    loss[r]   = 0                                        if y_r == IGNORE_INDEX
                NaN                                      if y_r is counted but outside [0, VOCAB)
                lse[r] - target[r]                       otherwise

The column tiles are walked once: each (BLOCK_ROWS, BLOCK_V) tile updates m <- max(m, max_c x) and
s <- s * exp(m_old - m) + sum_c exp(x - m), and picks up the target logit where its column is the label
(m is kept in log2 units, m = max_c x * log2(e), so that each exponential is one exp2). jax.nn.logsumexp
is a max and then a sum over the logits, the second reduction depending on the first, plus a gather of the
target; this carries all three in one read. m starts at -FLT_MAX rather than -inf, so that the first rescale
is exp(-huge) = 0, never exp(-inf + inf) = NaN; a row whose counted columns are all -inf gets lse = -inf, as XLA's.

Layout: logits (rows, padded_vocab) bf16/f16/f32, the head product as stored (padded_vocab >= VOCAB, not a
power of two: the last column tile runs past it, loaded as zeros and masked with the columns >= VOCAB);
labels (rows,) int32. Grid (cdiv(rows, BLOCK_ROWS),): a block owns BLOCK_ROWS rows and loops over
cdiv(VOCAB, BLOCK_V) column tiles (the column tiles wholly in the padding are never read). Rows are
independent: a NaN in one row's logits reaches that row's lse and loss only.

Memory-bound: it reads the logits once (2 bytes per element in bf16) and writes 8 bytes per row. At the LM's
chunk of 2048 rows x 50280 columns that is 206 MB of bf16.

Outputs: lse (rows,) f32 (what the backward reads) and loss (rows,) f32 (the masked per-row losses, summed
by the caller).
"""

import dataclasses
from typing import NamedTuple, Optional

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    INT32_MAX, LOG2E, Big, Buffer, ConstInt, Launch, Plan, check_row_block_config, exp2_ftz, index_width_variant,
    int64_index_kernels, is_power_of_2, next_power_of_2)

# The running max's start: below every finite f32, so the first rescale exp(start - m) underflows to 0
# instead of exp(-inf - (-inf)) = NaN.
NEG_FLT_MAX = -3.4028234663852886e38
NEG_INF = float("-inf")
LN2 = 0.6931471805599453
NAN = float("nan")
# Bytes of the logits in a (1, BLOCK_V) tile of the defaults: 2048 f32 values, 4096 bf16 / f16. The forward
# streams the logits with about a tile's load in flight per block, so the tile's bytes, not its columns, set how
# close it comes to the bandwidth (docs/norms_and_loss.md: 2048 bf16 columns were measured well short of it).
TILE_BYTES = 8192

CROSS_ENTROPY_FWD_INPUTS = ("logits", "labels")
CROSS_ENTROPY_FWD_OUTPUTS = ("lse", "loss")


class CrossEntropyDims(NamedTuple):
    """Static description of one chunk's softmax (what the kernels specialise on).

    logits are (rows, padded_vocab) in `dtype`; the softmax covers the first `vocab_size` columns; a row
    whose label is `ignore_index` does not count; the backward writes dlogits in `grad_dtype`.
    """

    rows: int
    padded_vocab: int
    vocab_size: int
    ignore_index: int = -100
    dtype: str = "bfloat16"
    grad_dtype: str = "bfloat16"


@dataclasses.dataclass(frozen=True)
class CrossEntropyConfig:
    """The tile and hint choices of the loss kernels.

    BLOCK_ROWS: rows per block; BLOCK_V: columns per tile (powers of two; BLOCK_ROWS x BLOCK_V f32 values
      live in registers).
    FWD_OCCUPANCY / BWD_OCCUPANCY: the occupancy hints (blocks per SM the compiler budgets registers for).
    FWD_LATENCY / BWD_LATENCY: the latency hint (1..10) of the column loop's logits loads (a deeper prefetch:
      the next tile's load issues before this one's math), or 0 to leave them to the compiler.
    """

    BLOCK_ROWS: int
    BLOCK_V: int
    FWD_OCCUPANCY: int
    BWD_OCCUPANCY: int
    FWD_LATENCY: int = 0
    BWD_LATENCY: int = 0

    def __post_init__(self):
        check_row_block_config(self)
        if not is_power_of_2(self.BLOCK_V) or not 16 <= self.BLOCK_V <= 16384:
            raise ValueError(f"CrossEntropyConfig: BLOCK_V={self.BLOCK_V} must be a power of two in [16, 16384]")


def cross_entropy_default_config(dims: CrossEntropyDims) -> CrossEntropyConfig:
    """One row per block, TILE_BYTES of logits per column tile (fewer columns for a smaller vocabulary),
    occupancy 4 in both kernels (the highest at which both compile without spills at the LM's chunk:
    docs/norms_and_loss.md), no latency hints."""
    columns = TILE_BYTES // (4 if dims.dtype == "float32" else 2)  # the kernels' dtypes: f32, bf16, f16
    return CrossEntropyConfig(BLOCK_ROWS=1, BLOCK_V=max(16, min(columns, next_power_of_2(dims.vocab_size))),
                              FWD_OCCUPANCY=4, BWD_OCCUPANCY=4)


def needs_int64_index(dims: CrossEntropyDims) -> bool:
    """Whether the logits have 2^31 or more elements (int32 element offsets could overflow)."""
    return dims.rows * dims.padded_vocab > INT32_MAX


def row_block_count(dims: CrossEntropyDims, cfg: CrossEntropyConfig) -> int:
    return -(-dims.rows // cfg.BLOCK_ROWS)


# ------------------------------------------------------------------------------------------------
# Device helpers shared with the backward
# ------------------------------------------------------------------------------------------------

def load_logits(logits, row_block, column_tile, BLOCK_ROWS, BLOCK_V, LATENCY):
    """The (BLOCK_ROWS, BLOCK_V) tile (row_block, column_tile) of the (rows, padded_vocab) logits as f32, zero
    past the last row and column; LATENCY the load's latency hint (0: none, the compiler's choice)."""
    if LATENCY:
        tile = ct.load(logits, index=(row_block, column_tile), shape=(BLOCK_ROWS, BLOCK_V),
                       padding_mode=ct.PaddingMode.ZERO, latency=LATENCY)
    else:
        tile = ct.load(logits, index=(row_block, column_tile), shape=(BLOCK_ROWS, BLOCK_V),
                       padding_mode=ct.PaddingMode.ZERO)
    return tile.astype(ct.float32)


def load_row_vector(array, row_block, BLOCK_ROWS):
    """Rows [row_block*BLOCK_ROWS, ...) of a (rows,) array -> (BLOCK_ROWS, 1), zero past the last row."""
    return ct.load(array, index=(row_block,), shape=(BLOCK_ROWS,),
                   padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_ROWS, 1))


def store_row_vector(array, row_block, tile, BLOCK_ROWS):
    """Stores a (BLOCK_ROWS, 1) tile at rows [row_block*BLOCK_ROWS, ...) of a (rows,) array (rows past the
    end are dropped)."""
    ct.store(array, index=(row_block,), tile=tile.reshape((BLOCK_ROWS,)))


def label_masks(label, VOCAB, IGNORE_INDEX):
    """(counted, out of range) of a (BLOCK_ROWS, 1) int32 label tile, as jax_mamba2/cross_entropy.py's
    `_label_masks`: counted rows enter the mean; a counted label outside [0, VOCAB) makes the row's loss and
    gradient NaN."""
    counted = label != IGNORE_INDEX
    return counted, counted & ((label < 0) | (label >= VOCAB))


def columns(column_tile, BLOCK_V):
    """The column indices of tile `column_tile` -> (1, BLOCK_V) int32."""
    return (column_tile * BLOCK_V + ct.arange(BLOCK_V, dtype=ct.int32)).reshape((1, BLOCK_V))


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------

def _cross_entropy_fwd_body(logits, labels, lse, loss, VOCAB, IGNORE_INDEX, BLOCK_ROWS, BLOCK_V, LOAD_LAT):
    row_block = ct.bid(0)
    label = load_row_vector(labels, row_block, BLOCK_ROWS)                      # (BLOCK_ROWS, 1) int32
    running_max = ct.full((BLOCK_ROWS, 1), NEG_FLT_MAX, dtype=ct.float32)
    running_sum = ct.zeros((BLOCK_ROWS, 1), dtype=ct.float32)
    target = ct.zeros((BLOCK_ROWS, 1), dtype=ct.float32)
    for column_tile in range(ct.cdiv(VOCAB, BLOCK_V)):
        col = columns(column_tile, BLOCK_V)
        x = load_logits(logits, row_block, column_tile, BLOCK_ROWS, BLOCK_V, LOAD_LAT)
        # The max and sum in log2 units (exp2 is one MUFU.EX2); padding columns (past VOCAB, and the zeros
        # loaded past padded_vocab) are not in the softmax.
        x2 = ct.where(col < VOCAB, x * LOG2E, NEG_INF)
        new_max = ct.maximum(running_max, ct.max(x2, axis=1, keepdims=True))
        running_sum = (running_sum * exp2_ftz(running_max - new_max)
                       + ct.sum(exp2_ftz(x2 - new_max), axis=1, keepdims=True))
        running_max = new_max
        # One column at most matches an in-range label; where, not a product, so other columns' NaN stay out.
        target = target + ct.sum(ct.where(col == label, x, 0.0), axis=1, keepdims=True)
    row_lse = running_max * LN2 + ct.log(running_sum)
    counted, out_of_range = label_masks(label, VOCAB, IGNORE_INDEX)
    row_loss = ct.where(counted, ct.where(out_of_range, NAN, row_lse - target), 0.0)
    store_row_vector(lse, row_block, row_lse, BLOCK_ROWS)
    store_row_vector(loss, row_block, row_loss, BLOCK_ROWS)


def cross_entropy_fwd_kernel(
    logits: Big,          # (rows, padded_vocab) T
    labels,               # (rows,) int32
    lse,                  # (rows,) f32, written
    loss,                 # (rows,) f32, written
    VOCAB: ConstInt,      # the softmax's columns (<= padded_vocab)
    IGNORE_INDEX: ConstInt,
    BLOCK_ROWS: ConstInt,
    BLOCK_V: ConstInt,
    LOAD_LAT: ConstInt,   # latency hint of the column loop's loads (1..10), 0 for none
):
    _cross_entropy_fwd_body(logits, labels, lse, loss, VOCAB, IGNORE_INDEX, BLOCK_ROWS, BLOCK_V, LOAD_LAT)


# (int32-indexed, int64-indexed) entries of the one body.
CROSS_ENTROPY_FWD_KERNELS = int64_index_kernels(cross_entropy_fwd_kernel)


def cross_entropy_fwd_inputs(dims: CrossEntropyDims) -> dict[str, Buffer]:
    """Shape and dtype of each forward input as the bridge passes it."""
    return {"logits": Buffer((dims.rows, dims.padded_vocab), dims.dtype),
            "labels": Buffer((dims.rows,), "int32")}


def cross_entropy_fwd_plan(dims: CrossEntropyDims, cfg: Optional[CrossEntropyConfig] = None) -> Plan:
    """The forward for `dims`.

    Returns:
      A Plan with inputs CROSS_ENTROPY_FWD_INPUTS and outputs CROSS_ENTROPY_FWD_OUTPUTS: "lse" and "loss",
      both (rows,) f32.
    """
    cfg = cfg or cross_entropy_default_config(dims)
    launch = Launch(
        kernel=index_width_variant(CROSS_ENTROPY_FWD_KERNELS, needs_int64_index(dims), occupancy=cfg.FWD_OCCUPANCY),
        grid=(row_block_count(dims, cfg),),
        args=("logits", "labels", "lse", "loss", dims.vocab_size, dims.ignore_index, cfg.BLOCK_ROWS, cfg.BLOCK_V,
              cfg.FWD_LATENCY),
        writes=("lse", "loss"),
    )
    return Plan(
        inputs=CROSS_ENTROPY_FWD_INPUTS,
        buffers={"lse": Buffer((dims.rows,), "float32"), "loss": Buffer((dims.rows,), "float32")},
        launches=(launch,),
        outputs=CROSS_ENTROPY_FWD_OUTPUTS,
    )
