"""Shared test setup: 8 fake CPU devices for sharding tests, and the `gpu` marker.

Tests marked `@pytest.mark.gpu` need a CUDA device and the cuTile compiler; without them they are
skipped with the reason, never counted as passing.
"""
import os

# Must happen before jax initialises its backends.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

# Parallel workers (pytest -n) share the one GPU: none may reserve most of its memory up front.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Tests use the documented default kernel configs: autotuning every test shape would take minutes.
os.environ.setdefault("JAX_MAMBA2_AUTOTUNE", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


def _gpu_unavailable_reason():
    try:
        if not any(d.platform == "gpu" for d in jax.devices()):
            return "no CUDA device visible to JAX"
    except RuntimeError as e:  # no backend at all
        return f"no CUDA device: {e}"
    try:
        import cuda.tile  # noqa: F401
    except ImportError:
        return "cuda-tile is not installed"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_kernel_compiles_left_over_from_the_previous_test():
    """A test that only traces a cuTile program (jaxpr and HLO checks) leaves its launches noted for
    concurrent compilation; the next test that lowers one must not compile them as well."""
    yield
    try:
        from jax_mamba2.bridge import compile_ahead
    except ImportError:  # no cuda-tile: nothing is ever noted
        return
    compile_ahead.discard_pending()
