"""Backward of the gated, grouped RMSNorm and of the residual add + RMSNorm (kernels/rms_norm.py): two kernels.

Per row and group, with h the norm's input (x, or x * silu(z) when the gate comes first), rstd and
xhat = h * rstd recomputed from the loaded rows, s = sigmoid(z), silu'(z) = s (1 + z (1 - s)), and dy the
cotangent of the output:

    gate after the norm (NORM_BEFORE_GATE):  dz = dy * xhat * w * silu'(z);   dy <- dy * silu(z)
    dweight += dy * xhat                     (summed over rows)
    dxhat = dy * w;    dh = rstd * (dxhat - xhat * mean_g(dxhat * xhat))
    gate before the norm:                    dz = dh * x * silu'(z);          dh <- dh * silu(z)
    add + norm (HAS_RESIDUAL):               dh <- dh + dresidual (if HAS_DRESIDUAL_OUT);  dresidual = dh
    dx = dh

For the add + norm the kernel's `x` is the residual stream h = residual_out that the forward stored (the
norm's input), and dx, dresidual are the gradients of the block input and of the residual (the same values,
in their two dtypes; where the two dtypes are one, dx is not written: the plan's "dx" is a dummy and dx is
dresidual, `dx_is_dresidual`). The residual stream's incoming cotangent (residual_out's) is updated in place
into the residual's: each block reads its rows of `dresidual` before it writes them, and in a layer loop the
cotangent carried from layer to layer then stays in one buffer (a separate output was copied into the loop's
carry).

1. rms_norm_bwd_kernel, grid (programs, ngroups): program p walks row blocks p, p + programs, ... of its
   group (a persistent loop, so that the weight gradient is summed in registers over many rows) and writes
   its partial weight gradient to dweight_partial[p, g] (f32). programs = min(row blocks, occupancy x SMs //
   ngroups): one wave of resident blocks (bwd_programs).
2. rms_norm_dweight_kernel, grid (cdiv(G, BLOCK_F), ngroups): dweight[g] = sum over p of dweight_partial[p, g],
   in a fixed order: no atomics, so the weight gradient is bitwise reproducible.

z is the forward's (rows, ngroups, G) gate, or (Z_WINDOW) a (rows, columns) array whose columns [Z_OFFSET, Z_OFFSET +
F) hold it: the array it was sliced from, which the caller keeps anyway (the mixer's in_proj output), so that the
forward's gate need not be kept for the backward. A group is then a zero-copy `Array.slice` of those columns.

Memory-bound: the gated norm reads x, z, dy and writes dx, dz (10 bytes per element in bf16); the add + norm
reads h (f32), dy (bf16), dresidual (f32) and writes dx (bf16) and dresidual (f32), 16 bytes. At the LM's
shapes (16384 rows of 2048 / 1024 features) that is 335 / 268 MB, 84 / 67 us at 4 TB/s; the partial
weight gradients add 2 * programs * F * 4 bytes (4 MB each).
"""

from typing import Optional

import cuda.tile as ct
import numpy as np

from jax_mamba2.kernels._common import (
    SM90_SMS, Big, Buffer, ConstBool, ConstFloat, ConstInt, Launch, Plan, index_width_variant, int64_index_kernels,
    load_zero_padded, sigmoid)
from jax_mamba2.kernels.rms_norm import (
    NormConfig, NormDims, inverse_rms, load_rows, load_weight, needs_int64_index, norm_default_config,
    row_block_count, store_rows)

# The weight-gradient reduction's tile: BLOCK_P partial rows by BLOCK_F features (128-byte rows; narrow, so
# that a 1024-wide group still spreads over 32 blocks).
DWEIGHT_BLOCK_P = 64
DWEIGHT_BLOCK_F = 32

RMS_NORM_BWD_OUTPUTS = ("dx", "dresidual", "dz", "dweight")


def load_gate(z, row_block, g, BLOCK_ROWS, WIDTH, GROUP_SIZE, Z_WINDOW, Z_OFFSET, LATENCY):
    """Group g of the gate for rows [row_block*BLOCK_ROWS, ...) -> (BLOCK_ROWS, WIDTH) f32, zero past G: from
    the (rows, ngroups, G) gate, or with Z_WINDOW from columns Z_OFFSET + [g*G, (g+1)*G) of a wider array."""
    if not Z_WINDOW:
        return load_rows(z, row_block, g, BLOCK_ROWS, WIDTH, LATENCY)
    start = Z_OFFSET + g * GROUP_SIZE
    group = z.slice(axis=1, start=start, stop=start + GROUP_SIZE)
    return load_zero_padded(group, (row_block, 0), (BLOCK_ROWS, WIDTH), LATENCY).astype(ct.float32)


def _rms_norm_bwd_body(x, z, weight, dout, dx, dresidual, dz, dweight_partial, GROUP_SIZE, WIDTH,
                       BLOCK_ROWS, HAS_Z, Z_WINDOW, Z_OFFSET, NORM_BEFORE_GATE, HAS_RESIDUAL, HAS_DRESIDUAL_OUT,
                       HAS_DX, EPS, LOAD_LAT):
    program = ct.bid(0)
    g = ct.bid(1)
    w = load_weight(weight, g, WIDTH)
    # Summed elementwise over the row blocks and across the tile's rows once at the end.
    dw = ct.zeros((BLOCK_ROWS, WIDTH), dtype=ct.float32)
    for row_block in range(program, ct.cdiv(x.shape[0], BLOCK_ROWS), ct.num_blocks(0)):
        x_in = load_rows(x, row_block, g, BLOCK_ROWS, WIDTH, LOAD_LAT)
        dy = load_rows(dout, row_block, g, BLOCK_ROWS, WIDTH, LOAD_LAT)
        h = x_in
        if HAS_Z:
            z32 = load_gate(z, row_block, g, BLOCK_ROWS, WIDTH, GROUP_SIZE, Z_WINDOW, Z_OFFSET, LOAD_LAT)
            s = sigmoid(z32)
            gate = z32 * s
            dgate = s * (1.0 + z32 * (1.0 - s))
            if not NORM_BEFORE_GATE:
                h = x_in * gate
        rstd = inverse_rms(h, GROUP_SIZE, EPS)
        xhat = h * rstd
        if HAS_Z:
            if NORM_BEFORE_GATE:
                store_rows(dz, row_block, g, dy * xhat * w * dgate, BLOCK_ROWS, WIDTH)
                dy = dy * gate
        dw = dw + dy * xhat
        dxhat = dy * w
        dh = rstd * (dxhat - xhat * (ct.sum(dxhat * xhat, axis=1, keepdims=True) / GROUP_SIZE))
        if HAS_Z:
            if not NORM_BEFORE_GATE:
                store_rows(dz, row_block, g, dh * x_in * dgate, BLOCK_ROWS, WIDTH)
                dh = dh * gate
        if HAS_RESIDUAL:
            if HAS_DRESIDUAL_OUT:
                dh = dh + load_rows(dresidual, row_block, g, BLOCK_ROWS, WIDTH, LOAD_LAT)
            store_rows(dresidual, row_block, g, dh, BLOCK_ROWS, WIDTH)
        if HAS_DX:
            store_rows(dx, row_block, g, dh, BLOCK_ROWS, WIDTH)
    ct.store(dweight_partial, index=(program, g, 0), tile=ct.sum(dw, axis=0, keepdims=True).reshape((1, 1, WIDTH)))


def rms_norm_bwd_kernel(
    x: Big,               # (rows, ngroups, G) the norm's input: x (T), or h = residual_out (Tr)
    z: Big,               # (rows, ngroups, G) Tz, with Z_WINDOW (rows, columns) Tz, or a dummy without HAS_Z
    weight,               # (ngroups, G) in its dtype
    dout: Big,            # (rows, ngroups, G) T_out
    dx: Big,              # (rows, ngroups, G) T, written with HAS_DX, else a dummy (dx is dresidual)
    dresidual: Big,       # (rows, ngroups, G) Tr, with HAS_RESIDUAL: read (HAS_DRESIDUAL_OUT), then written;
                          # else a dummy
    dz: Big,              # (rows, ngroups, G) Tz, written with HAS_Z, else a dummy
    dweight_partial,      # (programs, ngroups, G) f32, written
    GROUP_SIZE: ConstInt,
    WIDTH: ConstInt,
    BLOCK_ROWS: ConstInt,
    HAS_Z: ConstBool,
    Z_WINDOW: ConstBool,  # z is read from columns of a wider array
    Z_OFFSET: ConstInt,   # where z starts in that array's rows
    NORM_BEFORE_GATE: ConstBool,
    HAS_RESIDUAL: ConstBool,
    HAS_DRESIDUAL_OUT: ConstBool,  # dresidual holds the residual stream's cotangent (else it is zero, not read)
    HAS_DX: ConstBool,    # dx is written; else it is dresidual's values in dresidual's dtype (`dx_is_dresidual`)
    EPS: ConstFloat,
    LOAD_LAT: ConstInt,   # latency hint of the loop's row loads (1..10), 0 for none
):
    _rms_norm_bwd_body(x, z, weight, dout, dx, dresidual, dz, dweight_partial, GROUP_SIZE,
                       WIDTH, BLOCK_ROWS, HAS_Z, Z_WINDOW, Z_OFFSET, NORM_BEFORE_GATE, HAS_RESIDUAL,
                       HAS_DRESIDUAL_OUT, HAS_DX, EPS, LOAD_LAT)


RMS_NORM_BWD_KERNELS = int64_index_kernels(rms_norm_bwd_kernel)


@ct.kernel
def rms_norm_dweight_kernel(
    dweight_partial,     # (programs, ngroups, G) f32
    dweight,             # (ngroups, G) f32, written
    BLOCK_P: ConstInt,
    BLOCK_F: ConstInt,
):
    f = ct.bid(0)
    g = ct.bid(1)
    acc = ct.zeros((BLOCK_P, BLOCK_F), dtype=ct.float32)
    for p in range(ct.cdiv(dweight_partial.shape[0], BLOCK_P)):
        acc = acc + ct.load(dweight_partial, index=(p, g, f), shape=(BLOCK_P, 1, BLOCK_F),
                            padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_P, BLOCK_F))
    ct.store(dweight, index=(g, f), tile=ct.sum(acc, axis=0, keepdims=True))


def bwd_programs(dims: NormDims, cfg: NormConfig) -> int:
    """Blocks per group of the backward's persistent grid: one wave of resident blocks of an H200 (occupancy x
    SMs over all groups), fewer when there are fewer row blocks."""
    return max(1, min(row_block_count(dims, cfg), cfg.BWD_OCCUPANCY * SM90_SMS // dims.ngroups))


def updates_dresidual_in_place(dims: NormDims, has_dresidual_out: bool = True) -> bool:
    """Whether the backward takes the residual stream's cotangent as the input "dresidual" and turns it into the
    residual's in place (the add + norm with a nonzero one), rather than writing "dresidual" as a buffer."""
    return dims.has_residual and has_dresidual_out


def dx_is_dresidual(dims: NormDims) -> bool:
    """Whether the add + norm's dx is its dresidual: the two gradients are the same values, so where x and the
    residual stream share a dtype the backward writes them once (the plan's "dx" is then a dummy)."""
    return dims.has_residual and np.dtype(dims.residual_dtype) == np.dtype(dims.dtype)


def rms_norm_bwd_inputs(dims: NormDims, has_dresidual_out: bool = True) -> dict[str, Buffer]:
    """Shape and dtype of each backward input as the bridge passes it (dummies where absent); "dresidual" only
    where it is updated in place (`updates_dresidual_in_place`)."""
    inputs = {
        "x": Buffer(dims.row_shape(), dims.residual_dtype or dims.dtype),
        "z": Buffer((dims.rows, dims.z_columns) if dims.z_in_window else dims.row_shape(dims.has_z),
                    dims.z_dtype or dims.dtype),
        "weight": Buffer((dims.ngroups, dims.group_size), dims.weight_dtype),
        "dout": Buffer(dims.row_shape(), dims.out_dtype),
    }
    if updates_dresidual_in_place(dims, has_dresidual_out):
        inputs["dresidual"] = Buffer(dims.row_shape(), dims.residual_dtype)
    return inputs


def rms_norm_bwd_plan(dims: NormDims, cfg: Optional[NormConfig] = None, has_dresidual_out: bool = True) -> Plan:
    """The backward for `dims`; for the add + norm without `has_dresidual_out` the residual stream's cotangent
    is zero (h feeds nothing, as in the LM's final norm) and "dresidual" is written, never read.

    Returns:
      A Plan with the inputs of `rms_norm_bwd_inputs` (x: the forward's x, or its residual_out for the add +
      norm; "dresidual": residual_out's cotangent, updated in place) and outputs RMS_NORM_BWD_OUTPUTS: "dx" in
      x's dtype, "dresidual" in residual_dtype, "dz" in z's dtype (both (1, 1, 1) dummies where absent) and
      "dweight" (ngroups, G) f32.
    """
    cfg = cfg or norm_default_config(dims)
    programs = bwd_programs(dims, cfg)
    block_f = min(dims.width, DWEIGHT_BLOCK_F)
    norm_launch = Launch(
        kernel=index_width_variant(RMS_NORM_BWD_KERNELS, needs_int64_index(dims), occupancy=cfg.BWD_OCCUPANCY),
        grid=(programs, dims.ngroups),
        args=("x", "z", "weight", "dout", "dx", "dresidual", "dz", "dweight_partial",
              dims.group_size, dims.width, cfg.BLOCK_ROWS, dims.has_z, dims.z_in_window, dims.z_offset,
              dims.has_z and dims.norm_before_gate,
              dims.has_residual, dims.has_residual and has_dresidual_out, not dx_is_dresidual(dims),
              float(dims.eps), cfg.BWD_LATENCY),
        writes=("dx", "dresidual", "dz", "dweight_partial"),
    )
    reduce_launch = Launch(
        kernel=rms_norm_dweight_kernel,
        grid=(-(-dims.group_size // block_f), dims.ngroups),
        args=("dweight_partial", "dweight", DWEIGHT_BLOCK_P, block_f),
        writes=("dweight",),
    )
    in_place = updates_dresidual_in_place(dims, has_dresidual_out)
    return Plan(
        inputs=tuple(rms_norm_bwd_inputs(dims, has_dresidual_out)),
        buffers={
            "dx": Buffer(dims.row_shape(not dx_is_dresidual(dims)), dims.dtype),
            **({} if in_place else
               {"dresidual": Buffer(dims.row_shape(dims.has_residual), dims.residual_dtype or dims.dtype)}),
            "dz": Buffer(dims.row_shape(dims.has_z), dims.z_dtype or dims.dtype),
            "dweight_partial": Buffer((programs, dims.ngroups, dims.group_size), "float32"),
            "dweight": Buffer((dims.ngroups, dims.group_size), "float32"),
        },
        launches=(norm_launch, reduce_launch),
        outputs=RMS_NORM_BWD_OUTPUTS,
    )
