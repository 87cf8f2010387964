"""Stage 1 of the SSD forward: the time steps Δ and their per-chunk decay cumsum.

Mirrors `reference.chunk_cumsum` (mamba_ssm `_chunk_cumsum_fwd`):

    v       = dt[b, t, h] + dt_bias[h]                                 (fp32)
    Δ       = where(v <= 20, log(exp(v) + 1), v)        if DT_SOFTPLUS
    Δ       = clip(Δ, DT_MIN, DT_MAX)                    if HAS_DT_LIMIT
    Δ       = 0                                          for t >= seqlen (padded tail of the last chunk)
    dt_out[b, h, c, l]    = Δ[b, c*Q + l, h]
    dA_cumsum[b, h, c, l] = Σ_{r<=l} Δ[b, c*Q + r, h] · A[h]           (natural-log units)

Because Δ is zero on the padded tail, dA_cumsum is flat there and dA_cumsum[..., Q-1] is the value at the
last valid token, which is what the later stages read as the chunk's total decay.

Grid: (nchunks, cdiv(nheads, BLOCK_H), batch). One block loads a (Q, BLOCK_H) tile of dt (contiguous in
heads), and writes (BLOCK_H, Q) tiles of both outputs, whose (b, h, c) rows are contiguous so that the
next stages read them with single TMA boxes.

Shapes: dt (batch, seqlen, nheads) bf16/f16/f32; A, dt_bias (nheads,) f32;
dt_out, dA_cumsum (batch, nheads, nchunks, chunk_size) f32.
"""
import dataclasses

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    Big, ConstBool, ConstFloat, ConstInt, Launch, SSDDims, Stage, check_arch, dt_transform, dt_transform_constants,
    int64_index_kernels, kernel_launch, next_power_of_2, select_kernel)


def chunk_cumsum_fwd_kernel(
    dt: Big,              # (batch, seqlen, nheads) bf16/f16/f32
    A,                    # (nheads,) f32
    dt_bias,              # (nheads,) f32
    dt_out: Big,          # (batch, nheads, nchunks, CHUNK) f32, written
    dA_cumsum: Big,       # (batch, nheads, nchunks, CHUNK) f32, written
    CHUNK: ConstInt,
    BLOCK_H: ConstInt,
    DT_SOFTPLUS: ConstBool,
    HAS_DT_LIMIT: ConstBool,
    DT_MIN: ConstFloat,
    DT_MAX: ConstFloat,
):
    c = ct.bid(0)
    hb = ct.bid(1)
    b = ct.bid(2)
    seqlen = dt.shape[1]

    dt_tile = ct.load(dt, index=(b, c, hb), shape=(1, CHUNK, BLOCK_H),
                      padding_mode=ct.PaddingMode.ZERO).reshape((CHUNK, BLOCK_H)).astype(ct.float32)
    a = ct.load(A, index=(hb,), shape=(BLOCK_H,), padding_mode=ct.PaddingMode.ZERO)
    bias = ct.load(dt_bias, index=(hb,), shape=(BLOCK_H,), padding_mode=ct.PaddingMode.ZERO)

    delta = dt_transform(dt_tile + bias[None, :], DT_SOFTPLUS, HAS_DT_LIMIT, DT_MIN, DT_MAX)  # [CHUNK, BLOCK_H]
    token = c * CHUNK + ct.arange(CHUNK, dtype=ct.int32)
    delta = ct.where((token < seqlen)[:, None], delta, 0.0)
    dA_cs = ct.cumsum(delta * a[None, :], axis=0)                             # [CHUNK, BLOCK_H]

    ct.store(dt_out, index=(b, hb, c, 0), tile=delta.transpose().reshape((1, BLOCK_H, 1, CHUNK)))
    ct.store(dA_cumsum, index=(b, hb, c, 0), tile=dA_cs.transpose().reshape((1, BLOCK_H, 1, CHUNK)))


CHUNK_CUMSUM_FWD_KERNELS = int64_index_kernels(chunk_cumsum_fwd_kernel)


@dataclasses.dataclass(frozen=True)
class ChunkCumsumConfig:
    """Tile sizes and hints of `chunk_cumsum_fwd_kernel`. BLOCK_H: heads per block (power of two)."""

    BLOCK_H: int = 8
    OCCUPANCY: int = 4


def chunk_cumsum_fwd_configs(dims: SSDDims, arch: str = "sm_90") -> list[ChunkCumsumConfig]:
    """The autotune space (sm_90): BLOCK_H 2..16 up to the (padded) head count, occupancy 2/4/8."""
    check_arch("chunk_cumsum_fwd_configs", arch)
    max_block_h = min(next_power_of_2(dims.nheads), 16)
    return [ChunkCumsumConfig(BLOCK_H=bh, OCCUPANCY=occ)
            for bh in (2, 4, 8, 16) if bh <= max_block_h
            for occ in (2, 4, 8)] or [ChunkCumsumConfig(BLOCK_H=1, OCCUPANCY=4)]


def chunk_cumsum_fwd_default_config(dims: SSDDims) -> ChunkCumsumConfig:
    """Small enough that a (CHUNK, BLOCK_H) tile stays ~2K f32 values; enough blocks to fill the GPU."""
    return ChunkCumsumConfig(BLOCK_H=min(next_power_of_2(dims.nheads), 16, 2048 // dims.chunk_size),
                             OCCUPANCY=4)


def chunk_cumsum_fwd_grid(dims: SSDDims, cfg: ChunkCumsumConfig) -> tuple[int, int, int]:
    return (dims.nchunks, -(-dims.nheads // cfg.BLOCK_H), dims.batch)


def chunk_cumsum_fwd_launch(dims: SSDDims, cfg: ChunkCumsumConfig | None = None) -> Launch:
    """The launch writing ("dt_out", "dA_cumsum") from inputs ("dt", "A", "dt_bias")."""
    cfg = cfg or chunk_cumsum_fwd_default_config(dims)
    return kernel_launch(
        select_kernel(CHUNK_CUMSUM_FWD_KERNELS, dims, occupancy=cfg.OCCUPANCY), chunk_cumsum_fwd_grid(dims, cfg),
        writes=("dt_out", "dA_cumsum"), CHUNK=dims.chunk_size, BLOCK_H=cfg.BLOCK_H, **dt_transform_constants(dims))


# Keyed by what its kernel specialises on (the dt transform's flags, the head count it tiles); its work is
# one (chunk, head) row pair of dt per item.
CUMSUM_KEY_FIELDS = ("chunk_size", "nheads", "dt_dtype", "dt_softplus", "has_dt_limit")

CHUNK_CUMSUM_STAGE = Stage(
    name="chunk_cumsum", config_type=ChunkCumsumConfig, space=chunk_cumsum_fwd_configs,
    default=chunk_cumsum_fwd_default_config, launch=chunk_cumsum_fwd_launch, key_fields=CUMSUM_KEY_FIELDS,
    work_items=lambda d: d.batch * d.nchunks * d.nheads)
