"""The fused Mamba2 decode kernel on the GPU (run on the H200; skipped elsewhere): the op against the float64
composition of the reference pieces at the LM's sizes, reproducibility of the group norm's last-arrival
rescale, jit / vmap / lax.scan, the layer against its unfused step, and greedy generation against the uncached
forward. Run with `python -m pytest -m gpu tests/test_decode_step_gpu.py`."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_mamba2.decode_step import mamba2_decode_step
from jax_mamba2.flax_layers import Mamba2, Mamba2Cache, Mamba2Config, Mamba2LMHeadModel, generate
from tests._decode_step_helpers import decode_step_float64, decode_through_layer_scan, make_decode_args
from tests._helpers import TOLERANCE, rel_l2

pytestmark = pytest.mark.gpu

# The 24-layer LM's mixer (d_model 1024): 32 heads of 64, dstate 128.
LM_SIZES = dict(nheads=32, headdim=64, dstate=128)
LIMIT = (0.01, 1.0)
OPTIONS = {
    "lm_g1": dict(ngroups=1),
    "g2_norm_before_gate_hdimD_limit": dict(ngroups=2, norm_before_gate=True, D="headdim", dt_limit=LIMIT),
    "g4_no_conv_bias_dconv3": dict(ngroups=4, conv_bias=False, d_conv=3),
    "g1_no_norm_limit": dict(ngroups=1, rmsnorm=False, dt_limit=LIMIT),
}
# float32: the kernel computes in f32 like the float64 oracle up to rounding; bfloat16 rounds the activations.
_TOLERANCE = {"float32": 1e-5, "bfloat16": TOLERANCE["kernel_fwd"]["bfloat16"]}


def _cutile(args, kwargs, options):
    return jax.jit(lambda a, k: mamba2_decode_step(*a, **k, **options, backend="cutile"))(args, kwargs)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype, state_dtype", [("float32", "float32"), ("bfloat16", "float32"),
                                                ("bfloat16", "bfloat16")])
@pytest.mark.parametrize("case", list(OPTIONS))
def test_cutile_decode_step_matches_float64_composition(case, dtype, state_dtype, batch):
    args, kwargs, options = make_decode_args(sum(map(ord, case)) + batch, batch=batch, **LM_SIZES, **OPTIONS[case],
                                             dtype=jnp.dtype(dtype), state_dtype=jnp.dtype(state_dtype))
    got = _cutile(args, kwargs, options)
    want = decode_step_float64(args, kwargs, options)
    assert [g.dtype for g in got] == [jnp.dtype(dtype), jnp.dtype(state_dtype), jnp.dtype(state_dtype)]
    tol = _TOLERANCE[dtype] if state_dtype == "float32" else _TOLERANCE["bfloat16"]
    errors = {name: rel_l2(g, w) for name, g, w in zip(("y", "conv_state", "ssm_state"), got, want)}
    assert max(errors.values()) < tol, errors


def test_cutile_decode_step_group_norm_is_bitwise_reproducible():
    """8192 blocks in 128 norm groups, more than are resident at once: whichever block arrives last rescales
    its group; the result must not depend on which, and must hold every block's writes."""
    args, kwargs, options = make_decode_args(11, batch=64, **LM_SIZES, ngroups=2, dtype=jnp.bfloat16)
    step = jax.jit(lambda a, k: mamba2_decode_step(*a, **k, **options, backend="cutile"))
    first = jax.device_get(step(args, kwargs))
    for _ in range(20):
        for a, b in zip(jax.device_get(step(args, kwargs)), first):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert rel_l2(first[0], decode_step_float64(args, kwargs, options)[0]) < _TOLERANCE["bfloat16"]


def test_cutile_decode_tokens_through_a_scan_over_layers_match_xla():
    """Tokens x layers, as the LM decodes: a lax.scan over stacked layers inside a loop over tokens."""
    args, kwargs, options = make_decode_args(12, batch=2, **LM_SIZES, ngroups=2)
    got = decode_through_layer_scan("cutile", args, kwargs, options, layers=4)
    want = decode_through_layer_scan("xla", args, kwargs, options, layers=4)
    for g, w in zip(got, want):
        assert rel_l2(g, w) < 1e-5, rel_l2(g, w)


def test_cutile_decode_step_vmap_matches_loop():
    args, kwargs, options = make_decode_args(13, batch=2, **LM_SIZES, ngroups=2)
    step = functools.partial(mamba2_decode_step, **options, backend="cutile")
    rows = jax.tree.map(lambda a: jnp.stack([a, 0.5 * a, -a]), args[:5])
    mapped = jax.jit(jax.vmap(lambda *r: step(*r, *args[5:], **kwargs)))(*rows)
    for i in range(3):
        for got, want in zip(mapped, jax.jit(lambda *r: step(*r, *args[5:], **kwargs))(*(r[i] for r in rows))):
            np.testing.assert_array_equal(got[i], want)


@pytest.mark.parametrize("options", [dict(ngroups=1), dict(ngroups=2, norm_before_gate=True, D_has_hdim=True),
                                     dict(ngroups=2, rmsnorm=False, d_ssm=1536)],
                         ids=["g1", "g2_norm_before_gate_hdimD", "g2_no_norm_mlp"])
def test_mamba2_fused_step_matches_unfused_step(options):
    """backend "cutile" takes the fused kernel, "cutile_callback" the unfused pieces (its state_update kernel)."""
    layers = {backend: Mamba2(1024, d_state=128, headdim=64, **options, backend=backend, rngs=nnx.Rngs(0))
              for backend in ("cutile", "cutile_callback")}
    keys = jax.random.split(jax.random.key(1), 3)
    cache = layers["cutile"].init_cache(2)
    cache = Mamba2Cache(*(jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, cache)))
    u = jax.random.normal(keys[2], (2, 1024))
    out = {b: nnx.jit(lambda m, u, c: m.step(u, c))(m, u, cache) for b, m in layers.items()}
    assert rel_l2(out["cutile"][0], out["cutile_callback"][0]) < 1e-5
    for got, want in zip(out["cutile"][1], out["cutile_callback"][1]):
        assert rel_l2(got, want) < 1e-6


_LM = Mamba2Config(d_model=256, n_layer=2, vocab_size=256, pad_vocab_size_multiple=8,
                   ssm_cfg=dict(d_state=64, headdim=64, ngroups=2, chunk_size=64))


def test_lm_cutile_greedy_generate_follows_the_uncached_forward():
    """Greedy tokens of generate (prefill, then fused decode steps) are the argmax of the uncached forward."""
    model = Mamba2LMHeadModel(_LM, backend="cutile", rngs=nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.key(3), (2, 8), 0, _LM.vocab_size)
    tokens = generate(model, prompt, max_new_tokens=24)
    logits = nnx.jit(lambda m, ids: m(ids))(model, tokens[:, :-1])[:, 7:, :_LM.vocab_size]
    top2 = jnp.sort(logits, axis=-1)[..., -2:]
    np.testing.assert_array_equal(jnp.argmax(logits, axis=-1), tokens[:, 8:],
                                  err_msg=f"smallest top-2 logit margin {float(jnp.min(top2[..., 1] - top2[..., 0]))}")
