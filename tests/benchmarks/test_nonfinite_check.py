"""The non-finite check tool's HLO reading: the checks outside conditionals counted, the branches' not."""
import jax
import jax.numpy as jnp

from benchmarks.tools.nonfinite_check import is_finite_fusions_outside_branches


def _compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def test_is_finite_fusions_outside_branches_counts_each_check_and_skips_the_branches():
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 32))

    def checked(x, y):  # two checks; the recompute branch tests finiteness too
        finite = jnp.isfinite(x).all() & jnp.isfinite(jnp.sin(y)).all()
        return jax.lax.cond(finite, lambda x: x, lambda x: jnp.where(jnp.isfinite(x), x, 0.0) * 2, x)

    def branch_only(x):
        return jax.lax.cond(x[0, 0] > 0, lambda x: x, lambda x: jnp.where(jnp.isfinite(x), x, 0.0) * 2, x)

    assert is_finite_fusions_outside_branches(_compiled_text(checked, x, 2 * x)) >= 1
    assert is_finite_fusions_outside_branches(_compiled_text(branch_only, x)) == 0
    assert is_finite_fusions_outside_branches(_compiled_text(jnp.sin, x)) == 0
