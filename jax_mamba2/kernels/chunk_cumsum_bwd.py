"""Backward of chunk_cumsum: gathers the Δ and dA_cumsum gradients of the other backward stages and
chains them through the cumsum, dt_limit, softplus and dt_bias to the raw dt (notation in
_tiles.py).

The forward (chunk_cumsum.py) computes v = dt + dt_bias, Δ = clip(softplus(v), DT_MIN, DT_MAX) (0 past
seqlen) and dA_l = A Σ_{r<=l} Δ_r within each chunk. With R_r = Σ_{l>=r} ∂L/∂dA_l, the gradient w.r.t. the
decay increment Δ_r A, the chain rule gives

    ∂L/∂Δ_r = ddt_out_r + A R_r,       dA = Σ_{b,c,r} Δ_r R_r,
    ddt_r   = ∂L/∂Δ_r · [DT_MIN <= softplus(v_r) <= DT_MAX] · (σ(v_r) if v_r <= 20 else 1),
    ddt_bias = Σ_{b,t} ddt_t

(the clamp mask only with HAS_DT_LIMIT, the softplus factor only with DT_SOFTPLUS; mamba_ssm
`_chunk_cumsum_bwd`). R is assembled from the four pieces, each free of cancellation:

    R_r = Σ_{l>=r} ddA_inter_l        (output's inter-chunk term, chunk_scan_bwd_dc)
        + Σ_{s<r} ddA_state_s         (end state S_c, chunk_scan_bwd_dx)
        + Σ_m ddA_intra[m, r]         (output's intra-chunk term, stable form, chunk_scan_bwd_dc)
        + Σ ddA_chunk                 (carry of the state passing, ∂L/∂dA_last, in sums over each
                                       state tile's 16-row warp groups; chunk_state_bwd)

where ddA_intra[m, r] was written by row block m only for r < (m+1) BLOCK_M, and row blocks wholly past
seqlen wrote nothing (both masked here; every per-row input is masked to valid tokens).

dA and ddt_bias are reduced over (batch, chunk) later, in a fixed order (param_grads_bwd), so this stage
writes per-(batch, chunk) partials.

Grid: (nchunks, cdiv(nheads, BLOCK_H), batch). One block handles BLOCK_H heads of one chunk: per-row
vectors as (BLOCK_H, CHUNK) tiles, dt and ddt as (CHUNK, BLOCK_H) tiles of the (batch, seqlen, nheads) arrays.

Shapes: dt (batch, seqlen, nheads) T or f32; A, dt_bias (nheads,) f32; dt_out, ddt_out, ddA_inter,
ddA_state (batch, nheads, nchunks, CHUNK) f32; ddA_intra (batch, nheads, nchunks, NUM_M_BLOCKS, CHUNK) f32;
ddA_chunk (batch, nheads, nchunks, NUM_CARRY_TERMS) f32; ddt (batch, seqlen, nheads) in dt's dtype (stored
rounded from f32: the gradient's own dtype, so no cast follows);
dA_partials, ddt_bias_partials (batch * nchunks, nheads) f32.
"""
import cuda.tile as ct

from jax_mamba2.kernels._common import (
    Big, ConstBool, ConstFloat, ConstInt, Launch, SSDDims, Stage, check_arch, dt_transform_constants,
    int64_index_kernels, kernel_launch, next_power_of_2, select_kernel)
from jax_mamba2.kernels.chunk_cumsum import CUMSUM_KEY_FIELDS, ChunkCumsumConfig, chunk_cumsum_fwd_grid


def _load_heads_rows(array, b, hb, c, BLOCK_H, CHUNK):
    """array[b, hb*BLOCK_H : (hb+1)*BLOCK_H, c, :] of a (batch, nheads, nchunks, CHUNK) f32 array
    -> [BLOCK_H, CHUNK] (heads past nheads read as 0)."""
    return ct.load(array, index=(b, hb, c, 0), shape=(1, BLOCK_H, 1, CHUNK),
                   padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_H, CHUNK))


def chunk_cumsum_bwd_kernel(
    dt: Big,                 # (batch, seqlen, nheads) T or f32, raw
    A,                       # (nheads,) f32
    dt_bias,                 # (nheads,) f32
    dt_out: Big,             # (batch, nheads, nchunks, CHUNK) f32, Δ
    ddt_out: Big,            # (batch, nheads, nchunks, CHUNK) f32
    ddA_inter: Big,          # (batch, nheads, nchunks, CHUNK) f32
    ddA_state: Big,          # (batch, nheads, nchunks, CHUNK) f32
    ddA_intra: Big,          # (batch, nheads, nchunks, NUM_M_BLOCKS, CHUNK) f32
    ddA_chunk: Big,          # (batch, nheads, nchunks, NUM_CARRY_TERMS) f32
    ddt: Big,                # (batch, seqlen, nheads) in dt's dtype, written
    dA_partials,             # (batch * nchunks, nheads) f32, written
    ddt_bias_partials,       # (batch * nchunks, nheads) f32, written
    CHUNK: ConstInt,
    BLOCK_H: ConstInt,
    BLOCK_M: ConstInt,       # the row block of chunk_scan_bwd_dc, which wrote ddA_intra
    NUM_M_BLOCKS: ConstInt,  # CHUNK // BLOCK_M
    NUM_CARRY_TERMS: ConstInt,
    DT_SOFTPLUS: ConstBool,
    HAS_DT_LIMIT: ConstBool,
    DT_MIN: ConstFloat,
    DT_MAX: ConstFloat,
):
    c = ct.bid(0)
    hb = ct.bid(1)
    b = ct.bid(2)
    seqlen = dt.shape[1]
    nchunks = ct.cdiv(seqlen, CHUNK)
    pos = ct.arange(CHUNK, dtype=ct.int32)
    valid = (c * CHUNK + pos < seqlen)[None, :]                              # [1, CHUNK]

    inter = ct.where(valid, _load_heads_rows(ddA_inter, b, hb, c, BLOCK_H, CHUNK), 0.0)
    state = ct.where(valid, _load_heads_rows(ddA_state, b, hb, c, BLOCK_H, CHUNK), 0.0)
    intra = ct.load(ddA_intra, index=(b, hb, c, 0, 0), shape=(1, BLOCK_H, 1, NUM_M_BLOCKS, CHUNK),
                    padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_H, NUM_M_BLOCKS, CHUNK))
    block = ct.arange(NUM_M_BLOCKS, dtype=ct.int32)[:, None]                 # [NUM_M_BLOCKS, 1]
    written = (c * CHUNK + block * BLOCK_M < seqlen) & (pos[None, :] < (block + 1) * BLOCK_M)
    intra = ct.sum(ct.where(written[None, :, :], intra, 0.0), axis=1)        # [BLOCK_H, CHUNK]
    carry = ct.load(ddA_chunk, index=(b, hb, c, 0), shape=(1, BLOCK_H, 1, NUM_CARRY_TERMS),
                    padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_H, NUM_CARRY_TERMS))
    ddA = (ct.cumsum(inter, axis=1, reverse=True) + (ct.cumsum(state, axis=1) - state) + intra
           + ct.sum(carry, axis=1)[:, None])                                 # R [BLOCK_H, CHUNK]

    a = ct.load(A, index=(hb,), shape=(BLOCK_H,), padding_mode=ct.PaddingMode.ZERO)
    delta = _load_heads_rows(dt_out, b, hb, c, BLOCK_H, CHUNK)
    ddelta = ct.where(valid, _load_heads_rows(ddt_out, b, hb, c, BLOCK_H, CHUNK), 0.0) + a[:, None] * ddA
    ct.store(dA_partials, index=(b * nchunks + c, hb),
             tile=ct.sum(ct.where(valid, delta * ddA, 0.0), axis=1).reshape((1, BLOCK_H)))

    v = ct.load(dt, index=(b, c, hb), shape=(1, CHUNK, BLOCK_H), padding_mode=ct.PaddingMode.ZERO
                ).reshape((CHUNK, BLOCK_H)).astype(ct.float32).transpose()  # [BLOCK_H, CHUNK]
    v = v + ct.load(dt_bias, index=(hb,), shape=(BLOCK_H,), padding_mode=ct.PaddingMode.ZERO)[:, None]
    grad = ddelta
    delta_unclipped = v
    if DT_SOFTPLUS:
        below = v <= 20.0
        delta_unclipped = ct.where(below, ct.log(ct.exp(v) + 1.0), v)
        grad = grad * ct.where(below, 1.0 / (1.0 + ct.exp(-v)), 1.0)
    if HAS_DT_LIMIT:
        grad = ct.where((delta_unclipped < DT_MIN) | (delta_unclipped > DT_MAX), 0.0, grad)
    grad = ct.where(valid, grad, 0.0)
    ct.store(ddt, index=(b, c, hb), tile=grad.transpose().reshape((1, CHUNK, BLOCK_H)).astype(ddt.dtype))
    ct.store(ddt_bias_partials, index=(b * nchunks + c, hb), tile=ct.sum(grad, axis=1).reshape((1, BLOCK_H)))


CHUNK_CUMSUM_BWD_KERNELS = int64_index_kernels(chunk_cumsum_bwd_kernel)


# The forward's per-(chunk, head block) layout: its config and grid.
ChunkCumsumBwdConfig = ChunkCumsumConfig
chunk_cumsum_bwd_grid = chunk_cumsum_fwd_grid


def chunk_cumsum_bwd_configs(dims: SSDDims, arch: str = "sm_90") -> list[ChunkCumsumBwdConfig]:
    """The autotune space (sm_90): BLOCK_H 1..8 up to the (padded) head count, occupancy 2/4/8."""
    check_arch("chunk_cumsum_bwd_configs", arch)
    max_block_h = min(next_power_of_2(dims.nheads), 8)
    return [ChunkCumsumBwdConfig(BLOCK_H=bh, OCCUPANCY=occ)
            for bh in (1, 2, 4, 8) if bh <= max_block_h
            for occ in (2, 4, 8)]


def chunk_cumsum_bwd_default_config(dims: SSDDims) -> ChunkCumsumBwdConfig:
    """BLOCK_H so that one (BLOCK_H, CHUNK) tile holds at most 1K f32 values (8 heads at most)."""
    return ChunkCumsumBwdConfig(BLOCK_H=min(next_power_of_2(dims.nheads), max(1024 // dims.chunk_size, 1), 8),
                                OCCUPANCY=4)


def chunk_cumsum_bwd_launch(dims: SSDDims, cfg: ChunkCumsumBwdConfig | None = None, *,
                            dc_block_m: int, carry_terms: int) -> Launch:
    """The launch writing ("ddt", "dA_partials", "ddt_bias_partials").

    `dc_block_m`: BLOCK_M of the chunk_scan_bwd_dc launch (the layout of ddA_intra); `carry_terms`:
    the entries per chunk of the chunk_state_bwd launch's ddA_chunk (its last axis).
    """
    cfg = cfg or chunk_cumsum_bwd_default_config(dims)
    return kernel_launch(
        select_kernel(CHUNK_CUMSUM_BWD_KERNELS, dims, occupancy=cfg.OCCUPANCY), chunk_cumsum_bwd_grid(dims, cfg),
        writes=("ddt", "dA_partials", "ddt_bias_partials"), CHUNK=dims.chunk_size, BLOCK_H=cfg.BLOCK_H,
        BLOCK_M=dc_block_m, NUM_M_BLOCKS=dims.chunk_size // dc_block_m, NUM_CARRY_TERMS=carry_terms,
        **dt_transform_constants(dims))


CHUNK_CUMSUM_BWD_STAGE = Stage(
    name="chunk_cumsum_bwd", config_type=ChunkCumsumBwdConfig, space=chunk_cumsum_bwd_configs,
    default=chunk_cumsum_bwd_default_config, launch=chunk_cumsum_bwd_launch, key_fields=CUMSUM_KEY_FIELDS,
    work_items=lambda d: d.batch * d.nchunks * d.nheads)
