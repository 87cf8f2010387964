"""One Mamba2 decode step from in_proj's output to the gated norm's input, in a single launch.

Per batch row b, from in_proj's output zxbcdt[b] = [z0, x0, z, xBC, dt] (widths d_mlp, d_mlp, d_ssm,
conv_dim = d_ssm + 2 ngroups dstate, nheads), and per head h of group g = h // (nheads / ngroups), with T =
zxbcdt's dtype:

    window    = [conv_state[b, :, 1:], xBC]                      (conv_dim, d_conv): the new conv_state
    x, B, C   = silu(bias + Σ_k conv_weight[k] · window[:, k])   split [d_ssm, ngroups dstate, ngroups dstate]
    Δ         = clip(softplus(dt[h] + dt_bias[h])),  A = -exp(A_log[h])
    state'    = exp(Δ A) state[b, h] + (Δ x_h)[:, None] B_g[None, :]                    (headdim, dstate), f32
    y_h       = state' C_g + D[h] x_h,  rounded to T;   gated_h = y_h · silu(z_h)

Outputs: with RMSNORM, `gated` in f32 and `sumsq[b, piece]` = Σ q² over the block's BLOCK_P features, q =
y (NORM_BEFORE_GATE) or gated; the grouped norm's scale rsqrt(mean_group(q²) + eps) · norm_weight is one XLA
elementwise after the launch (jax_mamba2/decode_step.py). Without RMSNORM, `gated` in T is the output. The
group's statistic spans many blocks, and the launch synchronizes no blocks: every block streams its slice of
the state once (read and write) and finishes.

The intermediates round where the composed step (conv1d_reference.causal_conv1d_step, reference.ssd_step)
stores them: the conv's taps, weights and bias in T, its output and x/B/C in T, y in T; the conv sum, the state
update and the gate run in f32.

Grid: (batch * nheads / HEADS_PER_BLOCK, headdim / BLOCK_P). A block convolves its group's B and C (2 dstate
channels, recomputed by each block of the group from L2), then, for each of its HEADS_PER_BLOCK heads in turn,
convolves the head's BLOCK_P x channels, updates rows [pb BLOCK_P, (pb + 1) BLOCK_P) of the head's state as
`state_update.py` does (BLOCK_P x dstate values: about 2K keep everything in registers) and gates them. The
first block of a group writes the group's B/C conv state. `decode_step_default_config` narrows BLOCK_P so that
small batches still fill the GPU and gives large ones several heads per block, so that B and C are recomputed
rarely.

Shapes: zxbcdt (batch, 2 d_mlp + d_ssm + conv_dim + nheads) T; conv_state, new_conv_state (batch, conv_dim,
d_conv); conv_weight (d_conv, conv_dim), conv_bias (conv_dim,) (a dummy (1,) without HAS_CONV_BIAS); ssm_state,
new_ssm_state (batch, nheads, headdim, dstate); A_log, dt_bias (nheads,) (dt_bias a dummy (1,) without
HAS_DT_BIAS); D (nheads, headdim) with D_HAS_HDIM, (nheads,) otherwise (a dummy (1,) without HAS_D); gated
(batch, d_ssm) f32 with RMSNORM, else T; sumsq (batch, nheads headdim / BLOCK_P) f32 (a dummy (1, 1) without
RMSNORM). Parameters may be f32, bf16 or f16 each: the kernel converts on load.
"""
from __future__ import annotations

import dataclasses
import math

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    KERNEL_DTYPES, SM90_SMS, Big, Buffer, ConstBool, ConstFloat, ConstInt, Plan, SSDDims, dt_transform,
    int64_index_kernels, is_power_of_2, kernel_launch, select_kernel, silu_gate)
from jax_mamba2.kernels._tiles import batch_head_group

DECODE_STEP_INPUTS = ("zxbcdt", "conv_state", "conv_weight", "conv_bias", "ssm_state", "A_log", "D", "dt_bias")
DECODE_STEP_OUTPUTS = ("gated", "sumsq", "new_conv_state", "new_ssm_state")
# The widest conv the kernel unrolls (mamba_ssm's causal_conv1d stops at 4): the conv state then stays
# smaller than the SSM state, whose size alone picks the index width.
MAX_D_CONV = 8


def _widen(tile, dtype):
    """Device helper: `tile` rounded to `dtype`, in f32 (the value the composed step stores in `dtype`)."""
    return tile.astype(dtype).astype(ct.float32)


def _convolve_channels(zxbcdt, conv_state, conv_weight, conv_bias, new_conv_state, b, XBC_START, start, WIDTH,
                       D_CONV, HAS_CONV_BIAS, store_state):
    """Device helper: conv channels [start, start + WIDTH) of row b -> silu(conv) [WIDTH] f32, rounded to T.

    Shifts the channels' window by one token (writing it to new_conv_state when `store_state`): column k of
    the new window is column k + 1 of the old one, the last is the token's xBC. Per-channel gathers: a
    channel's d_conv columns are contiguous, so the strided reads touch the same sectors a tile load would.
    """
    T = zxbcdt.dtype
    cols = start + ct.arange(WIDTH, dtype=ct.int32)
    newest = ct.gather(zxbcdt, (b, XBC_START + cols)).astype(conv_state.dtype)
    acc = ct.zeros((WIDTH,), dtype=ct.float32)
    for k in ct.static_iter(range(D_CONV)):
        if k == D_CONV - 1:
            tap = newest
        else:
            tap = ct.gather(conv_state, (b, cols, k + 1))
        if store_state:
            ct.scatter(new_conv_state, (b, cols, k), tap)
        acc = acc + _widen(tap, T) * _widen(ct.gather(conv_weight, (k, cols)), T)
    if HAS_CONV_BIAS:
        acc = acc + _widen(ct.gather(conv_bias, cols), T)
    return _widen(silu_gate(1.0, _widen(acc, T)), T)


def decode_step_kernel(
    zxbcdt,               # (batch, d_in_proj) T: [z0, x0, z, xBC, dt]
    conv_state: Big,      # (batch, conv_dim, d_conv)
    conv_weight,          # (d_conv, conv_dim)
    conv_bias,            # (conv_dim,), or a dummy without HAS_CONV_BIAS
    ssm_state: Big,       # (batch, nheads, headdim, dstate)
    A_log,                # (nheads,)
    D,                    # (nheads, headdim) with D_HAS_HDIM, else (nheads,); a dummy without HAS_D
    dt_bias,              # (nheads,), or a dummy without HAS_DT_BIAS
    gated,                # (batch, d_ssm) f32 with RMSNORM, else T; written
    sumsq,                # (batch, nheads * headdim / BLOCK_P) f32, or a dummy without RMSNORM; written
    new_conv_state: Big,  # like conv_state, written
    new_ssm_state: Big,   # like ssm_state, written
    D_MLP: ConstInt,             # width of in_proj's gated-MLP pieces z0, x0 (0 without the branch)
    NHEADS: ConstInt,
    HEADDIM: ConstInt,
    DSTATE: ConstInt,
    NGROUPS: ConstInt,
    D_CONV: ConstInt,
    BLOCK_P: ConstInt,
    HEADS_PER_BLOCK: ConstInt,   # heads of one group per block, in turn (a divisor of nheads / ngroups)
    HAS_CONV_BIAS: ConstBool,
    HAS_D: ConstBool,
    D_HAS_HDIM: ConstBool,
    HAS_DT_BIAS: ConstBool,
    RMSNORM: ConstBool,
    NORM_BEFORE_GATE: ConstBool,
    DT_SOFTPLUS: ConstBool,
    HAS_DT_LIMIT: ConstBool,
    DT_MIN: ConstFloat,
    DT_MAX: ConstFloat,
):
    b, head_block, g = batch_head_group(ct.bid(0), NHEADS // HEADS_PER_BLOCK, NGROUPS)
    pb = ct.bid(1)
    d_ssm = NHEADS * HEADDIM
    z_start = 2 * D_MLP
    xbc_start = z_start + d_ssm
    bc_start = d_ssm + g * DSTATE                    # group g's B channels; its C channels NGROUPS * DSTATE on
    first_head = head_block * HEADS_PER_BLOCK
    first_of_group = (first_head % (NHEADS // NGROUPS) == 0) & (pb == 0)

    # The block's heads share their group's B and C: convolved once per block.
    B_n = _convolve_channels(zxbcdt, conv_state, conv_weight, conv_bias, new_conv_state, b, xbc_start,
                             bc_start, DSTATE, D_CONV, HAS_CONV_BIAS, first_of_group)           # [DSTATE]
    C_n = _convolve_channels(zxbcdt, conv_state, conv_weight, conv_bias, new_conv_state, b, xbc_start,
                             bc_start + NGROUPS * DSTATE, DSTATE, D_CONV, HAS_CONV_BIAS, first_of_group)
    for i in range(HEADS_PER_BLOCK):
        _update_head(zxbcdt, conv_state, conv_weight, conv_bias, ssm_state, A_log, D, dt_bias, gated, sumsq,
                     new_conv_state, new_ssm_state, B_n, C_n, b, first_head + i, pb, D_MLP, NHEADS, HEADDIM,
                     DSTATE, NGROUPS, D_CONV, BLOCK_P, HAS_CONV_BIAS, HAS_D, D_HAS_HDIM, HAS_DT_BIAS, RMSNORM,
                     NORM_BEFORE_GATE, DT_SOFTPLUS, HAS_DT_LIMIT, DT_MIN, DT_MAX)


def _update_head(zxbcdt, conv_state, conv_weight, conv_bias, ssm_state, A_log, D, dt_bias, gated, sumsq,
                 new_conv_state, new_ssm_state, B_n, C_n, b, h, pb, D_MLP, NHEADS, HEADDIM, DSTATE, NGROUPS,
                 D_CONV, BLOCK_P, HAS_CONV_BIAS, HAS_D, D_HAS_HDIM, HAS_DT_BIAS, RMSNORM, NORM_BEFORE_GATE,
                 DT_SOFTPLUS, HAS_DT_LIMIT, DT_MIN, DT_MAX):
    """Device helper: rows [pb BLOCK_P, (pb + 1) BLOCK_P) of head h of row b, given its group's B_n, C_n."""
    d_ssm = NHEADS * HEADDIM
    z_start = 2 * D_MLP
    xbc_start = z_start + d_ssm
    dt_start = xbc_start + d_ssm + 2 * NGROUPS * DSTATE
    piece = h * (HEADDIM // BLOCK_P) + pb            # this piece of d_ssm, BLOCK_P wide
    x_p = _convolve_channels(zxbcdt, conv_state, conv_weight, conv_bias, new_conv_state, b, xbc_start,
                             piece * BLOCK_P, BLOCK_P, D_CONV, HAS_CONV_BIAS, True)              # [BLOCK_P]

    heads = ct.full((1,), h, dtype=ct.int32)
    v = ct.gather(zxbcdt, (b, dt_start + heads)).astype(ct.float32)                            # [1]
    if HAS_DT_BIAS:
        v = v + ct.gather(dt_bias, heads).astype(ct.float32)
    delta = dt_transform(v, DT_SOFTPLUS, HAS_DT_LIMIT, DT_MIN, DT_MAX)                         # [1]
    decay = ct.exp(-delta * ct.exp(ct.gather(A_log, heads).astype(ct.float32)))               # exp(Δ A), [1]

    s = ct.load(ssm_state, index=(b, h, pb, 0), shape=(1, 1, BLOCK_P, DSTATE)
                ).reshape((BLOCK_P, DSTATE)).astype(ct.float32)
    s = s * decay + (delta * x_p)[:, None] * B_n[None, :]                                      # [BLOCK_P, DSTATE]
    ct.store(new_ssm_state, index=(b, h, pb, 0),
             tile=s.reshape((1, 1, BLOCK_P, DSTATE)).astype(new_ssm_state.dtype))
    y_p = ct.sum(s * C_n[None, :], axis=1)                                                      # [BLOCK_P] f32
    if HAS_D:
        if D_HAS_HDIM:
            D_p = ct.load(D, index=(h, pb), shape=(1, BLOCK_P)).reshape((BLOCK_P,)).astype(ct.float32)
        else:
            D_p = ct.gather(D, heads).astype(ct.float32)
        y_p = y_p + D_p * x_p
    y_p = _widen(y_p, zxbcdt.dtype)
    rows = piece * BLOCK_P + ct.arange(BLOCK_P, dtype=ct.int32)
    out = silu_gate(y_p, ct.gather(zxbcdt, (b, z_start + rows)))                               # [BLOCK_P] f32
    ct.store(gated, index=(b, piece), tile=out.reshape((1, BLOCK_P)).astype(gated.dtype))
    if RMSNORM:
        statistic = y_p if NORM_BEFORE_GATE else out
        ct.store(sumsq, index=(b, piece), tile=ct.sum(statistic * statistic, axis=0, keepdims=True
                                                      ).reshape((1, 1)))


# (int32-indexed, int64-indexed) entries of the one body.
DECODE_STEP_KERNELS = int64_index_kernels(decode_step_kernel)


@dataclasses.dataclass(frozen=True)
class DecodeStepDims:
    """Static description of one decode step (everything the kernel specialises on).

    dtype is that of zxbcdt (the computation dtype: the conv, y, the gate); the state and parameter dtypes are
    the arrays' own (the kernel converts on load). Without `rmsnorm`, z gates y and `gated` is the output.
    """

    batch: int
    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    d_conv: int
    d_mlp: int = 0
    dtype: str = "bfloat16"
    conv_state_dtype: str = "float32"
    ssm_state_dtype: str = "float32"
    conv_weight_dtype: str = "float32"
    has_conv_bias: bool = True
    has_D: bool = True
    D_has_hdim: bool = False
    has_dt_bias: bool = True
    rmsnorm: bool = True
    norm_before_gate: bool = False
    dt_softplus: bool = True
    dt_limit: tuple[float, float] = (0.0, math.inf)

    @property
    def d_ssm(self) -> int:
        return self.nheads * self.headdim

    @property
    def conv_dim(self) -> int:
        return self.d_ssm + 2 * self.ngroups * self.dstate

    @property
    def d_in_proj(self) -> int:
        return 2 * self.d_mlp + self.d_ssm + self.conv_dim + self.nheads

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
    for name in ("dtype", "conv_state_dtype", "ssm_state_dtype", "conv_weight_dtype"):
        if getattr(dims, name) not in KERNEL_DTYPES:
            return f"{name}={getattr(dims, name)} is not one of {KERNEL_DTYPES}"
    for name in ("headdim", "dstate"):
        if not is_power_of_2(getattr(dims, name)):
            return f"{name}={getattr(dims, name)} must be a power of two"
    if not 1 <= dims.d_conv <= MAX_D_CONV:
        return f"d_conv={dims.d_conv} must be in [1, {MAX_D_CONV}]"
    return None


@dataclasses.dataclass(frozen=True)
class DecodeStepConfig:
    """BLOCK_P: headdim rows of the state per block and head (a power of two dividing headdim);
    HEADS_PER_BLOCK: heads per block (a divisor of nheads / ngroups)."""

    BLOCK_P: int
    HEADS_PER_BLOCK: int = 1
    occupancy: int = 4


def decode_step_default_config(dims: DecodeStepDims) -> DecodeStepConfig:
    """About 2K state values per head and block (the register budget of `state_update.py`'s default; a
    64 x 128 f32 tile spills to the stack), narrowed to at least 2 blocks per SM (at least 8 rows), then as
    many heads per block as keep 4 blocks per SM (the occupancy hint).

    Every block re-convolves its group's 2 dstate B/C channels (d_conv taps and weights each), as many values
    as a 16 x 128 piece of the state: several heads per block share them. At the 24-layer LM (32 heads of 64,
    dstate 128): batch 1 runs 256 blocks of 8 rows and one head, batch 64 1024 blocks of 16 rows and 8 heads.
    """
    def blocks(block_p, heads_per_block=1):
        return dims.batch * dims.nheads // heads_per_block * (dims.headdim // block_p)

    block_p = min(dims.headdim, max(8, 2048 // dims.dstate))
    while block_p > 8 and blocks(block_p) < 2 * SM90_SMS:
        block_p //= 2
    heads = 1
    while (dims.nheads // dims.ngroups) % (2 * heads) == 0 and blocks(block_p, 2 * heads) >= 4 * SM90_SMS:
        heads *= 2
    return DecodeStepConfig(BLOCK_P=block_p, HEADS_PER_BLOCK=heads)


def decode_step_grid(dims: DecodeStepDims, cfg: DecodeStepConfig) -> tuple[int, int]:
    return (dims.batch * dims.nheads // cfg.HEADS_PER_BLOCK, dims.headdim // cfg.BLOCK_P)


def decode_step_inputs(dims: DecodeStepDims, param_dtype: str = "float32") -> dict[str, Buffer]:
    """Shape and dtype of each input as the bridge passes it (dummies where an option is off; the parameters
    other than conv_weight in `param_dtype`, A_log always float32)."""
    b, H, P, N, K = dims.batch, dims.nheads, dims.headdim, dims.dstate, dims.d_conv
    return {
        "zxbcdt": Buffer((b, dims.d_in_proj), dims.dtype),
        "conv_state": Buffer((b, dims.conv_dim, K), dims.conv_state_dtype),
        "conv_weight": Buffer((K, dims.conv_dim), dims.conv_weight_dtype),
        "conv_bias": Buffer((dims.conv_dim,) if dims.has_conv_bias else (1,), param_dtype),
        "ssm_state": Buffer((b, H, P, N), dims.ssm_state_dtype),
        "A_log": Buffer((H,), "float32"),
        "D": Buffer(((H, P) if dims.D_has_hdim else (H,)) if dims.has_D else (1,), param_dtype),
        "dt_bias": Buffer((H,) if dims.has_dt_bias else (1,), param_dtype),
    }


def decode_step_plan(dims: DecodeStepDims, cfg: DecodeStepConfig | None = None) -> Plan:
    """The decode step of `dims` as one launch.

    Returns:
      A Plan with inputs DECODE_STEP_INPUTS and outputs DECODE_STEP_OUTPUTS: "gated" ((batch, d_ssm), f32 with
      rmsnorm, else dims.dtype), "sumsq" ((batch, d_ssm / BLOCK_P) f32 partial sums of squares; a (1, 1)
      dummy without rmsnorm) and the next conv and SSM states in their states' dtypes.

    Raises:
      ValueError: unless cfg.BLOCK_P is a power of two dividing headdim and cfg.HEADS_PER_BLOCK divides
        nheads / ngroups.
    """
    cfg = cfg or decode_step_default_config(dims)
    if not is_power_of_2(cfg.BLOCK_P) or dims.headdim % cfg.BLOCK_P:
        raise ValueError(f"decode_step_plan: cfg.BLOCK_P={cfg.BLOCK_P} must be a power of two dividing "
                         f"headdim={dims.headdim}")
    heads_per_group = dims.nheads // dims.ngroups
    if not 1 <= cfg.HEADS_PER_BLOCK <= heads_per_group or heads_per_group % cfg.HEADS_PER_BLOCK:
        raise ValueError(f"decode_step_plan: cfg.HEADS_PER_BLOCK={cfg.HEADS_PER_BLOCK} must divide "
                         f"nheads / ngroups={heads_per_group}")
    b = dims.batch
    dt_min, dt_max = (float(v) for v in dims.dt_limit)
    launch = kernel_launch(
        select_kernel(DECODE_STEP_KERNELS, dims.ssd_dims(), occupancy=cfg.occupancy),
        decode_step_grid(dims, cfg), writes=DECODE_STEP_OUTPUTS,
        D_MLP=dims.d_mlp, NHEADS=dims.nheads, HEADDIM=dims.headdim, DSTATE=dims.dstate, NGROUPS=dims.ngroups,
        D_CONV=dims.d_conv, BLOCK_P=cfg.BLOCK_P, HEADS_PER_BLOCK=cfg.HEADS_PER_BLOCK,
        HAS_CONV_BIAS=dims.has_conv_bias, HAS_D=dims.has_D,
        D_HAS_HDIM=dims.D_has_hdim, HAS_DT_BIAS=dims.has_dt_bias, RMSNORM=dims.rmsnorm,
        NORM_BEFORE_GATE=dims.norm_before_gate, DT_SOFTPLUS=dims.dt_softplus, HAS_DT_LIMIT=dims.has_dt_limit,
        DT_MIN=dt_min, DT_MAX=dt_max)
    return Plan(
        inputs=DECODE_STEP_INPUTS,
        buffers={
            "gated": Buffer((b, dims.d_ssm), "float32" if dims.rmsnorm else dims.dtype),
            "sumsq": Buffer((b, dims.d_ssm // cfg.BLOCK_P) if dims.rmsnorm else (1, 1), "float32"),
            "new_conv_state": Buffer((b, dims.conv_dim, dims.d_conv), dims.conv_state_dtype),
            "new_ssm_state": Buffer((b, dims.nheads, dims.headdim, dims.dstate), dims.ssm_state_dtype),
        },
        launches=(launch,),
        outputs=DECODE_STEP_OUTPUTS,
    )
