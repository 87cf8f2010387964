"""Decoding on the cuTile backend in the parameters' dtype (run on the H200; skipped elsewhere): the compiled
token step converts no weight matrix, generate launches only the forward kernels and the fused step's, and
greedy tokens are the uncached forward's argmax; an eos-ended, sampled generate keeps the same tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks.decode_kernels import DECODE_KERNELS
from benchmarks.lm_bench import RECORD_EVERY_COMMAND, RECORD_HOST_CUSTOM_CALLS, cutile_launches
from jax_mamba2.bridge.aot import CUTILE_CUSTOM_CALL
from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel, cast_params, generate
from tests.flax_layers._generation import ended_at_eos
from tests.flax_layers._programs import hlo_weight_conversions

pytestmark = pytest.mark.gpu

CONFIG = Mamba2Config(d_model=256, n_layer=2, vocab_size=256, pad_vocab_size_multiple=8,
                      ssm_cfg=dict(d_state=64, headdim=64, chunk_size=64))
BATCH = 3


def _model(**kwargs):
    return Mamba2LMHeadModel(CONFIG, backend="cutile", rngs=nnx.Rngs(0), **kwargs)


def _compiled_step_hlo(model) -> str:
    graphdef, state = nnx.split(model)

    def step(state, token, cache):
        return nnx.merge(graphdef, state).step(token, cache)

    return jax.jit(step).lower(state, jnp.zeros((BATCH,), jnp.int32), model.init_cache(BATCH)).compile().as_text()


def _prompt(seed, length):
    return jax.random.randint(jax.random.key(seed), (BATCH, length), 0, CONFIG.vocab_size)


def test_compiled_bf16_decode_step_converts_no_weight():
    model = _model(param_dtype=jnp.bfloat16)
    assert hlo_weight_conversions(_compiled_step_hlo(model), model) == []


def test_compiled_step_of_a_cast_model_converts_no_weight():
    model = _model(dtype=jnp.bfloat16)
    assert hlo_weight_conversions(_compiled_step_hlo(model), model)  # float32 weights: converted every step
    cast = cast_params(model, jnp.bfloat16)
    assert hlo_weight_conversions(_compiled_step_hlo(cast), cast) == []


def test_compiled_generate_launches_the_forward_kernels_and_the_fused_step_only():
    model = _model(param_dtype=jnp.bfloat16)
    hlo = jax.jit(lambda prompt: generate(model, prompt, 8)).lower(_prompt(0, 200)).compile().as_text()
    kernels = cutile_launches(hlo, CUTILE_CUSTOM_CALL)
    steps = [k for k in kernels if k.startswith(DECODE_KERNELS)]
    forward = [k for k in kernels if k not in steps]
    # The decode loop: per layer in_proj's norm and product kernels, the mixer step (which also sums the gated
    # norm's squares) and out_proj's product (which normalizes), the head's norm and product; at these 3 rows the
    # projections' K is split: in_proj's and the head's partials summed once more, out_proj's summed by the next
    # norm kernel (no launch of their own).
    count = {name: sum(k.startswith(name) for k in steps) for name in DECODE_KERNELS}
    projections = 2 * CONFIG.n_layer + 1
    assert count == {"decode_norm_kernel": CONFIG.n_layer + 1, "decode_project_kernel": projections,
                     "decode_split_sum_kernel": CONFIG.n_layer + 1, "mixer_step_kernel": CONFIG.n_layer}, kernels
    assert forward and all("fwd" in k for k in forward), kernels  # the prompt: forward kernels, no backward


def test_the_decode_loop_gives_the_same_tokens_whatever_xla_records_into_command_buffers():
    """The decode loop's launches (the SSM state stack updated in place) give the same tokens when XLA records
    every run of commands into command buffers (CUDA graphs), the loop itself included, as XLA defaults them, with
    our launches from the host, and with command buffers off. (Which launches XLA records shows in no HLO: it forms
    its command buffers from the thunks; lm_decode.py times the settings.)"""
    model, prompt = _model(param_dtype=jnp.bfloat16), _prompt(2, 40)
    lowered = jax.jit(lambda prompt: generate(model, prompt, 8)).lower(prompt)
    settings = {"every": {**RECORD_EVERY_COMMAND, "xla_gpu_graph_min_graph_size": 1}, "default": {},
                "host_custom_calls": RECORD_HOST_CUSTOM_CALLS,
                "off": {"xla_gpu_enable_command_buffer": ""}}
    compiled = {name: lowered.compile(options) for name, options in settings.items()}
    assert len(cutile_launches(compiled["default"].as_text(), CUTILE_CUSTOM_CALL)) > 0
    tokens = {name: np.asarray(program(prompt)) for name, program in compiled.items()}
    for name in settings:
        np.testing.assert_array_equal(tokens[name], tokens["off"], err_msg=name)


def _assert_greedy_tokens_follow_the_forward(model, seed: int, rtol: float, agreement: float, **controls):
    """16 greedy tokens of generate after a 100-token prompt: each one's logit in the uncached forward of the
    generated text is the maximum up to `rtol`, and more than `agreement` of them are its argmax."""
    prompt_len = 100
    tokens = generate(model, _prompt(seed, prompt_len), 16, **controls)
    logits = nnx.jit(lambda m, ids: m(ids))(model, tokens[:, :-1])[:, prompt_len - 1:, :CONFIG.vocab_size]
    tokens = tokens[:, prompt_len:]
    chosen = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(chosen, np.float32), np.asarray(logits.max(axis=-1), np.float32),
                               rtol=rtol, atol=0)
    assert float(jnp.mean(jnp.argmax(logits, axis=-1) == tokens)) > agreement


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_greedy_tokens_are_the_uncached_forward_argmax_up_to_ties(param_dtype):
    """A generated token ties with the forward's maximum up to one bfloat16 rounding step of the logits. Also with
    float32 parameters (the LM's default, and so float32 decode states): their conv windows of d_conv 4 are
    16-byte rows, which the mixer step's window stores once took as TMA and hung."""
    _assert_greedy_tokens_follow_the_forward(_model(param_dtype=param_dtype), 1, rtol=2 ** -7, agreement=0.9)


def test_greedy_tokens_of_float32_parameters_with_a_bfloat16_cache_follow_the_uncached_forward():
    """generate(cache_dtype=bfloat16) on float32 parameters: the fused step's kernels with a state in another dtype
    than the weights. The state rounded to bf16 every token moves the logits by more than one rounding step of
    them, so each chosen token is the forward's argmax up to a few (a wrong kernel moves them by far more)."""
    _assert_greedy_tokens_follow_the_forward(_model(), 2, rtol=2 ** -4, agreement=0.8, cache_dtype=jnp.bfloat16)


def test_generate_until_eos_with_sampling_and_a_repetition_penalty_on_the_fused_step():
    """The while loop of an eos-ended generate around the fused step (its SSM state updated in place): the same
    tokens as the loop of known length with the same key up to each row's eos, the pad after it."""
    model = _model(param_dtype=jnp.bfloat16)
    prompt = _prompt(2, 40)
    controls = dict(temperature=0.8, top_p=0.9, repetition_penalty=1.3, rng=jax.random.key(4))
    free = np.asarray(generate(model, prompt, 24, **controls))[:, 40:]
    eos = int(free[0, 10])
    got = np.asarray(generate(model, prompt, 24, eos_token_id=eos, pad_token_id=0, **controls))[:, 40:]
    np.testing.assert_array_equal(got, ended_at_eos(free, eos, 0))


def test_left_padded_prompts_generate_the_uncached_forward_argmax_of_each_prompt_alone():
    """Prompts of 3, 60 and 100 tokens left-padded to 100 (the prefill's seq_idx on the forward kernels): each
    generated token is the forward's maximum over its own unpadded sequence, up to bfloat16 ties."""
    model, lengths = _model(param_dtype=jnp.bfloat16), [3, 60, 100]
    tokens = np.asarray(generate(model, _prompt(3, 100), 16, prompt_lengths=lengths))
    forward = nnx.jit(lambda m, ids: m(ids))
    for row, length in zip(tokens, lengths):
        sequence = row[100 - length:]
        logits = forward(model, jnp.asarray(sequence[None, :-1]))[0, length - 1:, :CONFIG.vocab_size]
        chosen = jnp.take_along_axis(logits, jnp.asarray(sequence[length:, None]), axis=-1)[:, 0]
        np.testing.assert_allclose(np.asarray(chosen, np.float32), np.asarray(logits.max(axis=-1), np.float32),
                                   rtol=2 ** -7, atol=0)


def test_generate_at_batch_zero_launches_nothing_for_its_empty_rows():
    """No rows: the decode ops take their reference path (a launch of no blocks is not made) and generate returns
    the empty tokens the xla backend does."""
    tokens = generate(_model(param_dtype=jnp.bfloat16), jnp.zeros((0, 5), jnp.int32), 3)
    assert tokens.shape == (0, 8)


def test_the_callback_backend_s_token_step_is_one_graph_with_the_ffi_step_s_tokens():
    """backend="cutile_callback": the whole token step is one callback (decode.token_step) that captures its
    launches into a CUDA graph at its first call and replays it after, the launches programmatic dependents of
    each other; the same kernels in the same order as the FFI step (the products' dependent builds take their K
    steps in halves, the same 16-feature MMA steps in the same order), so the same tokens bit for bit, in a first
    generate (the capture) and a second (replays)."""
    models = {b: Mamba2LMHeadModel(CONFIG, backend=b, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
              for b in ("cutile", "cutile_callback")}
    prompt = _prompt(5, 40)
    programs = {b: jax.jit(lambda prompt, m=m: generate(m, prompt, 12)) for b, m in models.items()}
    from jax_mamba2.bridge import callback  # needs cuda.tile: imported where the tests run

    want = np.asarray(programs["cutile"](prompt))
    captured = len(callback._GRAPHS)
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(programs["cutile_callback"](prompt)), want)
    assert len(callback._GRAPHS) > captured  # the token step's graph, captured at its first call
