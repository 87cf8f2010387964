"""`generate`: autoregressive decoding of a `Mamba2LMHeadModel` as one jitted program (mamba_ssm's `decode`, with
HF transformers' sampling controls and end-of-sequence handling).

The prompt runs through the full-sequence kernels (`prefill`), then each new token through the O(1) cached step.
Without an end-of-sequence id the steps are a `lax.scan` of known length; with one, a `lax.while_loop` that stops
once every row has ended (its condition is read on the host each step: a few microseconds that a loop of known
length does not pay).
"""
import functools
from numbers import Integral

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_mamba2.flax_layers import _checks
from jax_mamba2.flax_layers import sampling as sampling_rule
from jax_mamba2.flax_layers.cache import unstack_layers


def generate(model, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None, repetition_penalty: float = 1.0,
             eos_token_id=None, pad_token_id: int | None = None, prompt_lengths=None, rng=None):
    """Autoregressive generation: one jitted program, a prefill then a loop of cached O(1) steps.

    The model's weights enter the program as arguments (not constants), and the program is cached per model
    structure, prompt shape, max_new_tokens and which controls are on (not their values), so later calls do not
    retrace. The controls act as in HF transformers' `generate`, in its order: repetition_penalty, then (when
    sampling) temperature, top_k, top_p, min_p.

    Args:
      model: the `Mamba2LMHeadModel`.
      prompt_ids: (batch, prompt_len) int, prompt_len >= 1, ids in [0, config.vocab_size). Concrete ids are
        range-checked; traced ones (generate called inside jit) cannot be read and are not: there an id past
        the embedding's rows gives NaN logits and a negative one counts from the end.
      prompt_lengths: None (every row's prompt is prompt_len ids), or (batch,) int in [1, prompt_len]: prompts
        of different lengths, left-padded (as HF's `generate` takes a decoder-only batch; e.g. the
        attention_mask's row sums): row b's prompt is its last prompt_lengths[b] ids, the ids before them are
        ignored (any value). Each row generates what its prompt alone would: the padding is a sequence of its
        own in the prefill (`seq_idx`), which every mixer's conv and state restart after.
      max_new_tokens: number of tokens to generate (>= 1).
      temperature: 0 for greedy decoding (deterministic); > 0 samples from softmax(logits / temperature).
      top_k: when sampling, only the top_k most likely tokens are candidates (default: None, all).
      top_p: when sampling, only the most likely tokens whose probabilities sum to top_p, in (0, 1] (the first
        always; default: None, all).
      min_p: when sampling, only tokens at least min_p times as likely as the most likely one, in [0, 1]
        (default: None, all).
      repetition_penalty: > 0; the logits of every token already in the row (prompt or generated) are divided
        by it where positive and multiplied where negative, greedy or sampling (default 1.0: off).
      eos_token_id: None, an id, or a sequence of ids in [0, vocab_size) that end a row: its later tokens are
        pad_token_id, and the loop stops once every row has ended.
      pad_token_id: the id in [0, vocab_size) written after a row's end (default: the first eos_token_id);
        needs eos_token_id.
      rng: a `jax.random.key`, required when temperature > 0.

    Returns:
      (batch, prompt_len + max_new_tokens) int32: the prompt followed by the generated tokens. Tokens are drawn
      from the first `config.vocab_size` ids (padding rows of the embedding are never produced).

    Raises:
      ValueError: on a non-positive max_new_tokens, prompt ids outside [0, vocab_size), a negative
        temperature, a top_k outside [1, vocab_size], a top_p outside (0, 1], a min_p outside [0, 1], a
        repetition_penalty <= 0, an eos_token_id or pad_token_id outside [0, vocab_size), a pad_token_id
        without an eos_token_id, prompt_lengths outside [1, prompt_len] or of another shape than (batch,), or
        a missing rng when sampling.
      TypeError: on prompt ids or lengths that are not integers, or a control of the wrong type.
    """
    vocab_size = model.config.vocab_size
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r} must be a positive int")
    if not hasattr(prompt_ids, "dtype"):  # a nested list of ids
        prompt_ids = np.asarray(prompt_ids)
    _checks.check_array("generate", "prompt_ids", prompt_ids, (("batch", None), ("prompt_len", None)),
                        kind="integer")
    if prompt_ids.shape[1] < 1:
        raise ValueError(f"generate: prompt_ids.shape={prompt_ids.shape} must be (batch, prompt_len >= 1)")
    prompt_lengths = _check_prompt_lengths(prompt_ids, prompt_lengths)
    if prompt_lengths is None:
        _checks.check_token_ids_in_range("generate", "prompt_ids", prompt_ids, vocab_size)
    elif not any(isinstance(a, jax.core.Tracer) for a in (prompt_ids, prompt_lengths)):  # the padding: any id
        in_prompt = np.asarray(_in_prompt(prompt_ids.shape[1], prompt_lengths))
        _checks.check_token_ids_in_range("generate", "prompt_ids", np.where(in_prompt, prompt_ids, 0), vocab_size)
    sampling = sampling_rule.make_sampling(vocab_size, temperature=temperature, top_k=top_k, top_p=top_p,
                                           min_p=min_p, repetition_penalty=repetition_penalty)
    end = _end_of_sequence(vocab_size, eos_token_id, pad_token_id)
    if sampling.sample and rng is None:
        raise ValueError("generate: rng=None must be a jax.random.key when temperature > 0")
    graphdef, state = nnx.split(model)
    rng = jax.random.key(0) if rng is None else rng
    return _generate(graphdef, state, jnp.asarray(prompt_ids, jnp.int32), prompt_lengths, rng, sampling, end,
                     max_new_tokens=max_new_tokens)


def _check_prompt_lengths(prompt_ids, prompt_lengths):
    """None, or prompt_lengths as (batch,) int32 after checking its shape and (concrete) its range."""
    if prompt_lengths is None:
        return None
    if not hasattr(prompt_lengths, "dtype"):
        prompt_lengths = np.asarray(prompt_lengths)
    batch, prompt_len = prompt_ids.shape
    _checks.check_array("generate", "prompt_lengths", prompt_lengths, (("batch", batch),), kind="integer")
    if not isinstance(prompt_lengths, jax.core.Tracer):
        values = np.asarray(prompt_lengths)
        if ((values < 1) | (values > prompt_len)).any():
            raise ValueError(f"generate: prompt_lengths={values.tolist()} must be in [1, prompt_len={prompt_len}]")
    return jnp.asarray(prompt_lengths, jnp.int32)


def _in_prompt(prompt_len: int, prompt_lengths):
    """(batch, prompt_len) bool: which positions of left-padded rows hold their prompt."""
    return jnp.arange(prompt_len)[None, :] >= prompt_len - prompt_lengths[:, None]


def _end_of_sequence(vocab_size: int, eos_token_id, pad_token_id):
    """None (no end of sequence), or (eos ids (n,) int32, pad id int32 scalar), checked."""
    if eos_token_id is None:
        if pad_token_id is not None:
            raise ValueError(f"generate: pad_token_id={pad_token_id!r} needs an eos_token_id (it fills the rows "
                             "after their end)")
        return None
    ids = (eos_token_id,) if isinstance(eos_token_id, Integral) else tuple(np.asarray(eos_token_id).reshape(-1))
    if not ids or any(isinstance(i, (bool, np.bool_)) or not isinstance(i, Integral) for i in ids):
        raise TypeError(f"generate: eos_token_id={eos_token_id!r} must be an int or a non-empty sequence of ints")
    if any(not 0 <= i < vocab_size for i in ids):
        raise ValueError(f"generate: eos_token_id={eos_token_id!r} must be in [0, vocab_size={vocab_size})")
    if pad_token_id is None:
        pad_token_id = ids[0]
    if isinstance(pad_token_id, (bool, np.bool_)) or not isinstance(pad_token_id, Integral):
        raise TypeError(f"generate: pad_token_id={pad_token_id!r} must be None or an int")
    if not 0 <= pad_token_id < vocab_size:  # the ended rows feed it to the model's step
        raise ValueError(f"generate: pad_token_id={pad_token_id} must be in [0, vocab_size={vocab_size})")
    return jnp.asarray(ids, jnp.int32), jnp.int32(pad_token_id)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _generate(graphdef, state, prompt_ids, prompt_lengths, rng, sampling, end, *, max_new_tokens):
    model = nnx.merge(graphdef, state)
    vocab_size = model.config.vocab_size
    batch, prompt_len = prompt_ids.shape

    def choose(logits, key, seen):  # logits (batch, padded_vocab) -> (batch,) int32
        return sampling_rule.next_tokens(logits[:, :vocab_size], key, seen, sampling)

    keys = jax.random.split(rng, max_new_tokens)
    prompt, seq_idx = prompt_ids, None
    if prompt_lengths is not None:  # the left padding: sequence 0 of each row, its ids 0 (-1 for the penalty)
        in_prompt = _in_prompt(prompt_len, prompt_lengths)
        prompt, seq_idx = jnp.where(in_prompt, prompt_ids, 0), in_prompt.astype(jnp.int32)
    seen = (sampling_rule.mark_seen(jnp.zeros((batch, vocab_size), bool),
                                    prompt if seq_idx is None else jnp.where(in_prompt, prompt, -1))
            if sampling.penalizes_repeats else None)
    hidden, residual, cache = model._scan_layers_with_cache("prefill", prompt, None, seq_idx=seq_idx)
    if seq_idx is not None:  # the conv state's columns from the padding: zero, as before a prompt alone
        d_conv = cache.conv_state.shape[-1]
        in_window = prompt_len - d_conv + jnp.arange(d_conv)[None, :] >= prompt_len - prompt_lengths[:, None]
        cache = cache._replace(conv_state=jnp.where(in_window[None, :, None, :], cache.conv_state, 0))
    first = choose(model._logits(hidden[:, -1], residual[:, -1]), keys[0], seen)
    ended = None if end is None else jnp.isin(first, end[0])

    # The composed step of unrolled layers carries one cache per layer, so that no step stacks the whole
    # state; the fused step updates the stacked SSM state in place.
    per_layer = not model.scan_layers and not model.layers.mixer.decodes_fused()
    if per_layer:
        cache = unstack_layers(cache)

    def advance(carry, key):
        """One cached step: the carry (last tokens, cache, seen, ended) -> (the next carry, the new tokens)."""
        token, cache, seen, ended = carry
        # NNX Variables belong to the trace that created them: rebuild the model from fresh ones here.
        step_model = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
        logits, cache = step_model._step_unstacked(token, cache) if per_layer else step_model.step(token, cache)
        seen = sampling_rule.mark_seen(seen, token)
        token = choose(logits, key, seen)
        if ended is not None:
            token = jnp.where(ended, end[1], token)
            ended = ended | jnp.isin(token, end[0])
        return (token, cache, seen, ended), token

    carry = (first, cache, seen, ended)
    if end is None:
        _, rest = jax.lax.scan(advance, carry, keys[1:])
        generated = jnp.concatenate([first[:, None], rest.T], axis=1)
    else:
        def unfinished(loop):
            step, (_, _, _, ended), _ = loop
            return (step < max_new_tokens) & ~jnp.all(ended)

        def next_step(loop):
            step, carry, generated = loop
            carry, token = advance(carry, keys[step])
            return step + 1, carry, jax.lax.dynamic_update_slice(generated, token[:, None], (0, step))

        generated = jnp.full((batch, max_new_tokens), end[1]).at[:, 0].set(first)
        _, _, generated = jax.lax.while_loop(unfinished, next_step, (1, carry, generated))
    return jnp.concatenate([prompt_ids, generated], axis=1)
