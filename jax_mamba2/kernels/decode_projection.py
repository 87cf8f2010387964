"""The decode step's projections: a few rows, optionally added to the residual stream and RMS-normalized (grouped,
gated), times one layer's weight matrix, as two cuTile kernels of one plan.

Mirrors `jax_mamba2.decode_reference.norm_project`. Per row r, in f32 up to the product:

    h      = x[r] (+ residual[r] with HAS_RESIDUAL); rounded to residual_out's dtype and stored there
             (WRITE_RESIDUAL: the residual stream the next block adds to)
    h     *= silu(z[r])                                      HAS_Z and not NORM_BEFORE_GATE
    h      = h / sqrt(mean_g(h^2) + EPS) * norm_weight[l, g]   HAS_NORM, per group g of GROUP_SIZE features
    h     *= silu(z[r])                                      HAS_Z and NORM_BEFORE_GATE
    a      = h rounded to the stream's dtype, then x's (normed, an (M, K) buffer), then out's (the computation dtype)
    out[r] = a @ weight[l] (+ bias[l] with HAS_BIAS): f32 accumulation, rounded to out's dtype

with l = layer_index[0]: every per-layer array is the model's stack of all layers (leading (L,) axis), so a layer
loop passes the parameters as they are stored and never copies one layer's slice out of the stack. weight is
(L, K, N), or (L, N, K) with TRANSPOSE_W (a tied embedding (vocab, d_model) as the LM head), in its own dtype,
rounded to out's dtype as it is loaded (what `x @ w.astype(dtype)` computes); f32 products run as TF32.

Two launches (one without the norm, three with a split K):
- `decode_norm_kernel`, grid (M, NGROUPS): a block normalizes one row's group in two passes over it (the sum of
  squares, then the scaled rows), NORM_BLOCK_K features per step (the whole group when it is a power of two up to
  2048: one load); it writes the normalized rows (M x K, a few KB) and the residual stream.
- `decode_project_kernel`, grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K): a block computes a (BLOCK_M,
  BLOCK_N) tile of out over all K, rows and weight tiles pipelined by the loads' latency hint; the rows are few
  and every column block rereads them from L2, the weight is read once: its bytes are the floor (at a few rows a block's
  chain of K steps sets the time, hence as many blocks as one wave holds: `projection_default_config`). With
  SPLIT_K > 1 the grid gains a third axis over shares of K, each writing an f32 partial product, and
  `decode_split_sum_kernel` sums them into out.
Folding the norm into the product's K loop (one launch) put a row reduction and four more loads on every step's
critical path and was slower on the H200 than the two launches (docs/design.md, "Decode"). What can
be folded is the normalization alone, with the statistics computed elsewhere: with NORM_PARTS (the gated norm after
the mixer step, whose kernel sums the squares of its own blocks' channels) the product loads a group's sums of
squares (one tile per group, before the K loop for one group), and per K step scales the rows it loads by them and
the norm weight: the plan is then the product's launches alone.

Arrays: x, residual, residual_out, normed (M, K); z (M, ZW), the gate being columns [Z_BLOCK * NORM_BLOCK_K, + K)
(in_proj's output, whose z columns come first); norm_weight (L, NGROUPS, GROUP_SIZE); bias (L, N); out (M, N);
partials (SPLIT_K, M, N) f32; sum_squares (M, NGROUPS * NORM_PARTS) f32, a group's sums consecutive.
Absent optional arrays are (1, 1) / (1, 1, 1) dummies the kernels never touch.
"""
import dataclasses
from typing import Optional

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    INDEPENDENT, INT32_MAX, SM90_SMS, Buffer, ConstBool, ConstFloat, ConstInt, Launch, Plan, is_power_of_2,
    load_zero_padded, mma_dtype, next_power_of_2, sigmoid, wait_for_predecessor, with_hints)

NORM_PROJECT_INPUTS = ("layer_index", "x", "residual", "z", "norm_weight", "weight", "bias", "sum_squares")
# Rows per block: the product's M tile (a power of two >= 16, the smallest tensor-core tile).
MIN_BLOCK_M, MAX_BLOCK_M = 16, 64
# The most blocks one output tile's K steps split over.
MAX_SPLIT_K = 16
# The norm pass's widest step: a (1, MAX_NORM_BLOCK_K) f32 tile per loaded array.
MAX_NORM_BLOCK_K = 2048
# The most sums of squares (norm_parts) the product reads at once per row: a (BLOCK_M, 64) f32 tile.
MAX_PARTS_TILE = 64
# Product blocks in one wave of an H200: one block per SM (as measured: a block's pipelined loads hold 76-167 KB
# of shared memory at the default tiles).
WAVE_BLOCKS = SM90_SMS
# The most blocks a narrow product of a few rows splits its K over (out_proj from d_inner 2048 at one row: 16
# column blocks of 64, split 8 to fill a wave).
MAX_NARROW_SPLITS = 8
# Up to this many rows a product streams its weight as one row does (out_proj takes about as long at 8 rows as
# at one), so the default splits a narrow product's K there (see projection_default_config).
SPLIT_ROWS = 8


@dataclasses.dataclass(frozen=True)
class ProjectionDims:
    """Static description of one decode projection (what the kernel specialises on).

    rows: M, the rows projected (a decode step's batch); features: K; out_features: N; layers: L, the leading
    axis of the per-layer arrays. ngroups, group_size: the norm's groups (K = ngroups * group_size; one group
    without has_norm). z_width: the gate array's columns (0 without a gate) and z_offset where the gate starts.
    Dtypes as numpy names: dtype x's, out_dtype the output's (the computation dtype), weight_dtype the
    weight's (and the bias's), norm_weight_dtype the norm weight's, residual_dtype the residual stream's (None
    without write_residual), residual_in_dtype the residual input's (None without has_residual). x_parts: 0, or
    x comes as (x_parts, M, K) float32 partial sums (an earlier projection's with out_parts) whose sum, rounded to
    dtype, is the input (needs has_norm); out_parts: the product's float32 partial sums (one per split of K, the
    bias in the first) are the output instead of out, for the next projection's norm to sum (no launch of their
    own). norm_parts: 0, or the norm's statistics come as (M, ngroups * norm_parts) float32 sums of squares of its
    gated input, norm_parts per group, each group's contiguous (what `mixer_step` returns with the norm's gate):
    the product then normalizes x as it loads it, and the plan has no norm launch (needs has_norm; no residual,
    no partial sums of x).
    """

    rows: int
    features: int
    out_features: int
    layers: int = 1
    ngroups: int = 1
    group_size: Optional[int] = None
    has_norm: bool = False
    has_residual: bool = False
    write_residual: bool = False
    z_width: int = 0
    z_offset: int = 0
    norm_before_gate: bool = False
    transpose_weight: bool = False
    has_bias: bool = False
    eps: float = 1e-5
    dtype: str = "bfloat16"
    out_dtype: str = "bfloat16"
    weight_dtype: str = "bfloat16"
    norm_weight_dtype: str = "float32"
    z_dtype: str = "bfloat16"
    residual_dtype: Optional[str] = None
    residual_in_dtype: Optional[str] = None
    x_parts: int = 0
    out_parts: bool = False
    norm_parts: int = 0

    @property
    def has_z(self) -> bool:
        return self.z_width > 0

    @property
    def group(self) -> int:
        return self.features // self.ngroups if self.group_size is None else self.group_size

    @property
    def block_m(self) -> int:
        return min(MAX_BLOCK_M, max(MIN_BLOCK_M, next_power_of_2(self.rows)))


@dataclasses.dataclass(frozen=True)
class ProjectionConfig:
    """The product's tiles: BLOCK_N output columns per block; BLOCK_K its K step (a power of two); LATENCY the
    loads' latency hint (1..10, 0 none); OCCUPANCY blocks per SM the compiler budgets registers for (None: its
    choice); BLOCK_M rows per block (None: `ProjectionDims.block_m`; below 16 the product runs without tensor
    cores); SPLIT_K blocks per output tile, each over its share of the K steps (a power of two, see `split_k`;
    above 1 their f32 partial products go to a buffer that one more launch sums: more blocks, shorter chains, for
    a few rows and a long K); WEIGHT_FIRST: the product taken as (W^T x^T)^T, the weight's tile the tensor cores'
    first operand, which wgmma reads from registers, and the rows the second, from shared memory (for float32
    weights, whose tiles are rounded to the compute dtype in registers before the product: wgmma on 64 rows in
    place of mma.sync on 32-row blocks; docs/design.md, "Decode"). The norm's pass has no tile to choose
    (`norm_block_k`)."""

    BLOCK_N: int = 64
    BLOCK_K: int = 128
    LATENCY: int = 4
    OCCUPANCY: Optional[int] = None
    BLOCK_M: Optional[int] = None
    SPLIT_K: int = 1
    WEIGHT_FIRST: bool = False

    def __post_init__(self):
        for name in ("BLOCK_N", "BLOCK_K"):
            value = getattr(self, name)
            if not is_power_of_2(value) or not 16 <= value <= 256:
                raise ValueError(f"ProjectionConfig: {name}={value} must be a power of two in [16, 256]")
        if self.BLOCK_M is not None and (not is_power_of_2(self.BLOCK_M) or self.BLOCK_M > MAX_BLOCK_M):
            raise ValueError(f"ProjectionConfig: BLOCK_M={self.BLOCK_M} must be None or a power of two <= "
                             f"{MAX_BLOCK_M}")
        if not 0 <= self.LATENCY <= 10:
            raise ValueError(f"ProjectionConfig: LATENCY={self.LATENCY} must be 0 (no hint) or in [1, 10]")
        if self.OCCUPANCY is not None and not 1 <= self.OCCUPANCY <= 32:
            raise ValueError(f"ProjectionConfig: OCCUPANCY={self.OCCUPANCY} must be None or in [1, 32]")
        if not isinstance(self.WEIGHT_FIRST, bool):
            raise TypeError(f"ProjectionConfig: WEIGHT_FIRST={self.WEIGHT_FIRST!r} must be a bool")
        if not is_power_of_2(self.SPLIT_K) or self.SPLIT_K > MAX_SPLIT_K:
            raise ValueError(f"ProjectionConfig: SPLIT_K={self.SPLIT_K} must be a power of two <= {MAX_SPLIT_K}")


def _k_steps(dims: ProjectionDims, cfg: ProjectionConfig) -> int:
    """The product's K steps, cdiv(K, BLOCK_K): the last one's features past K load as zeros."""
    return -(-dims.features // cfg.BLOCK_K)


def split_k(dims: ProjectionDims, cfg: ProjectionConfig) -> int:
    """The product's splits: cfg.SPLIT_K, lowered to the largest power of two that divides its K steps (so that
    every split runs the same steps), and 1 where K is not whole steps: each split then covers an equal piece of K,
    none past it, which is what the op's VJP takes the partial sums for (`decode_reference.norm_project`'s parts)."""
    if dims.features % cfg.BLOCK_K:
        return 1
    steps = _k_steps(dims, cfg)
    return min(cfg.SPLIT_K, steps & -steps)


def norm_block_k(dims: ProjectionDims) -> int:
    """The norm pass's step: the largest power of two, up to MAX_NORM_BLOCK_K, that divides the group and the
    gate's offset (so a step never spans two groups and the gate's columns start on a step)."""
    step = min(MAX_NORM_BLOCK_K, dims.group & -dims.group)
    return min(step, dims.z_offset & -dims.z_offset) if dims.z_offset else step


def projection_unsupported_reason(dims: ProjectionDims) -> Optional[str]:
    """Why the kernels cannot run `dims` (None when they can)."""
    if dims.features % 16 or dims.group % 16:
        return f"features={dims.features} and the norm's group ({dims.group}) must be multiples of 16"
    if dims.ngroups * dims.group != dims.features:
        return f"ngroups={dims.ngroups} x group_size={dims.group} must be features={dims.features}"
    if dims.has_z and (dims.z_offset % 16 or dims.z_offset + dims.features > dims.z_width):
        return (f"the gate's columns [{dims.z_offset}, +{dims.features}) must start at a multiple of 16 inside "
                f"z's {dims.z_width}")
    if (dims.has_z or dims.has_residual or dims.write_residual or dims.x_parts or dims.norm_parts) \
            and not dims.has_norm:
        return "a gate, a residual stream, partial sums of x or sums of squares come with the norm"
    if dims.norm_parts and (dims.has_residual or dims.write_residual or dims.x_parts):
        return "the norm's sums of squares are for a norm without a residual stream or partial sums of x"
    largest = max(max(dims.x_parts, MAX_SPLIT_K if dims.out_parts else 1) * dims.rows
                  * max(dims.features, dims.out_features, dims.z_width),
                  dims.layers * dims.features * dims.out_features)
    if largest > INT32_MAX:
        return f"an array of {largest} elements needs 64-bit indices, which the decode kernels do not take"
    return None


def projection_default_config(dims: ProjectionDims) -> ProjectionConfig:
    """The product's columns per block: the fewest (down to 32) whose blocks still fit one wave of an H200 (132
    SMs, a block per SM), so that every block streams its weight columns at once; 128 when even those are more
    than a wave (an LM head). K step 128 (64 for float32 weights: the same bytes per step, and spill-free).
    Fewer than 32 columns leave the product without tensor cores, which the H200 runs many times slower.

    A narrow product of up to SPLIT_ROWS rows (out_proj's 1024 columns: 16 blocks of 64) splits K over
    MAX_NARROW_SPLITS (8) blocks, or 4, or else 2, the most that fit one wave: more blocks stream the weight at
    once, and the partials' sum is one more small launch (or the next norm's loads): faster for out_proj (2048 x
    1024) at one row, 8 splits faster than 4 (float32 weights keep 4, whose 8 splits' build holds a stack frame),
    while in_proj (69 blocks of 64, which a split of 2 takes past a wave) was slower split, and at 64 rows no split
    paid in bfloat16. float32 weights double each K step's bytes, so up to one block of rows (64) a product whose
    blocks fit a wave twice splits K the same way, over 128-feature steps (faster than unsplit for out_proj at 64
    rows, with no local memory; docs/design.md, "Decode", has the timings). A wider float32 product of 33 to 64 rows
    runs one of two forms (none of this for a product wider still, the head). Where its 64-column blocks fill more
    than half a wave and fit two per SM in one (in_proj from d_model 1024: 69 to 133 blocks), the weight is the
    tensor cores' first operand (WEIGHT_FIRST: wgmma on the 64-row block), 64 columns per block at an occupancy hint
    of 2, 64-feature K steps, which timed faster than the other form for in_proj at the widths of mamba2-370m, -780m
    and -1.3b (same section). Narrower ones (out_proj of mamba2-2.7b, in_proj of mamba2-130m), whose 64-row blocks
    would leave most SMs idle, run two blocks of 32 rows per column block at an occupancy hint of 2 (mma.sync),
    128-feature K steps, 64 columns. Where the product normalizes (norm_parts), its K step also stays within a group
    of the norm and starts the gate's columns on a step (`norm_block_k`)."""
    def within_norm(block_k):  # a K step within one group of the norm, the gate's columns starting on a step
        return min(block_k, norm_block_k(dims)) if dims.norm_parts else block_k

    m_blocks = -(-dims.rows // dims.block_m)
    wide_blocks = -(-dims.out_features // 64)
    float32 = dims.weight_dtype == "float32"

    def splits(blocks):  # the most that still fit one wave (float32 weights at most 4: 8 take a stack frame)
        candidates = (4,) if float32 else (MAX_NARROW_SPLITS, 4)
        return next((s for s in candidates if s * blocks <= WAVE_BLOCKS), 2)
    block_k = within_norm(64 if float32 else 128)
    if dims.rows <= SPLIT_ROWS and 2 * wide_blocks <= WAVE_BLOCKS:
        return ProjectionConfig(BLOCK_N=64, BLOCK_K=block_k, SPLIT_K=splits(wide_blocks))
    block_n = next((n for n in (32, 64, 128) if m_blocks * -(-dims.out_features // n) <= WAVE_BLOCKS), 128)
    blocks = m_blocks * -(-dims.out_features // block_n)
    if float32 and m_blocks == 1 and 2 * blocks <= WAVE_BLOCKS:
        return ProjectionConfig(BLOCK_N=block_n, BLOCK_K=within_norm(128), SPLIT_K=splits(blocks))
    if float32 and m_blocks == 1 and dims.rows > MAX_BLOCK_M // 2:
        # Two blocks per SM either way: the weight first on 64-row blocks where they fill more than half a wave,
        # else two blocks of 32 rows per column block (twice the blocks streaming the weight). Wider products
        # (an LM head) keep 128 columns of whole rows.
        if WAVE_BLOCKS // 2 < wide_blocks <= 2 * WAVE_BLOCKS:
            return ProjectionConfig(BLOCK_N=64, BLOCK_K=block_k, OCCUPANCY=2, BLOCK_M=MAX_BLOCK_M,
                                    WEIGHT_FIRST=True)
        if wide_blocks <= WAVE_BLOCKS // 2:
            return ProjectionConfig(BLOCK_N=64, BLOCK_K=within_norm(128), BLOCK_M=MAX_BLOCK_M // 2, OCCUPANCY=2)
    return ProjectionConfig(BLOCK_N=block_n, BLOCK_K=block_k)


def _weight_tile(weight, layer, k, n, BLOCK_K, BLOCK_N, TRANSPOSE_W, LATENCY):
    """weight[layer] rows [k*BLOCK_K, ...) x columns [n*BLOCK_N, ...) as (BLOCK_K, BLOCK_N), zero outside."""
    if TRANSPOSE_W:
        tile = load_zero_padded(weight, (layer, n, k), (1, BLOCK_N, BLOCK_K), LATENCY)
        return ct.permute(tile.reshape((BLOCK_N, BLOCK_K)), (1, 0))
    return load_zero_padded(weight, (layer, k, n), (1, BLOCK_K, BLOCK_N), LATENCY).reshape((BLOCK_K, BLOCK_N))


def _gated(h, z32, NORM_BEFORE_GATE):
    """(h, gate) of f32 tiles of the norm's input and its gate's z: gate = silu(z), h gated unless NORM_BEFORE_GATE
    (then the gate applies after the norm: `_scaled`)."""
    gate = z32 * sigmoid(z32)
    if not NORM_BEFORE_GATE:
        h = h * gate
    return h, gate


def _scaled(h, rstd, scale, gate, HAS_Z, NORM_BEFORE_GATE):
    """The normalized f32 tile h * rstd * scale, gated after the norm with HAS_Z and NORM_BEFORE_GATE."""
    y = h * rstd * scale.astype(ct.float32)
    if HAS_Z:
        if NORM_BEFORE_GATE:
            y = y * gate
    return y


def _norm_input(x, residual, z, residual_out, normed, row, k, BLOCK_K, X_PARTS, HAS_RESIDUAL, WRITE_RESIDUAL,
                HAS_Z, Z_BLOCK, NORM_BEFORE_GATE, STORE_RESIDUAL):
    """(h, gate) of one row's features [k*BLOCK_K, +BLOCK_K), (1, BLOCK_K) f32: h = x (+ residual) as the residual
    stream stores it (stored there with STORE_RESIDUAL), gated unless NORM_BEFORE_GATE; gate = silu(z) (h when
    there is no gate). With X_PARTS, x is the sum of its X_PARTS f32 partials rounded to normed's dtype (what
    the projection that wrote them would have stored)."""
    if X_PARTS:
        h = ct.load(x, index=(0, row, k), shape=(1, 1, BLOCK_K)).reshape((1, BLOCK_K))
        for part in range(1, X_PARTS):
            h = h + ct.load(x, index=(part, row, k), shape=(1, 1, BLOCK_K)).reshape((1, BLOCK_K))
        h = h.astype(normed.dtype).astype(ct.float32)
    else:
        h = ct.load(x, index=(row, k), shape=(1, BLOCK_K)).astype(ct.float32)
    if HAS_RESIDUAL:
        h = h + ct.load(residual, index=(row, k), shape=(1, BLOCK_K)).astype(ct.float32)
    if WRITE_RESIDUAL:  # the norm reads h as the residual stream stores it
        h = h.astype(residual_out.dtype)
        if STORE_RESIDUAL:
            ct.store(residual_out, index=(row, k), tile=h)
        h = h.astype(ct.float32)
    gate = h
    if HAS_Z:
        h, gate = _gated(h, ct.load(z, index=(row, Z_BLOCK + k), shape=(1, BLOCK_K)).astype(ct.float32),
                         NORM_BEFORE_GATE)
    return h, gate


def _store_normed(norm_weight, normed, residual_out, layer, row, g, s, steps, h, gate, rstd, BLOCK_K, HAS_Z,
                  NORM_BEFORE_GATE, WRITE_RESIDUAL):
    """normed[row, step s of group g] = h * rstd * norm_weight[layer, g, step s] (* gate), rounded to the residual
    stream's dtype with WRITE_RESIDUAL (the dtype the reference returns the normalized rows in) and then to
    normed's."""
    scale = ct.load(norm_weight, index=(layer, g, s), shape=(1, 1, BLOCK_K)).reshape((1, BLOCK_K))
    y = _scaled(h, rstd, scale, gate, HAS_Z, NORM_BEFORE_GATE)
    if WRITE_RESIDUAL:
        y = y.astype(residual_out.dtype)
    ct.store(normed, index=(row, g * steps + s), tile=y.astype(normed.dtype))


def decode_norm_kernel(
    layer_index,         # (1,) int32
    x,                   # (M, K) T, or (X_PARTS, M, K) f32 partial sums
    residual,            # (M, K) Tr_in, or a dummy without HAS_RESIDUAL
    z,                   # (M, ZW) Tz, or a dummy without HAS_Z
    norm_weight,         # (L, NGROUPS, GROUP_SIZE) in its dtype
    normed,              # (M, K) T, written
    residual_out,        # (M, K) Tr, written with WRITE_RESIDUAL, else a dummy
    GROUP_SIZE: ConstInt,
    BLOCK_K: ConstInt,   # norm_block_k: divides GROUP_SIZE
    X_PARTS: ConstInt,   # 0: x is (M, K); else its partial sums
    HAS_RESIDUAL: ConstBool,
    WRITE_RESIDUAL: ConstBool,
    HAS_Z: ConstBool,
    Z_BLOCK: ConstInt,   # the gate's first column in units of BLOCK_K
    NORM_BEFORE_GATE: ConstBool,
    EPS: ConstFloat,
    DEPENDENT: ConstInt,  # INDEPENDENT, or how it waits under a programmatic dependent launch
):
    wait_for_predecessor(DEPENDENT)
    row = ct.bid(0)
    g = ct.bid(1)
    layer = ct.load(layer_index, index=(0,), shape=(1,)).item()
    steps = GROUP_SIZE // BLOCK_K
    h, gate = _norm_input(x, residual, z, residual_out, normed, row, g * steps, BLOCK_K, X_PARTS, HAS_RESIDUAL,
                          WRITE_RESIDUAL, HAS_Z, Z_BLOCK, NORM_BEFORE_GATE, True)
    sum_sq = ct.sum(h * h, axis=1, keepdims=True)
    for s in range(1, steps):
        h_s, _ = _norm_input(x, residual, z, residual_out, normed, row, g * steps + s, BLOCK_K, X_PARTS,
                             HAS_RESIDUAL, WRITE_RESIDUAL, HAS_Z, Z_BLOCK, NORM_BEFORE_GATE, True)
        sum_sq = sum_sq + ct.sum(h_s * h_s, axis=1, keepdims=True)
    rstd = ct.rsqrt(sum_sq / GROUP_SIZE + EPS)
    # The first step's rows are still in registers; later steps reread theirs (from L2: a few KB per row).
    _store_normed(norm_weight, normed, residual_out, layer, row, g, 0, steps, h, gate, rstd, BLOCK_K, HAS_Z,
                  NORM_BEFORE_GATE, WRITE_RESIDUAL)
    for s in range(1, steps):
        h_s, gate_s = _norm_input(x, residual, z, residual_out, normed, row, g * steps + s, BLOCK_K, X_PARTS,
                                  HAS_RESIDUAL, WRITE_RESIDUAL, HAS_Z, Z_BLOCK, NORM_BEFORE_GATE, False)
        _store_normed(norm_weight, normed, residual_out, layer, row, g, s, steps, h_s, gate_s, rstd, BLOCK_K, HAS_Z,
                      NORM_BEFORE_GATE, WRITE_RESIDUAL)


def _group_rstd(sum_squares, m, g, BLOCK_M, NORM_PARTS, PARTS_TILE, NGROUPS, GROUP_SIZE, EPS):
    """(BLOCK_M, 1) f32: 1 / rms of group g of the block's rows, from the group's NORM_PARTS sums of squares, read
    PARTS_TILE at a time."""
    total = ct.zeros((BLOCK_M, 1), ct.float32)
    if NORM_PARTS % PARTS_TILE == 0 or NGROUPS == 1:  # tiles of the group's parts (one group's last zero-padded)
        tiles = (NORM_PARTS + PARTS_TILE - 1) // PARTS_TILE
        for t in range(tiles):
            sums = ct.load(sum_squares, index=(m, g * tiles + t), shape=(BLOCK_M, PARTS_TILE),
                           padding_mode=ct.PaddingMode.ZERO)
            total = total + ct.sum(sums, axis=1, keepdims=True)
    else:  # gathered (a gather here compiles to a stack frame: kept off the common layouts), PARTS_TILE at a time
        rows = m * BLOCK_M + ct.arange(BLOCK_M, dtype=ct.int32)
        for start in range(0, NORM_PARTS, PARTS_TILE):
            part = start + ct.arange(PARTS_TILE, dtype=ct.int32)
            mask = (part[None, :] < NORM_PARTS) & (rows[:, None] >= 0)
            sums = ct.gather(sum_squares, (rows[:, None], g * NORM_PARTS + part[None, :]), mask=mask,
                             padding_value=0)
            total = total + ct.sum(sums, axis=1, keepdims=True)
    return ct.rsqrt(total / GROUP_SIZE + EPS)


def _normed_rows(a, z, norm_weight, layer, m, k, rstd, BLOCK_M, BLOCK_K, GROUP_SIZE, HAS_Z, Z_BLOCK,
                 NORM_BEFORE_GATE, LATENCY):
    """(BLOCK_M, BLOCK_K) in a's dtype: the rows' features [k * BLOCK_K, +BLOCK_K) normalized as `decode_norm_kernel`
    would have stored them (gated, times rstd and the norm weight of their group), rstd given."""
    h = load_zero_padded(a, (m, k), (BLOCK_M, BLOCK_K), LATENCY).astype(ct.float32)
    gate = h
    if HAS_Z:
        h, gate = _gated(h, load_zero_padded(z, (m, Z_BLOCK + k), (BLOCK_M, BLOCK_K), LATENCY).astype(ct.float32),
                         NORM_BEFORE_GATE)
    steps = GROUP_SIZE // BLOCK_K
    scale = ct.load(norm_weight, index=(layer, k // steps, k % steps), shape=(1, 1, BLOCK_K)).reshape((1, BLOCK_K))
    return _scaled(h, rstd, scale, gate, HAS_Z, NORM_BEFORE_GATE).astype(a.dtype)


def decode_project_kernel(
    layer_index,         # (1,) int32
    a,                   # (M, K) the rows: the normalized rows (T), or x itself without a norm (or with NORM_PARTS)
    weight,              # (L, K, N), or (L, N, K) with TRANSPOSE_W, in its dtype
    bias,                # (L, N) in the weight's dtype, or a dummy without HAS_BIAS
    out,                 # (M, N) T_out, written with SPLIT_K == 1 and not OUT_PARTS, else a dummy or the sum's
    partials,            # (SPLIT_K, M, N) f32 each split's product, written with SPLIT_K > 1 or OUT_PARTS, else a
                         # dummy
    sum_squares,         # (M, NGROUPS * NORM_PARTS) f32 with NORM_PARTS, else a dummy
    z,                   # (M, ZW) Tz with NORM_PARTS and HAS_Z, else a dummy
    norm_weight,         # (L, NGROUPS, GROUP_SIZE) with NORM_PARTS, else a dummy
    BLOCK_M: ConstInt,
    BLOCK_N: ConstInt,
    BLOCK_K: ConstInt,
    SPLIT_STEPS: ConstInt,  # K steps per split: cdiv(K, BLOCK_K) / SPLIT_K (features past K load as zeros)
    SPLIT_K: ConstInt,
    OUT_PARTS: ConstBool,  # the partials are the output: the bias goes into split 0's
    TRANSPOSE_W: ConstBool,
    HAS_BIAS: ConstBool,
    LATENCY: ConstInt,   # latency hint of the loads in the K loop (1..10), 0 for none
    NORM_PARTS: ConstInt,  # 0, or a normalizes a's rows as it loads them, with each group's statistics from its
                           # NORM_PARTS sums of squares: BLOCK_K divides GROUP_SIZE
    PARTS_TILE: ConstInt,  # the sums read at once: next_power_of_2(NORM_PARTS) up to MAX_PARTS_TILE
    NGROUPS: ConstInt,
    GROUP_SIZE: ConstInt,
    HAS_Z: ConstBool,
    Z_BLOCK: ConstInt,   # the gate's first column in units of BLOCK_K
    NORM_BEFORE_GATE: ConstBool,
    EPS: ConstFloat,
    WEIGHT_FIRST: ConstBool,  # the product as (W^T a^T)^T: the weight's tile the tensor cores' first operand
    DEPENDENT_HALVES: ConstInt,  # 2: a dependent build takes each K step as two of BLOCK_K / 2 features (1: not)
    DEPENDENT: ConstInt,  # INDEPENDENT, or how it waits under a programmatic dependent launch
):
    wait_for_predecessor(DEPENDENT)
    # With that wait, tileiras builds 128-feature K steps with spills and up to twice the shared memory
    # (docs/design.md §3), half steps without.
    HALVES = 1
    if DEPENDENT > INDEPENDENT:
        HALVES = DEPENDENT_HALVES
    STEP_K = BLOCK_K // HALVES
    m = ct.bid(0)
    n = ct.bid(1)
    split = ct.bid(2)
    layer = ct.load(layer_index, index=(0,), shape=(1,)).item()
    mma_type = mma_dtype(out.dtype)
    if WEIGHT_FIRST:
        acc = ct.zeros((BLOCK_N, BLOCK_M), ct.float32)
    else:
        acc = ct.zeros((BLOCK_M, BLOCK_N), ct.float32)
    rstd = ct.zeros((BLOCK_M, 1), ct.float32)
    if NORM_PARTS:
        if NGROUPS == 1:  # one group: its statistics before the K loop
            rstd = _group_rstd(sum_squares, m, 0, BLOCK_M, NORM_PARTS, PARTS_TILE, NGROUPS, GROUP_SIZE, EPS)
    for i in range(SPLIT_STEPS * HALVES):
        k = split * SPLIT_STEPS * HALVES + i
        if NORM_PARTS:
            if NGROUPS > 1:
                rstd = _group_rstd(sum_squares, m, k * STEP_K // GROUP_SIZE, BLOCK_M, NORM_PARTS, PARTS_TILE,
                                   NGROUPS, GROUP_SIZE, EPS)
            rows = _normed_rows(a, z, norm_weight, layer, m, k, rstd, BLOCK_M, STEP_K, GROUP_SIZE, HAS_Z,
                                Z_BLOCK * HALVES, NORM_BEFORE_GATE, LATENCY)
        else:
            rows = load_zero_padded(a, (m, k), (BLOCK_M, STEP_K), LATENCY)
        rows = rows.astype(out.dtype).astype(mma_type)
        w = _weight_tile(weight, layer, k, n, STEP_K, BLOCK_N, TRANSPOSE_W, LATENCY).astype(out.dtype)
        if WEIGHT_FIRST:
            acc = ct.mma(ct.permute(w.astype(mma_type), (1, 0)), ct.permute(rows, (1, 0)), acc)
        else:
            acc = ct.mma(rows, w.astype(mma_type), acc)
    if WEIGHT_FIRST:
        acc = ct.permute(acc, (1, 0))
    if OUT_PARTS or SPLIT_K > 1:
        if OUT_PARTS and HAS_BIAS:  # no sum launch adds it: split 0 does
            if split == 0:
                acc = acc + _bias_tile(out, bias, layer, n, BLOCK_N)
        ct.store(partials, index=(split, m, n), tile=acc.reshape((1, BLOCK_M, BLOCK_N)))
    else:
        _store_out(out, bias, layer, m, n, acc, BLOCK_N, HAS_BIAS)


def _bias_tile(out, bias, layer, n, BLOCK_N):
    """(1, BLOCK_N) f32: bias[layer, n] tile rounded to out's dtype (what the reference adds)."""
    b = ct.load(bias, index=(layer, n), shape=(1, BLOCK_N), padding_mode=ct.PaddingMode.ZERO)
    return b.astype(out.dtype).astype(ct.float32)


def _store_out(out, bias, layer, m, n, acc, BLOCK_N, HAS_BIAS):
    """out[m, n] tile = acc (+ bias[layer, n]), rounded to out's dtype."""
    if HAS_BIAS:
        acc = acc + _bias_tile(out, bias, layer, n, BLOCK_N)
    ct.store(out, index=(m, n), tile=acc.astype(out.dtype))


def decode_split_sum_kernel(
    layer_index,         # (1,) int32
    partials,            # (SPLIT_K, M, N) f32
    bias,                # (L, N) in the weight's dtype, or a dummy without HAS_BIAS
    out,                 # (M, N) T_out, written
    BLOCK_M: ConstInt,
    BLOCK_N: ConstInt,
    SPLIT_K: ConstInt,
    HAS_BIAS: ConstBool,
    DEPENDENT: ConstInt,  # INDEPENDENT, or how it waits under a programmatic dependent launch
):
    wait_for_predecessor(DEPENDENT)
    m = ct.bid(0)
    n = ct.bid(1)
    layer = ct.load(layer_index, index=(0,), shape=(1,)).item()
    acc = ct.zeros((BLOCK_M, BLOCK_N), ct.float32)
    for split in range(SPLIT_K):
        tile = ct.load(partials, index=(split, m, n), shape=(1, BLOCK_M, BLOCK_N), padding_mode=ct.PaddingMode.ZERO)
        acc = acc + tile.reshape((BLOCK_M, BLOCK_N))
    _store_out(out, bias, layer, m, n, acc, BLOCK_N, HAS_BIAS)


# int32-indexed only: projection_unsupported_reason refuses arrays of 2^31 elements or more.
DECODE_NORM_KERNEL = ct.kernel(decode_norm_kernel)
DECODE_PROJECT_KERNEL = ct.kernel(decode_project_kernel)
DECODE_SPLIT_SUM_KERNEL = ct.kernel(decode_split_sum_kernel)


def norm_project_inputs(dims: ProjectionDims) -> dict[str, Buffer]:
    """Shape and dtype of each input as the bridge passes it (dummies where absent)."""
    M, K, N, L = dims.rows, dims.features, dims.out_features, dims.layers
    return {
        "layer_index": Buffer((1,), "int32"),
        "x": Buffer((dims.x_parts, M, K), "float32") if dims.x_parts else Buffer((M, K), dims.dtype),
        "residual": Buffer((M, K) if dims.has_residual else (1, 1), dims.residual_in_dtype or dims.dtype),
        "z": Buffer((M, dims.z_width) if dims.has_z else (1, 1), dims.z_dtype),
        "norm_weight": Buffer((L, dims.ngroups, dims.group) if dims.has_norm else (1, 1, 1), dims.norm_weight_dtype),
        "weight": Buffer((L, N, K) if dims.transpose_weight else (L, K, N), dims.weight_dtype),
        "bias": Buffer((L, N) if dims.has_bias else (1, 1), dims.weight_dtype),
        "sum_squares": Buffer((M, dims.ngroups * dims.norm_parts) if dims.norm_parts else (1, 1), "float32"),
    }


def _norm_launch(dims: ProjectionDims) -> Launch:
    step = norm_block_k(dims)
    return Launch(
        kernel=DECODE_NORM_KERNEL,
        grid=(dims.rows, dims.ngroups),
        args=("layer_index", "x", "residual", "z", "norm_weight", "normed", "residual_out", dims.group, step,
              dims.x_parts, dims.has_residual, dims.write_residual, dims.has_z, dims.z_offset // step,
              dims.has_z and dims.norm_before_gate, float(dims.eps), INDEPENDENT),
        writes=("normed", "residual_out"),
    )


# Placeholders for the norm's arrays in a product that does not normalize (plan buffers never read).
_NO_NORM_BUFFERS = {"no_z": Buffer((1, 1), "float32", zero_init=True),
                    "no_norm_weight": Buffer((1, 1, 1), "float32", zero_init=True)}


def _product_launches(dims: ProjectionDims, cfg: ProjectionConfig, rows: str) -> tuple[Launch, ...]:
    """The product of `rows` (an input or buffer name) and the layer's weight into "out": one launch, or with
    SPLIT_K > 1 the splits into "partials" and their sum; with out_parts one launch into "partials". With
    norm_parts the product normalizes the rows (x) itself; without, it reads the _NO_NORM_BUFFERS."""
    bm = cfg.BLOCK_M or dims.block_m
    tiles = (-(-dims.rows // bm), -(-dims.out_features // cfg.BLOCK_N))
    splits = split_k(dims, cfg)
    norm_arrays = ("z" if dims.has_z else "no_z", "norm_weight") if dims.norm_parts else tuple(_NO_NORM_BUFFERS)
    product = Launch(
        kernel=with_hints(DECODE_PROJECT_KERNEL, occupancy=cfg.OCCUPANCY),
        grid=(*tiles, splits),
        args=("layer_index", rows, "weight", "bias", "out", "partials", "sum_squares", *norm_arrays, bm,
              cfg.BLOCK_N, cfg.BLOCK_K, _k_steps(dims, cfg) // splits, splits, dims.out_parts,
              dims.transpose_weight, dims.has_bias, cfg.LATENCY, dims.norm_parts,
              min(next_power_of_2(dims.norm_parts), MAX_PARTS_TILE) if dims.norm_parts else 0, dims.ngroups,
              dims.group,
              dims.has_z and dims.norm_parts > 0, dims.z_offset // cfg.BLOCK_K, dims.norm_before_gate,
              float(dims.eps), cfg.WEIGHT_FIRST, _dependent_halves(dims, cfg), INDEPENDENT),
        writes=("out", "partials"),  # one of them, the other a dummy: out without a split or out_parts, else
                                     # partials
    )
    if splits == 1 or dims.out_parts:
        return (product,)
    return product, Launch(
        kernel=DECODE_SPLIT_SUM_KERNEL,
        grid=tiles,
        args=("layer_index", "partials", "bias", "out", bm, cfg.BLOCK_N, splits, dims.has_bias, INDEPENDENT),
        writes=("out",),
    )


def _dependent_halves(dims: ProjectionDims, cfg: ProjectionConfig) -> int:
    """2 where the product's dependent build takes half K steps: steps of 128 features or more, whose last half
    step still reaches into K (a tile wholly past an array's end is not loaded), else 1."""
    padding = -dims.features % cfg.BLOCK_K
    return 2 if cfg.BLOCK_K >= 128 and padding < cfg.BLOCK_K // 2 else 1


def norm_project_plan(dims: ProjectionDims, cfg: Optional[ProjectionConfig] = None) -> Plan:
    """The projection for `dims`: the norm's launch (with has_norm, unless norm_parts: then the product normalizes)
    and the product's (with cfg.SPLIT_K > 1 two: the splits and their sum; with out_parts one, the splits being
    the output).

    Returns:
      A Plan with inputs NORM_PROJECT_INPUTS and outputs "out" (M, N) in out_dtype, or with out_parts "partials"
      (splits, M, N) float32 (see `output_parts`), and with write_residual "residual_out" (M, K) in
      residual_dtype.
    """
    cfg = cfg or projection_default_config(dims)
    if dims.norm_parts and (dims.group % cfg.BLOCK_K or dims.z_offset % cfg.BLOCK_K):
        raise ValueError(f"norm_project_plan: BLOCK_K={cfg.BLOCK_K} must divide the norm's group ({dims.group}) "
                         f"and the gate's offset ({dims.z_offset}) when the product normalizes")
    splits = split_k(dims, cfg)
    buffers = {"out": Buffer((1, 1) if dims.out_parts else (dims.rows, dims.out_features), dims.out_dtype),
               "partials": Buffer((splits, dims.rows, dims.out_features) if splits > 1 or dims.out_parts
                                  else (1, 1, 1), "float32")}
    if not dims.norm_parts:
        buffers.update(_NO_NORM_BUFFERS)
    elif not dims.has_z:
        buffers["no_z"] = _NO_NORM_BUFFERS["no_z"]
    out = ("partials",) if dims.out_parts else ("out",)
    if not dims.has_norm or dims.norm_parts:
        return Plan(inputs=NORM_PROJECT_INPUTS, buffers=buffers, launches=_product_launches(dims, cfg, "x"),
                    outputs=out)
    buffers["normed"] = Buffer((dims.rows, dims.features), dims.dtype)
    buffers["residual_out"] = Buffer((dims.rows, dims.features) if dims.write_residual else (1, 1),
                                     dims.residual_dtype or dims.dtype)
    return Plan(
        inputs=NORM_PROJECT_INPUTS,
        buffers=buffers,
        launches=(_norm_launch(dims), *_product_launches(dims, cfg, "normed")),
        outputs=out + ("residual_out",) if dims.write_residual else out,
    )


def output_parts(dims: ProjectionDims, cfg: Optional[ProjectionConfig] = None) -> int:
    """How many float32 partial sums the plan of `dims` with out_parts returns: the product's splits of K."""
    return split_k(dims, cfg or projection_default_config(dims))
