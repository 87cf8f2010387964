"""Pure-JAX reference paths of the Mamba-2 SSD op: the lax.scan oracle and the chunked algorithm.

Semantics follow mamba_ssm's `mamba_chunk_scan_combined`. Per (batch, head), with head h reading group
h // (nheads // ngroups):

    Δ_t = dt_transform(dt_t)
    h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t ⊗ B_t        (state h_t: (headdim, dstate))
    y_t = h_t C_t + D ⊙ x_t ;  y_t ← y_t ⊙ silu(z_t) if z is given (gate after D)

With `seq_idx` (token -> packed sequence id, nondecreasing along seqlen) the state resets to 0 wherever the id
changes, and the id "before" token 0 is 0, so `initial_states` only reach a row's first sequence if its id is 0.

All dt math, decays, states and accumulations run in the compute dtype: float64 for float64 `x` (with x64
enabled), else float32; contractions use `Precision.HIGHEST`. Outputs `y` come back in `x.dtype` and states in
the compute dtype. Nothing here validates user input: `jax_mamba2.ssd` does that before calling in.

`ssd_chunked` is assembled from stages named like mamba_ssm's (and our cuTile) kernels: `chunk_cumsum`,
`chunk_state`, `state_passing`, `chunk_scan`. Stages take unpadded (batch, seqlen, ...) operands and pad
seqlen to a multiple of chunk_size internally. Heads are contracted in grouped form (g, r) with
r = nheads // ngroups, so B and C are never repeated to all heads.

Non-finite values reach what the recurrence carries them to and nothing else. The scan does this by itself.
The chunked algorithm mixes every token of a chunk in its matrix products, where a masked-out NaN or inf
still spoils the sum (0 * NaN = NaN), in the forward and in the transposed products of the backward; so
`ssd_chunked` runs the stages on the finite part of its inputs and adds a cheap per-(token, head) term that
is NaN from a non-finite input to the end of its sequence (see `nonfinite_reach`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_mamba2.ssd_args import sequence_numbers, sequence_starts

_HIGHEST = jax.lax.Precision.HIGHEST
_DEFAULT_DT_LIMIT = (0.0, math.inf)
# mamba_ssm's kernel softplus returns v unchanged above this threshold.
_SOFTPLUS_THRESHOLD = 20.0


def _compute_dtype(dtype) -> jnp.dtype:
    """float64 for float64 inputs, float32 for everything else (bf16/f16/f32)."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def _einsum(subscripts: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(subscripts, *operands, precision=_HIGHEST)


def _split_heads(a: jax.Array, ngroups: int, axis: int) -> jax.Array:
    """Reshapes the nheads axis `axis` of `a` into (ngroups, nheads // ngroups)."""
    axis = axis % a.ndim
    nheads = a.shape[axis]
    return a.reshape(a.shape[:axis] + (ngroups, nheads // ngroups) + a.shape[axis + 1:])


def _to_chunks(a: jax.Array, nchunks: int, chunk_size: int, *, mode: str = "constant") -> jax.Array:
    """Pads axis 1 (seqlen) of `a` to nchunks * chunk_size and splits it: (b, L, ...) -> (b, c, q, ...)."""
    pad = nchunks * chunk_size - a.shape[1]
    assert 0 <= pad < chunk_size, (a.shape, nchunks, chunk_size)
    widths = [(0, 0)] * a.ndim
    widths[1] = (0, pad)
    a = jnp.pad(a, widths, mode=mode)
    return a.reshape((a.shape[0], nchunks, chunk_size) + a.shape[2:])


def _skip(y: jax.Array, x: jax.Array, D: jax.Array | None) -> jax.Array:
    """y + D ⊙ x in y's dtype (y itself without D).

    Args:
      y: (..., nheads, headdim), compute dtype: the SSM output h_t C_t.
      x: (..., nheads, headdim), any float dtype.
      D: (nheads,) or (nheads, headdim), or None.
    """
    if D is None:
        return y
    D = D.astype(y.dtype)
    return y + (D[:, None] if D.ndim == 1 else D) * x.astype(y.dtype)


def _skip_and_gate(y: jax.Array, x: jax.Array, D: jax.Array | None, z: jax.Array | None) -> jax.Array:
    """Adds the D skip (`_skip`), then applies the silu(z) gate; returns x.dtype.

    Args:
      y, x, D: as in `_skip`.
      z: (..., nheads, headdim), or None.
    """
    y = _skip(y, x, D)
    if z is not None:
        y = _gate(y, z.astype(y.dtype))
    return y.astype(x.dtype)


@jax.custom_jvp
def _gate(y: jax.Array, z: jax.Array) -> jax.Array:
    """y * silu(z), whose derivative in y is silu of z's finite part: a non-finite z makes its own token's output
    (and z's own gradient there) non-finite, but not, through 0 * silu(z) in the backward, the cotangent of y that
    the recurrence carries to earlier tokens; as the kernels' backward, which takes z's finite part."""
    return y * jax.nn.silu(z)


@_gate.defjvp
def _gate_jvp(primals, tangents):
    (y, z), (dy, dz) = primals, tangents
    silu_z, dsilu_z = jax.jvp(jax.nn.silu, (z,), (dz,))
    return y * silu_z, dy * jax.nn.silu(finite_part(z)) + y * dsilu_z


def dt_transform(dt: jax.Array, dt_bias: jax.Array | None = None, *, dt_softplus: bool = False,
                 dt_limit: tuple[float, float] = _DEFAULT_DT_LIMIT) -> jax.Array:
    """Turns raw dt into the time step Δ = clip(softplus(dt + dt_bias), *dt_limit).

    The softplus is mamba_ssm's kernel form, `log(exp(v) + 1)` for v <= 20 and `v` above (not log1p, to match
    its rounding for small Δ). The clip is applied only when dt_limit differs from (0, inf).

    Args:
      dt: (..., nheads), any float dtype.
      dt_bias: (nheads,), or None.
      dt_softplus: whether to apply the softplus.
      dt_limit: (dt_min, dt_max) clip range.

    Returns:
      Δ: (..., nheads) in the compute dtype of dt (float64 for float64, else float32).
    """
    cdt = _compute_dtype(dt.dtype)
    v = dt.astype(cdt)
    if dt_bias is not None:
        v = v + dt_bias.astype(cdt)
    if dt_softplus:
        below = v <= _SOFTPLUS_THRESHOLD
        # Double where: exp of the unselected large v would overflow and poison the gradient with inf * 0.
        v_safe = jnp.where(below, v, 0.0)
        v = jnp.where(below, jnp.log(jnp.exp(v_safe) + 1.0), v)
    if tuple(dt_limit) != _DEFAULT_DT_LIMIT:
        # Selects, not jnp.clip: a Δ on a bound keeps its whole gradient (the clip would split it with the bound),
        # as mamba_ssm's backward and the kernels' zero it only strictly outside the range.
        low, high = dt_limit
        v = jnp.where(v < low, low, jnp.where(v > high, high, v))
    return v


def negative_steps_as_nan(delta: jax.Array) -> jax.Array:
    """Δ with NaN where it is negative.

    Δ >= 0 is a precondition of `ssd`, which it checks only where dt is concrete. A negative Δ grows the state,
    and the chunked algorithms cannot follow growth (they clamp every decay to exp(<= 0)), so each backend's
    values would be its own. As NaN it is a non-finite dt on every backend instead: NaN for its head from its
    token to the end of its sequence, and nothing else.
    """
    return jnp.where(delta < 0, jnp.nan, delta)


def _state_update(h: jax.Array, x: jax.Array, delta: jax.Array, A: jax.Array, B: jax.Array,
                  C: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One step of the recurrence in grouped-head form, all in the compute dtype.

    Args:
      h: (b, g, r, p, n) state h_{t-1}.
      x: (b, g, r, p).
      delta: (b, g, r), Δ_t.
      A: (g, r).
      B, C: (b, g, n).

    Returns:
      (h_t (b, g, r, p, n), h_t C_t (b, g, r, p)).
    """
    decay = jnp.exp(delta * A)
    h = decay[..., None, None] * h + _einsum("bgrp,bgn->bgrpn", x * delta[..., None], B)
    return h, _einsum("bgrpn,bgn->bgrp", h, C)


def ssd_scan(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=_DEFAULT_DT_LIMIT, initial_states=None, seq_idx=None):
    """The SSD recurrence as a lax.scan over time: the exact oracle (a negative Δ, outside the precondition
    Δ >= 0, as NaN, as on the chunked path: `negative_steps_as_nan`).

    Args:
      x: (batch, seqlen, nheads, headdim), bf16/f16/f32/f64.
      dt: (batch, seqlen, nheads), raw time steps.
      A: (nheads,), negative.
      B, C: (batch, seqlen, ngroups, dstate).
      D: (nheads,) or (nheads, headdim), or None.
      z: (batch, seqlen, nheads, headdim) gate, or None.
      dt_bias: (nheads,), or None.
      dt_softplus: apply softplus to dt + dt_bias.
      dt_limit: (dt_min, dt_max) clip of Δ.
      initial_states: (batch, nheads, headdim, dstate), or None (zeros).
      seq_idx: (batch, seqlen) int32 nondecreasing sequence ids, or None.

    Returns:
      (y (batch, seqlen, nheads, headdim) in x.dtype,
       final_states (batch, nheads, headdim, dstate) in the compute dtype).
    """
    cdt = _compute_dtype(x.dtype)
    batch, _, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    delta = negative_steps_as_nan(dt_transform(dt.astype(cdt), dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit))

    def time_major(a):
        return jnp.moveaxis(_split_heads(a.astype(cdt), ngroups, axis=2), 1, 0)

    xs = (time_major(x), time_major(delta), jnp.moveaxis(B.astype(cdt), 1, 0),
          jnp.moveaxis(C.astype(cdt), 1, 0))
    if seq_idx is not None:
        previous_ids = jnp.pad(seq_idx[:, :-1], ((0, 0), (1, 0)))  # the id before token 0 is 0
        xs += (jnp.moveaxis(seq_idx != previous_ids, 1, 0),)
    A_gr = _split_heads(A.astype(cdt), ngroups, axis=0)

    def step(h, inputs):
        x_t, delta_t, B_t, C_t = inputs[:4]
        if seq_idx is not None:
            h = jnp.where(inputs[4][:, None, None, None, None], 0.0, h)
        return _state_update(h, x_t, delta_t, A_gr, B_t, C_t)

    if initial_states is None:
        # zeros_like keeps x's shard_map varying axes, so the scan carry type does not change.
        h0 = jnp.zeros_like(x, shape=(batch, nheads, headdim, dstate), dtype=cdt)
    else:
        h0 = initial_states.astype(cdt)
    h_final, y = jax.lax.scan(step, _split_heads(h0, ngroups, axis=1), xs)
    y = jnp.moveaxis(y, 0, 1).reshape(x.shape)
    return _skip_and_gate(y, x, D, z), h_final.reshape(h0.shape)


def ssd_step(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=_DEFAULT_DT_LIMIT):
    """One decode step of the recurrence (mamba_ssm `selective_state_update` semantics, plus dt_limit).

    Args:
      state: (batch, nheads, headdim, dstate) h_{t-1}, any float dtype.
      x: (batch, nheads, headdim).
      dt: (batch, nheads), raw time step.
      A: (nheads,), negative.
      B, C: (batch, ngroups, dstate).
      D: (nheads,) or (nheads, headdim), or None.
      z: (batch, nheads, headdim) gate, or None.
      dt_bias, dt_softplus, dt_limit: as in `ssd_scan`.

    Returns:
      (y (batch, nheads, headdim) in x.dtype, new_state (batch, nheads, headdim, dstate) in state.dtype).
      The update runs in the compute dtype of x; the new state is rounded to state.dtype once.
    """
    cdt = _compute_dtype(x.dtype)
    ngroups = B.shape[1]
    delta = dt_transform(dt.astype(cdt), dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    h, y = _state_update(
        _split_heads(state.astype(cdt), ngroups, axis=1),
        _split_heads(x.astype(cdt), ngroups, axis=1),
        _split_heads(delta, ngroups, axis=1),
        _split_heads(A.astype(cdt), ngroups, axis=0),
        B.astype(cdt), C.astype(cdt))
    return _skip_and_gate(y.reshape(x.shape), x, D, z), h.reshape(state.shape).astype(state.dtype)


def chunk_cumsum(dt, A, chunk_size, dt_bias=None, dt_softplus=False, dt_limit=_DEFAULT_DT_LIMIT):
    """Stage 1: time steps and their per-chunk decay cumsum.

    Δ is computed by `dt_transform` and then zero-padded to a multiple of chunk_size, so dA_cumsum stays flat
    past the end of the sequence and dA_cumsum[..., -1] of the last chunk is its last valid value.

    Args:
      dt: (batch, seqlen, nheads), raw time steps.
      A: (nheads,), negative.
      chunk_size: Q.
      dt_bias, dt_softplus, dt_limit: as in `dt_transform`.

    Returns:
      (dt_out, dA_cumsum), both (batch, nheads, nchunks, chunk_size) in the compute dtype of dt:
      dt_out = Δ (0 on padding), dA_cumsum[..., l] = Σ_{r <= l} Δ_r A within each chunk.
    """
    delta = dt_transform(dt, dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    nchunks = -(-dt.shape[1] // chunk_size)
    dt_out = jnp.moveaxis(_to_chunks(delta, nchunks, chunk_size), 3, 1)  # (b, h, c, q)
    dA_cumsum = jnp.cumsum(dt_out * A.astype(delta.dtype)[:, None, None], axis=-1)
    return dt_out, dA_cumsum


def _seq_idx_chunks(seq_idx, nchunks, chunk_size):
    """(b, L) -> (b, c, q) ids, padded with the last id so position q-1 is the chunk's last VALID token's id."""
    return _to_chunks(seq_idx, nchunks, chunk_size, mode="edge")


def chunk_state(B, x, dt_out, dA_cumsum, seq_idx=None):
    """Stage 2: each chunk's local end-of-chunk state, starting from zero.

    states[c] = Σ_s exp(min(dA_cumsum[c, -1] - dA_cumsum[c, s], 0)) Δ_s x_s ⊗ B_s, over the tokens s of chunk c
    whose seq_idx equals that of the chunk's last valid token.

    Args:
      B: (batch, seqlen, ngroups, dstate).
      x: (batch, seqlen, nheads, headdim).
      dt_out, dA_cumsum: (batch, nheads, nchunks, chunk_size) from `chunk_cumsum`, compute dtype.
      seq_idx: (batch, seqlen) int32, or None.

    Returns:
      states: (batch, nchunks, nheads, headdim, dstate) in the compute dtype.
    """
    cdt = dt_out.dtype
    _, nheads, nchunks, chunk_size = dt_out.shape
    ngroups = B.shape[2]
    decay = jnp.exp(jnp.minimum(dA_cumsum[..., -1:] - dA_cumsum, 0.0))
    weights = jnp.moveaxis(decay * dt_out, 1, 3)  # (b, c, q, h)
    if seq_idx is not None:
        ids = _seq_idx_chunks(seq_idx, nchunks, chunk_size)
        weights = jnp.where((ids == ids[:, :, -1:])[..., None], weights, 0.0)
    x_weighted = _to_chunks(x.astype(cdt), nchunks, chunk_size) * weights[..., None]
    states = _einsum("bcqgn,bcqgrp->bcgrpn", _to_chunks(B.astype(cdt), nchunks, chunk_size),
                     _split_heads(x_weighted, ngroups, axis=3))
    return states.reshape(states.shape[:2] + (nheads,) + states.shape[4:])


def state_passing(states, dA_chunk_cumsum, initial_states=None, seq_idx_chunk_end=None):
    """Stage 3: the sequential pass over chunks that turns local states into chunk-entry states.

    H_0 = initial_states; H_{c+1} = keep_c exp(dA_chunk_cumsum[c]) H_c + states[c]; final_states = H_nchunks,
    where keep_c = 0 if the seq_idx at the end of chunk c differs from that at the end of chunk c-1 (the id
    before chunk 0 is 0), else 1. Memory is O(nchunks) (one lax.scan).

    Args:
      states: (batch, nchunks, nheads, headdim, dstate) from `chunk_state`, compute dtype.
      dA_chunk_cumsum: (batch, nheads, nchunks), dA_cumsum[..., -1].
      initial_states: (batch, nheads, headdim, dstate), or None (zeros).
      seq_idx_chunk_end: (batch, nchunks) int32 id of each chunk's last valid token, or None.

    Returns:
      (entry_states (batch, nchunks, nheads, headdim, dstate): the state entering each chunk,
       final_states (batch, nheads, headdim, dstate)), both in the compute dtype.
    """
    cdt = states.dtype
    scale = jnp.moveaxis(jnp.exp(dA_chunk_cumsum), 2, 0)[..., None, None]  # (c, b, h, 1, 1)
    if seq_idx_chunk_end is not None:
        previous_ids = jnp.pad(seq_idx_chunk_end[:, :-1], ((0, 0), (1, 0)))
        keep = (seq_idx_chunk_end == previous_ids).T  # (c, b)
        scale = jnp.where(keep[:, :, None, None, None], scale, 0.0)
    if initial_states is None:
        h0 = jnp.zeros_like(states[:, 0])  # keeps shard_map varying axes (a scan carry)
    else:
        h0 = initial_states.astype(cdt)

    def step(h, inputs):
        local_state, chunk_scale = inputs
        return chunk_scale * h + local_state, h

    final_states, entry_states = jax.lax.scan(step, h0, (jnp.moveaxis(states, 1, 0), scale))
    return jnp.moveaxis(entry_states, 0, 1), final_states


def chunk_scan(B, C, x, dt_out, dA_cumsum, entry_states, D=None, z=None, seq_idx=None):
    """Stage 4: the outputs, intra-chunk ("attention" form) plus inter-chunk (from the entry state).

    For token l of chunk c (ids = seq_idx):
      y_l = [ids_l == id_prev(c)] exp(dA_l) C_l · H_c
            + Σ_{s <= l, ids_s == ids_l} (C_l · B_s) exp(min(dA_l - dA_s, 0)) Δ_s x_s
      then the D skip and the silu(z) gate, where id_prev(c) is the id of chunk c-1's last token (0 for c=0).

    Args:
      B, C: (batch, seqlen, ngroups, dstate).
      x: (batch, seqlen, nheads, headdim).
      dt_out, dA_cumsum: (batch, nheads, nchunks, chunk_size) from `chunk_cumsum`, compute dtype.
      entry_states: (batch, nchunks, nheads, headdim, dstate) from `state_passing`, compute dtype.
      D: (nheads,) or (nheads, headdim), or None.
      z: (batch, seqlen, nheads, headdim), or None.
      seq_idx: (batch, seqlen) int32, or None.

    Returns:
      y: (batch, seqlen, nheads, headdim) in x.dtype.
    """
    y = _chunk_scan_ssm(B, C, x, dt_out, dA_cumsum, entry_states, seq_idx)
    return _skip_and_gate(y, x, D, z)


def _chunk_scan_ssm(B, C, x, dt_out, dA_cumsum, entry_states, seq_idx):
    """`chunk_scan` before the D skip and the gate: (batch, seqlen, nheads, headdim) in the compute dtype."""
    cdt = dt_out.dtype
    batch, seqlen, nheads, headdim = x.shape
    _, _, nchunks, chunk_size = dt_out.shape
    ngroups = B.shape[2]
    B_chunks = _to_chunks(B.astype(cdt), nchunks, chunk_size)  # (b, c, q, g, n)
    C_chunks = _to_chunks(C.astype(cdt), nchunks, chunk_size)
    x_chunks = _split_heads(_to_chunks(x.astype(cdt), nchunks, chunk_size), ngroups, axis=3)  # (b,c,q,g,r,p)
    dA = _split_heads(jnp.moveaxis(dA_cumsum, 1, 2), ngroups, axis=2)  # (b, c, g, r, q)
    dt_s = _split_heads(jnp.moveaxis(dt_out, 1, 2), ngroups, axis=2)

    # Intra-chunk: masked decay-weighted C B^T, one per group, shared by the group's heads.
    CB = _einsum("bclgn,bcsgn->bcgls", C_chunks, B_chunks)[:, :, :, None]  # (b, c, g, 1, l, s)
    decay = jnp.exp(jnp.minimum(dA[..., :, None] - dA[..., None, :], 0.0))  # (b, c, g, r, l, s)
    mask = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    if seq_idx is not None:
        ids = _seq_idx_chunks(seq_idx, nchunks, chunk_size)  # (b, c, q)
        mask = mask & (ids[:, :, :, None] == ids[:, :, None, :])[:, :, None, None]
    scores = jnp.where(mask, CB * decay * dt_s[..., None, :], 0.0)
    y = _einsum("bcgrls,bcsgrp->bclgrp", scores, x_chunks)

    # Inter-chunk: the state entering the chunk, decayed to each row.
    entry = _split_heads(entry_states.astype(cdt), ngroups, axis=2)  # (b, c, g, r, p, n)
    y_inter = _einsum("bclgn,bcgrpn->bclgrp", C_chunks, entry)
    row_scale = jnp.exp(jnp.moveaxis(dA, 4, 2))  # (b, c, l, g, r)
    if seq_idx is not None:
        previous_end_ids = jnp.pad(ids[:, :-1, -1], ((0, 0), (1, 0)))  # (b, c)
        row_scale = jnp.where((ids == previous_end_ids[:, :, None])[..., None, None], row_scale, 0.0)
    y = y + y_inter * row_scale[..., None]
    # Heads, then tokens: one merge per reshape, which explicitly sharded groups (heads) can follow.
    y = y.reshape(batch, nchunks, chunk_size, nheads, headdim)
    return y.reshape(batch, nchunks * chunk_size, nheads, headdim)[:, :seqlen]


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def finite_part(a: jax.Array | None) -> jax.Array | None:
    """a with its non-finite entries replaced by 0 (a select: no NaN reaches the gradient of the others)."""
    return None if a is None else jnp.where(jnp.isfinite(a), a, 0.0)


@jax.custom_vjp
def _finite_cotangent(a: jax.Array) -> jax.Array:
    """The identity, whose backward zeroes non-finite cotangents.

    Placed on the outputs of the stages run on finite inputs: their backward is a chain of dense products
    over the tokens of a chunk, in which one NaN cotangent would reach every token. Non-finite cotangents
    travel back through `nonfinite_reach` instead, which keeps them in their sequence. (A custom VJP, so
    the chunked path, like the kernel backends, supports reverse-mode differentiation only.)
    """
    return a


def _finite_cotangent_fwd(a):
    return a, None


def _finite_cotangent_bwd(_, cotangent):
    return (jnp.where(jnp.isfinite(cotangent), cotangent, 0.0),)


_finite_cotangent.defvjp(_finite_cotangent_fwd, _finite_cotangent_bwd)


@jax.custom_vjp
def _spread_nonfinite(marks: jax.Array, starts: jax.Array) -> jax.Array:
    """NaN from each non-finite entry of `marks` (b, L, h) to the end of its segment, 0 elsewhere.

    Segments of axis 1 begin where `starts` (b, L) is True. The backward spreads each non-finite cotangent
    back to the start of its segment in the same way (0 elsewhere): used on marks that are `0 * v`, whose
    cotangent only says whether it is finite, this is the derivative. Both directions compare positions
    (two running maxima), so no NaN crosses a segment start, which differences of cumsums would not give.
    """
    return _spread_forward(marks, starts)


def _spread_forward(marks, starts):
    positions = jnp.arange(marks.shape[1])[None, :]
    last_nonfinite = jax.lax.cummax(jnp.where(~jnp.isfinite(marks), positions[..., None], -1), axis=1)
    segment_start = jax.lax.cummax(jnp.where(starts, positions, 0), axis=1)
    return jnp.where(last_nonfinite >= segment_start[..., None], jnp.nan, 0.0).astype(marks.dtype)


def _spread_nonfinite_fwd(marks, starts):
    return _spread_forward(marks, starts), starts


def _spread_nonfinite_bwd(starts, cotangent):
    seqlen = cotangent.shape[1]
    positions = jnp.arange(seqlen)[None, :]
    ends = jnp.pad(starts[:, 1:], ((0, 0), (0, 1)), constant_values=True)  # the last token of a segment
    next_nonfinite = jax.lax.cummin(jnp.where(~jnp.isfinite(cotangent), positions[..., None], seqlen),
                                    axis=1, reverse=True)
    segment_end = jax.lax.cummin(jnp.where(ends, positions, seqlen - 1), axis=1, reverse=True)
    spread = jnp.where(next_nonfinite <= segment_end[..., None], jnp.nan, 0.0).astype(cotangent.dtype)
    return spread, None


_spread_nonfinite.defvjp(_spread_nonfinite_fwd, _spread_nonfinite_bwd)


def head_marks(x: jax.Array) -> jax.Array:
    """x (b, L, h, p) -> (b, L, h): 0 where a (token, head) row of x is finite, NaN where an entry is not (the
    sum of 0 * x over headdim; its VJP passes a cotangent on as 0 * cotangent to every entry of the row)."""
    return jnp.sum(0 * x, axis=3)


def nonfinite_reach(x_marks, delta, A, B, C, initial_states, seq_idx):
    """Where the recurrence carries the non-finite entries of its inputs: 0 there is finite, NaN not.

    Per (token, head): a non-finite x, Δ or B of token s (B of the head's group) reaches token s and every
    later token of its sequence (through the state); a non-finite C only its own token; a non-finite
    initial state the tokens before the first sequence start; a non-finite A every token. The final state
    of a head is reached by what reaches the last token, C excepted. (Coarser than the recurrence within
    a head: a NaN in one headdim or dstate entry marks all of the head's entries.)

    `0 * v` is 0 where v is finite and NaN where not, and passes a cotangent on as 0 * cotangent, so a
    non-finite cotangent travels back to the same inputs, within the same sequence (`_spread_nonfinite`),
    and a finite one adds exactly 0.

    Args:
      x_marks: (b, L, h), x's `head_marks`; delta: (b, L, h); A: (h,); B, C: (b, L, g, n); initial_states:
        (b, h, p, n) or None; seq_idx: (b, L) int or None. Floats in the compute dtype.

    Returns:
      (reach_y (b, L, h), reach_final (b, h)).
    """
    batch, seqlen, nheads = x_marks.shape
    ngroups = B.shape[2]

    def per_head(group_term):  # (b, L, g) -> (b, L, h)
        return jnp.repeat(group_term, nheads // ngroups, axis=2)

    carried = x_marks + 0 * delta + per_head(jnp.sum(0 * B, axis=3))
    if seq_idx is None:
        starts = jnp.zeros((batch, seqlen), bool)
    else:
        starts = sequence_starts(seq_idx)
    reach_y = _spread_nonfinite(carried, starts) + 0 * A
    reach_final = reach_y[:, -1]
    reach_y = reach_y + per_head(jnp.sum(0 * C, axis=3))
    if initial_states is not None:
        initial = jnp.sum(0 * initial_states, axis=(2, 3))  # (b, h)
        before_first_start = jnp.cumsum(starts, axis=1) == 0  # (b, L)
        reach_y = reach_y + jnp.where(before_first_start[..., None], initial[:, None], 0.0)
        reach_final = reach_final + jnp.where(before_first_start[:, -1:], initial, 0.0)
    return reach_y, reach_final


def ssd_chunked(x, dt, A, B, C, chunk_size, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                dt_limit=_DEFAULT_DT_LIMIT, initial_states=None, seq_idx=None):
    """The chunked SSD algorithm in pure JAX (mamba_ssm's forward pipeline); O(seqlen) memory, any seqlen.

    The stages and the D skip run on the finite part of the inputs; `nonfinite_reach` marks with NaN what
    the non-finite part reaches (its token's head from that token to the end of its sequence, and the final
    state when that is the last sequence). Gradients stay finite wherever the recurrence's do, and a
    non-finite cotangent reaches only the inputs of its own sequence (and A and dt_bias, which every
    sequence shares; D's gradient takes the finite part of x and of the cotangent). The gradient at a
    non-finite input itself is unspecified. A negative Δ counts as a non-finite dt (`negative_steps_as_nan`).
    Differentiable in reverse mode.

    Args:
      x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states, seq_idx: as in `ssd_scan`.
      chunk_size: Q, the chunk length (static int); seqlen needs not be a multiple of it. A chunk longer
        than the sequence would only pad it, so Q is capped at the smallest power of two >= seqlen (the
        intra-chunk products are Q x Q per chunk and head).

    Returns:
      (y (batch, seqlen, nheads, headdim) in x.dtype,
       final_states (batch, nheads, headdim, dstate) in the compute dtype).
    """
    cdt = _compute_dtype(x.dtype)
    if isinstance(x.shape[1], int):  # a symbolic seqlen (shape-polymorphic export) keeps the chunk size
        chunk_size = min(chunk_size, _pow2_at_least(x.shape[1]))
    x_c, A_c, B_c, C_c = (a.astype(cdt) for a in (x, A, B, C))
    h0 = None if initial_states is None else initial_states.astype(cdt)
    delta = negative_steps_as_nan(dt_transform(dt.astype(cdt), dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit))

    seq_idx = None if seq_idx is None else sequence_numbers(seq_idx)
    x_f, delta_f, A_f, B_f, C_f, h0_f = map(finite_part, (x_c, delta, A_c, B_c, C_c, h0))
    dt_out, dA_cumsum = chunk_cumsum(delta_f, A_f, chunk_size)  # delta is transformed already
    states = chunk_state(B_f, x_f, dt_out, dA_cumsum, seq_idx)
    seq_idx_chunk_end = None
    if seq_idx is not None:
        seq_idx_chunk_end = _seq_idx_chunks(seq_idx, dt_out.shape[2], chunk_size)[:, :, -1]
    entry_states, final_states = state_passing(states, dA_cumsum[..., -1], h0_f, seq_idx_chunk_end)
    y = _chunk_scan_ssm(B_f, C_f, x_f, dt_out, dA_cumsum, entry_states, seq_idx)

    # The D skip joins the stages, on x's finite part and behind their cotangent guard, as in the kernels: D is
    # shared by every sequence, and dD = Σ dy x of x itself would be NaN for one non-finite x or cotangent in any
    # of them (the reach term marks that x's own token in y).
    y = _finite_cotangent(_skip(y, x_f, D))

    reach_y, reach_final = nonfinite_reach(head_marks(x_c), delta, A_c, B_c, C_c, h0, seq_idx)
    y = y + reach_y[..., None]
    final_states = _finite_cotangent(final_states) + reach_final[..., None, None]
    return _skip_and_gate(y, x, None, z), final_states
