"""Backward of chunk_scan, row pass: dC, dD and the dA_cumsum gradients of the output (see _tiles.py for
the notation).

The forward (chunk_scan.py) computes, for the rows l of chunk c of head h,

    y_l   = r_l exp(dA_l) (C_l · H_c)  +  Σ_s M[l,s] (C_l · B_s) Φ[l,s] Δ_s x_s  +  D ⊙ x_l

with Φ[l,s] = exp(min(dA_l - dA_s, 0)). Given dy = ∂L/∂y (the backward kernels are gate-free: a gate's
VJP is taken outside them, see bridge/ops.py) this pass computes, per row l:

    dCB[l,s] = M[l,s] Φ[l,s] Δ_s (dy_l · x_s)                    (∂L/∂(C_l · B_s) of one head)
    dC_l   = Σ_{h in group} [ r_l exp(dA_l) dy_l H_c  +  Σ_s dCB[l,s] B_s ]
    dD    += Σ_l dy_l ⊙ x_l                                       (per (batch, chunk, row block) partials)

and the dA_cumsum gradients that the output terms contribute. The inter-chunk term gives
∂L/∂dA_l = V_l = r_l exp(dA_l) (dy_l · C_l H_c^T), stored as `ddA_inter`. In the intra-chunk term the
pair (l, s) contributes T[l,s] = dCB[l,s] (C_l · B_s) to the loss's sensitivity to Φ[l,s], and
∂Φ[l,s]/∂dA_l = -∂Φ[l,s]/∂dA_s = Φ[l,s], so ∂L/∂dA_j = Σ_s T[j,s] - Σ_l T[l,j]. chunk_cumsum_bwd needs
the reverse cumsum R_r = Σ_{j>=r} ∂L/∂dA_j (the gradient w.r.t. the decay increment Δ_r A). Summed
naively, the pairs with l >= s >= r enter once with + and once with - and cancel only up to rounding
(mamba_ssm's "unstable" form); dropping them exactly ("stable", as `_chunk_scan_bwd_ddAcs_stable`) leaves
the pairs that straddle r:

    R^intra_r = Σ_{l >= r} Σ_{s < r} T[l,s].

A block owns rows l of one row block and walks the key blocks up to its diagonal, keeping the row sums of
T over the key blocks done so far; for key block k it adds Σ_{l >= r} (carry_l + Σ_{s<r, s in k} T[l,s])
to R^intra_r for the r of block k. These per-row-block pieces go to `ddA_intra[b, h, c, m, :]` (only
entries r < (m+1) BLOCK_M are written) and chunk_cumsum_bwd sums them over m in a fixed order. With one
key block (BLOCK_K = CHUNK) there is no carry and the straddling sum is a product,

    R^intra_r = Σ_s [s < r] Z[r, s],   Z = U T,   U[r, l] = [l >= r]  (l in the row block),

one tf32 mma and a row sum instead of a cumulative sum and a sum across rows (shared memory and
barriers); the key loop is then static.

SUM_HEADS (BLOCK_M = BLOCK_K = CHUNK): the one key block is the whole chunk, so its B and C·Bᵀ are loaded
and computed once for all the block's heads, and the heads' dCB are summed in f32 before a single product
with B (Σ_h dCB_h B = (Σ_h dCB_h) B: one [CHUNK x CHUNK x dstate] product per block instead of one per head;
the sum is rounded to x's dtype once).

Heads of a group share dC: a block loops over HEADS_PER_BLOCK heads of one group, accumulating dC in f32,
then adds it to dC atomically (ATOMIC_ADD, zero-initialised dC) or stores it (HEADS_PER_BLOCK = heads per
group: one block owns the group, bitwise deterministic). C B^T is recomputed per head (the price of not
materialising per-head Q x Q matrices).

Precision: mma operands in x's dtype (tf32 for f32 inputs); dy, the states H_c, dCB and the scores are
rounded to x's dtype before their products, as mamba_ssm does; T enters U T in tf32 (U is exact);
accumulation and everything elementwise in f32.

Grid: (nheads/HEADS_PER_BLOCK * CHUNK/BLOCK_M * nchunks, batch), head splits fastest, the heaviest row
blocks (near the chunk end) first. Row blocks wholly past seqlen do nothing.

Shapes: x, dout (= dy) (batch, seqlen, nheads, headdim) T; B, C (batch, seqlen, ngroups, dstate) T; dt_out,
dA_cumsum, ddA_inter (batch, nheads, nchunks, CHUNK) f32; states (batch, nchunks, nheads, headdim, dstate) T;
seq_idx (batch, seqlen) int32 or a dummy; dC (batch, seqlen, ngroups, dstate) f32 if added atomically, else T;
ddA_intra (batch, nheads, nchunks, CHUNK/BLOCK_M, CHUNK) f32; dD_partials (batch * nchunks * CHUNK/BLOCK_M,
nheads, headdim) f32.
"""
import dataclasses

import cuda.tile as ct

from jax_mamba2.kernels._block_pass_config import (
    BLOCK_PASS_KEY_FIELDS, BlockPassConfig, block_pass_configs, block_pass_default_config, block_pass_launch,
    block_pass_work_items, summing_heads_config, sums_heads_by_default)
from jax_mamba2.kernels._common import (
    LOG2E, Big, ConstBool, ConstInt, Launch, SSDDims, Stage, exp2_ftz, int64_index_kernels, mma_dtype)
from jax_mamba2.kernels._tiles import (
    block_pass_tile, group_rows_and_products, head_rows, load_chunk_vector, operand, previous_chunk_end_id,
    row_ids, store_chunk_vector, store_group_sum)


def _store_dD_partial(dD_partials, b, c, m, h, nchunks, num_m_blocks, dy_m, x_rows, HEADDIM):
    """dD_partials[(b, c, m), h] = Σ_l dy_l ⊙ x_l over the row block: dy_m [BLOCK_M, HEADDIM] f32, x_rows
    [BLOCK_M, HEADDIM] in x's dtype."""
    ct.store(dD_partials, index=((b * nchunks + c) * num_m_blocks + m, h, 0),
             tile=ct.sum(dy_m * x_rows.astype(ct.float32), axis=0).reshape((1, 1, HEADDIM)))


def chunk_scan_bwd_dc_kernel(
    x: Big,               # (batch, seqlen, nheads, headdim) T
    B: Big,               # (batch, seqlen, ngroups, dstate) T
    C: Big,               # (batch, seqlen, ngroups, dstate) T
    dout: Big,            # (batch, seqlen, nheads, headdim) T, ∂L/∂y
    dt_out: Big,          # (batch, nheads, nchunks, CHUNK) f32
    dA_cumsum: Big,       # (batch, nheads, nchunks, CHUNK) f32
    states: Big,          # (batch, nchunks, nheads, headdim, dstate) T, chunk-entry states
    seq_idx: Big,         # (batch, seqlen) int32, or a dummy without HAS_SEQ_IDX
    dC: Big,              # (batch, seqlen, ngroups, dstate) written, f32 zero-initialised if ATOMIC_ADD, else T
    ddA_intra: Big,       # (batch, nheads, nchunks, CHUNK/BLOCK_M, CHUNK) f32, written
    ddA_inter: Big,       # (batch, nheads, nchunks, CHUNK) f32, written
    dD_partials: Big,     # (batch * nchunks * CHUNK/BLOCK_M, nheads, headdim) f32, written
    CHUNK: ConstInt,
    HEADDIM: ConstInt,
    DSTATE: ConstInt,
    BLOCK_M: ConstInt,    # rows per block
    BLOCK_K: ConstInt,    # keys per inner step
    HEADS_PER_BLOCK: ConstInt,
    HAS_SEQ_IDX: ConstBool,
    ATOMIC_ADD: ConstBool,
    LOAD_LAT: ConstInt,   # latency hint of the key-loop loads (1..10)
    SUM_HEADS: ConstBool,  # one whole-chunk key block; C·Bᵀ once, the heads' dCB summed (BlockPassConfig)
):
    seqlen = x.shape[1]
    num_m_blocks = CHUNK // BLOCK_M
    b, c, m, first_head, g = block_pass_tile(x.shape[2], C.shape[2], CHUNK, BLOCK_M, HEADS_PER_BLOCK, True)
    nchunks = ct.cdiv(seqlen, CHUNK)
    op_dtype = mma_dtype(x.dtype)

    # A row block wholly past seqlen has nothing to write, and its loads would lie outside the arrays.
    if c * CHUNK + m * BLOCK_M < seqlen:
        m_tile = c * num_m_blocks + m                    # row-block index along seqlen
        rows = m * BLOCK_M + ct.arange(BLOCK_M, dtype=ct.int32)
        C_m = ct.load(C, index=(b, m_tile, g, 0), shape=(1, BLOCK_M, 1, DSTATE),
                      padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_M, DSTATE)).astype(op_dtype)
        if HAS_SEQ_IDX:
            ids_m = row_ids(seq_idx, b, m_tile, BLOCK_M)
            prev_end_id = previous_chunk_end_id(seq_idx, b, c, CHUNK)
        # Key blocks up to the diagonal that hold a valid token (a wholly out-of-bounds load is undefined).
        num_k_blocks = ct.cdiv(ct.minimum((m + 1) * BLOCK_M, seqlen - c * CHUNK), BLOCK_K)
        dC_acc = ct.zeros((BLOCK_M, DSTATE), dtype=ct.float32)              # [BLOCK_M, DSTATE]
        # With one whole-chunk key block the dD partial is taken from the key rows (they are the rows l) as
        # they arrive, instead of reloading x and dout after the key loop (two loads fewer per head).
        DD_FROM_KEYS = BLOCK_M == CHUNK and BLOCK_K == CHUNK
        if BLOCK_K == CHUNK:
            # One key block, so no carry, and R^intra is a product: R_r = Σ_s [s < r] (U T)[r, s] with
            # U[r, l] = [l >= r] (exact in tf32), instead of a cumulative and a cross-row sum.
            keys = ct.arange(CHUNK, dtype=ct.int32)
            suffix_ones = ct.where(rows[None, :] >= keys[:, None], 1.0, 0.0).astype(ct.tfloat32)
            below_diagonal = keys[None, :] < keys[:, None]                  # [r, s]: s < r
        if SUM_HEADS:
            # One key block, the whole chunk: its B and C·Bᵀ serve every head, and the heads' dCB are
            # summed before the one product with B.
            B_chunk, cb_chunk = group_rows_and_products(B, b, c, g, C_m, CHUNK, CHUNK, DSTATE, LOAD_LAT, op_dtype)
            dcb_sum = ct.zeros((CHUNK, CHUNK), dtype=ct.float32)

        for t in range(HEADS_PER_BLOCK):
            h = first_head + t
            dA_m = load_chunk_vector(dA_cumsum, b, h, c, m, BLOCK_M)         # [BLOCK_M]
            dy_m = head_rows(dout, b, m_tile, h, BLOCK_M, HEADDIM)          # [BLOCK_M, HEADDIM] f32
            dy_op = operand(dy_m, x.dtype, op_dtype)

            # Inter-chunk term: y_l = r_l exp(dA_l) C_l H_c^T, V_l = dy_l · y_l, dC_l += r_l exp(dA_l) dy_l H_c.
            H_c = ct.load(states, index=(b, c, h, 0, 0), shape=(1, 1, 1, HEADDIM, DSTATE)
                          ).reshape((HEADDIM, DSTATE))
            H_op = operand(H_c, x.dtype, op_dtype)                           # [HEADDIM, DSTATE]
            inter_scale = ct.exp(dA_m)
            if HAS_SEQ_IDX:
                inter_scale = ct.where(ids_m == prev_end_id, inter_scale, 0.0)
            y_m = ct.mma(C_m, H_op.transpose(), ct.zeros((BLOCK_M, HEADDIM), dtype=ct.float32))
            y_m = y_m * inter_scale[:, None]                                 # [BLOCK_M, HEADDIM]
            store_chunk_vector(ddA_inter, b, h, c, m, ct.sum(dy_m * y_m, axis=1), BLOCK_M)
            dC_acc = ct.mma(operand(dy_m * inter_scale[:, None], x.dtype, op_dtype), H_op, dC_acc)

            # Intra-chunk term, key blocks up to the diagonal.
            row_carry = ct.zeros((BLOCK_M,), dtype=ct.float32)   # Σ_{s in earlier key blocks} T[l, s]
            # With one key block the loop is static (the head loop is then the innermost: tileiras pipelines
            # its loads, and fewer values stay live; sm_90 cubins spill less).
            for k in range(1 if BLOCK_K == CHUNK else num_k_blocks):
                k_tile = c * (CHUNK // BLOCK_K) + k
                cols = k * BLOCK_K + ct.arange(BLOCK_K, dtype=ct.int32)
                if SUM_HEADS:
                    B_k, cb = B_chunk, cb_chunk
                else:
                    B_k, cb = group_rows_and_products(B, b, k_tile, g, C_m, BLOCK_M, BLOCK_K, DSTATE, LOAD_LAT,
                                                      op_dtype)
                x_rows = ct.load(x, index=(b, k_tile, h, 0), shape=(1, BLOCK_K, 1, HEADDIM),
                                 padding_mode=ct.PaddingMode.ZERO, latency=LOAD_LAT).reshape((BLOCK_K, HEADDIM))
                x_k = x_rows.astype(op_dtype)
                if DD_FROM_KEYS:
                    _store_dD_partial(dD_partials, b, c, m, h, nchunks, num_m_blocks, dy_m, x_rows, HEADDIM)
                dA_k = load_chunk_vector(dA_cumsum, b, h, c, k, BLOCK_K)
                delta_k = load_chunk_vector(dt_out, b, h, c, k, BLOCK_K)
                causal = rows[:, None] >= cols[None, :]                      # [BLOCK_M, BLOCK_K]
                keep = causal
                if HAS_SEQ_IDX:
                    keep = keep & (ids_m[:, None] == row_ids(seq_idx, b, k_tile, BLOCK_K)[None, :])
                decay = exp2_ftz(ct.minimum((dA_m * LOG2E)[:, None] - (dA_k * LOG2E)[None, :], 0.0))
                decay_dt = decay * delta_k[None, :]
                dy_x = ct.mma(dy_op, x_k.transpose(), ct.zeros((BLOCK_M, BLOCK_K), dtype=ct.float32))
                dcb = ct.where(keep, dy_x * decay_dt, 0.0)                   # dCB[l, s]
                if SUM_HEADS:
                    dcb_sum = dcb_sum + dcb
                else:
                    dC_acc = ct.mma(operand(dcb, x.dtype, op_dtype), B_k, dC_acc)
                # R^intra_r += Σ_{l >= r} (carry_l + Σ_{s < r in this block} T[l, s]), r in this block.
                t_ls = dcb * cb
                if BLOCK_K == CHUNK:
                    suffix_t = ct.mma(suffix_ones, t_ls.astype(ct.tfloat32),
                                      ct.zeros((CHUNK, CHUNK), dtype=ct.float32))
                    ddA_part = ct.sum(ct.where(below_diagonal, suffix_t, 0.0), axis=1)
                else:
                    below_r = ct.cumsum(t_ls, axis=1) - t_ls + row_carry[:, None]
                    ddA_part = ct.sum(ct.where(causal, below_r, 0.0), axis=0)   # [BLOCK_K]
                    row_carry = row_carry + ct.sum(t_ls, axis=1)
                ct.store(ddA_intra, index=(b, h, c, m, k), tile=ddA_part.reshape((1, 1, 1, 1, BLOCK_K)))

            if not DD_FROM_KEYS:
                # Reloaded rather than kept live across the key loop (they would spill).
                x_m = head_rows(x, b, m_tile, h, BLOCK_M, HEADDIM)
                dy_m = head_rows(dout, b, m_tile, h, BLOCK_M, HEADDIM)
                _store_dD_partial(dD_partials, b, c, m, h, nchunks, num_m_blocks, dy_m, x_m, HEADDIM)

        if SUM_HEADS:
            dC_acc = ct.mma(operand(dcb_sum, x.dtype, op_dtype), B_chunk, dC_acc)
        store_group_sum(dC, dC_acc, b, m_tile, g, BLOCK_M, DSTATE, ATOMIC_ADD)


CHUNK_SCAN_BWD_DC_KERNELS = int64_index_kernels(chunk_scan_bwd_dc_kernel)


# The row pass's tiles; see _block_pass_config.py.
ChunkScanBwdDcConfig = BlockPassConfig


def chunk_scan_bwd_dc_default_config(dims: SSDDims) -> BlockPassConfig:
    """Whole chunks summing their heads' dCB where `sums_heads_by_default` (with one key block R^intra is a
    product and the key loop static). Elsewhere the shared default with 32-key steps at latency 2: this pass
    keeps four live [rows x keys] f32 products per step (two in dx), so smaller steps and a shorter
    pipeline measured faster."""
    if sums_heads_by_default(dims):
        return summing_heads_config(dims)
    return dataclasses.replace(block_pass_default_config(dims), BLOCK_K=32, LOAD_LAT=2)


def chunk_scan_bwd_dc_launch(dims: SSDDims, cfg: ChunkScanBwdDcConfig | None = None, *,
                             heads_per_block: int = 1) -> Launch:
    """The launch writing ("dC", "ddA_intra", "ddA_inter", "dD_partials").

    `heads_per_block` heads of one group share a block (it must divide heads_per_group); dC is added
    atomically unless one block owns the whole group.
    """
    return block_pass_launch(CHUNK_SCAN_BWD_DC_KERNELS, dims, cfg or chunk_scan_bwd_dc_default_config(dims),
                             heads_per_block, writes=("dC", "ddA_intra", "ddA_inter", "dD_partials"))


CHUNK_SCAN_BWD_DC_STAGE = Stage(
    name="chunk_scan_bwd_dc", config_type=BlockPassConfig, space=block_pass_configs,
    default=chunk_scan_bwd_dc_default_config, launch=chunk_scan_bwd_dc_launch, key_fields=BLOCK_PASS_KEY_FIELDS,
    work_items=block_pass_work_items, blocks_span_heads=True)
