"""The gradients of the per-head parameters: sums of per-(batch, chunk) partials in a fixed order.

    dA[h]       = Σ_i dA_partials[i, h]           (i = batch * nchunks + chunk;  from chunk_cumsum_bwd)
    ddt_bias[h] = Σ_i ddt_bias_partials[i, h]
    dD[h, p]    = Σ_j dD_partials[j, h, p]         (j = (batch * nchunks + chunk) * row blocks + row block;
                                                    from chunk_scan_bwd_dc)

No atomics: every block sums its rows in the same order on every run, so the result is bitwise
reproducible. The partials are small (a few values per head and chunk), so this stage is cheap.

Grid: (cdiv(nheads, BLOCK_H),). One block walks the partial rows BLOCK_R at a time for BLOCK_H heads.

Shapes: dA_partials, ddt_bias_partials (num_partials, nheads) f32; dD_partials (num_dD_partials, nheads,
headdim) f32; dA, ddt_bias (nheads,) f32; dD (nheads, headdim) f32.
"""
import dataclasses

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    Big, ConstInt, Launch, SSDDims, Stage, check_arch, int64_index_kernels, kernel_launch, next_power_of_2,
    select_kernel)


def param_grads_bwd_kernel(
    dA_partials: Big,        # (batch * nchunks, nheads) f32
    ddt_bias_partials: Big,  # (batch * nchunks, nheads) f32
    dD_partials: Big,        # (batch * nchunks * row blocks, nheads, headdim) f32
    dA,                      # (nheads,) f32, written
    ddt_bias,                # (nheads,) f32, written
    dD,                      # (nheads, headdim) f32, written
    HEADDIM: ConstInt,
    BLOCK_H: ConstInt,       # heads per block
    BLOCK_R: ConstInt,       # partial rows per step
):
    hb = ct.bid(0)
    # Rows are summed elementwise step by step and across the tile once at the end: one cross-warp
    # reduction per output instead of one per step.
    dA_rows = ct.zeros((BLOCK_R, BLOCK_H), dtype=ct.float32)
    ddt_bias_rows = ct.zeros((BLOCK_R, BLOCK_H), dtype=ct.float32)
    for r in range(ct.cdiv(dA_partials.shape[0], BLOCK_R)):
        dA_rows = dA_rows + ct.load(dA_partials, index=(r, hb), shape=(BLOCK_R, BLOCK_H),
                                    padding_mode=ct.PaddingMode.ZERO)
        ddt_bias_rows = ddt_bias_rows + ct.load(ddt_bias_partials, index=(r, hb), shape=(BLOCK_R, BLOCK_H),
                                                padding_mode=ct.PaddingMode.ZERO)
    dD_rows = ct.zeros((BLOCK_R, BLOCK_H, HEADDIM), dtype=ct.float32)
    for r in range(ct.cdiv(dD_partials.shape[0], BLOCK_R)):
        dD_rows = dD_rows + ct.load(dD_partials, index=(r, hb, 0), shape=(BLOCK_R, BLOCK_H, HEADDIM),
                                    padding_mode=ct.PaddingMode.ZERO)
    dA_acc = ct.sum(dA_rows, axis=0)
    ddt_bias_acc = ct.sum(ddt_bias_rows, axis=0)
    dD_acc = ct.sum(dD_rows, axis=0)
    ct.store(dA, index=(hb,), tile=dA_acc)
    ct.store(ddt_bias, index=(hb,), tile=ddt_bias_acc)
    ct.store(dD, index=(hb, 0), tile=dD_acc)


PARAM_GRADS_BWD_KERNELS = int64_index_kernels(param_grads_bwd_kernel)


@dataclasses.dataclass(frozen=True)
class ParamGradsBwdConfig:
    """Tile sizes of `param_grads_bwd_kernel`: BLOCK_H heads per block, BLOCK_R partial rows per step."""

    BLOCK_H: int = 4
    BLOCK_R: int = 32
    OCCUPANCY: int = 4


def param_grads_bwd_configs(dims: SSDDims, arch: str = "sm_90") -> list[ParamGradsBwdConfig]:
    """The autotune space (sm_90): BLOCK_H 1..8, BLOCK_R 16/64, (BLOCK_R, BLOCK_H, headdim) tiles of at
    most 16K values."""
    check_arch("param_grads_bwd_configs", arch)
    return [ParamGradsBwdConfig(BLOCK_H=bh, BLOCK_R=br)
            for bh in (1, 2, 4, 8) if bh <= next_power_of_2(dims.nheads)
            for br in (16, 64) if br * bh * dims.headdim <= 16 * 1024]


def param_grads_bwd_default_config(dims: SSDDims) -> ParamGradsBwdConfig:
    """One head per block (nheads blocks), 64 partial rows per step."""
    return ParamGradsBwdConfig(BLOCK_H=1, BLOCK_R=64, OCCUPANCY=4)


def param_grads_bwd_grid(dims: SSDDims, cfg: ParamGradsBwdConfig) -> tuple[int]:
    return (-(-dims.nheads // cfg.BLOCK_H),)


def param_grads_bwd_launch(dims: SSDDims, cfg: ParamGradsBwdConfig | None = None) -> Launch:
    """The launch writing ("dA", "ddt_bias", "dD")."""
    cfg = cfg or param_grads_bwd_default_config(dims)
    return kernel_launch(
        select_kernel(PARAM_GRADS_BWD_KERNELS, dims, occupancy=cfg.OCCUPANCY), param_grads_bwd_grid(dims, cfg),
        writes=("dA", "ddt_bias", "dD"), HEADDIM=dims.headdim, BLOCK_H=cfg.BLOCK_H, BLOCK_R=cfg.BLOCK_R)


PARAM_GRADS_BWD_STAGE = Stage(
    name="param_grads_bwd", config_type=ParamGradsBwdConfig, space=param_grads_bwd_configs,
    default=param_grads_bwd_default_config, launch=param_grads_bwd_launch, key_fields=("nheads", "headdim"),
    # Each head sums batch * nchunks partial rows.
    work_items=lambda d: d.batch * d.nchunks * d.nheads)
