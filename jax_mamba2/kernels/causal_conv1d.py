"""The causal depthwise conv1d (+ SiLU) of the Mamba-2 mixer, forward, channels-last.

Mirrors `conv1d_reference.causal_conv1d` followed by SiLU (mamba_ssm / causal_conv1d `causal_conv1d_fn`,
channels-last). Per batch row b, token t and channel c, with K = WIDTH taps:

    pre[t, c] = bias[c] + Σ_{k<K} weight[k, c] · x̃[t - K + 1 + k, c] · m_k[t]        (f32)
    y[t, c]   = silu(pre[t, c]) if SILU else pre[t, c]                            (rounded to x's dtype)

x̃ is x left-extended by the last K - 1 columns of `initial_states` (zeros without HAS_INIT). With seq_idx,
m_k[t] = (ids[t - K + 1 + k] == ids[t]) with ids = -1 before the sequence: a tap never reads an earlier
packed sequence (nor the initial states). Without seq_idx every m_k is 1.

Layout and loads. cuTile tiles have power-of-two dims and `ct.load` offsets are whole tiles, so a tile of
rows shifted by one token cannot be formed from an aligned tile. Each block therefore handles BLOCK_L
tokens of BLOCK_C channels as a Python tuple of rows: it gathers the BLOCK_L + K - 1 rows of its window once
(`ct.gather` of one token's BLOCK_C contiguous channels: a vector load per thread, zero outside the array,
which is also the left padding), and each output row combines K rows of the tuple by static indexing, as a
CUDA thread shifts a register window. The K - 1 halo rows are read again by the neighbouring block, from L2.

Bytes (the floor of this memory-bound op): one read of x and one write of y, 2 · itemsize(x) bytes per
element, e.g. 151 MB (31 µs at the H200's 4.8 TB/s) at (8, 2048, 2304) bf16; the halo adds (K - 1) / BLOCK_L
re-reads that hit L2, the weights and seq_idx are noise.

Grid: (cdiv(seqlen, BLOCK_L), cdiv(channels, BLOCK_C), batch).

Shapes: x, y (batch, seqlen, channels) T in {bf16, f16, f32}; weight (WIDTH, channels) and bias (channels,)
T (the op rounds them to x's dtype, as the reference does); initial_states (batch, channels, INIT_WIDTH) T
(a dummy (1, 1, 1) without HAS_INIT); seq_idx (batch, seqlen) int32 (a dummy (1, 1) without HAS_SEQ_IDX).
"""
import dataclasses

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    LOG2E, Big, Buffer, ConstBool, ConstInt, Launch, Plan, exp2_ftz, int64_index_kernels, is_power_of_2,
    next_power_of_2)

_INT32_MAX = (1 << 31) - 1

CONV_INPUTS = ("x", "weight", "bias", "initial_states", "seq_idx")


@dataclasses.dataclass(frozen=True)
class ConvDims:
    """Static description of one conv problem (everything the kernels specialise on).

    x is (batch, seqlen, channels) of `dtype`; `width` is d_conv (the number of taps); `init_width` the
    number of columns of initial_states (width - 1 or width; 0 without them).
    """

    batch: int
    seqlen: int
    channels: int
    width: int
    dtype: str = "bfloat16"
    init_width: int = 0
    has_seq_idx: bool = False
    silu: bool = True

    @property
    def has_init(self) -> bool:
        return self.init_width > 0


def needs_int64_index(dims: ConvDims, partials: int = 0) -> bool:
    """Whether an array of the problem (x, or `partials` rows of per-block weight sums) has 2^31 or more
    elements, so that int32 element offsets could overflow."""
    largest = max(dims.batch * dims.seqlen * dims.channels, max(partials, 1) * dims.width * dims.channels,
                  dims.batch * dims.channels * max(dims.init_width, 1))
    return largest > _INT32_MAX


def conv_arrays(dims: ConvDims) -> dict[str, Buffer]:
    """Shape and dtype of each plan input as the bridge passes it (dummies for absent options)."""
    b, L, C, T = dims.batch, dims.seqlen, dims.channels, dims.dtype
    return {
        "x": Buffer((b, L, C), T),
        "weight": Buffer((dims.width, C), T),
        "bias": Buffer((C,), T),
        "initial_states": Buffer((b, C, dims.init_width) if dims.has_init else (1, 1, 1), T),
        "seq_idx": Buffer((b, L) if dims.has_seq_idx else (1, 1), "int32"),
    }


# ----------------------------------------------------------------------------------------------
# Device helpers (shared with causal_conv1d_bwd.py)
# ----------------------------------------------------------------------------------------------

def sigmoid(p):
    """Device helper: 1 / (1 + e^-p) in f32 with one MUFU.EX2 and an approximate division (e^-p -> inf for
    very negative p gives 0, never NaN)."""
    return ct.truediv(1.0, 1.0 + exp2_ftz(p * -LOG2E), rounding_mode=ct.RoundingMode.APPROX,
                      flush_to_zero=True)


def token_rows(x, b, first, count, cols):
    """x[b, t, cols] of tokens t = first .. first + count - 1 as a tuple of [BLOCK_C] tiles in x's dtype, 0
    where t or a channel lies outside x (t < 0 is the left padding): one vector load per thread and row."""
    rows = ()
    for j in ct.static_iter(range(count)):
        rows += (ct.gather(x, (b, first + j, cols)),)
    return rows


def widened(rows):
    """A tuple of tiles cast to f32."""
    wide = ()
    for row in ct.static_iter(rows):
        wide += (row.astype(ct.float32),)
    return wide


def halo_rows(x, initial_states, b, first, count, cols, HAS_INIT, INIT_WIDTH):
    """The rows of tokens first .. first + count - 1 of x̃ (x left-extended by the initial states' last
    columns) as a tuple of f32 [BLOCK_C] tiles. A token t < 0 reads initial_states[b, cols, INIT_WIDTH + t]
    (x's gather is 0 there, and the states' is 0 for t >= 0, so the two add up without a branch)."""
    rows = widened(token_rows(x, b, first, count, cols))
    if HAS_INIT:
        extended = ()
        for j in ct.static_iter(range(count)):
            state = ct.gather(initial_states, (b, cols, INIT_WIDTH + first + j)).astype(ct.float32)
            extended += (rows[j] + state,)
        rows = extended
    return rows


def token_ids(seq_idx, b, first, count):
    """The sequence ids of tokens first .. first + count - 1 as a tuple of int32 scalars, -1 outside x."""
    ids = ()
    for j in ct.static_iter(range(count)):
        ids += (ct.gather(seq_idx, (b, first + j), padding_value=-1),)
    return ids


def weight_rows(weight, cols, WIDTH):
    """The WIDTH taps weight[k, cols] as a tuple of f32 [BLOCK_C] tiles."""
    taps = ()
    for k in ct.static_iter(range(WIDTH)):
        taps += (ct.gather(weight, (k, cols)).astype(ct.float32),)
    return taps


def masked_taps(rows, ids, r, WIDTH, HAS_SEQ_IDX):
    """The WIDTH input rows of output row r of a window (rows[r + k], k < WIDTH; rows[r + WIDTH - 1] is the
    token itself), each zeroed where its token belongs to another sequence than the output's."""
    taps = ()
    for k in ct.static_iter(range(WIDTH)):
        tap = rows[r + k]
        if HAS_SEQ_IDX:
            tap = ct.where(ids[r + k] == ids[r + WIDTH - 1], tap, 0.0)
        taps += (tap,)
    return taps


def preactivation(taps, weights, bias_row, WIDTH):
    """bias + Σ_k weight[k] · tap[k], f32 [BLOCK_C]."""
    acc = bias_row
    for k in ct.static_iter(range(WIDTH)):
        acc = acc + taps[k] * weights[k]
    return acc


# ----------------------------------------------------------------------------------------------
# Forward kernel
# ----------------------------------------------------------------------------------------------

def _conv_fwd_body(x, weight, bias, initial_states, seq_idx, y, WIDTH, INIT_WIDTH, BLOCK_L, BLOCK_C, HAS_INIT,
                   HAS_SEQ_IDX, SILU):
    l = ct.bid(0)
    b = ct.bid(2)
    cols = ct.bid(1) * BLOCK_C + ct.arange(BLOCK_C, dtype=ct.int32)
    first = l * BLOCK_L - (WIDTH - 1)

    rows = halo_rows(x, initial_states, b, first, WIDTH - 1, cols, HAS_INIT, INIT_WIDTH) + \
        widened(token_rows(x, b, l * BLOCK_L, BLOCK_L, cols))
    ids = ()
    if HAS_SEQ_IDX:
        ids = token_ids(seq_idx, b, first, BLOCK_L + WIDTH - 1)
    weights = weight_rows(weight, cols, WIDTH)
    bias_row = ct.gather(bias, cols).astype(ct.float32)

    for r in ct.static_iter(range(BLOCK_L)):
        pre = preactivation(masked_taps(rows, ids, r, WIDTH, HAS_SEQ_IDX), weights, bias_row, WIDTH)
        out = pre * sigmoid(pre) if SILU else pre
        # Rows past seqlen and channels past the last fall outside y and are dropped.
        ct.scatter(y, (b, l * BLOCK_L + r, cols), out.astype(y.dtype))


def causal_conv1d_fwd_kernel(
    x: Big,                # (batch, seqlen, channels) T
    weight,                # (WIDTH, channels) T
    bias,                  # (channels,) T
    initial_states: Big,   # (batch, channels, INIT_WIDTH) T, or a dummy
    seq_idx,               # (batch, seqlen) int32, or a dummy
    y: Big,                # (batch, seqlen, channels) T, written
    WIDTH: ConstInt,
    INIT_WIDTH: ConstInt,
    BLOCK_L: ConstInt,
    BLOCK_C: ConstInt,
    HAS_INIT: ConstBool,
    HAS_SEQ_IDX: ConstBool,
    SILU: ConstBool,
):
    _conv_fwd_body(x, weight, bias, initial_states, seq_idx, y, WIDTH, INIT_WIDTH, BLOCK_L, BLOCK_C,
                   HAS_INIT, HAS_SEQ_IDX, SILU)


# (int32-indexed, int64-indexed) entries of the one body.
# Three blocks per SM: the forward is memory-bound, and more blocks in flight hide the gathers' latency.
CONV_FWD_KERNELS = tuple(k.replace_hints(occupancy=3) for k in int64_index_kernels(causal_conv1d_fwd_kernel))


@dataclasses.dataclass(frozen=True)
class ConvFwdConfig:
    """Tile of `causal_conv1d_fwd_kernel`: BLOCK_L tokens (unrolled rows) x BLOCK_C channels (powers of two)."""

    BLOCK_L: int
    BLOCK_C: int


def conv_fwd_default_config(dims: ConvDims) -> ConvFwdConfig:
    """16 rows of up to 512 channels: 4 channels per thread of the block's 128, one 8-byte load per row at
    bf16 (16 bytes at f32), ~167 registers and no shared or local memory at d_conv 4 (tileiras 13.4, sm_90),
    within the occupancy hint of 3 blocks (12 warps) per SM: 3 x 19 rows x 1 KB = 57 KB of loads in flight
    per SM. Fewer channels take a narrower tile (at least 16)."""
    return ConvFwdConfig(BLOCK_L=16, BLOCK_C=min(512, max(16, next_power_of_2(dims.channels))))


def conv_fwd_grid(dims: ConvDims, cfg: ConvFwdConfig) -> tuple[int, int, int]:
    return (-(-dims.seqlen // cfg.BLOCK_L), -(-dims.channels // cfg.BLOCK_C), dims.batch)


def check_block_c(api: str, block_c: int) -> None:
    """Raises ValueError unless BLOCK_C is a power of two (a tile dimension)."""
    if not is_power_of_2(block_c):
        raise ValueError(f"{api}: BLOCK_C={block_c} must be a power of two")


def conv_fwd_plan(dims: ConvDims, cfg: ConvFwdConfig | None = None) -> Plan:
    """The forward for `dims`: inputs CONV_INPUTS (see `conv_arrays`), output "y" (x's shape and dtype)."""
    cfg = cfg or conv_fwd_default_config(dims)
    check_block_c("conv_fwd_plan", cfg.BLOCK_C)
    kernel = CONV_FWD_KERNELS[1 if needs_int64_index(dims) else 0]
    launch = Launch(
        kernel=kernel, grid=conv_fwd_grid(dims, cfg),
        args=(*CONV_INPUTS, "y", dims.width, dims.init_width, cfg.BLOCK_L, cfg.BLOCK_C, dims.has_init,
              dims.has_seq_idx, dims.silu),
        writes=("y",))
    return Plan(inputs=CONV_INPUTS, buffers={"y": Buffer((dims.batch, dims.seqlen, dims.channels), dims.dtype)},
                launches=(launch,), outputs=("y",))
