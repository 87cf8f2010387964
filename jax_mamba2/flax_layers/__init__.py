"""Flax NNX Mamba-2: the mixer layer, the language model, decoding, checkpoints and sharding.

Public API:
  Mamba2                      the mixer (mamba_ssm `Mamba2`): __call__, prefill, step, init_cache.
  Mamba2Cache                 decode state pytree (conv_state, ssm_state).
  Mamba2Block, Mamba2LMHeadModel, generate, generate_stream
                              the language model and jitted decoding (prefill, then cached steps; greedy or
                              sampled with HF's controls: repetition penalty, temperature, top-k/p, min-p, eos),
                              in one program or a token at a time.
  Mamba2Config, mamba2_130m, mamba2_370m, mamba2_780m, mamba2_1_3b, mamba2_2_7b
                              configuration (mamba_ssm config.json fields) and published presets.
  load_pretrained, save_pretrained
                              mamba_ssm / HF transformers checkpoint directories.
  shard_model                 run on a (data, model) mesh: batch over "data", heads over "model".
  RMSNorm                     (gated, grouped) RMSNorm, and the fused residual add + RMSNorm.
  cast_params                 a model's parameters converted to another dtype once (e.g. bf16 for decoding).
"""
from jax_mamba2.flax_layers.cache import Mamba2Cache
from jax_mamba2.flax_layers.checkpoint import load_pretrained, save_pretrained
from jax_mamba2.flax_layers.config import (Mamba2Config, mamba2_1_3b, mamba2_2_7b, mamba2_130m, mamba2_370m,
                                           mamba2_780m)
from jax_mamba2.flax_layers.generation import generate, generate_stream
from jax_mamba2.flax_layers.lm import Mamba2Block, Mamba2LMHeadModel
from jax_mamba2.flax_layers.mamba2 import Mamba2
from jax_mamba2.flax_layers.norm import RMSNorm
from jax_mamba2.flax_layers.precision import cast_params
from jax_mamba2.flax_layers.sharding import shard_model

__all__ = [
    "Mamba2", "Mamba2Cache", "Mamba2Block", "Mamba2LMHeadModel", "generate", "generate_stream", "Mamba2Config",
    "mamba2_130m", "mamba2_370m", "mamba2_780m", "mamba2_1_3b", "mamba2_2_7b", "load_pretrained", "save_pretrained",
    "shard_model", "RMSNorm", "cast_params",
]
