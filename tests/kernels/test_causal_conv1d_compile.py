"""The conv kernels compile to sm_90 cubins on this machine (no GPU needed) with the constraints JAX uses, and at
the LM's training shapes their default tiles are what the configs' docstrings say: vector loads and stores per
row, no local memory, no stack, registers within the occupancy hint."""
import dataclasses
import functools
import re

import pytest

pytest.importorskip("cuda.tile")

from benchmarks.tools.sass import disassemble  # noqa: E402
from jax_mamba2.kernels.causal_conv1d import ConvDims, conv_arrays, conv_fwd_plan  # noqa: E402
from jax_mamba2.kernels.causal_conv1d_bwd import conv_bwd_arrays, conv_bwd_plan  # noqa: E402
from jax_mamba2.kernels.export import compile_launch  # noqa: E402
from tests.kernels._plan_checks import kernel_name  # noqa: E402

# The mixer of the LM at d_model 1024, batch 8 x 2048: conv_dim = 2304 channels, convolved in one launch from
# in_proj's output [z, xBC, dt] (2048 + 2304 + 32 channels) into x (2048), B and C (128 each) on one device,
# as x (2048) and [B, C] (256) apart under head parallelism.
_LM = ConvDims(batch=8, seqlen=2048, channels=2304, width=4)
PROBLEMS = {
    "bf16_lm": _LM,
    "bf16_lm_layout": dataclasses.replace(_LM, in_offset=2048, in_width=4384, split=(2048, 128, 128)),
    # The layer's call: z and dt copied through by blocks of their own.
    "bf16_lm_pass_through": dataclasses.replace(_LM, in_offset=2048, in_width=4384, split=(2048, 128, 128),
                                                pass_through=True),
    "bf16_lm_x": dataclasses.replace(_LM, channels=2048),
    "bf16_lm_bc": dataclasses.replace(_LM, channels=256),
    "bf16_seq_idx": dataclasses.replace(_LM, has_seq_idx=True),
    "bf16_init": dataclasses.replace(_LM, init_width=4),
    "f32_width3_init": dataclasses.replace(_LM, dtype="float32", width=3, init_width=2),
    "f16_no_activation_width2": dataclasses.replace(_LM, dtype="float16", width=2, silu=False, channels=100),
    # x has 2^31 elements: the int64-indexed variants.
    "bf16_int64_index": dataclasses.replace(_LM, batch=1, seqlen=1 << 20, channels=2048),
}


@functools.cache
def _compiled(problem: str) -> dict[str, tuple[str, str]]:
    """kernel name -> (SASS, resource usage) of the forward and backward launches of `problem`."""
    dims = PROBLEMS[problem]
    fwd, bwd = conv_fwd_plan(dims), conv_bwd_plan(dims)
    launches = [(launch, {**conv_arrays(dims), **fwd.buffers}) for launch in fwd.launches]
    launches += [(launch, conv_bwd_arrays(dims)) for launch in bwd.launches]
    compiled = {}
    for launch, arrays in launches:
        _, cubin = compile_launch(launch, arrays, "sm_90")
        assert cubin[:4] == b"\x7fELF", kernel_name(launch)
        compiled[kernel_name(launch)] = cubin
    return compiled


@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_conv_kernels_compile_to_sm90_cubins(problem):
    assert set(_compiled(problem)) == {"causal_conv1d_fwd_kernel", "causal_conv1d_bwd_kernel",
                                       "conv_grads_reduce_kernel"}


def sass_and_resources(cubin: bytes) -> tuple[str, str]:
    """(cuobjdump -sass, cuobjdump -res-usage) of `cubin`; skips the test without cuobjdump/nvdisasm."""
    try:
        return disassemble(cubin)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _usage(resources: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(REG|SHARED|LOCAL|STACK):(\d+)", resources)}


@pytest.mark.parametrize("problem,loads", [("bf16_lm", "LDG.E.64"), ("bf16_lm_bc", "LDG.E "),
                                           ("bf16_lm_layout", "LDG.E.64"), ("bf16_lm_pass_through", "LDG.E.128"),
                                           ("bf16_seq_idx", "LDG.E.64")])
def test_conv_forward_default_tile_is_spill_free_with_vector_rows(problem, loads):
    """8-row steps of 512 channels (256 for [B, C]): a vector load / store per row and thread, no shared or local
    memory, no stack, and at most 128 registers, which fits the occupancy hint of 4 blocks of 128 threads; the
    pass-through copies move 16 bytes per thread and row."""
    sass, resources = sass_and_resources(_compiled(problem)["causal_conv1d_fwd_kernel"])
    usage = _usage(resources)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0 and usage["SHARED"] == 0 and "LDL" not in sass, usage
    assert usage["REG"] <= 128, usage
    assert loads in sass and loads.replace("LDG", "STG") in sass


@pytest.mark.parametrize("problem", ["bf16_lm", "bf16_lm_layout", "bf16_lm_pass_through", "bf16_seq_idx",
                                     "f32_width3_init"])
def test_conv_backward_default_tile_is_spill_free(problem):
    """The backward's step keeps its rows in registers: no shared or local memory or stack, and at most 128
    registers, which fits the occupancy hint of 4 blocks of 128 threads."""
    for name in ("causal_conv1d_bwd_kernel", "conv_grads_reduce_kernel"):
        sass, resources = sass_and_resources(_compiled(problem)[name])
        usage = _usage(resources)
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0 and "LDL" not in sass, (name, usage)
        assert name != "causal_conv1d_bwd_kernel" or usage["SHARED"] == 0, usage
        assert name != "causal_conv1d_bwd_kernel" or usage["REG"] <= 128, usage


@pytest.mark.parametrize("problem", ["bf16_lm_pass_through", "bf16_lm", "bf16_seq_idx"])
def test_conv_forward_default_segments_load_each_step_ahead_of_its_stores(problem):
    """The default forward walks segments (16 steps of 8 tokens at these shapes): in the steps' loop the next
    step's gathers are all issued before this step's first store (the prefetch that a block of one tile cannot
    have)."""
    from jax_mamba2.kernels.causal_conv1d import conv_fwd_default_config
    from benchmarks.tools.sass import instructions, loops

    assert conv_fwd_default_config(PROBLEMS[problem]).SEGMENT_TILES == 16
    sass, _ = sass_and_resources(_compiled(problem)["causal_conv1d_fwd_kernel"])
    listing = instructions(sass)
    # The conv's loop is the longest one (the pass-through copy blocks have a loop of their own).
    loop = max(loops(sass), key=lambda lp: lp.instructions)
    body = [text for address, text in listing if loop.start <= address < loop.end]
    gathers = [i for i, text in enumerate(body) if "LDG" in text]
    stores = [i for i, text in enumerate(body) if "STG" in text]
    assert gathers and stores and max(gathers) < min(stores), (gathers[-3:], stores[:3])
