"""The bridge-overhead benchmark's programs (traced on CPU: one kernel call per launch), fit, table."""
import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("cuda.tile")

from benchmarks import bridge_overhead  # noqa: E402
from jax_mamba2.bridge import _compat  # noqa: E402


def test_bridge_overhead_programs_chain_one_kernel_call_per_launch():
    x = jnp.zeros((bridge_overhead.SIZE,), jnp.float32)
    for path, primitive in [("cutile_call", "cutile_call_ffi"), ("ffi_plan", "cutile_call_ffi"),
                            ("callback_plan", "buffer_callback")]:
        program = bridge_overhead._chained_jit(bridge_overhead._jax_step(path), 3)
        assert str(jax.make_jaxpr(program)(x)).count(primitive) == 3, path
    # Our FFI bridge lowers to the very program a bare cutile_call gives: no op of its own per launch (its
    # jaxpr wraps each plan in the custom_jvp that refuses higher derivatives, which lowering inlines).
    with _compat.cuda_target("sm_90"):
        bare, ours = (jax.jit(bridge_overhead._chained_jit(bridge_overhead._jax_step(path), 3)).trace(x).lower(
            lowering_platforms=("cuda",)).as_text() for path in ("cutile_call", "ffi_plan"))
    assert ours == bare and ours.count("stablehlo.custom_call") == 3
    assert bridge_overhead.fit([1, 32, 128], [10.0, 41.0, 137.0]) == pytest.approx((1.0, 9.0))
    table = bridge_overhead.format_table([
        {"impl": "ffi_plan", "us_median": [10.0, 41.0, 137.0], "us_per_extra_call": 1.0,
         "us_fixed": 9.0, "error": None},
        {"impl": "ct_launch", "error": "ImportError: no cupy"}])
    assert "1.00" in table and "ct_launch: ImportError: no cupy" in table
