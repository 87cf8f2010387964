"""Mamba2.step through the fused decode kernel against the unfused step, on the CPU.

Backend "cutile" runs `mamba2_decode_step` with its kernel plan on the NumPy emulator (float64, through
`jax.pure_callback`); backend "xla" runs the unfused pieces (conv1d step, ssd_step, gated norm). Both layers
hold the same parameters. The LM decodes greedily through the fused step the tokens of its uncached forward;
under head parallelism the layer keeps the unfused step. (The fused step under a data-parallel shard_map is
tested at the op level, tests/test_decode_step.py.)
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

pytest.importorskip("cuda.tile")

from jax_mamba2 import decode_step  # noqa: E402
from jax_mamba2.bridge import decode_ops  # noqa: E402
from jax_mamba2.flax_layers import Mamba2, Mamba2Cache, Mamba2LMHeadModel, shard_model  # noqa: E402
from tests._helpers import rel_l2  # noqa: E402
from tests.kernels._cutile_emulator import jax_run_plan as _run_plan_emulated  # noqa: E402

D_MODEL, BATCH = 32, 2
TINY = dict(d_state=8, headdim=8, chunk_size=8)


@pytest.fixture
def fused_runs(monkeypatch):
    """Installs the emulated decode kernel as "cutile" (supported everywhere); returns the list of the calls
    traced through it."""
    runs = []
    emulated = decode_ops.make_decode_step(_run_plan_emulated)

    def run(inputs, static):
        runs.append(inputs.xBC.shape)
        return emulated(inputs, static)

    monkeypatch.setitem(decode_step._KERNELS, "cutile",
                        decode_step.DecodeKernel(run=run, unsupported_reason=lambda inputs, static: None))
    return runs


def _layer(backend, options):
    layer = Mamba2(D_MODEL, **TINY, **options, backend=backend, rngs=nnx.Rngs(1))
    # Non-trivial D and norm scale, the same in every layer built with these options.
    keys = jax.random.split(jax.random.key(5), 2)
    layer.D[...] = jax.random.normal(keys[0], layer.D[...].shape)
    if layer.rmsnorm:
        layer.norm.scale[...] = jax.random.uniform(keys[1], (layer.d_ssm,), jnp.float32, 0.5, 1.5)
    return layer


def _random_cache(layer, seed):
    keys = jax.random.split(jax.random.key(seed), 2)
    cache = layer.init_cache(BATCH)
    return Mamba2Cache(*(jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, cache)))


def _step(layer, u, cache):
    return nnx.jit(lambda m, u, c: m.step(u, c))(layer, u, cache)


@pytest.mark.parametrize("options", [
    pytest.param(dict(ngroups=1), id="ngroups1"),
    pytest.param(dict(ngroups=2, norm_before_gate=True), id="ngroups2_norm_before_gate"),
    pytest.param(dict(ngroups=2, d_ssm=48, D_has_hdim=True, bias=True, dt_limit=(0.01, 0.05)),
                 id="ngroups2_mlp_hdimD_bias_dtlimit"),
    pytest.param(dict(ngroups=2, rmsnorm=False, conv_bias=False), id="ngroups2_no_rmsnorm_no_conv_bias"),
    pytest.param(dict(ngroups=1, d_conv=2, norm_before_gate=True, D_has_hdim=True), id="ngroups1_dconv2"),
])
def test_mamba2_fused_step_equals_unfused_step(fused_runs, options):
    fused, unfused = _layer("cutile", options), _layer("xla", options)
    cache = _random_cache(unfused, seed=2)
    u = jax.random.normal(jax.random.key(3), (BATCH, D_MODEL))
    out, new_cache = _step(fused, u, cache)
    want_out, want_cache = _step(unfused, u, cache)
    assert fused_runs, "the fused decode step did not run"
    assert rel_l2(out, want_out) < 1e-5
    for got, want in zip(new_cache, want_cache):
        assert got.dtype == want.dtype and rel_l2(got, want) < 1e-6


def test_lm_greedy_decode_through_the_fused_step_follows_the_uncached_forward(fused_runs, tiny_config):
    """Prefill with the unfused model, then greedy steps through the fused one (the nnx.scan over layers
    carries the per-layer caches): each token is the argmax of the uncached forward's logits, and the step
    logits match the unfused model's."""
    fused = Mamba2LMHeadModel(tiny_config, backend="cutile", rngs=nnx.Rngs(0))
    unfused = Mamba2LMHeadModel(tiny_config, backend="xla", rngs=nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.key(4), (BATCH, 4), 0, tiny_config.vocab_size)
    logits, cache = nnx.jit(lambda m, ids: m.prefill(ids))(unfused, prompt)
    step = nnx.jit(lambda m, token, cache: m.step(token, cache))
    vocab = tiny_config.vocab_size
    tokens, unfused_cache = [jnp.argmax(logits[:, -1, :vocab], axis=-1)], cache
    for _ in range(5):
        logits, cache = step(fused, tokens[-1], cache)
        want_logits, unfused_cache = step(unfused, tokens[-1], unfused_cache)
        assert rel_l2(logits, want_logits) < 1e-5
        tokens.append(jnp.argmax(logits[:, :vocab], axis=-1))
    assert fused_runs
    sequence = jnp.concatenate([prompt, jnp.stack(tokens, axis=1)], axis=1)
    forward = nnx.jit(lambda m, ids: m(ids))(unfused, sequence[:, :-1])
    np.testing.assert_array_equal(jnp.argmax(forward[:, 3:, :vocab], axis=-1), sequence[:, 4:])


def test_mamba2_step_under_head_parallelism_keeps_the_unfused_step(fused_runs):
    """Heads split over two devices: a norm group may span devices, so the layer runs the unfused step (the
    kernel, supported here, is never traced) and equals the single-device step."""
    options = dict(ngroups=2)
    layer, reference = _layer("auto", options), _layer("xla", options)
    cache = _random_cache(reference, seed=6)
    u = jax.random.normal(jax.random.key(7), (BATCH, D_MODEL))
    want_out, want_cache = _step(reference, u, cache)
    shard_model(layer, jax.make_mesh((1, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2))
    out, new_cache = _step(layer, u, cache)
    assert not fused_runs
    assert rel_l2(out, want_out) < 1e-5
    for got, want in zip(new_cache, want_cache):
        assert rel_l2(got, want) < 1e-6
