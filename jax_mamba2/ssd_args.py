"""The arguments of the SSD op: the containers that the op, its backends and the eager path pass around, and
the checks of their shapes, dtypes and options (`ssd`'s value checks, which need the arrays' values, stay in
`jax_mamba2.op`), and what seq_idx means to every path: the packed sequences as the runs of one id
(`sequence_starts`, `sequence_numbers`)."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_mamba2.checks import as_int, check_array, check_float, check_ndim, check_seq_idx


class SSDInputs(NamedTuple):
    """The array arguments of the op (None where absent); see `ssd` for shapes. `reach` and `dx_reach`
    (batch, seqlen, nheads) are the op's own, not arguments: where the kernel backends confine non-finite
    values, 0 or NaN per (token, head), which their forward adds to each row of y (`reach`) and their backward
    to each row of dx (`dx_reach`)."""

    x: jax.Array
    dt: jax.Array
    A: jax.Array
    B: jax.Array
    C: jax.Array
    D: Optional[jax.Array]
    z: Optional[jax.Array]
    dt_bias: Optional[jax.Array]
    initial_states: Optional[jax.Array]
    seq_idx: Optional[jax.Array]
    reach: Optional[jax.Array] = None
    dx_reach: Optional[jax.Array] = None


@dataclasses.dataclass(frozen=True)
class SSDStatic:
    """The static options of the op (hashable: a custom_vjp nondiff argument, so each value of each option
    is a program of its own). See `ssd` for their meaning."""

    chunk_size: int
    dt_softplus: bool
    dt_limit: tuple[float, float]
    deterministic_backward: bool = False
    save_chunk_states: bool = True
    check_finite: bool = True


class Dims(NamedTuple):
    """The sizes `check_inputs` read off the arguments."""

    batch: int
    seqlen: int
    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    chunk_size: int  # as a Python int


def check_head_options(api, x, D, z, dt_bias):
    """D, z and dt_bias against x (..., nheads, headdim): shared by `ssd` and `ssd_step`."""
    nheads, headdim = x.shape[-2:]
    if D is not None:
        check_array(api, "D", D)  # an array of a float dtype
        if tuple(D.shape) not in ((nheads,), (nheads, headdim)):
            raise ValueError(f"{api}: D.shape={tuple(D.shape)} must be (nheads,)=({nheads},) "
                             f"or (nheads, headdim)=({nheads}, {headdim})")
    if z is not None:
        check_array(api, "z", z, "x.shape", x.shape)
    if dt_bias is not None:
        check_array(api, "dt_bias", dt_bias, "(nheads,)", (nheads,))


def check_model_sizes(api, nheads, headdim, dstate) -> None:
    """The model's sizes are at least 1 (batch and seqlen may be 0: an empty batch or sequence is data)."""
    for name, size in (("nheads", nheads), ("headdim", headdim), ("dstate", dstate)):
        if size < 1:
            raise ValueError(f"{api}: {name}={size} must be at least 1")


def check_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx) -> Dims:
    """The argument checks of `ssd` (arrays or anything with .shape and .dtype, e.g. ShapeDtypeStruct):
    raises ValueError / TypeError naming the argument and what it must be; returns the sizes."""
    api = "ssd"
    batch, seqlen, nheads, headdim = check_ndim(api, "x", x, 4, "(batch, seqlen, nheads, headdim)")
    check_float(api, "x", x)
    ngroups, dstate = check_ndim(api, "B", B, 4, "(batch, seqlen, ngroups, dstate)")[2:]
    check_array(api, "dt", dt, "(batch, seqlen, nheads)", (batch, seqlen, nheads))
    check_array(api, "A", A, "(nheads,)", (nheads,))
    check_array(api, "B", B, "(batch, seqlen, ngroups, dstate)", (batch, seqlen, ngroups, dstate))
    check_array(api, "C", C, "(batch, seqlen, ngroups, dstate)", (batch, seqlen, ngroups, dstate))
    check_model_sizes(api, nheads, headdim, dstate)
    if ngroups < 1 or nheads % ngroups:
        raise ValueError(f"ssd: nheads={nheads} must be divisible by ngroups={ngroups}")
    chunk = as_int(chunk_size)
    if chunk is None:
        raise TypeError(f"ssd: chunk_size={chunk_size!r} must be an int")
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"ssd: chunk_size={chunk} must be a power of two")
    check_head_options(api, x, D, z, dt_bias)
    if initial_states is not None:
        check_array(api, "initial_states", initial_states, "(batch, nheads, headdim, dstate)",
                     (batch, nheads, headdim, dstate))
    if seq_idx is not None:
        check_seq_idx(api, seq_idx, batch, seqlen)
    return Dims(batch, seqlen, nheads, headdim, ngroups, dstate, chunk)


def sequence_starts(seq_idx):
    """(b, L) ids of packed sequences -> (b, L) bool: where the id changes, the id before token 0 being 0."""
    return seq_idx != jnp.pad(seq_idx[:, :-1], ((0, 0), (1, 0)))


def sequence_numbers(seq_idx):
    """(b, L) ids of packed sequences -> (b, L) int32 numbers of the same sequences: the count of
    `sequence_starts` up to each token, so 0 where the first sequence's id is 0 and from 1 otherwise.

    The chunked algorithms give the initial state to a chunk's tokens whose id equals the one before the chunk,
    which for the first chunk is 0: with the ids themselves a sequence 0 after a first sequence of another id (a
    negative one) would take it too, wherever the two share the first chunk. The numbers reset where the ids
    change and only there, as the scan, and give 0 to the first sequence alone.
    """
    return jnp.cumsum(sequence_starts(seq_idx), axis=1, dtype=jnp.int32)
