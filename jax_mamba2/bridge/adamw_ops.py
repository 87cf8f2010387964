"""AdamW's update on the cuTile kernel (kernels/adamw.py), for any plan executor.

Adds what a raw kernel call lacks: a vmap rule (the update is elementwise, so a mapped axis folds into the flat
arrays; items with their own step scalars run one launch each) and outputs that keep shard_map's varying axes.
`jax_mamba2.adamw` calls `KERNELS[backend]` per parameter array, on flat (n,) views and the step's (HYPER_SIZE,)
float32 scalars; the parameter and the moments are written in place (donated, they are updated where they lie).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jax_mamba2.bridge import _compat, callback, ffi
from jax_mamba2.bridge.batching import fold, map_items, unfold
from jax_mamba2.bridge.problem import gpu_unavailable_reason
from jax_mamba2.kernels import adamw as kernels
from jax_mamba2.kernels._common import KERNEL_DTYPES
from jax_mamba2.kernels.adamw import AdamWConfig, AdamWDims

RunPlan = Callable[..., dict]
# The kernel's tile choice for a problem (the default: AdamWConfig()).
ChooseConfig = Callable[[AdamWDims], AdamWConfig]


def adamw_dims(param, grad, mu, nu, *, decay: bool) -> AdamWDims:
    """The kernel's problem for one (flat) parameter array, its gradient and moments."""
    return AdamWDims(size=param.shape[0], param_dtype=jnp.dtype(param.dtype).name,
                     grad_dtype=jnp.dtype(grad.dtype).name, mu_dtype=jnp.dtype(mu.dtype).name,
                     nu_dtype=jnp.dtype(nu.dtype).name, decay=bool(decay))


def unsupported_reason(dims: AdamWDims) -> Optional[str]:
    """Why the kernel cannot run this update here (None when it can)."""
    for name in ("param", "grad", "mu", "nu"):
        dtype = getattr(dims, f"{name}_dtype")
        if dtype not in KERNEL_DTYPES:
            return f"{name} is {dtype}; the kernel takes bfloat16, float16 or float32: use backend='xla' or cast"
    return gpu_unavailable_reason()


def default_config(dims: AdamWDims) -> AdamWConfig:
    del dims
    return AdamWConfig()


def _update_once(run_plan: RunPlan, config: ChooseConfig, dims: AdamWDims, param, grad, mu, nu, hyper):
    out = run_plan(kernels.adamw_plan(dims, config(dims)), dict(param=param, grad=grad, mu=mu, nu=nu, hyper=hyper))
    return _compat.match_varying_axes(tuple(out[name] for name in kernels.ADAMW_OUTPUTS),
                                      (param, grad, mu, nu, hyper))


@functools.cache
def _batchable(run_plan: RunPlan, config: ChooseConfig, dims: AdamWDims):
    @jax.custom_batching.custom_vmap
    def update(param, grad, mu, nu, hyper):
        return _update_once(run_plan, config, dims, param, grad, mu, nu, hyper)

    @update.def_vmap
    def update_vmap(axis_size, in_batched, param, grad, mu, nu, hyper):
        if in_batched[-1]:  # each item's own step scalars: one launch per item
            outputs = map_items(update, (param, grad, mu, nu, hyper), in_batched, axis_size)
        else:  # elementwise: the items are one longer array
            folded = dims._replace(size=axis_size * dims.size)
            arrays = (fold(a, b, axis_size) for a, b in zip((param, grad, mu, nu), in_batched))
            outputs = tuple(unfold(o, axis_size) for o in _batchable(run_plan, config, folded)(*arrays, hyper))
        return outputs, (True,) * len(outputs)

    return update


@dataclasses.dataclass(frozen=True)
class AdamWKernels:
    """The kernel path of the AdamW update for one plan executor (`run_plan`) and tile choice (`config`).

    update(dims, param, grad, mu, nu, hyper) -> (param', mu', nu'): flat (dims.size,) arrays in the dims' dtypes,
    hyper the (HYPER_SIZE,) float32 step scalars (kernels.adamw.HYPER_FIELDS).
    """

    run_plan: RunPlan
    config: ChooseConfig = default_config

    def update(self, dims: AdamWDims, param, grad, mu, nu, hyper):
        return _batchable(self.run_plan, self.config, dims)(param, grad, mu, nu, hyper)


def make_kernels(run_plan: RunPlan, config: ChooseConfig = default_config) -> AdamWKernels:
    """The update's kernel path with every plan run by `run_plan` (ffi.run_plan, callback.run_plan, ...) in the
    tile `config(dims)` chooses. Keep one `config` object per choice: the traced kernels are cached per
    (run_plan, config, dims)."""
    return AdamWKernels(run_plan, config)


KERNELS = {"cutile": make_kernels(ffi.run_plan), "cutile_callback": make_kernels(callback.run_plan)}
