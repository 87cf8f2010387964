"""The single-token decode step: the output token and the next SSM state.

Mirrors `reference.ssd_step` (mamba_ssm `selective_state_update`, plus dt_limit). Per (batch b, head h),
group g = h // (nheads / ngroups), all in f32:

    Δ        = clip(softplus(dt[b, h] + dt_bias[h]))        (softplus / clip per DT_SOFTPLUS, HAS_DT_LIMIT)
    state'   = exp(Δ A[h]) * state[b, h] + (Δ x[b, h])[:, None] * B[b, g][None, :]      (headdim, dstate)
    y        = state' @ C[b, g] + D[h] * x[b, h];   y *= silu(z[b, h]) if HAS_Z       (D[h] per channel or one)
    new_state[b, h] = state' rounded to the state's dtype; y is computed from the f32 state'.

The next state goes to its own buffer instead of overwriting `state` through an aliased in-place
custom-call operand: that in-place form passed a single jitted step on the GPU but drifted from the second
step on when the LM scanned its layers with the cache, and a separate output moves no extra bytes.

Grid: (batch * nheads, headdim / BLOCK_P). Purely bandwidth-bound (the state is read and written once).

Shapes: state, new_state (batch, nheads, headdim, dstate) f32 or T; x, z, y (batch, nheads,
headdim) T (z a dummy (1, 1, 1) without HAS_Z); dt (batch, nheads) T or f32; A (nheads,) f32; dt_bias (nheads,)
and D (nheads, headdim) with D_PER_CHANNEL, else (nheads,), both in the parameters' dtype (f32, bf16 or f16: a
bf16 model's parameters go in as they are, widened to f32 as they are loaded, with no conversion pass per token);
B, C (batch, ngroups, dstate) T.
"""
import dataclasses

import cuda.tile as ct

from jax_mamba2.kernels._common import (
    Big, Buffer, ConstBool, ConstFloat, ConstInt, Launch, Plan, SSDDims, Stage, check_arch, dt_transform,
    dt_transform_constants, int64_index_kernels, kernel_launch, select_kernel, silu_gate)
from jax_mamba2.kernels._tiles import batch_head_group

STATE_UPDATE_INPUTS = ("state", "x", "dt", "A", "dt_bias", "B", "C", "D", "z")
STATE_UPDATE_OUTPUTS = ("y", "new_state")


def state_update_kernel(
    state: Big,           # (batch, nheads, headdim, dstate) f32 or T
    x,                    # (batch, nheads, headdim) T
    dt,                   # (batch, nheads) T or f32
    A,                    # (nheads,) f32
    dt_bias,              # (nheads,) parameter dtype
    B,                    # (batch, ngroups, dstate) T
    C,                    # (batch, ngroups, dstate) T
    D,                    # (nheads, headdim) with D_PER_CHANNEL, else (nheads,); parameter dtype
    z,                    # (batch, nheads, headdim) T, or a dummy without HAS_Z
    y,                    # (batch, nheads, headdim) T, written
    new_state: Big,       # (batch, nheads, headdim, dstate) state's dtype, written
    DSTATE: ConstInt,
    BLOCK_P: ConstInt,
    HAS_Z: ConstBool,
    D_PER_CHANNEL: ConstBool,
    DT_SOFTPLUS: ConstBool,
    HAS_DT_LIMIT: ConstBool,
    DT_MIN: ConstFloat,
    DT_MAX: ConstFloat,
):
    bh = ct.bid(0)
    pb = ct.bid(1)
    b, h, g = batch_head_group(bh, x.shape[1], B.shape[1])

    dt_v = ct.load(dt, index=(b, h), shape=(1, 1)).reshape((1,)).astype(ct.float32)
    bias = ct.load(dt_bias, index=(h,), shape=(1,)).astype(ct.float32)
    delta = dt_transform(dt_v + bias, DT_SOFTPLUS, HAS_DT_LIMIT, DT_MIN, DT_MAX)           # [1]
    s = ct.load(state, index=(b, h, pb, 0), shape=(1, 1, BLOCK_P, DSTATE)
                ).reshape((BLOCK_P, DSTATE)).astype(ct.float32)
    x_p = ct.load(x, index=(b, h, pb), shape=(1, 1, BLOCK_P)).reshape((BLOCK_P,)).astype(ct.float32)
    B_n = ct.load(B, index=(b, g, 0), shape=(1, 1, DSTATE)).reshape((DSTATE,)).astype(ct.float32)
    C_n = ct.load(C, index=(b, g, 0), shape=(1, 1, DSTATE)).reshape((DSTATE,)).astype(ct.float32)
    if D_PER_CHANNEL:
        D_p = ct.load(D, index=(h, pb), shape=(1, BLOCK_P)).reshape((BLOCK_P,)).astype(ct.float32)
    else:
        D_p = ct.load(D, index=(h,), shape=(1,)).astype(ct.float32)                      # [1], broadcast

    s, y_p = state_step(s, x_p, delta, ct.load(A, index=(h,), shape=(1,)), B_n, C_n, D_p)
    ct.store(new_state, index=(b, h, pb, 0), tile=s.reshape((1, 1, BLOCK_P, DSTATE)).astype(new_state.dtype))
    if HAS_Z:
        y_p = silu_gate(y_p, ct.load(z, index=(b, h, pb), shape=(1, 1, BLOCK_P)).reshape((BLOCK_P,)))
    ct.store(y, index=(b, h, pb), tile=y_p.reshape((1, 1, BLOCK_P)).astype(y.dtype))


def state_step(s, x_p, delta, A_h, B_n, C_n, D_p):
    """Device helper: one token of the recurrence for a (BLOCK_P, DSTATE) f32 state tile s of one head, all f32:
    x_p (BLOCK_P,), delta and A_h (1,), B_n and C_n (DSTATE,), D_p (BLOCK_P,) or (1,). Returns (state', y) with
    state' = exp(delta A_h) s + (delta x_p) B_n^T and y = state' C_n + D_p x_p (BLOCK_P,)."""
    s = s * ct.exp(delta * A_h) + (delta * x_p)[:, None] * B_n[None, :]
    return s, ct.sum(s * C_n[None, :], axis=1) + D_p * x_p


STATE_UPDATE_KERNELS = int64_index_kernels(state_update_kernel)


@dataclasses.dataclass(frozen=True)
class StateUpdateConfig:
    """BLOCK_P: headdim rows of the state per block (a power of two dividing headdim)."""

    BLOCK_P: int = 16
    OCCUPANCY: int = 4


def state_update_configs(dims: SSDDims, arch: str = "sm_90") -> list[StateUpdateConfig]:
    """The autotune space (sm_90): BLOCK_P 4..64 (more, smaller blocks hide more DRAM latency),
    occupancy 2/4/8."""
    check_arch("state_update_configs", arch)
    return [StateUpdateConfig(BLOCK_P=bp, OCCUPANCY=occ)
            for bp in (4, 8, 16, 32, 64) if bp <= dims.headdim
            for occ in (2, 4, 8)]


def state_update_default_config(dims: SSDDims) -> StateUpdateConfig:
    """About 2K state values per block."""
    return StateUpdateConfig(BLOCK_P=min(dims.headdim, 64, max(4, 2048 // dims.dstate)), OCCUPANCY=4)


def state_update_grid(dims: SSDDims, cfg: StateUpdateConfig) -> tuple[int, int]:
    return (dims.batch * dims.nheads, dims.headdim // cfg.BLOCK_P)


def state_update_inputs(dims: SSDDims, state_dtype: str = "float32", param_dtype: str = "float32",
                        d_per_channel: bool = True) -> dict[str, Buffer]:
    """Shape and dtype of each input as the bridge passes it (z a dummy without has_z): dt_bias and D in
    `param_dtype`, D (nheads, headdim) when `d_per_channel`, else (nheads,)."""
    b, H, P, G, N, T = dims.batch, dims.nheads, dims.headdim, dims.ngroups, dims.dstate, dims.dtype
    return {
        "state": Buffer((b, H, P, N), state_dtype),
        "x": Buffer((b, H, P), T),
        "dt": Buffer((b, H), dims.dt_dtype),
        "A": Buffer((H,), "float32"),
        "dt_bias": Buffer((H,), param_dtype),
        "B": Buffer((b, G, N), T),
        "C": Buffer((b, G, N), T),
        "D": Buffer((H, P) if d_per_channel else (H,), param_dtype),
        "z": Buffer((b, H, P) if dims.has_z else (1, 1, 1), T),
    }


def state_update_launch(dims: SSDDims, cfg: StateUpdateConfig | None = None,
                        d_per_channel: bool = True) -> Launch:
    """The launch writing ("y", "new_state") (the state's and the parameters' dtypes are the arrays': the kernel
    is compiled per dtype)."""
    cfg = cfg or state_update_default_config(dims)
    return kernel_launch(
        select_kernel(STATE_UPDATE_KERNELS, dims, occupancy=cfg.OCCUPANCY), state_update_grid(dims, cfg),
        writes=("y", "new_state"), DSTATE=dims.dstate, BLOCK_P=cfg.BLOCK_P, HAS_Z=dims.has_z,
        D_PER_CHANNEL=d_per_channel, **dt_transform_constants(dims))


def state_update_plan(dims: SSDDims, cfg: StateUpdateConfig | None = None,
                      state_dtype: str = "float32", d_per_channel: bool = True) -> Plan:
    """One decode step for `dims` (seqlen and chunk_size are ignored) on a state of `state_dtype`, D per
    channel (nheads, headdim) or per head (nheads,).

    Returns:
      A Plan with inputs STATE_UPDATE_INPUTS, the buffers "y" (x's dtype) and "new_state" (`state_dtype`),
      and outputs STATE_UPDATE_OUTPUTS.
    """
    return Plan(
        inputs=STATE_UPDATE_INPUTS,
        buffers={"y": Buffer((dims.batch, dims.nheads, dims.headdim), dims.dtype),
                 "new_state": Buffer((dims.batch, dims.nheads, dims.headdim, dims.dstate), state_dtype)},
        launches=(state_update_launch(dims, cfg, d_per_channel),),
        outputs=STATE_UPDATE_OUTPUTS,
    )


# The decode step runs its default config (it is not tuned: one launch per token, bandwidth-bound).
STATE_UPDATE_STAGE = Stage(
    name="state_update", config_type=StateUpdateConfig, space=state_update_configs,
    default=state_update_default_config, launch=state_update_launch,
    key_fields=("headdim", "dstate", "dtype", "has_z", "dt_softplus", "has_dt_limit"),
    work_items=lambda d: d.batch * d.nheads)
