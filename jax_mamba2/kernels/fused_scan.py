"""Stages 2-4 of the SSD forward in one kernel: each block carries its state through the chunks and
writes the outputs as it goes, so the chunk-entry states never leave the SM.

Computes what chunk_state (+ state passing) followed by chunk_scan compute, with the same rounding
(the state enters the C·H product in x's dtype, the carried state stays f32). For batch b, head h
(group g = h // (nheads / ngroups)), chunk c with rows l, s, dA = dA_cumsum[b, h, c], Δ = dt_out[b, h, c]
and H_c the state entering chunk c, stored transposed as Hᵀ [dstate, headdim] (H_0 = initial_states):

    y[l]     = exp(dA[l]) * (C[l] @ H_c^T) + Σ_{s<=l} (C[l] · B[s]) exp(min(dA[l] - dA[s], 0)) Δ[s] x[s]
               + D[h] * x[l],          out[l] = y[l] * silu(z[l]) if HAS_Z
    H_{c+1}  = exp(dA[Q-1]) * H_c + x_c^T @ (B_c * exp(min(dA[Q-1] - dA[l], 0)) * Δ[l])
    final_states[b, h] = H_nchunks

with chunk_state's and chunk_scan's seq_idx rules (`_tiles.py`): the carry is dropped when a chunk ends in
another sequence than the previous one, the state only collects tokens of the chunk's last sequence,
the C·H term only reaches rows of the previous chunk's last sequence, and intra-chunk pairs need equal
ids.

The trade against the staged plan: no entry states are written and read back (2 * batch * nchunks *
nheads * headdim * dstate * 2 bytes, 536 MB at (4,8192,32,64,128), chunk 64), and C·B^T and the state
product share one load of each chunk's B, C and x; but the work is one sequential chain per (batch, head,
headdim block), batch * nheads * headdim / BLOCK_P blocks in all, so it needs that many to fill the GPU
(`forward.forward_layout` decides).

Grid: (batch * nheads, headdim / BLOCK_P). The loads of chunk c+1 do not depend on the carried state, so
the `LOAD_LAT` hint lets them be issued while chunk c computes.

Shapes: x, z, out (batch, seqlen, nheads, headdim) T (z a dummy without HAS_Z); B, C (batch, seqlen,
ngroups, dstate) T; D (nheads, headdim) f32; dt_out, dA_cumsum (batch, nheads, nchunks, chunk_size) f32;
initial_states, final_states (batch, nheads, headdim, dstate) f32 (initial_states a dummy without
HAS_INIT); seq_idx (batch, seqlen) int32 or a dummy.
"""
import dataclasses

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    ConstBool, ConstInt, Launch, SSDDims, check_arch, int64_index_kernels, mma_dtype, select_kernel,
    silu_gate)
from jax_mamba2.kernels._tiles import batch_head_group, last_valid_id, row_ids


def _load_rows(array, b, c, col_block, index, CHUNK, WIDTH, LOAD_LAT):
    """Chunk c's [CHUNK, WIDTH] tile of a (batch, seqlen, heads or groups, width) array at head/group
    `index`, column block `col_block` (zero past seqlen)."""
    return ct.load(array, index=(b, c, index, col_block), shape=(1, CHUNK, 1, WIDTH),
                   padding_mode=ct.PaddingMode.ZERO, latency=LOAD_LAT).reshape((CHUNK, WIDTH))


def _fused_scan_body(x, B, C, D, z, dt_out, dA_cumsum, initial_states, seq_idx, out, final_states,
                     CHUNK, DSTATE, BLOCK_P, HAS_Z, HAS_INIT, HAS_SEQ_IDX, LOAD_LAT):
    bh = ct.bid(0)
    pb = ct.bid(1)
    seqlen = x.shape[1]
    b, h, g = batch_head_group(bh, x.shape[2], B.shape[2])
    nchunks = ct.cdiv(seqlen, CHUNK)
    operand_dtype = mma_dtype(x.dtype)

    if HAS_INIT:
        state_t = ct.load(initial_states, index=(b, h, pb, 0), shape=(1, 1, BLOCK_P, DSTATE)
                          ).reshape((BLOCK_P, DSTATE)).transpose()        # [DSTATE, BLOCK_P] f32
    else:
        state_t = ct.zeros((DSTATE, BLOCK_P), dtype=ct.float32)
    prev_end_id = ct.zeros((1,), dtype=ct.int32)                          # e_{-1} = 0
    D_p = ct.load(D, index=(h, pb), shape=(1, BLOCK_P)).reshape((BLOCK_P,))
    rows = ct.arange(CHUNK, dtype=ct.int32)
    causal = rows[:, None] >= rows[None, :]

    for c in range(nchunks):
        C_c = _load_rows(C, b, c, 0, g, CHUNK, DSTATE, LOAD_LAT).astype(operand_dtype)
        B_c = _load_rows(B, b, c, 0, g, CHUNK, DSTATE, LOAD_LAT)
        x_c = _load_rows(x, b, c, pb, h, CHUNK, BLOCK_P, LOAD_LAT)
        delta = ct.load(dt_out, index=(b, h, c, 0), shape=(1, 1, 1, CHUNK), latency=LOAD_LAT).reshape((CHUNK,))
        dA = ct.load(dA_cumsum, index=(b, h, c, 0), shape=(1, 1, 1, CHUNK), latency=LOAD_LAT).reshape((CHUNK,))
        dA_last = ct.extract(dA, index=(CHUNK - 1,), shape=(1,))         # flat past seqlen: last valid
        inter_scale = ct.exp(dA)                                          # rows H_c reaches
        keep = causal                                                     # intra-chunk pairs
        state_scale = ct.exp(ct.minimum(dA_last - dA, 0.0)) * delta       # tokens H_{c+1} collects
        carry = ct.exp(dA_last)
        if HAS_SEQ_IDX:
            ids = row_ids(seq_idx, b, c, CHUNK)
            end_id = last_valid_id(ids, c, seqlen, CHUNK)
            inter_scale = ct.where(ids == prev_end_id, inter_scale, 0.0)
            keep = keep & (ids[:, None] == ids[None, :])
            state_scale = ct.where(ids == end_id, state_scale, 0.0)
            carry = ct.where(end_id == prev_end_id, carry, 0.0)
            prev_end_id = end_id

        x_op = x_c.astype(operand_dtype)
        cb = ct.mma(C_c, B_c.astype(operand_dtype).transpose(), ct.zeros((CHUNK, CHUNK), dtype=ct.float32))
        acc = ct.mma(C_c, state_t.astype(x.dtype).astype(operand_dtype),
                     ct.zeros((CHUNK, BLOCK_P), dtype=ct.float32))
        acc = acc * inter_scale[:, None]
        decay = ct.exp(ct.minimum(dA[:, None] - dA[None, :], 0.0))
        scores = ct.where(keep, cb * decay * delta[None, :], 0.0).astype(x.dtype).astype(operand_dtype)
        acc = ct.mma(scores, x_op, acc)
        acc = acc + x_c.astype(ct.float32) * D_p[None, :]
        if HAS_Z:
            acc = silu_gate(acc, _load_rows(z, b, c, pb, h, CHUNK, BLOCK_P, LOAD_LAT))
        ct.store(out, index=(b, c, h, pb), tile=acc.reshape((1, CHUNK, 1, BLOCK_P)).astype(out.dtype))

        B_scaled = (B_c.astype(ct.float32) * state_scale[:, None]).astype(x.dtype)  # rounded like mamba_ssm
        state_t = ct.mma(B_scaled.transpose().astype(operand_dtype), x_op, state_t * carry)

    ct.store(final_states, index=(b, h, pb, 0),
             tile=state_t.transpose().reshape((1, 1, BLOCK_P, DSTATE)))


def _make_fused_scan_fwd_kernel(Big):
    @ct.kernel
    def fused_scan_fwd_kernel(
        x: Big,               # (batch, seqlen, nheads, headdim) T
        B: Big,               # (batch, seqlen, ngroups, dstate) T
        C: Big,               # (batch, seqlen, ngroups, dstate) T
        D,                    # (nheads, headdim) f32
        z: Big,               # (batch, seqlen, nheads, headdim) T, or a dummy without HAS_Z
        dt_out: Big,          # (batch, nheads, nchunks, CHUNK) f32
        dA_cumsum: Big,       # (batch, nheads, nchunks, CHUNK) f32
        initial_states: Big,  # (batch, nheads, headdim, dstate) f32, or a dummy without HAS_INIT
        seq_idx: Big,         # (batch, seqlen) int32, or a dummy without HAS_SEQ_IDX
        out: Big,             # (batch, seqlen, nheads, headdim) T, written
        final_states: Big,    # (batch, nheads, headdim, dstate) f32, written
        CHUNK: ConstInt,
        DSTATE: ConstInt,
        BLOCK_P: ConstInt,    # headdim columns per block
        HAS_Z: ConstBool,
        HAS_INIT: ConstBool,
        HAS_SEQ_IDX: ConstBool,
        LOAD_LAT: ConstInt,   # latency hint of the per-chunk loads (1..10)
    ):
        _fused_scan_body(x, B, C, D, z, dt_out, dA_cumsum, initial_states, seq_idx, out, final_states,
                         CHUNK, DSTATE, BLOCK_P, HAS_Z, HAS_INIT, HAS_SEQ_IDX, LOAD_LAT)

    return fused_scan_fwd_kernel


# (int32-indexed, int64-indexed) entries of the one body.
FUSED_SCAN_FWD_KERNELS = int64_index_kernels(_make_fused_scan_fwd_kernel)
fused_scan_fwd_kernel = FUSED_SCAN_FWD_KERNELS[0]


@dataclasses.dataclass(frozen=True)
class FusedScanConfig:
    """Tile size and hints of `fused_scan_fwd_kernel`.

    BLOCK_P: headdim columns per block (a power of two dividing headdim); the block carries a
    [dstate, BLOCK_P] f32 state. LOAD_LAT: latency hint on the per-chunk loads. occupancy: expected
    blocks per SM.
    """

    BLOCK_P: int = 64
    LOAD_LAT: int = 6
    occupancy: int = 1


# The chunk sizes the fused kernel takes: its [CHUNK, CHUNK] f32 C·B^T and [dstate, BLOCK_P] f32 state
# live in registers next to each other.
FUSED_CHUNK_SIZES = (16, 32, 64)
# Largest carried state (dstate * BLOCK_P f32 values) per block.
_MAX_STATE = 128 * 64


def fused_scan_supported(dims: SSDDims) -> bool:
    """Whether the fused kernel has a configuration for `dims` (chunk size and state size)."""
    return dims.chunk_size in FUSED_CHUNK_SIZES and dims.dstate * min(16, dims.headdim) <= _MAX_STATE


def _widths(dims: SSDDims) -> list[int]:
    """BLOCK_P candidates: 32 and 64 where they fit; 16 only where nothing wider does (below 32
    columns the wgmma N side is too narrow: tileiras emits mma.sync, measured 2x slower)."""
    fits = [bp for bp in (16, 32, 64) if bp <= dims.headdim and dims.dstate * bp <= _MAX_STATE]
    return [bp for bp in fits if bp >= 32] or fits


def fused_scan_fwd_configs(dims: SSDDims, arch: str = "sm_90") -> list[FusedScanConfig]:
    """The autotune space (sm_90): BLOCK_P 32/64 (dividing headdim, state at most 128 x 64 f32),
    latency 2/4/6, occupancy 1/2; empty where `fused_scan_supported(dims)` is false."""
    check_arch("fused_scan_fwd_configs", arch)
    if not fused_scan_supported(dims):
        return []
    return [FusedScanConfig(BLOCK_P=bp, LOAD_LAT=lat, occupancy=occ)
            for bp in _widths(dims) for lat in (2, 4, 6) for occ in (1, 2)]


def fused_scan_fwd_default_config(dims: SSDDims) -> FusedScanConfig:
    """The widest BLOCK_P (64 up to dstate 128) at occupancy 1 and latency 6: the best of the space on
    the H200 at (4,8192,32,64,128,1), chunk 64 (219 us; occupancy 2 at 64 columns 421-433 us, 32
    columns 336-457 us), and at occupancy 1 also the best measured at (4,2048,32,...), (4,8192,80,...)
    and (4,8192,64,...,G=8) (benchmarks/NOTES.md)."""
    return FusedScanConfig(BLOCK_P=_widths(dims)[-1], LOAD_LAT=6, occupancy=1)


def fused_scan_fwd_grid(dims: SSDDims, cfg: FusedScanConfig) -> tuple[int, int]:
    return (dims.batch * dims.nheads, dims.headdim // cfg.BLOCK_P)


def fused_scan_fwd_launch(dims: SSDDims, cfg: FusedScanConfig | None = None) -> Launch:
    """The launch writing ("out", "final_states")."""
    cfg = cfg or fused_scan_fwd_default_config(dims)
    return Launch(
        kernel=select_kernel(FUSED_SCAN_FWD_KERNELS, dims, occupancy=cfg.occupancy),
        grid=fused_scan_fwd_grid(dims, cfg),
        args=("x", "B", "C", "D", "z", "dt_out", "dA_cumsum", "initial_states", "seq_idx", "out",
              "final_states", dims.chunk_size, dims.dstate, cfg.BLOCK_P, dims.has_z, dims.has_init,
              dims.has_seq_idx, cfg.LOAD_LAT),
        writes=("out", "final_states"),
    )
