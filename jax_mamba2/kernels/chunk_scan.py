"""Stage 4 of the SSD forward: the outputs, from the chunk-entry states and the causal intra-chunk term.

Mirrors `reference.chunk_scan` (mamba_ssm `_bmm_chunk_fwd` + `_chunk_scan_fwd`, fused). For batch b,
head h (group g = h // (nheads / ngroups)), chunk c, rows l of the chunk, dA = dA_cumsum[b, h, c],
Δ = dt_out[b, h, c], H_c = states[b, c, h]:

    y[l] = exp(dA[l]) * (C[l] @ H_c^T)                                         (inter-chunk)
         + Σ_{s<=l} (C[l] · B[s]) * exp(min(dA[l] - dA[s], 0)) * Δ[s] * x[s]     (intra-chunk)
         + D[h] * x[l]
    out[l] = y[l] * silu(z[l])   if HAS_Z (the gate comes after D)

With seq_idx: the inter-chunk term only reaches rows whose id equals the id of the last token of chunk
c-1 (0 for c = 0), and the intra-chunk pairs (l, s) need equal ids.

Like flash attention, a block owns BLOCK_M rows x BLOCK_P columns of (b, h, c) and walks the key
blocks k <= its row block, skipping those above the diagonal. Precision follows mamba_ssm: C, B, x, H_c
enter the mma in x's dtype (tf32 for f32 inputs; H_c is rounded to it), the decayed score matrix
C B^T * exp(..) * Δ is rounded to x's dtype before multiplying x, everything accumulates in f32, and
D and the gate are applied in f32 before one final rounding.

A block computes HEADS heads of one group at once: the C B^T product of a (row, key) block pair is
computed once and reused by every head (batched [HEADS, ...] mma for the rest).

Grid: (nheads/HEADS * headdim/BLOCK_P * CHUNK/BLOCK_M * nchunks, batch), head blocks fastest (heads of
a group share the C and B tiles in L2), the heaviest row blocks (near the chunk end) first.

Shapes: x, z, out (batch, seqlen, nheads, headdim) T (z a dummy without HAS_Z); B, C (batch, seqlen,
ngroups, dstate) T; D (nheads, headdim) f32; dt_out, dA_cumsum (batch, nheads, nchunks, chunk_size) f32;
states (batch, nchunks, nheads, headdim, dstate) T or f32; seq_idx (batch, seqlen) int32 or a dummy.
"""
import dataclasses

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    ConstBool, ConstInt, Launch, SSDDims, check_arch, int64_index_kernels, mma_dtype, select_kernel)


def _silu_gate(acc, z_tile):
    """acc * silu(z), in f32 (exp(-z) -> inf for very negative z gives -0, never NaN)."""
    z32 = z_tile.astype(ct.float32)
    return acc * z32 / (1.0 + ct.exp(-z32))


def _load_heads(array, b, row_tile, hb, pb, BLOCK_ROWS, HEADS, BLOCK_P):
    """The [HEADS, BLOCK_ROWS, BLOCK_P] tile of a (batch, seqlen, nheads, headdim) array (zero padded)."""
    tile = ct.load(array, index=(b, row_tile, hb, pb), shape=(1, BLOCK_ROWS, HEADS, BLOCK_P),
                   padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_ROWS, HEADS, BLOCK_P))
    return ct.permute(tile, (1, 0, 2))


def _chunk_scan_fwd_body(x, B, C, D, z, dt_out, dA_cumsum, states, seq_idx, out, CHUNK, DSTATE, HEADS,
                         BLOCK_M, BLOCK_K, BLOCK_P, HAS_Z, HAS_SEQ_IDX, LOAD_LAT):
    seqlen = x.shape[1]
    num_head_blocks = x.shape[2] // HEADS
    num_p_blocks = x.shape[3] // BLOCK_P
    num_m_blocks = CHUNK // BLOCK_M
    tile_id = ct.bid(0)
    hb = tile_id % num_head_blocks
    tile_id = tile_id // num_head_blocks
    pb = tile_id % num_p_blocks
    tile_id = tile_id // num_p_blocks
    m = num_m_blocks - 1 - tile_id % num_m_blocks
    c = tile_id // num_m_blocks
    b = ct.bid(1)
    g = hb * HEADS // (x.shape[2] // B.shape[2])       # HEADS divides nheads / ngroups: one group
    operand_dtype = mma_dtype(x.dtype)

    # A row block wholly past seqlen (partial last chunk) has nothing to store; its loads would lie
    # entirely out of bounds, which ct.load leaves undefined.
    if c * CHUNK + m * BLOCK_M < seqlen:
        m_tile = c * num_m_blocks + m                    # row-block index along seqlen
        rows = m * BLOCK_M + ct.arange(BLOCK_M, dtype=ct.int32)
        C_m = ct.load(C, index=(b, m_tile, g, 0), shape=(1, BLOCK_M, 1, DSTATE),
                      padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_M, DSTATE)).astype(operand_dtype)
        dA_m = ct.load(dA_cumsum, index=(b, hb, c, m), shape=(1, HEADS, 1, BLOCK_M)
                       ).reshape((HEADS, BLOCK_M))

        # Inter-chunk: exp(dA[l]) * C[l] @ H_c^T, per head.
        H_c = ct.load(states, index=(b, c, hb, pb, 0), shape=(1, 1, HEADS, BLOCK_P, DSTATE)
                      ).reshape((HEADS, BLOCK_P, DSTATE))
        acc = ct.mma(C_m, ct.permute(H_c, (0, 2, 1)).astype(x.dtype).astype(operand_dtype),
                     ct.zeros((HEADS, BLOCK_M, BLOCK_P), dtype=ct.float32))   # [HEADS, BLOCK_M, BLOCK_P]
        inter_scale = ct.exp(dA_m)                                            # [HEADS, BLOCK_M]
        if HAS_SEQ_IDX:
            ids_m = ct.load(seq_idx, index=(b, m_tile), shape=(1, BLOCK_M),
                            padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_M,))
            prev_id = ct.load(seq_idx, index=(b, ct.maximum(c * CHUNK - 1, 0)), shape=(1, 1)
                              ).reshape((1,))
            prev_id = ct.where(c > 0, prev_id, 0)
            inter_scale = ct.where((ids_m == prev_id)[None, :], inter_scale, 0.0)
        acc = acc * inter_scale[:, :, None]

        # Intra-chunk: key blocks up to and including the diagonal; C B^T is shared by the HEADS heads.
        # Stop at seqlen too: with BLOCK_K < BLOCK_M a key block of a partial last chunk can lie wholly
        # past the end, and a wholly out-of-bounds load is undefined.
        num_k_blocks = ct.cdiv(ct.minimum((m + 1) * BLOCK_M, seqlen - c * CHUNK), BLOCK_K)
        for k in range(num_k_blocks):
            k_tile = c * (CHUNK // BLOCK_K) + k
            B_k = ct.load(B, index=(b, k_tile, g, 0), shape=(1, BLOCK_K, 1, DSTATE),
                          padding_mode=ct.PaddingMode.ZERO, latency=LOAD_LAT
                          ).reshape((BLOCK_K, DSTATE)).astype(operand_dtype)
            x_k = ct.permute(
                ct.load(x, index=(b, k_tile, hb, pb), shape=(1, BLOCK_K, HEADS, BLOCK_P),
                        padding_mode=ct.PaddingMode.ZERO, latency=LOAD_LAT
                        ).reshape((BLOCK_K, HEADS, BLOCK_P)),
                (1, 0, 2)).astype(operand_dtype)                              # [HEADS, BLOCK_K, BLOCK_P]
            dA_k = ct.load(dA_cumsum, index=(b, hb, c, k), shape=(1, HEADS, 1, BLOCK_K)
                           ).reshape((HEADS, BLOCK_K))
            delta_k = ct.load(dt_out, index=(b, hb, c, k), shape=(1, HEADS, 1, BLOCK_K)
                              ).reshape((HEADS, BLOCK_K))
            cb = ct.mma(C_m, B_k.transpose(), ct.zeros((BLOCK_M, BLOCK_K), dtype=ct.float32))
            cols = k * BLOCK_K + ct.arange(BLOCK_K, dtype=ct.int32)
            keep = rows[:, None] >= cols[None, :]                             # causal
            if HAS_SEQ_IDX:
                ids_k = ct.load(seq_idx, index=(b, k_tile), shape=(1, BLOCK_K),
                                padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_K,))
                keep = keep & (ids_m[:, None] == ids_k[None, :])
            decay = ct.exp(ct.minimum(dA_m[:, :, None] - dA_k[:, None, :], 0.0))
            scores = ct.where(keep[None, :, :], cb[None, :, :] * decay * delta_k[:, None, :], 0.0)
            acc = ct.mma(scores.astype(x.dtype).astype(operand_dtype), x_k, acc)

        x_m = _load_heads(x, b, m_tile, hb, pb, BLOCK_M, HEADS, BLOCK_P)      # [HEADS, BLOCK_M, BLOCK_P]
        D_p = ct.load(D, index=(hb, pb), shape=(HEADS, BLOCK_P))
        acc = acc + x_m.astype(ct.float32) * D_p[:, None, :]
        if HAS_Z:
            acc = _silu_gate(acc, _load_heads(z, b, m_tile, hb, pb, BLOCK_M, HEADS, BLOCK_P))
        ct.store(out, index=(b, m_tile, hb, pb),
                 tile=ct.permute(acc, (1, 0, 2)).reshape((1, BLOCK_M, HEADS, BLOCK_P)).astype(out.dtype))


def _make_chunk_scan_fwd_kernel(Big):
    @ct.kernel
    def chunk_scan_fwd_kernel(
        x: Big,               # (batch, seqlen, nheads, headdim) T
        B: Big,               # (batch, seqlen, ngroups, dstate) T
        C: Big,               # (batch, seqlen, ngroups, dstate) T
        D,                    # (nheads, headdim) f32
        z: Big,               # (batch, seqlen, nheads, headdim) T, or a dummy without HAS_Z
        dt_out: Big,          # (batch, nheads, nchunks, CHUNK) f32
        dA_cumsum: Big,       # (batch, nheads, nchunks, CHUNK) f32
        states: Big,          # (batch, nchunks, nheads, headdim, dstate) T or f32
        seq_idx: Big,         # (batch, seqlen) int32, or a dummy without HAS_SEQ_IDX
        out: Big,             # (batch, seqlen, nheads, headdim) T, written
        CHUNK: ConstInt,
        DSTATE: ConstInt,
        HEADS: ConstInt,      # heads per block, all of one group (they share C B^T)
        BLOCK_M: ConstInt,    # rows per block
        BLOCK_K: ConstInt,    # keys per inner step
        BLOCK_P: ConstInt,    # headdim columns per block
        HAS_Z: ConstBool,
        HAS_SEQ_IDX: ConstBool,
        LOAD_LAT: ConstInt,   # latency hint of the key-loop loads (1..10)
    ):
        _chunk_scan_fwd_body(x, B, C, D, z, dt_out, dA_cumsum, states, seq_idx, out, CHUNK, DSTATE, HEADS,
                             BLOCK_M, BLOCK_K, BLOCK_P, HAS_Z, HAS_SEQ_IDX, LOAD_LAT)

    return chunk_scan_fwd_kernel


# (int32-indexed, int64-indexed) entries of the one body.
CHUNK_SCAN_FWD_KERNELS = int64_index_kernels(_make_chunk_scan_fwd_kernel)
chunk_scan_fwd_kernel = CHUNK_SCAN_FWD_KERNELS[0]


@dataclasses.dataclass(frozen=True)
class ChunkScanConfig:
    """Tile sizes and hints of `chunk_scan_fwd_kernel`.

    BLOCK_M: rows per block, BLOCK_K: keys per step (both divide chunk_size), BLOCK_P: headdim columns
    per block (divides headdim), HEADS: heads per block (divides nheads / ngroups; the heads share one
    C B^T product). LOAD_LAT: latency hint on the key-loop loads.
    """

    BLOCK_M: int = 64
    BLOCK_K: int = 64
    BLOCK_P: int = 64
    HEADS: int = 1
    LOAD_LAT: int = 4
    occupancy: int = 2


# Largest f32 accumulator (HEADS * BLOCK_M * BLOCK_P) per block: larger ones spill registers on sm_90
# (checked in the SASS of tileiras 13.4: 64 x 64 x 2 heads runs spill-free at 2 blocks per SM).
_MAX_ACC = 64 * 128


def _occupancy(dims: SSDDims) -> int:
    # tf32 operands take twice the registers of 16-bit ones: f32 needs the whole register file.
    return 1 if dims.dtype == "float32" else 2


def chunk_scan_fwd_configs(dims: SSDDims, arch: str = "sm_90") -> list[ChunkScanConfig]:
    """The autotune space (sm_90), pruned to what divides the problem: 64-row blocks with 32/64-key
    steps or 128-row blocks with 64-key steps; BLOCK_P 64 (or all of a headdim <= 128 with one head);
    1/2/4 heads per block, the accumulator at most 64 x 128; latency 2/4. (Four heads of 32 columns, twice
    the C B^T sharing at the same accumulator size, were 25-30% slower than two heads of 64 on the H200.)"""
    check_arch("chunk_scan_fwd_configs", arch)
    Q, P = dims.chunk_size, dims.headdim
    tiles = [(bm, bk) for bm, bk in ((64, 32), (64, 64), (128, 64)) if bm <= Q]
    heads = [r for r in (1, 2, 4) if dims.heads_per_group % r == 0]
    shapes = [(bm, bk, bp, r) for bm, bk in tiles for bp in sorted({min(64, P), min(P, 128)})
              for r in heads if (bp == min(64, P) or r == 1) and r * bm * bp <= _MAX_ACC]
    return [ChunkScanConfig(BLOCK_M=bm, BLOCK_K=bk, BLOCK_P=bp, HEADS=r, LOAD_LAT=lat,
                            occupancy=_occupancy(dims))
            for bm, bk, bp, r in shapes for lat in (2, 4)]


def chunk_scan_fwd_default_config(dims: SSDDims) -> ChunkScanConfig:
    """64 x 64 row/key blocks (the causal diagonal wastes at most half a block), BLOCK_P <= 64, and two
    heads per block (halving the C B^T work) when a group has an even number of heads and the
    registers allow it (16-bit inputs, dstate <= 128)."""
    two_heads = dims.heads_per_group % 2 == 0 and dims.dtype != "float32" and dims.dstate <= 128
    return ChunkScanConfig(BLOCK_M=64, BLOCK_K=64, BLOCK_P=min(64, dims.headdim), HEADS=2 if two_heads else 1,
                           LOAD_LAT=4, occupancy=_occupancy(dims))


def chunk_scan_fwd_grid(dims: SSDDims, cfg: ChunkScanConfig) -> tuple[int, int]:
    tiles = ((dims.nheads // cfg.HEADS) * (dims.headdim // cfg.BLOCK_P) * (dims.chunk_size // cfg.BLOCK_M)
             * dims.nchunks)
    return (tiles, dims.batch)


def chunk_scan_fwd_launch(dims: SSDDims, cfg: ChunkScanConfig | None = None) -> Launch:
    """The launch writing "out"."""
    cfg = cfg or chunk_scan_fwd_default_config(dims)
    return Launch(
        kernel=select_kernel(CHUNK_SCAN_FWD_KERNELS, dims, occupancy=cfg.occupancy),
        grid=chunk_scan_fwd_grid(dims, cfg),
        args=("x", "B", "C", "D", "z", "dt_out", "dA_cumsum", "states", "seq_idx", "out",
              dims.chunk_size, dims.dstate, cfg.HEADS, cfg.BLOCK_M, cfg.BLOCK_K, cfg.BLOCK_P, dims.has_z,
              dims.has_seq_idx, cfg.LOAD_LAT),
        writes=("out",),
    )
