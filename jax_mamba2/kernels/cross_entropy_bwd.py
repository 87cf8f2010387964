"""Backward of the LM loss's softmax (kernels/cross_entropy.py): the logits' gradient, tile by tile.

Mirrors the inner computation of `jax_mamba2.cross_entropy` (`chunk_grads`). Per row r with label y_r,
the forward's lse[r] and the row's cotangent scale[r] (dloss / count), in f32:

    dlogits[r, c] = NaN (every column)                                       if y_r is counted but outside
                                                                              [0, VOCAB)
                  = 0                                                         else if y_r == IGNORE_INDEX
                                                                              or c >= VOCAB (padding)
                  = (exp(logits[r, c] - lse[r]) - [c == y_r]) * scale[r]     otherwise

stored in dlogits' dtype (the head matmul's operand dtype). Ignored rows and padding columns are written as
exact zeros (a where, not a product with 0): a non-finite logit there gives no NaN.

Layout as the forward's: logits (rows, padded_vocab) bf16/f16/f32, labels (rows,) int32, lse and scale
(rows,) f32, dlogits (rows, padded_vocab) bf16/f16/f32. Grid (cdiv(rows, BLOCK_ROWS),): a block owns
BLOCK_ROWS rows and walks all cdiv(padded_vocab, BLOCK_V) column tiles, so that every column of dlogits is
written (the padding ones as zeros); the column tiles wholly in the padding are written without being read.
The exponential is exp2(logit * log2(e) - lse * log2(e)), one FMA and one exp2 per element.

Memory-bound: one read of the logits and one write of dlogits, 4 bytes per element in bf16 (412 MB at the
LM's chunk of 2048 x 50280): the forward's lse is saved, so the softmax needs no second pass.
"""

from typing import Optional

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    LOG2E, Big, Buffer, ConstInt, Launch, Plan, exp2_ftz, index_width_variant, int64_index_kernels)
from jax_mamba2.kernels.cross_entropy import (
    NAN, CrossEntropyConfig, CrossEntropyDims, columns, cross_entropy_default_config, label_masks, load_logits,
    load_row_vector, needs_int64_index, row_block_count)

CROSS_ENTROPY_BWD_INPUTS = ("logits", "labels", "lse", "scale")
CROSS_ENTROPY_BWD_OUTPUTS = ("dlogits",)


def _cross_entropy_bwd_body(logits, labels, lse, scale, dlogits, VOCAB, IGNORE_INDEX, BLOCK_ROWS, BLOCK_V,
                            LOAD_LAT):
    row_block = ct.bid(0)
    label = load_row_vector(labels, row_block, BLOCK_ROWS)                      # (BLOCK_ROWS, 1) int32
    row_lse2 = load_row_vector(lse, row_block, BLOCK_ROWS) * LOG2E              # (BLOCK_ROWS, 1) f32, log2 units
    row_scale = load_row_vector(scale, row_block, BLOCK_ROWS)                   # (BLOCK_ROWS, 1) f32
    counted, out_of_range = label_masks(label, VOCAB, IGNORE_INDEX)
    vocab_tiles = ct.cdiv(VOCAB, BLOCK_V)
    for column_tile in range(vocab_tiles):
        col = columns(column_tile, BLOCK_V)
        x = load_logits(logits, row_block, column_tile, BLOCK_ROWS, BLOCK_V, LOAD_LAT)
        probability = exp2_ftz(x * LOG2E - row_lse2)
        grad = (probability - ct.where(col == label, 1.0, 0.0)) * row_scale
        grad = ct.where(out_of_range, NAN, ct.where((col < VOCAB) & counted, grad, 0.0))
        ct.store(dlogits, index=(row_block, column_tile), tile=grad.astype(dlogits.dtype))
    # The tiles wholly in the padding columns: nothing to read, zeros (NaN in an out-of-range row) to write.
    padding = ct.where(out_of_range, NAN, ct.zeros((BLOCK_ROWS, BLOCK_V), dtype=ct.float32))
    for column_tile in range(vocab_tiles, ct.cdiv(dlogits.shape[1], BLOCK_V)):
        ct.store(dlogits, index=(row_block, column_tile), tile=padding.astype(dlogits.dtype))


def cross_entropy_bwd_kernel(
    logits: Big,          # (rows, padded_vocab) T
    labels,               # (rows,) int32
    lse,                  # (rows,) f32, the forward's
    scale,                # (rows,) f32, the loss's cotangent per counted row (dloss / count)
    dlogits: Big,         # (rows, padded_vocab) T_grad, written
    VOCAB: ConstInt,
    IGNORE_INDEX: ConstInt,
    BLOCK_ROWS: ConstInt,
    BLOCK_V: ConstInt,
    LOAD_LAT: ConstInt,   # latency hint of the column loop's loads (1..10), 0 for none
):
    _cross_entropy_bwd_body(logits, labels, lse, scale, dlogits, VOCAB, IGNORE_INDEX, BLOCK_ROWS, BLOCK_V,
                            LOAD_LAT)


CROSS_ENTROPY_BWD_KERNELS = int64_index_kernels(cross_entropy_bwd_kernel)


def cross_entropy_bwd_inputs(dims: CrossEntropyDims) -> dict[str, Buffer]:
    """Shape and dtype of each backward input as the bridge passes it."""
    return {"logits": Buffer((dims.rows, dims.padded_vocab), dims.dtype),
            "labels": Buffer((dims.rows,), "int32"),
            "lse": Buffer((dims.rows,), "float32"),
            "scale": Buffer((dims.rows,), "float32")}


def cross_entropy_bwd_plan(dims: CrossEntropyDims, cfg: Optional[CrossEntropyConfig] = None) -> Plan:
    """The backward for `dims`.

    Returns:
      A Plan with inputs CROSS_ENTROPY_BWD_INPUTS and the output "dlogits" (rows, padded_vocab) in grad_dtype.
    """
    cfg = cfg or cross_entropy_default_config(dims)
    launch = Launch(
        kernel=index_width_variant(CROSS_ENTROPY_BWD_KERNELS, needs_int64_index(dims), occupancy=cfg.BWD_OCCUPANCY),
        grid=(row_block_count(dims, cfg),),
        args=("logits", "labels", "lse", "scale", "dlogits", dims.vocab_size, dims.ignore_index, cfg.BLOCK_ROWS,
              cfg.BLOCK_V, cfg.BWD_LATENCY),
        writes=("dlogits",),
    )
    return Plan(
        inputs=CROSS_ENTROPY_BWD_INPUTS,
        buffers={"dlogits": Buffer((dims.rows, dims.padded_vocab), dims.grad_dtype)},
        launches=(launch,),
        outputs=CROSS_ENTROPY_BWD_OUTPUTS,
    )
