"""The RMSNorm ops' cuTile path lowered for CUDA on this CPU machine (jax.export with backend="auto", kernels
compiled to sm_90 cubins by tileiras with the constraints JAX derives): the forward and both backward kernels of
the gated norm and of the add + norm, as the LM's training step holds them."""
import re

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("cuda.tile")

import jax_mamba2  # noqa: E402
from jax_mamba2.bridge import aot  # noqa: E402


def test_aot_export_lowers_the_norm_kernels_forward_and_backward():
    x = jax.random.normal(jax.random.key(0), (2, 100, 256), jnp.bfloat16)
    z = jax.random.normal(jax.random.key(1), x.shape, jnp.bfloat16)
    residual = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    weight = jnp.ones((256,), jnp.float32)

    def loss(x, z, residual, weight):
        normed, h = jax_mamba2.add_rms_norm(x, residual, weight, residual_dtype=jnp.float32)
        gated = jax_mamba2.rms_norm(normed, weight, z, group_size=128)
        return jnp.sum(gated.astype(jnp.float32) ** 2) + jnp.sum(h)

    exported = aot.export_for_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), x, z, residual, weight)
    kernels = [re.sub(r"_Kt\d.*", "", name)
               for name in re.findall(r'function_name = "([^"]+)"', exported.mlir_module())]
    assert sorted(kernels) == sorted(["rms_norm_fwd_kernel"] * 2 + ["rms_norm_bwd_kernel"] * 2 +
                                     ["rms_norm_dweight_kernel"] * 2), kernels
    assert exported.platforms == ("cuda",)
