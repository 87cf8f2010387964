"""The fused Mamba2 decode-step op (jax_mamba2/decode_step.py) on the CPU: its checks, and its cutile path end to
end (bridge/decode_ops.py: dummies, vmap rule, no derivative) with the kernel plan run by the NumPy emulator in
float64 through `jax.pure_callback`, against the float64 composition of the reference pieces; under jit, vmap,
lax.scan over layers and tokens, and shard_map over the batch. The traced FFI call is checked for being the
step's only operation besides zeroing the norm's counters."""
import functools
import math
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

pytest.importorskip("cuda.tile")

from jax_mamba2 import decode_step  # noqa: E402
from jax_mamba2.bridge import _compat, aot, decode_ops, ffi  # noqa: E402
from jax_mamba2.decode_step import mamba2_decode_step  # noqa: E402
from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel  # noqa: E402
from tests._decode_step_helpers import (  # noqa: E402
    decode_step_float64, decode_through_layer_scan, make_decode_args)
from tests._helpers import rel_l2  # noqa: E402
from tests.kernels._cutile_emulator import jax_run_plan as _run_plan_emulated  # noqa: E402

# The arrays between the plan and XLA are float32 (the emulated kernel computes in float64).
TOLERANCE = 2e-6
EMULATED = decode_step.DecodeKernel(run=decode_ops.make_decode_step(_run_plan_emulated),
                                    unsupported_reason=lambda inputs, static: None)


@pytest.fixture
def emulated_kernel(monkeypatch):
    """backend="cutile" runs the decode plan on the emulator."""
    monkeypatch.setitem(decode_step._KERNELS, "cutile", EMULATED)


def _cutile(args, kwargs, options):
    return jax.jit(lambda a, k: mamba2_decode_step(*a, **k, **options, backend="cutile"))(args, kwargs)


def _errors(got, want):
    return {name: rel_l2(g, w) for name, g, w in zip(("y", "conv_state", "ssm_state"), got, want)}


@pytest.mark.parametrize("options", [
    dict(),
    dict(norm_before_gate=True, ngroups=1, D="headdim", dt_limit=(0.01, 1.0), conv_bias=False),
    dict(rmsnorm=False, D=None, d_conv=3),
], ids=["default", "norm_before_gate_g1_hdimD_limit_nobias", "no_norm_no_D_dconv3"])
def test_emulated_cutile_decode_step_under_jit_matches_float64_composition(emulated_kernel, options):
    args, kwargs, static = make_decode_args(1, **options)
    got = _cutile(args, kwargs, static)
    assert [(g.shape, g.dtype) for g in got] == [((2, 64), jnp.float32), (args[3].shape, jnp.float32),
                                                 (args[4].shape, jnp.float32)]
    errors = _errors(got, decode_step_float64(args, kwargs, static))
    assert max(errors.values()) < TOLERANCE, errors


def test_emulated_cutile_vmap_folds_rows_and_maps_per_item_parameters(emulated_kernel):
    """vmap over rows folds into the kernel batch; over stacked parameters (per-layer A, conv weight, norm
    weight) it maps the items. Both equal a loop of single calls."""
    args, kwargs, options = make_decode_args(2)
    step = functools.partial(mamba2_decode_step, **options, backend="cutile")
    rows = jax.tree.map(lambda a: jnp.stack([a, 0.5 * a]), args[:5])
    folded = jax.jit(jax.vmap(lambda *r: step(*r, *args[5:], **kwargs)))(*rows)
    params = (jnp.stack([args[5], -args[5]]), jnp.stack([args[6], 2.0 * args[6]]),
              jnp.stack([kwargs["norm_weight"], 1.0 + kwargs["norm_weight"]]))
    mapped = jax.jit(jax.vmap(lambda w, A, nw: step(*args[:5], w, A, **dict(kwargs, norm_weight=nw))))(*params)
    for i in range(2):
        row = [r[i] for r in rows]
        for got, want in zip(folded, step(*row, *args[5:], **kwargs)):
            assert rel_l2(got[i], want) < 1e-6
        for got, want in zip(mapped, step(*args[:5], params[0][i], params[1][i],
                                          **dict(kwargs, norm_weight=params[2][i]))):
            assert rel_l2(got[i], want) < 1e-6


def test_emulated_cutile_decode_tokens_through_a_scan_over_layers_match_xla(emulated_kernel):
    """Tokens x layers, as the LM decodes: a lax.scan over stacked layers inside a loop over tokens."""
    args, kwargs, options = make_decode_args(3)
    errors = _errors(decode_through_layer_scan("cutile", args, kwargs, options),
                     decode_through_layer_scan("xla", args, kwargs, options))
    assert max(errors.values()) < 1e-5, errors


def test_emulated_cutile_under_shard_map_over_the_batch_matches_unsharded(emulated_kernel):
    """The rows split over two devices: the kernel runs per shard and its outputs keep the varying axes."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))
    args, kwargs, options = make_decode_args(5, batch=4)
    step = functools.partial(mamba2_decode_step, **options, backend="cutile")

    def per_shard(*rows):
        out = step(*rows, *args[5:], **kwargs)
        assert all(_compat.varying_axes(o) == {"data"} for o in out)
        return out

    sharded = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(*args[:5])
    for got, want in zip(sharded, jax.jit(lambda *a: step(*a, **kwargs))(*args)):
        np.testing.assert_array_equal(got, want)


def test_emulated_cutile_has_no_derivative_and_xla_does(emulated_kernel):
    args, kwargs, options = make_decode_args(6)

    def loss(backend, z):
        return jnp.sum(mamba2_decode_step(z, *args[1:], **kwargs, **options, backend=backend)[0])

    with pytest.raises(TypeError, match=r"mamba2_decode_step\(backend='cutile'\) has no derivative"):
        jax.grad(functools.partial(loss, "cutile"))(args[0])
    assert bool(jnp.all(jnp.isfinite(jax.grad(functools.partial(loss, "xla"))(args[0]))))


def _cutile_calls(jaxpr) -> list:
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            found.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)
    visit(jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("rmsnorm", [True, False], ids=["rmsnorm", "gate_only"])
def test_ffi_decode_step_is_one_kernel_call_and_adds_no_xla_op(rmsnorm):
    """Traced (no GPU needed to trace): one cutile call launching the decode kernel on the arrays as given
    (no casts, no broadcasts of absent options); with the norm, the zeroed counters are the only other op."""
    args, kwargs, options = make_decode_args(7, dtype=jnp.bfloat16, rmsnorm=rmsnorm, D="head", conv_bias=False)
    run = decode_ops.make_decode_step(ffi.run_plan)
    inputs, static, _ = decode_step.pack_arguments(*args, **kwargs, **options)
    jaxpr = jax.make_jaxpr(lambda i: run(i, static))(inputs)
    eqns = _cutile_calls(jaxpr)
    calls = [e for e in eqns if e.primitive.name == "cutile_call_ffi"]
    assert [c.params["kernel"]._annotated_function.pyfunc.__name__ for c in calls] == ["decode_step_kernel"]
    others = {e.primitive.name for e in eqns} - {"cutile_call_ffi", "custom_vmap_call", "custom_jvp_call",
                                                  "pjit"}
    assert others == ({"broadcast_in_dim"} if rmsnorm else set()), others
    y, conv_state, ssm_state = jaxpr.out_avals
    assert (y.shape, y.dtype) == ((2, 64), jnp.bfloat16)
    assert (conv_state.shape, ssm_state.shape) == (args[3].shape, args[4].shape)


@pytest.mark.slow
def test_lm_decode_step_lowered_for_cuda_launches_one_kernel_per_layer():
    """The LM's decode step with backend "auto", lowered for CUDA on this machine (tileiras compiles the
    cubin): the layer scan's body launches one cuTile kernel, the fused decode step, and nothing else does."""
    config = Mamba2Config(d_model=64, n_layer=2, vocab_size=64, ssm_cfg=dict(d_state=16, headdim=16, ngroups=2))
    model = Mamba2LMHeadModel(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    exported = aot.export_for_cuda(lambda s, t, c: nnx.merge(graphdef, s).step(t, c), state,
                                   jnp.zeros((2,), jnp.int32), model.init_cache(2))
    kernels = re.findall(r'function_name = "([^"]+)"', exported.mlir_module())
    assert [re.sub(r"_Kt\d.*", "", name) for name in kernels] == ["decode_step_kernel"], kernels


def test_auto_on_cpu_is_the_xla_composition():
    args, kwargs, options = make_decode_args(8)
    auto = jax.jit(lambda a, k: mamba2_decode_step(*a, **k, **options))(args, kwargs)
    xla = jax.jit(lambda a, k: mamba2_decode_step(*a, **k, **options, backend="xla"))(args, kwargs)
    for a, b in zip(auto, xla):
        np.testing.assert_array_equal(a, b)
    assert decode_step.kernel_unsupported_reason(*args, **kwargs, **options) is not None


def _bad(index_or_name, value):
    args, kwargs, options = make_decode_args(9)
    args = list(args)
    if isinstance(index_or_name, int):
        args[index_or_name] = value
    elif index_or_name in kwargs:
        kwargs[index_or_name] = value
    else:
        options[index_or_name] = value
    return args, kwargs, options


@pytest.mark.parametrize("where, value, error, message", [
    (4, jnp.zeros((2, 4, 16)), ValueError, r"ssm_state.shape=\(2, 4, 16\) must be \(batch, nheads, headdim"),
    (1, jnp.zeros((2, 100)), ValueError, r"xBC.shape\[1\]=100 must be nheads\*headdim \+ 2\*ngroups\*dstate"),
    (0, jnp.zeros((2, 63)), ValueError, r"z.shape=\(2, 63\) must be \(batch, nheads\*headdim\)=\(2, 64\)"),
    (2, jnp.zeros((2, 3)), ValueError, r"dt.shape=\(2, 3\) must be \(batch, nheads\)=\(2, 4\)"),
    (3, jnp.zeros((2, 100, 4)), ValueError, r"conv_state.shape=\(2, 100, 4\) must be \(batch, conv_dim, d_conv\)"),
    (5, jnp.zeros((3, 128)), ValueError, r"conv_weight.shape=\(3, 128\) must be \(d_conv, conv_dim\)=\(4, 128\)"),
    (6, jnp.zeros((4,), jnp.int32), TypeError, r"A.dtype=int32 must be one of"),
    ("conv_bias", jnp.zeros((64,)), ValueError, r"conv_bias.shape=\(64,\) must be \(conv_dim,\)=\(128,\)"),
    ("D", jnp.zeros((4, 3)), ValueError, r"D.shape=\(4, 3\) must be \(nheads,\)=\(4,\) or"),
    ("dt_bias", jnp.zeros((5,)), ValueError, r"dt_bias.shape=\(5,\) must be \(nheads,\)=\(4,\)"),
    ("norm_weight", jnp.zeros((32,)), ValueError, r"norm_weight.shape=\(32,\) must be \(nheads\*headdim,\)"),
    ("eps", 0.0, ValueError, r"eps=0.0 must be a positive float"),
    ("dt_limit", (1.0, 0.5), ValueError, r"dt_limit=\(1.0, 0.5\) must satisfy 0 <= min <= max"),
    ("backend", "cuda", ValueError, r"backend='cuda' is not one of \('auto', 'cutile', 'xla'\)"),
])
def test_decode_step_rejects_bad_arguments_naming_them(where, value, error, message):
    args, kwargs, options = _bad(where, value)
    with pytest.raises(error, match=r"mamba2_decode_step: " + message):
        mamba2_decode_step(*args, **kwargs, **options)


def test_decode_step_cutile_without_a_gpu_says_why():
    args, kwargs, options = make_decode_args(10)
    with pytest.raises(ValueError, match=r"mamba2_decode_step\(backend='cutile'\) cannot run this call: no CUDA"):
        mamba2_decode_step(*args, **kwargs, **options, backend="cutile")
    args, kwargs, options = make_decode_args(10, headdim=8, d_conv=5)
    assert "headdim=8" in decode_step.kernel_unsupported_reason(*args, **kwargs, **options)
    assert math.isinf(options["dt_limit"][1])
