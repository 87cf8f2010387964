"""The SSD forward as a plan of three launches: chunk_cumsum -> chunk_state (+ state passing) -> chunk_scan.

`forward_plan(dims)` is what the bridge executes; `forward_arrays(dims)` gives the shape and dtype of every
array the plan names (inputs as the bridge passes them, dummies included), for AOT export and tests.
"""
from typing import Mapping

from jax_mamba2.kernels._common import Buffer, Plan, SSDDims
from jax_mamba2.kernels.chunk_cumsum import chunk_cumsum_fwd_launch
from jax_mamba2.kernels.chunk_scan import chunk_scan_fwd_launch
from jax_mamba2.kernels.chunk_state import chunk_state_fwd_launch

FORWARD_INPUTS = ("x", "dt", "A", "dt_bias", "B", "C", "D", "z", "initial_states", "seq_idx")
FORWARD_OUTPUTS = ("out", "final_states")
# The stage names `configs` is keyed by.
FORWARD_STAGES = ("chunk_cumsum", "chunk_state", "chunk_scan")


def forward_inputs(dims: SSDDims) -> dict[str, Buffer]:
    """Shape and dtype of each input as the bridge passes it (absent optional ones as dummies)."""
    b, L, H, P, G, N = dims.batch, dims.seqlen, dims.nheads, dims.headdim, dims.ngroups, dims.dstate
    T = dims.dtype
    return {
        "x": Buffer((b, L, H, P), T),
        "dt": Buffer((b, L, H), dims.dt_dtype),
        "A": Buffer((H,), "float32"),
        "dt_bias": Buffer((H,), "float32"),
        "B": Buffer((b, L, G, N), T),
        "C": Buffer((b, L, G, N), T),
        "D": Buffer((H, P), "float32"),
        "z": Buffer((b, L, H, P) if dims.has_z else (1, 1, 1, 1), T),
        "initial_states": Buffer((b, H, P, N) if dims.has_init else (1, 1, 1, 1), "float32"),
        "seq_idx": Buffer((b, L) if dims.has_seq_idx else (1, 1), "int32"),
    }


def forward_buffers(dims: SSDDims) -> dict[str, Buffer]:
    """The intermediates and outputs the plan allocates."""
    b, H, P, N, nc, Q = dims.batch, dims.nheads, dims.headdim, dims.dstate, dims.nchunks, dims.chunk_size
    return {
        "dt_out": Buffer((b, H, nc, Q), "float32"),
        "dA_cumsum": Buffer((b, H, nc, Q), "float32"),
        # Chunk-entry states in x's dtype, as mamba_ssm rounds them before chunk_scan.
        "states": Buffer((b, nc, H, P, N), dims.dtype),
        "out": Buffer((b, dims.seqlen, H, P), dims.dtype),
        "final_states": Buffer((b, H, P, N), "float32"),
    }


def forward_arrays(dims: SSDDims) -> dict[str, Buffer]:
    """Every array `forward_plan(dims)` names: inputs, then buffers."""
    return {**forward_inputs(dims), **forward_buffers(dims)}


def forward_plan(dims: SSDDims, configs: Mapping[str, object] | None = None) -> Plan:
    """The SSD forward for `dims`.

    Args:
      dims: the problem.
      configs: optional stage name (one of FORWARD_STAGES) -> that stage's config; missing stages use
        their default configuration.

    Returns:
      A Plan with inputs FORWARD_INPUTS, buffers dt_out, dA_cumsum, states, out, final_states, and
      outputs ("out", "final_states").
    """
    configs = dict(configs or {})
    unknown = set(configs) - set(FORWARD_STAGES)
    if unknown:
        raise ValueError(f"forward_plan: configs keys={sorted(unknown)} must be among {FORWARD_STAGES}")
    return Plan(
        inputs=FORWARD_INPUTS,
        buffers=forward_buffers(dims),
        launches=(
            chunk_cumsum_fwd_launch(dims, configs.get("chunk_cumsum")),
            chunk_state_fwd_launch(dims, configs.get("chunk_state")),
            chunk_scan_fwd_launch(dims, configs.get("chunk_scan")),
        ),
        outputs=FORWARD_OUTPUTS,
    )
