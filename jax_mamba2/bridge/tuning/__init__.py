"""Kernel configs per problem for the SSD forward and backward, on this GPU.

`forward_configs(dims)` gives the forward's layout and the config of each of its stages,
`backward_configs(dims, deterministic)` the config of every backward stage; `clear_memory()` forgets what
this process chose. One module per job:

  cache_keys     which cache file (GPU, versions, kernel source) and which entry (stage, problem fields)
  cache_file     the JSON cache file, locked for writers and replaced atomically
  timing         timing a stage's configs on the GPU (torch / CuPy arrays, cuda.tile.tune)
  precompile     compiling a stage's configs concurrently before they are timed
  lookup         per stage: memory -> cache file -> tune now -> default
  layout_choice  per plan: the forward's layout, the backward's stages shared with the forward
  ahead_of_time  every plan of a program, tuned before it runs (`jax_mamba2.autotune`)
"""
from jax_mamba2.bridge.tuning.layout_choice import backward_configs, forward_configs
from jax_mamba2.bridge.tuning.lookup import clear_memory

__all__ = ["forward_configs", "backward_configs", "clear_memory"]
