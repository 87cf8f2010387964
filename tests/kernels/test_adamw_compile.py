"""AdamW's update kernel compiles to sm_90 cubins on this machine (no GPU needed) with the constraints JAX uses:
float32 and bfloat16 arrays, moments in another dtype than the parameter, the int64-indexed variant past 2^31
elements; and at the default block it streams every array with 16-byte loads and stores, without spilling
(cuobjdump, when available)."""
import re

import pytest

pytest.importorskip("cuda.tile")

from jax_mamba2.kernels.adamw import HYPER_SIZE, AdamWDims, adamw_inputs, adamw_plan  # noqa: E402
from tests.kernels.test_compile import plan_cubins, sass_and_resources  # noqa: E402

# The LM's largest leaf: the tied embedding of mamba2's 50280-word vocabulary at d_model 1024.
EMBEDDING = 50280 * 1024


def _cubin(dims: AdamWDims) -> bytes:
    (cubin,) = plan_cubins((adamw_plan(dims), adamw_inputs(dims))).values()
    return cubin


@pytest.mark.parametrize("dims", [
    AdamWDims(size=EMBEDDING),
    AdamWDims(size=1000, param_dtype="bfloat16", grad_dtype="bfloat16", decay=False),
    AdamWDims(size=(1 << 31) + 5),
], ids=["f32_embedding", "bf16_params_f32_moments_no_decay", "int64_indexed"])
def test_kernel_compiles_to_sm90_cubin(dims):
    assert _cubin(dims)[:4] == b"\x7fELF"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_block_streams_with_16_byte_accesses_and_no_spills(dtype):
    """Every access to the four arrays is a 128-bit LDG / STG (the only narrower loads are the HYPER_SIZE step
    scalars); no local memory, no stack."""
    sass, resources = sass_and_resources(_cubin(AdamWDims(size=EMBEDDING, param_dtype=dtype, grad_dtype=dtype,
                                                          mu_dtype=dtype, nu_dtype=dtype)))
    usage = dict(re.findall(r"(LOCAL|STACK):(\d+)", resources))
    assert int(usage["LOCAL"]) == 0 and int(usage["STACK"]) == 0 and "LDL" not in sass, usage
    loads = re.findall(r"\bLDG\.E(\S*)", sass)
    stores = re.findall(r"\bSTG\.E(\S*)", sass)
    assert loads.count(".128") >= 4 and len(loads) - loads.count(".128") == HYPER_SIZE, loads
    assert stores and set(stores) == {".128"}, stores
