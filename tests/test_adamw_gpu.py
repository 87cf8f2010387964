"""AdamW's update kernel on the GPU (run on the H200; skipped elsewhere): the kernel at the LM's largest leaf (the
tied embedding, 50280 x 1024) against the float64 reference with both executors, and `fused_adamw.apply` on an
LM's parameters against the xla backend over steps under jit, with the parameters and state donated and updated
in place (no parameter-sized temporary in the compiled step).

    python -m pytest -m gpu tests/test_adamw_gpu.py
"""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jax_mamba2
from jax_mamba2.adamw_reference import AdamWHyper
from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel
from tests._helpers import rel_l2
from tests.kernels._adamw_checks import HYPER, make_inputs, oracle, output_error, step_error

pytestmark = pytest.mark.gpu

EMBEDDING = 50280 * 1024


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-6), ("bfloat16", 5e-3)])
def test_kernel_at_the_embedding_matches_float64_reference(backend, dtype, tolerance):
    arrays = make_inputs(EMBEDDING, seed=0, dtypes=(dtype,) * 4)
    hyper = AdamWHyper(*(jnp.float32(HYPER[f]) for f in AdamWHyper._fields))
    got = jax.jit(lambda p, g, m, v: jax_mamba2.adamw_update(p, g, m, v, hyper, backend=backend))(
        *(jnp.asarray(arrays[n]) for n in ("param", "grad", "mu", "nu")))
    got = dict(zip(("param", "mu", "nu"), got))
    want = oracle(arrays, decay=True)
    assert output_error(got, want) < tolerance
    if dtype == "float32":  # the step itself, not only the parameter it moved
        assert step_error(got, arrays, want) < 1e-4


def test_fused_step_on_lm_parameters_matches_xla_in_place():
    config = Mamba2Config(d_model=512, n_layer=4, vocab_size=50280, ssm_cfg=dict(d_state=64, headdim=64))
    params = nnx.as_pure(nnx.state(Mamba2LMHeadModel(config, backend="xla", rngs=nnx.Rngs(0)), nnx.Param))
    grads = jax.tree.map(lambda p: 0.01 * jax.random.normal(jax.random.key(1), p.shape, p.dtype), params)
    results = {}
    for backend in ("cutile", "xla"):
        tx = jax_mamba2.fused_adamw(1e-3, b2=0.95, weight_decay=0.1, max_grad_norm=1.0, backend=backend)
        p, state = jax.tree.map(jnp.copy, params), tx.init(params)
        apply = jax.jit(tx.apply, donate_argnums=(0, 2))
        if backend == "cutile":
            # In place: nothing parameter-sized is allocated besides the donated inputs.
            temp = apply.lower(p, grads, state).compile().memory_analysis().temp_size_in_bytes
            largest = max(leaf.nbytes for leaf in jax.tree.leaves(params))
            assert temp < largest // 4, (temp, largest)
        for _ in range(3):
            p, state = apply(p, grads, state)
        results[backend] = (p, state)
    for a, b in zip(jax.tree.leaves(results["cutile"]), jax.tree.leaves(results["xla"])):
        assert a.dtype == b.dtype and (a.size == 0 or a.ndim == 0 or rel_l2(a, b) < 1e-5)
