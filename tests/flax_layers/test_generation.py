"""Tests of `generate` and its next-token rule (jax_mamba2/flax_layers/generation.py, sampling.py).

The logits processing is checked against a NumPy transcription of HF transformers' processors (float64), the
sampled frequencies against the processed distribution, and generate's tokens against the uncached forward.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_mamba2.flax_layers import Mamba2LMHeadModel, generate, generate_stream
from jax_mamba2.flax_layers import sampling as sampling_rule
from tests.flax_layers._generation import ended_at_eos
from tests.flax_layers._programs import walk

BATCH = 2


def _model(config, cls=Mamba2LMHeadModel):
    return cls(config, backend="xla", rngs=nnx.Rngs(0))


def _token_ids(config, seed=0, shape=(BATCH, 4)):
    return jax.random.randint(jax.random.key(seed), shape, 0, config.vocab_size)


def _forward_logits(model, tokens):
    """The uncached forward's logits of the vocabulary: (batch, seqlen, vocab_size) float64 NumPy."""
    logits = nnx.jit(lambda m, ids: m(ids))(model, jnp.asarray(tokens))
    return np.asarray(logits[..., :model.config.vocab_size], np.float64)


def _softmax(logits):
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def hf_processed_logits(logits, *, temperature=1.0, top_k=None, top_p=None, min_p=None, seen=None, penalty=1.0):
    """HF transformers' RepetitionPenalty, Temperature, TopK, TopP and MinP processors, in generate's order, on
    (batch, vocab) float64 logits (removed tokens at -inf)."""
    s = np.array(logits, np.float64)
    if seen is not None:
        s = np.where(seen, np.where(s < 0, s * penalty, s / penalty), s)
    s = s / temperature
    if top_k is not None:
        kth = np.sort(s, axis=-1)[:, -top_k][:, None]
        s = np.where(s < kth, -np.inf, s)
    if top_p is not None:
        order = np.argsort(s, axis=-1)  # ascending
        cumulative = np.cumsum(_softmax(np.take_along_axis(s, order, axis=-1)), axis=-1)
        remove_sorted = cumulative <= 1 - top_p
        remove_sorted[:, -1] = False
        remove = np.zeros_like(remove_sorted)
        np.put_along_axis(remove, order, remove_sorted, axis=-1)
        s = np.where(remove, -np.inf, s)
    if min_p is not None:
        probs = _softmax(s)
        s = np.where(probs < min_p * probs.max(axis=-1, keepdims=True), -np.inf, s)
    return s


def _candidates(logits, sampling):
    """Our processing as dense (batch, vocab) float64 logits with the removed tokens at -inf."""
    kept, ids = sampling_rule.candidate_logits(jnp.asarray(logits, jnp.float32), sampling)
    kept = np.asarray(kept, np.float64)
    if ids is None:
        return kept
    dense = np.full(logits.shape, -np.inf)
    np.put_along_axis(dense, np.asarray(ids), kept, axis=-1)
    return dense


@pytest.mark.parametrize("controls", [
    dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=1.0, top_p=0.6),
    dict(temperature=0.8, top_p=0.95), dict(temperature=1.0, min_p=0.2), dict(temperature=2.0, min_p=1.0),
    dict(temperature=1.5, top_k=12, top_p=0.5, min_p=0.05),
])
def test_candidates_follow_hf_processors(controls):
    logits = np.random.default_rng(0).normal(0, 2, (16, 40))
    sampling = sampling_rule.make_sampling("test", 40, **controls)
    want, got = hf_processed_logits(logits, **controls), _candidates(logits, sampling)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    # Up to each row's shift (the candidates come shifted by the row's largest logit: the same distribution).
    want = want - np.max(want, axis=-1, keepdims=True)
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6, atol=1e-6)
    assert 1 <= np.isfinite(got).sum(axis=-1).min()


@pytest.mark.parametrize("controls", [
    dict(temperature=0.9, top_p=0.85, min_p=0.05), dict(temperature=1.4, top_k=5),
    dict(temperature=0.6, top_k=7, top_p=0.9),
])
def test_sampled_frequencies_follow_the_processed_distribution(controls):
    """40,000 draws of one row's next token: only candidates, at their renormalized probabilities (within 5
    standard errors)."""
    logits = np.random.default_rng(1).normal(0, 1.5, (1, 12))
    want = _softmax(hf_processed_logits(logits, **controls))[0]
    draws = 40_000
    tokens = sampling_rule.next_tokens(jnp.asarray(np.repeat(logits, draws, axis=0), jnp.float32),
                                       jax.random.key(3), None, sampling_rule.make_sampling("test", 12, **controls))
    counts = np.bincount(np.asarray(tokens), minlength=12)
    assert counts[want == 0].sum() == 0 and (counts[want > 0] > 0).all()
    standard_error = np.sqrt(want * (1 - want) / draws)
    np.testing.assert_array_less(np.abs(counts / draws - want), 5 * standard_error + 1e-12)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = jnp.array([[2.0, -1.0, 0.5, 3.0]])
    seen = sampling_rule.mark_seen(jnp.zeros((1, 4), bool), jnp.array([[0, 1]]))
    np.testing.assert_array_equal(sampling_rule.penalize_repeats(logits, seen, jnp.float32(2.0)),
                                  [[1.0, -2.0, 0.5, 3.0]])
    greedy = sampling_rule.make_sampling("test", 4, repetition_penalty=8.0)
    assert greedy.values.keys() == {"repetition_penalty"} and not greedy.sample
    seen = sampling_rule.mark_seen(seen, jnp.array([3]))  # the argmax seen: 3.0 / 8 < 0.5
    assert int(sampling_rule.next_tokens(logits, None, seen, greedy)[0]) == 2


def test_a_penalized_logit_past_float32_saturates_instead_of_becoming_inf():
    """The smallest penalty allowed divides a large logit past float32's range: it stays finite (an inf would
    turn the row's shift by its largest into NaN, and the draw would fall to id 0), and it is drawn."""
    largest = np.finfo(np.float32).max
    logits = jnp.array([[0.5, -1e3, 1e3, 2.0]])
    seen = jnp.array([[False, True, True, False]])
    tiny = np.finfo(np.float32).tiny  # a negative logit is multiplied by it, a positive one divided
    np.testing.assert_array_equal(sampling_rule.penalize_repeats(logits, seen, jnp.float32(tiny)),
                                  [[0.5, np.float32(-1e3) * tiny, largest, 2.0]])
    sampling = sampling_rule.make_sampling("test", 4, temperature=1.0, min_p=0.1, repetition_penalty=float(tiny))
    assert int(sampling_rule.next_tokens(logits, jax.random.key(0), seen, sampling)[0]) == 2


def test_top_k_keeps_the_tokens_tied_with_the_kth_as_hf_does():
    """HF's TopKLogitsWarper removes only logits below the k-th largest: with top_k=1 and two tokens tied for the
    largest logit, both are drawn (bf16 logits tie often)."""
    logits = jnp.asarray(np.repeat([[1.0, 3.0, 3.0, 0.0]], 4000, axis=0), jnp.float32)
    sampling = sampling_rule.make_sampling("test", 4, temperature=1.0, top_k=1)
    np.testing.assert_array_equal(np.isfinite(_candidates(np.asarray(logits[:1]), sampling)), [[0, 1, 1, 0]])
    counts = np.bincount(np.asarray(sampling_rule.next_tokens(logits, jax.random.key(0), None, sampling)),
                         minlength=4)
    assert counts[0] == counts[3] == 0 and 1800 < counts[1] < 2200


def test_controls_take_numpy_and_concrete_jax_scalars_and_top_p_one_is_off():
    a = sampling_rule.make_sampling("test", 10, temperature=jnp.float32(0.5), top_p=np.float64(1.0), top_k=np.int64(3),
                                    repetition_penalty=np.float32(1.2))
    assert a.sample and a.top_k == 3 and set(a.values) == {"temperature", "repetition_penalty"}
    assert sampling_rule.make_sampling("test", 10, temperature=1.0, top_k=jnp.int32(3)).top_k == 3
    # bfloat16 scalars too (NumPy does not count ml_dtypes' bfloat16 among its numbers).
    b = sampling_rule.make_sampling("test", 10, temperature=jnp.bfloat16(0.5), top_p=jnp.bfloat16(0.5),
                                    min_p=jnp.bfloat16(0.25), repetition_penalty=jnp.bfloat16(1.5))
    assert b.values == {"temperature": 0.5, "top_p": 0.5, "min_p": 0.25, "repetition_penalty": 1.5}
    with pytest.raises(TypeError, match="temperature=.* must be a float \\(a concrete number\\)"):
        sampling_rule.make_sampling("test", 10, temperature=jnp.complex64(0.5))
    with pytest.raises(TypeError, match="temperature=.* must be a float \\(a concrete number\\)"):
        jax.jit(lambda t: sampling_rule.make_sampling("test", 10, temperature=t))(0.5)


def test_greedy_drops_the_sampling_filters_and_values_are_traced():
    assert sampling_rule.make_sampling("test", 10, top_k=3, top_p=0.5, min_p=0.1).values == {}
    a = sampling_rule.make_sampling("test", 10, temperature=0.5, top_p=0.5)
    b = sampling_rule.make_sampling("test", 10, temperature=2.0, top_p=0.9)
    assert jax.tree.structure(a) == jax.tree.structure(b)  # one compiled program for both
    assert jax.tree.structure(a) != jax.tree.structure(sampling_rule.make_sampling("test", 10, temperature=2.0))


def test_generate_greedy_is_deterministic_and_follows_forward_argmax(tiny_config):
    model = _model(tiny_config)
    prompt = _token_ids(tiny_config, seed=3)
    tokens = generate(model, prompt, 6)
    assert tokens.shape == (BATCH, 10) and tokens.dtype == jnp.int32
    np.testing.assert_array_equal(tokens[:, :4], prompt)
    np.testing.assert_array_equal(generate(model, prompt, 6), tokens)
    np.testing.assert_array_equal(np.argmax(_forward_logits(model, tokens[:, :-1])[:, 3:], axis=-1), tokens[:, 4:])


def test_generate_sampling_respects_top_k(tiny_config):
    model = _model(tiny_config)
    prompt = _token_ids(tiny_config, seed=4)
    top_k = 3
    tokens = generate(model, prompt, 8, temperature=2.0, top_k=top_k, rng=jax.random.key(0))
    other = generate(model, prompt, 8, temperature=2.0, top_k=top_k, rng=jax.random.key(1))
    assert not np.array_equal(tokens, other)  # the key matters
    logits = _forward_logits(model, tokens[:, :-1])[:, 3:]
    ranks = np.sum(logits > np.take_along_axis(logits, np.asarray(tokens[:, 4:, None]), axis=-1), axis=-1)
    assert int(ranks.max()) < top_k  # every sampled token is among the top_k of its logits
    assert int(tokens.max()) < tiny_config.vocab_size
    np.testing.assert_array_equal(
        generate(model, prompt, 8, temperature=1.0, top_k=1, rng=jax.random.key(0)), generate(model, prompt, 8))


def test_generate_samples_within_top_p_and_min_p_of_the_forward_logits(tiny_config):
    """Every sampled token is a candidate of HF's processors on the uncached forward's logits; the bounds are
    widened by 1e-4 so that the cached step's rounding cannot move a token across them."""
    model = _model(tiny_config)
    prompt = _token_ids(tiny_config, seed=5, shape=(4, 4))
    for controls in (dict(temperature=1.0, top_p=0.5), dict(temperature=0.1, min_p=0.3)):
        tokens = np.asarray(generate(model, prompt, 10, **controls, rng=jax.random.key(2)))
        logits = _forward_logits(model, tokens[:, :-1])[:, 3:].reshape(-1, tiny_config.vocab_size)
        widened = {k: v + 1e-4 if k == "top_p" else v - 1e-4 if k == "min_p" else v for k, v in controls.items()}
        allowed = np.isfinite(hf_processed_logits(logits, **widened))
        assert np.take_along_axis(allowed, tokens[:, 4:].reshape(-1, 1), axis=-1).all()
        assert (allowed.sum(axis=-1) < tiny_config.vocab_size).all()  # the filter removed tokens


def test_generate_with_repetition_penalty_follows_the_penalized_forward(tiny_config):
    """Greedy decoding with a repetition penalty equals, token by token, the argmax of the uncached forward's
    logits with HF's penalty over the prompt and the tokens generated so far."""
    model = _model(tiny_config)
    prompt = np.asarray(_token_ids(tiny_config, seed=6, shape=(3, 5)))
    penalty, new_tokens = 1.8, 8
    tokens = prompt
    for _ in range(new_tokens):
        seen = np.zeros((len(tokens), tiny_config.vocab_size), bool)
        np.put_along_axis(seen, tokens, True, axis=-1)
        logits = hf_processed_logits(_forward_logits(model, tokens)[:, -1], seen=seen, penalty=penalty)
        tokens = np.concatenate([tokens, np.argmax(logits, axis=-1)[:, None]], axis=1)
    np.testing.assert_array_equal(generate(model, prompt, new_tokens, repetition_penalty=penalty), tokens)
    assert not np.array_equal(generate(model, prompt, new_tokens), tokens)  # the penalty changed the tokens


class _StepCountingLM(Mamba2LMHeadModel):
    """Counts the cached steps a compiled generate runs (a host callback per step)."""
    steps: list = []

    def step(self, input_ids, cache):
        jax.debug.callback(lambda: _StepCountingLM.steps.append(1))
        return super().step(input_ids, cache)


def test_generate_ends_rows_at_eos_pads_after_it_and_stops_when_all_ended(tiny_config):
    model = _model(tiny_config, _StepCountingLM)
    prompt = _token_ids(tiny_config, seed=7, shape=(3, 4))
    new_tokens = 10
    free = np.asarray(generate(model, prompt, new_tokens))[:, 4:]
    eos = int(free[0, 3])
    ends = [int(np.argmax(row == eos)) if (row == eos).any() else None for row in free]

    _StepCountingLM.steps.clear()
    got = np.asarray(generate(model, prompt, new_tokens, eos_token_id=eos, pad_token_id=jnp.int32(0)))  # JAX's ints too
    jax.effects_barrier()
    np.testing.assert_array_equal(got[:, :4], prompt)
    np.testing.assert_array_equal(got[:, 4:], ended_at_eos(free, eos, 0))
    finished_all = None if None in ends else max(ends)
    assert len(_StepCountingLM.steps) == (new_tokens - 1 if finished_all is None else finished_all)

    # two copies of the first row: both end at its first eos, after that many cached steps
    _StepCountingLM.steps.clear()
    got = np.asarray(generate(model, jnp.repeat(prompt[:1], 2, axis=0), new_tokens, eos_token_id=eos))
    jax.effects_barrier()
    assert len(_StepCountingLM.steps) == ends[0] and 0 < ends[0] < new_tokens - 1
    np.testing.assert_array_equal(got[:, 4:], ended_at_eos(np.repeat(free[:1], 2, axis=0), eos, eos))

    # every row ends at its first token: no cached step runs, and the pad defaults to the (first) eos id
    _StepCountingLM.steps.clear()
    got = np.asarray(generate(model, prompt, new_tokens, eos_token_id=[int(t) for t in free[:, 0]]))
    jax.effects_barrier()
    assert len(_StepCountingLM.steps) == 0
    np.testing.assert_array_equal(got[:, 4], free[:, 0])
    assert (got[:, 5:] == free[0, 0]).all()


def test_generate_samples_the_same_tokens_until_eos_with_the_same_key(tiny_config):
    model = _model(tiny_config)
    prompt = _token_ids(tiny_config, seed=8, shape=(4, 4))
    controls = dict(temperature=1.0, top_k=20, rng=jax.random.key(5))
    free = np.asarray(generate(model, prompt, 12, **controls))[:, 4:]
    eos = int(free[1, 6])
    got = np.asarray(generate(model, prompt, 12, eos_token_id=eos, pad_token_id=1, **controls))[:, 4:]
    np.testing.assert_array_equal(got, ended_at_eos(free, eos, 1))


@pytest.mark.parametrize("controls, variant", [
    (dict(), "fused"), (dict(repetition_penalty=1.5), "fused"), (dict(), "mlp_branch_unrolled"),
], ids=["greedy", "penalty", "composed_step_per_layer_caches"])
def test_generate_left_padded_prompts_of_different_lengths_like_each_alone(tiny_config, controls, variant):
    """Rows of 1, 2 (shorter than the conv window), 5 and 7 prompt ids, left-padded with ids the model never
    reads (out of range too): each row's tokens are those of its prompt generated alone; also for a mixer with
    the MLP branch, unrolled (the composed step, one cache per layer)."""
    if variant == "fused":
        model = _model(tiny_config)
    else:
        config = dataclasses.replace(tiny_config, ssm_cfg={**tiny_config.ssm_cfg, "d_ssm": tiny_config.d_model})
        model = Mamba2LMHeadModel(config, backend="xla", scan_layers=False, rngs=nnx.Rngs(0))
        assert not model.layers.mixer.decodes_fused()
    lengths = [1, 2, 5, 7]
    prompts = [np.asarray(_token_ids(tiny_config, seed=10 + i, shape=(1, n)))[0] for i, n in enumerate(lengths)]
    padded = np.stack([np.concatenate([np.full(7 - len(p), 999 if i % 2 else 3), p]) for i, p in enumerate(prompts)])
    got = np.asarray(generate(model, padded, 6, prompt_lengths=lengths, **controls))
    np.testing.assert_array_equal(got[:, :7], padded)
    for row, prompt in zip(got, prompts):
        alone = np.asarray(generate(model, prompt[None], 6, **controls))[0]
        np.testing.assert_array_equal(row[7:], alone[len(prompt):])


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("controls", [
    dict(), dict(temperature=0.9, top_p=0.8, repetition_penalty=1.3, rng=jax.random.key(6)),
    dict(prompt_lengths=[2, 6, 4]),
], ids=["greedy", "sampled", "padded"])
def test_generate_stream_yields_generates_tokens_one_step_at_a_time(tiny_config, scan_layers, controls):
    model = Mamba2LMHeadModel(tiny_config, backend="xla", scan_layers=scan_layers, rngs=nnx.Rngs(0))
    prompt = _token_ids(tiny_config, seed=9, shape=(3, 6))
    want = np.asarray(generate(model, prompt, 7, **controls))[:, 6:]
    got = [np.asarray(tokens) for tokens in list(generate_stream(model, prompt, 7, **controls))]  # all kept
    assert len(got) == 7 and all(t.shape == (3,) and t.dtype == np.int32 for t in got)
    np.testing.assert_array_equal(np.stack(got, axis=1), want)
    np.testing.assert_array_equal(np.asarray(generate(model, prompt, 7, **controls))[:, 6:], want)  # state intact


def test_a_stream_of_any_length_draws_each_step_s_key_as_it_comes(tiny_config):
    """generate_stream(max_new_tokens=2**31 - 1) samples its first tokens at once, as generate of 3 tokens does
    with the same rng (no array of every step's key is built first: 16 GiB at that length)."""
    model = _model(tiny_config)
    prompt = _token_ids(tiny_config, seed=13, shape=(2, 5))
    controls = dict(temperature=1.0, rng=jax.random.key(21))
    stream = generate_stream(model, prompt, 2**31 - 1, **controls)
    got = np.stack([np.asarray(next(stream)) for _ in range(3)], axis=1)
    np.testing.assert_array_equal(got, np.asarray(generate(model, prompt, 3, **controls))[:, 5:])


def test_generate_stream_stops_once_every_row_has_ended(tiny_config):
    model = _model(tiny_config)
    prompt = jnp.repeat(_token_ids(tiny_config, seed=11, shape=(1, 4)), 2, axis=0)
    free = np.asarray(generate(model, prompt, 10))[:, 4:]
    eos = int(free[0, 3])
    end = int(np.argmax(free[0] == eos))
    got = np.stack([np.asarray(t) for t in generate_stream(model, prompt, 10, eos_token_id=eos)], axis=1)
    np.testing.assert_array_equal(got, free[:, :end + 1])
    with pytest.raises(ValueError, match=r"generate_stream: top_p=2.0 must be in \(0, 1\]"):
        generate_stream(model, prompt, 10, temperature=1.0, top_p=2, rng=jax.random.key(0))  # checked at the call


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(max_new_tokens=0), ValueError, r"generate: max_new_tokens=0 must be a positive int"),
    (dict(temperature=-1.0), ValueError, r"generate: temperature=-1.0 must be >= 0"),
    (dict(temperature=float("nan")), ValueError, r"generate: temperature=nan must be >= 0"),
    (dict(temperature="hot"), TypeError, r"generate: temperature='hot' must be a float"),
    (dict(max_new_tokens=2.0), TypeError, r"generate: max_new_tokens=2.0 must be a positive int"),
    (dict(max_new_tokens=True), TypeError, r"generate: max_new_tokens=True must be a positive int"),
    (dict(max_new_tokens=2**40), ValueError, r"generate: max_new_tokens=1099511627776 after prompt_len=3: "
                                             r"prompt_len\+max_new_tokens=1099511627779 must be at most 2\*\*31 - 1 "
                                             r"\(an array axis\)"),
    (dict(temperature=1.0, top_k=0, rng=jax.random.key(0)), ValueError,
     r"generate: top_k=0 must be in \[1, vocab_size=61\]"),
    (dict(temperature=1.0, top_k=2.5, rng=jax.random.key(0)), TypeError, r"generate: top_k=2.5 must be None or an int"),
    (dict(top_p=0.0), ValueError, r"generate: top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, r"generate: top_p=1.5 must be in \(0, 1\]"),
    (dict(min_p=-0.1), ValueError, r"generate: min_p=-0.1 must be in \[0, 1\]"),
    (dict(min_p=float("nan")), ValueError, r"generate: min_p=nan must be in \[0, 1\]"),
    (dict(top_p="all"), TypeError, r"generate: top_p='all' must be a float"),
    (dict(repetition_penalty=0.0), ValueError, r"generate: repetition_penalty=0.0 must be > 0"),
    (dict(repetition_penalty=float("inf")), ValueError, r"generate: repetition_penalty=inf must be > 0 and within "
                                                        r"float32's normal numbers"),
    (dict(repetition_penalty=1e-45), ValueError, r"generate: repetition_penalty=1e-45 must be > 0 and within"),
    (dict(repetition_penalty=1e39), ValueError, r"generate: repetition_penalty=1e\+39 must be > 0 and within"),
    (dict(temperature=float("inf")), ValueError, r"generate: temperature=inf must be >= 0 and at most 3.4e\+38"),
    (dict(temperature=1e39, rng=jax.random.key(0)), ValueError,
     r"generate: temperature=1e\+39 must be >= 0 and at most 3.4e\+38, float32's largest number"),
    (dict(eos_token_id=61), ValueError, r"generate: eos_token_id=61 must be in \[0, vocab_size=61\)"),
    (dict(eos_token_id=[3, -1]), ValueError, r"generate: eos_token_id=\[3, -1\] must be in \[0, vocab_size=61\)"),
    (dict(eos_token_id=[]), ValueError, r"generate: eos_token_id=\[\] must be an int or a non-empty sequence"),
    (dict(eos_token_id=2.0), TypeError, r"generate: eos_token_id=2.0 must be an int or a non-empty sequence"),
    (dict(pad_token_id=0), ValueError, r"generate: pad_token_id=0 needs an eos_token_id"),
    (dict(eos_token_id=2, pad_token_id=-1), ValueError, r"generate: pad_token_id=-1 must be in \[0, vocab_size=61\)"),
    (dict(temperature=1.0), ValueError, r"generate: rng=None must be a jax.random.key when temperature > 0"),
    (dict(temperature=1.0, rng=7), TypeError, r"generate: rng must be one jax.random.key .*got int$"),
    (dict(temperature=1.0, rng=nnx.Rngs(0)), TypeError, r"generate: rng must be one jax.random.key .*got Rngs$"),
    (dict(temperature=1e-39, rng=jax.random.key(0)), ValueError,
     r"generate: temperature=1e-39 must be 0 \(greedy\) or at least 1.18e-38"),
    (dict(eos_token_id=[[1, 2], [3]]), TypeError, r"generate: eos_token_id=\[\[1, 2\], \[3\]\] must be an int or"),
    (dict(temperature=1.0, rng=jax.random.split(jax.random.key(0))), TypeError,
     r"generate: rng must be one jax.random.key .*of shape \(2,\) and dtype key<fry>"),
    (dict(prompt_lengths=[0]), ValueError, r"generate: prompt_lengths=\[0\] must be in \[1, prompt_len=3\]"),
    (dict(prompt_lengths=[4]), ValueError, r"generate: prompt_lengths=\[4\] must be in \[1, prompt_len=3\]"),
    (dict(prompt_lengths=[1, 2]), ValueError, r"generate: prompt_lengths.shape=\(2,\) must be \(batch,\)=\(1,\)"),
    (dict(prompt_lengths=[1.5]), TypeError, r"generate: prompt_lengths.dtype=float64 must be integer"),
    (dict(prompt_lengths=3), TypeError, r"generate: prompt_lengths must be None or a \(batch,\) integer array or "
                                        r"list of ints, got int$"),
    (dict(prompt_lengths=[[1], [2, 3]]), ValueError, r"generate: prompt_lengths must be None or a \(batch,\) "
                                                     r"integer array or list of ints$"),
    (dict(cache_dtype=jnp.int32), TypeError, r"generate: cache_dtype=int32 must be one of "
                                             r"bfloat16, float16, float32, float64"),
    (dict(cache_dtype="half precision"), TypeError, r"generate: cache_dtype='half precision' must be a float dtype"),
])
def test_generate_rejects_bad_arguments(tiny_config, kwargs, error, message):
    model = _model(tiny_config)
    with pytest.raises(error, match=message):
        generate(model, jnp.zeros((1, 3), jnp.int32), **{"max_new_tokens": 2, **kwargs})


@pytest.mark.parametrize("prompt, error, message", [
    pytest.param([[3, 999, 5]], ValueError,
                 r"generate: prompt_ids must be in \[0, vocab_size=61\); prompt_ids\[0, 1\]=999 \(1 ids out",
                 id="id_past_vocab"),
    pytest.param([[3, 4], [61, 62]], ValueError, r"prompt_ids\[1, 0\]=61 \(2 ids out of range\)",
                 id="padding_ids"),
    pytest.param([[3, -1, 5]], ValueError, r"generate: prompt_ids must be in .*prompt_ids\[0, 1\]=-1", id="negative"),
    pytest.param(jnp.array([[3.0, 4.7]]), TypeError, r"generate: prompt_ids.dtype=float32 must be integer",
                 id="float_array"),
    pytest.param([[3.0, 4.7]], TypeError, r"generate: prompt_ids.dtype=float64 must be integer", id="float_list"),
    pytest.param(jnp.array([3, 4]), ValueError, r"generate: prompt_ids.shape=\(2,\) must be \(batch, prompt_len\)",
                 id="1d"),
    pytest.param([[]], ValueError, r"generate: prompt_ids.shape=\(1, 0\) must be \(batch, prompt_len >= 1\)",
                 id="empty_list"),
    pytest.param(None, TypeError, r"generate: prompt_ids must be a \(batch, prompt_len\) integer array or list of "
                 r"equal-length lists of ints, got NoneType", id="none"),
    pytest.param(7, TypeError, r"generate: prompt_ids must be .* got int$", id="number"),
])
def test_generate_rejects_bad_prompts(tiny_config, prompt, error, message):
    with pytest.raises(error, match=message):
        generate(_model(tiny_config), prompt, 2)


def test_generate_refuses_an_output_longer_than_an_axis_or_larger_than_an_array_before_running(tiny_config):
    """The output, (batch, prompt_len + max_new_tokens) ids, must have an axis int32 indexes and fit XLA's byte
    count: refused at the call, naming max_new_tokens and the bound, before the prompt is read or anything built.
    generate_stream builds no such array: only max_new_tokens (its keys' axis) is bounded, at the call too."""
    model = _model(tiny_config)
    prompt = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"generate: max_new_tokens=2147483645 after prompt_len=3: "
                                         r"prompt_len\+max_new_tokens=2147483648 must be at most 2\*\*31 - 1"):
        generate(model, prompt, 2**31 - 3)
    generate_stream(model, prompt, 2**31 - 1)  # no output array: checked, nothing run until the first token
    with pytest.raises(ValueError, match=r"generate_stream: max_new_tokens=2147483648 must be at most 2\*\*31 - 1"):
        generate_stream(model, prompt, 2**31)
    rows = np.broadcast_to(np.int32(0), (2**30, 3))  # 2**30 prompts, of no memory
    with pytest.raises(ValueError, match=r"generate: the output of shape \(batch, prompt_len \+ max_new_tokens\)="
                                         r"\(1073741824, 2147483647\) would hold 2305843008139952128 elements; an "
                                         r"array holds at most 2\*\*60 - 1"):
        generate(model, rows, 2**31 - 4)


def test_small_temperatures_sample_the_most_likely_token_and_padding_ids_must_fit_int32(tiny_config):
    """A temperature so small that the logits over it pass float32's range samples the argmax, as the limit of
    sampling at T -> 0 does (the logits are shifted by their largest before the division); padding ids int32
    cannot hold are refused, since the prompt comes back as given."""
    model = _model(tiny_config)
    prompt = jax.random.randint(jax.random.key(3), (2, 5), 0, tiny_config.vocab_size)
    greedy = generate(model, prompt, 6)
    for seed in range(3):
        np.testing.assert_array_equal(generate(model, prompt, 6, temperature=1e-30, rng=jax.random.key(seed)),
                                      greedy)
    padded = np.asarray(prompt, np.int64).copy()
    padded[0, 0] = 2 ** 40 + 7
    with pytest.raises(ValueError, match="padding ids outside int32"):
        generate(model, padded, 2, prompt_lengths=[4, 5])


def test_step_needs_a_cache(tiny_config):
    model = _model(tiny_config)
    with pytest.raises(TypeError, match=r"Mamba2LMHeadModel.step: cache must be a Mamba2Cache .*got NoneType"):
        model.step(jnp.zeros((2,), jnp.int32), None)
    with pytest.raises(TypeError, match=r"Mamba2Block.step: cache must be a Mamba2Cache .*got NoneType"):
        _first_block(model).step(jnp.zeros((2, tiny_config.d_model)), jnp.zeros((2, tiny_config.d_model)), None)


def _first_block(model):
    graphdef, state = nnx.split(model.layers)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))


def test_generate_rejects_what_is_not_a_model_or_a_rectangular_prompt(tiny_config):
    with pytest.raises(TypeError, match=r"generate: model must be a Mamba2LMHeadModel, got object"):
        generate(object(), [[1, 2]], 2)
    with pytest.raises(ValueError, match=r"generate: prompt_ids must be a \(batch, prompt_len\) array or list of"):
        generate(_model(tiny_config), [[1, 2], [3]], 2)


def test_generate_and_the_decode_step_take_an_empty_batch(tiny_config):
    model = _model(tiny_config)
    tokens = generate(model, jnp.zeros((0, 4), jnp.int32), 3)
    assert tokens.shape == (0, 7)
    np.testing.assert_array_equal(generate(model, jnp.ones((2, 4), jnp.int32), 3)[:0], tokens)
    # with a repetition penalty too (the seen tokens of no rows)
    assert generate(model, jnp.zeros((0, 4), jnp.int32), 3, repetition_penalty=1.5).shape == (0, 7)
    # and the state of no rows that init_cache makes, which prefill and step take
    cache = model.init_cache(0)
    assert cache.ssm_state.shape[1] == 0 and cache.conv_state.shape[1] == 0
    logits, cache = model.prefill(jnp.zeros((0, 4), jnp.int32), cache)
    logits, cache = model.step(jnp.zeros((0,), jnp.int32), cache)
    assert logits.shape == (0, model.config.padded_vocab_size) and cache.ssm_state.shape[1] == 0


def test_generate_takes_max_new_tokens_as_a_numpy_or_concrete_jax_int(tiny_config):
    """A 0-d integer array is a max_new_tokens the checks accept, so the program must take it too: as the Python
    int it is (jit's static arguments are hashed, and a JAX array is not hashable)."""
    model = _model(tiny_config)
    prompt = _token_ids(tiny_config, seed=14)
    want = np.asarray(generate(model, prompt, 3))
    for count in (np.int64(3), jnp.int32(3), np.array(3)):
        np.testing.assert_array_equal(generate(model, prompt, count), want)
        np.testing.assert_array_equal(np.stack(list(generate_stream(model, prompt, count)), axis=1), want[:, 4:])


def test_generate_accepts_a_list_prompt(tiny_config):
    model = _model(tiny_config)
    prompt = [[1, 2, 3], [60, 0, 7]]  # 60 = vocab_size - 1, the largest id
    np.testing.assert_array_equal(generate(model, prompt, 3), generate(model, jnp.array(prompt), 3))


def _output_dtypes(jaxpr, shapes) -> set:
    """The dtypes of the values shaped as one of `shapes` that the equations of `jaxpr` and of the programs it
    calls make."""
    return {v.aval.dtype for eqn, _ in walk(jaxpr) for v in eqn.outvars
            if tuple(getattr(v.aval, "shape", ())) in shapes}


def _decode_loop_state_dtypes(jaxpr, steps: int, state_shape) -> set:
    """The dtypes of the operands shaped (..., *state_shape) of the scans of `steps` steps in `jaxpr` and in the
    programs it calls: in generate's program, the token loop's SSM state."""
    return {v.aval.dtype for eqn, _ in walk(jaxpr)
            if eqn.primitive.name == "scan" and eqn.params["length"] == steps
            for v in eqn.invars if tuple(getattr(v.aval, "shape", ()))[-4:] == state_shape}


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("param_dtype, cache_dtype", [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, "float32")])
def test_generate_decodes_in_the_cache_dtype_asked(tiny_config, scan_layers, param_dtype, cache_dtype):
    """cache_dtype: the prefill's state cast to it, then every step in it (the token loop carries it, where it
    carries the parameters' dtype without the option); the tokens are those of prefill and `step` with such a
    cache by hand, and the stream's."""
    model = Mamba2LMHeadModel(tiny_config, backend="xla", scan_layers=scan_layers, param_dtype=param_dtype,
                              rngs=nnx.Rngs(0))
    prompt = _token_ids(tiny_config, seed=12, shape=(3, 7))
    mixer = model.layers.mixer
    state_shape = (3, mixer.nheads, mixer.headdim, mixer.d_state)
    for asked, carried in ((None, param_dtype), (cache_dtype, cache_dtype)):
        jaxpr = jax.make_jaxpr(lambda p: generate(model, p, 6, cache_dtype=asked))(prompt).jaxpr
        assert _decode_loop_state_dtypes(jaxpr, 5, state_shape) == {jnp.dtype(carried)}  # 1 + 5 new tokens
    got = np.asarray(generate(model, prompt, 6, cache_dtype=cache_dtype))[:, 7:]
    logits, cache = model.prefill(prompt)
    cache = jax.tree.map(lambda a: a.astype(cache_dtype), cache)
    token, want = jnp.argmax(logits[:, -1, :tiny_config.vocab_size], axis=-1), []
    for _ in range(6):
        want.append(np.asarray(token))
        logits, cache = model.step(token, cache)
        assert {a.dtype for a in jax.tree.leaves(cache)} == {jnp.dtype(cache_dtype)}
        token = jnp.argmax(logits[:, :tiny_config.vocab_size], axis=-1)
    np.testing.assert_array_equal(got, np.stack(want, axis=1))
    stream = np.stack([np.asarray(t) for t in generate_stream(model, prompt, 6, cache_dtype=cache_dtype)], axis=1)
    np.testing.assert_array_equal(stream, got)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_prefill_rounds_each_layers_state_to_the_cache_dtype_and_never_stacks_a_wider_one(tiny_config, scan_layers):
    """prefill(cache_dtype=): the cache is the default prefill's rounded to it, and each layer's state is rounded
    as the layer returns it, so the program never makes a float32 stack of the layers' states besides the bf16 one
    (generate(cache_dtype=) prefills this way; rounding the whole stack after the prefill held both, and ran
    mamba2-1.3b's prefill at 256 rows out of an H100's memory)."""
    model = Mamba2LMHeadModel(tiny_config, backend="xla", scan_layers=scan_layers, rngs=nnx.Rngs(0))
    prompt = _token_ids(tiny_config, seed=13, shape=(2, 7))
    logits, cache = model.prefill(prompt)
    rounded_logits, rounded = model.prefill(prompt, cache_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(rounded_logits, logits)
    for got, want in zip(rounded, cache):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, want.astype(jnp.bfloat16))
    stacks, (graphdef, state) = {a.shape for a in cache}, nnx.split(model)
    for asked, made in ((jnp.bfloat16, jnp.bfloat16), (None, jnp.float32)):
        jaxpr = jax.make_jaxpr(lambda s, p: nnx.merge(graphdef, s).prefill(p, cache_dtype=asked))(state, prompt)
        assert _output_dtypes(jaxpr.jaxpr, stacks) == {jnp.dtype(made)}
    with pytest.raises(TypeError, match=r"Mamba2LMHeadModel.prefill: cache_dtype=int32 must be one of bfloat16"):
        model.prefill(prompt, cache_dtype=jnp.int32)
