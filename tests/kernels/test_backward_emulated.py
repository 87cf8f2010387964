"""The backward plan's exact blockwise algorithm, proven on CPU in float64 before any GPU run.

Every launch of `backward_plan` (the forward recompute included) runs block by block on NumPy through the
cuda.tile emulator of tests/kernels/_cutile_emulator.py, with every float dtype mapped to float64, so the
kernels' index math, masks, partial chunks, seq_idx rules, head splits and the stable dA_cumsum algebra
are checked against `jax.vjp` of the float64 `reference.ssd_scan` to ~1e-10: any derivation error shows
as an O(1) mismatch. (Rounding of the compiled kernels is checked by test_backward_gpu.py.)
"""
import contextlib
import dataclasses
import itertools
import math
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mamba2 import reference
from jax_mamba2.kernels._common import SSDDims
from jax_mamba2.kernels.backward import backward_plan
from jax_mamba2.kernels.chunk_cumsum_bwd import ChunkCumsumBwdConfig
from jax_mamba2.kernels.chunk_scan_bwd_dc import ChunkScanBwdDcConfig
from jax_mamba2.kernels.chunk_scan_bwd_dx import ChunkScanBwdDxConfig
from jax_mamba2.kernels.chunk_state import ChunkStateConfig
from jax_mamba2.kernels.chunk_state_bwd import ChunkStateBwdConfig
from jax_mamba2.kernels.param_grads_bwd import ParamGradsBwdConfig
from tests._helpers import make_ssd_args, rel_l2
from tests.kernels import _cutile_emulator as emulator

_F64 = np.dtype(np.float64)

# Small blocks so that chunks hold several row/key blocks, key steps both shorter and longer than row
# blocks, several state tiles, and head blocks that do not divide nheads.
_SMALL_BLOCKS = {
    "chunk_state": ChunkStateConfig(BLOCK_P=4, BLOCK_N=8),
    "chunk_scan_bwd_dc": ChunkScanBwdDcConfig(BLOCK_M=8, BLOCK_K=4),
    "chunk_state_bwd": ChunkStateBwdConfig(BLOCK_P=4, BLOCK_N=4),
    "chunk_scan_bwd_dx": ChunkScanBwdDxConfig(BLOCK_M=4, BLOCK_K=8),
    "chunk_cumsum_bwd": ChunkCumsumBwdConfig(BLOCK_H=2),
    "param_grads_bwd": ParamGradsBwdConfig(BLOCK_H=2, BLOCK_R=4),
}


class _EmulatedArray(np.ndarray):
    """A NumPy array with the `tiled_view(...).atomic_store_add` of a cuda.tile Array."""

    def tiled_view(self, tile_shape, *, padding_mode=None, traversal_steps=None):
        assert traversal_steps is None
        return _TiledView(self, tuple(tile_shape))


@dataclasses.dataclass
class _TiledView:
    array: np.ndarray
    tile_shape: tuple

    def atomic_store_add(self, index, update):
        src, dst = emulator._tile_window(self.array, index, self.tile_shape)
        self.array[src] += np.broadcast_to(update, self.tile_shape)[dst]


def _cumsum(x, axis=0, *, reverse=False):
    if reverse:
        return np.flip(np.cumsum(np.flip(x, axis), axis=axis), axis)
    return np.cumsum(x, axis=axis)


def _mma(x, y, acc):
    assert x.dtype == y.dtype == acc.dtype == _F64, (x.dtype, y.dtype, acc.dtype)
    return x @ y + acc


def _float64_ct():
    """The emulator with every float dtype (tf32 included) computed as float64."""
    ns = types.ModuleType("cutile_float64_emulator")
    ns.__dict__.update({k: v for k, v in vars(emulator).items() if not k.startswith("__")})
    ns.float16 = ns.bfloat16 = ns.float32 = ns.tfloat32 = _F64
    ns.cumsum, ns.mma = _cumsum, _mma
    return ns


@contextlib.contextmanager
def _as_ct(namespace):
    modules = [m for name, m in sys.modules.items()
               if name.startswith("jax_mamba2.kernels") and hasattr(m, "ct")]
    originals = [m.ct for m in modules]
    for m in modules:
        m.ct = namespace
    try:
        yield
    finally:
        for m, original in zip(modules, originals):
            m.ct = original


def _run_plan_float64(plan, inputs):
    """Runs `plan` block by block in float64; buffers start as NaN (or zeros when zero_init)."""
    def f64(a):
        a = np.asarray(a)
        return (a.astype(_F64) if a.dtype.kind == "f" else a).view(_EmulatedArray)

    arrays = {name: f64(a) for name, a in inputs.items()}
    for name, buf in plan.buffers.items():
        dtype = np.dtype(buf.dtype) if buf.dtype == "int32" else _F64
        fill = 0 if buf.zero_init else np.nan
        arrays[name] = np.full(buf.shape, fill, dtype).view(_EmulatedArray)
    with _as_ct(_float64_ct()):
        for launch in plan.launches:
            pyfunc = launch.kernel._annotated_function.pyfunc
            args = [arrays[a] if isinstance(a, str) else a for a in launch.args]
            grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
            for block in itertools.product(*(range(n) for n in grid)):
                emulator._block[:] = [block, grid]
                pyfunc(*args)
    return {name: np.asarray(arrays[name]) for name in plan.outputs}


@dataclasses.dataclass(frozen=True)
class _Case:
    seqlen: int
    nheads: int = 4
    ngroups: int = 2
    headdim: int = 8
    dstate: int = 16
    chunk_size: int = 16
    z: bool = True
    initial_states: bool = True
    dt_softplus: bool = True
    dt_limit: tuple = (0.0, math.inf)
    seq_lens: tuple | None = None


CASES = {
    "partial_chunk_z_init_groups": _Case(seqlen=37),
    "seq_idx_dt_limit_odd_heads": _Case(seqlen=50, nheads=3, ngroups=1, z=False, dt_limit=(0.05, 0.6),
                                        seq_lens=(5, 11, 16, 18)),
    "whole_chunks_plain_dt": _Case(seqlen=32, ngroups=4, z=False, initial_states=False, dt_softplus=False),
}


def _backward_by_emulation(case: _Case, deterministic: bool, seed: int = 0):
    """(the plan's outputs, jax.vjp of reference.ssd_scan's grads), both float64."""
    batch = 2
    args, kwargs = make_ssd_args(
        seed, batch=batch, seqlen=case.seqlen, nheads=case.nheads, headdim=case.headdim,
        ngroups=case.ngroups, dstate=case.dstate, D="headdim", z=case.z, dt_bias=True,
        dt_softplus=case.dt_softplus, dt_limit=case.dt_limit, initial_states=True,
        seq_idx=list(case.seq_lens) if case.seq_lens else None)
    if not case.dt_softplus:
        # Δ = dt + dt_bias must stay positive: the kernels' exponent clamp is a no-op only then.
        kwargs["dt_bias"] = jnp.abs(kwargs["dt_bias"])
    if not case.initial_states:
        # Without initial states the forward starts from zeros: the gradient w.r.t. zeros still exists.
        kwargs["initial_states"] = jnp.zeros_like(kwargs["initial_states"])
    x, dt, A, B, C = args
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), 2)
    dout = jax.random.normal(keys[0], x.shape)
    dfinal = jax.random.normal(keys[1], kwargs["initial_states"].shape)
    dims = SSDDims(batch=batch, seqlen=case.seqlen, nheads=case.nheads, headdim=case.headdim,
                   ngroups=case.ngroups, dstate=case.dstate, chunk_size=case.chunk_size, dtype="float32",
                   has_z=case.z, has_init=case.initial_states, has_seq_idx=case.seq_lens is not None,
                   dt_softplus=case.dt_softplus, dt_limit=case.dt_limit)
    dummy = np.zeros((1, 1, 1, 1))
    inputs = {
        "x": x, "dt": dt, "A": A, "dt_bias": kwargs["dt_bias"], "B": B, "C": C, "D": kwargs["D"],
        "z": kwargs["z"] if case.z else dummy,
        "initial_states": kwargs["initial_states"] if case.initial_states else dummy,
        "seq_idx": kwargs.get("seq_idx", np.zeros((1, 1), np.int32)),
        "dout": dout, "dfinal_states": dfinal,
    }
    got = _run_plan_float64(backward_plan(dims, _SMALL_BLOCKS, deterministic=deterministic), inputs)

    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(a, jnp.float64)  # noqa: E731
        wrt = {"x": f64(x), "dt": f64(dt), "A": f64(A), "B": f64(B), "C": f64(C), "D": f64(kwargs["D"]),
               "dt_bias": f64(kwargs["dt_bias"]), "initial_states": f64(kwargs["initial_states"])}
        if case.z:
            wrt["z"] = f64(kwargs["z"])

        def scan(p):
            return reference.ssd_scan(
                p["x"], p["dt"], p["A"], p["B"], p["C"], D=p["D"], z=p.get("z"), dt_bias=p["dt_bias"],
                dt_softplus=case.dt_softplus, dt_limit=case.dt_limit, initial_states=p["initial_states"],
                seq_idx=kwargs.get("seq_idx"))

        _, vjp = jax.vjp(scan, wrt)
        (grads,) = vjp((f64(dout), f64(dfinal)))
    want = {"dx": grads["x"], "ddt": grads["dt"], "dA": grads["A"], "dB": grads["B"], "dC": grads["C"],
            "dD": grads["D"], "ddt_bias": grads["dt_bias"], "dinitial_states": grads["initial_states"]}
    if case.z:
        want["dz"] = grads["z"]
    return got, {name: np.asarray(g) for name, g in want.items()}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_backward_plan_emulated_float64_matches_scan_vjp(case):
    got, want = _backward_by_emulation(CASES[case], deterministic=False)
    errors = {name: rel_l2(got[name], want[name]) for name in want}
    assert all(err < 1e-10 for err in errors.values()), f"{case}: relative L2 errors {errors}"
    if not CASES[case].z:
        assert not np.any(got["dz"]), "the dz dummy must stay zero without a gate"


def test_backward_plan_emulated_deterministic_mode_matches_scan_vjp():
    case = CASES["partial_chunk_z_init_groups"]
    got, want = _backward_by_emulation(case, deterministic=True)
    errors = {name: rel_l2(got[name], want[name]) for name in want}
    assert all(err < 1e-10 for err in errors.values()), f"deterministic: relative L2 errors {errors}"
