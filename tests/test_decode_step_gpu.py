"""The fused decode step kernel on the GPU (run on the H200; skipped elsewhere): `mamba2_decode_step` on the
cuTile backends against the float64 composed step on fresh random inputs (every option, ngroups > 1, the
kernels' own dtypes, every block shape), under jit, vmap and grad."""
import functools

import jax
import jax.numpy as jnp
import pytest

from jax_mamba2 import mamba2_decode_step
from tests._decode_step_helpers import float64_reference, make_decode_args
from tests._helpers import rel_l2

pytestmark = pytest.mark.gpu

# The GPU's approximate exp2 / division in softplus and SiLU, and f32 sums in another order.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
LM = dict(batch=1, nheads=32, headdim=64, ngroups=1, dstate=128)  # the 24-layer LM's mixer


def _assert_close(got, want, tolerance):
    for name, g, w in zip(("y", "conv_state", "ssm_state"), got, want):
        assert g.shape == w.shape, name
        assert rel_l2(g, w) < tolerance, (name, rel_l2(g, w))


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
@pytest.mark.parametrize("options", [
    {},
    {"norm_before_gate": True},
    {"ngroups": 2, "nheads": 4},
    {"ngroups": 4, "nheads": 8, "norm_before_gate": True},
    {"dt_limit": (0.02, 0.1)},
    {"D": None, "conv_bias": False, "dt_bias": False},
    {"D": "headdim"},
    {"rmsnorm": False},
    {"d_mlp": 8},
    {"d_conv": 2},
    LM,
    {**LM, "batch": 64},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_decode_step_matches_the_float64_composed_step(backend, options):
    args, kwargs = make_decode_args(1, **options)
    got = jax.jit(lambda *a: mamba2_decode_step(*a, **kwargs, backend=backend))(*args)
    _assert_close(got, float64_reference(args, kwargs), TOLERANCE["float32"])


@pytest.mark.parametrize("dtype,param_dtype,state_dtype", [
    (jnp.bfloat16, jnp.float32, jnp.float32),
    (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
])
@pytest.mark.parametrize("batch", [1, 64])
def test_decode_step_in_bf16(dtype, param_dtype, state_dtype, batch):
    args, kwargs = make_decode_args(2, **{**LM, "batch": batch}, dtype=dtype, param_dtype=param_dtype,
                                    state_dtype=state_dtype)
    got = jax.jit(lambda *a: mamba2_decode_step(*a, **kwargs, backend="cutile"))(*args)
    assert [a.dtype for a in got] == [dtype, state_dtype, state_dtype]
    _assert_close(got, float64_reference(args, kwargs), TOLERANCE["bfloat16"])


@pytest.mark.parametrize("block_p,heads_per_block", [(4, 1), (8, 2), (16, 4), (64, 1), (32, 8)])
def test_every_block_shape_matches(monkeypatch, block_p, heads_per_block):
    from jax_mamba2.bridge import decode_ops
    from jax_mamba2.kernels import decode_step as kernels

    monkeypatch.setattr(kernels, "decode_step_default_config",
                        lambda dims: kernels.DecodeStepConfig(BLOCK_P=block_p, HEADS_PER_BLOCK=heads_per_block))
    decode_ops._batchable_step.cache_clear()
    args, kwargs = make_decode_args(3, batch=3, nheads=16, headdim=64, ngroups=2, dstate=64)
    got = mamba2_decode_step(*args, **kwargs, backend="cutile")
    _assert_close(got, float64_reference(args, kwargs), TOLERANCE["float32"])
    decode_ops._batchable_step.cache_clear()


def test_vmap_and_grad():
    args, kwargs = make_decode_args(4, batch=2, nheads=8, headdim=64, ngroups=2, dstate=64)
    stacked = [jnp.stack([a, a * 0.5 + 0.25]) for a in args[:3]]
    step = functools.partial(mamba2_decode_step, backend="cutile")
    got = jax.jit(jax.vmap(lambda z, c, s: step(z, c, s, *args[3:], **kwargs)))(*stacked)
    for i in range(2):
        item = (stacked[0][i], stacked[1][i], stacked[2][i], *args[3:])
        _assert_close([g[i] for g in got], float64_reference(item, kwargs), TOLERANCE["float32"])

    def loss(fn, zxbcdt, ssm_state):
        y, _, state = fn(zxbcdt, args[1], ssm_state, *args[3:], **kwargs)
        return jnp.sum(y * y) + jnp.sum(state)

    got = jax.jit(jax.grad(functools.partial(loss, step), argnums=(0, 1)))(args[0], args[2])
    want = jax.grad(functools.partial(loss, functools.partial(mamba2_decode_step, backend="xla")),
                    argnums=(0, 1))(args[0], args[2])
    for g, w in zip(got, want):
        assert rel_l2(g, w) < TOLERANCE["float32"]


def test_auto_takes_the_kernel_on_the_gpu():
    args, kwargs = make_decode_args(5, **LM)
    hlo = jax.jit(lambda *a: mamba2_decode_step(*a, **kwargs)).lower(*args).compile().as_text()
    assert "decode_step_kernel" in hlo
