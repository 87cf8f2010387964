"""The conv op on the cuTile kernels on the GPU (run on the H200; skipped elsewhere): forward and gradients
against the float64 reference, determinism, dispatch, vmap, and the Mamba2 layer on the kernels against xla."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_mamba2 import conv1d
from jax_mamba2.bridge.aot import CUTILE_CUSTOM_CALL
from jax_mamba2.flax_layers import Mamba2
from tests._helpers import rel_l2
from tests.kernels._conv_checks import (conv_and_grads, float64_reference, make_cancelling_args, make_conv_args,
                                       rounding_errors)

pytestmark = pytest.mark.gpu

TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 2e-3}
CASES = {
    "odd": dict(batch=2, seqlen=1001, channels=300),
    "seq_idx": dict(batch=2, seqlen=1001, channels=300, seq_idx=[1, 500, 250, 250]),
    "init": dict(batch=3, seqlen=77, channels=136, init_width=4),
    "init_width_3_no_bias": dict(batch=3, seqlen=77, channels=136, d_conv=3, init_width=2, bias=False),
    "width_2": dict(batch=1, seqlen=513, channels=64, d_conv=2),
}


def _grads(backend, args, activation="silu"):
    """(y, grads of sum(y * weights) in x, kernel, bias and initial_states where present), jitted."""
    x, kernel, bias, init, seq_idx, weights = args
    argnums = tuple(i for i, a in enumerate((x, kernel, bias, init)) if a is not None)

    def f(x, kernel, bias, init):
        return conv1d.causal_conv1d_silu(x, kernel, bias, seq_idx=seq_idx, initial_states=init,
                                         activation=activation, backend=backend)

    def loss(*a):
        return jnp.sum(f(*a).astype(jnp.float32) * weights.astype(jnp.float32))

    run = jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=argnums)(*a)))
    y, grads = run(x, kernel, bias, init)
    return y, dict(zip(argnums, grads))


def _check(backend, args, dtype, activation="silu"):
    y, grads = _grads(backend, args, activation)
    want_y, want_grads = float64_reference(*args, silu=activation == "silu")
    errors = {"y": rel_l2(y, want_y)}
    errors.update({f"d{'x kernel bias init'.split()[i]}": rel_l2(g, want_grads[i]) for i, g in grads.items()})
    assert max(errors.values()) < TOLERANCE[dtype], errors
    assert y.dtype == args[0].dtype and all(g.dtype == args[i].dtype for i, g in grads.items())


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", list(CASES))
def test_conv_cutile_matches_float64_reference(backend, dtype, case):
    _check(backend, make_conv_args(21, dtype=jnp.dtype(dtype), **CASES[case]), dtype)


@pytest.mark.parametrize("channels", [2304, 2048, 256], ids=["conv_dim", "x", "BC"])
def test_conv_cutile_at_the_lm_training_shape_matches_float64_reference(channels):
    """(8, 2048) tokens of the LM at d_model 1024 in bf16: conv_dim and the two pieces the layer convolves."""
    _check("cutile", make_conv_args(22, batch=8, seqlen=2048, channels=channels, dtype=jnp.bfloat16), "bfloat16")


def test_conv_cutile_without_activation_matches_float64_reference():
    _check("cutile", make_conv_args(23, **CASES["seq_idx"]), "float32", activation=None)


def test_conv_cutile_gradients_are_deterministic():
    """The weight partials are reduced in a fixed order (no atomics): two runs agree bitwise."""
    args = make_conv_args(24, batch=4, seqlen=4096, channels=512, dtype=jnp.bfloat16)
    first, second = (_grads("cutile", args)[1] for _ in range(2))
    for i in first:
        np.testing.assert_array_equal(np.asarray(first[i]), np.asarray(second[i]))


def test_conv_auto_runs_the_kernels_on_the_gpu():
    x, kernel, bias, *_ = make_conv_args(25, dtype=jnp.bfloat16)
    hlo = jax.jit(lambda *a: conv1d.causal_conv1d_silu(*a)).lower(x, kernel, bias).compile().as_text()
    assert CUTILE_CUSTOM_CALL in hlo


def test_conv_cutile_vmap_of_gradients_matches_a_loop():
    x, kernel, bias, _, _, weights = make_conv_args(26, seqlen=300, channels=96)
    xs = jnp.stack([x, -0.5 * x, 2.0 * x])

    def grads(x):
        def loss(x, kernel, bias):
            return jnp.sum(conv1d.causal_conv1d_silu(x, kernel, bias, backend="cutile") * weights)
        return jax.grad(loss, argnums=(0, 1, 2))(x, kernel, bias)

    mapped = jax.jit(jax.vmap(grads))(xs)
    for i in range(3):
        for got, want in zip(mapped, jax.jit(grads)(xs[i])):
            assert rel_l2(got[i], want) < 1e-6


def test_mamba2_layer_on_the_conv_kernels_matches_xla():
    """The layer's `_convolve` runs the op with the layer's backend: forward, prefill's cache and gradients."""
    layers = {b: Mamba2(256, d_state=64, headdim=64, ngroups=2, chunk_size=64, backend=b, rngs=nnx.Rngs(0))
              for b in ("cutile", "xla")}
    u = jax.random.normal(jax.random.key(27), (2, 150, 256))
    weights = jax.random.normal(jax.random.key(28), u.shape)
    out = {b: nnx.jit(lambda m, u: m.prefill(u))(m, u) for b, m in layers.items()}
    assert rel_l2(out["cutile"][0], out["xla"][0]) < 5e-3
    assert rel_l2(out["cutile"][1].conv_state, out["xla"][1].conv_state) < 1e-5
    grads = {b: nnx.to_flat_state(nnx.jit(nnx.grad(lambda m: jnp.sum(m(u) * weights)))(m))
             for b, m in layers.items()}
    for (path, g_cutile), (_, g_xla) in zip(grads["cutile"], grads["xla"]):
        assert rel_l2(g_cutile[...], g_xla[...]) < 2e-2, path


# ----------------------------------------------------------------------------------------------
# causal_conv1d_silu_split: the mixer's layout (tests/test_conv1d.py runs the same on the emulator)
# ----------------------------------------------------------------------------------------------

# (make_conv_args options, channel offset, input width, split).
SPLIT_CASES = {
    # The LM at d_model 1024: in_proj's [z (2048), xBC (2304), dt (32)], 8 x 2048 tokens.
    "lm": (dict(batch=8, seqlen=2048, channels=2304), 2048, 4384, (2048, 128, 128)),
    "odd_seq_idx": (dict(batch=2, seqlen=1001, channels=300, seq_idx=[1, 500, 250, 250]), 40, 357, (200, 50, 50)),
    "unaligned_offset_init": (dict(batch=3, seqlen=77, channels=136, init_width=4), 5, 150, (100, 36)),
    "one_piece_width_3": (dict(batch=1, seqlen=513, channels=64, d_conv=3), 64, 130, (64,)),
}


def _split_source(x, offset, width, seed=41):
    wide = jax.random.normal(jax.random.key(seed), (*x.shape[:2], width), jnp.float32).astype(x.dtype)
    return jax.lax.dynamic_update_slice_in_dim(wide, x, offset, axis=-1)


def _check_split(backend, args, dtype, offset, width, split, transform=lambda f: f, pass_through=False):
    """The pieces and gradients against the float64 reference of the window; with pass_through the channels
    outside it come out unchanged and the source's cotangent there is their weights in the loss (else 0)."""
    x, kernel, bias, init, seq_idx, weights = args
    source = _split_source(x, offset, width)
    outside = [jax.random.normal(jax.random.key(47 + i), (*x.shape[:2], w), x.dtype)
               for i, w in enumerate((offset, width - offset - x.shape[-1]))]

    def f(source, kernel, bias, init):
        outputs = conv1d.causal_conv1d_silu_split(source, kernel, bias, channel_offset=offset, split=split,
                                                  seq_idx=seq_idx, initial_states=init, pass_through=pass_through,
                                                  backend=backend)
        pieces = outputs[1:-1] if pass_through else outputs
        return jnp.concatenate(pieces, axis=-1), (outputs[0], outputs[-1]) if pass_through else ()

    f = transform(f)
    argnums = tuple(i for i, a in enumerate((source, kernel, bias, init)) if a is not None)

    def loss(*a):
        y, around = f(*a)
        return (jnp.sum(y.astype(jnp.float32) * weights.astype(jnp.float32))
                + sum(jnp.sum(p.astype(jnp.float32) * w.astype(jnp.float32)) for p, w in zip(around, outside)))

    (y, around), grads = jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=argnums)(*a)))(source, kernel, bias, init)
    grads = dict(zip(argnums, grads))
    want_y, want_grads = float64_reference(*args)
    dsource = np.asarray(grads.pop(0).astype(jnp.float32))
    errors = {"y": rel_l2(y, want_y), "dx": rel_l2(dsource[..., offset:offset + x.shape[-1]], want_grads[0])}
    errors.update({f"d{'x kernel bias init'.split()[i]}": rel_l2(g, want_grads[i]) for i, g in grads.items()})
    assert max(errors.values()) < TOLERANCE[dtype], errors
    before, after = ((np.asarray(w.astype(jnp.float32)) for w in outside) if pass_through else (0.0, 0.0))
    np.testing.assert_array_equal(dsource[..., :offset], before)
    np.testing.assert_array_equal(dsource[..., offset + x.shape[-1]:], after)
    if pass_through:
        np.testing.assert_array_equal(np.asarray(around[0]), np.asarray(source[..., :offset]))
        np.testing.assert_array_equal(np.asarray(around[1]), np.asarray(source[..., offset + x.shape[-1]:]))


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_conv_split_cutile_matches_float64_reference(backend, dtype, case):
    options, offset, width, split = SPLIT_CASES[case]
    _check_split(backend, make_conv_args(42, dtype=jnp.dtype(dtype), **options), dtype, offset, width, split)


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_conv_split_cutile_passes_the_other_channels_through(backend, dtype, case):
    """pass_through (the mixer's z and dt): the backward kernel writes the source's whole cotangent."""
    options, offset, width, split = SPLIT_CASES[case]
    _check_split(backend, make_conv_args(48, dtype=jnp.dtype(dtype), **options), dtype, offset, width, split,
                 pass_through=True)


def test_conv_split_cutile_under_remat_matches_float64_reference():
    options, offset, width, split = SPLIT_CASES["unaligned_offset_init"]
    _check_split("cutile", make_conv_args(43, **options), "float32", offset, width, split, jax.checkpoint)


def test_conv_split_cutile_vmap_of_gradients_matches_a_loop():
    options, offset, width, split = SPLIT_CASES["odd_seq_idx"]
    x, kernel, bias, _, _, weights = make_conv_args(44, **{**options, "seq_idx": None})
    sources = jnp.stack([_split_source(x, offset, width), -0.5 * _split_source(x, offset, width, seed=45)])

    def grads(source):
        def loss(source, kernel, bias):
            pieces = conv1d.causal_conv1d_silu_split(source, kernel, bias, channel_offset=offset, split=split,
                                                     backend="cutile")
            return jnp.sum(jnp.concatenate(pieces, axis=-1) * weights)
        return jax.grad(loss, argnums=(0, 1, 2))(source, kernel, bias)

    mapped = jax.jit(jax.vmap(grads))(sources)
    for i in range(2):
        for got, want in zip(mapped, jax.jit(grads)(sources[i])):
            assert rel_l2(got[i], want) < 1e-6


def test_conv_split_cutile_gradients_are_deterministic():
    options, offset, width, split = SPLIT_CASES["lm"]
    x, kernel, bias, _, _, weights = make_conv_args(46, dtype=jnp.bfloat16, **options)
    source = _split_source(x, offset, width)

    def loss(source, kernel, bias):
        pieces = conv1d.causal_conv1d_silu_split(source, kernel, bias, channel_offset=offset, split=split,
                                                 backend="cutile")
        return jnp.sum(jnp.concatenate(pieces, axis=-1).astype(jnp.float32) * weights.astype(jnp.float32))

    run = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    first, second = run(source, kernel, bias), run(source, kernel, bias)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


@pytest.mark.parametrize("backend", ["cutile", "cutile_callback"])
@pytest.mark.parametrize("layout", ["plain", "split_pass_through"])
def test_conv_cutile_takes_float32_parameters_unrounded_with_bfloat16_x(backend, layout):
    """bf16 x with a float32 kernel and bias that bf16 cannot hold (tests/test_conv1d.py runs the same on the
    emulator): the kernels sum the parameters unrounded, so y and every gradient match the float64 reference of
    the float32 parameters and miss that of them rounded to bf16 by far more, plain and in the mixer's call
    (an offset into a wider input, pieces, the other channels passed through)."""
    args = make_cancelling_args(53, batch=3, seqlen=77, channels=136)
    x, kernel, bias, init = args[:4]
    _, offset, width, split = SPLIT_CASES["unaligned_offset_init"]
    y, dx, *grads = (conv_and_grads(backend, args) if layout == "plain" else
                     conv_and_grads(backend, args, _split_source(x, offset, width), offset, split))
    errors = rounding_errors((y, dx, *grads), args)
    for name, (error, rounded_error) in errors.items():
        assert error < 2e-2 and 8 * error < rounded_error, (name, errors)
    assert [g.dtype for g in grads] == [kernel.dtype, bias.dtype, init.dtype]


def test_mamba2_layer_compiled_training_step_has_no_copy_around_the_conv():
    """The LM's mixer at d_model 1024 in bf16 on one GPU: one conv forward launch (reading in_proj's product
    itself, writing x, B, C and copying z and dt) and one conv backward launch, which writes in_proj's whole
    output cotangent that only in_proj's backward matrix products read (no pad, add or layout copy); no
    slice / concatenate / copy fusion of activation size consumes in_proj's product or the conv's outputs
    (tests/flax_layers/test_mamba2_conv.py checks the same on the emulator, where the whole graph is also
    pinned)."""
    from tests.flax_layers.test_mamba2_conv import _computes_a_matmul, _copies, _elements, _instructions, _source

    batch, seqlen = 2, 2048
    layer = Mamba2(1024, backend="cutile", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    u = jax.random.normal(jax.random.key(47), (batch, seqlen, 1024), jnp.bfloat16)
    graphdef, state = nnx.split(layer)

    def loss(state, u):
        return jnp.sum(nnx.merge(graphdef, state)(u).astype(jnp.float32) ** 2)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, u).compile().as_text()
    entry = _instructions(hlo)
    pieces = [("bf16", f"{batch},{seqlen},{w}") for w in (2048, 128, 128)]
    forward = [n for n, i in entry.items() if i["op"] == "custom-call" and
               re.findall(r"(\w+)\[([\d,]*)\]", i["shape"])[:3] == pieces]
    backward = [n for n, i in entry.items() if i["op"] == "custom-call" and
                i["shape"].startswith(f"(bf16[{batch},{seqlen},4384]")]
    assert len(forward) == 1 and len(backward) == 1, (forward, backward)
    in_proj = _source(entry, entry[forward[0]]["operands"][0])
    assert entry[in_proj]["shape"].startswith(f"bf16[{batch},{seqlen},4384]") or \
        f"bf16[{batch * seqlen},4384]" in entry[in_proj]["shape"], entry[in_proj]
    assert _computes_a_matmul(hlo, entry, in_proj), entry[in_proj]
    in_proj_views = {n for n in entry if _source(entry, n) == in_proj}
    in_proj_readers = [n for n, i in entry.items() if set(i["operands"]) & in_proj_views and n not in in_proj_views]
    assert not any(_copies(hlo, entry, n) for n in in_proj_readers), in_proj_readers  # z and dt: the conv's copies
    conv_values = {*forward, *backward} | {n for n, i in entry.items() if i["op"] in ("bitcast", "get-tuple-element")
                                          and _source(entry, n) in (*forward, *backward)}
    for name, inst in entry.items():
        if set(inst["operands"]) & conv_values and _elements(inst["shape"]) >= batch * seqlen * 128:
            assert not _copies(hlo, entry, name, batch * seqlen * 128), (name, inst)
    dx = {n for n, i in entry.items() if i["op"] in ("get-tuple-element", "bitcast")
          and _source(entry, n) == backward[0] and _elements(i["shape"]) == batch * seqlen * 4384
          and not i["shape"].startswith("(")}
    readers = [n for n, i in entry.items() if set(i["operands"]) & dx and n not in dx]
    assert readers and all(_computes_a_matmul(hlo, entry, n) for n in readers), [entry[n]["line"][:200]
                                                                                 for n in readers]


@pytest.mark.parametrize("case", ["odd", "seq_idx", "init"])
def test_conv_cutile_forward_walking_segments_matches_float64_reference(case):
    """The forward's segmented form (`ConvFwdConfig.SEGMENT_TILES`: a block walks steps of tokens, each step's
    rows gathered during the step before) on the GPU, at a tile that splits these sequences mid-segment."""
    import dataclasses

    from jax_mamba2.bridge import conv_ops
    from jax_mamba2.kernels.causal_conv1d import ConvFwdConfig

    x, kernel, bias, init, seq_idx, dy = make_conv_args(46, dtype=jnp.bfloat16, **CASES[case])
    kernels = dataclasses.replace(conv_ops.KERNELS["cutile"], fwd_config=ConvFwdConfig(
        BLOCK_L=8, BLOCK_C=128, OCCUPANCY=4, SEGMENT_TILES=16))
    static = conv1d.ConvStatic(silu=True, offset=0, split=(), pass_through=False)
    (y,) = jax.jit(lambda *a: kernels.forward(conv1d.ConvInputs(*a), static))(x, kernel, bias, init, seq_idx)
    want, _ = float64_reference(x, kernel, bias, init, seq_idx, dy)
    assert rel_l2(y, want) < TOLERANCE["bfloat16"]
