"""The RMSNorm ops' cuTile path lowered for CUDA on this CPU machine (jax.export with backend="auto", kernels
compiled to sm_90 cubins by tileiras with the constraints JAX derives): the forward and both backward kernels of
the gated norm and of the add + norm, as the LM's training step holds them."""
import re

import jax
import jax.numpy as jnp
import numpy as np
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


@pytest.mark.parametrize("group_size,z_offset", [(np.int64(32), 8), (32, np.int64(8))], ids=["group_size", "z_offset"])
def test_aot_export_takes_numpy_ints_for_group_size_and_the_z_offset(group_size, z_offset):
    """NumPy ints pass the checks as Python ints do, and reach the kernels' shapes and constants as Python ints (a
    NumPy int was a symbolic dimension, or an array argument, to cutile_call's lowering)."""
    source = jax.random.normal(jax.random.key(0), (2, 4, 80), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (2, 4, 64), jnp.bfloat16)
    weight = jnp.ones((64,), jnp.float32)

    def loss(source, x, weight):
        z = source[..., 8:72]
        y = jax_mamba2.rms_norm(x, weight, z, group_size=group_size, z_kept_in=(source, z_offset))
        return jnp.sum(y.astype(jnp.float32) ** 2)

    exported = aot.export_for_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2)), source, x, weight)
    kernels = [re.sub(r"_Kt\d.*", "", name)
               for name in re.findall(r'function_name = "([^"]+)"', exported.mlir_module())]
    assert sorted(kernels) == ["rms_norm_bwd_kernel", "rms_norm_dweight_kernel", "rms_norm_fwd_kernel"], kernels
