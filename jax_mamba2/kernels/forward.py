"""The SSD forward as a plan of launches, in one of three layouts:

- "staged": chunk_cumsum -> chunk_state (+ state passing, writing every chunk-entry state) -> chunk_scan;
- "fused": chunk_cumsum -> fused_scan (one block per chain carries its state through every chunk);
- "segmented": chunk_cumsum -> segment_states -> segmented_scan: the fused kernel with each sequence cut
  into `fused_segment_chunks(dims)`-chunk segments, one block each, started from the entry states the
  segment_states launch's per-segment end states give (more blocks where the chains are few and long).

`forward_plan(dims)` is what the bridge executes; `forward_arrays(dims, layout)` gives the shape and dtype
of every array a layout's plan names (inputs as the bridge passes them, dummies included), for AOT export
and tests.
"""
from typing import Any, Mapping, NamedTuple

from jax_mamba2.kernels import fused_scan
from jax_mamba2.kernels._common import Buffer, Plan, SSDDims, check_config_tiles
from jax_mamba2.kernels.chunk_cumsum import CHUNK_CUMSUM_STAGE
from jax_mamba2.kernels.chunk_scan import CHUNK_SCAN_STAGE
from jax_mamba2.kernels.chunk_state import CHUNK_STATE_STAGE
from jax_mamba2.kernels.fused_scan import (
    FUSED_SCAN_STAGE, SEGMENT_STATES_STAGE, SEGMENTED_SCAN_STAGE, fused_chains, fused_scan_supported,
    fused_segment_chunks, num_pieces, state_piece_chunks)

# The op's arrays as the kernels take them (the backward's too), then the forward's own `reach`: what the op
# adds to the rows of y where it confines non-finite values (SSDDims.has_reach).
SSD_INPUTS = ("x", "dt", "A", "dt_bias", "B", "C", "D", "z", "initial_states", "seq_idx")
FORWARD_INPUTS = SSD_INPUTS + ("reach",)
FORWARD_OUTPUTS = ("out", "final_states")
# What a forward saving for the backward outputs besides: the chunk-entry states and the chunk quantities
# (Δ and dA_cumsum, 8 bytes per token and head), so that the backward recomputes neither.
SAVED_FOR_BACKWARD = ("states", "dt_out", "dA_cumsum")
# Every forward stage by name (the key of its config in `configs`).
STAGES = {stage.name: stage for stage in (CHUNK_CUMSUM_STAGE, CHUNK_STATE_STAGE, CHUNK_SCAN_STAGE,
                                          FUSED_SCAN_STAGE, SEGMENT_STATES_STAGE, SEGMENTED_SCAN_STAGE)}
FORWARD_STAGES = tuple(STAGES)
# The stages of each layout, in launch order.
FORWARD_LAYOUTS = {
    "staged": ("chunk_cumsum", "chunk_state", "chunk_scan"),
    "fused": ("chunk_cumsum", "fused_scan"),
    "segmented": ("chunk_cumsum", "segment_states", "segmented_scan"),
}


class ForwardConfigs(NamedTuple):
    """A forward plan's layout (one of FORWARD_LAYOUTS) and the config of each of its stages, by name."""

    layout: str
    configs: Mapping[str, Any]


def forward_layouts(dims: SSDDims) -> tuple[str, ...]:
    """The layouts that can run `dims`: "staged" always; "fused" where the fused kernel supports it;
    "segmented" where, besides, the chains are too few (`fused_segment_chunks`)."""
    layouts = ["staged"]
    if fused_scan_supported(dims):
        layouts += ["fused", "segmented"] if fused_segment_chunks(dims) else ["fused"]
    return tuple(layouts)


def forward_layout(dims: SSDDims) -> str:
    """The layout used without measurements: for 16-bit inputs the fused kernel supports (chunk <= 64),
    "fused" when its default tile gives at least `fused_scan.FUSED_MIN_BLOCKS` sequential chains, else
    "segmented" where the sequences are long enough to cut (more blocks than the fused chains, fewer bytes
    than the staged layout's entry states); "staged" otherwise (and for f32 inputs, untimed in the fused
    kernel: only the tuner picks that, by measurement)."""
    layouts = forward_layouts(dims)
    if "fused" not in layouts or dims.dtype == "float32":
        return "staged"
    if fused_chains(dims) >= fused_scan.FUSED_MIN_BLOCKS:
        return "fused"
    return "segmented" if "segmented" in layouts else "staged"


def forward_inputs(dims: SSDDims) -> dict[str, Buffer]:
    """Shape and dtype of each input as the bridge passes it (absent optional ones as dummies), in the
    order of FORWARD_INPUTS."""
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
        "reach": Buffer((b, H, dims.nchunks, dims.chunk_size) if dims.has_reach else (1, 1, 1, 1), "float32"),
    }


def forward_buffers(dims: SSDDims, layout: str = "staged", save_states: bool = False) -> dict[str, Buffer]:
    """The intermediates and outputs the plan of `layout` (`save_states`) allocates (the fused layout's
    segment arrays, and the fused kernel's states when not saved, as zeroed dummies: never read, but
    every argument must be defined)."""
    b, H, P, N, nc, Q = dims.batch, dims.nheads, dims.headdim, dims.dstate, dims.nchunks, dims.chunk_size
    buffers = {
        "dt_out": Buffer((b, H, nc, Q), "float32"),
        "dA_cumsum": Buffer((b, H, nc, Q), "float32"),
        # Chunk-entry states in x's dtype, as mamba_ssm rounds them before chunk_scan.
        "states": Buffer((b, nc, H, P, N), dims.dtype),
        "out": Buffer((b, dims.seqlen, H, P), dims.dtype),
        "final_states": Buffer((b, H, P, N), "float32"),
    }
    if layout == "staged":
        return buffers
    if not save_states:
        buffers["states"] = Buffer((1, 1, 1, 1, 1), dims.dtype, zero_init=True)
    if layout == "fused":
        return {**buffers, "seg_states": Buffer((1, 1, 1, 1, 1), "float32", zero_init=True),
                "seg_decay": Buffer((1, 1, 1), "float32", zero_init=True)}
    # The end state of every piece of the segments before the last, as [headdim, dstate] tiles, and its
    # carry-through factor.
    earlier = num_pieces(dims, fused_segment_chunks(dims), state_piece_chunks(dims))
    return {**buffers, "seg_states": Buffer((b, earlier, H, P, N), "float32"),
            "seg_decay": Buffer((b, H, earlier), "float32")}


def forward_arrays(dims: SSDDims, layout: str = "staged", save_states: bool = False) -> dict[str, Buffer]:
    """Every array the forward plan of `dims` in `layout` (`save_states`) names: inputs, then buffers."""
    return {**forward_inputs(dims), **forward_buffers(dims, layout, save_states)}


def forward_plan(dims: SSDDims, configs: Mapping[str, object] | None = None, layout: str | None = None,
                 save_states: bool = False) -> Plan:
    """The SSD forward for `dims`.

    Args:
      dims: the problem.
      configs: optional stage name (one of the layout's FORWARD_LAYOUTS stages) -> that stage's config;
        missing stages use their default configuration.
      layout: one of FORWARD_LAYOUTS that can run `dims` (`forward_layouts`); None: `forward_layout(dims)`.
      save_states: also output SAVED_FOR_BACKWARD for `backward.backward_plan(..., saved_states=True)`:
        "states", the chunk-entry states (batch, nchunks, nheads, headdim, dstate) in x's dtype (the
        fused kernels store them as they pass; the staged layout has them anyway), and "dt_out",
        "dA_cumsum" (batch, nheads, nchunks, chunk_size) f32.

    Returns:
      A Plan with inputs FORWARD_INPUTS, buffers dt_out, dA_cumsum, out, final_states, states (a dummy
      in the fused layouts unless saved) and the segmented layout's seg_states, seg_decay, and outputs
      FORWARD_OUTPUTS (+ SAVED_FOR_BACKWARD with save_states).
    """
    configs = dict(configs or {})
    layout = layout or forward_layout(dims)
    if layout not in FORWARD_LAYOUTS:
        raise ValueError(f"forward_plan: layout={layout!r} must be one of {tuple(FORWARD_LAYOUTS)}")
    if layout not in forward_layouts(dims):
        raise ValueError(f"forward_plan: layout={layout!r} cannot run chunk_size={dims.chunk_size}, "
                         f"dstate={dims.dstate}, {fused_chains(dims)} chains of {dims.nchunks} chunks: "
                         f"the layouts for it are {forward_layouts(dims)}")
    stages = FORWARD_LAYOUTS[layout]
    unknown = set(configs) - set(stages)
    if unknown:
        raise ValueError(f"forward_plan: configs keys={sorted(unknown)} must be among {stages} "
                         f"(layout={layout!r})")
    check_config_tiles("forward_plan", configs, dims)
    # The fused kernels store the entry states only when asked (the staged chunk_state always does).
    options = {"fused_scan": {"write_states": save_states}, "segmented_scan": {"write_states": save_states}}
    return Plan(
        inputs=FORWARD_INPUTS,
        buffers=forward_buffers(dims, layout, save_states),
        launches=tuple(STAGES[stage].launch(dims, configs.get(stage), **options.get(stage, {}))
                       for stage in stages),
        outputs=FORWARD_OUTPUTS + (SAVED_FOR_BACKWARD if save_states else ()),
    )
