"""Stages 2-4 of the SSD forward in one kernel: each block carries its state through the chunks and
writes the outputs as it goes, so the chunk-entry states never leave the SM.

Computes what chunk_state (+ state passing) followed by chunk_scan compute (the state enters the C·H
product in x's dtype, the carried state stays f32). For batch b, head h (group g = h // (nheads /
ngroups)), chunk c with rows l, s, dA = dA_cumsum[b, h, c], Δ = dt_out[b, h, c], the state's token weights
w[l] = exp(min(dA[Q-1] - dA[l], 0)) Δ[l] and H_c [headdim, dstate] the state entering chunk c (H_0 =
initial_states):

    y[l]     = (exp(dA[l]) + reach[l]) * (C[l] @ H_c^T) + Σ_{s<=l} (C[l] · B[s]) exp(min(dA[l] - dA[s], 0)) Δ[s] x[s]
               + D[h] * x[l],          out[l] = y[l] * silu(z[l]) if HAS_Z   (reach[l] = 0 without HAS_REACH)
    H_{c+1}  = exp(dA[Q-1]) * H_c + (x_c * w)^T @ B_c          (WEIGHT_X: carried as H)
             = exp(dA[Q-1]) * H_c + x_c^T @ (B_c * w)          (else: carried as H^T, chunk_state's rounding)
    final_states[b, h] = H_nchunks

where the weighted operand is rounded to x's dtype, with chunk_state's and chunk_scan's seq_idx rules
(`_tiles.py`): the carry is dropped when a chunk ends in another sequence than the previous one, the state only
collects tokens of the chunk's last sequence, the C·H term only reaches rows of the previous chunk's last
sequence, and intra-chunk pairs need equal ids.

With JOINT_OUTPUT (dstate = chunk size) the inter- and intra-chunk terms are one product,
y = [exp(dA) C | scores] · [H_c^T ; x] + D x, C's rows scaled and rounded to x's dtype before it (scores[l, s]
the masked, decayed C[l] · B[s] Δ[s]).

The trade against the staged plan: no entry states are written and read back (2 * batch * nchunks *
nheads * headdim * dstate * 2 bytes, 536 MB at (4,8192,32,64,128), chunk 64), and C·B^T and the state
product share one load of each chunk's B, C and x; but the work is one sequential chain per (batch, head,
headdim block), batch * nheads * headdim / BLOCK_P blocks in all, so it needs that many to fill the GPU
(`forward.forward_layout` decides).

Grid: (batch * nheads, headdim / BLOCK_P, segments). The loads of chunk c+1 do not depend on the
carried state, so the `LOAD_LAT` hint lets them be issued while chunk c computes. With CHUNKS_PER_ITER
= 2 the loop takes two chunks per iteration (then an odd last one alone): the two entry states are then
two values, which tileiras stages in two shared-memory buffers instead of one.

Segments (SEGMENT_CHUNKS > 0; one segment, the whole sequence, otherwise): where the chains are too few
to fill the GPU, each sequence is cut into segments of SEGMENT_CHUNKS chunks with a block each.
`segment_states_kernel` first walks the segments before the last in pieces of PIECE_CHUNKS chunks (a
divisor of SEGMENT_CHUNKS), one block per piece j, each from a zero state (state updates only), and stores
the piece's end state L_j and D_j, the product of its chunks' carries (0 when a sequence starts in it);
the block of segment s then enters with H = D_{J-1} (... (D_0 H_0 + L_0) ...) + L_{J-1} over the
J = s * SEGMENT_CHUNKS / PIECE_CHUNKS pieces before it, the same chunk recurrence regrouped. The pieces
are independent short chains: many more blocks than segments, so this pass is not one more long walk.

With WRITE_STATES a block also stores every chunk-entry state H_c it carries, rounded to x's dtype (the
operand of its C·H product), into `states`: what chunk_state writes in the staged layout and what the
backward reads, so a differentiated forward can save them instead of the backward recomputing them.

Shapes: x, z, out (batch, seqlen, nheads, headdim) T (z a dummy without HAS_Z); B, C (batch, seqlen,
ngroups, dstate) T; D (nheads, headdim) f32; dt_out, dA_cumsum (batch, nheads, nchunks, chunk_size) f32;
initial_states, final_states (batch, nheads, headdim, dstate) f32 (initial_states a dummy without
HAS_INIT); seq_idx (batch, seqlen) int32 or a dummy; seg_states (batch, pieces, nheads, headdim, dstate)
f32 and seg_decay (batch, nheads, pieces) f32 (dummies with one segment); states (batch,
nchunks, nheads, headdim, dstate) T (a dummy without WRITE_STATES); reach (batch, nheads, nchunks, CHUNK) f32,
0 or NaN (a dummy without HAS_REACH).
"""
import dataclasses
from typing import Any

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    LOG2E, Big, ConstBool, ConstInt, Launch, SSDDims, Stage, check_arch, exp2_ftz, int64_index_kernels,
    kernel_launch, mma_dtype, select_kernel, silu_gate)
from jax_mamba2.kernels._tiles import (
    batch_head_group, previous_chunk_end_id, state_seq_rules)


def _load_rows(array, b, c, col_block, index, CHUNK, WIDTH, LOAD_LAT):
    """Chunk c's [CHUNK, WIDTH] tile of a (batch, seqlen, heads or groups, width) array at head/group
    `index`, column block `col_block` (zero past seqlen)."""
    return ct.load(array, index=(b, c, index, col_block), shape=(1, CHUNK, 1, WIDTH),
                   padding_mode=ct.PaddingMode.ZERO, latency=LOAD_LAT).reshape((CHUNK, WIDTH))


def _oriented(tile, WEIGHT_X):
    """A [BLOCK_P, DSTATE] tile in the carried state's orientation, or the carried state as [BLOCK_P,
    DSTATE]: the state is carried as H [BLOCK_P, DSTATE] with WEIGHT_X, as H^T [DSTATE, BLOCK_P] without."""
    return tile if WEIGHT_X else tile.transpose()


def _zero_state(DSTATE, BLOCK_P, WEIGHT_X):
    return _oriented(ct.zeros((BLOCK_P, DSTATE), dtype=ct.float32), WEIGHT_X)


def _collect(B_c, x_c, state, state_scale, carry, dtype, operand_dtype, WEIGHT_X):
    """The state entering the next chunk, carry * H_c + Σ_s state_scale[s] x_c[s]^T B_c[s], the weighted
    operand rounded to x's dtype. WEIGHT_X: x's rows take the weights, (x_c * w)^T @ B_c with B straight
    from shared memory; else B's rows, (B_c * w)^T @ x_c (mamba_ssm's rounding). B_c [CHUNK, DSTATE], x_c
    [CHUNK, BLOCK_P] (x's dtype), state f32 in its orientation (`_oriented`)."""
    if WEIGHT_X:
        x_scaled = (x_c.astype(ct.float32) * state_scale[:, None]).astype(dtype)
        return ct.mma(x_scaled.transpose().astype(operand_dtype), B_c.astype(operand_dtype), state * carry)
    B_scaled = (B_c.astype(ct.float32) * state_scale[:, None]).astype(dtype)
    return ct.mma(B_scaled.transpose().astype(operand_dtype), x_c.astype(operand_dtype), state * carry)


def _chunk_vectors(dt_out, dA_cumsum, b, h, c, CHUNK, LOAD_LAT):
    """Δ and dA of chunk c [CHUNK] f32, dA's last entry [1], the state's token weights
    exp(min(dA[Q-1] - dA, 0)) * Δ [CHUNK] and its carry exp(dA[Q-1]) [1] (before the seq_idx rules)."""
    delta = ct.load(dt_out, index=(b, h, c, 0), shape=(1, 1, 1, CHUNK), latency=LOAD_LAT).reshape((CHUNK,))
    dA = ct.load(dA_cumsum, index=(b, h, c, 0), shape=(1, 1, 1, CHUNK), latency=LOAD_LAT).reshape((CHUNK,))
    dA_last = ct.extract(dA, index=(CHUNK - 1,), shape=(1,))             # flat past seqlen: last valid
    return delta, dA, ct.exp(ct.minimum(dA_last - dA, 0.0)) * delta, ct.exp(dA_last)


@dataclasses.dataclass(frozen=True)
class _ChunkArrays:
    """The arrays `_fused_chunk` reads and writes (the kernel's parameters of the same names)."""

    x: Any
    B: Any
    C: Any
    z: Any
    dt_out: Any
    dA_cumsum: Any
    seq_idx: Any
    reach: Any
    out: Any
    states: Any


@dataclasses.dataclass(frozen=True)
class _Chain:
    """A fused block's chain: batch row b, head h and its group g, headdim block pb, the sequence length,
    D's [BLOCK_P] columns for the head and the [CHUNK, CHUNK] causal mask."""

    b: Any
    h: Any
    g: Any
    pb: Any
    seqlen: Any
    D_p: Any
    causal: Any


@dataclasses.dataclass(frozen=True)
class _ChunkSpec:
    """The compile-time constants of `_fused_chunk` (the kernel's parameters of the same names)."""

    CHUNK: int
    DSTATE: int
    BLOCK_P: int
    LOAD_LAT: int
    HAS_Z: bool
    HAS_SEQ_IDX: bool
    HAS_REACH: bool
    WRITE_STATES: bool
    WEIGHT_X: bool
    JOINT_OUTPUT: bool


def _fused_chunk(c, state, prev_end_id, arrays, chain, spec):
    """Chunk c of a fused block: its outputs stored; returns the state entering chunk c+1 and the
    sequence id its carry continues (seq_idx rules)."""
    x, B, C, z, dt_out, dA_cumsum, seq_idx, out, states = (
        arrays.x, arrays.B, arrays.C, arrays.z, arrays.dt_out, arrays.dA_cumsum, arrays.seq_idx, arrays.out,
        arrays.states)
    b, h, g, pb, seqlen, D_p, causal = chain.b, chain.h, chain.g, chain.pb, chain.seqlen, chain.D_p, chain.causal
    CHUNK, DSTATE, BLOCK_P, LOAD_LAT = spec.CHUNK, spec.DSTATE, spec.BLOCK_P, spec.LOAD_LAT
    HAS_Z, HAS_SEQ_IDX, WRITE_STATES = spec.HAS_Z, spec.HAS_SEQ_IDX, spec.WRITE_STATES
    WEIGHT_X, JOINT_OUTPUT = spec.WEIGHT_X, spec.JOINT_OUTPUT
    operand_dtype = mma_dtype(x.dtype)
    C_c = _load_rows(C, b, c, 0, g, CHUNK, DSTATE, LOAD_LAT).astype(operand_dtype)
    B_c = _load_rows(B, b, c, 0, g, CHUNK, DSTATE, LOAD_LAT)
    x_c = _load_rows(x, b, c, pb, h, CHUNK, BLOCK_P, LOAD_LAT)
    delta, dA, state_scale, carry = _chunk_vectors(dt_out, dA_cumsum, b, h, c, CHUNK, LOAD_LAT)
    inter_scale = ct.exp(dA)                                          # rows H_c reaches
    keep = causal                                                     # intra-chunk pairs
    if HAS_SEQ_IDX:
        ids, end_id, state_scale, carry = state_seq_rules(
            seq_idx, b, c, seqlen, CHUNK, prev_end_id, state_scale, carry)
        inter_scale = ct.where(ids == prev_end_id, inter_scale, 0.0)
        keep = keep & (ids[:, None] == ids[None, :])
        prev_end_id = end_id
    if spec.HAS_REACH:
        # + 0 leaves a row as it is; + NaN makes the whole row NaN (C·H_c^T times NaN, whatever its value).
        inter_scale = inter_scale + ct.load(arrays.reach, index=(b, h, c, 0), shape=(1, 1, 1, CHUNK),
                                            latency=LOAD_LAT).reshape((CHUNK,))

    x_op = x_c.astype(operand_dtype)
    cb = ct.mma(C_c, B_c.astype(operand_dtype).transpose(), ct.zeros((CHUNK, CHUNK), dtype=ct.float32))
    entry_state = state.astype(x.dtype)                              # H_c as chunk_scan reads it
    if WRITE_STATES:
        ct.store(states, index=(b, c, h, pb, 0),
                 tile=_oriented(entry_state, WEIGHT_X).reshape((1, 1, 1, BLOCK_P, DSTATE)))
    entry_state_t = entry_state.transpose() if WEIGHT_X else entry_state  # H_c^T [DSTATE, BLOCK_P]
    zeros = ct.zeros((CHUNK, BLOCK_P), dtype=ct.float32)
    if not JOINT_OUTPUT:
        acc = ct.mma(C_c, entry_state_t.astype(operand_dtype), zeros) * inter_scale[:, None]
    # The difference is scaled, not dA before the broadcast: with a log2-unit dA vector tileiras moved the
    # state weights' exps into its state warpgroup, which then ran slower.
    decay = exp2_ftz(ct.minimum(dA[:, None] - dA[None, :], 0.0) * LOG2E)
    scores = ct.where(keep, cb * decay * delta[None, :], 0.0).astype(x.dtype).astype(operand_dtype)
    if JOINT_OUTPUT:
        # [exp(dA) C | scores] · [H_c^T ; x], both terms in one product (DSTATE == CHUNK): C's rows scaled
        # and rounded to x's dtype before it, where the two-product form scales the f32 C·H_c^T after.
        C_scaled = (C_c.astype(ct.float32) * inter_scale[:, None]).astype(x.dtype).astype(operand_dtype)
        acc = ct.mma(ct.cat((C_scaled, scores), 1), ct.cat((entry_state_t.astype(operand_dtype), x_op), 0), zeros)
    else:
        acc = ct.mma(scores, x_op, acc)
    acc = acc + x_c.astype(ct.float32) * D_p[None, :]
    if HAS_Z:
        acc = silu_gate(acc, _load_rows(z, b, c, pb, h, CHUNK, BLOCK_P, LOAD_LAT))
    ct.store(out, index=(b, c, h, pb), tile=acc.reshape((1, CHUNK, 1, BLOCK_P)).astype(out.dtype))
    state = _collect(B_c, x_c, state, state_scale, carry, x.dtype, operand_dtype, WEIGHT_X)
    return state, prev_end_id


def fused_scan_fwd_kernel(
    x: Big,               # (batch, seqlen, nheads, headdim) T
    B: Big,               # (batch, seqlen, ngroups, dstate) T
    C: Big,               # (batch, seqlen, ngroups, dstate) T
    D,                    # (nheads, headdim) f32
    z: Big,               # (batch, seqlen, nheads, headdim) T, or a dummy without HAS_Z
    dt_out: Big,          # (batch, nheads, nchunks, CHUNK) f32
    dA_cumsum: Big,       # (batch, nheads, nchunks, CHUNK) f32
    initial_states: Big,  # (batch, nheads, headdim, dstate) f32, or a dummy without HAS_INIT
    seq_idx: Big,         # (batch, seqlen) int32, or a dummy without HAS_SEQ_IDX
    reach: Big,           # (batch, nheads, nchunks, CHUNK) f32, or a dummy without HAS_REACH
    seg_states: Big,      # (batch, pieces, nheads, headdim, dstate) f32, or a dummy (one segment)
    seg_decay: Big,       # (batch, nheads, pieces) f32, or a dummy (one segment)
    out: Big,             # (batch, seqlen, nheads, headdim) T, written
    final_states: Big,    # (batch, nheads, headdim, dstate) f32, written
    states: Big,          # (batch, nchunks, nheads, headdim, dstate) T, written (WRITE_STATES), or a dummy
    CHUNK: ConstInt,
    DSTATE: ConstInt,
    BLOCK_P: ConstInt,    # headdim columns per block
    SEGMENT_CHUNKS: ConstInt,  # chunks per segment (grid axis 2); 0: the whole sequence
    PIECE_CHUNKS: ConstInt,    # chunks per piece of seg_states (divides SEGMENT_CHUNKS; 0 with it)
    HAS_Z: ConstBool,
    HAS_INIT: ConstBool,
    HAS_SEQ_IDX: ConstBool,
    HAS_REACH: ConstBool,  # add `reach` to each row's inter-chunk scale (SSDDims.has_reach)
    WRITE_STATES: ConstBool,  # store every chunk-entry state (what the backward would recompute)
    LOAD_LAT: ConstInt,   # latency hint of the per-chunk loads (1..10)
    CHUNKS_PER_ITER: ConstInt,  # chunks per loop iteration, 1 or 2
    WEIGHT_X: ConstBool,  # the state update weights x's rows (state carried [BLOCK_P, DSTATE]), else B's
    JOINT_OUTPUT: ConstBool,  # the output as one product [exp(dA) C | scores]·[H_c^T ; x] (DSTATE == CHUNK)
):
    pb = ct.bid(1)
    seqlen = x.shape[1]
    b, h, g = batch_head_group(ct.bid(0), x.shape[2], B.shape[2])
    nchunks = ct.cdiv(seqlen, CHUNK)

    if HAS_INIT:
        state = _oriented(ct.load(initial_states, index=(b, h, pb, 0), shape=(1, 1, BLOCK_P, DSTATE)
                                  ).reshape((BLOCK_P, DSTATE)), WEIGHT_X)
    else:
        state = _zero_state(DSTATE, BLOCK_P, WEIGHT_X)
    if SEGMENT_CHUNKS > 0:
        # Segment ct.bid(2) of the sequence: its entry state from the end states of the pieces before it.
        seg = ct.bid(2)
        first = seg * SEGMENT_CHUNKS
        last = ct.minimum(first + SEGMENT_CHUNKS, nchunks)
        for j in range(seg * (SEGMENT_CHUNKS // PIECE_CHUNKS)):
            through = ct.load(seg_decay, index=(b, h, j), shape=(1, 1, 1), latency=LOAD_LAT).reshape((1,))
            local = ct.load(seg_states, index=(b, j, h, pb, 0), shape=(1, 1, 1, BLOCK_P, DSTATE),
                            latency=LOAD_LAT).reshape((BLOCK_P, DSTATE))
            state = state * through + _oriented(local, WEIGHT_X)
        prev_end_id = ct.zeros((1,), dtype=ct.int32)
        if HAS_SEQ_IDX:
            prev_end_id = previous_chunk_end_id(seq_idx, b, first, CHUNK)
    else:
        first = 0
        last = nchunks
        prev_end_id = ct.zeros((1,), dtype=ct.int32)                      # e_{-1} = 0
    D_p = ct.load(D, index=(h, pb), shape=(1, BLOCK_P)).reshape((BLOCK_P,))
    rows = ct.arange(CHUNK, dtype=ct.int32)
    causal = rows[:, None] >= rows[None, :]

    chunk_args = (_ChunkArrays(x, B, C, z, dt_out, dA_cumsum, seq_idx, reach, out, states),
                  _Chain(b, h, g, pb, seqlen, D_p, causal),
                  _ChunkSpec(CHUNK, DSTATE, BLOCK_P, LOAD_LAT, HAS_Z, HAS_SEQ_IDX, HAS_REACH, WRITE_STATES,
                             WEIGHT_X, JOINT_OUTPUT))
    if CHUNKS_PER_ITER == 1:
        for c in range(first, last):
            state, prev_end_id = _fused_chunk(c, state, prev_end_id, *chunk_args)
    else:
        # Two chunks per iteration make their two entry states two values: tileiras stages them in two shared
        # buffers, so the state warpgroup can write H_{c+1} while the output warpgroup still reads H_c.
        pairs_end = first + (last - first) // 2 * 2
        for c in range(first, pairs_end, 2):
            state, prev_end_id = _fused_chunk(c, state, prev_end_id, *chunk_args)
            state, prev_end_id = _fused_chunk(c + 1, state, prev_end_id, *chunk_args)
        for c in range(pairs_end, last):
            state, prev_end_id = _fused_chunk(c, state, prev_end_id, *chunk_args)

    if last == nchunks:
        ct.store(final_states, index=(b, h, pb, 0),
                 tile=_oriented(state, WEIGHT_X).reshape((1, 1, BLOCK_P, DSTATE)))


def segment_states_kernel(
    x: Big,               # (batch, seqlen, nheads, headdim) T
    B: Big,               # (batch, seqlen, ngroups, dstate) T
    dt_out: Big,          # (batch, nheads, nchunks, CHUNK) f32
    dA_cumsum: Big,       # (batch, nheads, nchunks, CHUNK) f32
    seq_idx: Big,         # (batch, seqlen) int32, or a dummy without HAS_SEQ_IDX
    seg_states: Big,      # (batch, pieces, nheads, headdim, dstate) f32, written
    seg_decay: Big,       # (batch, nheads, pieces) f32, written
    CHUNK: ConstInt,
    DSTATE: ConstInt,
    BLOCK_P: ConstInt,
    PIECE_CHUNKS: ConstInt,   # chunks per piece (grid axis 2: one block per piece)
    HAS_SEQ_IDX: ConstBool,
    LOAD_LAT: ConstInt,
    WEIGHT_X: ConstBool,  # as the fused kernel's
):
    """A block per piece j (of the segments before the last): its end state from a zero start, L_j, and the
    product of its chunks' carries, the factor any earlier state is multiplied by across it (0 past a
    sequence start)."""
    pb = ct.bid(1)
    piece = ct.bid(2)
    seqlen = x.shape[1]
    b, h, g = batch_head_group(ct.bid(0), x.shape[2], B.shape[2])
    operand_dtype = mma_dtype(x.dtype)
    first = piece * PIECE_CHUNKS
    state = _zero_state(DSTATE, BLOCK_P, WEIGHT_X)
    through = ct.full((1,), 1.0, dtype=ct.float32)
    if HAS_SEQ_IDX:
        prev_end_id = previous_chunk_end_id(seq_idx, b, first, CHUNK)
    for c in range(first, first + PIECE_CHUNKS):
        B_c = _load_rows(B, b, c, 0, g, CHUNK, DSTATE, LOAD_LAT)
        x_c = _load_rows(x, b, c, pb, h, CHUNK, BLOCK_P, LOAD_LAT)
        _, _, state_scale, carry = _chunk_vectors(dt_out, dA_cumsum, b, h, c, CHUNK, LOAD_LAT)
        if HAS_SEQ_IDX:
            _, prev_end_id, state_scale, carry = state_seq_rules(
                seq_idx, b, c, seqlen, CHUNK, prev_end_id, state_scale, carry)
        state = _collect(B_c, x_c, state, state_scale, carry, x.dtype, operand_dtype, WEIGHT_X)
        through = through * carry
    ct.store(seg_states, index=(b, piece, h, pb, 0),
             tile=_oriented(state, WEIGHT_X).reshape((1, 1, 1, BLOCK_P, DSTATE)))
    ct.store(seg_decay, index=(b, h, piece), tile=through.reshape((1, 1, 1)))


FUSED_SCAN_FWD_KERNELS = int64_index_kernels(fused_scan_fwd_kernel)
SEGMENT_STATES_KERNELS = int64_index_kernels(segment_states_kernel)


@dataclasses.dataclass(frozen=True)
class FusedScanConfig:
    """Tile size and hints of `fused_scan_fwd_kernel`.

    BLOCK_P: headdim columns per block (a power of two dividing headdim); the block carries a
    dstate x BLOCK_P f32 state. LOAD_LAT: latency hint on the per-chunk loads. OCCUPANCY: expected
    blocks per SM. WORKER_WARPS: warps of the compute warpgroups (4 or 8; None: tileiras' choice).
    CHUNKS_PER_ITER: chunks per iteration of the chain's loop (1 or 2; ignored by segment_states).
    WEIGHT_X: the state update weights x's rows, (x * w)^T @ B, B's tile entering the product straight
    from shared memory (the state carried as [BLOCK_P, dstate]); else B's rows, (B * w)^T @ x, the
    rounding of mamba_ssm and of the staged chunk_state (either way the weighted operand is rounded to
    x's dtype). JOINT_OUTPUT: the chunk's output as one product [exp(dA) C | scores]·[H_c^T ; x] instead of
    C·H_c^T scaled, then scores·x accumulated onto it (where dstate equals the chunk size; ignored by
    segment_states).
    """

    BLOCK_P: int = 64
    LOAD_LAT: int = 6
    OCCUPANCY: int = 1
    WORKER_WARPS: int | None = None
    CHUNKS_PER_ITER: int = 1
    WEIGHT_X: bool = True
    JOINT_OUTPUT: bool = False

    def __post_init__(self):
        if self.CHUNKS_PER_ITER not in (1, 2):
            raise ValueError(f"CHUNKS_PER_ITER must be 1 or 2, got {self.CHUNKS_PER_ITER}")


# The chunk sizes the fused kernel takes: its [CHUNK, CHUNK] f32 C·B^T and dstate x BLOCK_P f32 state
# live in registers next to each other.
FUSED_CHUNK_SIZES = (16, 32, 64)
# Largest carried state (dstate * BLOCK_P f32 values) per block.
MAX_STATE = 128 * 64
# Twice that, a 256 x 64 state, is in the tune space x weighted at occupancy 1: tileiras 13.4 compiles the
# defaults to sm_90 without a stack (with B weighted and tileiras' warps, a 72-byte stack).
WIDE_STATE = 256 * 64


def fused_scan_supported(dims: SSDDims) -> bool:
    """Whether the fused kernel has a configuration for `dims` (chunk size and state size)."""
    return dims.chunk_size in FUSED_CHUNK_SIZES and dims.dstate * min(16, dims.headdim) <= MAX_STATE


def _widths(dims: SSDDims) -> list[int]:
    """BLOCK_P candidates: 32 and 64 where they fit; 16 only where nothing wider does (below 32
    columns the wgmma N side is too narrow: tileiras emits mma.sync, measured much slower)."""
    fits = [bp for bp in (16, 32, 64) if bp <= dims.headdim and dims.dstate * bp <= MAX_STATE]
    return [bp for bp in fits if bp >= 32] or fits


def _wide_state(dims: SSDDims) -> bool:
    """Whether 64 columns make a state over MAX_STATE but within WIDE_STATE (dstate 256)."""
    return 64 <= dims.headdim and MAX_STATE < dims.dstate * 64 <= WIDE_STATE


def fused_scan_fwd_configs(dims: SSDDims, arch: str = "sm_90") -> list[FusedScanConfig]:
    """The autotune space (sm_90): BLOCK_P 32/64 (dividing headdim, state at most 128 x 64 f32),
    latency 2/4/6, x weighted at occupancy 1 (tileiras' warps, or 8 worker warps taking two chunks per
    iteration) or 2 (tileiras' warps: 8 would cap them at 80 registers), and B weighted with 8 worker
    warps and two chunks per iteration; where dstate equals the chunk size, the widest BLOCK_P B weighted
    with the output as one product (JOINT_OUTPUT), one chunk per iteration, tileiras' warps; plus 64
    columns of a 256 x 64 state (dstate 256), x weighted at occupancy 1 with tileiras' warps or 8 worker
    warps. Empty where `fused_scan_supported(dims)` is false."""
    check_arch("fused_scan_fwd_configs", arch)
    if not fused_scan_supported(dims):
        return []
    # (OCCUPANCY, WORKER_WARPS, CHUNKS_PER_ITER, WEIGHT_X, JOINT_OUTPUT)
    hints = ((1, None, 1, True, False), (1, 8, 2, True, False), (1, 8, 2, False, False), (2, None, 1, True, False))
    space = [(bp, hint) for bp in _widths(dims) for hint in hints]
    if dims.dstate == dims.chunk_size:
        space.append((_widths(dims)[-1], (1, None, 1, False, True)))
    if _wide_state(dims):
        space += [(64, hint) for hint in ((1, None, 1, True, False), (1, 8, 1, True, False))]
    return [FusedScanConfig(BLOCK_P=bp, LOAD_LAT=lat, OCCUPANCY=occ, WORKER_WARPS=warps, CHUNKS_PER_ITER=n,
                            WEIGHT_X=weighted, JOINT_OUTPUT=joint)
            for bp, (occ, warps, n, weighted, joint) in space for lat in (2, 4, 6)]


def fused_scan_fwd_default_config(dims: SSDDims) -> FusedScanConfig:
    """The best measured config of the space (bf16, chunk 64, per dstate): dstate 128: 64 columns,
    occupancy 1, latency 6, tileiras' warps, x weighted (at every head count and group count timed).
    dstate 256: the same at latency 4 (latency 6's build stages the loads in less shared memory and ran
    slower); with seq_idx 8 worker warps (seq_idx makes tileiras put the loop in one warpgroup with a
    stack). dstate 64 (= the chunk size), without z and seq_idx: B weighted, the output as one product,
    one chunk per iteration, tileiras' warps, latency 6 (the build without the joint product spills); with
    z or seq_idx that build grows a stack or collapses into one warpgroup, so there: 8 worker warps, two
    chunks per iteration, B weighted. dstate 16 and 32 take the dstate-64 choice (untimed)."""
    if _wide_state(dims):
        return FusedScanConfig(BLOCK_P=64, LOAD_LAT=4, OCCUPANCY=1, WORKER_WARPS=8 if dims.has_seq_idx else None)
    width = _widths(dims)[-1]
    if width == 64 and dims.dstate < 128:
        if dims.dstate == dims.chunk_size and not (dims.has_z or dims.has_seq_idx):
            return FusedScanConfig(BLOCK_P=64, LOAD_LAT=6, OCCUPANCY=1, WEIGHT_X=False, JOINT_OUTPUT=True)
        return FusedScanConfig(BLOCK_P=64, LOAD_LAT=6, OCCUPANCY=1, WORKER_WARPS=8, CHUNKS_PER_ITER=2,
                               WEIGHT_X=False)
    return FusedScanConfig(BLOCK_P=width, LOAD_LAT=6, OCCUPANCY=1)


def segment_states_default_config(dims: SSDDims) -> FusedScanConfig:
    """The fused default's width and weighting for the state-only walk of the pieces, at occupancy 2 and
    latency 4, tileiras' warps: sm_90 wgmma without a stack at dstate 64-256 (x weighted at dstate 256 the
    build takes 219 registers and 228 KB of shared memory, so one block per SM). x weighted measured faster
    than B weighted at dstate 128. At the fused default itself (occupancy 1, latency 6) tileiras 13.4
    emitted no wgmma for this kernel at dstate 128 (B weighted)."""
    return dataclasses.replace(fused_scan_fwd_default_config(dims), LOAD_LAT=4, OCCUPANCY=2, WORKER_WARPS=None,
                               CHUNKS_PER_ITER=1, JOINT_OUTPUT=False)


def segment_states_configs(dims: SSDDims, arch: str = "sm_90") -> list[FusedScanConfig]:
    """The fused kernel's space at one chunk per iteration (its joint-output configs left out: the walk has
    no output) plus this walk's default, which the fused space lacks at dstate 256 (its 64 columns only at
    occupancy 1; the state-only walk fits them at occupancy 2)."""
    space = [dataclasses.replace(cfg, CHUNKS_PER_ITER=1) for cfg in fused_scan_fwd_configs(dims, arch)
             if not cfg.JOINT_OUTPUT]
    return list(dict.fromkeys([*space, segment_states_default_config(dims)])) if space else []


# The fused layout's blocks are sequential chains over the chunks: with fewer than this many (at its
# default tile) the staged layout's chunk-parallel launches win (forward.forward_layout).
FUSED_MIN_BLOCKS = 128
# The shortest segment the segmented layout cuts a sequence into, in chunks.
MIN_SEGMENT_CHUNKS = 8
# The longest piece segment_states walks (one block per piece, from a zero state): the segments before
# the last are cut into pieces of at most this many chunks, so that pass is many short chains (more pieces:
# more end states for the later segments to fold in).
MAX_PIECE_CHUNKS = 32


def fused_chains(dims: SSDDims) -> int:
    """The sequential chains of the fused layout at its default tile: (batch, head, headdim block) triples."""
    return dims.batch * dims.nheads * (dims.headdim // fused_scan_fwd_default_config(dims).BLOCK_P)


def _pieces_per_segment(segment_chunks: int) -> int:
    return -(-segment_chunks // MAX_PIECE_CHUNKS)


def fused_segment_chunks(dims: SSDDims) -> int:
    """Chunks per segment of the segmented layout: the sequence cut into the fewest power-of-two
    segments that bring the fused chains to FUSED_MIN_BLOCKS, none shorter than MIN_SEGMENT_CHUNKS,
    rounded up to a whole number of `state_piece_chunks` pieces; 0 where that is one segment (the
    segmented layout does not apply)."""
    segments = 1
    while (fused_chains(dims) * segments < FUSED_MIN_BLOCKS
           and dims.nchunks >= 2 * segments * MIN_SEGMENT_CHUNKS):
        segments *= 2
    if segments == 1:
        return 0
    chunks = -(-dims.nchunks // segments)
    pieces = _pieces_per_segment(chunks)
    return pieces * -(-chunks // pieces)


def state_piece_chunks(dims: SSDDims) -> int:
    """Chunks per piece of segment_states (a divisor of `fused_segment_chunks(dims)`, at most
    MAX_PIECE_CHUNKS); 0 without segments."""
    segment_chunks = fused_segment_chunks(dims)
    return segment_chunks // _pieces_per_segment(segment_chunks) if segment_chunks else 0


def num_segments(dims: SSDDims, segment_chunks: int) -> int:
    """Segments of `segment_chunks` chunks per sequence (one for 0: the whole sequence)."""
    return -(-dims.nchunks // segment_chunks) if segment_chunks else 1


def num_pieces(dims: SSDDims, segment_chunks: int, piece_chunks: int) -> int:
    """Pieces of `piece_chunks` chunks (dividing `segment_chunks`) in the segments before the last."""
    return (num_segments(dims, segment_chunks) - 1) * (segment_chunks // piece_chunks) if segment_chunks else 0


def fused_scan_fwd_grid(dims: SSDDims, cfg: FusedScanConfig, segment_chunks: int = 0) -> tuple[int, int, int]:
    return (dims.batch * dims.nheads, dims.headdim // cfg.BLOCK_P, num_segments(dims, segment_chunks))


def fused_scan_fwd_launch(dims: SSDDims, cfg: FusedScanConfig | None = None, segment_chunks: int = 0,
                          piece_chunks: int = 0, *, write_states: bool = False) -> Launch:
    """The launch writing ("out", "final_states"), and "states" (every chunk-entry state in x's dtype, as
    chunk_state writes them) with `write_states`; with `segment_chunks`, one block per segment, each
    starting from the entry state that the "seg_states" and "seg_decay" of the `piece_chunks`-chunk pieces
    before it give (`segment_states_launch`)."""
    cfg = cfg or fused_scan_fwd_default_config(dims)
    if cfg.JOINT_OUTPUT and dims.dstate != dims.chunk_size:
        raise ValueError(f"fused_scan_fwd_launch: JOINT_OUTPUT=True needs dstate == chunk_size, got "
                         f"dstate={dims.dstate}, chunk_size={dims.chunk_size}")
    return kernel_launch(
        select_kernel(FUSED_SCAN_FWD_KERNELS, dims, occupancy=cfg.OCCUPANCY, num_worker_warps=cfg.WORKER_WARPS),
        fused_scan_fwd_grid(dims, cfg, segment_chunks),
        writes=("out", "final_states") + (("states",) if write_states else ()), CHUNK=dims.chunk_size,
        DSTATE=dims.dstate, BLOCK_P=cfg.BLOCK_P, SEGMENT_CHUNKS=segment_chunks, PIECE_CHUNKS=piece_chunks,
        HAS_Z=dims.has_z, HAS_INIT=dims.has_init, HAS_SEQ_IDX=dims.has_seq_idx, HAS_REACH=dims.has_reach,
        WRITE_STATES=write_states,
        LOAD_LAT=cfg.LOAD_LAT, CHUNKS_PER_ITER=cfg.CHUNKS_PER_ITER, WEIGHT_X=cfg.WEIGHT_X,
        JOINT_OUTPUT=cfg.JOINT_OUTPUT)


def segmented_scan_launch(dims: SSDDims, cfg: FusedScanConfig | None = None, *,
                          write_states: bool = False) -> Launch:
    """`fused_scan_fwd_launch` with one block per `fused_segment_chunks(dims)`-chunk segment (the
    segmented layout), reading the "seg_states" and "seg_decay" of `segment_states_launch`."""
    return fused_scan_fwd_launch(dims, cfg, fused_segment_chunks(dims), state_piece_chunks(dims),
                                 write_states=write_states)


def segment_states_launch(dims: SSDDims, cfg: FusedScanConfig | None = None) -> Launch:
    """The launch writing ("seg_states", "seg_decay") for every `state_piece_chunks(dims)`-chunk piece of
    the segments but the last, one block per piece."""
    cfg = cfg or segment_states_default_config(dims)
    segment_chunks, piece_chunks = fused_segment_chunks(dims), state_piece_chunks(dims)
    return kernel_launch(
        select_kernel(SEGMENT_STATES_KERNELS, dims, occupancy=cfg.OCCUPANCY, num_worker_warps=cfg.WORKER_WARPS),
        (dims.batch * dims.nheads, dims.headdim // cfg.BLOCK_P, num_pieces(dims, segment_chunks, piece_chunks)),
        writes=("seg_states", "seg_decay"), CHUNK=dims.chunk_size, DSTATE=dims.dstate, BLOCK_P=cfg.BLOCK_P,
        PIECE_CHUNKS=piece_chunks, HAS_SEQ_IDX=dims.has_seq_idx, LOAD_LAT=cfg.LOAD_LAT, WEIGHT_X=cfg.WEIGHT_X)


# The fused kernel's key: no heads_per_group (a block owns one head), but the initial state it loads.
_FUSED_KEY_FIELDS = ("chunk_size", "headdim", "dstate", "dtype", "has_z", "has_init", "has_seq_idx")

FUSED_SCAN_STAGE = Stage(
    name="fused_scan", config_type=FusedScanConfig, space=fused_scan_fwd_configs,
    default=fused_scan_fwd_default_config, launch=fused_scan_fwd_launch, key_fields=_FUSED_KEY_FIELDS,
    # One block walks all chunks of one (batch, head, headdim block), as chunk_state.
    work_items=lambda d: d.batch * d.nheads)
# The segmented layout: the same kernels (and config types) with one block per piece / segment of a chain.
SEGMENT_STATES_STAGE = Stage(
    name="segment_states", config_type=FusedScanConfig, space=segment_states_configs,
    default=segment_states_default_config, launch=segment_states_launch,
    key_fields=("chunk_size", "headdim", "dstate", "dtype", "has_seq_idx"),
    work_items=lambda d: d.batch * d.nheads * num_pieces(d, fused_segment_chunks(d), state_piece_chunks(d)))
SEGMENTED_SCAN_STAGE = Stage(
    name="segmented_scan", config_type=FusedScanConfig, space=fused_scan_fwd_configs,
    default=fused_scan_fwd_default_config, launch=segmented_scan_launch, key_fields=_FUSED_KEY_FIELDS,
    work_items=lambda d: d.batch * d.nheads * num_segments(d, fused_segment_chunks(d)))
