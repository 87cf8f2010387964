"""The LM loss's softmax on the cuTile kernels (kernels/cross_entropy.py, cross_entropy_bwd.py), for any plan
executor.

Adds what raw kernel calls lack: a vmap rule (every array is per row, so the mapped axis folds into the
kernels' rows) and outputs that keep shard_map's varying axes. `jax_mamba2.cross_entropy` calls
`KERNELS[backend]` per chunk inside its custom VJP, on the chunk's logits as the head product stored them
((rows, padded_vocab) in the logits dtype) and int32 labels; the head matmuls and the weight gradient stay
in XLA.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jax_mamba2.bridge import _compat, callback, ffi
from jax_mamba2.bridge.problem import gpu_unavailable_reason
from jax_mamba2.kernels import cross_entropy as fwd_kernels
from jax_mamba2.kernels import cross_entropy_bwd as bwd_kernels
from jax_mamba2.kernels._common import KERNEL_DTYPES
from jax_mamba2.kernels.cross_entropy import CrossEntropyConfig, CrossEntropyDims, cross_entropy_default_config

RunPlan = Callable[..., dict]
# The kernels' tile and hint choice for a problem (the default: cross_entropy_default_config).
ChooseConfig = Callable[[CrossEntropyDims], CrossEntropyConfig]

_INT32 = (-(1 << 31), (1 << 31) - 1)


def loss_dims(logits, *, vocab_size: int, ignore_index: int, grad_dtype) -> CrossEntropyDims:
    """The kernels' problem for a chunk's (rows, padded_vocab) logits and the loss's options."""
    return CrossEntropyDims(rows=logits.shape[0], padded_vocab=logits.shape[1], vocab_size=int(vocab_size),
                            ignore_index=int(ignore_index), dtype=jnp.dtype(logits.dtype).name,
                            grad_dtype=jnp.dtype(grad_dtype).name)


def unsupported_reason(dims: CrossEntropyDims) -> Optional[str]:
    """Why the kernels cannot run this loss here (None when they can)."""
    for name, dtype in (("logits_dtype", dims.dtype), ("dtype", dims.grad_dtype)):
        if dtype not in KERNEL_DTYPES:
            return (f"{name} is {dtype}; the kernels take bfloat16, float16 or float32 (and compute in "
                    f"float32): use backend='xla' or cast")
    if not _INT32[0] <= dims.ignore_index <= _INT32[1]:
        return f"ignore_index={dims.ignore_index} does not fit the kernels' int32 labels"
    return gpu_unavailable_reason()


def _fold(arr, batched: bool, axis_size: int):
    """(axis_size, rows, ...) or an unbatched (rows, ...) array -> (axis_size * rows, ...)."""
    if not batched:
        arr = jnp.broadcast_to(arr[None], (axis_size, *arr.shape))
    return arr.reshape((axis_size * arr.shape[1], *arr.shape[2:]))


def _folded_call(once: Callable, dims: CrossEntropyDims, axis_size: int, in_batched, *arrays):
    """once(dims, *arrays) with the mapped axis of every array folded into the rows, its outputs unfolded."""
    folded = dims._replace(rows=axis_size * dims.rows)
    outputs = once(folded, *(_fold(a, b, axis_size) for a, b in zip(arrays, in_batched)))
    unfolded = tuple(o.reshape((axis_size, dims.rows, *o.shape[1:])) for o in outputs)
    return unfolded, tuple(True for _ in unfolded)


def _forward_once(run_plan: RunPlan, config: ChooseConfig, dims: CrossEntropyDims, logits, labels):
    out = run_plan(fwd_kernels.cross_entropy_fwd_plan(dims, config(dims)), dict(logits=logits, labels=labels))
    return _compat.match_varying_axes((out["lse"], out["loss"]), (logits, labels))


def _backward_once(run_plan: RunPlan, config: ChooseConfig, dims: CrossEntropyDims, logits, labels, lse, scale):
    out = run_plan(bwd_kernels.cross_entropy_bwd_plan(dims, config(dims)),
                   dict(logits=logits, labels=labels, lse=lse, scale=scale))
    return _compat.match_varying_axes((out["dlogits"],), (logits, labels, lse, scale))


@functools.cache
def _batchable(once: Callable, run_plan: RunPlan, config: ChooseConfig, dims: CrossEntropyDims):
    @jax.custom_batching.custom_vmap
    def call(*arrays):
        return once(run_plan, config, dims, *arrays)

    @call.def_vmap
    def call_vmap(axis_size, in_batched, *arrays):
        return _folded_call(functools.partial(once, run_plan, config), dims, axis_size, in_batched, *arrays)

    return call


@dataclasses.dataclass(frozen=True)
class LossKernels:
    """The kernel path of the loss's softmax for one plan executor (`run_plan`) and tile choice (`config`);
    frozen, so that the loss can keep it in its static (hashed) options.

    forward(dims, logits, labels) -> (lse, loss), both (rows,) f32: the row's logsumexp over the first
      vocab_size columns and its masked loss (0 ignored, NaN for a counted label out of range);
    backward(dims, logits, labels, lse, scale) -> dlogits (rows, padded_vocab) in dims.grad_dtype, scale (rows,)
      f32 the cotangent of each row's loss.
    Arrays: logits (rows, padded_vocab) in dims.dtype, labels (rows,) int32, lse / scale (rows,) f32.
    """

    run_plan: RunPlan
    config: ChooseConfig = cross_entropy_default_config

    def forward(self, dims: CrossEntropyDims, logits, labels):
        return _batchable(_forward_once, self.run_plan, self.config, dims)(logits, labels)

    def backward(self, dims: CrossEntropyDims, logits, labels, lse, scale):
        return _batchable(_backward_once, self.run_plan, self.config, dims)(logits, labels, lse, scale)[0]


def make_kernels(run_plan: RunPlan, config: ChooseConfig = cross_entropy_default_config) -> LossKernels:
    """The loss's kernel path with every plan run by `run_plan` (ffi.run_plan, callback.run_plan, ...) in the
    tiles and hints `config(dims)` chooses. Keep one `config` object per choice: the traced kernels are cached
    per (run_plan, config, dims)."""
    return LossKernels(run_plan, config)


KERNELS = {"cutile": make_kernels(ffi.run_plan), "cutile_callback": make_kernels(callback.run_plan)}
