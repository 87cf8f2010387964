"""Device helpers shared by the kernel stages: per-chunk vectors and the seq_idx rules.

Notation of every backward docstring: batch b, head h, group g = h // (nheads/ngroups),
chunk c of Q = CHUNK tokens with local rows l, s; dA = dA_cumsum[b, h, c] (natural-log units, flat past
seqlen), Δ = dt_out[b, h, c] (0 past seqlen), H_c = states[b, c, h] the chunk-ENTRY state, y the pre-gate
output, dy = ∂L/∂y (= dout * silu(z) with a gate, else dout). With seq_idx, ids_l is the id of row l,
e_c the id of chunk c's last valid token and e_{-1} = 0:

    causal pairs      M[l, s] = (s <= l) & (ids_l == ids_s)
    state rows        k_s     = (ids_s == e_c) & (e_c >= 0)         (tokens chunk c's end state keeps)
    inter rows        r_l     = (ids_l == e_{c-1})                   (rows the entry state H_c reaches)
    carry             m_c     = (e_c == e_{c-1})                     (H_c survives chunk c)

Without seq_idx all of M's id tests, k, r and m are true. These are exactly the rules of the forward
kernels (chunk_state.py, chunk_scan.py), so each backward stage differentiates what the forward computed.
"""
import cuda.tile as ct

# Below every real sequence id: the max over a chunk's valid rows ignores the padded ones.
_ID_FLOOR = -(1 << 30)


def batch_head_group(bh, nheads, ngroups):
    """(b, h, g) of a grid index over batch * nheads: the batch row, the head and the head's group."""
    h = bh % nheads
    return bh // nheads, h, h // (nheads // ngroups)


def load_chunk_vector(array, b, h, c, block, BLOCK):
    """Rows [block*BLOCK, (block+1)*BLOCK) of array[b, h, c] for a (batch, nheads, nchunks, CHUNK)
    f32 array (dt_out, dA_cumsum and the backward's per-row buffers) -> [BLOCK] f32."""
    return ct.load(array, index=(b, h, c, block), shape=(1, 1, 1, BLOCK)).reshape((BLOCK,))


def store_chunk_vector(array, b, h, c, block, tile, BLOCK):
    """Stores a [BLOCK] tile at rows [block*BLOCK, (block+1)*BLOCK) of array[b, h, c]."""
    ct.store(array, index=(b, h, c, block), tile=tile.reshape((1, 1, 1, BLOCK)))


def row_ids(seq_idx, b, row_tile, BLOCK):
    """The sequence ids of rows [row_tile*BLOCK, (row_tile+1)*BLOCK) of batch row b -> [BLOCK] int32."""
    return ct.load(seq_idx, index=(b, row_tile), shape=(1, BLOCK),
                   padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK,))


def previous_chunk_end_id(seq_idx, b, c, CHUNK):
    """e_{c-1}: the id of token c*CHUNK - 1 (chunk c-1 is full), 0 for the first chunk -> [1] int32."""
    last = ct.load(seq_idx, index=(b, ct.maximum(c * CHUNK - 1, 0)), shape=(1, 1)).reshape((1,))
    return ct.where(c > 0, last, 0)


def last_valid_id(ids, c, seqlen, CHUNK):
    """e_c from chunk c's row ids [CHUNK]: the id of its last valid token (ids are nondecreasing: the
    max over its valid rows) -> [1] int32."""
    valid = c * CHUNK + ct.arange(CHUNK, dtype=ct.int32) < seqlen
    return ct.max(ct.where(valid, ids, _ID_FLOOR), axis=0, keepdims=True)


def chunk_end_id(seq_idx, b, c, seqlen, CHUNK):
    """e_c, loading chunk c's row ids -> [1] int32."""
    return last_valid_id(row_ids(seq_idx, b, c, CHUNK), c, seqlen, CHUNK)


def state_seq_rules(seq_idx, b, c, seqlen, CHUNK, prev_end_id, state_scale, carry):
    """The seq_idx rules of chunk c's state update given e_{c-1} = prev_end_id: the token weights
    `state_scale` [CHUNK] kept only for tokens of the chunk's last sequence (k), the `carry` [1] only
    where that sequence continues the previous chunk's (m) -> (ids [CHUNK], e_c [1], state_scale, carry)."""
    ids = row_ids(seq_idx, b, c, CHUNK)
    end_id = last_valid_id(ids, c, seqlen, CHUNK)
    return ids, end_id, ct.where(ids == end_id, state_scale, 0.0), ct.where(end_id == prev_end_id, carry, 0.0)


def group_rows_and_products(array, b, row_tile, g, own_rows, ROWS, BLOCK, DSTATE, LOAD_LAT, op_dtype):
    """Rows [row_tile*BLOCK, (row_tile+1)*BLOCK) of group g of a (batch, seqlen, ngroups, dstate) array (B
    or C) as an mma operand [BLOCK, DSTATE] (0 past seqlen), and the products own_rows · rowsᵀ [ROWS, BLOCK]
    f32 with a block's own rows own_rows [ROWS, DSTATE] (C·Bᵀ in bwd_dc, B·Cᵀ in bwd_dx)."""
    rows = ct.load(array, index=(b, row_tile, g, 0), shape=(1, BLOCK, 1, DSTATE),
                   padding_mode=ct.PaddingMode.ZERO, latency=LOAD_LAT).reshape((BLOCK, DSTATE)).astype(op_dtype)
    return rows, ct.mma(own_rows, rows.transpose(), ct.zeros((ROWS, BLOCK), dtype=ct.float32))


def operand(tile, dtype, mma_dtype):
    """`tile` rounded to the data dtype `dtype` and presented to ct.mma as `mma_dtype` (tf32 for f32
    data), the precision mamba_ssm's backward dots use for their f32 intermediates."""
    return tile.astype(dtype).astype(mma_dtype)


def head_rows(array, b, row_tile, h, BLOCK_M, HEADDIM):
    """Rows [row_tile*BLOCK_M, (row_tile+1)*BLOCK_M) of head h of a (batch, seqlen, nheads, headdim)
    array -> [BLOCK_M, HEADDIM] f32 (0 past seqlen)."""
    return ct.load(array, index=(b, row_tile, h, 0), shape=(1, BLOCK_M, 1, HEADDIM),
                   padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_M, HEADDIM)).astype(ct.float32)


def block_pass_tile(nheads, ngroups, CHUNK, BLOCK_M, HEADS_PER_BLOCK, LAST_FIRST):
    """Device helper: (b, c, m, first_head, g) of this block in the grid of the intra-chunk backward passes
    (`_block_pass_config.block_pass_grid`): batch row, chunk, row block of the chunk, the first of the block's
    HEADS_PER_BLOCK heads and their group. Head splits vary fastest, then the row blocks (the chunk's last
    first with LAST_FIRST), then the chunks; batch rows on grid axis 1."""
    num_m_blocks = CHUNK // BLOCK_M
    tile_id = ct.bid(0)
    num_splits = nheads // HEADS_PER_BLOCK
    split = tile_id % num_splits
    tile_id = tile_id // num_splits
    if LAST_FIRST:
        m = num_m_blocks - 1 - tile_id % num_m_blocks
    else:
        m = tile_id % num_m_blocks
    c = tile_id // num_m_blocks
    b = ct.bid(1)
    first_head = split * HEADS_PER_BLOCK
    return b, c, m, first_head, first_head // (nheads // ngroups)


def store_group_sum(array, acc, b, row_tile, g, BLOCK_M, DSTATE, ATOMIC_ADD):
    """Writes a block's sum over its heads of group g's rows [BLOCK_M, DSTATE] f32 (dB or dC) into `array`:
    added atomically (ATOMIC_ADD: the group spans several blocks; f32, zero-initialised), else stored in the
    array's dtype (the block owns the group)."""
    tile = acc.reshape((1, BLOCK_M, 1, DSTATE))
    if ATOMIC_ADD:
        array.tiled_view((1, BLOCK_M, 1, DSTATE)).atomic_store_add((b, row_tile, g, 0), tile)
    else:
        ct.store(array, index=(b, row_tile, g, 0), tile=tile.astype(array.dtype))
