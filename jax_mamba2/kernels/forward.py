"""The SSD forward as a plan of launches, in one of two layouts:

- "staged": chunk_cumsum -> chunk_state (+ state passing, writing every chunk-entry state) -> chunk_scan;
- "fused": chunk_cumsum -> fused_scan (states carried in the SM, never written).

`forward_plan(dims)` is what the bridge executes, in the layout `forward_layout(dims)` picks;
`forward_arrays(dims)` gives the shape and dtype of every array either layout names (inputs as the bridge
passes them, dummies included), for AOT export and tests.
"""
from typing import Mapping

from jax_mamba2.kernels._common import Buffer, Plan, SSDDims
from jax_mamba2.kernels.chunk_cumsum import chunk_cumsum_fwd_launch
from jax_mamba2.kernels.chunk_scan import chunk_scan_fwd_launch
from jax_mamba2.kernels.chunk_state import chunk_state_fwd_launch
from jax_mamba2.kernels.fused_scan import fused_scan_fwd_default_config, fused_scan_fwd_launch, fused_scan_supported

FORWARD_INPUTS = ("x", "dt", "A", "dt_bias", "B", "C", "D", "z", "initial_states", "seq_idx")
FORWARD_OUTPUTS = ("out", "final_states")
# The stage names `configs` is keyed by, per layout, in launch order.
FORWARD_LAYOUTS = {
    "staged": ("chunk_cumsum", "chunk_state", "chunk_scan"),
    "fused": ("chunk_cumsum", "fused_scan"),
}
FORWARD_STAGES = tuple(dict.fromkeys(s for stages in FORWARD_LAYOUTS.values() for s in stages))
# The fused layout's blocks are sequential chains over the chunks: with fewer than this many (at its
# default tile) the staged layout's chunk-parallel launches win. Measured on the H200 (132 SMs), chunk
# 64, bf16: 128 blocks fused 0.236 vs staged 0.431 ms at (4,8192,32,64,128,1), 0.090 vs 0.137 at
# (4,2048,...); 64 blocks even at (2,32768,...) (0.868 vs 0.854); 32 blocks staged at (4,16384,8,...)
# (0.465 vs 0.311) and (1,131072,32,...) (3.39 vs 2.02).
FUSED_MIN_BLOCKS = 128


def forward_layouts(dims: SSDDims) -> tuple[str, ...]:
    """The layouts that can run `dims`: "staged" always, "fused" where the fused kernel supports it."""
    return ("staged", "fused") if fused_scan_supported(dims) else ("staged",)


def forward_layout(dims: SSDDims) -> str:
    """"fused" when the fused kernel supports `dims` (16-bit inputs, chunk <= 64) and its default tile
    gives at least FUSED_MIN_BLOCKS sequential chains, else "staged". (f32 inputs have not been timed
    fused: staged.)"""
    if "fused" not in forward_layouts(dims) or dims.dtype == "float32":
        return "staged"
    blocks = dims.batch * dims.nheads * (dims.headdim // fused_scan_fwd_default_config(dims).BLOCK_P)
    return "fused" if blocks >= FUSED_MIN_BLOCKS else "staged"


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


def forward_buffers(dims: SSDDims, layout: str = "staged") -> dict[str, Buffer]:
    """The intermediates and outputs the plan of `layout` allocates."""
    b, H, P, N, nc, Q = dims.batch, dims.nheads, dims.headdim, dims.dstate, dims.nchunks, dims.chunk_size
    buffers = {
        "dt_out": Buffer((b, H, nc, Q), "float32"),
        "dA_cumsum": Buffer((b, H, nc, Q), "float32"),
        # Chunk-entry states in x's dtype, as mamba_ssm rounds them before chunk_scan.
        "states": Buffer((b, nc, H, P, N), dims.dtype),
        "out": Buffer((b, dims.seqlen, H, P), dims.dtype),
        "final_states": Buffer((b, H, P, N), "float32"),
    }
    if layout == "fused":
        del buffers["states"]
    return buffers


def forward_arrays(dims: SSDDims) -> dict[str, Buffer]:
    """Every array a forward plan of `dims` names, in either layout: inputs, then buffers."""
    return {**forward_inputs(dims), **forward_buffers(dims)}


def configs_layout(dims: SSDDims, configs: Mapping[str, object]) -> str:
    """The layout whose own stages (those not shared by every layout) `configs` names, as the tuner's
    `forward_configs` returns them; `forward_layout(dims)` when they name none (or several)."""
    shared = set.intersection(*(set(stages) for stages in FORWARD_LAYOUTS.values()))
    named = [name for name, stages in FORWARD_LAYOUTS.items() if set(configs) & (set(stages) - shared)]
    return named[0] if len(named) == 1 else forward_layout(dims)


def forward_plan(dims: SSDDims, configs: Mapping[str, object] | None = None, layout: str | None = None
                 ) -> Plan:
    """The SSD forward for `dims`.

    Args:
      dims: the problem.
      configs: optional stage name (one of the layout's FORWARD_LAYOUTS stages) -> that stage's config;
        missing stages use their default configuration.
      layout: "staged" or "fused"; None: `configs_layout(dims, configs)`.

    Returns:
      A Plan with inputs FORWARD_INPUTS, buffers dt_out, dA_cumsum, out, final_states (and states in
      the staged layout), and outputs ("out", "final_states").
    """
    configs = dict(configs or {})
    layout = layout or configs_layout(dims, configs)
    if layout not in FORWARD_LAYOUTS:
        raise ValueError(f"forward_plan: layout={layout!r} must be one of {tuple(FORWARD_LAYOUTS)}")
    if layout not in forward_layouts(dims):
        raise ValueError(f"forward_plan: layout='fused' needs chunk_size in (16, 32, 64) and dstate <= 512, "
                         f"got chunk_size={dims.chunk_size}, dstate={dims.dstate}")
    stages = FORWARD_LAYOUTS[layout]
    unknown = set(configs) - set(stages)
    if unknown:
        raise ValueError(f"forward_plan: configs keys={sorted(unknown)} must be among {stages} "
                         f"(layout={layout!r})")
    launch_of = {"chunk_cumsum": chunk_cumsum_fwd_launch, "chunk_state": chunk_state_fwd_launch,
                 "chunk_scan": chunk_scan_fwd_launch, "fused_scan": fused_scan_fwd_launch}
    return Plan(
        inputs=FORWARD_INPUTS,
        buffers=forward_buffers(dims, layout),
        launches=tuple(launch_of[stage](dims, configs.get(stage)) for stage in stages),
        outputs=FORWARD_OUTPUTS,
    )
