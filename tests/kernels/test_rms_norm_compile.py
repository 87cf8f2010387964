"""The RMSNorm kernels compile to sm_90 cubins on this machine (no GPU needed) with the constraints JAX uses, and
at the LM's shapes their default configurations run without spilling registers (cuobjdump, when available)."""
import dataclasses
import re

import pytest

pytest.importorskip("cuda.tile")

from jax_mamba2.kernels.rms_norm import (  # noqa: E402
    NormDims, needs_int64_index, norm_default_config, rms_norm_fwd_inputs, rms_norm_fwd_plan)
from jax_mamba2.kernels.rms_norm_bwd import rms_norm_bwd_inputs, rms_norm_bwd_plan  # noqa: E402
from tests.kernels.test_compile import plan_cubins, sass_and_resources  # noqa: E402

ROWS = 8 * 2048  # the LM benchmark's batch x seqlen
LM_PROBLEMS = {
    # The mixer's gated norm (d_ssm 2048, one group), both gate placements; mamba2-130m's 1536 (a padded tile).
    "gated_before_2048": NormDims(rows=ROWS, ngroups=1, group_size=2048, z_dtype="bfloat16"),
    "gated_after_2048": NormDims(rows=ROWS, ngroups=1, group_size=2048, z_dtype="bfloat16", norm_before_gate=True),
    "gated_before_1536": NormDims(rows=ROWS, ngroups=1, group_size=1536, z_dtype="bfloat16"),
    # 8 groups of 256 (ngroups > 1 on the grid's second axis).
    "gated_before_8x256": NormDims(rows=ROWS, ngroups=8, group_size=256, z_dtype="bfloat16"),
    # The LM's gated norm as the mixer calls it: the backward reads z from in_proj's output [z, xBC, dt] (d1024:
    # 4384 columns, z first; d1536: 6448, a 3072-wide group in a 4096 tile).
    "gated_before_2048_z_in_proj": NormDims(rows=ROWS, ngroups=1, group_size=2048, z_dtype="bfloat16",
                                            z_columns=4384),
    "gated_before_3072_z_in_proj": NormDims(rows=ROWS, ngroups=1, group_size=3072, z_dtype="bfloat16",
                                            z_columns=6448),
    # An odd width and offset (an odd number of heads): rows no TMA descriptor can address.
    "gated_before_2048_z_odd": NormDims(rows=ROWS, ngroups=1, group_size=2048, z_dtype="bfloat16", z_columns=4385,
                                        z_offset=3),
    # The block's add + norm (d_model 1024, bf16 input, float32 residual stream).
    "add_norm_1024": NormDims(rows=ROWS, ngroups=1, group_size=1024, residual_dtype="float32",
                              residual_in_dtype="float32"),
}


def _cubins(dims: NormDims, cfg=None) -> dict[str, bytes]:
    """kernel name -> sm_90 cubin of every launch of the forward and backward plans of `dims` (in `cfg`)."""
    return plan_cubins((rms_norm_fwd_plan(dims, cfg), rms_norm_fwd_inputs(dims)),
                       (rms_norm_bwd_plan(dims, cfg), rms_norm_bwd_inputs(dims)))


def test_kernels_compile_to_sm90_cubins_float32_and_int64_indexed():
    """A float32 plain norm, and a problem of 2^31 elements, whose kernels index with int64."""
    for dims in (NormDims(rows=300, ngroups=1, group_size=96, dtype="float32", out_dtype="float32"),
                 NormDims(rows=1 << 20, ngroups=2, group_size=1024, z_dtype="bfloat16")):
        cubins = _cubins(dims)
        assert set(cubins) == {"rms_norm_fwd_kernel", "rms_norm_bwd_kernel", "rms_norm_dweight_kernel"}
        assert all(cubin[:4] == b"\x7fELF" for cubin in cubins.values())
    assert needs_int64_index(dims)


def test_the_z_window_counts_toward_int64_indexing():
    """The wider array the backward reads z from is indexed like the per-row arrays: past 2^31 elements it asks
    for the int64 kernels, though the per-row arrays alone would not."""
    dims = NormDims(rows=1 << 20, ngroups=1, group_size=1024, z_dtype="bfloat16")
    assert not needs_int64_index(dims)
    assert needs_int64_index(dataclasses.replace(dims, z_columns=4384, z_offset=2048))


@pytest.mark.slow
@pytest.mark.parametrize("problem", list(LM_PROBLEMS))
def test_default_configs_at_lm_shapes_have_no_spills(problem):
    """What norm_default_config says: spill-free (no local memory, no stack) at the LM's shapes."""
    for name, cubin in _cubins(LM_PROBLEMS[problem]).items():
        sass, resources = sass_and_resources(cubin)
        usage = dict(re.findall(r"(LOCAL|STACK):(\d+)", resources))
        assert int(usage["LOCAL"]) == 0 and int(usage["STACK"]) == 0 and "LDL" not in sass, (name, usage)


@pytest.mark.slow
@pytest.mark.parametrize("problem", ["gated_before_2048", "add_norm_1024"])
def test_latency_hints_keep_the_default_tiles_spill_free(problem):
    """The benchmark sweep's deepest prefetch (forward latency 3, backward loop latency 4) at the default tiles
    and occupancies still fits the registers."""
    dims = LM_PROBLEMS[problem]
    cfg = dataclasses.replace(norm_default_config(dims), FWD_LATENCY=3, BWD_LATENCY=4)
    for name, cubin in _cubins(dims, cfg).items():
        sass, resources = sass_and_resources(cubin)
        usage = dict(re.findall(r"(LOCAL|STACK):(\d+)", resources))
        assert int(usage["LOCAL"]) == 0 and int(usage["STACK"]) == 0 and "LDL" not in sass, (name, usage)
