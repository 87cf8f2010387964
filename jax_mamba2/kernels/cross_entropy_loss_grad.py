"""The LM loss's softmax and its unit gradient in one kernel: per row block, the forward's pass and then the
backward's, back to back.

A mean or a sum of the tokens' losses takes its gradient in the forward pass with every token's cotangent 1
(flax_layers/loss.py, `_loss_and_unit_grads`), so a chunk's logits are read for the loss (kernels/
cross_entropy.py) and read again for the gradient (kernels/cross_entropy_bwd.py), which needs the finished
logsumexp. Two launches read the chunk twice from memory: 1 GB per chunk of 2048 x 50288 f32 logits with the
bf16 gradient's write, of which the second read is 412 MB. Here a block makes both passes over its rows, the
second straight after the first and over the column tiles last to first, so that the tiles it re-reads are the
ones it read last: what every block reads in between is its rows alone, and while that fits the GPU's L2 cache
(fewer blocks at once: FUSED_ROW_BLOCKS, occupancy) the second read comes from L2 rather than HBM.

Per row r, with the notation of the two kernels: loss[r] as cross_entropy.py's, and

    dlogits[r, c] = (exp(logits[r, c] - lse[r]) - [c == y_r])     (NaN rows, zeros, padding as cross_entropy_bwd.py)

i.e. the backward's gradient at scale 1, in the same arithmetic as the two kernels.

Layout: logits (rows, padded_vocab) bf16/f16/f32, labels (rows,) int32; loss (rows,) f32 and dlogits (rows,
padded_vocab) in grad_dtype, written. Grid (cdiv(row_blocks, FUSED_ROW_BLOCKS),) with row_blocks =
cdiv(rows, BLOCK_ROWS): block b walks the row blocks b, b + grid, b + 2 grid, ... Rows are independent, as in
both kernels: a NaN logit reaches its own row's loss and gradient only.
"""
from typing import Optional

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    Big, Buffer, ConstInt, Launch, Plan, index_width_variant, int64_index_kernels)
from jax_mamba2.kernels.cross_entropy import (
    CrossEntropyConfig, CrossEntropyDims, cross_entropy_default_config, load_row_vector, needs_int64_index,
    row_block_count, row_logsumexp_and_loss, store_row_vector)
from jax_mamba2.kernels.cross_entropy_bwd import store_row_gradient

CROSS_ENTROPY_LOSS_GRAD_INPUTS = ("logits", "labels")
CROSS_ENTROPY_LOSS_GRAD_OUTPUTS = ("loss", "dlogits")


def _cross_entropy_loss_grad_body(logits, labels, loss, dlogits, VOCAB, IGNORE_INDEX, BLOCK_ROWS, BLOCK_V,
                                  LOAD_LAT):
    row_blocks = ct.cdiv(logits.shape[0], BLOCK_ROWS)
    one = ct.full((BLOCK_ROWS, 1), 1.0, dtype=ct.float32)
    for step in range(ct.cdiv(row_blocks - ct.bid(0), ct.num_blocks(0))):
        row_block = ct.bid(0) + step * ct.num_blocks(0)
        label = load_row_vector(labels, row_block, BLOCK_ROWS)                  # (BLOCK_ROWS, 1) int32
        row_lse, row_loss = row_logsumexp_and_loss(logits, label, row_block, VOCAB, IGNORE_INDEX, BLOCK_ROWS,
                                                   BLOCK_V, LOAD_LAT)
        store_row_vector(loss, row_block, row_loss, BLOCK_ROWS)
        store_row_gradient(logits, label, row_lse, one, dlogits, row_block, VOCAB, IGNORE_INDEX, BLOCK_ROWS,
                           BLOCK_V, LOAD_LAT, True)


def cross_entropy_loss_grad_kernel(
    logits: Big,          # (rows, padded_vocab) T
    labels,               # (rows,) int32
    loss,                 # (rows,) f32, written
    dlogits: Big,         # (rows, padded_vocab) T_grad, written
    VOCAB: ConstInt,      # the softmax's columns (<= padded_vocab)
    IGNORE_INDEX: ConstInt,
    BLOCK_ROWS: ConstInt,
    BLOCK_V: ConstInt,
    LOAD_LAT: ConstInt,   # latency hint of the column loops' loads (1..10), 0 for none
):
    _cross_entropy_loss_grad_body(logits, labels, loss, dlogits, VOCAB, IGNORE_INDEX, BLOCK_ROWS, BLOCK_V, LOAD_LAT)


CROSS_ENTROPY_LOSS_GRAD_KERNELS = int64_index_kernels(cross_entropy_loss_grad_kernel)


def cross_entropy_loss_grad_inputs(dims: CrossEntropyDims) -> dict[str, Buffer]:
    """Shape and dtype of each input as the bridge passes it."""
    return {"logits": Buffer((dims.rows, dims.padded_vocab), dims.dtype),
            "labels": Buffer((dims.rows,), "int32")}


def cross_entropy_loss_grad_plan(dims: CrossEntropyDims, cfg: Optional[CrossEntropyConfig] = None) -> Plan:
    """The loss and its unit gradient for `dims`.

    Returns:
      A Plan with inputs CROSS_ENTROPY_LOSS_GRAD_INPUTS and outputs CROSS_ENTROPY_LOSS_GRAD_OUTPUTS: "loss" (rows,)
      f32 and "dlogits" (rows, padded_vocab) in grad_dtype.
    """
    cfg = cfg or cross_entropy_default_config(dims)
    launch = Launch(
        kernel=index_width_variant(CROSS_ENTROPY_LOSS_GRAD_KERNELS, needs_int64_index(dims),
                                   occupancy=cfg.FUSED_OCCUPANCY),
        grid=(-(-row_block_count(dims, cfg) // cfg.FUSED_ROW_BLOCKS),),
        args=("logits", "labels", "loss", "dlogits", dims.vocab_size, dims.ignore_index, cfg.BLOCK_ROWS,
              cfg.BLOCK_V, cfg.FUSED_LATENCY),
        writes=("loss", "dlogits"),
    )
    return Plan(
        inputs=CROSS_ENTROPY_LOSS_GRAD_INPUTS,
        buffers={"loss": Buffer((dims.rows,), "float32"),
                 "dlogits": Buffer((dims.rows, dims.padded_vocab), dims.grad_dtype)},
        launches=(launch,),
        outputs=CROSS_ENTROPY_LOSS_GRAD_OUTPUTS,
    )
