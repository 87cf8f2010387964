"""The cuTile backend lowered for CUDA on this CPU machine (jax.export, cubins compiled by tileiras with
the constraints JAX derives): forward and backward plans, every optional input."""
import re

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("cuda.tile")

import jax_mamba2  # noqa: E402
from jax_mamba2.bridge import aot  # noqa: E402
from tests._helpers import make_ssd_args  # noqa: E402


def _kernels(exported) -> list[str]:
    text = exported.mlir_module()
    return [re.sub(r"_Kt\d.*", "", name) for name in re.findall(r'function_name = "([^"]+)"', text)]


def test_aot_export_lowers_forward_and_backward_kernels_for_sm90():
    args, kwargs = make_ssd_args(0, batch=2, seqlen=100, nheads=4, headdim=32, ngroups=2, dstate=32,
                                 dtype=jnp.bfloat16, D="head", z=True, dt_bias=True, dt_softplus=True,
                                 initial_states=True, seq_idx=[60, 40])

    def loss(x, dt, A, B, C):
        y, final = jax_mamba2.ssd(x, dt, A, B, C, 64, **kwargs, return_final_states=True)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(final)

    exported = aot.export_for_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)), *args)
    kernels = _kernels(exported)
    assert kernels[:3] == ["chunk_cumsum_fwd_kernel", "chunk_state_fwd_kernel", "chunk_scan_fwd_kernel"]
    assert {"chunk_scan_bwd_dc_kernel", "chunk_state_bwd_kernel", "chunk_scan_bwd_dx_kernel",
            "chunk_cumsum_bwd_kernel", "param_grads_bwd_kernel"} <= set(kernels), kernels
    assert exported.platforms == ("cuda",)
    assert len(exported.serialize()) > 0


def test_aot_target_is_scoped():
    from jax_mamba2.bridge import problem
    with aot.cuda_target("sm_90"):
        assert problem.gpu_unavailable_reason() is None
    assert problem.gpu_unavailable_reason() is not None  # this CPU machine
