"""Fixtures of the Flax layer tests: float64 mode and a tiny LM configuration."""
import jax
import pytest

from jax_mamba2.flax_layers import Mamba2Config

# Tiny mixer options: nheads = 2 * 32 / 8 = 8 heads of headdim 8, 2 groups, short chunks.
TINY_SSM_CFG = dict(d_state=8, headdim=8, ngroups=2, chunk_size=8)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture
def tiny_config():
    return Mamba2Config(d_model=32, n_layer=3, vocab_size=61, ssm_cfg=TINY_SSM_CFG, pad_vocab_size_multiple=8)
