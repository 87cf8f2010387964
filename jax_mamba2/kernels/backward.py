"""The SSD backward as a plan: recompute the forward's chunk quantities, then five backward stages.

    1. chunk_cumsum        (forward)  Δ, dA_cumsum
    2. chunk_state         (forward)  chunk-entry states H_c in x's dtype (final_states recomputed, unused);
                                      1 and 2 are skipped when the forward saved them (`saved_states`)
    3. chunk_scan_bwd_dc   dC, dD partials, dA_cumsum grads of the output
    4. chunk_state_bwd     reverse state pass: ∂L/∂(chunk end states), dinitial_states, carry's dA grad
    5. chunk_scan_bwd_dx   dx, dB, ∂L/∂Δ (explicit factors), end-state dA grads
    6. chunk_cumsum_bwd    ddt through cumsum / dt_limit / softplus; dA, ddt_bias partials
    7. param_grads_bwd     dA, ddt_bias, dD summed over (batch, chunk) in a fixed order

The kernels are gate-free: dout is ∂L/∂y of the output before any gate z, whose VJP the caller takes
(bridge/ops.py applies the gate and its VJP as XLA elementwise ops, with the pre-gate output the forward
saved). The math of each stage is in its module docstring (notation in _tiles.py). The heads of a group
share dB and dC: each block of the dB/dC passes sums some heads of a group (`group_heads_per_block`), and
where a group spans several blocks they add their sums atomically into zero-initialised f32 buffers; a
block owning a whole group stores its sum in x's dtype (no zero fill, no cast after). `deterministic=True`
always gives each block a whole group (no float atomics), and since every other reduction is a fixed-order
sum, the plan's outputs are then bitwise reproducible.
"""
import math
from typing import Mapping

from jax_mamba2.kernels._block_pass_config import adds_atomically
from jax_mamba2.kernels._common import Buffer, Plan, SSDDims, check_config_tiles
from jax_mamba2.kernels.chunk_cumsum import CHUNK_CUMSUM_STAGE, chunk_cumsum_fwd_launch
from jax_mamba2.kernels.chunk_cumsum_bwd import CHUNK_CUMSUM_BWD_STAGE, chunk_cumsum_bwd_launch
from jax_mamba2.kernels.chunk_scan_bwd_dc import (
    CHUNK_SCAN_BWD_DC_STAGE, chunk_scan_bwd_dc_default_config, chunk_scan_bwd_dc_launch)
from jax_mamba2.kernels.chunk_scan_bwd_dx import CHUNK_SCAN_BWD_DX_STAGE, chunk_scan_bwd_dx_launch
from jax_mamba2.kernels.chunk_state import CHUNK_STATE_STAGE, chunk_state_fwd_launch
from jax_mamba2.kernels.chunk_state_bwd import (
    CHUNK_STATE_BWD_STAGE, chunk_state_bwd_carry_terms, chunk_state_bwd_default_config, chunk_state_bwd_launch)
from jax_mamba2.kernels.forward import SAVED_FOR_BACKWARD, SSD_INPUTS, forward_inputs
from jax_mamba2.kernels.param_grads_bwd import PARAM_GRADS_BWD_STAGE, param_grads_bwd_launch

BACKWARD_INPUTS = SSD_INPUTS + ("dx_reach", "dout", "dfinal_states")
BACKWARD_OUTPUTS = ("dx", "ddt", "dA", "dB", "dC", "dD", "ddt_bias", "dinitial_states")
# Every backward stage by name, in launch order (the first two are the forward stages it recomputes with).
STAGES = {stage.name: stage for stage in (
    CHUNK_CUMSUM_STAGE, CHUNK_STATE_STAGE, CHUNK_SCAN_BWD_DC_STAGE, CHUNK_STATE_BWD_STAGE, CHUNK_SCAN_BWD_DX_STAGE,
    CHUNK_CUMSUM_BWD_STAGE, PARAM_GRADS_BWD_STAGE)}
BACKWARD_STAGES = tuple(STAGES)


# The group-reducing passes (chunk_scan_bwd_dc, chunk_scan_bwd_dx) give a block as many heads of a group as
# keep at least this many blocks in the launch: each block adds one f32 (rows x dstate) tile of dB or dC,
# so more heads per block divide the atomic traffic (and a whole group per block needs none), and fewer,
# longer blocks still fill an H200's 132 SMs at 2 blocks per SM in 2 waves.
MIN_GROUP_PASS_BLOCKS = 512


def group_heads_per_block(dims: SSDDims, deterministic: bool, atomic_heads_per_block: int | None = None) -> int:
    """The heads per block of the group-reducing passes (chunk_scan_bwd_dc sums dC, chunk_scan_bwd_dx dB).

    deterministic: the whole group (no atomics). Otherwise `atomic_heads_per_block` (a power of 2; the
    largest such divisor of heads_per_group up to it is used), by default the whole group wherever that
    leaves `MIN_GROUP_PASS_BLOCKS` blocks of 64 rows, whatever the head count; else the largest power of 2
    that does. More heads per block measured faster at every count up to the whole group, also where that
    leaves fewer blocks than heads (80 heads of one group).
    """
    if deterministic:
        return dims.heads_per_group
    if atomic_heads_per_block is None:
        row_blocks = dims.batch * dims.nchunks * max(1, dims.chunk_size // 64) * dims.nheads
        if row_blocks // dims.heads_per_group >= MIN_GROUP_PASS_BLOCKS:
            return dims.heads_per_group
        atomic_heads_per_block = 1
        while (dims.heads_per_group % (2 * atomic_heads_per_block) == 0
               and row_blocks // (2 * atomic_heads_per_block) >= MIN_GROUP_PASS_BLOCKS):
            atomic_heads_per_block *= 2
    return math.gcd(atomic_heads_per_block, dims.heads_per_group)


def backward_inputs(dims: SSDDims, saved_states: bool = False) -> dict[str, Buffer]:
    """Shape and dtype of each input: the op's arrays as the forward takes them (dummies included), dx_reach
    (what the dx pass adds to the rows of dx, shaped as the forward's `reach`), dout (b, L, H, P) in x's dtype
    and dfinal_states (b, H, P, N) f32 (zeros when final_states was not used); with `saved_states`,
    the forward's SAVED_FOR_BACKWARD: chunk-entry states (b, nchunks, H, P, N) in x's dtype, dt_out and
    dA_cumsum (b, H, nchunks, chunk_size) f32."""
    b, L, H, P, N = dims.batch, dims.seqlen, dims.nheads, dims.headdim, dims.dstate
    saved = dict(zip(SAVED_FOR_BACKWARD, (_states(dims), _per_row(dims), _per_row(dims)))) if saved_states else {}
    forward = forward_inputs(dims)
    return {**{name: forward[name] for name in SSD_INPUTS}, "dx_reach": forward["reach"],
            "dout": Buffer((b, L, H, P), dims.dtype),
            "dfinal_states": Buffer((b, H, P, N), "float32"),
            **saved}


def _states(dims: SSDDims) -> Buffer:
    # Chunk-entry states and their gradients in x's dtype, as mamba_ssm's backward keeps them: the
    # passes that read them round them to x's dtype for their products anyway, and at chunk 64 each
    # is as large as x times dstate / chunk_size (half the bytes of f32).
    return Buffer((dims.batch, dims.nchunks, dims.nheads, dims.headdim, dims.dstate), dims.dtype)


def _per_row(dims: SSDDims) -> Buffer:
    return Buffer((dims.batch, dims.nheads, dims.nchunks, dims.chunk_size), "float32")


def _stage_configs(dims: SSDDims, configs: Mapping[str, object] | None) -> dict[str, object]:
    configs = dict(configs or {})
    unknown = set(configs) - set(BACKWARD_STAGES)
    if unknown:
        raise ValueError(f"backward_plan: configs keys={sorted(unknown)} must be among {BACKWARD_STAGES}")
    check_config_tiles("backward_plan", configs, dims)
    configs.setdefault("chunk_scan_bwd_dc", chunk_scan_bwd_dc_default_config(dims))
    configs.setdefault("chunk_state_bwd", chunk_state_bwd_default_config(dims))
    return configs


def backward_buffers(dims: SSDDims, configs: Mapping[str, object] | None = None, deterministic: bool = False,
                     atomic_heads_per_block: int | None = None, saved_states: bool = False
                     ) -> dict[str, Buffer]:
    """The intermediates and outputs `backward_plan(dims, configs, deterministic=...,
    atomic_heads_per_block=..., saved_states=...)` allocates."""
    configs = _stage_configs(dims, configs)
    b, L, H, P, G, N = dims.batch, dims.seqlen, dims.nheads, dims.headdim, dims.ngroups, dims.dstate
    nc, Q, T = dims.nchunks, dims.chunk_size, dims.dtype
    num_m_blocks = Q // configs["chunk_scan_bwd_dc"].BLOCK_M
    carry_terms = chunk_state_bwd_carry_terms(dims, configs["chunk_state_bwd"])
    per_row = _per_row(dims)
    # Atomic head reductions need zeroed dB/dC; a block owning its whole group stores them.
    atomic = adds_atomically(dims, group_heads_per_block(dims, deterministic, atomic_heads_per_block))
    recomputed = {} if saved_states else {"dt_out": per_row, "dA_cumsum": per_row, "states": _states(dims),
                                          "final_states": Buffer((b, H, P, N), "float32")}
    return {
        **recomputed,
        # Intermediates of the backward stages.
        "ddA_intra": Buffer((b, H, nc, num_m_blocks, Q), "float32"),
        "ddA_inter": per_row,
        # Zeroed where row blocks can lie wholly past seqlen (they write no partial row).
        "dD_partials": Buffer((b * nc * num_m_blocks, H, P), "float32", zero_init=num_m_blocks > 1),
        "dstates": _states(dims),
        "ddA_chunk": Buffer((b, H, nc, carry_terms), "float32"),
        "ddt_out": per_row,
        "ddA_state": per_row,
        "dA_partials": Buffer((b * nc, H), "float32"),
        "ddt_bias_partials": Buffer((b * nc, H), "float32"),
        # Outputs.
        "dx": Buffer((b, L, H, P), T),
        "ddt": Buffer((b, L, H), dims.dt_dtype),
        "dA": Buffer((H,), "float32"),
        "dB": Buffer((b, L, G, N), "float32" if atomic else T, zero_init=atomic),
        "dC": Buffer((b, L, G, N), "float32" if atomic else T, zero_init=atomic),
        "dD": Buffer((H, P), "float32"),
        "ddt_bias": Buffer((H,), "float32"),
        "dinitial_states": Buffer((b, H, P, N), "float32"),
    }


def backward_arrays(dims: SSDDims, configs: Mapping[str, object] | None = None, deterministic: bool = False,
                    atomic_heads_per_block: int | None = None, saved_states: bool = False
                    ) -> dict[str, Buffer]:
    """Every array `backward_plan(dims, configs, ...)` names: inputs, then buffers."""
    return {**backward_inputs(dims, saved_states),
            **backward_buffers(dims, configs, deterministic, atomic_heads_per_block, saved_states)}


def backward_plan(dims: SSDDims, configs: Mapping[str, object] | None = None, *,
                  deterministic: bool = False, atomic_heads_per_block: int | None = None,
                  saved_states: bool = False) -> Plan:
    """The SSD backward for `dims`.

    Args:
      dims: the problem.
      configs: optional stage name (one of BACKWARD_STAGES) -> that stage's config; missing stages use
        their default configuration.
      deterministic: no float atomics (one block per group for the dB/dC head sums), bitwise
        reproducible outputs.
      atomic_heads_per_block: heads per block of the dB/dC passes when not deterministic (default: see
        `group_heads_per_block`).
      saved_states: the forward's chunk-entry states and chunk quantities are inputs (SAVED_FOR_BACKWARD,
        from `forward.forward_plan(..., save_states=True)`) instead of being recomputed.

    Returns:
      A Plan with inputs BACKWARD_INPUTS and outputs BACKWARD_OUTPUTS: dx (b, L, H, P) in x's dtype; dB, dC
      (b, L, G, N) in f32 where added atomically, else in x's dtype; ddt (b, L, H) w.r.t. the raw dt, in dt's
      dtype; dA (H,), dD (H, P) (the caller sums over P for a per-head D), ddt_bias (H,), dinitial_states
      (b, H, P, N), f32.

    Raises:
      ValueError: dims.has_z (the caller takes a gate's VJP outside the kernels).
    """
    if dims.has_z:
        raise ValueError("backward_plan: dims.has_z must be False: the backward kernels are gate-free (take "
                         "the gate's VJP outside them, as bridge/ops.py does)")
    configs = _stage_configs(dims, configs)
    heads = group_heads_per_block(dims, deterministic, atomic_heads_per_block)
    dc_config = configs["chunk_scan_bwd_dc"]
    state_config = configs["chunk_state_bwd"]
    recompute = () if saved_states else (chunk_cumsum_fwd_launch(dims, configs.get("chunk_cumsum")),
                                         chunk_state_fwd_launch(dims, configs.get("chunk_state")))
    return Plan(
        inputs=BACKWARD_INPUTS + (SAVED_FOR_BACKWARD if saved_states else ()),
        buffers=backward_buffers(dims, configs, deterministic, atomic_heads_per_block, saved_states),
        launches=recompute + (
            chunk_scan_bwd_dc_launch(dims, dc_config, heads_per_block=heads),
            chunk_state_bwd_launch(dims, state_config),
            chunk_scan_bwd_dx_launch(dims, configs.get("chunk_scan_bwd_dx"), heads_per_block=heads),
            chunk_cumsum_bwd_launch(dims, configs.get("chunk_cumsum_bwd"), dc_block_m=dc_config.BLOCK_M,
                                    carry_terms=chunk_state_bwd_carry_terms(dims, state_config)),
            param_grads_bwd_launch(dims, configs.get("param_grads_bwd")),
        ),
        outputs=BACKWARD_OUTPUTS,
    )
