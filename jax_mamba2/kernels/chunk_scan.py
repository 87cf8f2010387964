"""Stage 4 of the SSD forward: the outputs, from the chunk-entry states and the causal intra-chunk term.

Mirrors `reference.chunk_scan` (mamba_ssm `_bmm_chunk_fwd` + `_chunk_scan_fwd`, fused). For batch b,
head h (group g = h // (nheads / ngroups)), chunk c, rows l of the chunk, dA = dA_cumsum[b, h, c],
Δ = dt_out[b, h, c], H_c = states[b, c, h]:

    y[l] = (exp(dA[l]) + reach[l]) * (C[l] @ H_c^T)                              (inter-chunk)
         + Σ_{s<=l} (C[l] · B[s]) * exp(min(dA[l] - dA[s], 0)) * Δ[s] * x[s]     (intra-chunk)
         + D[h] * x[l]
    out[l] = y[l] * silu(z[l])   if HAS_Z (the gate comes after D)

With seq_idx: the inter-chunk term only reaches rows whose id equals the id of the last token of chunk
c-1 (0 for c = 0), and the intra-chunk pairs (l, s) need equal ids. reach[l] = reach[b, h, c, l], 0 or NaN
(HAS_REACH; 0 otherwise): a NaN makes row l NaN, what the op's confinement of non-finite values asks.

A block owns BLOCK_M rows x BLOCK_P columns of (b, h, c), with one of two loop structures (the config's
BLOCK_N picks): the key loop computes C·H_c^T over the whole dstate, then walks the key blocks k <= its
row block like flash attention, skipping those above the diagonal; the state loop takes all of the
chunk's keys at once and walks dstate in BLOCK_N-column steps, accumulating C·B^T and C·H_c^T together
so that its C, B and H_c loads are pipelined, then applies the causal mask and multiplies x once.

Precision follows mamba_ssm: C, B, x, H_c enter the mma in x's dtype (tf32 for f32 inputs; H_c is
rounded to it), the decayed score matrix C B^T * exp(..) * Δ is rounded to x's dtype before multiplying
x, everything accumulates in f32, and D and the gate are applied in f32 before one final rounding.

A block computes HEADS heads of one group at once: the C B^T product of a (row, key) block pair is
computed once and reused by every head (batched [HEADS, ...] mma for the rest).

Grid: (nheads/HEADS * headdim/BLOCK_P * CHUNK/BLOCK_M * nchunks, batch), head blocks fastest (heads of
a group share the C and B tiles in L2), the heaviest row blocks (near the chunk end) first; or, with
PERSISTENT, that many blocks striding over the same work tiles in the same order.

Shapes: x, z, out (batch, seqlen, nheads, headdim) T (z a dummy without HAS_Z); B, C (batch, seqlen,
ngroups, dstate) T; D (nheads, headdim) f32; dt_out, dA_cumsum (batch, nheads, nchunks, chunk_size) f32;
states (batch, nchunks, nheads, headdim, dstate) T or f32; seq_idx (batch, seqlen) int32 or a dummy; reach
(batch, nheads, nchunks, chunk_size) f32 or a dummy.
"""
import dataclasses
from typing import Any

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    SM90_SMS, Big, ConstBool, ConstInt, Launch, SSDDims, Stage, check_arch, int64_index_kernels, kernel_launch,
    mma_dtype, select_kernel, silu_gate)
from jax_mamba2.kernels._tiles import previous_chunk_end_id, row_ids


def _load_heads(array, b, row_tile, hb, pb, BLOCK_ROWS, HEADS, BLOCK_P):
    """The [HEADS, BLOCK_ROWS, BLOCK_P] tile of a (batch, seqlen, nheads, headdim) array (zero padded)."""
    tile = ct.load(array, index=(b, row_tile, hb, pb), shape=(1, BLOCK_ROWS, HEADS, BLOCK_P),
                   padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_ROWS, HEADS, BLOCK_P))
    return ct.permute(tile, (1, 0, 2))


def _num_tiles(x, HEADS, BLOCK_M, BLOCK_P, CHUNK):
    """Work tiles of the launch: (batch, chunk, row block, headdim block, head block) combinations."""
    nchunks = ct.cdiv(x.shape[1], CHUNK)
    return x.shape[0] * nchunks * (CHUNK // BLOCK_M) * (x.shape[3] // BLOCK_P) * (x.shape[2] // HEADS)


def _tile_coordinates(tile_id, x, B, HEADS, BLOCK_M, BLOCK_P, CHUNK):
    """(b, c, m, hb, pb, g) of work tile `tile_id`: batch, chunk, row block, head block, headdim block,
    group. Head blocks vary fastest (the heads of a group share the C and B tiles in L2), then headdim
    blocks, then row blocks (the heaviest, near the chunk end, first), then chunks, then batch rows."""
    num_head_blocks = x.shape[2] // HEADS
    num_p_blocks = x.shape[3] // BLOCK_P
    num_m_blocks = CHUNK // BLOCK_M
    nchunks = ct.cdiv(x.shape[1], CHUNK)
    hb = tile_id % num_head_blocks
    tile_id = tile_id // num_head_blocks
    pb = tile_id % num_p_blocks
    tile_id = tile_id // num_p_blocks
    m = num_m_blocks - 1 - tile_id % num_m_blocks
    tile_id = tile_id // num_m_blocks
    c = tile_id % nchunks
    b = tile_id // nchunks
    g = hb * HEADS // (x.shape[2] // B.shape[2])       # HEADS divides nheads / ngroups: one group
    return b, c, m, hb, pb, g


def _decayed_scores(cb, dA_m, dA_k, delta_k, keep, dtype, operand_dtype):
    """The intra-chunk weights C·B^T * exp(min(dA[l] - dA[s], 0)) * Δ[s], masked, rounded to the data
    dtype: cb [BLOCK_M, BLOCK_K] f32, dA_m [HEADS, BLOCK_M], dA_k, delta_k [HEADS, BLOCK_K], keep
    [BLOCK_M, BLOCK_K] -> [HEADS, BLOCK_M, BLOCK_K] in the operand dtype."""
    decay = ct.exp(ct.minimum(dA_m[:, :, None] - dA_k[:, None, :], 0.0))
    scores = ct.where(keep[None, :, :], cb[None, :, :] * decay * delta_k[:, None, :], 0.0)
    return scores.astype(dtype).astype(operand_dtype)


@dataclasses.dataclass(frozen=True)
class _ScanArrays:
    """The arrays of a work tile (the kernel's parameters of the same names)."""

    x: Any
    B: Any
    C: Any
    D: Any
    z: Any
    dt_out: Any
    dA_cumsum: Any
    states: Any
    seq_idx: Any
    reach: Any
    out: Any


@dataclasses.dataclass(frozen=True)
class _ScanSpec:
    """The compile-time constants of a work tile (the kernel's parameters of the same names)."""

    CHUNK: int
    DSTATE: int
    HEADS: int
    BLOCK_M: int
    BLOCK_K: int
    BLOCK_N: int
    BLOCK_P: int
    HAS_Z: bool
    HAS_SEQ_IDX: bool
    HAS_REACH: bool
    LOAD_LAT: int


def _inter_scale(arrays, b, hb, c, m, dA_m, reached, spec):
    """exp(dA[l]) for the rows H_c reaches (`reached` [BLOCK_M] with seq_idx, else None), 0 for the others,
    plus `reach` with HAS_REACH (+ NaN makes the row's C·H_c^T term, and so its output, NaN) -> [HEADS,
    BLOCK_M] f32."""
    inter_scale = ct.exp(dA_m)
    if spec.HAS_SEQ_IDX:
        inter_scale = ct.where(reached[None, :], inter_scale, 0.0)
    if spec.HAS_REACH:
        inter_scale = inter_scale + ct.load(arrays.reach, index=(b, hb, c, m), shape=(1, spec.HEADS, 1, spec.BLOCK_M)
                                            ).reshape((spec.HEADS, spec.BLOCK_M))
    return inter_scale


def _finish_rows(acc, x_m, arrays, b, m_tile, hb, pb, spec):
    """out = (acc + D * x) [* silu(z)] for the block's rows: acc, x_m [HEADS, BLOCK_M, BLOCK_P]."""
    D, z, out = arrays.D, arrays.z, arrays.out
    HEADS, BLOCK_M, BLOCK_P, HAS_Z = spec.HEADS, spec.BLOCK_M, spec.BLOCK_P, spec.HAS_Z
    D_p = ct.load(D, index=(hb, pb), shape=(HEADS, BLOCK_P))
    acc = acc + x_m.astype(ct.float32) * D_p[:, None, :]
    if HAS_Z:
        acc = silu_gate(acc, _load_heads(z, b, m_tile, hb, pb, BLOCK_M, HEADS, BLOCK_P))
    ct.store(out, index=(b, m_tile, hb, pb),
             tile=ct.permute(acc, (1, 0, 2)).reshape((1, BLOCK_M, HEADS, BLOCK_P)).astype(out.dtype))


def _key_loop_body(tile_id, arrays, spec):
    """Whole-dstate C·H_c^T first, then the key blocks up to the diagonal (flash-attention style)."""
    x, B, C, dt_out, dA_cumsum, states, seq_idx = (
        arrays.x, arrays.B, arrays.C, arrays.dt_out, arrays.dA_cumsum, arrays.states, arrays.seq_idx)
    CHUNK, DSTATE, HEADS, BLOCK_M, BLOCK_K, BLOCK_P = (
        spec.CHUNK, spec.DSTATE, spec.HEADS, spec.BLOCK_M, spec.BLOCK_K, spec.BLOCK_P)
    HAS_SEQ_IDX, LOAD_LAT = spec.HAS_SEQ_IDX, spec.LOAD_LAT
    seqlen = x.shape[1]
    b, c, m, hb, pb, g = _tile_coordinates(tile_id, x, B, HEADS, BLOCK_M, BLOCK_P, CHUNK)
    operand_dtype = mma_dtype(x.dtype)

    # A row block wholly past seqlen (partial last chunk) has nothing to store; its loads would lie
    # entirely out of bounds, which ct.load leaves undefined.
    if c * CHUNK + m * BLOCK_M < seqlen:
        m_tile = c * (CHUNK // BLOCK_M) + m              # row-block index along seqlen
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
        reached = None
        if HAS_SEQ_IDX:
            ids_m = row_ids(seq_idx, b, m_tile, BLOCK_M)
            reached = ids_m == previous_chunk_end_id(seq_idx, b, c, CHUNK)   # rows H_c reaches
        acc = acc * _inter_scale(arrays, b, hb, c, m, dA_m, reached, spec)[:, :, None]

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
                keep = keep & (ids_m[:, None] == row_ids(seq_idx, b, k_tile, BLOCK_K)[None, :])
            acc = ct.mma(_decayed_scores(cb, dA_m, dA_k, delta_k, keep, x.dtype, operand_dtype), x_k, acc)

        x_m = _load_heads(x, b, m_tile, hb, pb, BLOCK_M, HEADS, BLOCK_P)      # [HEADS, BLOCK_M, BLOCK_P]
        _finish_rows(acc, x_m, arrays, b, m_tile, hb, pb, spec)


def _state_loop_body(tile_id, arrays, spec):
    """All of the chunk's keys at once (BLOCK_K = CHUNK): one loop over dstate tiles of BLOCK_N columns
    accumulates both C·B^T [BLOCK_M, CHUNK] and C·H_c^T, so the C, B and H_c loads stream through a
    pipelined loop (TileGym's compute_out); then one causal mma with x."""
    x, B, C, dt_out, dA_cumsum, states, seq_idx = (
        arrays.x, arrays.B, arrays.C, arrays.dt_out, arrays.dA_cumsum, arrays.states, arrays.seq_idx)
    CHUNK, DSTATE, HEADS, BLOCK_M, BLOCK_N, BLOCK_P = (
        spec.CHUNK, spec.DSTATE, spec.HEADS, spec.BLOCK_M, spec.BLOCK_N, spec.BLOCK_P)
    HAS_SEQ_IDX, LOAD_LAT = spec.HAS_SEQ_IDX, spec.LOAD_LAT
    seqlen = x.shape[1]
    b, c, m, hb, pb, g = _tile_coordinates(tile_id, x, B, HEADS, BLOCK_M, BLOCK_P, CHUNK)
    operand_dtype = mma_dtype(x.dtype)

    if c * CHUNK + m * BLOCK_M < seqlen:                 # as in _key_loop_body
        m_tile = c * (CHUNK // BLOCK_M) + m
        cb = ct.zeros((BLOCK_M, CHUNK), dtype=ct.float32)                     # Σ_n C B^T
        acc = ct.zeros((HEADS, BLOCK_M, BLOCK_P), dtype=ct.float32)           # Σ_n C H_c^T
        for n in range(DSTATE // BLOCK_N):
            C_n = ct.load(C, index=(b, m_tile, g, n), shape=(1, BLOCK_M, 1, BLOCK_N),
                          padding_mode=ct.PaddingMode.ZERO, latency=LOAD_LAT
                          ).reshape((BLOCK_M, BLOCK_N)).astype(operand_dtype)
            B_n = ct.load(B, index=(b, c, g, n), shape=(1, CHUNK, 1, BLOCK_N),
                          padding_mode=ct.PaddingMode.ZERO, latency=LOAD_LAT
                          ).reshape((CHUNK, BLOCK_N)).astype(operand_dtype)
            H_n = ct.load(states, index=(b, c, hb, pb, n), shape=(1, 1, HEADS, BLOCK_P, BLOCK_N),
                          latency=LOAD_LAT).reshape((HEADS, BLOCK_P, BLOCK_N))
            cb = ct.mma(C_n, B_n.transpose(), cb)
            acc = ct.mma(C_n, ct.permute(H_n, (0, 2, 1)).astype(x.dtype).astype(operand_dtype), acc)

        dA_m = ct.load(dA_cumsum, index=(b, hb, c, m), shape=(1, HEADS, 1, BLOCK_M)
                       ).reshape((HEADS, BLOCK_M))
        rows = m * BLOCK_M + ct.arange(BLOCK_M, dtype=ct.int32)
        keep = rows[:, None] >= ct.arange(CHUNK, dtype=ct.int32)[None, :]    # causal
        reached = None
        if HAS_SEQ_IDX:
            ids_m = row_ids(seq_idx, b, m_tile, BLOCK_M)
            reached = ids_m == previous_chunk_end_id(seq_idx, b, c, CHUNK)   # rows H_c reaches
            keep = keep & (ids_m[:, None] == row_ids(seq_idx, b, c, CHUNK)[None, :])
        acc = acc * _inter_scale(arrays, b, hb, c, m, dA_m, reached, spec)[:, :, None]

        x_c = _load_heads(x, b, c, hb, pb, CHUNK, HEADS, BLOCK_P)             # [HEADS, CHUNK, BLOCK_P]
        dA_k = ct.load(dA_cumsum, index=(b, hb, c, 0), shape=(1, HEADS, 1, CHUNK)).reshape((HEADS, CHUNK))
        delta_k = ct.load(dt_out, index=(b, hb, c, 0), shape=(1, HEADS, 1, CHUNK)).reshape((HEADS, CHUNK))
        acc = ct.mma(_decayed_scores(cb, dA_m, dA_k, delta_k, keep, x.dtype, operand_dtype),
                     x_c.astype(operand_dtype), acc)

        if BLOCK_M == CHUNK:
            x_m = x_c                                    # the block's rows are the chunk's keys
        else:
            x_m = _load_heads(x, b, m_tile, hb, pb, BLOCK_M, HEADS, BLOCK_P)
        _finish_rows(acc, x_m, arrays, b, m_tile, hb, pb, spec)


def _scan_tile(tile_id, arrays, spec):
    """Work tile `tile_id` with the loop structure BLOCK_N selects."""
    if spec.BLOCK_N == 0:
        _key_loop_body(tile_id, arrays, spec)
    else:
        _state_loop_body(tile_id, arrays, spec)


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
    reach: Big,           # (batch, nheads, nchunks, CHUNK) f32, or a dummy without HAS_REACH
    out: Big,             # (batch, seqlen, nheads, headdim) T, written
    CHUNK: ConstInt,
    DSTATE: ConstInt,
    HEADS: ConstInt,      # heads per block, all of one group (they share C B^T)
    BLOCK_M: ConstInt,    # rows per block
    BLOCK_K: ConstInt,    # keys per inner step of the key loop
    BLOCK_N: ConstInt,    # dstate columns per step of the state loop; 0: the key loop
    BLOCK_P: ConstInt,    # headdim columns per block
    HAS_Z: ConstBool,
    HAS_SEQ_IDX: ConstBool,
    HAS_REACH: ConstBool,  # add `reach` to each row's inter-chunk scale (SSDDims.has_reach)
    LOAD_LAT: ConstInt,   # latency hint of the loop's loads (1..10)
    PERSISTENT: ConstBool,  # a fixed grid whose blocks stride over the work tiles
):
    arrays = _ScanArrays(x, B, C, D, z, dt_out, dA_cumsum, states, seq_idx, reach, out)
    spec = _ScanSpec(CHUNK, DSTATE, HEADS, BLOCK_M, BLOCK_K, BLOCK_N, BLOCK_P, HAS_Z, HAS_SEQ_IDX, HAS_REACH,
                     LOAD_LAT)
    if PERSISTENT:
        for tile_id in range(ct.bid(0), _num_tiles(x, HEADS, BLOCK_M, BLOCK_P, CHUNK), ct.num_blocks(0)):
            _scan_tile(tile_id, arrays, spec)
    else:
        _scan_tile(ct.bid(0) + ct.bid(1) * ct.num_blocks(0), arrays, spec)


CHUNK_SCAN_FWD_KERNELS = int64_index_kernels(chunk_scan_fwd_kernel)


@dataclasses.dataclass(frozen=True)
class ChunkScanConfig:
    """Tile sizes and hints of `chunk_scan_fwd_kernel`.

    BLOCK_M: rows per block, BLOCK_P: headdim columns per block (divides headdim), HEADS: heads per
    block (divides nheads / ngroups; the heads share one C B^T product). Two loop structures:
    BLOCK_N == 0, the key loop: BLOCK_K keys per step (BLOCK_K <= BLOCK_M, both divide chunk_size);
    BLOCK_N > 0, the state loop: all keys at once (BLOCK_K == chunk_size), BLOCK_N dstate columns per
    step (divides dstate). LOAD_LAT: latency hint on the loop's loads. PERSISTENT: 0 for one block per
    work tile, else the number of blocks launched, each striding over the work tiles.
    """

    BLOCK_M: int = 64
    BLOCK_K: int = 64
    BLOCK_N: int = 0
    BLOCK_P: int = 64
    HEADS: int = 1
    LOAD_LAT: int = 4
    OCCUPANCY: int = 2
    PERSISTENT: int = 0


# Largest f32 accumulator (HEADS * BLOCK_M * BLOCK_P) per block: larger ones spill registers on sm_90
# (checked in the SASS of tileiras 13.4: 64 x 64 x 2 heads runs spill-free at 2 blocks per SM).
_MAX_ACC = 64 * 128


def _occupancy(dims: SSDDims) -> int:
    # tf32 operands take twice the registers of 16-bit ones: f32 needs the whole register file.
    return 1 if dims.dtype == "float32" else 2


def chunk_scan_fwd_configs(dims: SSDDims, arch: str = "sm_90") -> list[ChunkScanConfig]:
    """The autotune space (sm_90), pruned to what divides the problem.

    Key loop: 64-row blocks with 32/64-key steps or 128-row blocks with 64-key steps; BLOCK_P 64 (or all
    of a headdim <= 128 with one head); 1/2/4 heads per block, the accumulator at most 64 x 128. (Four
    heads of 32 columns, twice the C B^T sharing at the same accumulator size, measured slower than two
    heads of 64.) State loop, for chunks <= 128 (its [64, chunk] f32 C B^T stays in registers): 64-row
    blocks, 32/64 dstate columns per step (16/32 for f32), 1/2 heads, BLOCK_P 64. Latency 2/4.
    Persistent grids (occupancy x 132 blocks) of the state-loop and the 64 x 64 key-loop configs at
    latency 4 (slightly faster at some shapes).
    """
    check_arch("chunk_scan_fwd_configs", arch)
    Q, P, N = dims.chunk_size, dims.headdim, dims.dstate
    heads = [r for r in (1, 2, 4) if dims.heads_per_group % r == 0]
    tiles = [(bm, bk, 0) for bm, bk in ((64, 32), (64, 64), (128, 64)) if bm <= Q]
    # tf32 operands take twice the registers: f32 state loops spill beyond 16-32 columns per step.
    state_steps = (16, 32) if dims.dtype == "float32" else (32, 64)
    tiles += [(64, Q, bn) for bn in sorted({min(s, N) for s in state_steps}) if Q <= 128]
    shapes = [(bm, bk, bn, bp, r) for bm, bk, bn in tiles for bp in sorted({min(64, P), min(P, 128)})
              for r in heads
              if (bp == min(64, P) or (r == 1 and bn == 0)) and r * bm * bp <= _MAX_ACC and (bn == 0 or r <= 2)]
    space = [ChunkScanConfig(BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn, BLOCK_P=bp, HEADS=r, LOAD_LAT=lat,
                             OCCUPANCY=_occupancy(dims))
             for bm, bk, bn, bp, r in shapes for lat in (2, 4)]
    persistent = [cfg for cfg in space
                  if cfg.LOAD_LAT == 4 and (cfg.BLOCK_N or (cfg.BLOCK_M, cfg.BLOCK_K) == (64, 64))]
    return space + [dataclasses.replace(cfg, PERSISTENT=cfg.OCCUPANCY * SM90_SMS) for cfg in persistent]


def chunk_scan_fwd_default_config(dims: SSDDims) -> ChunkScanConfig:
    """Two heads per block (halving the C B^T work) when a group has an even number of heads and the
    registers allow it (16-bit inputs), BLOCK_P <= 64, 64-row blocks, and by chunk size:

    - chunk 64, 16-bit inputs: the state loop over 64 dstate columns per step: measured faster than the
      key loop, and its SASS stays spill-free up to dstate 256, where every key-loop config spills.
    - otherwise the key loop with 64 x 64 row/key blocks (the causal diagonal wastes at most half a
      block), two heads only up to dstate 128 (beyond, its whole-dstate tiles spill). (f32 has not been
      timed with the state loop.)
    """
    two_heads = dims.heads_per_group % 2 == 0 and dims.dtype != "float32"
    bp = min(64, dims.headdim)
    if dims.chunk_size == 64 and dims.dtype != "float32":
        return ChunkScanConfig(BLOCK_M=64, BLOCK_K=64, BLOCK_N=min(64, dims.dstate), BLOCK_P=bp,
                               HEADS=2 if two_heads else 1, LOAD_LAT=4, OCCUPANCY=_occupancy(dims))
    two_heads = two_heads and dims.dstate <= 128
    return ChunkScanConfig(BLOCK_M=64, BLOCK_K=64, BLOCK_P=bp, HEADS=2 if two_heads else 1, LOAD_LAT=4,
                           OCCUPANCY=_occupancy(dims))


def chunk_scan_fwd_grid(dims: SSDDims, cfg: ChunkScanConfig) -> tuple[int, int]:
    """(work tiles per batch row, batch), or (PERSISTENT, 1) blocks striding over all work tiles."""
    tiles = ((dims.nheads // cfg.HEADS) * (dims.headdim // cfg.BLOCK_P) * (dims.chunk_size // cfg.BLOCK_M)
             * dims.nchunks)
    if cfg.PERSISTENT:
        return (min(cfg.PERSISTENT, tiles * dims.batch), 1)
    return (tiles, dims.batch)


def chunk_scan_fwd_launch(dims: SSDDims, cfg: ChunkScanConfig | None = None) -> Launch:
    """The launch writing "out"."""
    cfg = cfg or chunk_scan_fwd_default_config(dims)
    return kernel_launch(
        select_kernel(CHUNK_SCAN_FWD_KERNELS, dims, occupancy=cfg.OCCUPANCY), chunk_scan_fwd_grid(dims, cfg),
        writes=("out",), CHUNK=dims.chunk_size, DSTATE=dims.dstate, HEADS=cfg.HEADS, BLOCK_M=cfg.BLOCK_M,
        BLOCK_K=cfg.BLOCK_K, BLOCK_N=cfg.BLOCK_N, BLOCK_P=cfg.BLOCK_P, HAS_Z=dims.has_z,
        HAS_SEQ_IDX=dims.has_seq_idx, HAS_REACH=dims.has_reach, LOAD_LAT=cfg.LOAD_LAT,
        PERSISTENT=cfg.PERSISTENT > 0)


CHUNK_SCAN_STAGE = Stage(
    name="chunk_scan", config_type=ChunkScanConfig, space=chunk_scan_fwd_configs,
    default=chunk_scan_fwd_default_config, launch=chunk_scan_fwd_launch,
    key_fields=("chunk_size", "headdim", "dstate", "heads_per_group", "dtype", "has_z", "has_seq_idx"),
    work_items=lambda d: d.batch * d.nchunks * d.nheads)
