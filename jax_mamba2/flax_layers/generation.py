"""`generate`: autoregressive decoding of a `Mamba2LMHeadModel` as one jitted program (mamba_ssm's `decode`, with
HF transformers' sampling controls and end-of-sequence handling).

The prompt runs through the full-sequence kernels (`prefill`), then each new token through the O(1) cached step.
Without an end-of-sequence id the steps are a `lax.scan` of known length; with one, a `lax.while_loop` that stops
once every row has ended (its condition is read on the host each step: a few microseconds that a loop of known
length does not pay).
"""
import functools
from numbers import Integral
from typing import Any, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_mamba2.checks import as_int, check_axis_length, check_element_count, check_int, check_token_ids_in_range
from jax_mamba2.flax_layers import _checks
from jax_mamba2.flax_layers import sampling as sampling_rule
from jax_mamba2.flax_layers.cache import unstack_layers
from jax_mamba2.flax_layers.lm import Mamba2LMHeadModel


def generate(model, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None, repetition_penalty: float = 1.0,
             eos_token_id=None, pad_token_id: int | None = None, prompt_lengths=None, rng=None, cache_dtype=None):
    """Autoregressive generation: one jitted program, a prefill then a loop of cached O(1) steps.

    The model's weights enter the program as arguments (not constants), and the program is cached per model
    structure, prompt shape, max_new_tokens, cache_dtype and which controls are on (not their values, except
    top_k's, the static size of its `lax.top_k`, and the number of eos ids), so later calls do not retrace. The
    controls act as in HF transformers' `generate`, in its order: repetition_penalty, then (when sampling)
    temperature, top_k, top_p, min_p.

    Args:
      model: the `Mamba2LMHeadModel`.
      prompt_ids: (batch, prompt_len) int, prompt_len >= 1, ids in [0, config.vocab_size). Concrete ids are
        range-checked; traced ones (generate called inside jit) cannot be read and are not: there an id past
        the embedding's rows gives NaN logits and a negative one counts from the end.
      max_new_tokens: number of tokens to generate (>= 1, with prompt_len at most 2**31 - 1: the output's axis): an
        int, NumPy's or a concrete 0-d array's too.
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
      prompt_lengths: None (every row's prompt is prompt_len ids), or (batch,) int in [1, prompt_len]: prompts
        of different lengths, left-padded (as HF's `generate` takes a decoder-only batch; e.g. the
        attention_mask's row sums): row b's prompt is its last prompt_lengths[b] ids, the ids before them are
        ignored (any value int32 holds: they are returned as given). Each row generates what its prompt alone
        would: the padding is a sequence of its own in the prefill (`seq_idx`), which every mixer's conv and
        state restart after.
      rng: a `jax.random.key`, required when temperature > 0.
      cache_dtype: the decode state's floating dtype, both its fields (default: None, as mamba_ssm allocates
        them: conv_state in conv1d's parameter dtype, ssm_state in in_proj's). The state is read and written
        once per token, so from a few dozen rows its bytes, not the weights', bound a token step: bfloat16
        with float32 parameters halves them (and the state's memory), rounding the state to bfloat16 after
        every step as a bfloat16 model's own state is.

    Returns:
      (batch, prompt_len + max_new_tokens) int32: the prompt followed by the generated tokens. Tokens are drawn
      from the first `config.vocab_size` ids (padding rows of the embedding are never produced).

    Raises:
      ValueError: on a non-positive max_new_tokens or one that makes the output longer than 2**31 - 1 ids (or of
        more than 2**60 - 1 elements), prompt ids outside [0, vocab_size), a negative temperature, a top_k outside
        [1, vocab_size], a top_p outside (0, 1], a min_p outside [0, 1], a repetition_penalty <= 0, an eos_token_id
        or pad_token_id outside [0, vocab_size), a pad_token_id without an eos_token_id, prompt_lengths outside
        [1, prompt_len] or of another shape than (batch,) (or ragged lists), padding ids outside int32, or a
        missing rng when sampling.
      TypeError: on prompt ids or lengths that are not integers or not an array or list (None, a number), a
        max_new_tokens that is not an int, a control of the wrong type (the controls must be concrete numbers),
        an rng that is not one key, or a cache_dtype that is not a floating dtype.
    """
    *program_args, max_new_tokens = _prepare(
        "generate", model, prompt_ids, max_new_tokens, whole_output=True, temperature=temperature, top_k=top_k,
        top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, prompt_lengths=prompt_lengths, rng=rng, cache_dtype=cache_dtype)
    return _generate(*program_args, max_new_tokens=max_new_tokens)


def generate_stream(model, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
                    top_p: float | None = None, min_p: float | None = None, repetition_penalty: float = 1.0,
                    eos_token_id=None, pad_token_id: int | None = None, prompt_lengths=None,
                    rng=None, cache_dtype=None) -> Iterator[jax.Array]:
    """`generate` a token at a time, for showing text as it comes (mamba_ssm's and HF's `streamer`).

    The arguments, their checks (made at the call) and the tokens are `generate`'s: with the same rng the same
    tokens (but for the output's size: a stream has no array of all the tokens, so only max_new_tokens must be
    at most 2**31 - 1). Each step is a jitted call of its own, with the decode state donated to it (not
    copied), so every token costs one dispatch from Python more than in `generate`'s single program.

    Returns:
      An iterator over each step's new tokens, (batch,) int32 device arrays: max_new_tokens of them, or fewer
      once every row has ended (with an eos_token_id; rows that ended earlier give pad_token_id).
    """
    return _stream(*_prepare("generate_stream", model, prompt_ids, max_new_tokens, whole_output=False,
                             temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             repetition_penalty=repetition_penalty, eos_token_id=eos_token_id,
                             pad_token_id=pad_token_id, prompt_lengths=prompt_lengths, rng=rng,
                             cache_dtype=cache_dtype))


def _prepare(api: str, model, prompt_ids, max_new_tokens, *, whole_output: bool, temperature, top_k, top_p, min_p,
             repetition_penalty, eos_token_id, pad_token_id, prompt_lengths, rng, cache_dtype):
    """`generate`'s arguments checked and converted: (graphdef, state, prompt_ids, prompt_lengths, rng,
    sampling, end, cache_dtype, max_new_tokens) for `_generate` and `_stream`; cache_dtype (None or a dtype's
    name) and max_new_tokens (a Python int, also where given as a 0-d array) hashable for jit's static
    arguments. whole_output: the caller returns all (batch, prompt_len + max_new_tokens) ids as one array, whose
    size is then checked (a stream yields them a step at a time)."""
    if not isinstance(model, Mamba2LMHeadModel):
        raise TypeError(f"{api}: model must be a Mamba2LMHeadModel, got {type(model).__name__}")
    vocab_size = model.config.vocab_size
    max_new_tokens = check_int(api, "max_new_tokens", max_new_tokens)
    if not hasattr(prompt_ids, "dtype"):  # a nested list of ids
        given = prompt_ids
        try:
            prompt_ids = np.asarray(prompt_ids)
        except ValueError:
            raise ValueError(f"{api}: prompt_ids must be a (batch, prompt_len) array or list of equal-length "
                             "lists") from None
        if prompt_ids.ndim == 0:  # None, a number, a string: no nesting of ids at all (not a wrong shape)
            raise TypeError(f"{api}: prompt_ids must be a (batch, prompt_len) integer array or list of "
                            f"equal-length lists of ints, got {type(given).__name__}")
        if prompt_ids.size == 0:  # NumPy makes an empty list float64: let the shape check name what is wrong
            prompt_ids = prompt_ids.astype(np.int32)
    _checks.check_named_array(api, "prompt_ids", prompt_ids, (("batch", None), ("prompt_len", None)), kind="integer")
    _checks.check_batch_splits(api, "prompt_ids", prompt_ids.shape[0], model.layers.mixer.mesh_axes)
    if prompt_ids.shape[1] < 1:
        raise ValueError(f"{api}: prompt_ids.shape={prompt_ids.shape} must be (batch, prompt_len >= 1)")
    batch, prompt_len = prompt_ids.shape
    if whole_output:  # generate's output, (batch, prompt_len + max_new_tokens) ids, checked before anything runs
        check_axis_length(api, f"max_new_tokens={max_new_tokens} after prompt_len={prompt_len}: "
                          "prompt_len+max_new_tokens", prompt_len + max_new_tokens)
        check_element_count(api, "the output", "(batch, prompt_len + max_new_tokens)",
                            (batch, prompt_len + max_new_tokens))
    else:  # a stream builds no output, and draws each step's key as it comes: a step counts in int32
        check_axis_length(api, "max_new_tokens", max_new_tokens)
    prompt_lengths = _check_prompt_lengths(api, prompt_ids, prompt_lengths)
    if prompt_lengths is None:
        check_token_ids_in_range(api, "prompt_ids", prompt_ids, vocab_size)
    elif not any(isinstance(a, jax.core.Tracer) for a in (prompt_ids, prompt_lengths)):
        # The padding: any id that int32 (the ids' dtype in the program, returned with the tokens) holds.
        in_prompt = np.asarray(_in_prompt(prompt_ids.shape[1], prompt_lengths))
        check_token_ids_in_range(api, "prompt_ids", np.where(in_prompt, prompt_ids, 0), vocab_size)
        ids = np.asarray(prompt_ids)
        if ids.size and (ids.min() < np.iinfo(np.int32).min or ids.max() > np.iinfo(np.int32).max):
            raise ValueError(f"{api}: prompt_ids hold padding ids outside int32 (min {ids.min()}, max "
                             f"{ids.max()}); the padding must be ids int32 holds (they are returned as given)")
    sampling = sampling_rule.make_sampling(api, vocab_size, temperature=temperature, top_k=top_k, top_p=top_p,
                                           min_p=min_p, repetition_penalty=repetition_penalty)
    end = _end_of_sequence(api, vocab_size, eos_token_id, pad_token_id)
    if sampling.sample and rng is None:
        raise ValueError(f"{api}: rng=None must be a jax.random.key when temperature > 0")
    if rng is not None and not _is_key(rng):
        array = isinstance(rng, (jax.Array, np.ndarray))  # (an nnx.Rngs makes a stream of any attribute read)
        raise TypeError(f"{api}: rng must be one jax.random.key (or a legacy uint32[2] PRNGKey), got "
                        f"{type(rng).__name__}" + (f" of shape {rng.shape} and dtype {rng.dtype}" if array else ""))
    _checks.check_float_dtype(api, "cache_dtype", cache_dtype)
    graphdef, state = nnx.split(model)
    rng = jax.random.key(0) if rng is None else rng
    return (graphdef, state, jnp.asarray(prompt_ids, jnp.int32), prompt_lengths, rng, sampling, end,
            None if cache_dtype is None else jnp.dtype(cache_dtype).name, max_new_tokens)


def _is_key(rng) -> bool:
    """A typed key (`jax.random.key`) or a legacy raw uint32[2] key (`jax.random.PRNGKey`), unbatched."""
    if not isinstance(rng, (jax.Array, np.ndarray)):  # e.g. an nnx.Rngs, whose attributes are streams
        return False
    dtype, shape = rng.dtype, rng.shape
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return shape == ()
    return dtype == jnp.uint32 and shape == (2,)


def _check_prompt_lengths(api: str, prompt_ids, prompt_lengths):
    """None, or prompt_lengths as (batch,) int32 after checking its shape and (concrete) its range."""
    if prompt_lengths is None:
        return None
    if not hasattr(prompt_lengths, "dtype"):
        given = prompt_lengths
        try:
            prompt_lengths = np.asarray(prompt_lengths)
        except ValueError:  # a ragged nesting
            raise ValueError(f"{api}: prompt_lengths must be None or a (batch,) integer array or list of ints") \
                from None
        if prompt_lengths.ndim == 0:  # a number or a string, not one length per row
            raise TypeError(f"{api}: prompt_lengths must be None or a (batch,) integer array or list of ints, "
                            f"got {type(given).__name__}")
    batch, prompt_len = prompt_ids.shape
    _checks.check_named_array(api, "prompt_lengths", prompt_lengths, (("batch", batch),), kind="integer")
    if not isinstance(prompt_lengths, jax.core.Tracer):
        values = np.asarray(prompt_lengths)
        if ((values < 1) | (values > prompt_len)).any():
            raise ValueError(f"{api}: prompt_lengths={values.tolist()} must be in [1, prompt_len={prompt_len}]")
    return jnp.asarray(prompt_lengths, jnp.int32)


def _in_prompt(prompt_len: int, prompt_lengths):
    """(batch, prompt_len) bool: which positions of left-padded rows hold their prompt."""
    return jnp.arange(prompt_len)[None, :] >= prompt_len - prompt_lengths[:, None]


def _end_of_sequence(api: str, vocab_size: int, eos_token_id, pad_token_id):
    """None (no end of sequence), or (eos ids (n,) int32, pad id int32 scalar), checked."""
    if eos_token_id is None:
        if pad_token_id is not None:
            raise ValueError(f"{api}: pad_token_id={pad_token_id!r} needs an eos_token_id (it fills the rows "
                             "after their end)")
        return None
    if isinstance(eos_token_id, jax.core.Tracer):
        raise TypeError(f"{api}: eos_token_id must be concrete ids (an int or a sequence of ints), not traced")
    try:
        ids = (eos_token_id,) if isinstance(eos_token_id, Integral) else tuple(np.asarray(eos_token_id).reshape(-1))
    except ValueError:  # a ragged nesting
        raise TypeError(f"{api}: eos_token_id={eos_token_id!r} must be an int or a non-empty sequence of ints") \
            from None
    if any(as_int(i) is None for i in ids):
        raise TypeError(f"{api}: eos_token_id={eos_token_id!r} must be an int or a non-empty sequence of ints")
    if not ids:
        raise ValueError(f"{api}: eos_token_id={eos_token_id!r} must be an int or a non-empty sequence of ints")
    if any(not 0 <= i < vocab_size for i in ids):
        raise ValueError(f"{api}: eos_token_id={eos_token_id!r} must be in [0, vocab_size={vocab_size})")
    if pad_token_id is None:
        pad_token_id = ids[0]
    number = as_int(pad_token_id)
    if number is None:
        raise TypeError(f"{api}: pad_token_id={pad_token_id!r} must be None or an int")
    pad_token_id = number
    if not 0 <= pad_token_id < vocab_size:  # the ended rows feed it to the model's step
        raise ValueError(f"{api}: pad_token_id={pad_token_id} must be in [0, vocab_size={vocab_size})")
    return jnp.asarray(ids, jnp.int32), jnp.int32(pad_token_id)


class _Decoding(NamedTuple):
    """What the decode loop carries from token to token."""
    token: jax.Array  # (batch,) int32: the last tokens chosen
    cache: Any  # the model's decode cache (one per layer for the composed step of unrolled layers)
    seen: jax.Array | None  # (batch, vocab_size) bool: the tokens each row has seen (with a repetition penalty)
    ended: jax.Array | None  # (batch,) bool: the rows that have ended (with an eos id)


def _start(graphdef, state, prompt_ids, prompt_lengths, key, sampling, end, cache_dtype) -> _Decoding:
    """The prefill of the prompts (left-padded with prompt_lengths) and the first new token; the cache in
    cache_dtype unless None."""
    model = nnx.merge(graphdef, state)
    vocab_size = model.config.vocab_size
    batch, prompt_len = prompt_ids.shape
    prompt, seq_idx, seen_ids = prompt_ids, None, prompt_ids
    if prompt_lengths is not None:  # the left padding: sequence 0 of each row, its ids 0 (-1: not seen)
        in_prompt = _in_prompt(prompt_len, prompt_lengths)
        prompt, seq_idx = jnp.where(in_prompt, prompt_ids, 0), in_prompt.astype(jnp.int32)
        seen_ids = jnp.where(in_prompt, prompt_ids, -1)
    seen = (sampling_rule.mark_seen(jnp.zeros((batch, vocab_size), bool), seen_ids)
            if sampling.penalizes_repeats else None)
    # With seq_idx the cache is the prompt's alone (`Mamba2.prefill`: the padding's conv columns zeroed).
    # Each layer's state is rounded to cache_dtype as the layer returns it: no wider stack of them is held.
    hidden, residual, cache = model._scan_layers_with_cache("prefill", prompt, None, seq_idx=seq_idx,
                                                            cache_dtype=cache_dtype)
    token = sampling_rule.next_tokens(model._logits(hidden[:, -1], residual[:, -1])[:, :vocab_size], key, seen,
                                      sampling)
    # The composed step of unrolled layers carries one cache per layer, so that no step stacks the whole
    # state; the fused step updates the stacked SSM state in place.
    if _per_layer_cache(model):
        cache = unstack_layers(cache)
    return _Decoding(token, cache, seen, None if end is None else jnp.isin(token, end[0]))


def _per_layer_cache(model) -> bool:
    return not model.scan_layers and not model.layers.mixer.decodes_fused()


def _advance(graphdef, state, decoding: _Decoding, key, sampling, end) -> _Decoding:
    """One cached step: the next tokens (the pad in rows that have ended)."""
    # NNX Variables belong to the trace that created them: rebuild the model from fresh ones here.
    model = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    token, cache, seen, ended = decoding
    logits, cache = model._step_unstacked(token, cache) if _per_layer_cache(model) else model.step(token, cache)
    seen = sampling_rule.mark_seen(seen, token)
    token = sampling_rule.next_tokens(logits[:, :model.config.vocab_size], key, seen, sampling)
    if ended is not None:
        token = jnp.where(ended, end[1], token)
        ended = ended | jnp.isin(token, end[0])
    return _Decoding(token, cache, seen, ended)


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_dtype", "max_new_tokens"))
def _generate(graphdef, state, prompt_ids, prompt_lengths, rng, sampling, end, cache_dtype, *, max_new_tokens):
    """`generate`'s program: the prefill and first token, then the cached steps in a scan (no eos) or a while
    loop that stops once every row has ended; (batch, prompt_len + max_new_tokens) int32."""
    decoding = _start(graphdef, state, prompt_ids, prompt_lengths, _step_key(rng, 0), sampling, end, cache_dtype)

    def advance(decoding, step):
        decoding = _advance(graphdef, state, decoding, _step_key(rng, step), sampling, end)
        return decoding, decoding.token

    if end is None:
        _, rest = jax.lax.scan(advance, decoding, jnp.arange(1, max_new_tokens, dtype=jnp.int32))
        generated = jnp.concatenate([decoding.token[:, None], rest.T], axis=1)
    else:
        def unfinished(loop):
            step, decoding, _ = loop
            return (step < max_new_tokens) & ~jnp.all(decoding.ended)

        def next_step(loop):
            step, decoding, generated = loop
            decoding, token = advance(decoding, step)
            return step + 1, decoding, jax.lax.dynamic_update_slice(generated, token[:, None], (0, step))

        generated = jnp.full((prompt_ids.shape[0], max_new_tokens), end[1]).at[:, 0].set(decoding.token)
        _, _, generated = jax.lax.while_loop(unfinished, next_step, (1, decoding, generated))
    return jnp.concatenate([prompt_ids, generated], axis=1)


def _step_key(rng, step):
    """The random key of new token `step` (0 for the first): rng folded with the step, so a step's key needs no
    array of every step's (a stream's may be long) and generate and generate_stream draw the same keys."""
    return jax.random.fold_in(rng, step)


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_dtype"))
def _start_program(graphdef, state, prompt_ids, prompt_lengths, rng, sampling, end, cache_dtype) -> _Decoding:
    """`_start` with the first step's key."""
    return _start(graphdef, state, prompt_ids, prompt_lengths, _step_key(rng, 0), sampling, end, cache_dtype)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("carried",))
def _advance_program(graphdef, state, token, carried, rng, step, sampling, end) -> _Decoding:
    """`_advance` of new token `step` (an int32 scalar, so one program serves every step) with what the step
    carries besides the tokens (cache, seen, ended) donated: the cache (the SSM state stack updated in place) is
    not copied per token, and the tokens already yielded stay readable."""
    return _advance(graphdef, state, _Decoding(token, *carried), _step_key(rng, step), sampling, end)


def _stream(graphdef, state, prompt_ids, prompt_lengths, rng, sampling, end, cache_dtype, max_new_tokens):
    """`generate_stream`'s generator: the jitted prefill, then one jitted step per token, each yielding the
    (batch,) new tokens; it stops after max_new_tokens or once every row has ended."""
    decoding = _start_program(graphdef, state, prompt_ids, prompt_lengths, rng, sampling, end, cache_dtype)
    yield decoding.token
    for step in range(1, max_new_tokens):
        if end is not None and bool(jnp.all(decoding.ended)):
            return
        decoding = _advance_program(graphdef, state, decoding.token, decoding[1:], rng, np.int32(step), sampling,
                                    end)
        yield decoding.token
