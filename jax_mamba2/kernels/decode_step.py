"""One Mamba2 decode step between in_proj and out_proj in a single launch: conv, SSD update, gate and norm.

Per batch row b, from the in_proj output pieces z (d_ssm), xBC (conv_dim = d_ssm + 2 ngroups dstate) and dt
(nheads), and per head h of group g = h // (nheads / ngroups), with T = xBC's dtype:

    window    = [conv_state[b, :, 1:], xBC[b]]                        (conv_dim, d_conv): the new conv_state
    x, B, C   = silu(bias + Σ_k conv_weight[k] * window[:, k])        split [d_ssm, ngroups dstate, ngroups dstate]
    Δ         = clip(softplus(dt[b, h] + dt_bias[h]))
    state'    = exp(Δ A[h]) state[b, h] + (Δ x_h)[:, None] B_g[None, :]             (headdim, dstate), f32
    y_h       = state' C_g + D[h] x_h;   gated = y * silu(z)
    out       = gated * norm_weight * rsqrt(mean_g(q²) + eps),  q = y (NORM_BEFORE_GATE) or gated
    out       = gated                                                 without RMSNORM

The intermediates are rounded where the unfused layer step (conv1d_step, ssd_step, rms_norm) stores them: the
conv's taps, weights and bias, its output and x/B/C in T, y in T before the norm; the conv sum, the state
update and the norm run in f32.

Grid: (batch * nheads, headdim / BLOCK_P). A block convolves its BLOCK_P x channels and its group's B and C
(2 dstate channels, recomputed by every block of the group: reads that stay in L2), updates rows
[pb * BLOCK_P, (pb + 1) * BLOCK_P) of one head's state as `state_update.py` does, and gates them. The first block
of a group writes the group's B/C conv state.

The norm's statistic spans a whole group (d_ssm / ngroups features, the blocks of many heads). Each block writes
its gated * norm_weight piece (f32) and its sum of squares, then takes a ticket from the group's arrival counter
(an atomic add, acq_rel at device scope). The block that draws the last ticket sees the writes of all the others
(their releases precede its acquire), sums the partial sums in a fixed order and writes the group's output. No
block waits for another, so this holds however many blocks are resident at once, and the result does not
depend on the order of arrival. The next states go to their own buffers (state_update.py says why).

Shapes: z, y (batch, d_ssm) T; xBC (batch, conv_dim) T; dt (batch, nheads) T or f32; conv_state,
new_conv_state (batch, conv_dim, d_conv); conv_weight (d_conv, conv_dim), conv_bias (conv_dim,) (a dummy (1,)
without HAS_CONV_BIAS); ssm_state, new_ssm_state (batch, nheads, headdim, dstate) f32 or T; A, dt_bias (nheads,)
f32; D (nheads, headdim) with D_HAS_HDIM, else (nheads,); norm_weight (d_ssm,); the workspaces unscaled (batch,
d_ssm) f32, sumsq (batch, ngroups, blocks per group) f32 and arrivals (batch, ngroups) int32, zeroed (dummies
with RMSNORM off, as is norm_weight).
"""
import dataclasses
import math

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    KERNEL_DTYPES, Big, Buffer, ConstBool, ConstFloat, ConstInt, Launch, Plan, SSDDims, dt_transform,
    int64_index_kernels, next_power_of_2, select_kernel, silu_gate)
from jax_mamba2.kernels._tiles import batch_head_group

DECODE_STEP_INPUTS = ("z", "xBC", "dt", "conv_state", "conv_weight", "conv_bias", "ssm_state", "A", "D",
                      "dt_bias", "norm_weight")
DECODE_STEP_OUTPUTS = ("y", "new_conv_state", "new_ssm_state")
# The widest conv the kernel takes (mamba_ssm's causal_conv1d takes 2..4): the conv state then stays smaller
# than the SSM state, whose size alone picks the index width.
MAX_D_CONV = 4
# The most features of a group the normalizing block rescales per load.
_MAX_NORM_BLOCK = 2048


def _widen(tile, dtype):
    """Device helper: `tile` rounded to `dtype`, in f32 (the value the unfused step stores in `dtype`)."""
    return tile.astype(dtype).astype(ct.float32)


def _convolve_channels(xBC, conv_state, conv_weight, conv_bias, new_conv_state, b, start, WIDTH, D_CONV,
                       DCONV_TILE, HAS_CONV_BIAS, store_state):
    """Device helper: channels [start, start + WIDTH) of row b. Shifts the conv window (writing it to
    new_conv_state when `store_state`) and returns silu(conv) -> [WIDTH] f32, rounded to xBC's dtype."""
    T = xBC.dtype
    stop = start + WIDTH
    x_new = ct.load(xBC.slice(1, start, stop), index=(b, 0), shape=(1, WIDTH)).reshape((WIDTH, 1))
    column = ct.arange(DCONV_TILE, dtype=ct.int32)[None, :]
    if D_CONV > 1:
        # Columns 1.. of the old window become columns 0..; the padded columns past d_conv read as 0.
        older = ct.load(conv_state.slice(1, start, stop).slice(2, 1, D_CONV), index=(b, 0, 0),
                        shape=(1, WIDTH, DCONV_TILE), padding_mode=ct.PaddingMode.ZERO
                        ).reshape((WIDTH, DCONV_TILE))
    else:
        older = ct.zeros((WIDTH, DCONV_TILE), dtype=conv_state.dtype)
    window = ct.where(column == D_CONV - 1, x_new.astype(conv_state.dtype), older)         # [WIDTH, DCONV_TILE]
    if store_state:
        ct.store(new_conv_state.slice(1, start, stop), index=(b, 0, 0),
                 tile=window.reshape((1, WIDTH, DCONV_TILE)))
    weight = ct.load(conv_weight.slice(1, start, stop), index=(0, 0), shape=(DCONV_TILE, WIDTH),
                     padding_mode=ct.PaddingMode.ZERO)
    acc = ct.sum(_widen(window, T) * _widen(weight, T).transpose(), axis=1)                 # [WIDTH] f32
    if HAS_CONV_BIAS:
        acc = acc + _widen(ct.load(conv_bias.slice(0, start, stop), index=(0,), shape=(WIDTH,)), T)
    return _widen(silu_gate(1.0, _widen(acc, T)), T)


def _normalize_group(y, unscaled, sumsq, b, g, GROUP_SIZE, NORM_BLOCK, PARTIALS_TILE, EPS):
    """Device helper: y[b, group g] = unscaled[b, group g] * rsqrt(mean square + EPS), the mean square from the
    group's partial sums of squares sumsq[b, g, :]."""
    partials = ct.load(sumsq, index=(b, g, 0), shape=(1, 1, PARTIALS_TILE),
                       padding_mode=ct.PaddingMode.ZERO).reshape((PARTIALS_TILE,))
    rstd = ct.rsqrt(ct.sum(partials, axis=0, keepdims=True) / GROUP_SIZE + EPS)             # [1]
    pieces = GROUP_SIZE // NORM_BLOCK
    for i in range(pieces):
        index = (b, g * pieces + i)
        piece = ct.load(unscaled, index=index, shape=(1, NORM_BLOCK))
        ct.store(y, index=index, tile=(piece * rstd).astype(y.dtype))


def decode_step_kernel(
    z,                    # (batch, d_ssm) T
    xBC,                  # (batch, conv_dim) T
    dt,                   # (batch, nheads) T or f32
    conv_state: Big,      # (batch, conv_dim, d_conv)
    conv_weight,          # (d_conv, conv_dim)
    conv_bias,            # (conv_dim,), or a dummy without HAS_CONV_BIAS
    ssm_state: Big,       # (batch, nheads, headdim, dstate) f32 or T
    A,                    # (nheads,) f32
    D,                    # (nheads, headdim) with D_HAS_HDIM, else (nheads,)
    dt_bias,              # (nheads,)
    norm_weight,          # (d_ssm,), or a dummy without RMSNORM
    y,                    # (batch, d_ssm) T, written
    new_conv_state: Big,  # like conv_state, written
    new_ssm_state: Big,   # like ssm_state, written
    unscaled,             # (batch, d_ssm) f32 workspace, or a dummy without RMSNORM
    sumsq,                # (batch, ngroups, blocks per group) f32 workspace, or a dummy
    arrivals,             # (batch, ngroups) int32, zeros, or a dummy
    NHEADS: ConstInt,
    HEADDIM: ConstInt,
    DSTATE: ConstInt,
    NGROUPS: ConstInt,
    D_CONV: ConstInt,
    DCONV_TILE: ConstInt,        # next power of two >= D_CONV
    BLOCK_P: ConstInt,
    NORM_BLOCK: ConstInt,        # features per load of the normalizing block (divides the group size)
    PARTIALS_TILE: ConstInt,     # next power of two >= blocks per group
    HAS_CONV_BIAS: ConstBool,
    D_HAS_HDIM: ConstBool,
    RMSNORM: ConstBool,
    NORM_BEFORE_GATE: ConstBool,
    EPS: ConstFloat,
    DT_SOFTPLUS: ConstBool,
    HAS_DT_LIMIT: ConstBool,
    DT_MIN: ConstFloat,
    DT_MAX: ConstFloat,
):
    b, h, g = batch_head_group(ct.bid(0), NHEADS, NGROUPS)
    pb = ct.bid(1)
    heads_per_group = NHEADS // NGROUPS
    pieces_per_head = HEADDIM // BLOCK_P
    piece = h * pieces_per_head + pb                  # this block's BLOCK_P-wide piece of d_ssm
    bc_start = NHEADS * HEADDIM + g * DSTATE          # group g's B channels; its C channels NGROUPS * DSTATE on
    first_of_group = (h % heads_per_group == 0) & (pb == 0)

    x_p = _convolve_channels(xBC, conv_state, conv_weight, conv_bias, new_conv_state, b, piece * BLOCK_P,
                             BLOCK_P, D_CONV, DCONV_TILE, HAS_CONV_BIAS, True)               # [BLOCK_P]
    B_n = _convolve_channels(xBC, conv_state, conv_weight, conv_bias, new_conv_state, b, bc_start, DSTATE,
                             D_CONV, DCONV_TILE, HAS_CONV_BIAS, first_of_group)              # [DSTATE]
    C_n = _convolve_channels(xBC, conv_state, conv_weight, conv_bias, new_conv_state, b,
                             bc_start + NGROUPS * DSTATE, DSTATE, D_CONV, DCONV_TILE, HAS_CONV_BIAS,
                             first_of_group)                                                 # [DSTATE]

    dt_v = ct.load(dt, index=(b, h), shape=(1, 1)).reshape((1,)).astype(ct.float32)
    bias = ct.load(dt_bias, index=(h,), shape=(1,)).astype(ct.float32)
    delta = dt_transform(dt_v + bias, DT_SOFTPLUS, HAS_DT_LIMIT, DT_MIN, DT_MAX)          # [1]
    decay = ct.exp(delta * ct.load(A, index=(h,), shape=(1,)).astype(ct.float32))        # [1]
    s = ct.load(ssm_state, index=(b, h, pb, 0), shape=(1, 1, BLOCK_P, DSTATE)
                ).reshape((BLOCK_P, DSTATE)).astype(ct.float32)
    s = s * decay + (delta * x_p)[:, None] * B_n[None, :]                                  # [BLOCK_P, DSTATE]
    ct.store(new_ssm_state, index=(b, h, pb, 0),
             tile=s.reshape((1, 1, BLOCK_P, DSTATE)).astype(new_ssm_state.dtype))
    if D_HAS_HDIM:
        D_p = ct.load(D, index=(h, pb), shape=(1, BLOCK_P)).reshape((BLOCK_P,)).astype(ct.float32)
    else:
        D_p = ct.load(D, index=(h,), shape=(1,)).astype(ct.float32)
    y_p = ct.sum(s * C_n[None, :], axis=1) + D_p * x_p                                     # [BLOCK_P] f32
    z_p = ct.load(z, index=(b, piece), shape=(1, BLOCK_P)).reshape((BLOCK_P,))

    if RMSNORM:
        y_p = _widen(y_p, xBC.dtype)
        gated = silu_gate(y_p, z_p)
        if NORM_BEFORE_GATE:
            statistic = y_p
        else:
            statistic = gated
        weight = ct.load(norm_weight, index=(piece,), shape=(BLOCK_P,)).astype(ct.float32)
        ct.store(unscaled, index=(b, piece), tile=(gated * weight).reshape((1, BLOCK_P)))
        partial = ct.sum(statistic * statistic, axis=0, keepdims=True)                    # [1]
        ct.store(sumsq, index=(b, g, (h % heads_per_group) * pieces_per_head + pb),
                 tile=partial.reshape((1, 1, 1)))
        # Release this block's writes and acquire those of the blocks before it.
        ticket = ct.atomic_add(arrivals, (b, g), 1, memory_order=ct.MemoryOrder.ACQ_REL,
                               memory_scope=ct.MemoryScope.DEVICE)
        if ticket == heads_per_group * pieces_per_head - 1:
            _normalize_group(y, unscaled, sumsq, b, g, heads_per_group * HEADDIM, NORM_BLOCK,
                             PARTIALS_TILE, EPS)
    else:
        ct.store(y, index=(b, piece), tile=silu_gate(y_p, z_p).reshape((1, BLOCK_P)).astype(y.dtype))


# (int32-indexed, int64-indexed) entries of the one body.
DECODE_STEP_KERNELS = int64_index_kernels(decode_step_kernel)


@dataclasses.dataclass(frozen=True)
class DecodeStepDims:
    """Static description of one decode step (everything the kernel specialises on).

    dtype is that of the in_proj output pieces z, xBC, dt and of y; param_dtype that of conv_weight, conv_bias,
    D, dt_bias and norm_weight (A is float32). Without `rmsnorm`, z gates y directly.
    """

    batch: int
    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    d_conv: int
    dtype: str = "bfloat16"
    conv_state_dtype: str = "float32"
    ssm_state_dtype: str = "float32"
    param_dtype: str = "float32"
    has_conv_bias: bool = True
    D_has_hdim: bool = False
    rmsnorm: bool = True
    norm_before_gate: bool = False
    eps: float = 1e-5
    dt_softplus: bool = True
    dt_limit: tuple[float, float] = (0.0, math.inf)

    @property
    def d_ssm(self) -> int:
        return self.nheads * self.headdim

    @property
    def conv_dim(self) -> int:
        return self.d_ssm + 2 * self.ngroups * self.dstate

    @property
    def has_dt_limit(self) -> bool:
        return tuple(self.dt_limit) != (0.0, math.inf)

    def ssd_dims(self) -> SSDDims:
        """The one-token SSD problem of this step (what picks the index width: the SSM state is the largest
        array, as d_conv <= MAX_D_CONV)."""
        return SSDDims(batch=self.batch, seqlen=1, nheads=self.nheads, headdim=self.headdim,
                       ngroups=self.ngroups, dstate=self.dstate, chunk_size=1, dtype=self.dtype)


def decode_step_unsupported_reason(dims: DecodeStepDims) -> str | None:
    """Why the kernel cannot take `dims` (None when it can): the dtypes, power-of-two headdim and dstate
    (tile sizes) and d_conv <= MAX_D_CONV."""
    for name in ("dtype", "conv_state_dtype", "ssm_state_dtype", "param_dtype"):
        if getattr(dims, name) not in KERNEL_DTYPES:
            return f"{name}={getattr(dims, name)} is not one of {KERNEL_DTYPES}"
    for name in ("headdim", "dstate"):
        value = getattr(dims, name)
        if value & (value - 1):
            return f"{name}={value} must be a power of two"
    if not 1 <= dims.d_conv <= MAX_D_CONV:
        return f"d_conv={dims.d_conv} must be in [1, {MAX_D_CONV}]"
    return None


@dataclasses.dataclass(frozen=True)
class DecodeStepConfig:
    """BLOCK_P: headdim rows of the state per block (a power of two dividing headdim)."""

    BLOCK_P: int = 16
    occupancy: int = 4


def decode_step_default_config(dims: DecodeStepDims) -> DecodeStepConfig:
    """About 2K state values per block, as state_update's default, but at least 8 rows: every block also
    convolves its group's 2 * dstate B/C channels. At the 24-layer LM (32 heads of 64, dstate 128) that is
    BLOCK_P = 16: 128 blocks at batch 1, one per SM."""
    return DecodeStepConfig(BLOCK_P=min(dims.headdim, max(8, 2048 // dims.dstate)), occupancy=4)


def decode_step_grid(dims: DecodeStepDims, cfg: DecodeStepConfig) -> tuple[int, int]:
    return (dims.batch * dims.nheads, dims.headdim // cfg.BLOCK_P)


def _blocks_per_group(dims: DecodeStepDims, cfg: DecodeStepConfig) -> int:
    return dims.nheads // dims.ngroups * (dims.headdim // cfg.BLOCK_P)


def decode_step_inputs(dims: DecodeStepDims) -> dict[str, Buffer]:
    """Shape and dtype of each input as the bridge passes it (dummies where an option is off)."""
    b, H, P, N, K = dims.batch, dims.nheads, dims.headdim, dims.dstate, dims.d_conv
    return {
        "z": Buffer((b, dims.d_ssm), dims.dtype),
        "xBC": Buffer((b, dims.conv_dim), dims.dtype),
        "dt": Buffer((b, H), dims.dtype),
        "conv_state": Buffer((b, dims.conv_dim, K), dims.conv_state_dtype),
        "conv_weight": Buffer((K, dims.conv_dim), dims.param_dtype),
        "conv_bias": Buffer((dims.conv_dim,) if dims.has_conv_bias else (1,), dims.param_dtype),
        "ssm_state": Buffer((b, H, P, N), dims.ssm_state_dtype),
        "A": Buffer((H,), "float32"),
        "D": Buffer((H, P) if dims.D_has_hdim else (H,), dims.param_dtype),
        "dt_bias": Buffer((H,), dims.param_dtype),
        "norm_weight": Buffer((dims.d_ssm,) if dims.rmsnorm else (1,), dims.param_dtype),
    }


def decode_step_plan(dims: DecodeStepDims, cfg: DecodeStepConfig | None = None) -> Plan:
    """The decode step of `dims` as one launch.

    Returns:
      A Plan with inputs DECODE_STEP_INPUTS and outputs DECODE_STEP_OUTPUTS: "y" (dims.dtype) and the next
      conv and SSM states in their states' dtypes. With rmsnorm it also allocates the f32 workspaces and the
      zeroed arrival counters (batch * ngroups int32) of the group norm.

    Raises:
      ValueError: unless cfg.BLOCK_P is a power of two dividing headdim.
    """
    cfg = cfg or decode_step_default_config(dims)
    if cfg.BLOCK_P & (cfg.BLOCK_P - 1) or dims.headdim % cfg.BLOCK_P:
        raise ValueError(f"decode_step_plan: cfg.BLOCK_P={cfg.BLOCK_P} must be a power of two dividing "
                         f"headdim={dims.headdim}")
    b, G = dims.batch, dims.ngroups
    group_size = dims.d_ssm // G
    blocks_per_group = _blocks_per_group(dims, cfg)
    dt_min, dt_max = (float(v) for v in dims.dt_limit)
    norm = dims.rmsnorm
    launch = Launch(
        kernel=select_kernel(DECODE_STEP_KERNELS, dims.ssd_dims(), occupancy=cfg.occupancy),
        grid=decode_step_grid(dims, cfg),
        args=(*DECODE_STEP_INPUTS, "y", "new_conv_state", "new_ssm_state", "unscaled", "sumsq", "arrivals",
              dims.nheads, dims.headdim, dims.dstate, G, dims.d_conv, next_power_of_2(dims.d_conv), cfg.BLOCK_P,
              min(group_size & -group_size, _MAX_NORM_BLOCK), next_power_of_2(blocks_per_group),
              dims.has_conv_bias, dims.D_has_hdim, norm, dims.norm_before_gate, float(dims.eps),
              dims.dt_softplus, dims.has_dt_limit, dt_min, dt_max),
        writes=("y", "new_conv_state", "new_ssm_state", "unscaled", "sumsq", "arrivals"),
    )
    return Plan(
        inputs=DECODE_STEP_INPUTS,
        buffers={
            "y": Buffer((b, dims.d_ssm), dims.dtype),
            "new_conv_state": Buffer((b, dims.conv_dim, dims.d_conv), dims.conv_state_dtype),
            "new_ssm_state": Buffer((b, dims.nheads, dims.headdim, dims.dstate), dims.ssm_state_dtype),
            "unscaled": Buffer((b, dims.d_ssm) if norm else (1, 1), "float32"),
            "sumsq": Buffer((b, G, blocks_per_group) if norm else (1, 1, 1), "float32"),
            "arrivals": Buffer((b, G) if norm else (1, 1), "int32", zero_init=norm),
        },
        launches=(launch,),
        outputs=DECODE_STEP_OUTPUTS,
    )
