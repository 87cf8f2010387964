"""The non-finite check tool's HLO reading: the fused computations that test finiteness counted."""
import jax
import jax.numpy as jnp

from benchmarks.tools.nonfinite_check import is_finite_fusions


def _compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def test_is_finite_fusions_counts_the_computations_that_test_finiteness():
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 32))

    def finite_part(x):
        return jnp.where(jnp.isfinite(x), x, 0.0) * 2

    assert is_finite_fusions(_compiled_text(finite_part, x)) >= 1
    assert is_finite_fusions(_compiled_text(jnp.sin, x)) == 0
