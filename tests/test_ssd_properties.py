"""Property test: on random small shapes and option combinations, `ssd(backend="xla")` in float32 matches
the float64 scan, forward and every gradient (relative L2 error). Marked slow: each of the 25 examples
compiles a program of its own (a few seconds of CPU each)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

import jax_mamba2  # noqa: E402
from jax_mamba2 import reference  # noqa: E402
from tests._helpers import make_ssd_args, rel_l2, to_float64  # noqa: E402

_OPTIONAL = ("D", "z", "dt_bias", "initial_states")


@st.composite
def problems(draw):
    """(make_ssd_args keyword arguments, chunk_size): any option combination, L often not a multiple."""
    seqlen = draw(st.integers(1, 40))
    ngroups = draw(st.sampled_from([1, 2]))
    cuts = sorted(draw(st.sets(st.integers(1, seqlen - 1), max_size=3))) if seqlen > 1 else []
    lengths = np.diff([0, *cuts, seqlen]).tolist()
    return dict(
        batch=draw(st.integers(1, 2)), seqlen=seqlen, nheads=ngroups * draw(st.sampled_from([1, 2])),
        headdim=draw(st.sampled_from([1, 3, 4])), ngroups=ngroups, dstate=draw(st.sampled_from([1, 2, 5])),
        D=draw(st.sampled_from([None, "head", "headdim"])), z=draw(st.booleans()),
        dt_bias=draw(st.booleans()), dt_softplus=draw(st.booleans()),
        dt_limit=draw(st.sampled_from([None, (0.01, 0.4), (0.0, 2.0)])),
        initial_states=draw(st.booleans()),
        seq_idx=lengths if draw(st.booleans()) else None,
    ), draw(st.sampled_from([4, 8, 16]))


def _outputs_and_grads(ssd_fn, args, optional, seq_idx, weights):
    """((y, final_states), (grads of args, grads of optional)) of sum(y w_y) + sum(final w_final)."""
    def loss(args, optional):
        y, final = ssd_fn(*args, **optional, seq_idx=seq_idx)
        return jnp.sum(y * weights[0]) + jnp.sum(final * weights[1]), (y, final)

    (_, outputs), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(args, optional)
    return outputs, grads


def _xla_and_scan(args, optional, seq_idx, weights, static, chunk_size):
    """The xla backend on the float32 operands and the scan on their float64 copies, in one program."""
    xla = functools.partial(jax_mamba2.ssd, chunk_size=chunk_size, return_final_states=True, backend="xla",
                            **static)
    scan = functools.partial(reference.ssd_scan, **static)
    return (_outputs_and_grads(xla, args, optional, seq_idx, weights),
            _outputs_and_grads(scan, *to_float64((args, optional)), seq_idx, to_float64(weights)))


def _error(got, want) -> float:
    """Relative L2 error, or the absolute one where the expected value is exactly 0 (e.g. dA at seqlen 1)."""
    return rel_l2(got, want) if np.linalg.norm(np.asarray(want, np.float64)) > 0 else float(
        np.linalg.norm(np.asarray(got, np.float64)))


# Each example is a new program: compiled without LLVM's optimizations, which halves the compile time
# that dominates the test and leaves the float32 results to within rounding.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


@pytest.mark.slow
@settings(max_examples=15, deadline=None, derandomize=True)
@given(problems(), st.integers(0, 2 ** 16))
def test_xla_matches_float64_scan_on_random_problems(problem, seed):
    options, chunk_size = problem
    args, kwargs = make_ssd_args(seed, **options)
    if "dt_bias" in kwargs and not options["dt_softplus"] and options["dt_limit"] is None:
        kwargs["dt_bias"] = jnp.abs(kwargs["dt_bias"])  # Δ = dt + dt_bias must be >= 0 (a precondition)
    optional = {name: kwargs.pop(name) for name in _OPTIONAL if name in kwargs}
    seq_idx = kwargs.pop("seq_idx", None)
    static = dict(dt_softplus=kwargs.pop("dt_softplus"), dt_limit=tuple(kwargs.pop("dt_limit", (0.0, np.inf))))
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), 2)
    final_shape = (options["batch"], options["nheads"], options["headdim"], options["dstate"])
    weights = (jax.random.normal(keys[0], args[0].shape), jax.random.normal(keys[1], final_shape))

    with jax.enable_x64(True):
        run = jax.jit(functools.partial(_xla_and_scan, static=static, chunk_size=chunk_size))
        got, want = run.lower(args, optional, seq_idx, weights).compile(_FAST_COMPILE)(
            args, optional, seq_idx, weights)
    (y, final), (grad_args, grad_optional) = got
    (want_y, want_final), (want_args, want_optional) = jax.tree.map(np.asarray, want)
    assert y.dtype == jnp.float32 and want_y.dtype == np.float64
    errors = {"y": _error(y, want_y), "final_states": _error(final, want_final)}
    errors.update({f"d{name}": _error(g, w) for name, g, w in zip("x dt A B C".split(), grad_args, want_args)})
    errors.update({f"d{name}": _error(grad_optional[name], want_optional[name]) for name in optional})
    assert max(errors.values()) < 1e-4, (options, chunk_size, errors)
