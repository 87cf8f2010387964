"""bridge/eager.py's glue on the CPU: the op's checks, the problem's dims and kernel inputs built with the
caller's array namespace, and the forward plan, run block by block on the NumPy emulator of `cuda.tile` in
place of ct.launch (NumPy standing in for torch / CuPy). Against the float64 scan oracle."""
import jax
import numpy as np
import pytest

pytest.importorskip("cuda.tile")

from jax_mamba2 import reference, ssd_args  # noqa: E402
from jax_mamba2.bridge import eager  # noqa: E402
from tests._helpers import make_ssd_args, rel_l2, to_float64  # noqa: E402
from tests.kernels import _cutile_emulator as emulator  # noqa: E402

DIMS = dict(batch=2, seqlen=100, nheads=4, headdim=16, ngroups=2, dstate=16)


class NumpyNamespace:
    """eager.ArrayNamespace's operations on NumPy arrays."""

    name, module = "numpy", np

    def zeros(self, shape, dtype_name):
        return np.zeros(shape, dtype_name)

    def empty(self, shape, dtype_name):
        return np.empty(shape, dtype_name)

    def cast(self, arr, dtype_name):
        return np.ascontiguousarray(arr.astype(dtype_name))

    def stream(self):
        return None

    sequence_numbers = eager.ArrayNamespace.sequence_numbers  # CuPy's code, which NumPy runs as it is

    def dtype_name(self, arr) -> str:
        return str(arr.dtype)


@pytest.fixture
def launches(monkeypatch):
    """eager.ssd on NumPy, its plan on the emulator in float64; returns the (plan, input arrays) it ran."""
    plans = []

    def run_plan(plan, arrays, xp, stream=None):
        assert isinstance(xp, NumpyNamespace)
        plans.append((plan, arrays))
        out = emulator.run_plan(plan, arrays, float64=True)
        return {name: np.asarray(out[name]).view(np.ndarray) for name in plan.outputs}

    monkeypatch.setattr(eager, "ArrayNamespace", lambda module_name: NumpyNamespace())
    monkeypatch.setattr(eager, "run_plan", run_plan)
    return plans


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("D", ["head", "headdim"])
def test_eager_forward_matches_float64_scan(launches, dtype, D):
    args, kwargs = make_ssd_args(0, **DIMS, dtype=dtype, D=D, z=True, dt_bias=True, dt_softplus=True,
                                 dt_limit=(1e-3, 2.0), initial_states=True, seq_idx=[37, 63])
    y, final = eager.ssd(*args, 64, **kwargs, return_final_states=True)
    with jax.enable_x64(True):
        want_y, want_final = reference.ssd_scan(*to_float64(args), **to_float64(kwargs))
    assert rel_l2(y, want_y) < 1e-6 and rel_l2(final, want_final) < 1e-6
    ((_, arrays),) = launches
    # The jitted op's kernel inputs: dt kept in x's dtype (it has it), D per (head, headdim) in float32.
    assert arrays["x"].dtype == arrays["dt"].dtype == np.dtype(dtype)
    assert (arrays["D"].shape, arrays["D"].dtype) == ((DIMS["nheads"], DIMS["headdim"]), np.float32)


def test_eager_forward_gives_initial_states_to_a_first_sequence_of_id_0_alone(launches):
    """A row whose first sequence has id -1, then sequence 0 in the same chunk: the state restarts at both, as in
    the scan (the kernels take the sequences' numbers, as from the op), and int64 ids past int32 keep apart."""
    args, kwargs = make_ssd_args(4, **DIMS, dtype="float32", initial_states=True)
    kwargs["seq_idx"] = np.stack([np.repeat([-1, 0], [37, 63]), np.repeat([0, 2**32], [50, 50])])
    y, final = eager.ssd(*args, 64, **kwargs, return_final_states=True)
    with jax.enable_x64(True):
        want_y, want_final = reference.ssd_scan(*to_float64(args), **to_float64(kwargs))
        numbers = ssd_args.sequence_numbers(kwargs["seq_idx"])
    assert rel_l2(y, want_y) < 1e-6 and rel_l2(final, want_final) < 1e-6
    np.testing.assert_array_equal(launches[0][1]["seq_idx"], numbers)
    np.testing.assert_array_equal(numbers[:, [0, 36, 37, 49, 50, 99]], [[1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 1, 1]])


def test_eager_sequence_numbers_of_torch_ids_are_the_reference_s():
    torch = pytest.importorskip("torch")
    ids = np.stack([np.repeat([-1, 0, 3], [3, 4, 5]), np.repeat([0, 1, 7], [1, 10, 1])])
    numbers = eager.ArrayNamespace("torch").sequence_numbers(torch.from_numpy(ids))
    assert numbers.dtype == torch.int32
    np.testing.assert_array_equal(numbers.numpy(), ssd_args.sequence_numbers(ids))


def test_eager_checks_arguments_as_the_op_does_before_any_launch(launches):
    args, kwargs = make_ssd_args(1, **DIMS)
    x, dt, A, B, C = args
    with pytest.raises(ValueError, match=r"ssd: C.shape=\(2, 100, 2, 8\) must be \(batch, seqlen, ngroups"):
        eager.ssd(x, dt, A, B, C[..., :8], 64, **kwargs)
    with pytest.raises(ValueError, match=r"ssd: chunk_size=48 must be a power of two"):
        eager.ssd(*args, 48, **kwargs)
    with pytest.raises(ValueError, match=r"eager ssd cannot run this call: headdim=8"):
        eager.ssd(x[..., :8], dt, A, B, C, 64, **kwargs)
    assert launches == []
