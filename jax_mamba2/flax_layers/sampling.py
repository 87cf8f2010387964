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

import jax
import jax.numpy as jnp
import numpy as np

from jax_mamba2.checks import as_int, is_real_scalar


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values"], meta_fields=["top_k"])
@dataclasses.dataclass(frozen=True)
class Sampling:
    """The next-token rule of one `generate` call (see `make_sampling` for the checked constructor).

    Attributes:
      top_k: None, or how many of the most likely tokens stay candidates, with those tied with the k-th (sampling
        only; static: the size of `lax.top_k`).
      values: the float32 scalars of the steps that run, by name: "temperature" (sampling: without it the rule is
        greedy), "top_p", "min_p" (sampling), "repetition_penalty" (either mode). A step whose name is absent
        does not run.
    """
    top_k: int | None
    values: dict

    @property
    def sample(self) -> bool:
        """False for greedy decoding (argmax), True to draw from the processed distribution."""
        return "temperature" in self.values

    @property
    def penalizes_repeats(self) -> bool:
        return "repetition_penalty" in self.values


def _concrete_float(api: str, name: str, value) -> float:
    """A Python, NumPy or concrete JAX real scalar as a float (which controls run is decided before tracing)."""
    if not is_real_scalar(value):
        raise TypeError(f"{api}: {name}={value!r} must be a float (a concrete number)")
    return float(value)


def _check_fraction(api: str, name: str, value, *, open_low: bool) -> float:
    value = _concrete_float(api, name, value)
    low_ok = value > 0 if open_low else value >= 0
    if math.isnan(value) or not low_ok or value > 1:
        raise ValueError(f"{api}: {name}={value!r} must be in {'(0' if open_low else '[0'}, 1]")
    return value


def make_sampling(api: str, vocab_size: int, *, temperature=0.0, top_k=None, top_p=None, min_p=None,
                  repetition_penalty=1.0) -> Sampling:
    """The checked `Sampling` of `generate`'s arguments (their meanings are documented there); errors name `api`.

    top_p = 1 turns top-p off (as HF does: all the mass), so that float rounding of the cumulative sum cannot drop
    the least likely tokens.

    Raises:
      ValueError: temperature < 0, NaN or outside float32's normal numbers (other than 0), top_k outside
        [1, vocab_size], top_p outside (0, 1], min_p outside [0, 1], repetition_penalty <= 0, NaN or outside
        float32's normal numbers.
      TypeError: any of them not a concrete number (top_k not an int).
    """
    temperature = _concrete_float(api, "temperature", temperature)
    repetition_penalty = _concrete_float(api, "repetition_penalty", repetition_penalty)
    # Python floats: a float32 bound would cast the value to float32 first (an overflow warning past its range).
    tiny, largest = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    if not 0 <= temperature <= largest:  # past float32's largest it would become inf
        raise ValueError(f"{api}: temperature={temperature} must be >= 0 and at most {largest:.3g}, float32's "
                         "largest number")
    if 0 < temperature < tiny:  # would round to 0 (or a subnormal) in float32
        raise ValueError(f"{api}: temperature={temperature} must be 0 (greedy) or at least {tiny:.3g}, float32's "
                         "smallest normal number")
    if not tiny <= repetition_penalty <= largest:  # else it rounds to 0, a subnormal or inf in float32
        raise ValueError(f"{api}: repetition_penalty={repetition_penalty} must be > 0 and within float32's normal "
                         f"numbers, [{tiny:.3g}, {largest:.3g}]")
    if top_k is not None:
        number = as_int(top_k)
        if number is None:
            raise TypeError(f"{api}: top_k={top_k!r} must be None or an int")
        top_k = number
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"{api}: top_k={top_k} must be in [1, vocab_size={vocab_size}]")
    values = {}
    if top_p is not None and _check_fraction(api, "top_p", top_p, open_low=True) < 1:
        values["top_p"] = float(top_p)
    if min_p is not None:
        values["min_p"] = _check_fraction(api, "min_p", min_p, open_low=False)
    sample = temperature > 0
    if sample:
        values["temperature"] = float(temperature)
    else:  # greedy: the distribution's filters cannot change the argmax
        values = {}
    if repetition_penalty != 1:
        values["repetition_penalty"] = float(repetition_penalty)
    return Sampling(int(top_k) if sample and top_k is not None else None,
                    {name: jnp.float32(value) for name, value in values.items()})


def penalize_repeats(logits, seen, penalty):
    """HF's `RepetitionPenaltyLogitsProcessor`: the logits of tokens already seen (prompt or generated) divided by
    `penalty` where positive, multiplied by it where negative; a result past float32's range saturates at its
    largest finite value (an inf logit would make the row's shift by its largest NaN).

    logits (batch, vocab) float32, seen (batch, vocab) bool, penalty a float32 scalar -> (batch, vocab) float32.
    """
    largest = jnp.finfo(logits.dtype).max
    penalized = jnp.clip(jnp.where(logits < 0, logits * penalty, logits / penalty), -largest, largest)
    return jnp.where(seen, penalized, logits)


def candidate_logits(logits, sampling: Sampling):
    """The logits less the row's largest, scaled by the temperature (HF's distribution: the shift changes no
    probability), with every token that top-k, top-p or min-p excludes at -inf.

    Top-k keeps, as HF's, every token whose logit is at least the k-th largest (ties with it included). With
    top_p the candidates are sorted, most likely first, and come with their ids; otherwise they are in
    vocabulary order and ids is None.

    logits (batch, vocab) float32 -> (candidate logits (batch, vocab) float32, ids (batch, vocab) int32 or None).
    """
    values = sampling.values
    # Shifted by the row's largest first, which no rule below sees (softmax, top-k, top-p and min-p are shift
    # invariant), so that a small temperature cannot overflow the largest logits to tied infinities.
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / values["temperature"]
    if sampling.top_k is not None:
        kth_largest = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    ids = None
    if "top_p" in values:  # keep the most likely tokens until their probabilities reach top_p (the first always)
        logits, ids = jax.lax.top_k(logits, logits.shape[-1])  # sorted, most likely first
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
    if tokens.ndim == 1:  # (not reshape(batch, -1): with no rows the size -1 stands for could not be inferred)
        tokens = tokens[:, None]
    in_vocab = (tokens >= 0) & (tokens < seen.shape[-1])
    return seen.at[jnp.arange(tokens.shape[0])[:, None], jnp.where(in_vocab, tokens, seen.shape[-1])].set(
        True, mode="drop")
