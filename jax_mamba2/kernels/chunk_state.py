"""Stages 2+3 of the SSD forward, fused: chunk states and the sequential state passing.

Mirrors `reference.chunk_state` followed by `reference.state_passing` (mamba_ssm `_chunk_state_fwd` +
`_state_passing_fwd`; TileGym `fwd_pass_state_kernel`). For one (batch b, head h) and chunk c with local
decay cumsum dA[l] = dA_cumsum[b, h, c, l], Δ[l] = dt_out[b, h, c, l], group g = h // (nheads / ngroups):

    S_c      = x_c^T @ (B_c * (exp(min(dA[Q-1] - dA[l], 0)) * Δ[l])[:, None])      (P, N), f32 accumulate
    H_0      = initial_states[b, h]  (zeros without HAS_INIT)
    H_{c+1}  = exp(dA[Q-1]) * H_c + S_c
    states[b, c, h] = H_c (the state ENTERING chunk c),  final_states[b, h] = H_nchunks

With seq_idx (ids nondecreasing along the sequence), let e_c = the id of chunk c's last valid token (the
max over its valid rows) and e_{-1} = 0: S_c only accumulates tokens whose id == e_c, and the carry
exp(dA[Q-1]) * H_c is zeroed when e_c != e_{c-1}.

The mma operands are in x's dtype (tf32 for f32 inputs): the decay-scaled B is rounded to that dtype
before the product, as mamba_ssm does. The carried state stays f32; `states` is stored in its array's
dtype (x's dtype in both the forward and the backward's recompute).

Grid: (batch * nheads * dstate / BLOCK_N, headdim / BLOCK_P), the dstate tiles of one (batch, head)
adjacent in launch order (`state_tile_of_block`), so that the blocks re-reading one chunk's x tile run
at once and find it in L2 (where the blocks take more than one wave, that halved this pass's time). One
block owns a
(BLOCK_P, BLOCK_N) state tile and walks all chunks in order; the loads of chunk c+1 do not depend on the
carried state, so the `LOAD_LAT` latency hint lets the compiler issue them while chunk c's mma runs.
(Doing that by hand, prefetching chunk c+1's tiles into registers and carrying the state outside the mma
accumulator, measured slower.)

Shapes: x (batch, seqlen, nheads, headdim) T; B (batch, seqlen, ngroups, dstate) T;
dt_out, dA_cumsum (batch, nheads, nchunks, chunk_size) f32; initial_states (batch, nheads, headdim,
dstate) f32 (HAS_INIT) else a dummy; seq_idx (batch, seqlen) int32 (HAS_SEQ_IDX) else a dummy;
states (batch, nchunks, nheads, headdim, dstate) T or f32; final_states (batch, nheads, headdim, dstate) f32.
"""
import dataclasses
from typing import Any

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    Big, ConstBool, ConstInt, Launch, SSDDims, Stage, check_arch, int64_index_kernels, kernel_launch, mma_dtype,
    select_kernel)
from jax_mamba2.kernels._tiles import batch_head_group, state_seq_rules


@dataclasses.dataclass(frozen=True)
class StateTile:
    """Device values of a block of the state passes: batch row b, head h and its group g, and the headdim /
    dstate tile (pb, nb) of the state it carries."""

    b: Any
    h: Any
    g: Any
    pb: Any
    nb: Any


def state_tile_of_block(nheads, ngroups, dstate, BLOCK_N) -> StateTile:
    """Device helper: this block's StateTile in the state passes' grid (`chunk_state_fwd_grid`): the dstate
    tiles of one (batch, head) are consecutive blocks."""
    tiles_n = dstate // BLOCK_N
    bh, pb, nb = ct.bid(0) // tiles_n, ct.bid(1), ct.bid(0) % tiles_n
    b, h, g = batch_head_group(bh, nheads, ngroups)
    return StateTile(b, h, g, pb, nb)


def _load_chunk(x, B, dt_out, dA_cumsum, tile, c, CHUNK, BLOCK_P, BLOCK_N, LOAD_LAT):
    """Chunk c's operands for `tile`: x_c [CHUNK, BLOCK_P] and B_c [CHUNK, BLOCK_N] in x's dtype (zero past
    seqlen), Δ and dA [CHUNK] f32."""
    x_c = ct.load(x, index=(tile.b, c, tile.h, tile.pb), shape=(1, CHUNK, 1, BLOCK_P),
                  padding_mode=ct.PaddingMode.ZERO, latency=LOAD_LAT).reshape((CHUNK, BLOCK_P))
    B_c = ct.load(B, index=(tile.b, c, tile.g, tile.nb), shape=(1, CHUNK, 1, BLOCK_N),
                  padding_mode=ct.PaddingMode.ZERO, latency=LOAD_LAT).reshape((CHUNK, BLOCK_N))
    delta = ct.load(dt_out, index=(tile.b, tile.h, c, 0), shape=(1, 1, 1, CHUNK),
                    latency=LOAD_LAT).reshape((CHUNK,))
    dA = ct.load(dA_cumsum, index=(tile.b, tile.h, c, 0), shape=(1, 1, 1, CHUNK),
                 latency=LOAD_LAT).reshape((CHUNK,))
    return x_c, B_c, delta, dA


def chunk_state_fwd_kernel(
    x: Big,               # (batch, seqlen, nheads, headdim) T
    B: Big,               # (batch, seqlen, ngroups, dstate) T
    dt_out: Big,          # (batch, nheads, nchunks, CHUNK) f32
    dA_cumsum: Big,       # (batch, nheads, nchunks, CHUNK) f32
    initial_states: Big,  # (batch, nheads, headdim, dstate) f32, or a dummy without HAS_INIT
    seq_idx: Big,         # (batch, seqlen) int32, or a dummy without HAS_SEQ_IDX
    states: Big,          # (batch, nchunks, nheads, headdim, dstate) T or f32, written
    final_states: Big,    # (batch, nheads, headdim, dstate) f32, written
    CHUNK: ConstInt,
    BLOCK_P: ConstInt,
    BLOCK_N: ConstInt,
    HAS_INIT: ConstBool,
    HAS_SEQ_IDX: ConstBool,
    LOAD_LAT: ConstInt,   # latency hint of the per-chunk loads (1..10)
):
    tile = state_tile_of_block(x.shape[2], B.shape[2], B.shape[3], BLOCK_N)
    b, h = tile.b, tile.h
    seqlen = x.shape[1]
    nchunks = ct.cdiv(seqlen, CHUNK)
    operand_dtype = mma_dtype(x.dtype)

    if HAS_INIT:
        state = ct.load(initial_states, index=(b, h, tile.pb, tile.nb), shape=(1, 1, BLOCK_P, BLOCK_N)
                        ).reshape((BLOCK_P, BLOCK_N)).astype(ct.float32)
    else:
        state = ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32)           # [BLOCK_P, BLOCK_N] f32
    prev_end_id = ct.zeros((1,), dtype=ct.int32)                          # e_{-1} = 0

    for c in range(nchunks):
        ct.store(states, index=(b, c, h, tile.pb, tile.nb),
                 tile=state.reshape((1, 1, 1, BLOCK_P, BLOCK_N)).astype(states.dtype))
        x_c, B_c, delta, dA = _load_chunk(x, B, dt_out, dA_cumsum, tile, c, CHUNK, BLOCK_P, BLOCK_N, LOAD_LAT)
        dA_last = ct.extract(dA, index=(CHUNK - 1,), shape=(1,))         # flat past seqlen: last valid
        scale = ct.exp(ct.minimum(dA_last - dA, 0.0)) * delta             # [CHUNK]
        carry = ct.exp(dA_last)                                           # [1]
        if HAS_SEQ_IDX:
            _, prev_end_id, scale, carry = state_seq_rules(seq_idx, b, c, seqlen, CHUNK, prev_end_id, scale, carry)
        B_scaled = (B_c.astype(ct.float32) * scale[:, None]).astype(x.dtype)   # rounded like mamba_ssm
        x_t = x_c.transpose().astype(operand_dtype)
        state = ct.mma(x_t, B_scaled.astype(operand_dtype), state * carry)

    ct.store(final_states, index=(b, h, tile.pb, tile.nb), tile=state.reshape((1, 1, BLOCK_P, BLOCK_N)))


CHUNK_STATE_FWD_KERNELS = int64_index_kernels(chunk_state_fwd_kernel)


@dataclasses.dataclass(frozen=True)
class ChunkStateConfig:
    """Tile sizes and hints of `chunk_state_fwd_kernel`.

    BLOCK_P, BLOCK_N: the state tile one block carries (powers of two dividing headdim, dstate).
    LOAD_LAT: latency hint on the per-chunk loads. OCCUPANCY: expected blocks per SM.
    """

    BLOCK_P: int = 64
    BLOCK_N: int = 32
    LOAD_LAT: int = 6
    OCCUPANCY: int = 4


# Latency hints on the in-loop loads in the state passes' autotune spaces.
LOAD_LATENCIES = (2, 4, 6)


def chunk_state_fwd_configs(dims: SSDDims, arch: str = "sm_90") -> list[ChunkStateConfig]:
    """The autotune space (sm_90): state tiles of 64/128 x 16..64 (at most 64 x 64 f32 values carried),
    each with the `LOAD_LATENCIES` at occupancy 2, and the 64 x 32 tile at occupancy 4.

    BLOCK_P is the M side of the x^T @ B mma: wgmma needs M >= 64 (with 32 the SASS falls back to
    mma.sync and spills), so only a headdim below 64 gets a smaller tile. Small BLOCK_N gives more
    blocks (the kernel is a latency-bound chain over chunks with only batch * nheads * tiles blocks);
    large ones reuse each x/B load more. Occupancy is what hides the chain's latency, and shared
    memory caps it: at occupancy 2 the 64 x 32 tile's pipelined loads take 73-102 KB per block (two
    blocks per SM), at occupancy 4 46-50 KB with 64 registers and no spills (tileiras 13.4), so four
    chains interleave per SM.
    """
    check_arch("chunk_state_fwd_configs", arch)
    tiles = [(bp, bn) for bp in sorted({min(64, dims.headdim), min(128, dims.headdim)})
             for bn in (16, 32, 64) if bn <= dims.dstate and bp * bn <= 64 * 64]
    return [ChunkStateConfig(BLOCK_P=bp, BLOCK_N=bn, LOAD_LAT=lat, OCCUPANCY=occ)
            for occ in (2, 4) for bp, bn in tiles
            if occ == 2 or (bp, bn) == (min(64, dims.headdim), min(32, dims.dstate))
            for lat in LOAD_LATENCIES]


def chunk_state_fwd_default_config(dims: SSDDims) -> ChunkStateConfig:
    """TileGym's tile, BLOCK_P = min(64, headdim) x BLOCK_N = min(32, dstate), at occupancy 4 and
    latency 6: the best of both state passes' spaces in the tuning runs (TileGym uses occupancy 2 and
    latency 4)."""
    return ChunkStateConfig(BLOCK_P=min(64, dims.headdim), BLOCK_N=min(32, dims.dstate), LOAD_LAT=6,
                            OCCUPANCY=4)


def chunk_state_fwd_grid(dims: SSDDims, cfg: ChunkStateConfig) -> tuple[int, int]:
    return (dims.batch * dims.nheads * (dims.dstate // cfg.BLOCK_N), dims.headdim // cfg.BLOCK_P)


def chunk_state_fwd_launch(dims: SSDDims, cfg: ChunkStateConfig | None = None) -> Launch:
    """The launch writing ("states", "final_states")."""
    cfg = cfg or chunk_state_fwd_default_config(dims)
    return kernel_launch(
        select_kernel(CHUNK_STATE_FWD_KERNELS, dims, occupancy=cfg.OCCUPANCY), chunk_state_fwd_grid(dims, cfg),
        writes=("states", "final_states"), CHUNK=dims.chunk_size, BLOCK_P=cfg.BLOCK_P, BLOCK_N=cfg.BLOCK_N,
        HAS_INIT=dims.has_init, HAS_SEQ_IDX=dims.has_seq_idx, LOAD_LAT=cfg.LOAD_LAT)


CHUNK_STATE_STAGE = Stage(
    name="chunk_state", config_type=ChunkStateConfig, space=chunk_state_fwd_configs,
    default=chunk_state_fwd_default_config, launch=chunk_state_fwd_launch,
    key_fields=("chunk_size", "headdim", "dstate", "dtype", "has_init", "has_seq_idx"),
    # One block walks all chunks of one (batch, head): the parallelism is batch * nheads.
    work_items=lambda d: d.batch * d.nheads)
