"""Backward of the fused chunk_state + state passing: the reverse pass over chunks (notation in
_tiles.py).

The forward (chunk_state.py) carries H_{c+1} = m_c exp(dA_last,c) H_c + S_c from H_0 = initial_states,
and chunk_scan reads H_c in y_l = r_l exp(dA_l) C_l H_c^T + .... With G_c = ∂L/∂H_c and
G_nchunks = dfinal_states (the gradient through final_states), the chain rule gives

    G_c = m_c exp(dA_last,c) G_{c+1}  +  Σ_l r_l exp(dA_l) dy_l ⊗ C_l            (P x N)

so one block owns a (BLOCK_P, BLOCK_N) tile of one (batch, head), walks the chunks from last to first
carrying G in f32, and writes

    dstates[b, c, h]   = G_{c+1}  = ∂L/∂S_c, the gradient of chunk c's END state (read by the dx/dB pass),
    dinitial_states[b, h] = G_0,
    ddA_chunk[b, h, c, tile * BLOCK_P / R + j] = m_c exp(dA_last,c) Σ_{p = jR}^{jR+R-1} Σ_n G_{c+1}[p, n] H_c[p, n],

this tile's share of ∂L/∂dA_last,c through the carry in sums over R = SUM_ROWS = min(BLOCK_P, 16) rows
(chunk_cumsum_bwd adds them up).
Sixteen rows are one warp's in the sm_90 mma layout, so this reduction adds no barrier to the carried chain
(one scalar per tile took a cross-warp reduction per chunk, measured slower). A sum per row instead of per
warp left chunk_cumsum_bwd 256 terms per chunk to add, slower at 80 heads and equal elsewhere.
H_c comes from the forward (saved by it, or recomputed by the plan's chunk_state stage).

Precision: dy and the row-scaled C enter the mma in x's dtype (tf32 for f32 inputs); G accumulates in f32
and is stored in dstates' dtype (x's, as mamba_ssm's `dstates_dtype`), which is what the dx/dB pass
rounds it to.
The loads of chunk c-1 do not depend on the carried G, so the LOAD_LAT hint lets them overlap chunk c.

Grid: chunk_state's (`chunk_state.state_tile_of_block`: the dstate tiles of one (batch, head), which all read
its dy tile, adjacent in launch order).

Shapes: C (batch, seqlen, ngroups, dstate) T; dy (batch, seqlen, nheads, headdim) T (dout without a gate);
dA_cumsum (batch, nheads, nchunks, CHUNK) f32; states, dstates (batch, nchunks, nheads, headdim, dstate) T;
seq_idx (batch, seqlen) int32 or a dummy; dfinal_states, dinitial_states (batch, nheads, headdim, dstate)
f32; ddA_chunk (batch, nheads, nchunks, headdim/BLOCK_P * dstate/BLOCK_N * BLOCK_P/SUM_ROWS) f32.
"""
import dataclasses
import math

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    SM90_SMS, Big, ConstBool, ConstInt, Launch, SSDDims, Stage, check_arch, int64_index_kernels, kernel_launch,
    mma_dtype, select_kernel)
from jax_mamba2.kernels._tiles import chunk_end_id, operand, previous_chunk_end_id, row_ids
from jax_mamba2.kernels.chunk_state import (
    LOAD_LATENCIES, ChunkStateConfig, chunk_state_fwd_default_config, chunk_state_fwd_grid, state_tile_of_block)


# Rows of an sm_90 mma accumulator tile held by one warp: the carry term is summed over them.
WARP_ROWS = 16


def _load_chunk(C, dy, dA_cumsum, states, tile, c, CHUNK, BLOCK_P, BLOCK_N, LOAD_LAT):
    """Chunk c's operands for the StateTile `tile`: H_c [BLOCK_P, BLOCK_N] in states' dtype, dA [CHUNK] f32,
    dy_c [CHUNK, BLOCK_P] in dy's dtype and C_c [CHUNK, BLOCK_N] f32 (both zero past seqlen)."""
    H_c = ct.load(states, index=(tile.b, c, tile.h, tile.pb, tile.nb), shape=(1, 1, 1, BLOCK_P, BLOCK_N),
                  latency=LOAD_LAT).reshape((BLOCK_P, BLOCK_N))
    dA = ct.load(dA_cumsum, index=(tile.b, tile.h, c, 0), shape=(1, 1, 1, CHUNK),
                 latency=LOAD_LAT).reshape((CHUNK,))
    dy_c = ct.load(dy, index=(tile.b, c, tile.h, tile.pb), shape=(1, CHUNK, 1, BLOCK_P),
                   padding_mode=ct.PaddingMode.ZERO, latency=LOAD_LAT).reshape((CHUNK, BLOCK_P))
    C_c = ct.load(C, index=(tile.b, c, tile.g, tile.nb), shape=(1, CHUNK, 1, BLOCK_N),
                  padding_mode=ct.PaddingMode.ZERO, latency=LOAD_LAT
                  ).reshape((CHUNK, BLOCK_N)).astype(ct.float32)
    return H_c, dA, dy_c, C_c


def chunk_state_bwd_kernel(
    C: Big,                  # (batch, seqlen, ngroups, dstate) T
    dy: Big,                 # (batch, seqlen, nheads, headdim) T
    dA_cumsum: Big,          # (batch, nheads, nchunks, CHUNK) f32
    states: Big,             # (batch, nchunks, nheads, headdim, dstate) T, chunk-entry states
    seq_idx: Big,            # (batch, seqlen) int32, or a dummy without HAS_SEQ_IDX
    dfinal_states: Big,      # (batch, nheads, headdim, dstate) f32
    dstates: Big,            # (batch, nchunks, nheads, headdim, dstate) T, written
    dinitial_states: Big,    # (batch, nheads, headdim, dstate) f32, written
    ddA_chunk: Big,          # (batch, nheads, nchunks, state tiles * BLOCK_P / SUM_ROWS) f32, written
    CHUNK: ConstInt,
    BLOCK_P: ConstInt,
    BLOCK_N: ConstInt,
    SUM_ROWS: ConstInt,      # rows per entry of ddA_chunk: min(BLOCK_P, WARP_ROWS)
    HAS_SEQ_IDX: ConstBool,
    LOAD_LAT: ConstInt,      # latency hint of the per-chunk loads (1..10)
):
    state_tile = state_tile_of_block(dy.shape[2], C.shape[2], C.shape[3], BLOCK_N)
    b, h = state_tile.b, state_tile.h
    seqlen = dy.shape[1]
    nchunks = ct.cdiv(seqlen, CHUNK)
    tile = state_tile.pb * (C.shape[3] // BLOCK_N) + state_tile.nb          # this tile's ddA_chunk entries
    op_dtype = mma_dtype(dy.dtype)

    grad = ct.load(dfinal_states, index=(b, h, state_tile.pb, state_tile.nb), shape=(1, 1, BLOCK_P, BLOCK_N)
                   ).reshape((BLOCK_P, BLOCK_N))                            # [BLOCK_P, BLOCK_N] f32
    for i in range(nchunks):
        c = nchunks - 1 - i
        ct.store(dstates, index=(b, c, h, state_tile.pb, state_tile.nb),
                 tile=grad.reshape((1, 1, 1, BLOCK_P, BLOCK_N)).astype(dstates.dtype))
        H_c, dA, dy_c, C_c = _load_chunk(C, dy, dA_cumsum, states, state_tile, c, CHUNK, BLOCK_P, BLOCK_N,
                                         LOAD_LAT)
        carry = ct.exp(ct.extract(dA, index=(CHUNK - 1,), shape=(1,)))      # [1]
        row_scale = ct.exp(dA)                                              # [CHUNK]
        if HAS_SEQ_IDX:
            prev_end_id = previous_chunk_end_id(seq_idx, b, c, CHUNK)
            carry = ct.where(chunk_end_id(seq_idx, b, c, seqlen, CHUNK) == prev_end_id, carry, 0.0)
            row_scale = ct.where(row_ids(seq_idx, b, c, CHUNK) == prev_end_id, row_scale, 0.0)
        ddA_rows = carry * ct.sum(grad * H_c.astype(ct.float32), axis=1)    # [BLOCK_P]
        ddA_warps = ct.sum(ddA_rows.reshape((BLOCK_P // SUM_ROWS, SUM_ROWS)), axis=1)
        ct.store(ddA_chunk, index=(b, h, c, tile), tile=ddA_warps.reshape((1, 1, 1, BLOCK_P // SUM_ROWS)))
        C_scaled = operand(C_c * row_scale[:, None], C.dtype, op_dtype)     # [CHUNK, BLOCK_N]
        dy_t = dy_c.transpose().astype(op_dtype)
        grad = ct.mma(dy_t, C_scaled, grad * carry)

    ct.store(dinitial_states, index=(b, h, state_tile.pb, state_tile.nb),
             tile=grad.reshape((1, 1, BLOCK_P, BLOCK_N)))


CHUNK_STATE_BWD_KERNELS = int64_index_kernels(chunk_state_bwd_kernel)


# The same state tile walk as the forward state pass: its config and grid.
ChunkStateBwdConfig = ChunkStateConfig
chunk_state_bwd_grid = chunk_state_fwd_grid


def _waves(dims: SSDDims, cfg: ChunkStateBwdConfig) -> int:
    """Rounds of cfg.OCCUPANCY blocks per SM the grid takes on an sm_90 part."""
    return math.ceil(math.prod(chunk_state_bwd_grid(dims, cfg)) / (cfg.OCCUPANCY * SM90_SMS))


def chunk_state_bwd_default_config(dims: SSDDims) -> ChunkStateBwdConfig:
    """The forward's default tile (64 x 32 at occupancy 4), at occupancy 5 for 16-bit inputs where that
    takes fewer waves of blocks (five blocks of 48 registers and 42-45 KB shared memory fit an SM); where
    the waves are as many, occupancy 4 measured faster."""
    cfg = chunk_state_fwd_default_config(dims)
    five = dataclasses.replace(cfg, OCCUPANCY=5)
    if dims.dtype != "float32" and _waves(dims, five) < _waves(dims, cfg):
        return five
    return cfg


def chunk_state_bwd_configs(dims: SSDDims, arch: str = "sm_90") -> list[ChunkStateBwdConfig]:
    """The autotune space (sm_90): tiles 32..64 x 16..64, each with the forward's `LOAD_LATENCIES` at
    occupancy 2, and the default tile at occupancy 4 and, for 16-bit inputs, 5 (f32 tiles spill at 5's 48
    registers; see `chunk_state_fwd_configs`). A 64 x 128 tile (one block per chain, dy read once)
    measured several times slower than the default and is not in it.

    Like the forward this is a chain over chunks with batch * nheads * tiles blocks: small tiles give more
    blocks, large ones reuse each dy/C load more (its loads take about half its time).
    """
    check_arch("chunk_state_bwd_configs", arch)
    tiles = [(bp, bn) for bp in sorted({min(32, dims.headdim), min(64, dims.headdim)})
             for bn in (16, 32, 64) if bn <= dims.dstate]
    default = chunk_state_bwd_default_config(dims)
    return [ChunkStateBwdConfig(BLOCK_P=bp, BLOCK_N=bn, LOAD_LAT=lat, OCCUPANCY=occ)
            for occ in ((2, 4) if dims.dtype == "float32" else (2, 4, 5)) for bp, bn in tiles
            if occ == 2 or (bp, bn) == (default.BLOCK_P, default.BLOCK_N)
            for lat in LOAD_LATENCIES]


def chunk_state_bwd_carry_terms(dims: SSDDims, cfg: ChunkStateBwdConfig) -> int:
    """Entries per (batch, head, chunk) of ddA_chunk (the last axis): a sum per `_sum_rows` rows of each
    state tile."""
    return (dims.headdim // cfg.BLOCK_P) * (dims.dstate // cfg.BLOCK_N) * (cfg.BLOCK_P // _sum_rows(cfg))


def _sum_rows(cfg: ChunkStateBwdConfig) -> int:
    return min(cfg.BLOCK_P, WARP_ROWS)


def chunk_state_bwd_launch(dims: SSDDims, cfg: ChunkStateBwdConfig | None = None) -> Launch:
    """The launch writing ("dstates", "dinitial_states", "ddA_chunk"), reading the output gradient "dout"."""
    cfg = cfg or chunk_state_bwd_default_config(dims)
    return kernel_launch(
        select_kernel(CHUNK_STATE_BWD_KERNELS, dims, occupancy=cfg.OCCUPANCY), chunk_state_bwd_grid(dims, cfg),
        writes=("dstates", "dinitial_states", "ddA_chunk"), arrays={"dy": "dout"}, CHUNK=dims.chunk_size,
        BLOCK_P=cfg.BLOCK_P, BLOCK_N=cfg.BLOCK_N, SUM_ROWS=_sum_rows(cfg), HAS_SEQ_IDX=dims.has_seq_idx,
        LOAD_LAT=cfg.LOAD_LAT)


CHUNK_STATE_BWD_STAGE = Stage(
    name="chunk_state_bwd", config_type=ChunkStateBwdConfig, space=chunk_state_bwd_configs,
    default=chunk_state_bwd_default_config, launch=chunk_state_bwd_launch,
    key_fields=("chunk_size", "headdim", "dstate", "dtype", "has_seq_idx"),
    # The reverse chain over chunks, one (batch, head) per block as in the forward state pass.
    work_items=lambda d: d.batch * d.nheads)
