"""Shared stage checks of the kernel plans against the float64 reference, for any plan runner.

A runner is `run(plan, inputs) -> arrays` taking and returning NumPy arrays (name -> array): the CPU
emulator (`_cutile_emulator.run_plan`) or ct.launch on CuPy arrays (test_stages_gpu.py). Each check
compares every stage's output with the same-named `jax_mamba2.reference` stage function.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_mamba2 import reference
from jax_mamba2.bridge import problem
from jax_mamba2.kernels._common import SSDDims
from jax_mamba2.kernels.chunk_scan import ChunkScanConfig
from jax_mamba2.kernels.chunk_state import ChunkStateConfig
from jax_mamba2.kernels.forward import forward_plan
from jax_mamba2.kernels.fused_scan import FusedScanConfig
from jax_mamba2.kernels.state_update import state_update_plan
from tests._helpers import TOLERANCE, make_ssd_args, rel_l2, to_float64


@dataclasses.dataclass(frozen=True)
class Case:
    """One forward problem. `seq_lens`: lengths of the packed sequences of each row (None: no seq_idx)."""

    seqlen: int
    chunk_size: int = 64
    nheads: int = 4
    headdim: int = 32
    ngroups: int = 1
    dstate: int = 32
    batch: int = 2
    z: bool = False
    initial_states: bool = False
    seq_lens: tuple[int, ...] | None = None
    dt_limit: tuple[float, float] | None = None
    configs: tuple[tuple[str, object], ...] = ()
    layout: str | None = None                 # forward_plan's layout (None: its own choice)
    save_states: bool = False                 # forward_plan's save_states (the fused kernels store states)


# Small problems covering one partial chunk, partial last chunks, groups, z, initial states, seq_idx
# boundaries inside and at the edge of chunks, dt_limit, and several row/key blocks per chunk.
SMALL_CASES = {
    "one_partial_chunk": Case(seqlen=37),
    "partial_last_chunk_groups_z_init": Case(seqlen=150, nheads=8, ngroups=2, z=True, initial_states=True),
    "seq_idx_across_chunks_4_heads_per_block": Case(
        seqlen=150, seq_lens=(10, 70, 3, 67), initial_states=True,
        configs=(("chunk_scan", ChunkScanConfig(BLOCK_M=64, BLOCK_K=64, BLOCK_P=32, HEADS=4)),)),
    "chunk128_row_and_key_blocks": Case(
        seqlen=300, chunk_size=128, ngroups=4, seq_lens=(128, 1, 171), dt_limit=(0.05, 0.5),
        configs=(("chunk_scan", ChunkScanConfig(BLOCK_M=64, BLOCK_K=32, BLOCK_P=16, HEADS=1)),
                 ("chunk_state", ChunkStateConfig(BLOCK_P=16, BLOCK_N=16)))),
    # Keys narrower than rows: the last row block's second key block lies wholly past seqlen.
    "key_block_past_seqlen": Case(
        seqlen=74, configs=(("chunk_scan", ChunkScanConfig(BLOCK_M=64, BLOCK_K=32, BLOCK_P=32, HEADS=1)),)),
    # chunk_scan's state loop (all keys at once, dstate in steps): seq_idx, groups, z, a partial last
    # chunk, and row blocks narrower than the chunk.
    "state_loop_seq_idx_init_2_heads": Case(
        seqlen=150, nheads=8, ngroups=2, z=True, seq_lens=(10, 70, 3, 67), initial_states=True,
        configs=(("chunk_scan", ChunkScanConfig(BLOCK_M=64, BLOCK_N=16, BLOCK_P=32, HEADS=2)),)),
    # A persistent grid of 5 blocks striding over 2 * 3 chunks * 2 head blocks = 12 work tiles.
    "state_loop_persistent": Case(
        seqlen=150, initial_states=True,
        configs=(("chunk_scan", ChunkScanConfig(BLOCK_M=64, BLOCK_N=16, BLOCK_P=32, HEADS=2, PERSISTENT=5)),)),
    "key_loop_persistent_seq_idx": Case(
        seqlen=150, seq_lens=(10, 70, 3, 67),
        configs=(("chunk_scan", ChunkScanConfig(BLOCK_M=64, BLOCK_K=32, BLOCK_P=32, HEADS=1, PERSISTENT=7)),)),
    "state_loop_chunk128_row_blocks": Case(
        seqlen=300, chunk_size=128, ngroups=4, seq_lens=(128, 1, 171), dt_limit=(0.05, 0.5),
        configs=(("chunk_scan", ChunkScanConfig(BLOCK_M=64, BLOCK_K=128, BLOCK_N=16, BLOCK_P=16, HEADS=1)),)),
    # The state pass across a partial last chunk and seq_idx resets, and with one chunk only.
    "state_seq_idx_init_partial_last_chunk": Case(
        seqlen=150, seq_lens=(10, 70, 3, 67), initial_states=True,
        configs=(("chunk_state", ChunkStateConfig(BLOCK_P=16, BLOCK_N=16)),)),
    "state_one_chunk": Case(
        seqlen=37, initial_states=True, configs=(("chunk_state", ChunkStateConfig(BLOCK_P=32, BLOCK_N=32)),)),
    # The fused layout (states carried in the block): one partial chunk, seq_idx resets with initial
    # states, groups with z and a partial last chunk, narrow headdim blocks, chunk 32.
    "fused_one_partial_chunk": Case(seqlen=37, initial_states=True, layout="fused"),
    "fused_seq_idx_init": Case(seqlen=150, seq_lens=(10, 70, 3, 67), initial_states=True, layout="fused"),
    "fused_groups_z_partial_last_chunk": Case(
        seqlen=150, nheads=8, ngroups=2, z=True, dt_limit=(0.05, 0.5), layout="fused",
        configs=(("fused_scan", FusedScanConfig(BLOCK_P=16)),)),
    "fused_chunk32_seq_idx": Case(seqlen=100, chunk_size=32, seq_lens=(31, 2, 67), z=True, layout="fused"),
    # The segmented layout: 38 chunks of 16 in 4 segments of 10 (the last partial, ending in a partial
    # chunk), one piece each; sequences restarting inside a segment, and one starting exactly at a segment
    # boundary.
    "segmented_seq_idx_resets_init_groups_z": Case(
        seqlen=600, chunk_size=16, nheads=8, ngroups=2, z=True, initial_states=True,
        seq_lens=(100, 160, 3, 337), layout="segmented"),
    "segmented_sequence_starts_at_segment_boundary": Case(
        seqlen=600, chunk_size=16, seq_lens=(160, 100, 3, 337), initial_states=True, layout="segmented"),
    "segmented_two_segments_chunk32": Case(seqlen=517, chunk_size=32, layout="segmented"),
    # 141 chunks of 32 chains: 4 segments of 36 chunks, segment_states walking each of the first three in
    # 2 pieces of 18; one sequence starts exactly at a piece boundary (token 288), two inside pieces.
    "segmented_pieces_seq_idx_init": Case(
        seqlen=2250, chunk_size=16, nheads=16, seq_lens=(288, 612, 5, 1345), initial_states=True,
        layout="segmented"),
    # The fused kernels storing every chunk-entry state for the backward (checked against the reference's).
    "fused_seq_idx_init_saving_states": Case(
        seqlen=150, seq_lens=(10, 70, 3, 67), initial_states=True, layout="fused", save_states=True),
    "fused_narrow_groups_z_saving_states": Case(
        seqlen=150, nheads=8, ngroups=2, z=True, layout="fused", save_states=True,
        configs=(("fused_scan", FusedScanConfig(BLOCK_P=16)),)),
    # segment_states weighting B's rows, the segmented scan x's (and the other way round below): the pieces'
    # end states pass between the two forms.
    "segmented_seq_idx_init_saving_states": Case(
        seqlen=600, chunk_size=16, seq_lens=(160, 100, 3, 337), initial_states=True, layout="segmented",
        save_states=True, configs=(("segment_states", FusedScanConfig(BLOCK_P=32, WEIGHT_X=False)),)),
    # Two chunks per loop iteration: an odd chunk count (a pair, then one), sequences and a carry across the
    # pair's two chunks; in the segments, an odd last segment (33 chunks) after pieces of 18.
    "fused_two_chunks_per_iter_seq_idx_init_z": Case(
        seqlen=150, seq_lens=(10, 70, 3, 67), initial_states=True, z=True, layout="fused",
        configs=(("fused_scan", FusedScanConfig(BLOCK_P=32, CHUNKS_PER_ITER=2, WEIGHT_X=False)),)),
    "fused_two_chunks_per_iter_chunk32_saving_states": Case(
        seqlen=150, chunk_size=32, seq_lens=(31, 2, 117), initial_states=True, layout="fused", save_states=True,
        configs=(("fused_scan", FusedScanConfig(BLOCK_P=32, CHUNKS_PER_ITER=2)),)),
    # The output as one product [exp(dA) C | scores]·[H_c^T ; x] (dstate == chunk size): sequences, initial
    # states, z, both weightings, two chunks per iteration, saved states, segments.
    "fused_joint_output_chunk32_seq_idx_init_z": Case(
        seqlen=150, chunk_size=32, seq_lens=(10, 70, 3, 67), initial_states=True, z=True, layout="fused",
        configs=(("fused_scan", FusedScanConfig(BLOCK_P=32, JOINT_OUTPUT=True)),)),
    "fused_joint_output_two_chunks_per_iter_saving_states": Case(
        seqlen=150, chunk_size=32, nheads=8, ngroups=2, seq_lens=(31, 2, 117), layout="fused", save_states=True,
        configs=(("fused_scan", FusedScanConfig(BLOCK_P=16, CHUNKS_PER_ITER=2, WEIGHT_X=False, JOINT_OUTPUT=True)),)),
    "segmented_joint_output_seq_idx_init": Case(
        seqlen=600, chunk_size=16, dstate=16, seq_lens=(160, 100, 3, 337), initial_states=True, layout="segmented",
        configs=(("segmented_scan", FusedScanConfig(BLOCK_P=32, JOINT_OUTPUT=True)),)),
    "segmented_two_chunks_per_iter_pieces_seq_idx_init": Case(
        seqlen=2250, chunk_size=16, nheads=16, seq_lens=(288, 612, 5, 1345), initial_states=True,
        layout="segmented",
        configs=(("segmented_scan", FusedScanConfig(BLOCK_P=32, CHUNKS_PER_ITER=2, WEIGHT_X=False)),)),
}

# make_ssd_args draws A so that a 64-token chunk decays by ~e^-30, which hides every cross-chunk path
# (carried states, initial states, seq_idx resets); the stage checks scale A down to keep them visible.
_A_SCALE = 0.02


def _ssd_args(case: Case, dtype, seed: int):
    (x, dt, A, B, C), kwargs = make_ssd_args(
        seed, batch=case.batch, seqlen=case.seqlen, nheads=case.nheads, headdim=case.headdim,
        ngroups=case.ngroups, dstate=case.dstate, dtype=dtype, D="headdim", z=case.z, dt_bias=True,
        dt_softplus=True, dt_limit=case.dt_limit, initial_states=case.initial_states,
        seq_idx=list(case.seq_lens) if case.seq_lens else None)
    return (x, dt, A * _A_SCALE, B, C), kwargs


def case_dims(case: Case, dtype: str) -> SSDDims:
    return SSDDims(
        batch=case.batch, seqlen=case.seqlen, nheads=case.nheads, headdim=case.headdim,
        ngroups=case.ngroups, dstate=case.dstate, chunk_size=case.chunk_size, dtype=dtype,
        dt_dtype=dtype, has_z=case.z, has_init=case.initial_states, has_seq_idx=case.seq_lens is not None,
        dt_softplus=True, dt_limit=case.dt_limit or (0.0, float("inf")))


def _error(actual, expected) -> float:
    """Relative L2 error; the max abs error when `expected` is all zeros (e.g. states of a single chunk)."""
    expected = np.asarray(expected, np.float64)
    if not np.any(expected):
        return float(np.max(np.abs(np.asarray(actual, np.float64))))
    return rel_l2(actual, expected)


def _np(a):
    return np.asarray(a)


def forward_inputs_np(args, kwargs):
    """The plan inputs as the bridge passes them: absent optional arrays become dummies / zeros."""
    x, dt, A, B, C = args
    nheads, headdim = x.shape[2], x.shape[3]
    return {
        "x": _np(x), "dt": _np(dt), "A": _np(A), "B": _np(B), "C": _np(C),
        "dt_bias": _np(kwargs["dt_bias"]),
        "D": _np(jnp.broadcast_to(kwargs["D"], (nheads, headdim))).astype(np.float32),
        "z": _np(kwargs["z"]) if "z" in kwargs else np.zeros((1, 1, 1, 1), x.dtype),
        "initial_states": _np(kwargs["initial_states"]).astype(np.float32) if "initial_states" in kwargs
        else np.zeros((1, 1, 1, 1), np.float32),
        "seq_idx": _np(kwargs["seq_idx"]) if "seq_idx" in kwargs else np.zeros((1, 1), np.int32),
        "reach": np.zeros((1, 1, 1, 1), np.float32),
    }


def _reference_stages(args, kwargs, chunk_size):
    """Every forward stage of the reference in float64 (call under jax.enable_x64)."""
    x, dt, A, B, C = to_float64(args)
    kw = to_float64(kwargs)
    seq_idx = kw.get("seq_idx")
    dt_out, dA_cumsum = reference.chunk_cumsum(dt, A, chunk_size, kw["dt_bias"], True,
                                               kw.get("dt_limit", (0.0, float("inf"))))
    local = reference.chunk_state(B, x, dt_out, dA_cumsum, seq_idx)
    chunk_end_ids = None
    if seq_idx is not None:
        chunk_end_ids = reference._seq_idx_chunks(seq_idx, dt_out.shape[2], chunk_size)[:, :, -1]
    states, final_states = reference.state_passing(local, dA_cumsum[..., -1], kw.get("initial_states"),
                                                   chunk_end_ids)
    out = reference.chunk_scan(B, C, x, dt_out, dA_cumsum, states, kw["D"], kw.get("z"), seq_idx)
    return {"dt_out": dt_out, "dA_cumsum": dA_cumsum, "states": states, "final_states": final_states,
            "out": out}


@functools.partial(jax.jit, static_argnames=("chunk_size", "static"))
def _jitted_reference_outputs(args, arrays, chunk_size, static):
    kwargs = {**arrays, **dict(static)}
    y_scan, final_scan = reference.ssd_scan(*args, **kwargs)
    return _reference_stages(args, kwargs, chunk_size), y_scan, final_scan


def _reference_outputs(args, kwargs, chunk_size):
    """(_reference_stages, y and final states of the scan), in float64 (call under jax.enable_x64). One
    compiled program: run op by op, the reference compiles each of its operations at every new shape, which
    took most of a check's time; its float64 inputs let the float32 and bfloat16 cases of a problem share
    the program."""
    arrays = {name: value for name, value in kwargs.items() if isinstance(value, jax.Array)}
    static = tuple(sorted((name, value) for name, value in kwargs.items() if name not in arrays))
    return _jitted_reference_outputs(to_float64(args), to_float64(arrays), chunk_size, static)


def check_forward(run, case: Case, dtype: str, seed: int = 0):
    """Runs forward_plan through `run` and asserts each stage matches the float64 reference."""
    args, kwargs = _ssd_args(case, getattr(jnp, dtype), seed)
    dims = case_dims(case, dtype)
    plan = forward_plan(dims, dict(case.configs), case.layout, save_states=case.save_states)
    got = run(plan, forward_inputs_np(args, kwargs))
    written = {name for launch in plan.launches for name in launch.writes}
    with jax.enable_x64(True):
        stages, y_scan, final_scan = _reference_outputs(args, kwargs, case.chunk_size)
        want = {name: value for name, value in stages.items() if name in written}
    tol = TOLERANCE["kernel_fwd"][dtype]
    errors = {name: _error(got[name], want[name]) for name in want}
    errors["out_vs_scan"] = rel_l2(got["out"], y_scan)
    errors["final_states_vs_scan"] = rel_l2(got["final_states"], final_scan)
    # dt math is fp32 elementwise in every dtype: hold it to fp32 accuracy.
    limits = {name: (1e-5 if name in ("dt_out", "dA_cumsum") else tol) for name in errors}
    bad = {name: err for name, err in errors.items() if not err <= limits[name]}
    assert not bad, f"{case} {dtype}: relative L2 errors above {limits}: {bad}"


# Forward problems whose plans add the op's `reach` to their output rows (SSDDims.has_reach): the staged
# layout's two chunk_scan loops, the fused layout (one and two chunks per iteration, the joint output product)
# and the segmented one, with seq_idx, z and initial states.
REACH_CASES = ("partial_last_chunk_groups_z_init", "seq_idx_across_chunks_4_heads_per_block",
               "state_loop_seq_idx_init_2_heads", "fused_seq_idx_init_saving_states",
               "fused_two_chunks_per_iter_seq_idx_init_z", "fused_joint_output_chunk32_seq_idx_init_z",
               "segmented_seq_idx_resets_init_groups_z")


def random_reach(dims: SSDDims, seed: int):
    """(rows, per_chunk): a reach term that is NaN at about a tenth of the (batch, token, head) rows (`rows`, bool)
    and 0 elsewhere, in the kernels' per-chunk layout as the bridge lays it out (`problem.per_chunk_rows`)."""
    rows = np.random.default_rng(seed).random((dims.batch, dims.seqlen, dims.nheads)) < 0.1
    reach = jnp.where(jnp.asarray(rows), jnp.nan, 0.0).astype(jnp.float32)
    return rows, np.asarray(problem.per_chunk_rows(reach, dims))


def check_forward_reach(run, case: Case, dtype: str, seed: int = 0):
    """The plan with `reach` (0 or NaN per (batch, token, head), NaN at about a tenth) makes the output rows
    where it is NaN wholly NaN and leaves every other output, and its states, as the plan without it computes
    them, bit for bit."""
    args, kwargs = _ssd_args(case, getattr(jnp, dtype), seed)
    dims = case_dims(case, dtype)
    inputs = forward_inputs_np(args, kwargs)
    plain = run(forward_plan(dims, dict(case.configs), case.layout, save_states=case.save_states), inputs)
    nan_rows, per_chunk = random_reach(dims, seed)
    reach_dims = dataclasses.replace(dims, has_reach=True)
    got = run(forward_plan(reach_dims, dict(case.configs), case.layout, save_states=case.save_states),
              {**inputs, "reach": per_chunk})
    out, want = np.asarray(got["out"], np.float64), np.asarray(plain["out"], np.float64)
    assert np.isnan(out[nan_rows]).all(), f"{case}: a row whose reach is NaN has a non-NaN output"
    np.testing.assert_array_equal(out[~nan_rows], want[~nan_rows])
    for name in ("final_states", "states") if case.save_states else ("final_states",):
        np.testing.assert_array_equal(got[name], plain[name])


_STEP_SHAPE = {"batch": 3, "nheads": 4, "headdim": 32, "dstate": 16}


def step_dims(dtype: str, *, ngroups: int = 2, z: bool = True) -> SSDDims:
    """The decode problem `check_state_update` runs (dt_softplus and dt_limit on)."""
    return SSDDims(seqlen=1, ngroups=ngroups, chunk_size=1, dtype=dtype, dt_dtype=dtype, has_z=z,
                   dt_softplus=True, dt_limit=(0.01, 1.0), **_STEP_SHAPE)


def check_state_update(run, dtype: str, state_dtype: str, *, ngroups: int = 2, z: bool = True, cfg=None,
                       seed: int = 0, param_dtype: str = "float32", d_per_channel: bool = True):
    """Runs state_update_plan(cfg) through `run`; asserts y and the new state match reference.ssd_step.
    dt_bias and D in `param_dtype`, D (nheads, headdim) when `d_per_channel`, else (nheads,)."""
    dims = step_dims(dtype, ngroups=ngroups, z=z)
    batch, nheads, headdim, dstate = dims.batch, dims.nheads, dims.headdim, dims.dstate
    args, kwargs = make_ssd_args(seed, batch=batch, seqlen=1, nheads=nheads, headdim=headdim,
                                 ngroups=ngroups, dstate=dstate, dtype=getattr(jnp, dtype),
                                 D="headdim" if d_per_channel else "head", z=z, dt_bias=True, dt_softplus=True,
                                 dt_limit=dims.dt_limit)
    kwargs.update({name: kwargs[name].astype(param_dtype) for name in ("D", "dt_bias")})
    x, dt, A, B, C = args[0][:, 0], args[1][:, 0], args[2], args[3][:, 0], args[4][:, 0]
    if z:
        kwargs["z"] = kwargs["z"][:, 0]
    state = jax.random.normal(jax.random.PRNGKey(seed + 1), (batch, nheads, headdim, dstate)
                              ).astype(getattr(jnp, state_dtype))
    inputs = {"state": _np(state).copy(), "x": _np(x), "dt": _np(dt), "A": _np(A), "B": _np(B),
              "C": _np(C), "dt_bias": _np(kwargs["dt_bias"]), "D": _np(kwargs["D"]),
              "z": _np(kwargs["z"]) if z else np.zeros((1, 1, 1), _np(x).dtype)}
    got = run(state_update_plan(dims, cfg, state_dtype, d_per_channel), inputs)
    with jax.enable_x64(True):
        y_ref, state_ref = reference.ssd_step(*to_float64((state, x, dt, A, B, C)), **to_float64(kwargs))
    tol = TOLERANCE["kernel_fwd"][dtype]
    errors = {"y": rel_l2(got["y"], y_ref), "state": rel_l2(got["new_state"], state_ref)}
    assert got["new_state"].dtype == state.dtype
    assert all(err <= tol for err in errors.values()), f"{dtype}/{state_dtype} {cfg}: {errors} > {tol}"
