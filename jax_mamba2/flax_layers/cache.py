"""`Mamba2Cache`: the decode state of one `Mamba2` mixer (or of all layers, stacked on a leading axis).

The cache is a plain pytree passed to and returned by `Mamba2.prefill` / `Mamba2.step` (and the LM's
methods); nothing is mutated in place, so it can be donated to jit and carried through `lax.scan`.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Mamba2Cache(NamedTuple):
    """Decode state. For a whole LM every field has an extra leading (n_layer,) axis.

    Attributes:
      conv_state: (batch, conv_dim, d_conv): the last d_conv pre-convolution xBC columns, oldest first
        (left-zero-padded after a prompt shorter than d_conv); conv_dim = d_ssm + 2 * ngroups * d_state.
      ssm_state: (batch, nheads, headdim, d_state): the SSM state h after the last token.
    """

    conv_state: jax.Array  # (batch, conv_dim, d_conv)
    ssm_state: jax.Array  # (batch, nheads, headdim, d_state)


def unstack_layers(cache: Mamba2Cache) -> list[Mamba2Cache]:
    """The per-layer caches of an LM's stacked cache (leading (n_layer,) axis)."""
    return [Mamba2Cache(*fields) for fields in zip(*(list(a) for a in cache))]


def stack_layers(caches: list[Mamba2Cache]) -> Mamba2Cache:
    """The LM's stacked cache (leading (n_layer,) axis) of per-layer caches."""
    return jax.tree.map(lambda *layers: jnp.stack(layers), *caches)
