"""The backward plan's gradients against jax.vjp of the float64 scan oracle, for any plan runner.

A runner is `run(plan, inputs) -> arrays` taking and returning NumPy arrays (name -> array): the float64
CPU emulation (test_backward_emulated.py) or ct.launch on the GPU (test_backward_gpu.py).
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_mamba2 import reference
from jax_mamba2.kernels._common import SSDDims
from jax_mamba2.kernels.backward import backward_plan
from jax_mamba2.kernels.forward import SAVED_FOR_BACKWARD, forward_plan
from tests._helpers import make_ssd_args, rel_l2, to_float64
from tests.kernels._stage_checks import random_reach

# Plan output -> the reference argument it is the gradient of.
_GRAD_OF = {"dx": "x", "ddt": "dt", "dA": "A", "dB": "B", "dC": "C", "dD": "D", "ddt_bias": "dt_bias",
            "dinitial_states": "initial_states"}


@dataclasses.dataclass(frozen=True)
class BackwardCase:
    """One backward problem, gate-free as the backward kernels are. `seq_lens`: lengths of the packed
    sequences of each row (None: no seq_idx). `configs`: (stage, config) pairs for backward_plan."""

    seqlen: int
    chunk_size: int = 64
    nheads: int = 4
    ngroups: int = 2
    headdim: int = 64
    dstate: int = 64
    batch: int = 2
    initial_states: bool = True
    dt_softplus: bool = True
    dt_limit: tuple[float, float] = (0.0, math.inf)
    seq_lens: tuple[int, ...] | None = None
    configs: tuple[tuple[str, object], ...] = ()


def backward_dims(case: BackwardCase, dtype: str) -> SSDDims:
    return SSDDims(batch=case.batch, seqlen=case.seqlen, nheads=case.nheads, headdim=case.headdim,
                   ngroups=case.ngroups, dstate=case.dstate, chunk_size=case.chunk_size, dtype=dtype,
                   dt_dtype=dtype, has_z=False, has_init=case.initial_states,
                   has_seq_idx=case.seq_lens is not None, dt_softplus=case.dt_softplus, dt_limit=case.dt_limit)


@functools.partial(jax.jit, static_argnames=("dt_softplus", "dt_limit"))
def _scan_vjp(wrt, seq_idx, cotangents, dt_softplus, dt_limit):
    """jax.vjp of the scan oracle at `wrt`, applied to (dout, dfinal_states): one compiled program (op by op,
    the oracle and its transpose compile each operation at every new shape, most of a check's time)."""
    def scan(p):
        return reference.ssd_scan(
            p["x"], p["dt"], p["A"], p["B"], p["C"], D=p["D"], dt_bias=p["dt_bias"], dt_softplus=dt_softplus,
            dt_limit=dt_limit, initial_states=p["initial_states"], seq_idx=seq_idx)

    _, vjp = jax.vjp(scan, wrt)
    (grads,) = vjp(cotangents)
    return grads


def backward_problem(case: BackwardCase, dtype: str, seed: int = 0):
    """(plan inputs as NumPy arrays in the kernels' dtypes, float64 reference gradients by plan output).

    dout and dfinal_states are random, so the gradient through final_states is checked too. Without
    initial states the reference still gets zeros for them: its gradient w.r.t. those zeros is what the
    plan's dinitial_states holds.
    """
    args, kwargs = make_ssd_args(
        seed, batch=case.batch, seqlen=case.seqlen, nheads=case.nheads, headdim=case.headdim,
        ngroups=case.ngroups, dstate=case.dstate, dtype=jnp.dtype(dtype), D="headdim",
        dt_bias=True, dt_softplus=case.dt_softplus, dt_limit=case.dt_limit, initial_states=True,
        seq_idx=list(case.seq_lens) if case.seq_lens else None)
    if not case.dt_softplus:
        # Δ = dt + dt_bias must stay positive: the kernels' exponent clamp is a no-op only then.
        kwargs["dt_bias"] = jnp.abs(kwargs["dt_bias"])
    if not case.initial_states:
        kwargs["initial_states"] = jnp.zeros_like(kwargs["initial_states"])
    x, dt, A, B, C = args
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), 2)
    dout = jax.random.normal(keys[0], x.shape).astype(x.dtype)
    dfinal = jax.random.normal(keys[1], kwargs["initial_states"].shape)

    wrt = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": kwargs["D"], "dt_bias": kwargs["dt_bias"],
           "initial_states": kwargs["initial_states"]}
    seq_idx = kwargs.get("seq_idx")
    with jax.enable_x64(True):
        grads = _scan_vjp(to_float64(wrt), seq_idx, to_float64((dout, dfinal)), case.dt_softplus,
                          tuple(case.dt_limit))
        want = {out: np.asarray(grads[arg]) for out, arg in _GRAD_OF.items() if arg in grads}

    dummy = np.zeros((1, 1, 1, 1), np.asarray(x).dtype)
    inputs = {name: np.asarray(value) for name, value in wrt.items()}
    inputs.update(
        z=dummy,
        initial_states=inputs["initial_states"].astype(np.float32) if case.initial_states
        else np.zeros((1, 1, 1, 1), np.float32),
        seq_idx=np.asarray(seq_idx) if seq_idx is not None else np.zeros((1, 1), np.int32),
        reach=np.zeros((1, 1, 1, 1), np.float32), dx_reach=np.zeros((1, 1, 1, 1), np.float32),
        dout=np.asarray(dout), dfinal_states=np.asarray(dfinal, np.float32))
    return inputs, want


def run_backward(run, case: BackwardCase, dtype: str, *, seed: int = 0, states_from: str | None = None,
                 **plan_keywords):
    """(every array after running backward_plan(..., **plan_keywords) through `run`, the float64
    reference gradients). `states_from`: a forward layout whose plan, run first with save_states, gives
    the backward its chunk-entry states and chunk quantities (saved_states); None: the backward
    recomputes them."""
    inputs, want = backward_problem(case, dtype, seed)
    dims = backward_dims(case, dtype)
    if states_from is not None:
        forward = forward_plan(dims, layout=states_from, save_states=True)
        saved = run(forward, {name: inputs[name] for name in forward.inputs})
        inputs.update({name: saved[name] for name in SAVED_FOR_BACKWARD})
    plan = backward_plan(dims, dict(case.configs), saved_states=states_from is not None, **plan_keywords)
    return run(plan, inputs), want


def check_backward_reach(run, case: BackwardCase, dtype: str, seed: int = 0, **plan_keywords):
    """The plan (backward_plan(..., **plan_keywords): deterministic=True where float atomics would make two runs
    differ) with `dx_reach` (0 or NaN per (batch, token, head), NaN at about a tenth) makes the rows of dx where it
    is NaN wholly NaN and leaves every other row of dx, and every other gradient, as the plan without it
    computes them, bit for bit."""
    inputs, _ = backward_problem(case, dtype, seed)
    dims = backward_dims(case, dtype)
    configs = dict(case.configs)
    plain = run(backward_plan(dims, configs, **plan_keywords), inputs)
    nan_rows, per_chunk = random_reach(dims, seed)
    got = run(backward_plan(dataclasses.replace(dims, has_reach=True), configs, **plan_keywords),
              {**inputs, "dx_reach": per_chunk})
    dx, want = np.asarray(got["dx"], np.float64), np.asarray(plain["dx"], np.float64)
    assert np.isnan(dx[nan_rows]).all(), f"{case}: a row whose reach is NaN has a non-NaN dx"
    np.testing.assert_array_equal(dx[~nan_rows], want[~nan_rows])
    for name in _GRAD_OF:
        if name != "dx":
            np.testing.assert_array_equal(got[name], plain[name], err_msg=name)


def check_backward(run, case: BackwardCase, dtype: str, tolerance: float, **keywords):
    """Asserts every gradient of run_backward(run, case, dtype, **keywords) is within `tolerance` relative
    L2 of the float64 reference."""
    got, want = run_backward(run, case, dtype, **keywords)
    errors = {name: rel_l2(np.asarray(got[name], np.float64), expected) for name, expected in want.items()}
    bad = {name: err for name, err in errors.items() if not err <= tolerance}
    assert not bad, f"{case} {dtype}: relative L2 errors above {tolerance}: {bad} (all: {errors})"
