"""jax-mamba2: Mamba-2 for JAX with the SSD scan as NVIDIA cuTile kernels.

Public API:
  ssd, ssd_step            the Mamba-2 SSD op (mamba_ssm `mamba_chunk_scan_combined` semantics) and its
                           single-token decode step.
  ssd_scan, ssd_chunked    pure-JAX reference paths (lax.scan oracle, chunked algorithm).
  rms_norm, add_rms_norm   the gated, grouped RMSNorm and the residual add + RMSNorm (cuTile kernels on a GPU).
  available_backends       names of the registered SSD backends.
  Mamba2, Mamba2LMHeadModel, Mamba2Config, generate, load_pretrained, save_pretrained, shard_model,
  chunked_cross_entropy    the Flax NNX layers, language model and its loss (jax_mamba2.flax_layers has the rest).
"""
from jax_mamba2.norm import add_rms_norm, rms_norm
from jax_mamba2.op import available_backends, ssd, ssd_step
from jax_mamba2.reference import ssd_chunked, ssd_scan
from jax_mamba2.flax_layers import (Mamba2, Mamba2Config, Mamba2LMHeadModel, chunked_cross_entropy, generate,
                                    load_pretrained, save_pretrained, shard_model)

__all__ = [
    "ssd", "ssd_step", "ssd_scan", "ssd_chunked", "available_backends", "Mamba2", "Mamba2Config",
    "Mamba2LMHeadModel", "generate", "load_pretrained", "save_pretrained", "shard_model", "rms_norm",
    "add_rms_norm", "chunked_cross_entropy",
]
