"""Backward of chunk_scan and chunk_state, column pass: dx, dB and the gradients w.r.t. Δ and dA that
flow through the tokens as SOURCES s (notation in _tiles.py).

Token s of chunk c feeds the outputs y_l (l >= s) of its chunk and the chunk's end state
S_c = Σ_s k_s w_s Δ_s x_s ⊗ B_s with w_s = exp(min(dA_last - dA_s, 0)). With G = dstates[b, c, h]
= ∂L/∂S_c (from chunk_state_bwd) and dy from chunk_scan_bwd_dc:

    acc_s      = k_s w_s (G B_s)  +  Σ_l M[l,s] Φ[l,s] (C_l · B_s) dy_l              (headdim)
    dx_s       = (Δ_s + reach_s) acc_s + D ⊙ dy_s     (reach_s = reach[b, h, c, s], 0 or NaN, with HAS_REACH; else 0)
    ddt_out_s  = acc_s · x_s                           (∂L/∂Δ_s through its explicit factors, dA fixed)
    dB_s       = Σ_{h in group} [ k_s w_s Δ_s x_s G  +  Σ_l dCB[l,s] C_l ],  dCB[l,s] = M Φ[l,s] Δ_s (dy_l · x_s)
    ddA_state_s = U_s = k_s w_s Δ_s (x_s · G B_s)

ddt_out_s is summed as the block computes its terms, k_s w_s (G B_s) · x_s plus Σ_l scores[s, l] (x_s · dy_l)
with the rounded scores and the x·dyᵀ tile the dB term needs anyway, so x_s is not reloaded after the row
loop (the same products summed in another f32 order; faster but at dstate 256, where the build keeps a
stack).

U_s is the dA gradient of the end state: ∂L/∂dA_s = -U_s and ∂L/∂dA_last += Σ_s U_s, whose reverse cumsum
over the chunk is the exclusive prefix sum Σ_{s<r} U_s, taken by chunk_cumsum_bwd.

A block owns the rows s of one column block and walks the row blocks l from its diagonal to the chunk's
last valid row (flash-attention-backward style, dK/dV side), computing the transposed products
(B_s · C_l, x_s · dy_l) so that every mma writes [s, l] tiles without transposing them. As in
chunk_scan_bwd_dc, HEADS_PER_BLOCK heads of one group share a block and dB is added atomically
(ATOMIC_ADD, zero-initialised dB) or stored by the one block owning the group (deterministic).

SUM_HEADS (BLOCK_M = BLOCK_K = CHUNK): the one row block is the whole chunk, so its C and B·Cᵀ are loaded
and computed once for all the block's heads, and the heads' dCB are summed in f32 before a single product
with C (as in chunk_scan_bwd_dc).

Precision: mma operands in x's dtype (tf32 for f32 inputs); G, the scores and dCB are rounded to x's
dtype before their products; f32 accumulation and elementwise math.

Grid: (nheads/HEADS_PER_BLOCK * CHUNK/BLOCK_M * nchunks, batch), head splits fastest, the heaviest column
blocks (chunk start) first. Column blocks wholly past seqlen do nothing.

Shapes: x, dy, dx (batch, seqlen, nheads, headdim) T (dy is dout without a gate); B, C (batch, seqlen,
ngroups, dstate) T; D (nheads, headdim) f32; dt_out, dA_cumsum, ddt_out, ddA_state (batch, nheads, nchunks,
CHUNK) f32; dstates (batch, nchunks, nheads, headdim, dstate) T; seq_idx (batch, seqlen) int32 or a
dummy; dB (batch, seqlen, ngroups, dstate) f32 if added atomically, else T; reach (batch, nheads, nchunks,
CHUNK) f32 or a dummy.
"""
import dataclasses

import cuda.tile as ct

from jax_mamba2.kernels._block_pass_config import (
    BLOCK_PASS_KEY_FIELDS, BlockPassConfig, block_pass_configs, block_pass_default_config, block_pass_launch,
    block_pass_work_items, summing_heads_config, sums_heads_by_default)
from jax_mamba2.kernels._common import (
    LOG2E, Big, ConstBool, ConstInt, Launch, SSDDims, Stage, exp2_ftz, int64_index_kernels, mma_dtype)
from jax_mamba2.kernels._tiles import (
    block_pass_tile, chunk_end_id, group_rows_and_products, head_rows, load_chunk_vector, operand, row_ids,
    store_chunk_vector, store_group_sum)


def chunk_scan_bwd_dx_kernel(
    x: Big,               # (batch, seqlen, nheads, headdim) T
    B: Big,               # (batch, seqlen, ngroups, dstate) T
    C: Big,               # (batch, seqlen, ngroups, dstate) T
    D,                    # (nheads, headdim) f32
    dy: Big,              # (batch, seqlen, nheads, headdim) T
    dt_out: Big,          # (batch, nheads, nchunks, CHUNK) f32
    dA_cumsum: Big,       # (batch, nheads, nchunks, CHUNK) f32
    dstates: Big,         # (batch, nchunks, nheads, headdim, dstate) T, ∂L/∂(chunk end states)
    seq_idx: Big,         # (batch, seqlen) int32, or a dummy without HAS_SEQ_IDX
    reach: Big,           # (batch, nheads, nchunks, CHUNK) f32, added to the rows of dx (HAS_REACH), or a dummy
    dx: Big,              # (batch, seqlen, nheads, headdim) T, written
    dB: Big,              # (batch, seqlen, ngroups, dstate) written, f32 zero-initialised if ATOMIC_ADD, else T
    ddt_out: Big,         # (batch, nheads, nchunks, CHUNK) f32, written
    ddA_state: Big,       # (batch, nheads, nchunks, CHUNK) f32, written
    CHUNK: ConstInt,
    HEADDIM: ConstInt,
    DSTATE: ConstInt,
    BLOCK_M: ConstInt,    # source rows s per block
    BLOCK_K: ConstInt,    # output rows l per inner step
    HEADS_PER_BLOCK: ConstInt,
    HAS_SEQ_IDX: ConstBool,
    HAS_REACH: ConstBool,  # add `reach` to each row's Δ in dx (SSDDims.has_reach)
    ATOMIC_ADD: ConstBool,
    LOAD_LAT: ConstInt,   # latency hint of the row loop's and the head loop's tile loads (1..10)
    SUM_HEADS: ConstBool,  # one whole-chunk row block; B·Cᵀ once, the heads' dCB summed (BlockPassConfig)
):
    seqlen = x.shape[1]
    num_m_blocks = CHUNK // BLOCK_M
    b, c, m, first_head, g = block_pass_tile(x.shape[2], B.shape[2], CHUNK, BLOCK_M, HEADS_PER_BLOCK, False)
    op_dtype = mma_dtype(x.dtype)

    # A column block wholly past seqlen has nothing to write, and its loads would lie outside the arrays.
    if c * CHUNK + m * BLOCK_M < seqlen:
        s_tile = c * num_m_blocks + m                    # column-block index along seqlen
        cols = m * BLOCK_M + ct.arange(BLOCK_M, dtype=ct.int32)
        B_s = ct.load(B, index=(b, s_tile, g, 0), shape=(1, BLOCK_M, 1, DSTATE),
                      padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_M, DSTATE)).astype(op_dtype)
        if HAS_SEQ_IDX:
            ids_s = row_ids(seq_idx, b, s_tile, BLOCK_M)
            end_id = chunk_end_id(seq_idx, b, c, seqlen, CHUNK)
        # Row blocks from the one holding the diagonal to the last with a valid row. With one row block the
        # loop is static (the head loop is then the innermost, whose loads tileiras pipelines).
        if BLOCK_K == CHUNK:
            first_k, end_k = 0, 1
        else:
            first_k = (m * BLOCK_M) // BLOCK_K
            end_k = ct.cdiv(ct.minimum(seqlen - c * CHUNK, CHUNK), BLOCK_K)
        # One row block, the whole chunk: the rows l of the intra-chunk term are the rows s, so their dA is
        # dA_s. With the head's x rows loaded once (operand and f32) and dA_last taken from dA_s, three loads
        # per head fewer.
        WHOLE_CHUNK = BLOCK_M == CHUNK and BLOCK_K == CHUNK
        dB_acc = ct.zeros((BLOCK_M, DSTATE), dtype=ct.float32)              # [BLOCK_M, DSTATE]
        if SUM_HEADS:
            # One row block, the whole chunk: its C and B·Cᵀ serve every head, and the heads' dCB are
            # summed before the one product with C.
            C_chunk, bc_chunk = group_rows_and_products(C, b, c, g, B_s, CHUNK, CHUNK, DSTATE, LOAD_LAT, op_dtype)
            dcb_sum = ct.zeros((CHUNK, CHUNK), dtype=ct.float32)

        for t in range(HEADS_PER_BLOCK):
            h = first_head + t
            x_rows = ct.load(x, index=(b, s_tile, h, 0), shape=(1, BLOCK_M, 1, HEADDIM),
                             padding_mode=ct.PaddingMode.ZERO, latency=LOAD_LAT).reshape((BLOCK_M, HEADDIM))
            x_op = x_rows.astype(op_dtype)
            dA_s = load_chunk_vector(dA_cumsum, b, h, c, m, BLOCK_M)         # [BLOCK_M]
            delta_s = load_chunk_vector(dt_out, b, h, c, m, BLOCK_M)
            if BLOCK_M == CHUNK:
                dA_last = ct.extract(dA_s, index=(CHUNK - 1,), shape=(1,))
            else:
                dA_last = ct.load(dA_cumsum, index=(b, h, c, CHUNK - 1), shape=(1, 1, 1, 1)).reshape((1,))
            # End-state term: acc_s = k_s w_s G B_s, dB_s += k_s w_s Δ_s x_s G, U_s.
            G = ct.load(dstates, index=(b, c, h, 0, 0), shape=(1, 1, 1, HEADDIM, DSTATE), latency=LOAD_LAT
                        ).reshape((HEADDIM, DSTATE))
            G_op = operand(G, x.dtype, op_dtype)                             # [HEADDIM, DSTATE]
            state_scale = ct.exp(ct.minimum(dA_last - dA_s, 0.0))            # k_s w_s
            if HAS_SEQ_IDX:
                state_scale = ct.where((ids_s == end_id) & (end_id >= 0), state_scale, 0.0)
            b_g = ct.mma(B_s, G_op.transpose(), ct.zeros((BLOCK_M, HEADDIM), dtype=ct.float32))
            acc = b_g * state_scale[:, None]                                 # [BLOCK_M, HEADDIM]
            x_s = x_rows.astype(ct.float32)
            ddt_s = ct.sum(acc * x_s, axis=1)                                # acc_s · x_s so far: [BLOCK_M]
            store_chunk_vector(ddA_state, b, h, c, m, delta_s * ddt_s, BLOCK_M)
            dB_acc = ct.mma(operand(x_s * (state_scale * delta_s)[:, None], x.dtype, op_dtype), G_op, dB_acc)

            # Intra-chunk term, row blocks l >= s.
            for k in range(first_k, end_k):
                l_tile = c * (CHUNK // BLOCK_K) + k
                rows = k * BLOCK_K + ct.arange(BLOCK_K, dtype=ct.int32)
                if SUM_HEADS:
                    C_l, bc = C_chunk, bc_chunk
                else:
                    C_l, bc = group_rows_and_products(C, b, l_tile, g, B_s, BLOCK_M, BLOCK_K, DSTATE, LOAD_LAT,
                                                      op_dtype)
                dy_l = ct.load(dy, index=(b, l_tile, h, 0), shape=(1, BLOCK_K, 1, HEADDIM),
                               padding_mode=ct.PaddingMode.ZERO, latency=LOAD_LAT
                               ).reshape((BLOCK_K, HEADDIM)).astype(op_dtype)
                if WHOLE_CHUNK:
                    dA_l = dA_s
                else:
                    dA_l = load_chunk_vector(dA_cumsum, b, h, c, k, BLOCK_K)
                keep = cols[:, None] <= rows[None, :]                        # [BLOCK_M, BLOCK_K]: s <= l
                if HAS_SEQ_IDX:
                    keep = keep & (ids_s[:, None] == row_ids(seq_idx, b, l_tile, BLOCK_K)[None, :])
                # Φ[l, s] at [s, l]
                decay = exp2_ftz(ct.minimum((dA_l * LOG2E)[None, :] - (dA_s * LOG2E)[:, None], 0.0))
                scores = operand(ct.where(keep, bc * decay, 0.0), x.dtype, op_dtype)
                acc = ct.mma(scores, dy_l, acc)
                x_dy = ct.mma(x_op, dy_l.transpose(), ct.zeros((BLOCK_M, BLOCK_K), dtype=ct.float32))
                # (scores · dy_l) · x_s summed over the scores' columns instead: no x_s after the loop.
                ddt_s = ddt_s + ct.sum(scores.astype(ct.float32) * x_dy, axis=1)
                dcb = ct.where(keep, x_dy * decay * delta_s[:, None], 0.0)   # dCB[l, s] at [s, l]
                if SUM_HEADS:
                    dcb_sum = dcb_sum + dcb
                else:
                    dB_acc = ct.mma(operand(dcb, x.dtype, op_dtype), C_l, dB_acc)

            # Reloaded rather than kept live across the row loop (it would spill).
            dy_s = head_rows(dy, b, s_tile, h, BLOCK_M, HEADDIM)
            D_h = ct.load(D, index=(h, 0), shape=(1, HEADDIM)).reshape((HEADDIM,))
            row_scale = delta_s
            if HAS_REACH:
                # + 0 leaves the row as it is; + NaN makes the whole row of dx NaN (the op's reach term).
                row_scale = row_scale + load_chunk_vector(reach, b, h, c, m, BLOCK_M)
            dx_s = acc * row_scale[:, None] + dy_s * D_h[None, :]
            ct.store(dx, index=(b, s_tile, h, 0), tile=dx_s.reshape((1, BLOCK_M, 1, HEADDIM)).astype(dx.dtype))
            store_chunk_vector(ddt_out, b, h, c, m, ddt_s, BLOCK_M)

        if SUM_HEADS:
            dB_acc = ct.mma(operand(dcb_sum, x.dtype, op_dtype), C_chunk, dB_acc)
        store_group_sum(dB, dB_acc, b, s_tile, g, BLOCK_M, DSTATE, ATOMIC_ADD)


CHUNK_SCAN_BWD_DX_KERNELS = int64_index_kernels(chunk_scan_bwd_dx_kernel)


# The row pass's tiles; see _block_pass_config.py.
ChunkScanBwdDxConfig = BlockPassConfig


def chunk_scan_bwd_dx_default_config(dims: SSDDims) -> BlockPassConfig:
    """Whole chunks summing their heads' dCB at latency 4 where `sums_heads_by_default`, else the shared
    default. Latency 4 measured faster than 2 (and never slower at the benchmark shapes): with the static row
    loop of whole-chunk blocks the hint also reaches the head loop's x and dstates loads."""
    if sums_heads_by_default(dims):
        return dataclasses.replace(summing_heads_config(dims), LOAD_LAT=4)
    return block_pass_default_config(dims)


def chunk_scan_bwd_dx_launch(dims: SSDDims, cfg: ChunkScanBwdDxConfig | None = None, *,
                             heads_per_block: int = 1) -> Launch:
    """The launch writing ("dx", "dB", "ddt_out", "ddA_state"), reading the output gradient "dout" (and
    "dx_reach", added to the rows of dx, where `dims.has_reach`). dB is added atomically unless one block owns
    the whole group."""
    return block_pass_launch(CHUNK_SCAN_BWD_DX_KERNELS, dims, cfg or chunk_scan_bwd_dx_default_config(dims),
                             heads_per_block, writes=("dx", "dB", "ddt_out", "ddA_state"),
                             arrays={"dy": "dout", "reach": "dx_reach"},
                             HAS_REACH=dims.has_reach)


CHUNK_SCAN_BWD_DX_STAGE = Stage(
    name="chunk_scan_bwd_dx", config_type=BlockPassConfig, space=block_pass_configs,
    default=chunk_scan_bwd_dx_default_config, launch=chunk_scan_bwd_dx_launch, key_fields=BLOCK_PASS_KEY_FIELDS,
    work_items=block_pass_work_items, blocks_span_heads=True)
