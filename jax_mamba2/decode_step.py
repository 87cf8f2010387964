"""`mamba2_decode_step`: one token of the Mamba2 mixer between in_proj and out_proj, as one op.

Per batch row, from the in_proj output pieces z, xBC and dt:

    xBC, conv_state = causal_conv1d_step(xBC, conv_state, conv_weight, conv_bias);  x, B, C = split(silu(xBC))
    y, ssm_state    = ssd_step(ssm_state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit)
    y               = rms_norm(y, norm_weight, z, group_size = d_ssm / ngroups, norm_before_gate)
                      (y * silu(z) instead, gating the SSD output directly, without norm_weight)

Backends: "xla" composes exactly these pure-JAX pieces and is the reference; "cutile" runs the whole step as
one kernel launch (jax_mamba2/kernels/decode_step.py), registered by `jax_mamba2.bridge` when cuda-tile is
installed; "auto" takes cutile on a supported GPU (behind `lax.platform_dependent`) and xla otherwise.

A decode step is inference: the cutile path has no derivative (differentiating it raises a TypeError), the xla
path is plain differentiable JAX. Both compose with jit, vmap (a vmapped axis folds into the kernel's batch),
lax.scan and shard_map over the batch. The kernel normalizes whole groups, so under a head-parallel shard_map
call it only where each shard holds whole groups and their B, C columns (the Mamba2 layer runs its unfused
step there instead).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_mamba2 import backends, op, reference

_API = "mamba2_decode_step"
_BACKENDS = ("auto", "cutile", "xla")


class DecodeStepInputs(NamedTuple):
    """The array arguments of `mamba2_decode_step` (None where absent)."""

    z: jax.Array
    xBC: jax.Array
    dt: jax.Array
    conv_state: jax.Array
    conv_weight: jax.Array
    conv_bias: Optional[jax.Array]
    ssm_state: jax.Array
    A: jax.Array
    D: Optional[jax.Array]
    dt_bias: Optional[jax.Array]
    norm_weight: Optional[jax.Array]


@dataclasses.dataclass(frozen=True)
class DecodeStepStatic:
    """The static options (hashable)."""

    norm_before_gate: bool
    eps: float
    dt_softplus: bool
    dt_limit: tuple[float, float]


class DecodeStepSizes(NamedTuple):
    """The sizes the checks read off the arguments."""

    batch: int
    nheads: int
    headdim: int
    ngroups: int
    dstate: int


@dataclasses.dataclass(frozen=True)
class DecodeKernel:
    """A kernel implementation: run(inputs, static) -> (y, new_conv_state, new_ssm_state), and
    unsupported_reason(inputs, static) -> None or a sentence saying why it cannot run this call here."""

    run: Callable[[DecodeStepInputs, DecodeStepStatic], tuple[jax.Array, jax.Array, jax.Array]]
    unsupported_reason: Callable[[DecodeStepInputs, DecodeStepStatic], Optional[str]]


_KERNELS: dict[str, DecodeKernel] = {}


def register_kernel(name: str, kernel: DecodeKernel) -> None:
    """Adds (or replaces) a kernel implementation of the step; `jax_mamba2.bridge` registers "cutile"."""
    _KERNELS[name] = kernel


def _checked_sizes(inputs: DecodeStepInputs) -> DecodeStepSizes:
    """Checks the arrays; raises ValueError / TypeError naming the first bad one.

    ngroups is read off xBC: conv_dim = nheads * headdim + 2 * ngroups * dstate.
    """
    check = op._check_array
    state = inputs.ssm_state
    if not hasattr(state, "shape") or len(state.shape) != 4:
        raise ValueError(f"{_API}: ssm_state.shape={getattr(state, 'shape', None)} must be "
                         f"(batch, nheads, headdim, dstate)")
    op._check_float(_API, "ssm_state", state)
    batch, nheads, headdim, dstate = state.shape
    d_ssm = nheads * headdim
    xBC = inputs.xBC
    if not hasattr(xBC, "shape") or len(xBC.shape) != 2 or xBC.shape[0] != batch:
        raise ValueError(f"{_API}: xBC.shape={getattr(xBC, 'shape', None)} must be (batch, conv_dim) with "
                         f"batch={batch}")
    conv_dim = xBC.shape[1]
    ngroups, rest = divmod(conv_dim - d_ssm, 2 * dstate)
    if ngroups < 1 or rest or nheads % ngroups:
        raise ValueError(f"{_API}: xBC.shape[1]={conv_dim} must be nheads*headdim + 2*ngroups*dstate = "
                         f"{d_ssm} + {2 * dstate}*ngroups with ngroups >= 1 dividing nheads={nheads}")
    check(_API, "xBC", xBC, "(batch, conv_dim)", (batch, conv_dim))
    check(_API, "z", inputs.z, "(batch, nheads*headdim)", (batch, d_ssm))
    check(_API, "dt", inputs.dt, "(batch, nheads)", (batch, nheads))
    conv_state = inputs.conv_state
    if not hasattr(conv_state, "shape") or len(conv_state.shape) != 3 or conv_state.shape[2] < 1:
        raise ValueError(f"{_API}: conv_state.shape={getattr(conv_state, 'shape', None)} must be "
                         f"(batch, conv_dim, d_conv) with d_conv >= 1")
    d_conv = conv_state.shape[2]
    check(_API, "conv_state", conv_state, "(batch, conv_dim, d_conv)", (batch, conv_dim, d_conv))
    check(_API, "conv_weight", inputs.conv_weight, "(d_conv, conv_dim)", (d_conv, conv_dim))
    if inputs.conv_bias is not None:
        check(_API, "conv_bias", inputs.conv_bias, "(conv_dim,)", (conv_dim,))
    check(_API, "A", inputs.A, "(nheads,)", (nheads,))
    D = inputs.D
    if D is not None:
        if not hasattr(D, "shape") or tuple(D.shape) not in ((nheads,), (nheads, headdim)):
            raise ValueError(f"{_API}: D.shape={getattr(D, 'shape', None)} must be (nheads,)=({nheads},) "
                             f"or (nheads, headdim)=({nheads}, {headdim})")
        op._check_float(_API, "D", D)
    if inputs.dt_bias is not None:
        check(_API, "dt_bias", inputs.dt_bias, "(nheads,)", (nheads,))
    if inputs.norm_weight is not None:
        check(_API, "norm_weight", inputs.norm_weight, "(nheads*headdim,)", (d_ssm,))
    return DecodeStepSizes(batch, nheads, headdim, ngroups, dstate)


def _xla_decode_step(inputs: DecodeStepInputs, static: DecodeStepStatic, dims: DecodeStepSizes):
    """The reference: the layer's pure-JAX pieces, composed."""
    # Imported here: the package's layers import this module.
    from jax_mamba2.flax_layers.conv import causal_conv1d_step
    from jax_mamba2.flax_layers.norm import rms_norm

    batch, nheads, headdim, ngroups, dstate = dims
    d_ssm = nheads * headdim
    xBC, conv_state = causal_conv1d_step(inputs.xBC, inputs.conv_state, inputs.conv_weight, inputs.conv_bias,
                                         dtype=inputs.xBC.dtype)
    x, B, C = jnp.split(jax.nn.silu(xBC), [d_ssm, d_ssm + ngroups * dstate], axis=-1)
    rmsnorm = inputs.norm_weight is not None
    y, ssm_state = reference.ssd_step(
        inputs.ssm_state, x.reshape(batch, nheads, headdim), inputs.dt, inputs.A,
        B.reshape(batch, ngroups, dstate), C.reshape(batch, ngroups, dstate), D=inputs.D,
        z=None if rmsnorm else inputs.z.reshape(batch, nheads, headdim), dt_bias=inputs.dt_bias,
        dt_softplus=static.dt_softplus, dt_limit=static.dt_limit)
    y = y.reshape(batch, d_ssm)
    if rmsnorm:
        y = rms_norm(y, inputs.norm_weight, inputs.z, eps=static.eps, group_size=d_ssm // ngroups,
                     norm_before_gate=static.norm_before_gate)
    return y, conv_state, ssm_state


def pack_arguments(z, xBC, dt, conv_state, ssm_state, conv_weight, A, *, conv_bias=None, D=None, dt_bias=None,
                   norm_weight=None, norm_before_gate=False, eps=1e-5, dt_softplus=True,
                   dt_limit=(0.0, math.inf)) -> tuple[DecodeStepInputs, DecodeStepStatic, DecodeStepSizes]:
    """Checks `mamba2_decode_step`'s arguments (same signature, without backend) and packs them; raises
    ValueError / TypeError naming the first bad one."""
    inputs = DecodeStepInputs(z, xBC, dt, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias,
                              norm_weight)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
        raise ValueError(f"{_API}: eps={eps!r} must be a positive float")
    static = DecodeStepStatic(bool(norm_before_gate), float(eps), bool(dt_softplus),
                              op.check_dt_limit(_API, dt_limit))
    return inputs, static, _checked_sizes(inputs)


def _kernel_reason(inputs: DecodeStepInputs, static: DecodeStepStatic) -> Optional[str]:
    backends.registered()  # imports the bridge, which registers the kernel
    kernel = _KERNELS.get("cutile")
    if kernel is None:
        return "cuda-tile is not installed (pip install 'jax-mamba2[cuda]')"
    return kernel.unsupported_reason(inputs, static)


def kernel_unsupported_reason(*args, **kwargs) -> Optional[str]:
    """Why `mamba2_decode_step(*args, **kwargs, backend="cutile")` cannot run here (None when it can); the
    arguments are checked as `mamba2_decode_step` checks them."""
    return _kernel_reason(*pack_arguments(*args, **kwargs)[:2])


def mamba2_decode_step(z, xBC, dt, conv_state, ssm_state, conv_weight, A, *, conv_bias=None, D=None,
                       dt_bias=None, norm_weight=None, norm_before_gate=False, eps=1e-5, dt_softplus=True,
                       dt_limit=(0.0, math.inf), backend="auto"):
    """One decode step of a Mamba2 layer from in_proj's output to out_proj's input (see the module doc).

    Args:
      z: (batch, d_ssm) gate, d_ssm = nheads * headdim.
      xBC: (batch, conv_dim) pre-conv [x, B, C], conv_dim = d_ssm + 2 * ngroups * dstate; its dtype is the
        computation dtype of the conv and of y.
      dt: (batch, nheads) raw time steps.
      conv_state: (batch, conv_dim, d_conv): the last d_conv pre-conv columns, oldest first.
      ssm_state: (batch, nheads, headdim, dstate): the SSM state before this token.
      conv_weight: (d_conv, conv_dim); conv_bias: (conv_dim,) or None.
      A: (nheads,), negative (-exp(A_log)).
      D: (nheads,) or (nheads, headdim) skip, or None; dt_bias: (nheads,) or None.
      norm_weight: (d_ssm,) gated group RMSNorm weight; None: no norm, y * silu(z).
      norm_before_gate: RMSNorm(y) * silu(z) instead of RMSNorm(y * silu(z)).
      eps: added to the mean square.
      dt_softplus, dt_limit: as in `jax_mamba2.ssd`.
      backend: "auto", "cutile" or "xla".

    Returns:
      (y (batch, d_ssm) in xBC.dtype, new conv_state in conv_state.dtype, new ssm_state in ssm_state.dtype).

    Raises:
      ValueError / TypeError: on a wrong shape, dtype or option, naming the argument; ValueError when
        backend="cutile" cannot run the call, saying why. Differentiating the cutile path raises TypeError.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"{_API}: backend={backend!r} is not one of {_BACKENDS}")
    inputs, static, dims = pack_arguments(
        z, xBC, dt, conv_state, ssm_state, conv_weight, A, conv_bias=conv_bias, D=D, dt_bias=dt_bias,
        norm_weight=norm_weight, norm_before_gate=norm_before_gate, eps=eps, dt_softplus=dt_softplus,
        dt_limit=dt_limit)
    if backend == "xla" or dims.batch == 0:  # no launch for an empty batch
        return _xla_decode_step(inputs, static, dims)
    reason = _kernel_reason(inputs, static)
    if backend == "cutile":
        if reason is not None:
            raise ValueError(f"{_API}(backend='cutile') cannot run this call: {reason}")
        return _KERNELS["cutile"].run(inputs, static)
    if reason is not None:
        return _xla_decode_step(inputs, static, dims)
    return jax.lax.platform_dependent(
        inputs, cuda=lambda i: _KERNELS["cutile"].run(i, static),
        default=lambda i: _xla_decode_step(i, static, dims))
