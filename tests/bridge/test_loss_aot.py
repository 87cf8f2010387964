"""The LM loss's softmax kernels lowered for CUDA on this CPU machine (jax.export of chunked_cross_entropy with
backend="auto", the kernels compiled to sm_90 cubins by tileiras with the constraints JAX derives from the
avals): one forward and one backward kernel in the loss's value and gradient, bf16 logits of a vocabulary that
is not a power of two."""
import re

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("cuda.tile")

from jax_mamba2.bridge import aot  # noqa: E402
from jax_mamba2 import chunked_cross_entropy  # noqa: E402


def test_aot_export_lowers_the_loss_kernels_forward_and_backward():
    hidden = jax.random.normal(jax.random.key(0), (2, 100, 64), jnp.bfloat16)
    weight = jax.random.normal(jax.random.key(1), (64, 1008), jnp.bfloat16)
    labels = jax.random.randint(jax.random.key(2), (2, 100), 0, 1000)

    def loss(hidden, weight):
        return chunked_cross_entropy(hidden, labels, head_weight=weight, vocab_size=1000, chunk_tokens=128,
                                     logits_dtype=jnp.bfloat16, backend="auto")

    exported = aot.export_for_cuda(jax.value_and_grad(loss, argnums=(0, 1)), hidden, weight)
    kernels = [re.sub(r"_Kt\d.*", "", name)
               for name in re.findall(r'function_name = "([^"]+)"', exported.mlir_module())]
    assert sorted(kernels) == ["cross_entropy_bwd_kernel", "cross_entropy_fwd_kernel"], kernels
    assert exported.platforms == ("cuda",)
