"""How `generate` picks each next token from the LM's logits: greedily or by sampling, after the logits processing
of HF transformers' `generate` (and mamba_ssm's `decode`), in its order: repetition penalty, temperature, top-k,
top-p (nucleus), min-p.

`Sampling` is a pytree whose structure holds what changes the program (greedy or sampling, which steps run,
top_k's static size) and whose leaves are the values that do not (temperature, top_p, min_p, the penalty: float32
scalars), so every value of those reuses one compiled `generate`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from numbers import Integral, Real

import jax
import jax.numpy as jnp


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values"], meta_fields=["sample", "top_k"])
@dataclasses.dataclass(frozen=True)
class Sampling:
    """The next-token rule of one `generate` call (see `make_sampling` for the checked constructor).

    Attributes:
      sample: False for greedy decoding (argmax), True to draw from the processed distribution.
      top_k: None, or how many of the most likely tokens stay candidates (sampling only; static: the size of
        `lax.top_k`).
      values: the float32 scalars of the steps that run, by name: "temperature" (sampling), "top_p", "min_p"
        (sampling), "repetition_penalty" (either mode). A step whose name is absent does not run.
    """
    sample: bool
    top_k: int | None
    values: dict

    @property
    def penalizes_repeats(self) -> bool:
        return "repetition_penalty" in self.values


def _check_fraction(api: str, name: str, value, *, open_low: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{api}: {name}={value!r} must be a float")
    low_ok = value > 0 if open_low else value >= 0
    if math.isnan(value) or not low_ok or value > 1:
        raise ValueError(f"{api}: {name}={value!r} must be in {'(0' if open_low else '[0'}, 1]")
    return float(value)


def make_sampling(api: str, vocab_size: int, *, temperature=0.0, top_k=None, top_p=None, min_p=None,
                  repetition_penalty=1.0) -> Sampling:
    """The checked `Sampling` of `generate`'s arguments (their meanings are documented there); errors name `api`.

    Raises:
      ValueError: temperature < 0 or NaN, top_k outside [1, vocab_size], top_p outside (0, 1], min_p outside
        [0, 1], repetition_penalty <= 0 or NaN.
      TypeError: any of them not a number (top_k not an int).
    """
    for name, value in (("temperature", temperature), ("repetition_penalty", repetition_penalty)):
        if isinstance(value, bool) or not isinstance(value, Real):
            raise TypeError(f"{api}: {name}={value!r} must be a float")
    if not temperature >= 0:
        raise ValueError(f"{api}: temperature={temperature} must be >= 0")
    if not repetition_penalty > 0:
        raise ValueError(f"{api}: repetition_penalty={repetition_penalty} must be > 0")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, Integral):
            raise TypeError(f"{api}: top_k={top_k!r} must be None or an int")
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"{api}: top_k={top_k} must be in [1, vocab_size={vocab_size}]")
    values = {}
    if top_p is not None:
        values["top_p"] = _check_fraction(api, "top_p", top_p, open_low=True)
    if min_p is not None:
        values["min_p"] = _check_fraction(api, "min_p", min_p, open_low=False)
    sample = temperature > 0
    if sample:
        values["temperature"] = float(temperature)
    else:  # greedy: the distribution's filters cannot change the argmax
        values = {}
    if repetition_penalty != 1:
        values["repetition_penalty"] = float(repetition_penalty)
    return Sampling(sample, int(top_k) if sample and top_k is not None else None,
                    {name: jnp.float32(value) for name, value in values.items()})


def penalize_repeats(logits, seen, penalty):
    """HF's `RepetitionPenaltyLogitsProcessor`: the logits of tokens already seen (prompt or generated) divided by
    `penalty` where positive, multiplied by it where negative.

    logits (batch, vocab) float32, seen (batch, vocab) bool, penalty a float32 scalar -> (batch, vocab) float32.
    """
    return jnp.where(seen, jnp.where(logits < 0, logits * penalty, logits / penalty), logits)


def candidate_logits(logits, sampling: Sampling):
    """The logits scaled by the temperature, with every token that top-k, top-p or min-p excludes at -inf.

    With top_k or top_p the candidates are the most likely tokens in descending order (`lax.top_k`: all of the
    vocabulary for top_p alone) and come with their ids; otherwise every token, in vocabulary order, and ids None.

    logits (batch, vocab) float32 -> (candidate logits (batch, k) float32, ids (batch, k) int32 or None).
    """
    values = sampling.values
    logits = logits / values["temperature"]
    ids = None
    if sampling.top_k is not None or "top_p" in values:
        logits, ids = jax.lax.top_k(logits, sampling.top_k or logits.shape[-1])
    if "top_p" in values:  # keep the most likely tokens until their probabilities reach top_p (the first always)
        probs = jax.nn.softmax(logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        logits = jnp.where(mass_before < values["top_p"], logits, -jnp.inf)
    if "min_p" in values:  # probability >= min_p times the largest one's
        floor = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(values["min_p"])
        logits = jnp.where(logits >= floor, logits, -jnp.inf)
    return logits, ids


def next_tokens(logits, key, seen, sampling: Sampling):
    """One token per row.

    Args:
      logits: (batch, vocab) of the vocabulary's tokens (the embedding's padding rows sliced off).
      key: a `jax.random.key` (unused when greedy).
      seen: (batch, vocab) bool, the tokens each row has seen (with a repetition penalty; else None).
      sampling: the rule.

    Returns:
      (batch,) int32 ids.
    """
    logits = logits.astype(jnp.float32)
    if sampling.penalizes_repeats:
        logits = penalize_repeats(logits, seen, sampling.values["repetition_penalty"])
    if not sampling.sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits, ids = candidate_logits(logits, sampling)
    choice = jax.random.categorical(key, logits, axis=-1)
    if ids is not None:
        choice = jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]
    return choice.astype(jnp.int32)


def mark_seen(seen, tokens):
    """seen (batch, vocab) bool with tokens (batch, n) or (batch,) int marked, ids outside [0, vocab) left out
    (None stays None)."""
    if seen is None:
        return None
    tokens = tokens.reshape(tokens.shape[0], -1)
    in_vocab = (tokens >= 0) & (tokens < seen.shape[-1])
    return seen.at[jnp.arange(tokens.shape[0])[:, None], jnp.where(in_vocab, tokens, seen.shape[-1])].set(
        True, mode="drop")
