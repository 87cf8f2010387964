"""kernels/decode_step.py on the NumPy emulator (tests/kernels/_cutile_emulator.py) through the op
(`mamba2_decode_step(backend="cutile_emulated")`: bridge/decode_ops.py, the norm's XLA scale), against the
float64 composed step (conv1d_reference, reference.ssd_step, norm_reference) on fresh random inputs, by
relative L2 error: every option, ngroups > 1, several blocks per head, and the kernels' own dtypes."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("cuda.tile")

from jax_mamba2 import backends, mamba2_decode_step  # noqa: E402
from jax_mamba2.bridge import decode_ops  # noqa: E402
from jax_mamba2.decode_step import pack_arguments  # noqa: E402
from jax_mamba2.kernels import decode_step as kernels  # noqa: E402
from tests._decode_step_helpers import float64_reference, make_decode_args  # noqa: E402
from tests._helpers import rel_l2  # noqa: E402
from tests.bridge._emulated_backend import EMULATED  # noqa: E402
from tests.kernels import _cutile_emulator as emulator  # noqa: E402
from tests.kernels._plan_checks import assert_plan_well_formed  # noqa: E402

# Float64 emulation: only the outputs' rounding to their dtypes (f32 here) separates kernel and reference.
FLOAT64_TOLERANCE = 1e-6
# The kernel's own dtypes: bf16 y / zxbcdt / states round differently from the float64 reference.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setitem(backends._REGISTRY, EMULATED.name, EMULATED)
    return functools.partial(mamba2_decode_step, backend=EMULATED.name)


def _assert_close(got, want, tolerance):
    for name, g, w in zip(("y", "conv_state", "ssm_state"), got, want):
        assert g.shape == w.shape, name
        assert rel_l2(g, w) < tolerance, (name, rel_l2(g, w))


@pytest.mark.parametrize("options", [
    {},
    {"norm_before_gate": True},
    {"ngroups": 2, "nheads": 4},
    {"ngroups": 4, "nheads": 4, "norm_before_gate": True},
    {"dt_limit": (0.02, 0.1)},
    {"D": None, "conv_bias": False, "dt_bias": False},
    {"D": "headdim"},
    {"rmsnorm": False},
    {"d_mlp": 8},
    {"d_conv": 2},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_decode_step_matches_the_float64_composed_step(emulated, options):
    args, kwargs = make_decode_args(1, **options)
    _assert_close(emulated(*args, **kwargs), float64_reference(args, kwargs), FLOAT64_TOLERANCE)


@pytest.mark.parametrize("dtype,param_dtype,state_dtype", [
    (jnp.float32, jnp.float32, jnp.float32),
    (jnp.bfloat16, jnp.float32, jnp.float32),
    (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
])
@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_decode_step_in_the_kernels_own_dtypes(monkeypatch, dtype, param_dtype, state_dtype, norm_before_gate):
    own_dtypes = dataclasses.replace(
        EMULATED, name="cutile_emulated_own_dtypes",
        decode_step=decode_ops.make_decode_step(functools.partial(emulator.jax_run_plan, float64=False)))
    monkeypatch.setitem(backends._REGISTRY, own_dtypes.name, own_dtypes)
    args, kwargs = make_decode_args(2, ngroups=2, dtype=dtype, param_dtype=param_dtype, state_dtype=state_dtype,
                                    norm_before_gate=norm_before_gate)
    got = mamba2_decode_step(*args, **kwargs, backend=own_dtypes.name)
    assert [a.dtype for a in got] == [dtype, state_dtype, state_dtype]
    _assert_close(got, float64_reference(args, kwargs), TOLERANCE[jnp.dtype(dtype).name])


@pytest.mark.parametrize("block_p,heads_per_block", [(4, 1), (8, 2), (16, 2)])
def test_every_block_shape_writes_the_same_step(block_p, heads_per_block):
    """Blocks of 4..16 rows of a 16-row head, one or both heads of a group: pieces of heads, the first block of
    each group writing its B/C conv state, one partial sum of squares per head and block."""
    args, kwargs = make_decode_args(3, ngroups=2)
    inputs, static, _ = pack_arguments(*args, **kwargs)
    cfg = kernels.DecodeStepConfig(BLOCK_P=block_p, HEADS_PER_BLOCK=heads_per_block)
    plan, arrays = decode_ops.kernel_plan(inputs, static, cfg)
    assert_plan_well_formed(plan)
    out = emulator.run_plan(plan, {name: np.asarray(a) for name, a in arrays.items()}, float64=True)
    assert out["sumsq"].shape == (3, 64 // block_p)
    _, want_conv, want_ssm = float64_reference(args, kwargs)
    assert rel_l2(out["new_conv_state"], want_conv) < 1e-12
    assert rel_l2(out["new_ssm_state"], want_ssm) < 1e-12
    assert np.isfinite(out["gated"]).all() and np.isfinite(out["sumsq"]).all()


def test_default_blocks_fill_the_gpu_at_batch_1_and_share_b_c_over_heads_at_large_batches():
    def block(batch):
        dims = kernels.DecodeStepDims(batch=batch, nheads=32, headdim=64, ngroups=1, dstate=128, d_conv=4)
        cfg = kernels.decode_step_default_config(dims)
        return cfg.BLOCK_P, cfg.HEADS_PER_BLOCK, kernels.decode_step_grid(dims, cfg)

    assert [block(b) for b in (1, 8, 64)] == [(8, 1, (32, 8)), (16, 1, (256, 4)), (16, 8, (256, 4))]


def test_block_shapes_are_checked():
    dims = kernels.DecodeStepDims(batch=1, nheads=4, headdim=16, ngroups=2, dstate=16, d_conv=4)
    with pytest.raises(ValueError, match=r"cfg.BLOCK_P=12 must be a power of two dividing headdim=16"):
        kernels.decode_step_plan(dims, kernels.DecodeStepConfig(BLOCK_P=12))
    with pytest.raises(ValueError, match=r"cfg.HEADS_PER_BLOCK=4 must divide nheads / ngroups=2"):
        kernels.decode_step_plan(dims, kernels.DecodeStepConfig(BLOCK_P=8, HEADS_PER_BLOCK=4))


def test_vmap_folds_into_the_kernel_batch(emulated):
    args, kwargs = make_decode_args(4, batch=2)
    stacked = [jnp.stack([a, a * 0.5 + 0.25]) for a in args[:3]]
    got = jax.vmap(lambda z, c, s: emulated(z, c, s, *args[3:], **kwargs))(*stacked)
    for i in range(2):
        item = (stacked[0][i], stacked[1][i], stacked[2][i], *args[3:])
        _assert_close([g[i] for g in got], float64_reference(item, kwargs), FLOAT64_TOLERANCE)


def test_jit_and_grad_follow_the_composed_step(emulated):
    """The kernel path's custom VJP is the composed step's VJP."""
    args, kwargs = make_decode_args(5, batch=2)

    def loss(fn, zxbcdt, ssm_state):
        y, _, state = fn(zxbcdt, args[1], ssm_state, *args[3:], **kwargs)
        return jnp.sum(y * y) + jnp.sum(state)

    got = jax.jit(jax.grad(functools.partial(loss, emulated), argnums=(0, 1)))(args[0], args[2])
    want = jax.grad(functools.partial(loss, functools.partial(mamba2_decode_step, backend="xla")),
                    argnums=(0, 1))(args[0], args[2])
    for g, w in zip(got, want):
        assert rel_l2(g, w) < 1e-5
