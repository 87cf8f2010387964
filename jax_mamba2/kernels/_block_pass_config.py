"""Tile configuration shared by the two intra-chunk backward passes (chunk_scan_bwd_dc, chunk_scan_bwd_dx).

Both walk a chunk in blocks of BLOCK_M rows (dc: output rows, dx: source rows) and, per block, the other
side in steps of BLOCK_K; their register pressure, spill behaviour and tune spaces are the same.
"""
import dataclasses
from typing import Any

from jax_mamba2.kernels._common import Launch, SSDDims, check_arch, kernel_launch, select_kernel


@dataclasses.dataclass(frozen=True)
class BlockPassConfig:
    """BLOCK_M: rows of the chunk one block owns; BLOCK_K: rows of the other side per step (powers of
    two dividing chunk_size). LOAD_LAT: latency hint on the step loads. OCCUPANCY: blocks per SM.
    SUM_HEADS (BLOCK_M = BLOCK_K = chunk_size only): a block owns whole chunks, computes C·Bᵀ once for
    all its heads and sums their dCB before one product with B (dC) or C (dB), instead of one per head."""

    BLOCK_M: int = 64
    BLOCK_K: int = 64
    LOAD_LAT: int = 4
    OCCUPANCY: int = 1
    SUM_HEADS: bool = False


# What both passes specialise on (their cache-key fields); the heads per block are keyed besides.
BLOCK_PASS_KEY_FIELDS = ("chunk_size", "headdim", "dstate", "heads_per_group", "dtype", "has_seq_idx")


def block_pass_work_items(dims: SSDDims) -> int:
    """One (batch, chunk, head) triple per work item, before the row tiling and the head grouping."""
    return dims.batch * dims.nchunks * dims.nheads


def is_wide(dims: SSDDims) -> bool:
    """Whether a block's f32 accumulators crowd the register file: f32 (tf32) inputs, headdim >= 128 or
    dstate >= 256. Measured on sm_90 cubins (cuobjdump -res-usage): 64 x 64 tiles are spill-free for
    bf16/f16 at headdim 64, dstate <= 128, and spill otherwise, where 64 x 32 tiles spill least; blocks
    of fewer than 64 rows lose wgmma (HMMA instead) and still spill."""
    return dims.dtype == "float32" or dims.headdim >= 128 or dims.dstate >= 256


def block_pass_configs(dims: SSDDims, arch: str = "sm_90") -> list[BlockPassConfig]:
    """The autotune space of either pass (sm_90): 64-row blocks (and 128 when not wide), 32/64-row steps,
    latency 2/4, occupancy 1/2; at chunk 64 also whole-chunk blocks summing their heads' dCB (SUM_HEADS),
    latency 2/4, occupancy 1/2."""
    check_arch("block_pass_configs", arch)
    block_ms = (64, 128) if not is_wide(dims) and dims.chunk_size >= 128 else (64,)
    summing = [dataclasses.replace(summing_heads_config(dims), LOAD_LAT=lat, OCCUPANCY=occ)
               for lat in (2, 4) for occ in (1, 2)] if dims.chunk_size == 64 else []
    return [BlockPassConfig(BLOCK_M=bm, BLOCK_K=bk, LOAD_LAT=lat, OCCUPANCY=occ)
            for bm in block_ms
            for bk in (32, 64)
            for lat in (2, 4)
            for occ in (1, 2)] + summing


def block_pass_default_config(dims: SSDDims) -> BlockPassConfig:
    """64 x 64 tiles at 2 blocks per SM (two blocks hide each other's per-head chain: measured faster than
    one); 64 x 32 at 1 when wide (see `is_wide`)."""
    wide = is_wide(dims)
    return BlockPassConfig(BLOCK_M=64, BLOCK_K=32 if wide else 64, LOAD_LAT=4, OCCUPANCY=1 if wide else 2)


def sums_heads_by_default(dims: SSDDims) -> bool:
    """Whether the default tiles are whole chunks summing their heads' dCB (SUM_HEADS): at chunk 64 for
    bf16/f16 with headdim <= 64, where it measured faster than the per-head tiles for both passes at every
    dstate (one [CHUNK x CHUNK x dstate] product per block instead of one per head)."""
    return dims.chunk_size == 64 and dims.dtype != "float32" and dims.headdim <= 64


def summing_heads_config(dims: SSDDims) -> BlockPassConfig:
    """Whole-chunk blocks summing their heads' dCB, latency 2; 2 blocks per SM unless wide (where 1 and 2
    measured alike)."""
    return BlockPassConfig(BLOCK_M=dims.chunk_size, BLOCK_K=dims.chunk_size, LOAD_LAT=2,
                           OCCUPANCY=1 if is_wide(dims) else 2, SUM_HEADS=True)


def check_sum_heads(dims: SSDDims, cfg: BlockPassConfig) -> bool:
    """cfg.SUM_HEADS, after checking that its tiles are the whole chunk."""
    if cfg.SUM_HEADS and not cfg.BLOCK_M == cfg.BLOCK_K == dims.chunk_size:
        raise ValueError(f"BlockPassConfig(SUM_HEADS=True) needs BLOCK_M = BLOCK_K = chunk_size "
                         f"({dims.chunk_size}), got BLOCK_M={cfg.BLOCK_M}, BLOCK_K={cfg.BLOCK_K}")
    return cfg.SUM_HEADS


def adds_atomically(dims: SSDDims, heads_per_block: int) -> bool:
    """Whether blocks of `heads_per_block` heads (a divisor of heads_per_group) sum their group's dB/dC
    with atomic adds, i.e. whether a group is split over several blocks."""
    assert dims.heads_per_group % heads_per_block == 0, (dims.heads_per_group, heads_per_block)
    return heads_per_block < dims.heads_per_group


def block_pass_grid(dims: SSDDims, cfg: BlockPassConfig, heads_per_block: int) -> tuple[int, int]:
    """(head blocks * row blocks per chunk * nchunks, batch)."""
    splits = dims.nheads // heads_per_block
    return (splits * (dims.chunk_size // cfg.BLOCK_M) * dims.nchunks, dims.batch)


def block_pass_launch(kernels: tuple[Any, Any], dims: SSDDims, cfg: BlockPassConfig, heads_per_block: int, *,
                      writes: tuple[str, ...], arrays: dict[str, str] | None = None, **constants: Any) -> Launch:
    """The launch of either pass (`kernels`: its int32/int64 pair) for `cfg`, `heads_per_block` heads of a
    group per block, adding the group's sum atomically unless one block owns the whole group; `writes`,
    `arrays` and the pass's own `constants` as `kernel_launch` takes them."""
    return kernel_launch(
        select_kernel(kernels, dims, occupancy=cfg.OCCUPANCY), block_pass_grid(dims, cfg, heads_per_block),
        writes=writes, arrays=arrays, CHUNK=dims.chunk_size, HEADDIM=dims.headdim, DSTATE=dims.dstate,
        BLOCK_M=cfg.BLOCK_M, BLOCK_K=cfg.BLOCK_K, HEADS_PER_BLOCK=heads_per_block, HAS_SEQ_IDX=dims.has_seq_idx,
        ATOMIC_ADD=adds_atomically(dims, heads_per_block), LOAD_LAT=cfg.LOAD_LAT,
        SUM_HEADS=check_sum_heads(dims, cfg), **constants)
