"""The decode step of a Mamba-2 mixer between its two projections, as one cuTile kernel: the causal conv's step
and SiLU on in_proj's xBC columns, then the SSD state update (mamba_ssm `selective_state_update`), the D skip and,
for a mixer without the gated norm, the silu(z) gate.

Mirrors `jax_mamba2.decode_reference.mixer_step`. Per row b, head h of group g = h // (H / G), l = layer_index[0]:

    window[c] = conv_state[l, b, c, 1:] ++ xBC[b, c]                       (d_conv inputs, conv state's dtype)
    u[c]      = silu(bias[l, c] + sum_j w[l, j, c] window[c, j])          in f32: taps rounded to T, weights and
                                                                          bias not; the sum and u rounded to T
                                                                          (the composed step's roundings)
    x, B, C   = u's channels [0, d_ssm), [d_ssm, + G N), [d_ssm + G N, + G N)
    Δ         = dt_transform(dt[b, h] + dt_bias[l, h]),   A = -exp(A_log[l, h])
    state'    = exp(Δ A) ssm_state[l, b, h] + Δ x[h] ⊗ B[g]               (headdim, dstate), f32
    y[b, h]   = state' C[g] + D[l, h] x[h];   y *= silu(z[b, h]) with HAS_Z
    ssm_state[l, b, h] <- state' (in place);   conv_state[l, b, c] <- window[c] for x's channels (in place),
    group_windows[b, c - d_ssm] = window[c] for B's and C's
    with SUM_SQUARES (a gated norm follows, its gate zn from NORM_Z_OFFSET), y is instead the norm's input in
    f32: y rounded to T, times silu(zn[b, h]) unless NORM_BEFORE_GATE, and
    sum_squares[b, h * P / BLOCK_P + pb] = the sum of its squares over the block's channels: the norm's statistics
             in pieces (decode_projection.py's NORM_PARTS), so that the product after it normalizes with no
             norm launch and, the gate applied here, no gate of its own

xBC, dt and z are columns of in_proj's output zxbcdt (M, IN_WIDTH), read where they lie (no slice of it is
copied): xBC from XBC_OFFSET, dt from DT_OFFSET, z from Z_OFFSET. As everywhere in the decode kernels, the
per-layer arrays are the model's stacks (leading (L,) axis) indexed by layer_index. The two state stacks grow with
layers x rows (mamba2-370m's SSM state at 256 rows: 3.2e9 elements), so the kernel comes int32- and int64-indexed
(`needs_int64_index`).

Grid (M * H / HEADS, P / BLOCK_P). A block convolves all 2 N channels of its group's B and C (every block of the
group recomputes them: d_conv multiply-adds each), then for each of its HEADS heads (consecutive, of one group) its
BLOCK_P channels of x and the update; the first block of a group's first head writes B's and C's new windows.
Both state stacks are updated in place where one block owns what it rewrites: its (BLOCK_P, N) tiles of the SSM
state and its BLOCK_P channels of x's conv windows, so the stacks move no other bytes. B's and C's windows are
read by every block of their group, one of which could overwrite them before another reads them: they go to a
buffer of their own (one layer's, 2 G N channels: an eighth of d1024's conv state), which the caller writes into
the stack once no kernel reads it any more (`jax_mamba2.decode.mixer_step`; the LM's token step writes every
layer's at once).

Arrays: zxbcdt (M, IN_WIDTH) T; conv_state (L, M, CONV_DIM, D_CONV) Tc, read and written in place (x's channels);
group_windows (M, 2 G N, D_CONV) Tc;
sum_squares (M, H * P / BLOCK_P) f32 (a dummy without SUM_SQUARES);
conv_weight (L, D_CONV,
CONV_DIM), conv_bias (L, CONV_DIM) (a dummy without HAS_CONV_BIAS), A_log, dt_bias (L, H), D (L, H, P) with
D_PER_CHANNEL else (L, H), each in its own dtype; ssm_state (L, M, H, P, N) Ts, read and written; y (M, H, P) T.
"""
import dataclasses
import math
from typing import Optional

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    INDEPENDENT, INT32_MAX, SM90_SMS, Big, Buffer, ConstBool, ConstFloat, ConstInt, Launch, Plan, dt_transform,
    index_width_variant, int64_index_kernels, is_power_of_2, next_power_of_2, sigmoid, silu_gate,
    wait_for_predecessor)
from jax_mamba2.kernels.state_update import state_step

MIXER_STEP_INPUTS = ("layer_index", "zxbcdt", "conv_state", "conv_weight", "conv_bias", "A_log", "dt_bias", "D",
                     "ssm_state")
MIXER_STEP_OUTPUTS = ("y", "ssm_state", "conv_state", "group_windows")
# With dims.norm_z_offset: the blocks' sums of squares for the gated norm that follows.
SUM_SQUARES_OUTPUT = "sum_squares"
# A block's SSM state tile at most this many bytes (BLOCK_P x dstate): the compiler stages it in shared memory with
# the block's other operands (51.0 KB at 32 x 128 f32, 83.7 KB at 64 x 128 f32; sm_90), and four blocks of that
# fit an H200 SM's 228 KB.
MAX_STATE_TILE_BYTES = 16 * 1024


@dataclasses.dataclass(frozen=True)
class MixerStepDims:
    """Static description of one mixer decode step (what the kernel specialises on).

    rows: M, the sequences; layers: L; nheads, headdim, ngroups, dstate, d_conv: the mixer's; in_width: in_proj's
    output width and xbc_offset, dt_offset, z_offset (None without a gate in the step) where xBC, dt and z start in
    it. norm_z_offset: None, or where the gate of the gated norm that follows starts in zxbcdt: y is then the
    norm's input in float32 (y gated by it, y itself with norm_before_gate), and the step also writes each block's
    sum of its squares, the norm's statistics in pieces (`sum_squares_parts`). Dtypes as numpy names: dtype is
    zxbcdt's (T), the others the arrays' (conv_bias_dtype None: conv_weight's, as the dummy bias without one).
    """

    rows: int
    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    in_width: int
    xbc_offset: int
    dt_offset: int
    layers: int = 1
    d_conv: int = 4
    z_offset: Optional[int] = None
    norm_z_offset: Optional[int] = None
    norm_before_gate: bool = False
    d_per_channel: bool = False
    has_conv_bias: bool = True
    dt_softplus: bool = True
    dt_limit: tuple[float, float] = (0.0, math.inf)
    dtype: str = "bfloat16"
    conv_state_dtype: str = "bfloat16"
    ssm_state_dtype: str = "bfloat16"
    conv_weight_dtype: str = "float32"
    conv_bias_dtype: Optional[str] = None
    A_log_dtype: str = "float32"
    dt_bias_dtype: str = "float32"
    D_dtype: str = "float32"

    @property
    def d_ssm(self) -> int:
        return self.nheads * self.headdim

    @property
    def conv_dim(self) -> int:
        return self.d_ssm + 2 * self.ngroups * self.dstate

    @property
    def has_z(self) -> bool:
        return self.z_offset is not None

    @property
    def has_sum_squares(self) -> bool:
        return self.norm_z_offset is not None

    @property
    def has_dt_limit(self) -> bool:
        return tuple(self.dt_limit) != (0.0, math.inf)


@dataclasses.dataclass(frozen=True)
class MixerStepConfig:
    """BLOCK_P: headdim rows of the state per block (a power of two dividing headdim); OCCUPANCY: blocks per SM
    the compiler budgets registers for; HEADS: heads per block, one after the other (a power of two dividing the
    heads of a group): their group's B and C are convolved once for all of them rather than once per head."""

    BLOCK_P: int = 16
    OCCUPANCY: int = 4
    HEADS: int = 1

    def __post_init__(self):
        if not is_power_of_2(self.HEADS):
            raise ValueError(f"MixerStepConfig: HEADS={self.HEADS} must be a power of two")


def mixer_step_default_config(dims: MixerStepDims) -> MixerStepConfig:
    """Every block recomputes its group's B and C conv (2 dstate channels), so the fewer blocks the less of that
    while the grid still spreads over the SMs: whole heads (up to 64 rows) per block once the heads alone give two
    blocks per SM of an H200 (264), half heads (32 rows) from one per SM (132), else about 2K state values per
    block, as `ssd_step`'s kernel. Occupancy 4: the fastest config of every batch measured had it (docs/design.md,
    "Decode"); so a block's state tile stays within MAX_STATE_TILE_BYTES, which keeps 4 blocks' shared memory
    within an SM (a whole head of an f32 state, 64 x 128, would take 83.7 KB: 2 blocks per SM). Where there are
    blocks to spare, each takes several heads of its group (`_heads_per_block`), also with 64-bit offsets where a
    layer's SSM state is addressed as an array of its own (`views_the_layer_state`); without that view, one head
    per block (docs/design.md, "Heads per mixer-step block")."""
    heads = dims.rows * dims.nheads
    if heads >= SM90_SMS:
        rows_that_fit = MAX_STATE_TILE_BYTES // (dims.dstate * (4 if dims.ssm_state_dtype == "float32" else 2))
        block_p = min(dims.headdim, 64 if heads >= 2 * SM90_SMS else 32, max(16, rows_that_fit))
        plain_int64 = needs_int64_index(dims) and not views_the_layer_state(dims)
        return MixerStepConfig(BLOCK_P=block_p, HEADS=1 if plain_int64 else _heads_per_block(dims, block_p))
    return MixerStepConfig(BLOCK_P=min(dims.headdim, 64, max(4, 2048 // dims.dstate)))


def _heads_per_block(dims: MixerStepDims, block_p: int) -> int:
    """The most heads of a group per block, up to 8, that leave at least two blocks per SM of an H200: fewer
    blocks convolve B and C fewer times and overlap one head's loads with another's work, until the grid no
    longer covers the SMs (docs/design.md, "Heads per mixer-step block")."""
    blocks = dims.rows * dims.nheads * (dims.headdim // block_p)
    heads = 8
    while heads > 1 and ((dims.nheads // dims.ngroups) % heads or blocks // heads < 2 * SM90_SMS):
        heads //= 2
    return heads


def mixer_step_unsupported_reason(dims: MixerStepDims) -> Optional[str]:
    """Why the kernel cannot run `dims` (None when it can)."""
    for name in ("headdim", "dstate"):
        value = getattr(dims, name)
        if not is_power_of_2(value) or not 16 <= value <= 256:
            return f"{name}={value} must be a power of two in [16, 256]"
    if dims.nheads % dims.ngroups:
        return f"nheads={dims.nheads} must be a multiple of ngroups={dims.ngroups}"
    # Columns are read as tiles: each segment must start on a multiple of its tile.
    if dims.xbc_offset % math.lcm(dims.headdim, dims.dstate) or dims.d_ssm % dims.dstate:
        return (f"xBC's offset {dims.xbc_offset} must be a multiple of headdim={dims.headdim} and "
                f"dstate={dims.dstate}, and d_ssm={dims.d_ssm} of dstate")
    if dims.has_z and dims.z_offset % dims.headdim:
        return f"z's offset {dims.z_offset} must be a multiple of headdim={dims.headdim}"
    if dims.has_sum_squares and (dims.has_z or dims.norm_z_offset % dims.headdim):
        return (f"the norm's gate offset {dims.norm_z_offset} must be a multiple of headdim={dims.headdim}, "
                f"with no gate in the step (z_offset None)")
    return None


def views_the_layer_state(dims: MixerStepDims) -> bool:
    """Whether the kernel addresses the layer's SSM state through `_layer_state`: where the stacks need 64-bit
    offsets but one layer's state fits int32 ones (mamba2-370m's 48 layers at 256 rows: 67M elements a layer)."""
    return needs_int64_index(dims) and dims.rows * dims.d_ssm * dims.dstate <= INT32_MAX


def needs_int64_index(dims: MixerStepDims) -> bool:
    """Whether a state stack of `dims` has 2^31 or more elements, so that int32 offsets into it could overflow."""
    return dims.layers * dims.rows * max(dims.d_ssm * dims.dstate, dims.conv_dim * dims.d_conv) > INT32_MAX


def _conv_silu(zxbcdt, conv_state, conv_weight, conv_bias, layer, b, channel_block, column_block, WIDTH, D_CONV,
               D_CONV_TILE, HAS_CONV_BIAS):
    """(u, window) of conv channels [channel_block * WIDTH, + WIDTH), whose inputs are zxbcdt's columns
    [column_block * WIDTH, + WIDTH): u (WIDTH,) f32 = silu(conv) rounded to zxbcdt's dtype T, window (WIDTH,
    D_CONV_TILE) the new conv state's columns in its dtype (columns past D_CONV zero). The conv sums the window
    rounded to T times the weight and plus the bias in f32, the parameters not rounded to T (as
    `conv1d_reference` and the full-sequence conv take them)."""
    cols = ct.arange(D_CONV_TILE, dtype=ct.int32)
    channels = channel_block * WIDTH + ct.arange(WIDTH, dtype=ct.int32)
    # The old window shifted left by one: column j holds conv_state[..., j + 1] (0 past the state's d_conv).
    shifted = ct.gather(conv_state, (layer, b, channels[:, None], cols[None, :] + 1), padding_value=0)
    new = ct.load(zxbcdt, index=(b, column_block), shape=(1, WIDTH)).reshape((WIDTH, 1)).astype(conv_state.dtype)
    window = ct.where(cols[None, :] == D_CONV - 1, new, shifted)
    weight = ct.load(conv_weight, index=(layer, 0, channel_block), shape=(1, D_CONV_TILE, WIDTH),
                     padding_mode=ct.PaddingMode.ZERO).reshape((D_CONV_TILE, WIDTH))
    T = zxbcdt.dtype
    taps = window.astype(T).astype(ct.float32) * ct.permute(weight, (1, 0)).astype(ct.float32)
    acc = ct.sum(taps, axis=1)
    if HAS_CONV_BIAS:
        bias = ct.load(conv_bias, index=(layer, channel_block), shape=(1, WIDTH)).reshape((WIDTH,))
        acc = acc + bias.astype(ct.float32)
    u = acc.astype(T).astype(ct.float32)
    return (u * sigmoid(u)).astype(T).astype(ct.float32), window


def _layer_state(ssm_state, layer, rows, nheads, headdim, dstate):
    """ssm_state[layer] of an (L, rows, nheads, headdim, dstate) stack as an array of its own (row-major at the
    layer's address, shapes and strides int32). In the int64-indexed kernel its tiles are then addressed with
    int32 offsets from a 64-bit base, so their loads and stores keep the bulk tensor copies (TMA) the compiler
    gives int32-indexed arrays and not int64-indexed ones (sm_90, tileiras 13.4); a layer must hold fewer than
    2^31 elements (`views_the_layer_state`)."""
    return ct.Array.from_foreign(ssm_state.slice(0, layer, layer + 1).foreign_pointer,
                                 (rows, nheads, headdim, dstate),
                                 (nheads * headdim * dstate, headdim * dstate, dstate, 1))


def mixer_step_kernel(
    layer_index,        # (1,) int32
    zxbcdt,             # (M, IN_WIDTH) T
    conv_state: Big,    # (L, M, CONV_DIM, D_CONV) Tc, read, and written in place in x's channels
    conv_weight,        # (L, D_CONV, CONV_DIM) in its dtype
    conv_bias,          # (L, CONV_DIM) in its dtype, or a dummy without HAS_CONV_BIAS
    A_log,              # (L, H) in its dtype
    dt_bias,            # (L, H) in its dtype
    D,                  # (L, H, P) with D_PER_CHANNEL, else (L, H); in its dtype
    ssm_state: Big,     # (L, M, H, P, N) Ts, read and written in place
    group_windows,      # (M, 2 * NGROUPS * DSTATE, D_CONV) Tc: B's and C's new windows, written
    y,                  # (M, H, P) T, or f32 with SUM_SQUARES (the norm's input), written
    sum_squares,        # (M, H * P / BLOCK_P) f32, written with SUM_SQUARES, else a dummy
    NGROUPS: ConstInt,
    DSTATE: ConstInt,
    BLOCK_P: ConstInt,
    D_CONV: ConstInt,
    D_CONV_TILE: ConstInt,  # next_power_of_2(D_CONV)
    XBC_OFFSET: ConstInt,
    DT_OFFSET: ConstInt,
    HAS_Z: ConstBool,
    Z_OFFSET: ConstInt,
    SUM_SQUARES: ConstBool,
    NORM_Z_OFFSET: ConstInt,
    NORM_BEFORE_GATE: ConstBool,
    HAS_CONV_BIAS: ConstBool,
    D_PER_CHANNEL: ConstBool,
    DT_SOFTPLUS: ConstBool,
    HAS_DT_LIMIT: ConstBool,
    DT_MIN: ConstFloat,
    DT_MAX: ConstFloat,
    HEADS: ConstInt,     # heads per block (of one group): B's and C's conv computed once for them
    STATE_VIEW: ConstBool,  # the layer's SSM state through `_layer_state` (int64-indexed kernels)
    DEPENDENT: ConstInt,  # INDEPENDENT, or how it waits under a programmatic dependent launch
):
    wait_for_predecessor(DEPENDENT)
    nheads = y.shape[1]
    headdim = y.shape[2]
    head_blocks = nheads // HEADS
    bh = ct.bid(0)
    pb = ct.bid(1)
    b = bh // head_blocks
    h0 = (bh % head_blocks) * HEADS
    heads_per_group = nheads // NGROUPS
    g = h0 // heads_per_group
    layer = ct.load(layer_index, index=(0,), shape=(1,)).item()
    d_ssm = nheads * headdim
    p_blocks = headdim // BLOCK_P
    # The layer's SSM state: with STATE_VIEW its entry of the stack as an int32-indexed array of its own.
    if STATE_VIEW:
        state = _layer_state(ssm_state, layer, y.shape[0], nheads, headdim, DSTATE)

    # B and C of the group, which the block's HEADS heads share: conv channels d_ssm + g * DSTATE and
    # d_ssm + (NGROUPS + g) * DSTATE onwards.
    b_block = d_ssm // DSTATE + g
    c_block = b_block + NGROUPS
    B_n, B_window = _conv_silu(zxbcdt, conv_state, conv_weight, conv_bias, layer, b, b_block,
                               XBC_OFFSET // DSTATE + b_block, DSTATE, D_CONV, D_CONV_TILE, HAS_CONV_BIAS)
    C_n, C_window = _conv_silu(zxbcdt, conv_state, conv_weight, conv_bias, layer, b, c_block,
                               XBC_OFFSET // DSTATE + c_block, DSTATE, D_CONV, D_CONV_TILE, HAS_CONV_BIAS)
    if h0 % heads_per_group == 0:
        if pb == 0:
            # The conv windows' stores are plain stores, not bulk tensor copies (TMA): where a window's row is 16
            # bytes (f32, d_conv 4) tileiras 13.4 makes them TMA, and such launches hung on the GPU (docs/design.md
            # §8 says what was and was not isolated). A window tile is a few KB: TMA gains nothing on it.
            ct.store(group_windows, index=(b, g, 0), tile=B_window.reshape((1, DSTATE, D_CONV_TILE)),
                     allow_tma=False)
            ct.store(group_windows, index=(b, NGROUPS + g, 0), tile=C_window.reshape((1, DSTATE, D_CONV_TILE)),
                     allow_tma=False)

    for i in range(HEADS):
        h = h0 + i
        # x: this block's BLOCK_P channels of head h (conv channel h * headdim + pb * BLOCK_P + j).
        x_block = h * p_blocks + pb
        x_p, x_window = _conv_silu(zxbcdt, conv_state, conv_weight, conv_bias, layer, b, x_block,
                                   XBC_OFFSET // BLOCK_P + x_block, BLOCK_P, D_CONV, D_CONV_TILE, HAS_CONV_BIAS)
        # Only this block reads these channels' windows, and it has read them: rewritten in place.
        ct.store(conv_state, index=(layer, b, x_block, 0), tile=x_window.reshape((1, 1, BLOCK_P, D_CONV_TILE)),
                 allow_tma=False)
        dt_v = ct.load(zxbcdt, index=(b, DT_OFFSET + h), shape=(1, 1)).reshape((1,)).astype(ct.float32)
        bias = ct.load(dt_bias, index=(layer, h), shape=(1, 1)).reshape((1,)).astype(ct.float32)
        delta = dt_transform(dt_v + bias, DT_SOFTPLUS, HAS_DT_LIMIT, DT_MIN, DT_MAX)
        A_h = -ct.exp(ct.load(A_log, index=(layer, h), shape=(1, 1)).reshape((1,)).astype(ct.float32))
        if D_PER_CHANNEL:
            D_p = ct.load(D, index=(layer, h, pb), shape=(1, 1, BLOCK_P)).reshape((BLOCK_P,)).astype(ct.float32)
        else:
            D_p = ct.load(D, index=(layer, h), shape=(1, 1)).reshape((1,)).astype(ct.float32)
        if STATE_VIEW:
            s = ct.load(state, index=(b, h, pb, 0), shape=(1, 1, BLOCK_P, DSTATE))
        else:
            s = ct.load(ssm_state, index=(layer, b, h, pb, 0), shape=(1, 1, 1, BLOCK_P, DSTATE))
        s, y_p = state_step(s.reshape((BLOCK_P, DSTATE)).astype(ct.float32), x_p, delta, A_h, B_n, C_n, D_p)
        if STATE_VIEW:
            ct.store(state, index=(b, h, pb, 0), tile=s.reshape((1, 1, BLOCK_P, DSTATE)).astype(ssm_state.dtype))
        else:
            ct.store(ssm_state, index=(layer, b, h, pb, 0),
                     tile=s.reshape((1, 1, 1, BLOCK_P, DSTATE)).astype(ssm_state.dtype))
        if HAS_Z:
            z = ct.load(zxbcdt, index=(b, Z_OFFSET // BLOCK_P + x_block), shape=(1, BLOCK_P)).reshape((BLOCK_P,))
            y_p = silu_gate(y_p, z)
        if SUM_SQUARES:
            # The norm's input as its kernel would have computed it: y rounded to T, gated in f32
            # (decode_projection.py).
            y_p = y_p.astype(zxbcdt.dtype).astype(ct.float32)
            if not NORM_BEFORE_GATE:
                zn = ct.load(zxbcdt, index=(b, NORM_Z_OFFSET // BLOCK_P + x_block), shape=(1, BLOCK_P)
                             ).reshape((BLOCK_P,)).astype(ct.float32)
                y_p = y_p * (zn * sigmoid(zn))
            ct.store(sum_squares, index=(b, x_block), tile=ct.sum(y_p * y_p, axis=0, keepdims=True).reshape((1, 1)))
        ct.store(y, index=(b, h, pb), tile=y_p.reshape((1, 1, BLOCK_P)).astype(y.dtype))


MIXER_STEP_KERNELS = int64_index_kernels(mixer_step_kernel)


def mixer_step_inputs(dims: MixerStepDims) -> dict[str, Buffer]:
    """Shape and dtype of each input as the bridge passes it (a dummy conv_bias without one)."""
    L, M, H, P = dims.layers, dims.rows, dims.nheads, dims.headdim
    return {
        "layer_index": Buffer((1,), "int32"),
        "zxbcdt": Buffer((M, dims.in_width), dims.dtype),
        "conv_state": Buffer((L, M, dims.conv_dim, dims.d_conv), dims.conv_state_dtype),
        "conv_weight": Buffer((L, dims.d_conv, dims.conv_dim), dims.conv_weight_dtype),
        "conv_bias": Buffer((L, dims.conv_dim) if dims.has_conv_bias else (1, 1),
                            dims.conv_bias_dtype or dims.conv_weight_dtype),
        "A_log": Buffer((L, H), dims.A_log_dtype),
        "dt_bias": Buffer((L, H), dims.dt_bias_dtype),
        "D": Buffer((L, H, P) if dims.d_per_channel else (L, H), dims.D_dtype),
        "ssm_state": Buffer((L, M, H, P, dims.dstate), dims.ssm_state_dtype),
    }


def sum_squares_parts(dims: MixerStepDims, cfg: Optional[MixerStepConfig] = None) -> int:
    """The pieces of a row the plan of `dims` (with norm_z_offset) returns sums of squares for: one per block,
    BLOCK_P channels each, in channel order."""
    return dims.d_ssm // (cfg or mixer_step_default_config(dims)).BLOCK_P


def mixer_step_plan(dims: MixerStepDims, cfg: Optional[MixerStepConfig] = None) -> Plan:
    """The mixer's decode step for `dims`.

    Returns:
      A Plan with inputs MIXER_STEP_INPUTS and outputs MIXER_STEP_OUTPUTS: "y" (M, H, P) in dims.dtype (float32,
      the gated norm's input, with norm_z_offset), "ssm_state" (the input stack, its layer updated in place),
      "conv_state" (the input stack, its layer's x channels advanced in place) and "group_windows" (M, 2 G N,
      D_CONV), the layer's next conv state in B's and C's channels (d_ssm on); with norm_z_offset also
      SUM_SQUARES_OUTPUT (M, sum_squares_parts) float32.
    """
    cfg = cfg or mixer_step_default_config(dims)
    if (dims.nheads // dims.ngroups) % cfg.HEADS:
        raise ValueError(f"mixer_step_plan: HEADS={cfg.HEADS} must divide the heads of a group "
                         f"({dims.nheads // dims.ngroups})")
    parts = sum_squares_parts(dims, cfg)
    dt_min, dt_max = (float(v) for v in dims.dt_limit)
    launch = Launch(
        kernel=index_width_variant(MIXER_STEP_KERNELS, needs_int64_index(dims), occupancy=cfg.OCCUPANCY),
        grid=(dims.rows * dims.nheads // cfg.HEADS, dims.headdim // cfg.BLOCK_P),
        args=("layer_index", "zxbcdt", "conv_state", "conv_weight", "conv_bias", "A_log", "dt_bias", "D",
              "ssm_state", "group_windows", "y", SUM_SQUARES_OUTPUT, dims.ngroups, dims.dstate, cfg.BLOCK_P,
              dims.d_conv, next_power_of_2(dims.d_conv), dims.xbc_offset, dims.dt_offset, dims.has_z,
              dims.z_offset or 0, dims.has_sum_squares, dims.norm_z_offset or 0, dims.norm_before_gate,
              dims.has_conv_bias, dims.d_per_channel, dims.dt_softplus, dims.has_dt_limit, dt_min, dt_max,
              cfg.HEADS, views_the_layer_state(dims), INDEPENDENT),
        writes=("ssm_state", "conv_state", "group_windows", "y", SUM_SQUARES_OUTPUT),
    )
    return Plan(
        inputs=MIXER_STEP_INPUTS,
        buffers={"y": Buffer((dims.rows, dims.nheads, dims.headdim),
                             "float32" if dims.has_sum_squares else dims.dtype),
                 "group_windows": Buffer((dims.rows, 2 * dims.ngroups * dims.dstate, dims.d_conv),
                                         dims.conv_state_dtype),
                 SUM_SQUARES_OUTPUT: Buffer((dims.rows, parts) if dims.has_sum_squares else (1, 1), "float32")},
        launches=(launch,),
        outputs=MIXER_STEP_OUTPUTS + ((SUM_SQUARES_OUTPUT,) if dims.has_sum_squares else ()),
    )
