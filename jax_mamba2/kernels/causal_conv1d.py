"""The causal depthwise conv1d (+ SiLU) of the Mamba-2 mixer, forward, channels-last.

Mirrors `conv1d_reference.causal_conv1d` followed by SiLU (mamba_ssm / causal_conv1d `causal_conv1d_fn`,
channels-last). Per batch row b, token t and channel c, with K = WIDTH taps:

    pre[t, c] = bias[c] + Σ_{k<K} weight[k, c] · x̃[t - K + 1 + k, c] · m_k[t]        (f32; weight, bias f32)
    y[t, c]   = silu(pre[t, c]) if SILU else pre[t, c]                            (rounded to x's dtype)

x̃ is x left-extended by the last K - 1 columns of `initial_states` (zeros without HAS_INIT). With seq_idx,
m_k[t] = (ids[t - K + 1 + k] == ids[t]) with ids = -1 before the sequence: a tap never reads an earlier
packed sequence (nor the initial states). Without seq_idx every m_k is 1.

Channels in, pieces out. x may be wider than the conv: the kernels read channels IN_OFFSET .. IN_OFFSET +
channels - 1 of each token (the mixer passes in_proj's whole output, [z, xBC, dt], and the offset of xBC), and
the forward writes channels [0, SPLIT1), [SPLIT1, SPLIT2), [SPLIT2, channels) to up to OUTPUTS = 3 separate
arrays (the mixer's x, B and C, in the layouts the SSD takes), so that XLA copies nothing around the launch:
no slice of the input, no concatenate of [B, C], no split of the output. A block's channels may straddle a
split; it stores to every output its channels meet (`if` on the block index, so a block within one output
issues the stores of that one only).

Layout and loads. cuTile tiles have power-of-two dims and `ct.load` offsets are whole tiles, so a tile of
rows shifted by one token cannot be formed from an aligned tile. Each block therefore handles BLOCK_L
tokens of BLOCK_C channels as a Python tuple of rows: it gathers the BLOCK_L + K - 1 rows of its window once
(`ct.gather` of one token's BLOCK_C contiguous channels: a vector load per thread, zero outside the array,
which is also the left padding), and each output row combines K rows of the tuple by static indexing, as a
CUDA thread shifts a register window. With SEGMENT_TILES > 1 a block walks that many tiles of BLOCK_L tokens
in steps, gathering the next step's rows before this step's arithmetic and stores and carrying the K - 1 halo
rows from step to step; with one tile per block the halo rows are read again by the neighbouring block, from
L2.

Bytes (the floor of this memory-bound op): one read of x and one write of y, 2 · itemsize(x) bytes per
element, e.g. 151 MB (31 µs at the H200's 4.8 TB/s) at (8, 2048, 2304) bf16; the halo adds
(K - 1) / (BLOCK_L · SEGMENT_TILES) re-reads that hit L2, the weights and seq_idx are noise.

Pass-through (PASS_THROUGH, the op's `pass_through`): the channels of x before and after the window (the
mixer's z and dt) are copied to arrays of their own, `before` and `after`, by blocks after the conv's on the
grid's channel axis (PASS_BLOCK_C channels each), so that the layer gets them as outputs of this launch and XLA
copies no slice of x. The copies are bandwidth the conv blocks, bound by their gathers' latency, leave unused
(the backward copies their cotangents the same way, causal_conv1d_bwd.py).

Grid: (cdiv(seqlen, BLOCK_L · SEGMENT_TILES), cdiv(channels, BLOCK_C) [+ cdiv(IN_OFFSET, PASS_BLOCK_C) + cdiv(after,
PASS_BLOCK_C) with PASS_THROUGH], batch).

Shapes: x (batch, seqlen, in_width) T in {bf16, f16, f32} with IN_OFFSET + channels <= in_width; y0, y1, y2
(batch, seqlen, width of the piece) T, dummies (1, 1, 1) past OUTPUTS; before (batch, seqlen, IN_OFFSET) and
after (batch, seqlen, in_width - IN_OFFSET - channels) T with PASS_THROUGH, dummies (1, 1, 1) without it or
for a width 0; weight (WIDTH, channels) and bias (channels,) f32 whatever T is (the op converts the parameters
to f32 without rounding them to x's dtype, as the reference and causal_conv1d's kernels take them);
initial_states (batch, channels, INIT_WIDTH) T (a dummy (1, 1, 1) without HAS_INIT); seq_idx (batch, seqlen)
int32 (a dummy (1, 1) without HAS_SEQ_IDX).
"""
import dataclasses
import numbers

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    INT32_MAX, Big, Buffer, ConstBool, ConstInt, Plan, index_width_variant, int64_index_kernels, is_power_of_2,
    kernel_launch, next_power_of_2, sigmoid)

# About two blocks per SM of an H100 / H200 (132 SMs): the default segments shorten to keep the grid at least
# this large.
MIN_BLOCKS = 256

CONV_INPUTS = ("x", "weight", "bias", "initial_states", "seq_idx")
# The pieces of the conv's output channels, at most this many (the mixer's x, B, C).
MAX_OUTPUTS = 3
CONV_OUTPUTS = tuple(f"y{i}" for i in range(MAX_OUTPUTS))
# x's channels before and after the window as arrays of their own (PASS_THROUGH): the forward's copies of them;
# the backward's cotangents of them are "d" + these.
OUTSIDE = ("before", "after")
# Channels per copy block of PASS_THROUGH: 8 per thread of 128, a 16-byte vector in bf16 (copies of the conv's
# 128 channels, 2 bytes per thread and instruction, did not hide behind the conv blocks of the backward).
PASS_BLOCK_C = 1024


@dataclasses.dataclass(frozen=True)
class ConvDims:
    """Static description of one conv problem (everything the kernels specialise on).

    The conv reads channels in_offset .. in_offset + channels - 1 of x (batch, seqlen, in_width) of `dtype`
    (in_width 0: x is (batch, seqlen, channels)), also the dtype of the initial states, the outputs and their
    cotangents (the weight and bias are float32 whatever it is: `conv_arrays`); `width` is d_conv (the number
    of taps); `init_width` the number of columns of initial_states (width - 1 or width; 0 without them);
    `split` the widths of the output pieces, summing to channels (empty: one output of all channels);
    `pass_through`: the forward also copies x's channels outside the window to arrays of their own, and the
    backward writes x's whole cotangent, theirs copied in.
    """

    batch: int
    seqlen: int
    channels: int
    width: int
    dtype: str = "bfloat16"
    init_width: int = 0
    has_seq_idx: bool = False
    silu: bool = True
    in_offset: int = 0
    in_width: int = 0
    split: tuple[int, ...] = ()
    pass_through: bool = False

    @property
    def has_init(self) -> bool:
        return self.init_width > 0

    @property
    def source_width(self) -> int:
        """The channels of x (the conv's and any others)."""
        return self.in_width or self.channels

    @property
    def outside_widths(self) -> tuple[int, int]:
        """The channels of x before and after the conv's window."""
        return self.in_offset, self.source_width - self.in_offset - self.channels

    @property
    def pieces(self) -> tuple[int, ...]:
        """The widths of the outputs."""
        return self.split or (self.channels,)

    @property
    def split_points(self) -> tuple[int, int]:
        """(SPLIT1, SPLIT2): where outputs 1 and 2 start (channels where there is none)."""
        starts = [sum(self.pieces[:i]) for i in range(1, MAX_OUTPUTS)]
        return tuple(starts[i] if i + 1 < len(self.pieces) else self.channels for i in range(MAX_OUTPUTS - 1))


def check_dims(api: str, dims: ConvDims) -> None:
    """Raises ValueError unless the channel layout fits: the read window inside x, 1 to MAX_OUTPUTS positive
    pieces summing to the channels."""
    if dims.in_offset < 0 or dims.in_offset + dims.channels > dims.source_width:
        raise ValueError(f"{api}: in_offset={dims.in_offset} + channels={dims.channels} must be within "
                         f"in_width={dims.source_width}")
    pieces = dims.pieces
    if not 1 <= len(pieces) <= MAX_OUTPUTS or min(pieces) < 1 or sum(pieces) != dims.channels:
        raise ValueError(f"{api}: split={dims.split} must be 1 to {MAX_OUTPUTS} positive widths summing to "
                         f"channels={dims.channels}")


def needs_int64_index(dims: ConvDims, partials: int = 0) -> bool:
    """Whether an array of the problem (x, or `partials` rows of per-block weight sums) has 2^31 or more
    elements, so that int32 element offsets could overflow."""
    largest = max(dims.batch * dims.seqlen * dims.source_width, max(partials, 1) * dims.width * dims.channels,
                  dims.batch * dims.channels * max(dims.init_width, 1))
    return largest > INT32_MAX


def piece_arrays(dims: ConvDims, prefix: str) -> dict[str, Buffer]:
    """The MAX_OUTPUTS arrays <prefix>0.. of the output pieces (batch, seqlen, width) in x's dtype, dummies
    (1, 1, 1) past the pieces."""
    widths = dims.pieces + (0,) * (MAX_OUTPUTS - len(dims.pieces))
    return {f"{prefix}{i}": Buffer((dims.batch, dims.seqlen, w) if w else (1, 1, 1), dims.dtype)
            for i, w in enumerate(widths)}


def outside_arrays(dims: ConvDims, prefix: str = "") -> dict[str, Buffer]:
    """The arrays <prefix>before and <prefix>after of x's channels outside the window, (batch, seqlen, width) in
    x's dtype with `dims.pass_through`, dummies (1, 1, 1) without it or for a width 0."""
    return {prefix + name: Buffer((dims.batch, dims.seqlen, w) if dims.pass_through and w else (1, 1, 1), dims.dtype)
            for name, w in zip(OUTSIDE, dims.outside_widths)}


def channel_blocks(dims: ConvDims, block_c: int) -> int:
    """The grid's channel axis: the conv's blocks of block_c channels, then with pass_through the copy blocks of
    the channels before and after the window."""
    blocks = -(-dims.channels // block_c)
    if dims.pass_through:
        blocks += sum(-(-w // PASS_BLOCK_C) for w in dims.outside_widths)
    return blocks


def conv_arrays(dims: ConvDims) -> dict[str, Buffer]:
    """Shape and dtype of each plan input as the bridge passes it (dummies for absent options): the weight and
    bias in float32 whatever x's dtype is (not rounded to it), the others in x's (seq_idx int32)."""
    b, L, C, T = dims.batch, dims.seqlen, dims.channels, dims.dtype
    return {
        "x": Buffer((b, L, dims.source_width), T),
        "weight": Buffer((dims.width, C), "float32"),
        "bias": Buffer((C,), "float32"),
        "initial_states": Buffer((b, C, dims.init_width) if dims.has_init else (1, 1, 1), T),
        "seq_idx": Buffer((b, L) if dims.has_seq_idx else (1, 1), "int32"),
    }


# ----------------------------------------------------------------------------------------------
# Device helpers (shared with causal_conv1d_bwd.py)
# ----------------------------------------------------------------------------------------------

def token_rows(x, b, first, count, cols):
    """x[b, t, cols] of tokens t = first .. first + count - 1 as a tuple of [BLOCK_C] tiles in x's dtype, 0
    where t or a channel lies outside x (t < 0 is the left padding): one vector load per thread and row."""
    rows = ()
    for j in ct.static_iter(range(count)):
        rows += (ct.gather(x, (b, first + j, cols)),)
    return rows


def copy_rows(src, dst, b, first, count, src_cols, dst_cols, inside):
    """dst[b, t, dst_cols] = src[b, t, src_cols] for tokens first .. first + count - 1 (all loads first), where
    `inside`; tokens past seqlen are dropped."""
    rows = token_rows(src, b, first, count, src_cols)
    for j in ct.static_iter(range(count)):
        ct.scatter(dst, (b, first + j, dst_cols), rows[j], mask=inside)


def copy_outside(x, before, after, block, channels, b, first, count, IN_OFFSET, INTO_X):
    """Copies tokens first .. first + count - 1 of one PASS_BLOCK_C-wide block of x's channels outside the window
    (`block` counts those before the window first, then those after it) from x to before / after, or with
    INTO_X from before / after into x (the backward's cotangents)."""
    lanes = ct.arange(PASS_BLOCK_C, dtype=ct.int32)
    before_blocks = (IN_OFFSET + PASS_BLOCK_C - 1) // PASS_BLOCK_C
    if block < before_blocks:
        cols = block * PASS_BLOCK_C + lanes
        if INTO_X:
            copy_rows(before, x, b, first, count, cols, cols, cols < IN_OFFSET)
        else:
            copy_rows(x, before, b, first, count, cols, cols, cols < IN_OFFSET)
    else:
        cols = (block - before_blocks) * PASS_BLOCK_C + lanes
        if INTO_X:
            copy_rows(after, x, b, first, count, cols, cols + IN_OFFSET + channels, cols < after.shape[2])
        else:
            copy_rows(x, after, b, first, count, cols + IN_OFFSET + channels, cols, cols < after.shape[2])


def last_rows(rows, count, total):
    """The last `count` entries of a tuple of `total` entries."""
    tail = ()
    for j in ct.static_iter(range(total - count, total)):
        tail += (rows[j],)
    return tail


def copy_outside_segment(x, before, after, block, channels, first, stop, IN_OFFSET, BLOCK_L, INTO_X):
    """`copy_outside` for tokens first .. stop - 1 of a segment, BLOCK_L at a time (tokens past seqlen dropped)."""
    for i in range(ct.cdiv(stop - first, BLOCK_L)):
        copy_outside(x, before, after, block, channels, ct.bid(2), first + i * BLOCK_L, BLOCK_L, IN_OFFSET, INTO_X)


def widened(rows):
    """A tuple of tiles cast to f32."""
    wide = ()
    for row in ct.static_iter(rows):
        wide += (row.astype(ct.float32),)
    return wide


def halo_rows(x, initial_states, b, first, count, x_cols, cols, HAS_INIT, INIT_WIDTH):
    """The rows of tokens first .. first + count - 1 of x̃ (x left-extended by the initial states' last
    columns) as a tuple of f32 [BLOCK_C] tiles, channels `cols` (x's channels `x_cols`). A token t < 0 reads
    initial_states[b, cols, INIT_WIDTH + t] (x's gather is 0 there, and the states' is 0 for t >= 0, so the
    two add up without a branch)."""
    rows = widened(token_rows(x, b, first, count, x_cols))
    if HAS_INIT:
        extended = ()
        for j in ct.static_iter(range(count)):
            state = ct.gather(initial_states, (b, cols, INIT_WIDTH + first + j)).astype(ct.float32)
            extended += (rows[j] + state,)
        rows = extended
    return rows


def piece_rows(y0, y1, y2, b, first, count, cols, OUTPUTS, SPLIT1, SPLIT2, BLOCK_C):
    """`token_rows` of the conv's channels `cols` (the block's, from ct.bid(1) * BLOCK_C) stored as pieces:
    channel c < SPLIT1 in y0, < SPLIT2 in y1 (at c - SPLIT1), else in y2 (at c - SPLIT2). A piece outside
    the block's channels is not read; where the block straddles a split, each piece's gather is 0 outside
    its own channels (out of bounds), so the sum of the pieces' rows is exact."""
    if OUTPUTS == 1:
        return token_rows(y0, b, first, count, cols)
    c0 = ct.bid(1) * BLOCK_C
    rows = ()
    for _ in ct.static_iter(range(count)):
        rows += (ct.zeros((BLOCK_C,), y0.dtype),)
    for i in ct.static_iter(range(OUTPUTS)):
        y, lo, hi = _piece(y0, y1, y2, i, SPLIT1, SPLIT2)
        if c0 < hi:
            if c0 + BLOCK_C > lo:
                summed = ()
                for j in ct.static_iter(range(count)):
                    summed += (rows[j] + ct.gather(y, (b, first + j, cols - lo)),)
                rows = summed
    return rows


def scatter_pieces(y0, y1, y2, b, first, rows, cols, OUTPUTS, SPLIT1, SPLIT2, BLOCK_C):
    """Stores rows (tokens first, first + 1, ... of channels `cols`, the block's) into the pieces y0, y1, y2
    (see `piece_rows`); tokens past seqlen and channels past a piece fall outside it and are dropped."""
    if OUTPUTS == 1:
        for r in ct.static_iter(range(len(rows))):
            ct.scatter(y0, (b, first + r, cols), rows[r].astype(y0.dtype))
    else:
        c0 = ct.bid(1) * BLOCK_C
        for i in ct.static_iter(range(OUTPUTS)):
            y, lo, hi = _piece(y0, y1, y2, i, SPLIT1, SPLIT2)
            if c0 < hi:
                if c0 + BLOCK_C > lo:
                    # Channels of an earlier piece have negative indices here: masked rather than left to
                    # the bounds check.
                    for r in ct.static_iter(range(len(rows))):
                        ct.scatter(y, (b, first + r, cols - lo), rows[r].astype(y.dtype), mask=cols >= lo)


def _piece(y0, y1, y2, i, SPLIT1, SPLIT2):
    """(array, first channel, end channel) of piece i (a compile-time index); the last piece's end is past
    every channel, its array's bounds end it."""
    if i == 0:
        return y0, 0, SPLIT1
    if i == 1:
        return y1, SPLIT1, SPLIT2
    return y2, SPLIT2, INT32_MAX


def token_ids(seq_idx, b, first, count):
    """The sequence ids of tokens first .. first + count - 1 as a tuple of int32 scalars, -1 outside x."""
    ids = ()
    for j in ct.static_iter(range(count)):
        ids += (ct.gather(seq_idx, (b, first + j), padding_value=-1),)
    return ids


def weight_rows(weight, cols, WIDTH):
    """The WIDTH taps weight[k, cols] of the f32 weight as a tuple of [BLOCK_C] tiles."""
    taps = ()
    for k in ct.static_iter(range(WIDTH)):
        taps += (ct.gather(weight, (k, cols)),)
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

def _conv_fwd_rows(rows, ids, weights, bias_row, WIDTH, BLOCK_L, HAS_SEQ_IDX, SILU):
    """Output rows r < BLOCK_L of a window (`rows` and `ids` start WIDTH - 1 tokens before the first output),
    f32 [BLOCK_C] tiles."""
    outs = ()
    for r in ct.static_iter(range(BLOCK_L)):
        pre = preactivation(masked_taps(rows, ids, r, WIDTH, HAS_SEQ_IDX), weights, bias_row, WIDTH)
        outs += (pre * sigmoid(pre) if SILU else pre,)
    return outs


def _conv_fwd_body(x, weight, bias, initial_states, seq_idx, y0, y1, y2, WIDTH, INIT_WIDTH, IN_OFFSET, OUTPUTS,
                   SPLIT1, SPLIT2, BLOCK_L, SEGMENT_TILES, BLOCK_C, HAS_INIT, HAS_SEQ_IDX, SILU):
    b = ct.bid(2)
    cols = ct.bid(1) * BLOCK_C + ct.arange(BLOCK_C, dtype=ct.int32)
    x_cols = cols + IN_OFFSET
    HALO = WIDTH - 1
    start = ct.bid(0) * (SEGMENT_TILES * BLOCK_L)

    halo = halo_rows(x, initial_states, b, start - HALO, HALO, x_cols, cols, HAS_INIT, INIT_WIDTH)
    id_halo = ()
    if HAS_SEQ_IDX:
        id_halo = token_ids(seq_idx, b, start - HALO, HALO)
    next_x = token_rows(x, b, start, BLOCK_L, x_cols)
    next_ids = ()
    if HAS_SEQ_IDX:
        next_ids = token_ids(seq_idx, b, start, BLOCK_L)
    weights = weight_rows(weight, cols, WIDTH)
    bias_row = ct.gather(bias, cols)

    if SEGMENT_TILES == 1:  # one tile per block: its rows and halo gathered at once
        outs = _conv_fwd_rows(halo + widened(next_x), id_halo + next_ids, weights, bias_row, WIDTH, BLOCK_L,
                              HAS_SEQ_IDX, SILU)
        scatter_pieces(y0, y1, y2, b, start, outs, cols, OUTPUTS, SPLIT1, SPLIT2, BLOCK_C)
    else:
        # A segment of tiles in steps: each step's rows are gathered while the step before computes and stores
        # (its stores end in barriers that no load is hoisted across), and the halo is carried in registers
        # rather than gathered again.
        seqlen = x.shape[1]
        steps = ct.cdiv(ct.minimum(start + SEGMENT_TILES * BLOCK_L, seqlen) - start, BLOCK_L)
        for i in range(steps):
            t0 = start + i * BLOCK_L
            rows = halo + widened(next_x)
            ids = id_halo + next_ids
            # The last step's prefetch points past seqlen, where the gathers load nothing.
            ahead = t0 + BLOCK_L + (i + 1) // steps * seqlen
            next_x = token_rows(x, b, ahead, BLOCK_L, x_cols)
            if HAS_SEQ_IDX:
                next_ids = token_ids(seq_idx, b, ahead, BLOCK_L)
            outs = _conv_fwd_rows(rows, ids, weights, bias_row, WIDTH, BLOCK_L, HAS_SEQ_IDX, SILU)
            scatter_pieces(y0, y1, y2, b, t0, outs, cols, OUTPUTS, SPLIT1, SPLIT2, BLOCK_C)
            halo = last_rows(rows, HALO, BLOCK_L + HALO)
            if HAS_SEQ_IDX:
                id_halo = last_rows(ids, HALO, BLOCK_L + HALO)


def causal_conv1d_fwd_kernel(
    x: Big,                # (batch, seqlen, in_width) T: channels IN_OFFSET .. IN_OFFSET + channels - 1 read
    weight,                # (WIDTH, channels) f32
    bias,                  # (channels,) f32
    initial_states: Big,   # (batch, channels, INIT_WIDTH) T, or a dummy
    seq_idx,               # (batch, seqlen) int32, or a dummy
    y0: Big,               # (batch, seqlen, SPLIT1) T, written: channels [0, SPLIT1)
    y1: Big,               # (batch, seqlen, SPLIT2 - SPLIT1) T, written (OUTPUTS > 1), or a dummy
    y2: Big,               # (batch, seqlen, channels - SPLIT2) T, written (OUTPUTS == 3), or a dummy
    before: Big,           # (batch, seqlen, IN_OFFSET) T, written (PASS_THROUGH, IN_OFFSET > 0), or a dummy
    after: Big,            # (batch, seqlen, in_width - IN_OFFSET - channels) T, written (PASS_THROUGH), or a dummy
    WIDTH: ConstInt,
    INIT_WIDTH: ConstInt,
    IN_OFFSET: ConstInt,
    OUTPUTS: ConstInt,
    SPLIT1: ConstInt,
    SPLIT2: ConstInt,
    BLOCK_L: ConstInt,
    SEGMENT_TILES: ConstInt,  # tiles of BLOCK_L tokens per block, walked in steps (1: one tile)
    BLOCK_C: ConstInt,
    HAS_INIT: ConstBool,
    HAS_SEQ_IDX: ConstBool,
    SILU: ConstBool,
    PASS_THROUGH: ConstBool,
):
    # The copy blocks exist only with PASS_THROUGH: without it their code (gathers from the dummies) is not
    # compiled at all, since it would take a shared-memory layout change that sizes every block's footprint.
    conv_blocks = ct.cdiv(weight.shape[1], BLOCK_C)
    if PASS_THROUGH and ct.bid(1) >= conv_blocks:
        first = ct.bid(0) * (SEGMENT_TILES * BLOCK_L)
        if SEGMENT_TILES == 1:  # one tile, without the segment's loop: the one-tile build's code as it was
            copy_outside(x, before, after, ct.bid(1) - conv_blocks, weight.shape[1], ct.bid(2), first, BLOCK_L,
                         IN_OFFSET, False)
        else:
            copy_outside_segment(x, before, after, ct.bid(1) - conv_blocks, weight.shape[1], first,
                                 ct.minimum(first + SEGMENT_TILES * BLOCK_L, x.shape[1]), IN_OFFSET, BLOCK_L, False)
    else:
        _conv_fwd_body(x, weight, bias, initial_states, seq_idx, y0, y1, y2, WIDTH, INIT_WIDTH, IN_OFFSET, OUTPUTS,
                       SPLIT1, SPLIT2, BLOCK_L, SEGMENT_TILES, BLOCK_C, HAS_INIT, HAS_SEQ_IDX, SILU)


# (int32-indexed, int64-indexed) entries of the one body; the occupancy hint comes from the config.
CONV_FWD_KERNELS = int64_index_kernels(causal_conv1d_fwd_kernel)


@dataclasses.dataclass(frozen=True)
class ConvFwdConfig:
    """Tile of `causal_conv1d_fwd_kernel`: BLOCK_L tokens (unrolled rows) x BLOCK_C channels (powers of two),
    the occupancy hint (blocks per SM the compiler budgets registers for), and SEGMENT_TILES, the tiles a block
    walks in steps (1: a block per tile, its rows and their WIDTH - 1 halo rows gathered at once; more: each
    step's rows gathered during the step before, the halo carried from step to step, fewer blocks)."""

    BLOCK_L: int
    BLOCK_C: int
    OCCUPANCY: int = 3
    SEGMENT_TILES: int = 1

    def __post_init__(self):
        check_tile_fields("ConvFwdConfig", self, powers_of_two=("BLOCK_C",))


def check_tile_fields(api: str, config, powers_of_two: tuple[str, ...]) -> None:
    """Checks every field of `config` (a frozen dataclass of tile sizes and counts): TypeError for one that is not
    an integer (a NumPy integer is stored as an int), ValueError for one below 1 or, among `powers_of_two` (tile
    dimensions), one that is not a power of two."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{api}: {field.name}={value!r} must be an int")
        object.__setattr__(config, field.name, int(value))
        if value < 1:
            raise ValueError(f"{api}: {field.name}={value} must be at least 1")
        if field.name in powers_of_two and not is_power_of_2(int(value)):
            raise ValueError(f"{api}: {field.name}={value} must be a power of two")


def default_segment_tiles(dims: ConvDims, block_l: int, block_c: int, tiles: int) -> int:
    """`tiles` steps of block_l tokens per block, halved (down to one) while the grid has fewer than MIN_BLOCKS
    blocks of block_c channels: a segment's steps overlap one another's loads and stores, but short or few
    sequences need the blocks."""
    rows = dims.batch * -(-dims.channels // block_c)
    while tiles > 1 and rows * -(-dims.seqlen // (tiles * block_l)) < MIN_BLOCKS:
        tiles //= 2
    return tiles


def conv_fwd_default_config(dims: ConvDims) -> ConvFwdConfig:
    """Segments of 16 steps of 8 rows of up to 512 channels (fewer steps while the grid would be small,
    `default_segment_tiles`): 4 channels per thread of the block's 128, one 8-byte load per row at bf16 (16 bytes
    at f32), each step's gathers issued before the previous step's stores, at most 128 registers and no shared
    or local memory at d_conv 4 (tileiras 13.4, sm_90), within the occupancy hint of 4 blocks per SM: faster in
    the LM's step than one tile of 16 rows per block at occupancy 3, which a grid too small for segments keeps
    (docs/conv1d.md, "Segments for the forward", has the timings). Fewer channels take a narrower tile (at least 16)."""
    block_c = min(512, max(16, next_power_of_2(dims.channels)))
    tiles = default_segment_tiles(dims, 8, block_c, 16)
    if tiles == 1:
        return ConvFwdConfig(BLOCK_L=16, BLOCK_C=block_c, OCCUPANCY=3)
    return ConvFwdConfig(BLOCK_L=8, BLOCK_C=block_c, OCCUPANCY=4, SEGMENT_TILES=tiles)


def conv_fwd_grid(dims: ConvDims, cfg: ConvFwdConfig) -> tuple[int, int, int]:
    return (-(-dims.seqlen // (cfg.BLOCK_L * cfg.SEGMENT_TILES)), channel_blocks(dims, cfg.BLOCK_C), dims.batch)


def conv_fwd_plan(dims: ConvDims, cfg: ConvFwdConfig | None = None) -> Plan:
    """The forward for `dims`: inputs CONV_INPUTS (see `conv_arrays`), outputs y0 .. (one per piece of
    `dims.pieces`, (batch, seqlen, width) in x's dtype), then with `dims.pass_through` before and after (those
    of width > 0: x's channels before and after the window)."""
    cfg = cfg or conv_fwd_default_config(dims)
    check_dims("conv_fwd_plan", dims)
    split1, split2 = dims.split_points
    launch = kernel_launch(
        index_width_variant(CONV_FWD_KERNELS, needs_int64_index(dims), occupancy=cfg.OCCUPANCY),
        conv_fwd_grid(dims, cfg), writes=CONV_OUTPUTS + OUTSIDE,  # the dummies too: every array needs a buffer
        WIDTH=dims.width, INIT_WIDTH=dims.init_width, IN_OFFSET=dims.in_offset, OUTPUTS=len(dims.pieces),
        SPLIT1=split1, SPLIT2=split2, BLOCK_L=cfg.BLOCK_L, SEGMENT_TILES=cfg.SEGMENT_TILES, BLOCK_C=cfg.BLOCK_C,
        HAS_INIT=dims.has_init, HAS_SEQ_IDX=dims.has_seq_idx, SILU=dims.silu, PASS_THROUGH=dims.pass_through)
    outside = tuple(name for name, w in zip(OUTSIDE, dims.outside_widths) if dims.pass_through and w)
    return Plan(inputs=CONV_INPUTS, buffers={**piece_arrays(dims, "y"), **outside_arrays(dims)}, launches=(launch,),
                outputs=CONV_OUTPUTS[:len(dims.pieces)] + outside)
