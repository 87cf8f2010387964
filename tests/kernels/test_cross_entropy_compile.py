"""The LM loss's softmax kernels compile to sm_90 cubins on this machine (no GPU needed) with the constraints JAX
uses: bfloat16 and float32 logits, a vocabulary that is not a power of two with padded columns, int64-indexed
variants past 2^31 logits, latency hints, the LM's chunk of 2048 x 50280; and at the LM's shape their default
configurations run without spilling registers (cuobjdump, when available)."""
import re

import pytest

pytest.importorskip("cuda.tile")

from jax_mamba2.kernels.cross_entropy import (  # noqa: E402
    CrossEntropyConfig, CrossEntropyDims, cross_entropy_fwd_inputs, cross_entropy_fwd_plan, needs_int64_index)
from jax_mamba2.kernels.cross_entropy_bwd import cross_entropy_bwd_inputs, cross_entropy_bwd_plan  # noqa: E402
from tests.kernels.test_compile import plan_cubins, sass_and_resources  # noqa: E402

# The LM's chunk: 2048 tokens of mamba2's 50280-word vocabulary padded to a multiple of 16, bf16 logits and
# matmul operands.
LM_DIMS = CrossEntropyDims(rows=2048, padded_vocab=50288, vocab_size=50280)


def _cubins(dims: CrossEntropyDims, cfg=None) -> dict[str, bytes]:
    """kernel name -> sm_90 cubin of the forward and backward plans' launches for `dims` (in `cfg`)."""
    return plan_cubins((cross_entropy_fwd_plan(dims, cfg), cross_entropy_fwd_inputs(dims)),
                       (cross_entropy_bwd_plan(dims, cfg), cross_entropy_bwd_inputs(dims)))


@pytest.mark.parametrize("dims,cfg", [
    (CrossEntropyDims(rows=37, padded_vocab=200, vocab_size=190, dtype="float32", grad_dtype="float32"), None),
    (CrossEntropyDims(rows=37, padded_vocab=200, vocab_size=190, dtype="bfloat16", grad_dtype="float32"),
     CrossEntropyConfig(BLOCK_ROWS=4, BLOCK_V=64, FWD_OCCUPANCY=4, BWD_OCCUPANCY=2, FWD_LATENCY=3, BWD_LATENCY=4)),
    (CrossEntropyDims(rows=1 << 16, padded_vocab=50288, vocab_size=50280), None),
], ids=["f32_padded", "bf16_rows_per_block_latency", "bf16_int64_indexed"])
def test_kernels_compile_to_sm90_cubins(dims, cfg):
    cubins = _cubins(dims, cfg)
    assert set(cubins) == {"cross_entropy_fwd_kernel", "cross_entropy_bwd_kernel"}
    assert all(cubin[:4] == b"\x7fELF" for cubin in cubins.values())
    assert needs_int64_index(dims) == (dims.rows == 1 << 16)


@pytest.mark.slow
def test_default_configs_at_the_lm_chunk_compile_without_spills():
    """What cross_entropy_default_config says: spill-free (no local memory, no stack) at the LM's chunk."""
    for name, cubin in _cubins(LM_DIMS).items():
        assert cubin[:4] == b"\x7fELF", name
        sass, resources = sass_and_resources(cubin)
        usage = dict(re.findall(r"(LOCAL|STACK):(\d+)", resources))
        assert int(usage["LOCAL"]) == 0 and int(usage["STACK"]) == 0 and "LDL" not in sass, (name, usage)
