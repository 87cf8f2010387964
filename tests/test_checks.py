"""jax_mamba2.checks: the shared argument checks the ops and layers raise their errors through."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mamba2 import rms_norm
from jax_mamba2.checks import as_int, check_dt_limit, check_int


def test_check_int_returns_a_python_int_within_its_bounds():
    assert check_int("api", "n", np.int64(3), minimum=0, maximum=3) == 3
    assert type(check_int("api", "n", np.int32(2))) is int
    assert check_int("api", "n", 10**12) == 10**12  # no upper bound by default
    assert check_int("api", "n", jnp.int32(4), maximum=4) == 4  # a concrete JAX integer too


@pytest.mark.parametrize("value,error", [(True, TypeError), (2.0, TypeError), ("2", TypeError), (None, TypeError),
                                         (0, ValueError), (5, ValueError)])
def test_check_int_names_the_argument_and_its_requirement(value, error):
    with pytest.raises(error, match=r"^api: n=.* must be an int in \[1, 4\]$"):
        check_int("api", "n", value, "an int in [1, 4]", maximum=4)


def test_as_int_reads_concrete_integers_of_python_numpy_and_jax():
    for value in (3, np.int64(3), np.array(3, np.uint8), jnp.int32(3)):
        assert as_int(value) == 3 and type(as_int(value)) is int
    for value in (True, jnp.bool_(True), 3.0, jnp.float32(3), jnp.ones(1, jnp.int32), "3", None):
        assert as_int(value) is None, value
    assert jax.jit(lambda k: jnp.int32(as_int(k) is None))(3) == 1  # a tracer has no value yet


def test_the_ops_integer_options_take_concrete_jax_integers_as_their_values():
    """chunk_size, group_size and the conv's split as 0-d JAX integers compute what the Python ints do."""
    from jax_mamba2 import causal_conv1d_silu_split, ssd
    keys = jax.random.split(jax.random.key(0), 6)
    x, dt = jax.random.normal(keys[0], (1, 24, 2, 4)), jax.random.normal(keys[1], (1, 24, 2))
    B = C = jax.random.normal(keys[2], (1, 24, 1, 4))
    A = -jnp.exp(jax.random.normal(keys[3], (2,)))
    np.testing.assert_array_equal(ssd(x, dt, A, B, C, jnp.int32(8), dt_softplus=True, backend="xla"),
                                  ssd(x, dt, A, B, C, 8, dt_softplus=True, backend="xla"))
    h, w = jax.random.normal(keys[4], (3, 8)), jax.random.normal(keys[5], (8,))
    np.testing.assert_array_equal(rms_norm(h, w, group_size=jnp.int32(4), backend="xla"),
                                  rms_norm(h, w, group_size=4, backend="xla"))
    u, kernel = jax.random.normal(keys[0], (1, 10, 12)), jax.random.normal(keys[1], (4, 8))
    pieces = [causal_conv1d_silu_split(u, kernel, channel_offset=2, split=split, backend="xla")
              for split in ((jnp.int32(6), jnp.int32(2)), (6, 2))]
    for got, want in zip(*pieces, strict=True):
        np.testing.assert_array_equal(got, want)


def test_rms_norm_refuses_a_z_source_offset_past_its_columns():
    x = jnp.ones((2, 8), jnp.float32)
    source = jnp.ones((2, 12), jnp.float32)
    z = source[:, 4:]
    rms_norm(x, jnp.ones(8), z, z_kept_in=(source, 4), backend="xla")  # the last offset that fits
    with pytest.raises(ValueError, match=r"z_kept_in\[1\]=5 must be an int with 0 <= offset and offset \+ "
                                         r"features=8 <= columns=12"):
        rms_norm(x, jnp.ones(8), z, z_kept_in=(source, 5), backend="xla")
    with pytest.raises(TypeError, match=r"z_kept_in\[1\]=4.0 must be"):
        rms_norm(x, jnp.ones(8), z, z_kept_in=(source, 4.0), backend="xla")


def test_check_dt_limit_takes_python_numpy_and_concrete_jax_scalars():
    assert check_dt_limit("api", (jnp.float32(0.5), np.float64(2.0))) == (0.5, 2.0)
    assert check_dt_limit("api", np.array([0, 1])) == (0.0, 1.0)
    for pair in ((jnp.bool_(True), 1.0), (jnp.zeros(2), 1.0), (jnp.complex64(1), 2.0)):
        with pytest.raises(TypeError, match=r"^api: dt_limit=.* must be a pair of floats \(min, max\)$"):
            check_dt_limit("api", pair)
    with pytest.raises(TypeError, match="must be a pair of floats"):  # a traced bound has no value to build with
        jax.jit(lambda low: check_dt_limit("api", (low, 1.0)))(0.0)
