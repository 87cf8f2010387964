"""The backward of the causal depthwise conv1d (+ SiLU): dx, dweight, dbias and d initial_states.

With the notation of causal_conv1d.py (K = WIDTH taps, x̃ the left-extended input, masks m_k[t]) and
g[t, c] = dy[t, c] · silu'(pre[t, c]) (g = dy without SILU), silu'(p) = σ(p) (1 + p (1 - σ(p))):

    dx̃[s, c]       = Σ_k weight[k, c] · g[s + K - 1 - k, c] · m_k[s + K - 1 - k]   (s < 0: d initial_states)
    dweight[k, c] = Σ_{b, t} g[t, c] · x̃[t - K + 1 + k, c] · m_k[t]
    dbias[c]      = Σ_{b, t} g[t, c]

The pre-activation is recomputed from x rather than saved: dweight needs x anyway, so saving it would only
add bytes. Bytes (the floor): x and dy read once, dx written once, 3 · itemsize(x) per element, 226 MB
(47 µs at 4.8 TB/s) at (8, 2048, 2304) bf16; the per-block weight partials add
batch · cdiv(seqlen, SEGMENT) · (K + 1) · channels f32 (3 MB there).

Layout. A block owns SEGMENT = SEGMENT_TILES · BLOCK_L tokens of BLOCK_C channels of one batch row and walks
them BLOCK_L rows at a time (rows as tuples of [BLOCK_C] tiles, as in the forward). It computes g of each
token once and carries, from one step to the next, the last K - 1 rows of x̃, of their ids and of g, so
that dx lags g by K - 1 tokens: step i writes dx of tokens t0 - K + 1 .. t0 + BLOCK_L - K. The lagging rows
of the first step belong to the previous segment and are not written, except in segment 0, where they are
the tokens -K + 1 .. -1: d initial_states. After the last step the block recomputes g of the K - 1 tokens
after its segment (not summed into dweight) for the dx of its last K - 1 tokens. dweight and dbias
accumulate in f32 over the segment and are written as one partial per block; `conv_grads_reduce_kernel`
sums the partials in a fixed order (deterministic, no atomics).

The layout of the forward (causal_conv1d.py): x's channels IN_OFFSET .., and dy in up to three pieces
dy0, dy1, dy2 (the cotangents of the forward's y0, y1, y2, split at SPLIT1, SPLIT2); dx is one array of the
conv's channels. With PASS_THROUGH, dx is x's whole cotangent (batch, seqlen, in_width): the conv's dx in
channels IN_OFFSET .., and the cotangents `dbefore` and `dafter` of the channels before and after the window
(which the op passes through unchanged, the mixer's z and dt) copied into the rest, by copy blocks as in the
forward (causal_conv1d.py, Pass-through). XLA would otherwise pad the three cotangents to in_width and add
them: a read and a write of the whole width more.

Grids: (cdiv(seqlen, SEGMENT), cdiv(channels, BLOCK_C) [+ cdiv(IN_OFFSET, PASS_BLOCK_C) + cdiv(after,
PASS_BLOCK_C) with PASS_THROUGH], batch) and (cdiv(channels, BLOCK_C), items).

Shapes: x (batch, seqlen, in_width) T; dy0, dy1, dy2 as the forward's y0, y1, y2; dbefore (batch, seqlen,
IN_OFFSET) and dafter (batch, seqlen, in_width - IN_OFFSET - channels) T, or dummies (1, 1, 1) (without
PASS_THROUGH, or a width 0); dx (batch, seqlen, channels), with PASS_THROUGH (batch, seqlen, in_width), T;
weight (WIDTH, channels), bias (channels,) f32 (as the forward takes them, not rounded to T); initial_states
(batch, channels, INIT_WIDTH) T or a dummy;
seq_idx (batch, seqlen) int32 or a dummy; dinitial_states (batch, channels, INIT_WIDTH) f32 (zero-initialised;
a dummy (1, 1, 1) without HAS_INIT); dweight_partials (partials, WIDTH, channels) and dbias_partials
(partials, channels) f32 with partials = batch · segments;
dweight (items, WIDTH, channels) and dbias (items, channels) f32, item i summing the partials of batch rows
[i · batch / items, (i + 1) · batch / items) (items > 1 under vmap).
"""
import dataclasses

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    Big, Buffer, ConstBool, ConstInt, Plan, index_width_variant, int64_index_kernels, kernel_launch, next_power_of_2,
    sigmoid)
from jax_mamba2.kernels.causal_conv1d import (
    CONV_INPUTS, MAX_OUTPUTS, OUTSIDE, ConvDims, channel_blocks, check_dims, check_tile_fields,
    conv_arrays, copy_outside_segment, default_segment_tiles, halo_rows, last_rows, masked_taps, needs_int64_index,
    outside_arrays, piece_arrays, piece_rows, preactivation, token_ids, token_rows, weight_rows, widened)

COTANGENTS = tuple(f"dy{i}" for i in range(MAX_OUTPUTS))
# The cotangents of x's channels before and after the conv's window (PASS_THROUGH).
PASSED_COTANGENTS = tuple("d" + name for name in OUTSIDE)
CONV_BWD_INPUTS = (*CONV_INPUTS, *COTANGENTS, *PASSED_COTANGENTS)
CONV_BWD_OUTPUTS = ("dx", "dweight", "dbias", "dinitial_states")
# The reduction of the weight partials loads up to this many partials at once (16 x 4 taps x 32 channels f32:
# 16 registers per thread of 128).
MAX_PART_TILE = 16
# Channels per block of that reduction: the partials are few, so its time is its loads' latency, which more
# blocks hide (72 blocks for 2304 channels).
REDUCE_BLOCK_C = 32


def _zero_rows(count, BLOCK_C):
    rows = ()
    for _ in ct.static_iter(range(count)):
        rows += (ct.zeros((BLOCK_C,), ct.float32),)
    return rows


def _first(rows, count):
    """The first `count` entries of a tuple."""
    head = ()
    for j in ct.static_iter(range(count)):
        head += (rows[j],)
    return head


def _output_grads(rows, ids, dys, weights, bias_row, count, dweight, dbias, ACCUMULATE, WIDTH, HAS_SEQ_IDX,
                  SILU):
    """g of output rows r < count of a window (`rows` and `ids` start WIDTH - 1 tokens before the first
    output; dys[r] is dy of output r), and with ACCUMULATE dweight, dbias plus this window's terms."""
    gs = ()
    for r in ct.static_iter(range(count)):
        taps = masked_taps(rows, ids, r, WIDTH, HAS_SEQ_IDX)
        g = dys[r]
        if SILU:
            pre = preactivation(taps, weights, bias_row, WIDTH)
            s = sigmoid(pre)
            g = g * s * (1.0 + pre * (1.0 - s))
        gs += (g,)
        if ACCUMULATE:
            summed = ()
            for k in ct.static_iter(range(WIDTH)):
                summed += (dweight[k] + g * taps[k],)
            dweight = summed
            dbias = dbias + g
    return gs, dweight, dbias


def _input_grads(gs, ids, weights, count, WIDTH, HAS_SEQ_IDX):
    """dx̃ of rows r < count: Σ_k weight[k] · gs[r + WIDTH - 1 - k], where gs[j] is g of the window's token
    j (row r's token is the window's token r; ids aligned with gs)."""
    dxs = ()
    for r in ct.static_iter(range(count)):
        acc = ct.zeros(weights[0].shape, ct.float32)
        for k in ct.static_iter(range(WIDTH)):
            g = gs[r + WIDTH - 1 - k]
            if HAS_SEQ_IDX:
                g = ct.where(ids[r + WIDTH - 1 - k] == ids[r], g, 0.0)
            acc = acc + weights[k] * g
        dxs += (acc,)
    return dxs


def _conv_bwd_body(x, weight, bias, initial_states, seq_idx, dy0, dy1, dy2, dx, dinitial_states,
                   dweight_partials, dbias_partials, WIDTH, INIT_WIDTH, IN_OFFSET, OUTPUTS, SPLIT1, SPLIT2,
                   BLOCK_L, SEGMENT_TILES, BLOCK_C, HAS_INIT, HAS_SEQ_IDX, SILU, PASS_THROUGH):
    seg = ct.bid(0)
    b = ct.bid(2)
    cols = ct.bid(1) * BLOCK_C + ct.arange(BLOCK_C, dtype=ct.int32)
    # dx's channels: the window's within x's whole width with PASS_THROUGH; the mask keeps a block's channels
    # past the conv's out of the channels after the window.
    dx_cols = cols
    if PASS_THROUGH:
        dx_cols = cols + IN_OFFSET
    in_window = cols < weight.shape[1]
    seqlen = x.shape[1]
    HALO = WIDTH - 1
    start = seg * (SEGMENT_TILES * BLOCK_L)

    weights = weight_rows(weight, cols, WIDTH)
    bias_row = ct.gather(bias, cols)
    # Carried from step to step: x̃, ids and g of the HALO tokens before the step's first.
    x_cols = cols + IN_OFFSET
    x_halo = halo_rows(x, initial_states, b, start - HALO, HALO, x_cols, cols, HAS_INIT, INIT_WIDTH)
    id_halo = ()
    if HAS_SEQ_IDX:
        id_halo = token_ids(seq_idx, b, start - HALO, HALO)
    g_halo = _zero_rows(HALO, BLOCK_C)  # g of tokens before the segment: only segment 0's lag rows use them
    dweight = _zero_rows(WIDTH, BLOCK_C)
    dbias = ct.zeros((BLOCK_C,), ct.float32)

    steps = ct.cdiv(ct.minimum(start + SEGMENT_TILES * BLOCK_L, seqlen) - start, BLOCK_L)
    # Each step's x, dy (and ids) are loaded one step ahead, so that their latency overlaps the compute of
    # the step before (the stores of a step end in barriers, which no load is hoisted across).
    next_x = token_rows(x, b, start, BLOCK_L, x_cols)
    next_dy = piece_rows(dy0, dy1, dy2, b, start, BLOCK_L, cols, OUTPUTS, SPLIT1, SPLIT2, BLOCK_C)
    next_ids = ()
    if HAS_SEQ_IDX:
        next_ids = token_ids(seq_idx, b, start, BLOCK_L)
    for i in range(steps):
        t0 = start + i * BLOCK_L
        rows = x_halo + widened(next_x)
        dys = widened(next_dy)
        ids = id_halo + next_ids
        next_x = token_rows(x, b, t0 + BLOCK_L, BLOCK_L, x_cols)
        next_dy = piece_rows(dy0, dy1, dy2, b, t0 + BLOCK_L, BLOCK_L, cols, OUTPUTS, SPLIT1, SPLIT2, BLOCK_C)
        if HAS_SEQ_IDX:
            next_ids = token_ids(seq_idx, b, t0 + BLOCK_L, BLOCK_L)
        gs, dweight, dbias = _output_grads(rows, ids, dys, weights, bias_row, BLOCK_L, dweight, dbias, True,
                                           WIDTH, HAS_SEQ_IDX, SILU)
        gs = g_halo + gs
        dxs = _input_grads(gs, ids, weights, BLOCK_L, WIDTH, HAS_SEQ_IDX)
        for r in ct.static_iter(range(BLOCK_L)):
            s = t0 - HALO + r
            if r < HALO:
                # Lagging rows: the previous segment's tokens on the first step (not written), or in segment 0
                # the tokens before the sequence, whose dx̃ is d initial_states (outside it for s >= 0).
                ct.scatter(dx, (b, s, dx_cols), dxs[r].astype(dx.dtype), mask=in_window & (s >= start))
                if HAS_INIT:
                    ct.scatter(dinitial_states, (b, cols, INIT_WIDTH + s), dxs[r])
            else:
                ct.scatter(dx, (b, s, dx_cols), dxs[r].astype(dx.dtype), mask=in_window)
        x_halo = last_rows(rows, HALO, BLOCK_L + HALO)
        if HAS_SEQ_IDX:
            id_halo = last_rows(ids, HALO, BLOCK_L + HALO)
        g_halo = last_rows(gs, HALO, BLOCK_L + HALO)

    # dx of the last HALO tokens of the steps needs g of the HALO tokens after them (0 past seqlen), the
    # first rows of the prefetched step. The steps cover whole BLOCK_L rows, past seqlen in the last segment
    # (where g is 0 and dx is dropped).
    stop = start + steps * BLOCK_L
    rows = x_halo + widened(_first(next_x, HALO))
    ids = id_halo
    if HAS_SEQ_IDX:
        ids = id_halo + _first(next_ids, HALO)
    gs, dweight, dbias = _output_grads(rows, ids, widened(_first(next_dy, HALO)), weights, bias_row, HALO,
                                       dweight, dbias, False, WIDTH, HAS_SEQ_IDX, SILU)
    dxs = _input_grads(g_halo + gs, ids, weights, HALO, WIDTH, HAS_SEQ_IDX)
    for r in ct.static_iter(range(HALO)):
        ct.scatter(dx, (b, stop - HALO + r, dx_cols), dxs[r].astype(dx.dtype), mask=in_window)

    part = b * ct.num_blocks(0) + seg
    for k in ct.static_iter(range(WIDTH)):
        ct.scatter(dweight_partials, (part, k, cols), dweight[k])
    ct.scatter(dbias_partials, (part, cols), dbias)


def causal_conv1d_bwd_kernel(
    x: Big,                 # (batch, seqlen, in_width) T: channels IN_OFFSET .. IN_OFFSET + channels - 1 read
    weight,                 # (WIDTH, channels) f32
    bias,                   # (channels,) f32
    initial_states: Big,    # (batch, channels, INIT_WIDTH) T, or a dummy
    seq_idx,                # (batch, seqlen) int32, or a dummy
    dy0: Big,               # (batch, seqlen, SPLIT1) T: dy of channels [0, SPLIT1)
    dy1: Big,               # (batch, seqlen, SPLIT2 - SPLIT1) T (OUTPUTS > 1), or a dummy
    dy2: Big,               # (batch, seqlen, channels - SPLIT2) T (OUTPUTS == 3), or a dummy
    dbefore: Big,           # (batch, seqlen, IN_OFFSET) T (PASS_THROUGH, IN_OFFSET > 0), or a dummy
    dafter: Big,            # (batch, seqlen, in_width - IN_OFFSET - channels) T (PASS_THROUGH), or a dummy
    dx: Big,                # (batch, seqlen, channels), with PASS_THROUGH (batch, seqlen, in_width) T, written
    dinitial_states: Big,   # (batch, channels, INIT_WIDTH) f32, zero-initialised, written; or a dummy
    dweight_partials: Big,  # (partials, WIDTH, channels) f32, written
    dbias_partials: Big,    # (partials, channels) f32, written
    WIDTH: ConstInt,
    INIT_WIDTH: ConstInt,
    IN_OFFSET: ConstInt,
    OUTPUTS: ConstInt,
    SPLIT1: ConstInt,
    SPLIT2: ConstInt,
    BLOCK_L: ConstInt,
    SEGMENT_TILES: ConstInt,
    BLOCK_C: ConstInt,
    HAS_INIT: ConstBool,
    HAS_SEQ_IDX: ConstBool,
    SILU: ConstBool,
    PASS_THROUGH: ConstBool,
):
    conv_blocks = ct.cdiv(weight.shape[1], BLOCK_C)
    if PASS_THROUGH and ct.bid(1) >= conv_blocks:  # copy blocks compiled only with PASS_THROUGH, as forward
        first = ct.bid(0) * (SEGMENT_TILES * BLOCK_L)
        copy_outside_segment(dx, dbefore, dafter, ct.bid(1) - conv_blocks, weight.shape[1], first,
                             ct.minimum(first + SEGMENT_TILES * BLOCK_L, dx.shape[1]), IN_OFFSET, BLOCK_L, True)
    else:
        _conv_bwd_body(x, weight, bias, initial_states, seq_idx, dy0, dy1, dy2, dx, dinitial_states,
                       dweight_partials, dbias_partials, WIDTH, INIT_WIDTH, IN_OFFSET, OUTPUTS, SPLIT1, SPLIT2,
                       BLOCK_L, SEGMENT_TILES, BLOCK_C, HAS_INIT, HAS_SEQ_IDX, SILU, PASS_THROUGH)


def _conv_grads_reduce_body(dweight_partials, dbias_partials, dweight, dbias, WIDTH_TILE, PART_TILE, BLOCK_C):
    cb = ct.bid(0)
    item = ct.bid(1)
    # PART_TILE partials per load, summed in a fixed order: the loop is as many loads deep as the partials
    # over PART_TILE, not as the partials (one dependent load per partial left the reduction latency-bound).
    tiles = dweight_partials.shape[0] // (dweight.shape[0] * PART_TILE)
    dw = ct.zeros((WIDTH_TILE, BLOCK_C), ct.float32)
    db = ct.zeros((BLOCK_C,), ct.float32)
    for p in range(item * tiles, (item + 1) * tiles):
        dw = dw + ct.sum(ct.load(dweight_partials, index=(p, 0, cb), shape=(PART_TILE, WIDTH_TILE, BLOCK_C),
                                 padding_mode=ct.PaddingMode.ZERO), axis=0)
        db = db + ct.sum(ct.load(dbias_partials, index=(p, cb), shape=(PART_TILE, BLOCK_C),
                                 padding_mode=ct.PaddingMode.ZERO), axis=0)
    # Rows past WIDTH (WIDTH_TILE is its power of two) fall outside dweight and are dropped.
    ct.store(dweight, index=(item, 0, cb), tile=dw.reshape((1, WIDTH_TILE, BLOCK_C)))
    ct.store(dbias, index=(item, cb), tile=db.reshape((1, BLOCK_C)))


def conv_grads_reduce_kernel(
    dweight_partials: Big,  # (partials, WIDTH, channels) f32
    dbias_partials: Big,    # (partials, channels) f32
    dweight,                # (items, WIDTH, channels) f32, written
    dbias,                  # (items, channels) f32, written
    WIDTH_TILE: ConstInt,
    PART_TILE: ConstInt,
    BLOCK_C: ConstInt,
):
    _conv_grads_reduce_body(dweight_partials, dbias_partials, dweight, dbias, WIDTH_TILE, PART_TILE, BLOCK_C)


def reduce_part_tile(partials_per_item: int) -> int:
    """Partials per load of the reduction: the largest power of two up to MAX_PART_TILE dividing an item's
    partials (so that a load never reaches the next item's)."""
    tile = 1
    while tile < MAX_PART_TILE and partials_per_item % (2 * tile) == 0:
        tile *= 2
    return tile


# The occupancy hint of the main kernel comes from the config.
CONV_BWD_KERNELS = int64_index_kernels(causal_conv1d_bwd_kernel)
CONV_GRADS_REDUCE_KERNELS = int64_index_kernels(conv_grads_reduce_kernel)


@dataclasses.dataclass(frozen=True)
class ConvBwdConfig:
    """Tiles of the backward: BLOCK_L tokens per step (unrolled rows), SEGMENT_TILES steps per block,
    BLOCK_C channels (powers of two), the main kernel's occupancy hint, and the channels per block of the
    partials' reduction."""

    BLOCK_L: int
    SEGMENT_TILES: int
    BLOCK_C: int
    REDUCE_BLOCK_C: int
    OCCUPANCY: int = 2

    def __post_init__(self):
        check_tile_fields("ConvBwdConfig", self, powers_of_two=("BLOCK_C", "REDUCE_BLOCK_C"))

    @property
    def segment(self) -> int:
        return self.BLOCK_L * self.SEGMENT_TILES


def conv_bwd_default_config(dims: ConvDims) -> ConvBwdConfig:
    """Steps of 8 rows of up to 128 channels: one channel per thread of the block's 128, which keeps a step's
    x, dy and g rows and the next step's prefetched x and dy in registers without spills at d_conv 4, with or
    without seq_idx (tileiras 13.4, sm_90: ~113 registers, 128 with seq_idx), within the occupancy hint of 4
    blocks per SM; docs/conv1d.md (Configurations) has the timings that chose it over wider steps at lower
    occupancy. Segments of 256 tokens, fewer while the grid would be small (`default_segment_tiles`): at
    (8, 2048) that is 1152 blocks for 2304 channels and 1024 for 2048, and 128-token segments (256 blocks) for
    the layer's 256 [B, C] channels. The reduction sums REDUCE_BLOCK_C channels per block."""
    block_l = 8
    block_c = min(128, max(16, next_power_of_2(dims.channels)))
    return ConvBwdConfig(BLOCK_L=block_l, SEGMENT_TILES=default_segment_tiles(dims, block_l, block_c, 32),
                         BLOCK_C=block_c, REDUCE_BLOCK_C=min(REDUCE_BLOCK_C, max(16, next_power_of_2(dims.channels))),
                         OCCUPANCY=4)


def conv_bwd_grid(dims: ConvDims, cfg: ConvBwdConfig) -> tuple[int, int, int]:
    return (-(-dims.seqlen // cfg.segment), channel_blocks(dims, cfg.BLOCK_C), dims.batch)


def passed_cotangent_arrays(dims: ConvDims) -> dict[str, Buffer]:
    """dbefore and dafter: the cotangents of x's channels before and after the window (`outside_arrays`)."""
    return outside_arrays(dims, "d")


def conv_bwd_arrays(dims: ConvDims, cfg: ConvBwdConfig | None = None, items: int = 1) -> dict[str, Buffer]:
    """Shape and dtype of every input and buffer of `conv_bwd_plan(dims, cfg, items)`."""
    return {**conv_arrays(dims), **piece_arrays(dims, "dy"), **passed_cotangent_arrays(dims),
            **conv_bwd_plan(dims, cfg, items).buffers}


def conv_bwd_plan(dims: ConvDims, cfg: ConvBwdConfig | None = None, items: int = 1) -> Plan:
    """The backward for `dims` from inputs CONV_BWD_INPUTS: CONV_INPUTS, the cotangents dy0, dy1, dy2 of the
    forward's pieces (dummies (1, 1, 1) past `dims.pieces`) and dbefore, dafter (`passed_cotangent_arrays`);
    see `conv_bwd_arrays`.

    Args:
      dims: the problem.
      cfg: tiles (default `conv_bwd_default_config`).
      items: how many equal groups of batch rows get their own dweight / dbias (vmap folds its axis into
        the batch); must divide dims.batch.

    Returns:
      A Plan with outputs CONV_BWD_OUTPUTS: dx (batch, seqlen, channels), with `dims.pass_through` x's whole
      cotangent (batch, seqlen, in_width), in x's dtype, dweight (items,
      WIDTH, channels) and dbias (items, channels) f32, dinitial_states (batch, channels, init_width) f32 (a
      dummy without initial states).
    """
    if items < 1 or dims.batch % items:
        raise ValueError(f"conv_bwd_plan: items={items} must divide batch={dims.batch}")
    cfg = cfg or conv_bwd_default_config(dims)
    check_dims("conv_bwd_plan", dims)
    if cfg.BLOCK_L < dims.width - 1:
        # dx lags g by width - 1 tokens within a step.
        raise ValueError(f"conv_bwd_plan: BLOCK_L={cfg.BLOCK_L} must be at least width - 1={dims.width - 1}")
    grid = conv_bwd_grid(dims, cfg)
    partials = dims.batch * grid[0]
    big = needs_int64_index(dims, partials)
    C = dims.channels
    buffers = {
        "dx": Buffer((dims.batch, dims.seqlen, dims.source_width if dims.pass_through else C), dims.dtype),
        "dinitial_states": Buffer((dims.batch, C, dims.init_width) if dims.has_init else (1, 1, 1), "float32",
                                  zero_init=True),
        "dweight_partials": Buffer((partials, dims.width, C), "float32"),
        "dbias_partials": Buffer((partials, C), "float32"),
        "dweight": Buffer((items, dims.width, C), "float32"),
        "dbias": Buffer((items, C), "float32"),
    }
    split1, split2 = dims.split_points
    main = kernel_launch(
        index_width_variant(CONV_BWD_KERNELS, big, occupancy=cfg.OCCUPANCY), grid,
        writes=("dx", "dinitial_states", "dweight_partials", "dbias_partials"),
        WIDTH=dims.width, INIT_WIDTH=dims.init_width, IN_OFFSET=dims.in_offset, OUTPUTS=len(dims.pieces),
        SPLIT1=split1, SPLIT2=split2, BLOCK_L=cfg.BLOCK_L, SEGMENT_TILES=cfg.SEGMENT_TILES, BLOCK_C=cfg.BLOCK_C,
        HAS_INIT=dims.has_init, HAS_SEQ_IDX=dims.has_seq_idx, SILU=dims.silu, PASS_THROUGH=dims.pass_through)
    reduce = kernel_launch(
        CONV_GRADS_REDUCE_KERNELS[1 if big else 0], (-(-C // cfg.REDUCE_BLOCK_C), items),
        writes=("dweight", "dbias"), WIDTH_TILE=next_power_of_2(dims.width),
        PART_TILE=reduce_part_tile(partials // items), BLOCK_C=cfg.REDUCE_BLOCK_C)
    return Plan(inputs=CONV_BWD_INPUTS, buffers=buffers, launches=(main, reduce), outputs=CONV_BWD_OUTPUTS)
