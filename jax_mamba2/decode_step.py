"""`mamba2_decode_step`: one token of the Mamba2 mixer from in_proj's output to out_proj's input, as one op.

Per batch row, from in_proj's output zxbcdt = [z0, x0, z, xBC, dt] (the mixer's gated-MLP pieces z0, x0 are
the layer's business and are skipped here):

    xBC, conv_state = causal_conv1d_step(xBC, conv_state, conv_weight, conv_bias);  x, B, C = split(silu(xBC))
    y, ssm_state    = ssd_step(ssm_state, x, dt, -exp(A_log), B, C, D, dt_bias, dt_softplus, dt_limit)
    y               = rms_norm(y, norm_weight, z, group_size = d_ssm / ngroups, norm_before_gate)
                      (y * silu(z) instead, gating the SSD output directly, without norm_weight)

Backends: "xla" composes exactly these pure-JAX references (conv1d_reference, reference, norm_reference);
a kernel backend (`Backend.decode_step` in `jax_mamba2.backends`: "cutile", "cutile_callback") runs all but the
norm's scale as one cuTile launch (kernels/decode_step.py) and applies the scale, rsqrt(mean_group(q²) + eps)
· norm_weight, in one XLA elementwise from the kernel's per-group sums of squares; "auto" takes "cutile" on a
supported GPU (behind `lax.platform_dependent`) and "xla" otherwise.

Differentiable (the kernel path through a custom VJP whose backward is the VJP of the xla path, recomputed);
composes with jit, vmap (a vmapped axis folds into the kernel's batch), lax.scan, remat and shard_map over the
batch. The norm's statistic spans a whole group: under head parallelism call it only where each shard holds
whole groups and their B, C columns (the Mamba2 layer runs its composed step there instead).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_mamba2 import backends as registry
from jax_mamba2 import conv1d_reference, norm_reference, op, reference

_API = "mamba2_decode_step"


class DecodeStepInputs(NamedTuple):
    """The array arguments of `mamba2_decode_step` (None where absent)."""

    zxbcdt: jax.Array
    conv_state: jax.Array
    conv_weight: jax.Array
    conv_bias: Optional[jax.Array]
    ssm_state: jax.Array
    A_log: jax.Array
    D: Optional[jax.Array]
    dt_bias: Optional[jax.Array]
    norm_weight: Optional[jax.Array]


@dataclasses.dataclass(frozen=True)
class DecodeStepStatic:
    """The static options (hashable: a custom_vjp nondiff argument)."""

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
    d_mlp: int


def _checked_sizes(inputs: DecodeStepInputs) -> DecodeStepSizes:
    """Checks the arrays; raises ValueError / TypeError naming the first bad one.

    ngroups is read off conv_state (conv_dim = nheads * headdim + 2 * ngroups * dstate) and d_mlp off zxbcdt
    (its width is 2 * d_mlp + nheads * headdim + conv_dim + nheads).
    """
    check = op._check_array
    state = inputs.ssm_state
    if not hasattr(state, "shape") or len(state.shape) != 4:
        raise ValueError(f"{_API}: ssm_state.shape={getattr(state, 'shape', None)} must be "
                         f"(batch, nheads, headdim, dstate)")
    op._check_float(_API, "ssm_state", state)
    batch, nheads, headdim, dstate = state.shape
    d_ssm = nheads * headdim
    conv_state = inputs.conv_state
    if not hasattr(conv_state, "shape") or len(conv_state.shape) != 3 or conv_state.shape[2] < 1:
        raise ValueError(f"{_API}: conv_state.shape={getattr(conv_state, 'shape', None)} must be "
                         f"(batch, conv_dim, d_conv) with d_conv >= 1")
    conv_dim, d_conv = conv_state.shape[1:]
    ngroups, rest = divmod(conv_dim - d_ssm, 2 * dstate)
    if ngroups < 1 or rest or nheads % ngroups:
        raise ValueError(f"{_API}: conv_state.shape[1]={conv_dim} must be conv_dim = nheads*headdim + "
                         f"2*ngroups*dstate = {d_ssm} + {2 * dstate}*ngroups with ngroups >= 1 dividing "
                         f"nheads={nheads}")
    check(_API, "conv_state", conv_state, "(batch, conv_dim, d_conv)", (batch, conv_dim, d_conv))
    zxbcdt = inputs.zxbcdt
    if not hasattr(zxbcdt, "shape") or len(zxbcdt.shape) != 2 or zxbcdt.shape[0] != batch:
        raise ValueError(f"{_API}: zxbcdt.shape={getattr(zxbcdt, 'shape', None)} must be (batch, d_in_proj) "
                         f"with batch={batch}")
    d_mlp, rest = divmod(zxbcdt.shape[1] - (d_ssm + conv_dim + nheads), 2)
    if d_mlp < 0 or rest:
        raise ValueError(f"{_API}: zxbcdt.shape[1]={zxbcdt.shape[1]} must be d_in_proj = 2*d_mlp + "
                         f"nheads*headdim + conv_dim + nheads = 2*d_mlp + {d_ssm + conv_dim + nheads} with "
                         f"d_mlp >= 0")
    check(_API, "zxbcdt", zxbcdt, "(batch, d_in_proj)", (batch, zxbcdt.shape[1]))
    check(_API, "conv_weight", inputs.conv_weight, "(d_conv, conv_dim)", (d_conv, conv_dim))
    if inputs.conv_bias is not None:
        check(_API, "conv_bias", inputs.conv_bias, "(conv_dim,)", (conv_dim,))
    check(_API, "A_log", inputs.A_log, "(nheads,)", (nheads,))
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
    return DecodeStepSizes(batch, nheads, headdim, ngroups, dstate, d_mlp)


def _split(inputs: DecodeStepInputs, sizes: DecodeStepSizes):
    """(z, xBC, dt) of zxbcdt."""
    d_ssm = sizes.nheads * sizes.headdim
    conv_dim = inputs.conv_state.shape[1]
    z0 = 2 * sizes.d_mlp
    z, xBC, dt = jnp.split(inputs.zxbcdt[:, z0:], [d_ssm, d_ssm + conv_dim], axis=-1)
    return z, xBC, dt


def _xla_decode_step(inputs: DecodeStepInputs, static: DecodeStepStatic, sizes: DecodeStepSizes):
    """The composed step on the pure-JAX references: (y, new conv_state, new ssm_state)."""
    batch, nheads, headdim, ngroups, dstate, _ = sizes
    d_ssm = nheads * headdim
    z, xBC, dt = _split(inputs, sizes)
    xBC, conv_state = conv1d_reference.causal_conv1d_step(xBC, inputs.conv_state, inputs.conv_weight,
                                                          inputs.conv_bias, dtype=xBC.dtype)
    x, B, C = jnp.split(jax.nn.silu(xBC), [d_ssm, d_ssm + ngroups * dstate], axis=-1)
    A_log = inputs.A_log
    A = -jnp.exp(A_log.astype(jnp.promote_types(jnp.float32, A_log.dtype)))
    rmsnorm = inputs.norm_weight is not None
    y, ssm_state = reference.ssd_step(
        inputs.ssm_state, x.reshape(batch, nheads, headdim), dt, A, B.reshape(batch, ngroups, dstate),
        C.reshape(batch, ngroups, dstate), D=inputs.D, z=None if rmsnorm else z.reshape(batch, nheads, headdim),
        dt_bias=inputs.dt_bias, dt_softplus=static.dt_softplus, dt_limit=static.dt_limit)
    y = y.reshape(batch, d_ssm)
    if rmsnorm:
        y = norm_reference.rms_norm(y, inputs.norm_weight, z, eps=static.eps, group_size=d_ssm // ngroups,
                                    norm_before_gate=static.norm_before_gate)
    return y, conv_state, ssm_state


def _kernel_decode_step(backend: registry.Backend, inputs: DecodeStepInputs, static: DecodeStepStatic):
    """The kernel's outputs with the norm's scale applied: (y, new conv_state, new ssm_state)."""
    out = backend.decode_step(inputs, static)
    gated, dtype = out["gated"], inputs.zxbcdt.dtype
    if inputs.norm_weight is not None:
        batch, d_ssm = gated.shape
        ngroups = out["sumsq"].shape[1]
        rstd = jax.lax.rsqrt(out["sumsq"] / (d_ssm // ngroups) + static.eps)                  # (batch, ngroups)
        gated = (gated.reshape(batch, ngroups, -1) * rstd[..., None]).reshape(batch, d_ssm)
        gated = gated * inputs.norm_weight.astype(jnp.float32)
    return gated.astype(dtype), out["new_conv_state"], out["new_ssm_state"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _differentiable_kernel_step(backend, static, sizes, inputs):
    return _kernel_decode_step(backend, inputs, static)


def _differentiable_kernel_step_fwd(backend, static, sizes, inputs):
    return _kernel_decode_step(backend, inputs, static), inputs


def _differentiable_kernel_step_bwd(backend, static, sizes, inputs, cotangents):
    # A decode step is trained rarely (if ever): the backward recomputes the composed step and takes its VJP.
    _, vjp = jax.vjp(lambda i: _xla_decode_step(i, static, sizes), inputs)
    return vjp(cotangents)


_differentiable_kernel_step.defvjp(_differentiable_kernel_step_fwd, _differentiable_kernel_step_bwd)


def pack_arguments(zxbcdt, conv_state, ssm_state, conv_weight, A_log, *, conv_bias=None, D=None, dt_bias=None,
                   norm_weight=None, norm_before_gate=False, eps=1e-5, dt_softplus=True,
                   dt_limit=(0.0, math.inf)) -> tuple[DecodeStepInputs, DecodeStepStatic, DecodeStepSizes]:
    """Checks `mamba2_decode_step`'s arguments (same signature, without backend) and packs them; raises
    ValueError / TypeError naming the first bad one."""
    inputs = DecodeStepInputs(zxbcdt, conv_state, conv_weight, conv_bias, ssm_state, A_log, D, dt_bias,
                              norm_weight)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
        raise ValueError(f"{_API}: eps={eps!r} must be a positive float")
    for name, flag in (("norm_before_gate", norm_before_gate), ("dt_softplus", dt_softplus)):
        if not isinstance(flag, bool):
            raise TypeError(f"{_API}: {name}={flag!r} must be a bool")
    static = DecodeStepStatic(norm_before_gate, float(eps), dt_softplus, op.check_dt_limit(_API, dt_limit))
    return inputs, static, _checked_sizes(inputs)


def kernel_backends() -> dict[str, registry.Backend]:
    """The registered backends that run the fused decode step, by name."""
    return {name: b for name, b in registry.registered().items() if b.decode_step is not None}


def kernel_unsupported_reason(backend: str, inputs: DecodeStepInputs, static: DecodeStepStatic) -> Optional[str]:
    """Why the fused kernel of `backend` ("auto": "cutile") cannot run this call here (None when it can)."""
    name = "cutile" if backend == "auto" else backend
    chosen = kernel_backends().get(name)
    if chosen is None:
        if name in registry.known_names():
            return f"backend {name!r} has no fused decode step"
        return f"backend {name!r} is unavailable (pip install 'jax-mamba2[cuda]')"
    return None if chosen.decode_step_unsupported_reason is None else \
        chosen.decode_step_unsupported_reason(inputs, static)


def mamba2_decode_step(zxbcdt, conv_state, ssm_state, conv_weight, A_log, *, conv_bias=None, D=None,
                       dt_bias=None, norm_weight=None, norm_before_gate=False, eps=1e-5, dt_softplus=True,
                       dt_limit=(0.0, math.inf), backend="auto"):
    """One decode step of a Mamba2 layer from in_proj's output to out_proj's input (see the module doc).

    Args:
      zxbcdt: (batch, d_in_proj) in_proj's output [z0, x0, z, xBC, dt], d_in_proj = 2 * d_mlp + d_ssm +
        conv_dim + nheads, d_ssm = nheads * headdim, conv_dim = d_ssm + 2 * ngroups * dstate; its dtype is
        the computation dtype of the conv and of y. z0 and x0 (d_mlp features each) are not read.
      conv_state: (batch, conv_dim, d_conv): the last d_conv pre-conv columns, oldest first.
      ssm_state: (batch, nheads, headdim, dstate): the SSM state before this token.
      conv_weight: (d_conv, conv_dim); conv_bias: (conv_dim,) or None.
      A_log: (nheads,): A = -exp(A_log).
      D: (nheads,) or (nheads, headdim) skip, or None; dt_bias: (nheads,) or None.
      norm_weight: (d_ssm,) gated group RMSNorm weight; None: no norm, y * silu(z).
      norm_before_gate: RMSNorm(y) * silu(z) instead of RMSNorm(y * silu(z)).
      eps: added to the mean square.
      dt_softplus, dt_limit: as in `jax_mamba2.ssd`.
      backend: "auto", "xla" or a backend with a fused decode step ("cutile", "cutile_callback").

    Returns:
      (y (batch, d_ssm) in zxbcdt.dtype, new conv_state in conv_state.dtype, new ssm_state in
      ssm_state.dtype).

    Raises:
      ValueError / TypeError: on a wrong shape, dtype or option, naming the argument; ValueError when a named
        kernel backend cannot run the call, saying why.
    """
    if not isinstance(backend, str):
        raise ValueError(f"{_API}: backend={backend!r} must be 'auto', 'xla' or one of {tuple(kernel_backends())}")
    inputs, static, sizes = pack_arguments(
        zxbcdt, conv_state, ssm_state, conv_weight, A_log, conv_bias=conv_bias, D=D, dt_bias=dt_bias,
        norm_weight=norm_weight, norm_before_gate=norm_before_gate, eps=eps, dt_softplus=dt_softplus,
        dt_limit=dt_limit)
    if backend == "xla" or sizes.batch == 0:  # no launch for an empty batch
        return _xla_decode_step(inputs, static, sizes)
    if backend != "auto" and backend not in kernel_backends():
        raise ValueError(f"{_API}: backend={backend!r} must be 'auto', 'xla' or one of "
                         f"{tuple(kernel_backends())}")
    reason = kernel_unsupported_reason(backend, inputs, static)
    if backend != "auto":
        if reason is not None:
            raise ValueError(f"{_API}(backend={backend!r}) cannot run this call: {reason}")
        return _differentiable_kernel_step(kernel_backends()[backend], static, sizes, inputs)
    if reason is not None:
        return _xla_decode_step(inputs, static, sizes)
    cutile = kernel_backends()["cutile"]
    return jax.lax.platform_dependent(
        inputs, cuda=lambda i: _differentiable_kernel_step(cutile, static, sizes, i),
        default=lambda i: _xla_decode_step(i, static, sizes))
