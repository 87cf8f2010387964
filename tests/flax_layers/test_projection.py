"""`project`: the layers' (and the decode ops' xla path's) dense projection equals the plain product, and one
row stays a matrix product."""
import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel
from jax_mamba2.projection import MIN_MATMUL_ROWS, project
from tests.flax_layers._programs import walk


@pytest.mark.parametrize("lead", [(1,), (1, 1), (3,), (2, 5), (0,), (1, 0)])
def test_project_equals_the_plain_product(lead):
    inputs = jax.random.normal(jax.random.key(0), (*lead, 24), jnp.float32)
    kernel = jax.random.normal(jax.random.key(1), (24, 40), jnp.float32)
    got = project(inputs, kernel)
    assert got.shape == (*lead, 40) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, np.einsum("...d,de->...e", np.asarray(inputs, np.float64), kernel),
                               rtol=1e-5, atol=1e-5)


def test_project_keeps_the_operands_result_dtype():
    inputs = jnp.ones((1, 8), jnp.bfloat16)
    assert project(inputs, jnp.ones((8, 4), jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("lead", [(1,), (3, 5)])
def test_project_with_a_dtype_converts_the_kernel_again_in_the_backward_instead_of_keeping_it(lead):
    """dtype=bf16 with a float32 kernel: the value and the gradients of the plain converted product, and the
    backward keeps the float32 parameter (which lives anyway), not a bfloat16 copy of it."""
    inputs = jax.random.normal(jax.random.key(0), (*lead, 24), jnp.float32)
    kernel = jax.random.normal(jax.random.key(1), (24, 40), jnp.float32)

    def loss(project_fn, inputs, kernel):
        return jnp.sum(jnp.sin(project_fn(inputs, kernel).astype(jnp.float32)))
    converted = lambda x, w: project(x, w, dtype=jnp.bfloat16)  # noqa: E731
    plain = lambda x, w: project(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))  # noqa: E731
    assert converted(inputs, kernel).dtype == jnp.bfloat16
    np.testing.assert_array_equal(converted(inputs, kernel), plain(inputs, kernel))
    for got, want in zip(jax.grad(lambda *a: loss(converted, *a), argnums=(0, 1))(inputs, kernel),
                         jax.grad(lambda *a: loss(plain, *a), argnums=(0, 1))(inputs, kernel)):
        np.testing.assert_array_equal(got, want)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(lambda *a: loss(converted, *a), inputs, kernel)
    assert "bf16[24,40]" not in printed.getvalue() and "f32[24,40] from the argument" in printed.getvalue()
    assert project(inputs, kernel, dtype=jnp.float32).dtype == jnp.float32  # no conversion, the plain product


def _lhs_rows_of_products(jaxpr, weight_shapes) -> list[int]:
    """Rows (all but the contracted last axis) of the left operand of every dot_general whose right operand
    has one of `weight_shapes`."""
    return [int(np.prod(eqn.invars[0].aval.shape[:-1])) for eqn, _ in walk(jaxpr)
            if eqn.primitive.name == "dot_general" and tuple(eqn.invars[1].aval.shape) in weight_shapes]


def test_a_batch_one_decode_step_runs_the_mixer_projections_as_matrix_products():
    config = Mamba2Config(d_model=32, n_layer=2, vocab_size=64, ssm_cfg=dict(d_state=16, headdim=16, chunk_size=8))
    model = Mamba2LMHeadModel(config, backend="xla", rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda state, token, cache: nnx.merge(graphdef, state).step(token, cache))(
        state, jnp.zeros((1,), jnp.int32), model.init_cache(1))
    mixer = model.layers.mixer
    weights = {tuple(mixer.in_proj.kernel.shape[1:]), tuple(mixer.out_proj.kernel.shape[1:])}  # per layer
    rows = _lhs_rows_of_products(jaxpr, weights)
    assert len(rows) == 2 * config.n_layer  # in_proj and out_proj of each layer (the fused step unrolls them)
    assert min(rows) >= MIN_MATMUL_ROWS
