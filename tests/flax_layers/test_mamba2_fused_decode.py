"""The Mamba2 layer's token step through the fused decode kernel (`decode_kernel="fused"`) on the NumPy emulator
of cuda.tile (the "cutile_emulated" backend of tests/bridge/_emulated_backend.py), against the composed step
(`decode_kernel="composed"`, pure JAX) of a layer with the same weights; the LM's greedy tokens through the
fused step against the uncached forward's argmax; and which kernels a traced step launches for sm_90 (no GPU
needed): the fused one per layer on one device, the composed ones under head parallelism."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

pytest.importorskip("cuda.tile")

from jax_mamba2 import backends  # noqa: E402
from jax_mamba2.flax_layers import Mamba2, Mamba2Config, Mamba2LMHeadModel, shard_model  # noqa: E402
from tests._helpers import rel_l2  # noqa: E402
from tests.bridge._emulated_backend import EMULATED  # noqa: E402
from tests.flax_layers._programs import cutile_launches, while_body_launches  # noqa: E402

# Kernel-compatible sizes: headdim and d_state powers of two.
CONFIG = Mamba2Config(d_model=32, n_layer=2, vocab_size=64, ssm_cfg=dict(d_state=16, headdim=16, chunk_size=8))


@pytest.fixture(autouse=True)
def emulated_backend(monkeypatch):
    monkeypatch.setitem(backends._REGISTRY, EMULATED.name, EMULATED)


def _layers(**options):
    """(fused on the emulator, composed in pure JAX) layers with the same weights."""
    def make(backend, decode_kernel):
        return Mamba2(32, d_state=16, headdim=16, chunk_size=8, backend=backend, decode_kernel=decode_kernel,
                      rngs=nnx.Rngs(0), **options)
    return make(EMULATED.name, "fused"), make("xla", "composed")


@pytest.mark.parametrize("options", [
    {},
    {"norm_before_gate": True},
    {"ngroups": 2, "dt_limit": (0.01, 0.2)},
    {"rmsnorm": False, "D_has_hdim": True},
    {"d_ssm": 32},  # half of d_inner: the gated-MLP branch beside the SSD
    {"param_dtype": jnp.bfloat16},
], ids=lambda o: ",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in o.items()) or "defaults")
def test_fused_layer_steps_equal_the_composed_steps(options):
    fused, composed = _layers(**options)
    u = jax.random.normal(jax.random.key(1), (3, 12, 32), jnp.float32)
    _, cache = composed.prefill(u[:, :9])  # a state of random tokens, not zeros
    want_cache = got_cache = cache
    step = nnx.jit(lambda layer, u, cache: layer.step(u, cache))
    tolerance = 2e-2 if options.get("param_dtype") == jnp.bfloat16 else 1e-5
    for t in range(9, 12):
        want, want_cache = step(composed, u[:, t], want_cache)
        got, got_cache = step(fused, u[:, t], got_cache)
        assert got.dtype == want.dtype
        assert rel_l2(got, want) < tolerance, t
        for name, g, w in zip(("conv_state", "ssm_state"), got_cache, want_cache):
            assert g.dtype == w.dtype, name
            assert rel_l2(g, w) < tolerance, (name, t)


def test_fused_lm_greedy_tokens_are_the_uncached_forward_argmax():
    fused = Mamba2LMHeadModel(CONFIG, backend=EMULATED.name, rngs=nnx.Rngs(0))
    composed = Mamba2LMHeadModel(CONFIG, backend="xla", rngs=nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.key(2), (2, 5), 0, CONFIG.vocab_size)
    logits, cache = nnx.jit(lambda m, ids: m.prefill(ids))(composed, prompt)
    step = nnx.jit(lambda m, token, cache: m.step(token, cache))
    tokens = [jnp.argmax(logits[:, -1, :CONFIG.vocab_size], axis=-1)]
    for _ in range(6):
        logits, cache = step(fused, tokens[-1], cache)
        tokens.append(jnp.argmax(logits[:, :CONFIG.vocab_size], axis=-1))
    ids = jnp.concatenate([prompt, jnp.stack(tokens, axis=1)], axis=1)
    forward = nnx.jit(lambda m, ids: m(ids))(composed, ids[:, :-1])[:, prompt.shape[1] - 1:, :CONFIG.vocab_size]
    np.testing.assert_array_equal(jnp.argmax(forward, axis=-1), ids[:, prompt.shape[1]:])


def _step_launches(model, batch=4):
    graphdef, state = nnx.split(model)

    def step(state, token, cache):
        return nnx.merge(graphdef, state).step(token, cache)

    jaxpr = jax.make_jaxpr(step)(state, jnp.zeros((batch,), jnp.int32), model.init_cache(batch))
    return [name for name, _ in cutile_launches(jaxpr)]


@pytest.mark.parametrize("decode_kernel,per_layer", [
    ("fused", ["rms_norm_fwd_kernel", "decode_step_kernel"]),
    ("composed", ["rms_norm_fwd_kernel", "state_update_kernel", "rms_norm_fwd_kernel"]),
])
def test_traced_lm_step_launches_the_chosen_decode_kernel(decode_kernel, per_layer):
    aot = pytest.importorskip("jax_mamba2.bridge.aot")
    with aot.cuda_target("sm_90"):
        model = Mamba2LMHeadModel(CONFIG, backend="cutile", decode_kernel=decode_kernel, rngs=nnx.Rngs(0))
        # The layers run in one scan: its body is traced once; the final norm follows it.
        assert _step_launches(model) == [*per_layer, "rms_norm_fwd_kernel"]


def test_head_parallel_step_runs_the_composed_kernels():
    """Under shard_map over heads a norm group and the B, C columns may span devices: the fused kernel,
    which normalizes whole groups from whole B, C, steps aside."""
    aot = pytest.importorskip("jax_mamba2.bridge.aot")
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with aot.cuda_target("sm_90"):
        model = shard_model(Mamba2LMHeadModel(CONFIG, backend="cutile", rngs=nnx.Rngs(0)), mesh)
        names = _step_launches(model)
    assert "decode_step_kernel" not in names and "state_update_kernel" in names


def _compiled_step_launches(model, batch=3):
    graphdef, state = nnx.split(model)

    def step(state, token, cache):
        return nnx.merge(graphdef, state).step(token, cache)

    hlo = jax.jit(step).lower(state, jnp.zeros((batch,), jnp.int32), model.init_cache(batch)).compile().as_text()
    return [name for category, name in while_body_launches(hlo) if category == "compute"]


def test_compiled_lm_step_launches_per_layer():
    """The body of the compiled scan over layers (CPU; the kernel is the emulator's host callback, the norms
    XLA's): the block's residual add and norm (3 on this backend, 1 cuTile kernel on a GPU), in_proj, the
    kernel, the grouped norm's scale (2: statistic and product) and out_proj, against 20 composed."""
    fused = _compiled_step_launches(Mamba2LMHeadModel(CONFIG, backend=EMULATED.name, rngs=nnx.Rngs(0)))
    composed = _compiled_step_launches(Mamba2LMHeadModel(CONFIG, backend="xla", rngs=nnx.Rngs(0)))
    assert len([name for name in fused if "callback" in name]) == 1, fused
    assert len(fused) <= 8, fused
    assert len(composed) >= len(fused) + 8, (fused, composed)


def test_decode_kernel_is_checked():
    with pytest.raises(ValueError, match=r"decode_kernel='graph' must be one of \('fused', 'composed'\)"):
        Mamba2(32, d_state=16, headdim=16, decode_kernel="graph", rngs=nnx.Rngs(0))
