"""jax-mamba2: Mamba-2 for JAX with the SSD scan as NVIDIA cuTile kernels.

Public API:
  ssd, ssd_step            the Mamba-2 SSD op (mamba_ssm `mamba_chunk_scan_combined` semantics) and its
                           single-token decode step; ssd(backend="scan") is the float64-capable lax.scan oracle
                           (`jax_mamba2.reference` holds the unchecked pure-JAX paths themselves).
  causal_conv1d_silu       the mixer's causal depthwise conv1d + SiLU (causal_conv1d's `causal_conv1d_fn`).
  causal_conv1d_silu_split the same on a channel window of a wider input (in_proj's output), in pieces.
  rms_norm, add_rms_norm   the gated, grouped RMSNorm and the residual add + RMSNorm (cuTile kernels on a GPU).
  chunked_cross_entropy    the LM head fused with a chunked cross-entropy (Mamba2LMHeadModel.loss).
  norm_project, mixer_step the fused ops of a decode step: (add +) norm + projection, and the mixer's conv step
                           + SSD state update; four or five launches per layer on a GPU.
  write_group_windows      writes the B and C conv windows that mixer_step(group_windows_apart=True) returns.
  available_backends       names of the SSD backends that can run in this process.
  backend_status           for every known backend: whether it can run here and, if not, why.
  autotune                 tune the cuTile kernel configs of a program's SSD calls ahead of time.
  Mamba2, Mamba2LMHeadModel, Mamba2Config, generate, generate_stream, load_pretrained, save_pretrained,
  shard_model              the Flax NNX layers and language model (jax_mamba2.flax_layers has the rest).
  __version__              the installed version (the source tree's, when it is not installed).
"""
from jax_mamba2._version import __version__
from jax_mamba2.conv1d import causal_conv1d_silu, causal_conv1d_silu_split
from jax_mamba2.cross_entropy import chunked_cross_entropy
from jax_mamba2.decode import mixer_step, norm_project, write_group_windows
from jax_mamba2.autotuning import autotune
from jax_mamba2.backends import available_backends, backend_status
from jax_mamba2.norm import add_rms_norm, rms_norm
from jax_mamba2.op import ssd, ssd_step
from jax_mamba2.flax_layers import (Mamba2, Mamba2Config, Mamba2LMHeadModel, generate, generate_stream,
                                    load_pretrained, save_pretrained, shard_model)

__all__ = [
    "__version__", "ssd", "ssd_step", "causal_conv1d_silu", "causal_conv1d_silu_split",
    "rms_norm", "add_rms_norm", "norm_project", "mixer_step", "write_group_windows",
    "available_backends", "backend_status", "autotune", "Mamba2", "Mamba2Config", "Mamba2LMHeadModel", "generate",
    "generate_stream", "load_pretrained", "save_pretrained", "shard_model", "chunked_cross_entropy",
]
