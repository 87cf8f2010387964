"""The RMSNorm kernels on the GPU (run on the H200; skipped elsewhere): jax_mamba2.rms_norm / add_rms_norm with the
"cutile" and "cutile_callback" backends, forward and backward against the float64 reference on fresh random
inputs, at the test cases and at the LM's shapes; the weight gradient bitwise reproducible.

    python -m pytest -m gpu tests/kernels/test_rms_norm_gpu.py
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mamba2
from tests._helpers import rel_l2
from tests.kernels._norm_checks import CASES, EPS, NormCase, make_inputs, oracle

pytestmark = pytest.mark.gpu

TOLERANCE = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}
LM_CASES = {
    "gated_before_16384x2048": NormCase(rows=16384, features=2048, gate="before", dtype="bfloat16"),
    "gated_after_16384x2048": NormCase(rows=16384, features=2048, gate="after", dtype="bfloat16"),
    "gated_before_8_groups": NormCase(rows=16384, features=2048, group_size=256, gate="before", dtype="bfloat16"),
    "add_norm_16384x1024": NormCase(rows=16384, features=1024, residual=True, dtype="bfloat16"),
}


def _forward_and_vjp(case, backend):
    def op(x, z, residual, weight):
        if case.residual:
            return jax_mamba2.add_rms_norm(x, residual, weight, eps=EPS, residual_dtype=jnp.float32, backend=backend)
        return jax_mamba2.rms_norm(x, weight, z, eps=EPS, group_size=case.group_size,
                                   norm_before_gate=case.norm_before_gate, backend=backend), None

    @jax.jit
    def run(primals, cotangents):
        outputs, vjp = jax.vjp(op, *primals)
        return outputs, vjp(cotangents)

    return run


def _check(case, backend, seed=0):
    arrays = make_inputs(case, seed)
    primals = tuple(None if arrays.get(n) is None else jnp.asarray(arrays[n])
                    for n in ("x", "z", "residual", "weight"))
    cotangents = (jnp.asarray(arrays["dout"]),
                  jnp.asarray(arrays["dresidual_out"]) if case.residual else None)
    (out, residual_out), (dx, dz, dresidual, dweight) = _forward_and_vjp(case, backend)(primals, cotangents)
    got = dict(out=out, residual_out=residual_out, dx=dx, dz=dz, dresidual=dresidual, dweight=dweight)
    want = oracle(case, arrays)
    errors = {k: rel_l2(got[k], want[k]) for k in want}
    assert max(errors.values()) < TOLERANCE[case.dtype], errors
    assert out.dtype == jnp.dtype(case.dtype) and dweight.dtype == jnp.float32


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_float64_reference(name, dtype, backend):
    _check(dataclasses.replace(CASES[name], dtype=dtype), backend)


@pytest.mark.parametrize("name", list(LM_CASES))
def test_kernels_at_lm_shapes_match_float64_reference(name):
    _check(LM_CASES[name], "cutile", seed=1)


def test_weight_gradient_is_bitwise_reproducible():
    case = LM_CASES["gated_before_16384x2048"]
    arrays = make_inputs(case, seed=2)
    primals = (jnp.asarray(arrays["x"]), jnp.asarray(arrays["z"]), None, jnp.asarray(arrays["weight"]))
    run = _forward_and_vjp(case, "cutile")
    grads = [run(primals, (jnp.asarray(arrays["dout"]), None))[1] for _ in range(3)]
    for other in grads[1:]:
        assert np.array_equal(np.asarray(grads[0][3]), np.asarray(other[3]))

