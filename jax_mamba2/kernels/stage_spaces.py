"""Every plan stage's autotune space and default configuration, by the stage names the forward and backward
plans key their `configs` by (forward.FORWARD_STAGES, backward.BACKWARD_STAGES): what the tuner searches
(bridge/tuning.py) and what `export --configs all` compiles.

STAGE_SPACES[stage] = (configs(dims, arch) -> list of configs, default_config(dims) -> config).
"""
from typing import Any, Callable, NamedTuple

from jax_mamba2.kernels import (
    chunk_cumsum, chunk_cumsum_bwd, chunk_scan, chunk_scan_bwd_dc, chunk_scan_bwd_dx, chunk_state, chunk_state_bwd,
    fused_scan, param_grads_bwd)
from jax_mamba2.kernels._common import SSDDims
from jax_mamba2.kernels.backward import BACKWARD_STAGES
from jax_mamba2.kernels.forward import FORWARD_STAGES


class StageSpace(NamedTuple):
    configs: Callable[[SSDDims, str], list]
    default_config: Callable[[SSDDims], Any]


_FUSED = StageSpace(fused_scan.fused_scan_fwd_configs, fused_scan.fused_scan_fwd_default_config)

STAGE_SPACES = {
    "chunk_cumsum": StageSpace(chunk_cumsum.chunk_cumsum_fwd_configs, chunk_cumsum.chunk_cumsum_fwd_default_config),
    "chunk_state": StageSpace(chunk_state.chunk_state_fwd_configs, chunk_state.chunk_state_fwd_default_config),
    "chunk_scan": StageSpace(chunk_scan.chunk_scan_fwd_configs, chunk_scan.chunk_scan_fwd_default_config),
    # The segmented layout runs the fused kernel on segments, after segment_states' state-only walk of pieces.
    "fused_scan": _FUSED, "segmented_scan": _FUSED,
    "segment_states": StageSpace(fused_scan.segment_states_configs, fused_scan.segment_states_default_config),
    "chunk_scan_bwd_dc": StageSpace(chunk_scan_bwd_dc.chunk_scan_bwd_dc_configs,
                                    chunk_scan_bwd_dc.chunk_scan_bwd_dc_default_config),
    "chunk_state_bwd": StageSpace(chunk_state_bwd.chunk_state_bwd_configs,
                                  chunk_state_bwd.chunk_state_bwd_default_config),
    "chunk_scan_bwd_dx": StageSpace(chunk_scan_bwd_dx.chunk_scan_bwd_dx_configs,
                                    chunk_scan_bwd_dx.chunk_scan_bwd_dx_default_config),
    "chunk_cumsum_bwd": StageSpace(chunk_cumsum_bwd.chunk_cumsum_bwd_configs,
                                   chunk_cumsum_bwd.chunk_cumsum_bwd_default_config),
    "param_grads_bwd": StageSpace(param_grads_bwd.param_grads_bwd_configs,
                                  param_grads_bwd.param_grads_bwd_default_config),
}
assert set(STAGE_SPACES) == set(FORWARD_STAGES) | set(BACKWARD_STAGES)
