"""Structural checks of a kernel `Plan` (no compilation, no GPU)."""
import inspect

from jax_mamba2.kernels._common import kernel_signature
from jax_mamba2.kernels._common import kernel_name as _function_name


def kernel_name(launch) -> str:
    return _function_name(launch.kernel)


def assert_plan_well_formed(plan) -> None:
    """Every launch passes one argument per kernel parameter, names only plan arrays, aliases none, writes only
    buffers or inputs the plan returns (updated in place), and reads only arrays that are defined by then: plan
    inputs, zero-initialised buffers, or buffers an earlier launch wrote (the FFI path allocates nothing else,
    so an undefined read fails there only)."""
    assert not set(plan.inputs) & set(plan.buffers)
    defined = set(plan.inputs) | {name for name, buf in plan.buffers.items() if buf.zero_init}
    for launch in plan.launches:
        names = [a for a in launch.args if isinstance(a, str)]
        params = inspect.signature(kernel_signature(launch.kernel).pyfunc).parameters
        assert len(launch.args) == len(params), kernel_name(launch)
        assert set(names) <= set(plan.inputs) | set(plan.buffers), kernel_name(launch)
        in_place = set(plan.inputs) & set(plan.outputs)
        assert set(launch.writes) <= set(names) and set(launch.writes) <= set(plan.buffers) | in_place
        read = set(names) - set(launch.writes)
        assert read <= defined, f"{kernel_name(launch)} reads {read - defined} before any write"
        assert len(names) == len(set(names)), f"{kernel_name(launch)} aliases an array"
        defined |= set(launch.writes)
    assert set(plan.outputs) <= defined
