"""The fused ops of a decode step: input checks, backend dispatch and their VJP.

  norm_project   a few rows, optionally added to the residual stream and RMS-normalized (grouped, gated), times
                 a weight matrix: a block's add + norm + in_proj, the mixer's gated norm + out_proj, the final
                 norm + LM head. Two kernel launches (the norm's and the product's); one where the product
                 normalizes as it loads its rows (without a norm, or with the statistics given as `sum_squares`),
                 and one more that sums the partial products of a split K unless `return_partials` keeps them.
  mixer_step     one token of the mixer between its projections: the conv step + SiLU on in_proj's xBC columns,
                 the SSD state update with D and, for a mixer without the gated norm, the gate. One launch.

With these a decode step runs five kernels per layer (`Mamba2LMHeadModel.step`), four up to a few rows, where the
mixer step also returns the gated norm's input and its sums of squares (`mixer_step(norm_z_offset=...)`) and
out_proj's product normalizes it; at a few rows out_proj's K is split over blocks (`kernels/decode_projection.py`),
and it returns their partial products (`return_partials`), which the next layer's norm kernel sums rather than a
launch of their own. Per-layer arrays may be stacks
of every layer (a leading (L,) axis: the LM's parameters and its cache) with `layer` naming the one to use: the
kernels then read that layer where it lies in the stack, and write the layer's SSM state in place, so that a step
over the layers slices nothing out of the stacks and copies no weight.

Semantics are those of `jax_mamba2.decode_reference`, which is the "xla" backend. Backends are the "decode"
entries of the registry in `jax_mamba2.backends`: "xla" (registered here), "cutile" (the kernels in
kernels/decode_projection.py and decode_mixer.py as XLA FFI custom calls) and "cutile_callback" (the same kernels
in a buffer callback), registered by the bridge; "auto" picks cutile on a supported GPU (behind
`lax.platform_dependent`) and xla otherwise. A kernel backend asked for by name never falls back: it raises
saying why it cannot run. Both ops are differentiable on every backend: their VJP is the reference's (decoding
never differentiates, and the kernels have no backward of their own).

`token_step(fn, backend)` runs a whole token step made of these ops on the callback backend as one callback, which
replays one CUDA graph of programmatic dependent launches (bridge/merged_callbacks.py).
"""
from __future__ import annotations

import functools
import math
import operator
from numbers import Integral
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_mamba2 import backends as registry
from jax_mamba2 import decode_reference as reference
from jax_mamba2.checks import check_array, check_dt_limit, check_flag, check_int, check_positive_float, float_dtype

OP = "decode"


def _bridge():
    """jax_mamba2.bridge.decode_ops: how the kernels describe a call. Called only once a kernel backend was
    selected, whose registration imported it."""
    from jax_mamba2.bridge import decode_ops
    return decode_ops


registry.register_backend(registry.LayerBackend("xla", None, registry.always_supported), op=OP)


# ----------------------------------------------------------------------------------------------
# Layers of stacked arrays
# ----------------------------------------------------------------------------------------------

def _python_int(value):
    """A NumPy integer as a Python int (the ops' layout options are static data); anything else as it is, for the
    checks to judge."""
    return int(value) if isinstance(value, np.integer) else value


def _check_layer(api: str, layer, layers: Optional[int], name: str = "layer"):
    """`layer` (None, an int in [0, layers), or an integer scalar array) as a (1,) int32 array, 0 for None. A
    concrete array is range-checked like an int; a traced one (a layer loop's index) cannot be, and one outside
    [0, layers) is clamped into it, as JAX's dynamic indexing does. Errors name it `name`."""
    if layer is None:
        return jnp.zeros((1,), jnp.int32)
    if isinstance(layer, (bool, np.bool_)) or not (isinstance(layer, Integral) or (
            hasattr(layer, "dtype") and jnp.issubdtype(layer.dtype, jnp.integer) and jnp.ndim(layer) == 0)):
        raise TypeError(f"{api}: {name}={layer!r} must be an int or an integer scalar array")
    if not isinstance(layer, jax.core.Tracer) and not 0 <= int(layer) < layers:
        raise ValueError(f"{api}: {name}={int(layer)} must be in [0, {layers})")
    return jnp.asarray(layer, jnp.int32).reshape(1)


def _int32_indices(*indices) -> tuple:
    """Start indices of a dynamic slice in one dtype, int32 (with jax_enable_x64 a Python int would be int64
    beside an int32 layer index, which `dynamic_update_slice` refuses)."""
    return tuple(jnp.asarray(i, jnp.int32) for i in indices)


def _stacked(a):
    """One layer's array as a stack of one (a leading axis of 1), or None."""
    return None if a is None else a[None]


def _take(stack, layer_index):
    """stack[layer_index[0]] of a stacked array (None passes)."""
    return None if stack is None else jax.lax.dynamic_index_in_dim(stack, layer_index[0], 0, keepdims=False)


class _Options(dict):
    """An op's static options (keyword -> value), hashable: the custom VJPs take them as a non-differentiable
    argument."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


def _select(api: str, backend: str, dims_fn):
    """The backends to run on (see `registry.select`); dims_fn(bridge) -> the kernels' description of the call."""
    def unsupported(b):
        if b.kernels is None:
            return None
        return b.unsupported_reason(dims_fn(_bridge()))
    return registry.select(backend, api, unsupported, op=OP)


# ----------------------------------------------------------------------------------------------
# norm_project
# ----------------------------------------------------------------------------------------------

class _ProjectionArgs(NamedTuple):
    """What `norm_project`'s checks settle: the options as Python values and the sizes the call runs at."""

    z_offset: int
    group_size: int
    residual_dtype: Optional[jnp.dtype]
    x_dtype: Optional[jnp.dtype]
    features: int
    layers: int


def _check_projection(api, x, weight, norm_weight, residual, residual_dtype, z, z_offset, group_size, bias,
                      transpose_weight, layer, x_dtype, sum_squares) -> _ProjectionArgs:
    """`norm_project`'s array arguments and their options (see it for the rules), before anything runs."""
    z_offset, group_size = _python_int(z_offset), _python_int(group_size)
    check_array(api, "x", x)
    if len(x.shape) not in (2, 3):
        raise ValueError(f"{api}: x.shape={tuple(x.shape)} must be (rows, features) or (parts, rows, features)")
    if len(x.shape) == 3:
        if x.dtype not in (jnp.float32, jnp.float64):
            raise TypeError(f"{api}: x of shape (parts, rows, features) must be float32 (or float64) partial sums, "
                            f"got {x.dtype}")
        if x_dtype is None or norm_weight is None:
            raise ValueError(f"{api}: x given as partial sums needs x_dtype (the dtype of their sum) and norm_weight")
        x_dtype = float_dtype(api, "x_dtype", x_dtype)
    elif x_dtype is not None:
        raise ValueError(f"{api}: x_dtype={x_dtype!r} is for x given as partial sums (parts, rows, features)")
    rows, features = x.shape[-2:]
    if features < 1:
        raise ValueError(f"{api}: x.shape={tuple(x.shape)} must have features >= 1")
    stack = () if layer is None else (None,)
    check_array(api, "weight", weight)
    if len(weight.shape) != 2 + len(stack):
        axes = "out_features, features" if transpose_weight else "features, out_features"
        raise ValueError(f"{api}: weight.shape={tuple(weight.shape)} must be {'(layers, ' if stack else '('}{axes})")
    layers = weight.shape[0] if stack else 1
    out_features = weight.shape[-2] if transpose_weight else weight.shape[-1]
    if weight.shape[-1 if transpose_weight else -2] != features:
        raise ValueError(f"{api}: weight.shape={tuple(weight.shape)} must have x's features={features} on its "
                         f"{'last' if transpose_weight else 'input'} axis")
    lead = (layers,) if stack else ()
    lead_text = "(layers, " if stack else "("
    if norm_weight is not None:
        check_array(api, "norm_weight", norm_weight, f"{lead_text}features)", (*lead, features))
    if residual is not None:
        check_array(api, "residual", residual, "(rows, features)", (rows, features))
        if residual_dtype is None:
            raise ValueError(f"{api}: residual needs residual_dtype (the residual stream's dtype)")
    if residual_dtype is not None:
        residual_dtype = float_dtype(api, "residual_dtype", residual_dtype)
    if z is not None:
        check_array(api, "z", z)
        if norm_weight is None:
            raise ValueError(f"{api}: z gates the norm and needs norm_weight")
        check_int(api, "z_offset", z_offset, "a non-negative int", minimum=0)
        if len(z.shape) != 2 or z.shape[0] != rows or z_offset + features > z.shape[1]:
            raise ValueError(f"{api}: z.shape={tuple(z.shape)} with z_offset={z_offset!r} must be (rows={rows}, "
                             f">= z_offset + {features}) with an int z_offset >= 0")
    if group_size is None:
        group_size = features
    elif norm_weight is None:  # no norm to group: refused rather than ignored, as z is
        raise ValueError(f"{api}: group_size groups the norm's features and needs norm_weight")
    elif features % check_int(api, "group_size", group_size, f"a positive divisor of features={features}"):
        raise ValueError(f"{api}: group_size={group_size!r} must be a positive divisor of features={features}")
    if bias is not None:
        check_array(api, "bias", bias, f"{lead_text}out_features)", (*lead, out_features))
    if sum_squares is not None:
        ngroups = features // group_size
        if norm_weight is None or residual is not None or residual_dtype is not None or x_dtype is not None:
            raise ValueError(f"{api}: sum_squares are the statistics of a norm (norm_weight) without residual, "
                             f"residual_dtype or x as partial sums")
        check_array(api, "sum_squares", sum_squares)
        if sum_squares.dtype not in (jnp.float32, jnp.float64):  # float64: a float64 model's, on the xla path
            raise TypeError(f"{api}: sum_squares must be float32 (float64 for a float64 model), got "
                            f"{sum_squares.dtype}")
        if (len(sum_squares.shape) != 2 or sum_squares.shape[0] != rows or sum_squares.shape[1] % ngroups
                or sum_squares.shape[1] == 0):
            raise ValueError(f"{api}: sum_squares.shape={tuple(sum_squares.shape)} must be (rows={rows}, a positive "
                             f"multiple of the norm's {ngroups} groups)")
    return _ProjectionArgs(z_offset, group_size, residual_dtype, x_dtype, features, layers)


def norm_project(x, weight, *, norm_weight=None, residual=None, residual_dtype=None, z=None, z_offset: int = 0,
                 group_size: Optional[int] = None, norm_before_gate: bool = False, eps: float = 1e-5, bias=None,
                 transpose_weight: bool = False, layer=None, dtype=None, x_dtype=None, return_partials: bool = False,
                 sum_squares=None, backend: str = "auto"):
    """A decode projection: (residual add, gated grouped RMSNorm,) then the product with a weight matrix.

        h   = x (+ residual), rounded to residual_dtype: the new residual stream (when residual_dtype is given)
        a   = rms_norm(h, norm_weight, z, group_size, norm_before_gate, eps) rounded to residual_dtype (when given),
              then to x.dtype (when norm_weight is given)
        out = a @ weight (+ bias), in dtype, accumulated in float32 (float64 for float64)

    Args:
      x: (rows, K), float; or (parts, rows, K) float32 partial sums of x (what `return_partials` returns), whose
        sum rounded to x_dtype is x (needs norm_weight).
      weight: (K, N), or (N, K) with transpose_weight (a tied embedding as the LM head); with `layer`, a stack
        (L, K, N) / (L, N, K) of which layer `layer` is used.
      norm_weight: optional (K,) (with layer: (L, K)): normalize first.
      residual: optional (rows, K) added to x; needs residual_dtype.
      residual_dtype: the residual stream's dtype: h is rounded to it and returned.
      z: optional gate (rows, ZW): its columns [z_offset, z_offset + K) gate the norm (needs norm_weight).
      z_offset: where the gate's columns start in z (in_proj's output holds z among other columns).
      group_size: the norm's groups of features (default: all K; needs norm_weight); norm_before_gate, eps: as
        `rms_norm`.
      bias: optional (N,) (with layer: (L, N)).
      transpose_weight: weight is (N, K).
      layer: None (unstacked arrays), or the layer of the stacked ones: an int or an integer scalar array.
      dtype: the computation and output dtype (default: the result type of x and weight); the weight is rounded
        to it (float32 products run as TF32 on the kernels).
      x_dtype: x's dtype when x is given as partial sums (required then).
      return_partials: return out as (parts, rows, N) partial sums in float32 (float64 for dtype float64), the
        bias included, whose sum rounded to dtype is out: a following norm_project takes them as its x and sums
        them in its norm kernel, so that a product whose K is split over blocks needs no launch of its own to
        sum them (parts: that split, into equal pieces of K, 1 on the xla backend).
      sum_squares: optional (rows, parts) float32: the norm's statistics in pieces, the sums of squares of its input
        (x, gated by silu(z) unless norm_before_gate), parts / ngroups pieces per group in order (what
        `mixer_step` returns with norm_z_offset): the norm takes them instead of a pass over x, so on the kernels
        the product normalizes x as it loads it and the projection is one launch (needs norm_weight; not with
        residual, residual_dtype or x as partial sums).
      backend: "auto", "cutile", "cutile_callback" or "xla".

    Returns:
      out (rows, N) in dtype (its partial sums with return_partials), or (out, h (rows, K) in residual_dtype)
      when residual_dtype is given.

    Raises:
      ValueError / TypeError: on a wrong shape, dtype or option, naming the argument; ValueError when a named
        kernel backend cannot run the call, saying why.
    """
    api = "norm_project"
    transpose_weight = check_flag(api, "transpose_weight", transpose_weight)  # the weight's shape check reads it
    z_offset, group_size, residual_dtype, x_dtype, features, layers = _check_projection(
        api, x, weight, norm_weight, residual, residual_dtype, z, z_offset, group_size, bias, transpose_weight, layer,
        x_dtype, sum_squares)
    stack = () if layer is None else (None,)
    eps = check_positive_float(api, "eps", eps)
    norm_before_gate = check_flag(api, "norm_before_gate", norm_before_gate)
    return_partials = check_flag(api, "return_partials", return_partials)
    if dtype is None:
        dtype = jnp.result_type(x if x_dtype is None else x_dtype, weight)
    dtype = float_dtype(api, "dtype", dtype)
    layer_index = _check_layer(api, layer, layers)
    if not stack:
        weight, norm_weight, bias = _stacked(weight), _stacked(norm_weight), _stacked(bias)
    if norm_weight is not None:
        norm_weight = norm_weight.reshape(layers, features // group_size, group_size)
    options = _Options(group_size=group_size, norm_before_gate=norm_before_gate, eps=float(eps), z_offset=z_offset,
                       transpose_weight=transpose_weight, residual_dtype=residual_dtype, dtype=dtype, x_dtype=x_dtype,
                       return_partials=return_partials)

    def dims(bridge):
        return bridge.projection_dims(x, residual, z, norm_weight, weight, bias, sum_squares, **options)

    selected = _select(api, backend, dims)
    out, residual_out = registry.run_selected(
        selected, lambda b, *arrays: _project(b.kernels, dims, options, *arrays),
        layer_index, x, residual, z, norm_weight, weight, bias, sum_squares)
    return out if residual_dtype is None else (out, residual_out)


def _project_reference(options, layer_index, x, residual, z, norm_weight, weight, bias, sum_squares):
    """The xla path on stacked arrays: reference.norm_project on layer layer_index[0]."""
    z_offset, features = options["z_offset"], x.shape[-1]
    norm_weight = _take(norm_weight, layer_index)
    return reference.norm_project(
        x, _take(weight, layer_index), norm_weight=None if norm_weight is None else norm_weight.reshape(features),
        residual=residual, residual_dtype=options["residual_dtype"],
        z=None if z is None else z[:, z_offset:z_offset + features], group_size=options["group_size"],
        norm_before_gate=options["norm_before_gate"], eps=options["eps"], bias=_take(bias, layer_index),
        transpose_weight=options["transpose_weight"], dtype=options["dtype"], x_dtype=options["x_dtype"],
        partials=options["return_partials"], parts=options.get("parts", 1), sum_squares=sum_squares)


def _project(kernels, dims_fn, options, layer_index, x, *arrays):
    if kernels is None or x.shape[-2] == 0:  # no rows: nothing to launch, the reference's empty result
        return _project_reference(options, layer_index, x, *arrays)
    return _kernel_project(kernels, dims_fn(_bridge()), options, layer_index, x, *arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _kernel_project(kernels, dims, options, layer_index, x, residual, z, norm_weight, weight, bias, sum_squares):
    return kernels.project(dims, layer_index, x, residual, z, norm_weight, weight, bias, sum_squares)


def _kernel_project_fwd(kernels, dims, options, *arrays):
    return _kernel_project(kernels, dims, options, *arrays), arrays


def _kernel_project_bwd(kernels, dims, options, arrays, cotangents):
    if options["return_partials"]:  # the kernels' partial sums, one per equal piece of K (their split's, not one)
        options = _Options(options, parts=cotangents[0].shape[0])
    return registry.reference_vjp(functools.partial(_project_reference, options), arrays, cotangents)


_kernel_project.defvjp(_kernel_project_fwd, _kernel_project_bwd)


# ----------------------------------------------------------------------------------------------
# mixer_step
# ----------------------------------------------------------------------------------------------

class _MixerArgs(NamedTuple):
    """What `mixer_step`'s checks settle: the sizes and options as Python values, and the layers of the stacks."""

    sizes: dict
    z_offset: Optional[int]
    norm_z_offset: Optional[int]
    norm_group_size: Optional[int]
    norm_before_gate: bool
    group_windows_apart: bool
    layers: int


def _check_mixer(api, zxbcdt, conv_state, ssm_state, conv_weight, conv_bias, A_log, dt_bias, D, nheads, headdim,
                 ngroups, dstate, xbc_offset, dt_offset, z_offset, norm_z_offset, norm_group_size, norm_before_gate,
                 layer, group_windows_apart) -> _MixerArgs:
    """`mixer_step`'s array arguments and their options (see it for the rules), before anything runs."""
    nheads, headdim, ngroups, dstate, xbc_offset, dt_offset, z_offset, norm_z_offset, norm_group_size = (
        _python_int(v) for v in (nheads, headdim, ngroups, dstate, xbc_offset, dt_offset, z_offset, norm_z_offset,
                                 norm_group_size))
    sizes = dict(nheads=nheads, headdim=headdim, ngroups=ngroups, dstate=dstate, xbc_offset=xbc_offset,
                 dt_offset=dt_offset)
    for name, value in sizes.items():
        offset = name.endswith("offset")
        check_int(api, name, value, f"a {'non-negative' if offset else 'positive'} int", minimum=0 if offset else 1)
    if nheads % ngroups:
        raise ValueError(f"{api}: nheads={nheads} must be a multiple of ngroups={ngroups}")
    d_ssm = nheads * headdim
    conv_dim = d_ssm + 2 * ngroups * dstate
    check_array(api, "zxbcdt", zxbcdt)
    if len(zxbcdt.shape) != 2:
        raise ValueError(f"{api}: zxbcdt.shape={tuple(zxbcdt.shape)} must be (rows, in_width)")
    rows, in_width = zxbcdt.shape
    spans = {"xBC": (xbc_offset, conv_dim), "dt": (dt_offset, nheads)}
    if z_offset is not None:
        check_int(api, "z_offset", z_offset, "None or a non-negative int", minimum=0)
        spans["z"] = (z_offset, d_ssm)
    norm_before_gate = check_flag(api, "norm_before_gate", norm_before_gate)
    group_windows_apart = check_flag(api, "group_windows_apart", group_windows_apart)
    if group_windows_apart and layer is None:
        raise ValueError(f"{api}: group_windows_apart=True needs the stacks of a `layer`")
    if norm_z_offset is not None:
        requirement = "None or a non-negative int, with no gate in the step (z_offset=None)"
        check_int(api, "norm_z_offset", norm_z_offset, requirement, minimum=0)
        if z_offset is not None:
            raise ValueError(f"{api}: norm_z_offset={norm_z_offset!r} must be {requirement}")
        spans["the norm's z"] = (norm_z_offset, d_ssm)
        if norm_group_size is None:
            norm_group_size = d_ssm
        requirement = f"a multiple of headdim={headdim} dividing nheads * headdim={d_ssm}"
        if check_int(api, "norm_group_size", norm_group_size, requirement) % headdim or d_ssm % norm_group_size:
            raise ValueError(f"{api}: norm_group_size={norm_group_size!r} must be {requirement}")
    elif norm_group_size is not None or norm_before_gate:
        raise ValueError(f"{api}: norm_group_size and norm_before_gate describe the norm of norm_z_offset, which is "
                         f"None")
    for name, (start, width) in spans.items():
        if start + width > in_width:
            raise ValueError(f"{api}: {name}'s columns [{start}, {start + width}) must lie inside zxbcdt's "
                             f"in_width={in_width}")
    stack = () if layer is None else (None,)
    layers = 1
    if stack:
        check_array(api, "conv_weight", conv_weight)
        if len(conv_weight.shape) != 3:
            raise ValueError(f"{api}: conv_weight.shape={tuple(conv_weight.shape)} must be (layers, d_conv, conv_dim) "
                             "with a layer")
        layers = conv_weight.shape[0]
    lead, lead_text = ((layers,), "(layers, ") if stack else ((), "(")
    check_array(api, "conv_state", conv_state)
    if len(conv_state.shape) != 3 + len(lead) or tuple(conv_state.shape[:-1]) != (*lead, rows, conv_dim):
        raise ValueError(f"{api}: conv_state.shape={tuple(conv_state.shape)} must be {lead_text}rows={rows}, "
                         f"conv_dim={conv_dim}, d_conv)")
    d_conv = conv_state.shape[-1]
    if d_conv < 1:
        raise ValueError(f"{api}: conv_state.shape={tuple(conv_state.shape)} must have d_conv >= 1 window columns")
    check_array(api, "ssm_state", ssm_state, f"{lead_text}rows, nheads, headdim, dstate)",
                (*lead, rows, nheads, headdim, dstate))
    check_array(api, "conv_weight", conv_weight, f"{lead_text}d_conv, conv_dim)", (*lead, d_conv, conv_dim))
    if conv_bias is not None:
        check_array(api, "conv_bias", conv_bias, f"{lead_text}conv_dim)", (*lead, conv_dim))
    check_array(api, "A_log", A_log, f"{lead_text}nheads)", (*lead, nheads))
    check_array(api, "dt_bias", dt_bias, f"{lead_text}nheads)", (*lead, nheads))
    check_array(api, "D", D, f"{lead_text}nheads) or {lead_text}nheads, headdim)", (*lead, nheads),
                (*lead, nheads, headdim))
    return _MixerArgs(sizes, z_offset, norm_z_offset, norm_group_size, norm_before_gate, group_windows_apart, layers)


def mixer_step(zxbcdt, conv_state, ssm_state, conv_weight, conv_bias, A_log, dt_bias, D, *, nheads: int,
               headdim: int, ngroups: int, dstate: int, xbc_offset: int, dt_offset: int,
               z_offset: Optional[int] = None, dt_limit=(0.0, math.inf), norm_z_offset: Optional[int] = None,
               norm_group_size: Optional[int] = None, norm_before_gate: bool = False, layer=None,
               group_windows_apart: bool = False, backend: str = "auto"):
    """One token of a Mamba-2 mixer between in_proj and the gated norm (mamba_ssm `Mamba2.step`'s middle).

    Computes `decode_reference.mixer_step`: the causal conv step + SiLU on xBC, then the SSD state update with
    Δ = clip(softplus(dt + dt_bias), *dt_limit), A = -exp(A_log), the D skip and, with z_offset, the gate.

    Args:
      zxbcdt: (rows, in_width), in_proj's output: xBC (conv_dim = nheads * headdim + 2 * ngroups * dstate
        columns) from xbc_offset, dt (nheads columns) from dt_offset, z (nheads * headdim) from z_offset.
      conv_state: (rows, conv_dim, d_conv); ssm_state: (rows, nheads, headdim, dstate); with `layer`, stacks
        (L, rows, ...) of every layer's.
      conv_weight: (d_conv, conv_dim); conv_bias: (conv_dim,) or None; A_log, dt_bias: (nheads,); D: (nheads,) or
        (nheads, headdim); with `layer`, stacks with a leading (L,) axis. Each in its own float dtype (the conv's
        weight and bias enter its sum unrounded to zxbcdt's dtype, as in `causal_conv1d_silu`).
      nheads, headdim, ngroups, dstate: the mixer's shape.
      xbc_offset, dt_offset, z_offset: where xBC, dt and (for a gate in the step) z start in zxbcdt's columns.
      dt_limit: (min, max) clip of the time step.
      norm_z_offset: None, or where the gate of the gated norm that follows starts in zxbcdt (a mixer with the
        gated norm; z_offset None): y is then the norm's input (gated here unless norm_before_gate) and the step
        also returns its sums of squares, which `norm_project` takes (x=y, z=None unless norm_before_gate,
        sum_squares) so that the norm needs no pass (and on the kernels no launch) of its own.
      norm_group_size: that norm's group size (None: every feature), a multiple of headdim.
      norm_before_gate: that norm's gate placement (the sums are of y gated by silu(z) unless True).
      layer: None (unstacked arrays), or the layer of the stacked ones: an int or an integer scalar array.
      group_windows_apart: with `layer`, leave B's and C's channels of the returned conv-state stack as they
        were and return their new windows apart, for the caller to write at [layer, :, nheads * headdim:] (the
        LM's token step writes every layer's in one pass, rather than one small pass per layer).
      backend: "auto", "cutile", "cutile_callback" or "xla".

    Returns:
      (y (rows, nheads * headdim) in zxbcdt's dtype, ssm_state and conv_state with the layer's states advanced
      (the stacks, with `layer`; on the kernels updated in place where XLA can reuse their buffers: donate them,
      or carry them through a loop)); with group_windows_apart next B's and C's new windows (rows, 2 * ngroups *
      dstate, d_conv) in conv_state's dtype; with norm_z_offset y is the norm's input in float32 (y rounded to
      zxbcdt's dtype, times silu(z) unless norm_before_gate) and a last output its sums of squares (rows, parts)
      float32, parts / groups consecutive pieces per group (one per group on the xla backend, one per kernel
      block of a head's channels on the kernels).

    Raises:
      ValueError / TypeError: as `norm_project`.
    """
    api = "mixer_step"
    sizes, z_offset, norm_z_offset, norm_group_size, norm_before_gate, group_windows_apart, layers = _check_mixer(
        api, zxbcdt, conv_state, ssm_state, conv_weight, conv_bias, A_log, dt_bias, D, nheads, headdim, ngroups,
        dstate, xbc_offset, dt_offset, z_offset, norm_z_offset, norm_group_size, norm_before_gate, layer,
        group_windows_apart)
    stack = () if layer is None else (None,)
    d_ssm = sizes["nheads"] * sizes["headdim"]
    dt_limit = check_dt_limit(api, dt_limit)
    layer_index = _check_layer(api, layer, layers)
    arrays = (zxbcdt, conv_state, conv_weight, conv_bias, A_log, dt_bias, D, ssm_state)
    if not stack:
        arrays = tuple(a if i == 0 else _stacked(a) for i, a in enumerate(arrays))
    options = _Options(**sizes, z_offset=z_offset, dt_limit=dt_limit)
    if norm_z_offset is not None:
        options.update(norm_z_offset=norm_z_offset, norm_group_size=norm_group_size,
                       norm_before_gate=norm_before_gate)

    def dims(bridge):
        return bridge.mixer_dims(*arrays, **options)

    selected = _select(api, backend, dims)
    y, new_ssm_state, new_conv_state, group_windows, *sum_squares = registry.run_selected(
        selected, lambda b, *a: _mixer(b.kernels, dims, options, *a), layer_index, *arrays)
    if group_windows_apart:
        return (y, new_ssm_state, new_conv_state, group_windows, *sum_squares)
    new_conv_state = write_group_windows(new_conv_state, group_windows[None], d_ssm, layer_index[0])
    if not stack:
        new_ssm_state, new_conv_state = new_ssm_state[0], new_conv_state[0]
    return (y, new_ssm_state, new_conv_state, *sum_squares)


def token_step(fn: Callable, backend: str) -> Callable:
    """`fn` (a token step made of this module's ops, all on `backend`) with its kernels launched together: on
    "cutile_callback" every run of its kernel plans that no other operation separates becomes one callback that
    replays a CUDA graph of its launches, each a programmatic dependent launch of its predecessor
    (`bridge.merged_callbacks.merge_plan_callbacks`); on any other backend `fn` itself. Call it inside a jitted
    function: the merged form traces `fn` at each call.

    Raises:
      ValueError: on "cutile_callback" where its graphs cannot run (CuPy missing), saying why.
    """
    if backend != "cutile_callback":
        return fn
    from jax_mamba2.bridge import merged_callbacks
    reason = merged_callbacks.unavailable_reason()
    if reason is not None:
        raise ValueError(f"token_step: backend='cutile_callback' launches a token step's kernels as one CUDA graph, "
                         f"which cannot run here: {reason}")
    return merged_callbacks.merge_plan_callbacks(fn)


def write_group_windows(conv_state, group_windows, d_ssm: int, first_layer=0):
    """conv_state (L, rows, conv_dim, d_conv) with B's and C's channels (d_ssm on) of layers [first_layer,
    first_layer + n) replaced by group_windows (n, rows, conv_dim - d_ssm, d_conv): what `mixer_step` returns
    apart with group_windows_apart. One pass over those channels, in place where XLA can reuse conv_state.
    first_layer may be traced (a layer loop's index); a concrete one is checked to keep the n layers inside.

    Raises:
      ValueError / TypeError: on shapes that do not match, a d_ssm outside the channels or layers outside the
        stack, naming the argument.
    """
    api = "write_group_windows"
    check_array(api, "conv_state", conv_state)
    if len(conv_state.shape) != 4:
        raise ValueError(f"{api}: conv_state.shape={tuple(conv_state.shape)} must be (layers, rows, conv_dim, d_conv)")
    layers, rows, conv_dim, d_conv = conv_state.shape
    if isinstance(d_ssm, (bool, np.bool_)) or not hasattr(d_ssm, "__index__"):
        raise TypeError(f"{api}: d_ssm={d_ssm!r} must be an int")
    d_ssm = operator.index(d_ssm)
    if not 0 <= d_ssm < conv_dim:
        raise ValueError(f"{api}: d_ssm={d_ssm} must be in [0, conv_dim={conv_dim})")
    check_array(api, "group_windows", group_windows)
    if len(group_windows.shape) != 4 or tuple(group_windows.shape[1:]) != (rows, conv_dim - d_ssm, d_conv):
        raise ValueError(f"{api}: group_windows.shape={tuple(group_windows.shape)} must be (n, rows, conv_dim - "
                         f"d_ssm, d_conv)=(n, {rows}, {conv_dim - d_ssm}, {d_conv})")
    if group_windows.shape[0] > layers:
        raise ValueError(f"{api}: group_windows.shape[0]={group_windows.shape[0]} (its layers) must be at most "
                         f"conv_state.shape[0]={layers}")
    # The n layers start at most n - 1 before the stack's end.
    first = _check_layer(api, first_layer, layers - group_windows.shape[0] + 1, name="first_layer")[0]
    return jax.lax.dynamic_update_slice(conv_state, group_windows.astype(conv_state.dtype),
                                        _int32_indices(first, 0, d_ssm, 0))


def _mixer_reference(options, layer_index, zxbcdt, conv_state, conv_weight, conv_bias, A_log, dt_bias, D,
                     ssm_state):
    """The xla path on stacked arrays, with the kernels' outputs: reference.mixer_step on layer layer_index[0],
    its SSM state and x's channels of its conv state written back into the stacks, B's and C's windows apart."""
    def take(a):
        return _take(a, layer_index)

    y, new_state, new_conv_state, *sum_squares = reference.mixer_step(
        zxbcdt, take(conv_state), take(ssm_state), take(conv_weight), take(conv_bias), take(A_log), take(dt_bias),
        take(D), **options)
    ssm_state = jax.lax.dynamic_update_index_in_dim(ssm_state, new_state.astype(ssm_state.dtype), layer_index[0], 0)
    d_ssm = options["nheads"] * options["headdim"]
    conv_state = jax.lax.dynamic_update_slice(conv_state, new_conv_state[None, :, :d_ssm].astype(conv_state.dtype),
                                              _int32_indices(layer_index[0], 0, 0, 0))
    return (y, ssm_state, conv_state, new_conv_state[:, d_ssm:], *sum_squares)


def _mixer(kernels, dims_fn, options, layer_index, zxbcdt, *arrays):
    if kernels is None or zxbcdt.shape[0] == 0:  # no rows: nothing to launch, the reference's empty result
        return _mixer_reference(options, layer_index, zxbcdt, *arrays)
    return _kernel_mixer(kernels, dims_fn(_bridge()), options, layer_index, zxbcdt, *arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _kernel_mixer(kernels, dims, options, layer_index, zxbcdt, conv_state, conv_weight, conv_bias, A_log, dt_bias,
                  D, ssm_state):
    y, ssm_state, conv_state, group_windows, *sum_squares = kernels.mixer_step(
        dims, layer_index, zxbcdt, conv_state, conv_weight, conv_bias, A_log, dt_bias, D, ssm_state)
    return (y.reshape(zxbcdt.shape[0], -1), ssm_state, conv_state, group_windows, *sum_squares)


def _kernel_mixer_fwd(kernels, dims, options, *arrays):
    return _kernel_mixer(kernels, dims, options, *arrays), arrays


def _kernel_mixer_bwd(kernels, dims, options, arrays, cotangents):
    if len(cotangents) == 5:  # the sums of squares in the kernels' pieces (their config's), not one per group
        options = _Options(options, norm_pieces=cotangents[4].shape[-1])
    return registry.reference_vjp(functools.partial(_mixer_reference, options), arrays, cotangents)


_kernel_mixer.defvjp(_kernel_mixer_fwd, _kernel_mixer_bwd)

