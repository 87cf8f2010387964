"""Non-finite confinement checks shared by the xla, emulated-kernel and GPU tests.

A backend confines non-finite values as the recurrence does when, against the float64 scan on the same
inputs: its outputs are non-finite at exactly the (token, head) and final-state heads where the scan's are;
every gradient entry that is finite for the scan is finite for it; and the finite entries agree.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_mamba2 import reference

FLOAT_ARGS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
# Three sequences in row 0 (tokens 0-19, 20-44, 45-99), two in row 1 (0-36, 37-99).
SEQUENCE_LENGTHS = ((20, 25, 55), (37, 63))


@dataclasses.dataclass(frozen=True)
class Spoil:
    """One non-finite entry (or slice) written into an input, or into the loss weight of y."""

    name: str                  # an input of FLOAT_ARGS, or "weight_y" for a NaN cotangent
    index: tuple
    value: float = float("nan")


def seq_idx(seqlen: int) -> np.ndarray:
    rows = []
    for lengths in SEQUENCE_LENGTHS:
        ids = np.repeat(np.arange(len(lengths)), lengths)[:seqlen]
        rows.append(np.pad(ids, (0, seqlen - len(ids)), mode="edge"))
    return np.stack(rows).astype(np.int32)


def make_problem(seed: int, *, seqlen=100, nheads=4, headdim=16, ngroups=2, dstate=16, segmented=True,
                 spoil: Optional[Spoil] = None):
    """(inputs: dict of FLOAT_ARGS + seq_idx, weights: (w_y, w_final)), float32, every option on."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 11)
    batch = len(SEQUENCE_LENGTHS)
    normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32)  # noqa: E731
    inputs = {
        "x": normal(keys[0], (batch, seqlen, nheads, headdim)),
        "dt": jax.random.uniform(keys[1], (batch, seqlen, nheads), jnp.float32, -3.0, 1.0),
        "A": -jnp.exp(jax.random.uniform(keys[2], (nheads,), jnp.float32, -2.0, 1.0)),
        "B": normal(keys[3], (batch, seqlen, ngroups, dstate)),
        "C": normal(keys[4], (batch, seqlen, ngroups, dstate)),
        "D": normal(keys[5], (nheads,)),
        "z": normal(keys[6], (batch, seqlen, nheads, headdim)),
        "dt_bias": jax.random.uniform(keys[7], (nheads,), jnp.float32, -0.5, 0.5),
        "initial_states": normal(keys[8], (batch, nheads, headdim, dstate)),
        "seq_idx": jnp.asarray(seq_idx(seqlen)) if segmented else None,
    }
    weights = {"y": normal(keys[9], inputs["x"].shape), "final": normal(keys[10], inputs["initial_states"].shape)}
    if spoil is not None:
        target = weights if spoil.name == "weight_y" else inputs
        key = "y" if spoil.name == "weight_y" else spoil.name
        target[key] = target[key].at[spoil.index].set(spoil.value)
    return inputs, weights


def _ssd(ssd_fn: Callable, float_args: dict, seq_idx, dt_softplus: bool):
    return ssd_fn(float_args["x"], float_args["dt"], float_args["A"], float_args["B"], float_args["C"],
                  D=float_args["D"], z=float_args["z"], dt_bias=float_args["dt_bias"], dt_softplus=dt_softplus,
                  initial_states=float_args["initial_states"], seq_idx=seq_idx)


def outputs_and_grads(ssd_fn: Callable, inputs: dict, weights: dict, *, nonlinear: bool, dt_softplus: bool = True):
    """((y, final_states), grads of FLOAT_ARGS) of sum(f(y) w_y) + sum(f(final) w_final), f = sin or id.

    sin makes the cotangent of a non-finite output non-finite too, as any non-linear layer after the op.
    Jitted: the op sees tracers, whose values it does not check."""
    run = _jitted_outputs_and_grads(ssd_fn, nonlinear, dt_softplus)
    return run({name: inputs[name] for name in FLOAT_ARGS}, inputs["seq_idx"], weights)


@functools.cache
def _jitted_outputs_and_grads(ssd_fn: Callable, nonlinear: bool, dt_softplus: bool):
    f = jnp.sin if nonlinear else (lambda v: v)

    @jax.jit
    def run(float_args, seq_idx, weights):
        def loss(float_args):
            y, final = _ssd(ssd_fn, float_args, seq_idx, dt_softplus)
            return (jnp.sum(f(y.astype(jnp.float32)) * weights["y"].astype(y.dtype))
                    + jnp.sum(f(final) * weights["final"].astype(final.dtype)))
        return _ssd(ssd_fn, float_args, seq_idx, dt_softplus), jax.grad(loss)(float_args)

    return run


def scan_oracle(inputs: dict, weights: dict, *, nonlinear: bool, dt_softplus: bool = True):
    """`outputs_and_grads` of the float64 scan, as NumPy arrays."""
    with jax.enable_x64(True):
        as64 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float64) if a.dtype == jnp.float32 else a, t)  # noqa: E731
        out = outputs_and_grads(reference.ssd_scan, as64(inputs), as64(weights), nonlinear=nonlinear,
                                dt_softplus=dt_softplus)
        return jax.tree.map(np.asarray, out)


def _finite_per_head(a: np.ndarray, head_axes: int) -> np.ndarray:
    """Whether every entry of a's trailing (head) axes past the first `head_axes` is finite."""
    a = np.asarray(a, np.float64)
    return np.isfinite(a).reshape(a.shape[:head_axes] + (-1,)).all(axis=-1)


def _may_be_nonfinite(name: str, want_grad: np.ndarray, seq_ids) -> np.ndarray:
    """Where a chunked backend's gradient may be non-finite: where the scan's is, and, as the chunked
    backends mark a whole head of a token non-finite where the scan marks one entry, anywhere in a
    (batch row, sequence) or (batch row, head) whose scan gradient has a non-finite entry."""
    bad = ~np.isfinite(want_grad)
    if name == "initial_states":
        return np.broadcast_to(bad.any(axis=(2, 3), keepdims=True), bad.shape)
    if want_grad.ndim < 3:  # A, D, dt_bias: per head
        return bad
    ids = np.zeros(want_grad.shape[:2], np.int32) if seq_ids is None else np.asarray(seq_ids)
    per_token = bad.reshape(bad.shape[:2] + (-1,)).any(axis=-1)  # (batch, seqlen)
    spoiled_sequence = np.zeros_like(per_token)
    for b in range(ids.shape[0]):
        spoiled_sequence[b] = np.isin(ids[b], ids[b][per_token[b]])
    return np.broadcast_to(spoiled_sequence.reshape(per_token.shape + (1,) * (bad.ndim - 2)), bad.shape)


def assert_confined_like_scan(got, want, spoiled_inputs: dict, tolerance: float, seq_ids=None):
    """got, want: ((y, final), grads) of a backend and of `scan_oracle`; spoiled_inputs: {name: index}.

    y and final_states must be non-finite at the scan's (batch, token, head) and (batch, head), and equal to
    the scan's elsewhere. A gradient may be non-finite only within what the scan's gradient spoils
    (`_may_be_nonfinite`) and must equal the scan's outside it (inside, finite entries may differ: the
    chunked path runs on the finite part of the inputs, so e.g. an infinite Δ, which makes the scan forget
    the state, leaves the state to the finite part there). Where the scan's dx has a non-finite entry in a
    (batch, token, head) row, the backend's dx row is wholly non-finite (a non-finite cotangent does reach x),
    the token of a spoiled input aside (the scan's dx there may be non-finite through its own factors, e.g. an
    infinite Δ, where the gradient is unspecified)."""
    (y, final), grads = got
    (want_y, want_final), want_grads = want
    np.testing.assert_array_equal(_finite_per_head(y, 3), _finite_per_head(want_y, 3),
                                  "y: non-finite (batch, token, head) entries differ from the scan's")
    np.testing.assert_array_equal(_finite_per_head(final, 2), _finite_per_head(want_final, 2),
                                  "final_states: non-finite (batch, head) entries differ from the scan's")
    errors = {"y": _rel_l2_where(y, want_y, np.isfinite(want_y) & np.isfinite(y)),
              "final_states": _rel_l2_where(final, want_final, np.isfinite(want_final) & np.isfinite(final))}
    want_bad_rows = ~_finite_per_head(want_grads["x"], 3)
    for name, index in spoiled_inputs.items():
        if name in ("x", "dt", "B", "C", "z"):  # per-token inputs
            want_bad_rows[index[:2]] = False
    got_bad_entries = ~np.isfinite(np.asarray(grads["x"], np.float64))
    assert got_bad_entries[want_bad_rows].all(), "dx: finite where the scan's dx row is not"
    for name in FLOAT_ARGS:
        got_grad, want_grad = np.asarray(grads[name], np.float64), want_grads[name]
        spoiled = _may_be_nonfinite(name, want_grad, seq_ids)
        leaked = ~np.isfinite(got_grad) & ~spoiled
        assert not leaked.any(), (f"d{name}: non-finite at {np.argwhere(leaked)[:8].tolist()} "
                                  f"({leaked.sum()} entries), outside what the scan's gradient spoils")
        compared = ~spoiled
        if name in spoiled_inputs:  # the gradient at a non-finite input itself is unspecified
            compared[spoiled_inputs[name]] = False
        errors[f"d{name}"] = _rel_l2_where(got_grad, want_grad, compared)
    assert max(errors.values()) < tolerance, errors


def _rel_l2_where(got, want, mask) -> float:
    got, want = np.asarray(got, np.float64)[mask], np.asarray(want, np.float64)[mask]
    norm = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / norm) if norm > 0 else float(np.linalg.norm(got))


# Each case spoils one entry; token 27 lies in row 0's second sequence (20-44), inside a 16-token chunk
# (16-31) that also holds the end of the first one and inside the kernels' first 64-token chunk.
SPOILS = {
    "x_nan": Spoil("x", (0, 27, 1, 3)),
    "x_inf": Spoil("x", (0, 27), float("inf")),
    "dt_nan": Spoil("dt", (0, 27, 2)),
    "dt_inf": Spoil("dt", (0, 27, 0), float("inf")),
    "B_nan": Spoil("B", (0, 27, 0, 2)),
    "C_nan": Spoil("C", (0, 27, 1)),
    "z_nan": Spoil("z", (0, 27, 3)),
    "initial_states_nan": Spoil("initial_states", (0, 1, 2, 5)),
    "cotangent_nan": Spoil("weight_y", (0, 30, 2)),
}


def assert_packed_reproduction_confined(ssd_fn: Callable, *, headdim: int, dstate: int) -> None:
    """The reproduction: a NaN at token 5 of the packed sequence 0-19 of a 64-token row; tokens 0-4 and 20..
    stay finite, as do the final state and the gradients of the second sequence's inputs.
    `ssd_fn(x, dt, A, B, C, seq_idx=) -> (y, final_states)`."""
    L = 64
    x = jnp.ones((1, L, 2, headdim)).at[0, 5].set(jnp.nan)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    dt = jax.random.uniform(keys[0], (1, L, 2), minval=0.01, maxval=0.5)
    A = -jnp.ones((2,))
    B, C = (jax.random.normal(k, (1, L, 1, dstate)) for k in keys[1:])
    seq_idx = (jnp.arange(L) >= 20)[None].astype(jnp.int32)

    def loss(x, dt, B, C):
        y, final = ssd_fn(x, dt, A, B, C, seq_idx=seq_idx)
        return jnp.sum(jnp.sin(y)) + jnp.sum(final)

    y, final = jax.jit(ssd_fn)(x, dt, A, B, C, seq_idx=seq_idx)
    assert np.isfinite(np.asarray(y[0, :5])).all() and np.isfinite(np.asarray(y[0, 20:])).all()
    assert not np.isfinite(np.asarray(y[0, 5:20])).any()
    assert np.isfinite(np.asarray(final)).all()
    for grad in jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, dt, B, C):
        assert np.isfinite(np.asarray(grad[0, 20:])).all()


def assert_d_gradient_takes_the_finite_part(ssd_fn: Callable, tolerance: float, *, nonlinear: bool) -> None:
    """A NaN in x at one token of row 0: D's gradient, a sum over every sequence, stays finite, that of the float64
    scan on x's finite part with the cotangents the NaN makes non-finite (y's rows that it reaches, under a
    non-linear loss) taken as 0, their finite part. Under a linear loss every cotangent is finite, and A's and
    dt_bias's gradients, shared too, are those of x's finite part as well."""
    inputs, weights = make_problem(3, spoil=SPOILS["x_nan"])
    _, grads = outputs_and_grads(ssd_fn, inputs, weights, nonlinear=nonlinear)
    finite_x = jnp.where(jnp.isfinite(inputs["x"]), inputs["x"], 0.0)
    if nonlinear:  # the (batch, token, head) rows of y that the NaN reaches
        (spoiled_y, _), _ = scan_oracle(inputs, weights, nonlinear=True)
        reached = ~_finite_per_head(spoiled_y, 3)[..., None]
        weights = dict(weights, y=jnp.where(reached, 0.0, weights["y"]))
    _, want = scan_oracle(dict(inputs, x=finite_x), weights, nonlinear=nonlinear)
    names = ("D",) if nonlinear else ("D", "A", "dt_bias")
    for name in names:
        assert np.isfinite(np.asarray(grads[name])).all(), (name, grads[name])
    errors = {name: _rel_l2_where(grads[name], want[name], np.ones(want[name].shape, bool)) for name in names}
    assert max(errors.values()) < tolerance, errors


# A negative step (Δ = dt + dt_bias < 0 without the softplus) at token 27 of row 0, in its second sequence (20-44).
NEGATIVE_STEP = (0, 27, 2)


def assert_negative_step_confined_like_a_nonfinite_dt(ssd_fn: Callable, tolerance: float) -> None:
    """Δ >= 0 goes unchecked under jit: a negative Δ makes its head's y NaN from its token to the end of its
    sequence, on the float64 scan and on `ssd_fn` alike, which otherwise agree (`assert_confined_like_scan`)."""
    inputs, weights = make_problem(4)
    dt = jax.nn.softplus(inputs["dt"]).at[NEGATIVE_STEP].set(-1.0)
    inputs = dict(inputs, dt=dt, dt_bias=jnp.abs(inputs["dt_bias"]))  # Δ = dt + dt_bias >= 0 elsewhere
    got = outputs_and_grads(ssd_fn, inputs, weights, nonlinear=True, dt_softplus=False)
    want = scan_oracle(inputs, weights, nonlinear=True, dt_softplus=False)
    row, token, head = NEGATIVE_STEP
    expected = np.zeros(dt.shape, bool)
    expected[row, token:sum(SEQUENCE_LENGTHS[row][:2]), head] = True
    (y, final), _ = want
    np.testing.assert_array_equal(~_finite_per_head(y, 3), expected, "the scan's y: not NaN where the step reaches")
    assert np.isfinite(final).all()
    assert_confined_like_scan(got, want, {"dt": NEGATIVE_STEP}, tolerance, inputs["seq_idx"])
