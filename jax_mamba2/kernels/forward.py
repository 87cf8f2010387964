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
from typing import Mapping

from jax_mamba2.kernels._common import Buffer, Plan, SSDDims, check_config_tiles
from jax_mamba2.kernels.chunk_cumsum import chunk_cumsum_fwd_launch
from jax_mamba2.kernels.chunk_scan import chunk_scan_fwd_launch
from jax_mamba2.kernels.chunk_state import chunk_state_fwd_launch
from jax_mamba2.kernels.fused_scan import (
    fused_scan_fwd_default_config, fused_scan_fwd_launch, fused_scan_supported, num_pieces, segment_states_launch)

FORWARD_INPUTS = ("x", "dt", "A", "dt_bias", "B", "C", "D", "z", "initial_states", "seq_idx")
FORWARD_OUTPUTS = ("out", "final_states")
# What a forward saving for the backward outputs besides: the chunk-entry states and the chunk quantities
# (Δ and dA_cumsum, 8 bytes per token and head), so that the backward recomputes neither.
SAVED_FOR_BACKWARD = ("states", "dt_out", "dA_cumsum")
# The stage names `configs` is keyed by, per layout, in launch order.
FORWARD_LAYOUTS = {
    "staged": ("chunk_cumsum", "chunk_state", "chunk_scan"),
    "fused": ("chunk_cumsum", "fused_scan"),
    "segmented": ("chunk_cumsum", "segment_states", "segmented_scan"),
}
FORWARD_STAGES = tuple(dict.fromkeys(s for stages in FORWARD_LAYOUTS.values() for s in stages))
# The fused layout's blocks are sequential chains over the chunks: with fewer than this many (at its
# default tile) the staged layout's chunk-parallel launches win. Measured on the H200 (132 SMs), chunk
# 64, bf16: 128 blocks fused 0.236 vs staged 0.431 ms at (4,8192,32,64,128,1), 0.090 vs 0.137 at
# (4,2048,...); 64 blocks even at (2,32768,...) (0.868 vs 0.854); 32 blocks staged at (4,16384,8,...)
# (0.465 vs 0.311) and (1,131072,32,...) (3.39 vs 2.02).
FUSED_MIN_BLOCKS = 128
# The shortest segment the segmented layout cuts a sequence into, in chunks.
MIN_SEGMENT_CHUNKS = 8
# The longest piece segment_states walks (one block per piece, from a zero state): the segments before
# the last are cut into pieces of at most this many chunks, so that pass is many short chains. Measured on
# the H200 (bf16, chunk 64, segment_states + segmented_scan per launch, ms): one piece per segment (as
# long as the segment) / 8 / 16 / 32 chunks: (2,32768,32,64,128,1) 0.213 + 0.468 / 0.123 + 0.512 /
# 0.110 + 0.484 / 0.103 + 0.478; (4,16384,8,...) 0.065 + 0.145 / 0.059 + 0.148 / 0.060 + 0.146 /
# 0.057 + 0.135; (1,131072,32,...) 0.409 + 0.924 / 0.331 + 1.037 / 0.303 + 0.982 / 0.282 + 0.951
# (more pieces: more end states for the later segments to fold in).
MAX_PIECE_CHUNKS = 32


def _fused_chains(dims: SSDDims) -> int:
    return dims.batch * dims.nheads * (dims.headdim // fused_scan_fwd_default_config(dims).BLOCK_P)


def _pieces_per_segment(segment_chunks: int) -> int:
    return -(-segment_chunks // MAX_PIECE_CHUNKS)


def fused_segment_chunks(dims: SSDDims) -> int:
    """Chunks per segment of the segmented layout: the sequence cut into the fewest power-of-two
    segments that bring the fused chains to FUSED_MIN_BLOCKS, none shorter than MIN_SEGMENT_CHUNKS,
    rounded up to a whole number of `state_piece_chunks` pieces; 0 where that is one segment (the
    segmented layout does not apply)."""
    segments = 1
    while (_fused_chains(dims) * segments < FUSED_MIN_BLOCKS
           and dims.nchunks >= 2 * segments * MIN_SEGMENT_CHUNKS):
        segments *= 2
    if segments == 1:
        return 0
    chunks = -(-dims.nchunks // segments)
    pieces = _pieces_per_segment(chunks)
    return pieces * -(-chunks // pieces)


def state_piece_chunks(dims: SSDDims) -> int:
    """Chunks per piece of segment_states (a divisor of `fused_segment_chunks(dims)`, at most
    MAX_PIECE_CHUNKS); 0 without segments."""
    segment_chunks = fused_segment_chunks(dims)
    return segment_chunks // _pieces_per_segment(segment_chunks) if segment_chunks else 0


def forward_layouts(dims: SSDDims) -> tuple[str, ...]:
    """The layouts that can run `dims`: "staged" always; "fused" where the fused kernel supports it;
    "segmented" where, besides, the chains are too few (`fused_segment_chunks`)."""
    layouts = ["staged"]
    if fused_scan_supported(dims):
        layouts += ["fused", "segmented"] if fused_segment_chunks(dims) else ["fused"]
    return tuple(layouts)


def forward_layout(dims: SSDDims) -> str:
    """The layout used without measurements: for 16-bit inputs the fused kernel supports (chunk <= 64),
    "fused" when its default tile gives at least FUSED_MIN_BLOCKS sequential chains, else "segmented"
    where the sequences are long enough to cut; "staged" otherwise (and for f32 inputs, untimed in the
    fused kernel: only the tuner picks that, by measurement). On the H200 (bf16, chunk 64, per launch)
    segmented took (4,16384,8,64,128,1) 0.301 -> 0.220 ms, (2,32768,32,...) 0.826 -> 0.720 and
    (1,131072,32,...) 1.99 -> 1.36 against staged (fused: 0.452, 0.855, 3.26)."""
    layouts = forward_layouts(dims)
    if "fused" not in layouts or dims.dtype == "float32":
        return "staged"
    if _fused_chains(dims) >= FUSED_MIN_BLOCKS:
        return "fused"
    return "segmented" if "segmented" in layouts else "staged"


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


def configs_layout(dims: SSDDims, configs: Mapping[str, object]) -> str:
    """The layout whose own stages (those not shared by every layout) `configs` names, as the tuner's
    `forward_configs` returns them; `forward_layout(dims)` when they name none (or several)."""
    shared = set.intersection(*(set(stages) for stages in FORWARD_LAYOUTS.values()))
    named = [name for name, stages in FORWARD_LAYOUTS.items() if set(configs) & (set(stages) - shared)]
    return named[0] if len(named) == 1 else forward_layout(dims)


def forward_plan(dims: SSDDims, configs: Mapping[str, object] | None = None, layout: str | None = None,
                 save_states: bool = False) -> Plan:
    """The SSD forward for `dims`.

    Args:
      dims: the problem.
      configs: optional stage name (one of the layout's FORWARD_LAYOUTS stages) -> that stage's config;
        missing stages use their default configuration.
      layout: one of FORWARD_LAYOUTS that can run `dims` (`forward_layouts`); None:
        `configs_layout(dims, configs)`.
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
    layout = layout or configs_layout(dims, configs)
    if layout not in FORWARD_LAYOUTS:
        raise ValueError(f"forward_plan: layout={layout!r} must be one of {tuple(FORWARD_LAYOUTS)}")
    if layout not in forward_layouts(dims):
        raise ValueError(f"forward_plan: layout={layout!r} cannot run chunk_size={dims.chunk_size}, "
                         f"dstate={dims.dstate}, {_fused_chains(dims)} chains of {dims.nchunks} chunks: "
                         f"the layouts for it are {forward_layouts(dims)}")
    stages = FORWARD_LAYOUTS[layout]
    unknown = set(configs) - set(stages)
    if unknown:
        raise ValueError(f"forward_plan: configs keys={sorted(unknown)} must be among {stages} "
                         f"(layout={layout!r})")
    check_config_tiles("forward_plan", configs, dims)
    segment_chunks = fused_segment_chunks(dims) if layout == "segmented" else 0
    piece_chunks = state_piece_chunks(dims) if layout == "segmented" else 0
    launch_of = {
        "chunk_cumsum": chunk_cumsum_fwd_launch, "chunk_state": chunk_state_fwd_launch,
        "chunk_scan": chunk_scan_fwd_launch,
        "fused_scan": lambda d, cfg: fused_scan_fwd_launch(d, cfg, write_states=save_states),
        "segment_states": lambda d, cfg: segment_states_launch(d, cfg, segment_chunks, piece_chunks),
        "segmented_scan": lambda d, cfg: fused_scan_fwd_launch(d, cfg, segment_chunks, piece_chunks,
                                                               write_states=save_states)}
    return Plan(
        inputs=FORWARD_INPUTS,
        buffers=forward_buffers(dims, layout, save_states),
        launches=tuple(launch_of[stage](dims, configs.get(stage)) for stage in stages),
        outputs=FORWARD_OUTPUTS + (SAVED_FOR_BACKWARD if save_states else ()),
    )
