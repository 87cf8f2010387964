"""Forward of the gated, grouped RMSNorm and of the residual add + RMSNorm, as one cuTile kernel.

Mirrors `jax_mamba2.norm_reference`. Per row r and group g (features [g*G, (g+1)*G) of F = ngroups*G),
all in f32:

    h     = x + residual, rounded to residual_out's dtype and stored there      if HAS_RESIDUAL, else x
    h    *= silu(z)                                                             if HAS_Z and not NORM_BEFORE_GATE
    rstd  = 1 / sqrt(mean_g(h^2) + EPS)
    out   = h * rstd * weight[g];   out *= silu(z)                              if HAS_Z and NORM_BEFORE_GATE

Layout: every per-row array is viewed as (rows, ngroups, G) (a free reshape of (..., F)), so a group is one
tile row whatever G is; weight is (ngroups, G) in its own dtype (the parameter's: no conversion pass before the
kernel), widened to f32 as it is loaded. Grid (cdiv(rows, BLOCK_ROWS), ngroups): a block owns one
(BLOCK_ROWS, WIDTH) tile, WIDTH = next_power_of_2(G) (tiles are powers of two); features past G and rows past
the end are loaded as zeros and never stored. Nothing is saved for the backward: it reloads x (and z) and
recomputes rstd, which costs no extra bytes since it reads them anyway.

Memory-bound: per element the gated norm reads x and z and writes out (6 bytes in bf16), the add + norm
reads x (bf16) and residual (f32) and writes residual_out (f32) and out (bf16), 12 bytes. At the LM's
16384 rows x 2048 (gated) / 1024 (add + norm) features that is 201 MB each, 50 us at 4 TB/s.

Absent optional arrays (z, residual, residual_out) are (1, 1, 1) dummies that the kernel never touches.
"""

import dataclasses
from typing import Optional

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    INT32_MAX, MAX_BLOCK_ROWS, Big, Buffer, ConstBool, ConstFloat, ConstInt, Launch, Plan, check_row_block_config,
    index_width_variant, int64_index_kernels, load_zero_padded, next_power_of_2, sigmoid)

# The widest group (rounded up to a power of two) a block holds: every per-element array lives in registers
# as one (BLOCK_ROWS, WIDTH) f32 tile (see norm_default_config for what spills).
MAX_WIDTH = 8192
# f32 elements per (BLOCK_ROWS, WIDTH) tile: rows are added to a block until it holds this many.
TILE_ELEMENTS = 2048

RMS_NORM_FWD_INPUTS = ("x", "z", "residual", "weight")
RMS_NORM_FWD_OUTPUTS = ("out", "residual_out")


@dataclasses.dataclass(frozen=True)
class NormDims:
    """Static description of one norm problem (what the kernels specialise on).

    Per-row arrays are (rows, ngroups, group_size). `dtype` is x's, `out_dtype` the output's; `z_dtype` is
    None without a gate; `residual_dtype` is None for a plain or gated norm, else the dtype of the residual
    stream h = x + residual (residual_out), and `residual_in_dtype` that of the residual input; `weight_dtype`
    is the weight's. `z_columns`: None, or the backward reads z from a wider (rows, z_columns) array whose
    columns [z_offset, z_offset + features) hold it (the array the gate was sliced from, which the caller keeps
    anyway: the mixer's in_proj output), so the forward's z need not be kept.
    """

    rows: int
    ngroups: int
    group_size: int
    dtype: str = "bfloat16"
    out_dtype: str = "bfloat16"
    z_dtype: Optional[str] = None
    residual_dtype: Optional[str] = None
    residual_in_dtype: Optional[str] = None
    norm_before_gate: bool = False
    eps: float = 1e-5
    weight_dtype: str = "float32"
    z_columns: Optional[int] = None
    z_offset: int = 0

    @property
    def has_z(self) -> bool:
        return self.z_dtype is not None

    @property
    def z_in_window(self) -> bool:
        """Whether the backward reads z from columns of a wider array (see `z_columns`)."""
        return self.has_z and self.z_columns is not None

    @property
    def has_residual(self) -> bool:
        return self.residual_dtype is not None

    @property
    def width(self) -> int:
        return next_power_of_2(self.group_size)

    @property
    def features(self) -> int:
        return self.ngroups * self.group_size

    def row_shape(self, present: bool = True) -> tuple[int, int, int]:
        """The (rows, ngroups, group_size) view of a per-row array, or the (1, 1, 1) dummy."""
        return (self.rows, self.ngroups, self.group_size) if present else (1, 1, 1)


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """The tile and hint choices of the norm kernels (what `benchmarks/norm.py --configs` sweeps).

    BLOCK_ROWS: rows per block (a power of two; BLOCK_ROWS x WIDTH f32 values live in registers).
    FWD_OCCUPANCY / BWD_OCCUPANCY: the occupancy hints of the forward and backward kernels (blocks per SM the
      compiler budgets registers for); the backward's persistent grid has BWD_OCCUPANCY x 132 blocks.
    FWD_LATENCY / BWD_LATENCY: the latency hint (1..10) of the per-row loads of the forward and of the
      backward's loop (a deeper prefetch: in the loop, the next row block's loads issue before this one's
      math), or 0 to leave the loads to the compiler.
    """

    BLOCK_ROWS: int
    FWD_OCCUPANCY: int
    BWD_OCCUPANCY: int
    FWD_LATENCY: int = 0
    BWD_LATENCY: int = 0

    def __post_init__(self):
        check_row_block_config(self)


def norm_default_config(dims: NormDims) -> NormConfig:
    """The fixed defaults (no autotuning), from sm_90 compiles (256 threads per block):

    - BLOCK_ROWS: rows up to TILE_ELEMENTS f32 values per tile (1 row of a 2048-wide group, 2 of 1024).
    - forward occupancy 16384 / tile elements, at most 8: 8 at 2048 (32 registers), 2 at 8192 (128), all
      spill-free; eight blocks of 2048 values keep about 50 KB of loads in flight per SM.
    - backward occupancy 4096 (gated) or 8192 (no gate) / tile elements, in [1, 4]: at 2048 values the gated
      backward needs 128 registers (occupancy 2) and the add + norm 64 (occupancy 4) to run without spills;
      a 4096-wide group gets occupancy 1 (255 registers, spill-free) and an 8192-wide one (tile of a 5120
      group) spills a few hundred bytes of stack even then.
    """
    rows = max(1, min(MAX_BLOCK_ROWS, TILE_ELEMENTS // dims.width))
    tile = rows * dims.width
    budget = 4096 if dims.has_z else 8192
    return NormConfig(BLOCK_ROWS=rows, FWD_OCCUPANCY=max(1, min(8, 16384 // tile)),
                      BWD_OCCUPANCY=max(1, min(4, budget // tile)))


def needs_int64_index(dims: NormDims) -> bool:
    """Whether a per-row array, or the wider array the backward reads z from (`z_columns`), has 2^31 or more
    elements (int32 element offsets could overflow)."""
    return dims.rows * max(dims.features, dims.z_columns or 0) > INT32_MAX


def row_block_count(dims: NormDims, cfg: NormConfig) -> int:
    return -(-dims.rows // cfg.BLOCK_ROWS)


# ------------------------------------------------------------------------------------------------
# Device helpers shared with the backward
# ------------------------------------------------------------------------------------------------

def load_rows(array, row_block, g, BLOCK_ROWS, WIDTH, LATENCY):
    """Rows [row_block*BLOCK_ROWS, ...) of group g of a (rows, ngroups, G) array -> (BLOCK_ROWS, WIDTH) f32,
    zero past the last row and past G; LATENCY the load's latency hint (0: none, the compiler's choice)."""
    return load_zero_padded(array, (row_block, g, 0), (BLOCK_ROWS, 1, WIDTH), LATENCY).reshape(
        (BLOCK_ROWS, WIDTH)).astype(ct.float32)


def store_rows(array, row_block, g, tile, BLOCK_ROWS, WIDTH):
    """Stores a (BLOCK_ROWS, WIDTH) tile into group g of a (rows, ngroups, G) array, in the array's dtype
    (elements past the last row and past G are dropped)."""
    ct.store(array, index=(row_block, g, 0), tile=tile.reshape((BLOCK_ROWS, 1, WIDTH)).astype(array.dtype))


def load_weight(weight, g, WIDTH):
    """weight[g] of the (ngroups, G) weight -> (1, WIDTH) f32, zero past G."""
    return ct.load(weight, index=(g, 0), shape=(1, WIDTH), padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)


def inverse_rms(h, GROUP_SIZE, EPS):
    """1 / sqrt(mean(h^2) + EPS) per row of h (BLOCK_ROWS, WIDTH), zero-padded past GROUP_SIZE -> (BLOCK_ROWS, 1)."""
    return ct.rsqrt(ct.sum(h * h, axis=1, keepdims=True) / GROUP_SIZE + EPS)


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------

def _rms_norm_fwd_body(x, z, residual, weight, out, residual_out, GROUP_SIZE, WIDTH, BLOCK_ROWS, HAS_Z,
                       NORM_BEFORE_GATE, HAS_RESIDUAL, EPS, LOAD_LAT):
    row_block = ct.bid(0)
    g = ct.bid(1)
    h = load_rows(x, row_block, g, BLOCK_ROWS, WIDTH, LOAD_LAT)
    if HAS_RESIDUAL:
        # The norm reads h as stored, so that it normalizes exactly the residual stream the next block gets.
        h = (h + load_rows(residual, row_block, g, BLOCK_ROWS, WIDTH, LOAD_LAT)).astype(residual_out.dtype)
        store_rows(residual_out, row_block, g, h, BLOCK_ROWS, WIDTH)
        h = h.astype(ct.float32)
    if HAS_Z:
        z32 = load_rows(z, row_block, g, BLOCK_ROWS, WIDTH, LOAD_LAT)
        gate = z32 * sigmoid(z32)
        if not NORM_BEFORE_GATE:
            h = h * gate
    y = h * inverse_rms(h, GROUP_SIZE, EPS) * load_weight(weight, g, WIDTH)
    if HAS_Z:
        if NORM_BEFORE_GATE:
            y = y * gate
    store_rows(out, row_block, g, y, BLOCK_ROWS, WIDTH)


def rms_norm_fwd_kernel(
    x: Big,              # (rows, ngroups, G) T
    z: Big,              # (rows, ngroups, G) Tz, or a dummy without HAS_Z
    residual: Big,       # (rows, ngroups, G) Tr_in, or a dummy without HAS_RESIDUAL
    weight,              # (ngroups, G) in its dtype
    out: Big,            # (rows, ngroups, G) T_out, written
    residual_out: Big,   # (rows, ngroups, G) Tr, written with HAS_RESIDUAL, else a dummy
    GROUP_SIZE: ConstInt,
    WIDTH: ConstInt,
    BLOCK_ROWS: ConstInt,
    HAS_Z: ConstBool,
    NORM_BEFORE_GATE: ConstBool,
    HAS_RESIDUAL: ConstBool,
    EPS: ConstFloat,
    LOAD_LAT: ConstInt,  # latency hint of the row loads (1..10), 0 for none
):
    _rms_norm_fwd_body(x, z, residual, weight, out, residual_out, GROUP_SIZE, WIDTH, BLOCK_ROWS, HAS_Z,
                       NORM_BEFORE_GATE, HAS_RESIDUAL, EPS, LOAD_LAT)


# (int32-indexed, int64-indexed) entries of the one body.
RMS_NORM_FWD_KERNELS = int64_index_kernels(rms_norm_fwd_kernel)


def rms_norm_fwd_inputs(dims: NormDims) -> dict[str, Buffer]:
    """Shape and dtype of each forward input as the bridge passes it (dummies where absent)."""
    return {
        "x": Buffer(dims.row_shape(), dims.dtype),
        "z": Buffer(dims.row_shape(dims.has_z), dims.z_dtype or dims.dtype),
        "residual": Buffer(dims.row_shape(dims.has_residual), dims.residual_in_dtype or dims.dtype),
        "weight": Buffer((dims.ngroups, dims.group_size), dims.weight_dtype),
    }


def rms_norm_fwd_plan(dims: NormDims, cfg: Optional[NormConfig] = None) -> Plan:
    """The forward for `dims`.

    Returns:
      A Plan with inputs RMS_NORM_FWD_INPUTS and outputs RMS_NORM_FWD_OUTPUTS: "out" (rows, ngroups, G) in
      out_dtype and "residual_out" (rows, ngroups, G) in residual_dtype (a (1, 1, 1) dummy without a residual).
    """
    cfg = cfg or norm_default_config(dims)
    launch = Launch(
        kernel=index_width_variant(RMS_NORM_FWD_KERNELS, needs_int64_index(dims), occupancy=cfg.FWD_OCCUPANCY),
        grid=(row_block_count(dims, cfg), dims.ngroups),
        args=("x", "z", "residual", "weight", "out", "residual_out", dims.group_size, dims.width,
              cfg.BLOCK_ROWS, dims.has_z, dims.has_z and dims.norm_before_gate, dims.has_residual,
              float(dims.eps), cfg.FWD_LATENCY),
        writes=("out", "residual_out"),
    )
    return Plan(
        inputs=RMS_NORM_FWD_INPUTS,
        buffers={"out": Buffer(dims.row_shape(), dims.out_dtype),
                 "residual_out": Buffer(dims.row_shape(dims.has_residual), dims.residual_dtype or dims.dtype)},
        launches=(launch,),
        outputs=RMS_NORM_FWD_OUTPUTS,
    )
