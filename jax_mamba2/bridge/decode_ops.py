"""The decode step's fused ops (`jax_mamba2.decode`) on the cuTile kernels (kernels/decode_projection.py,
decode_mixer.py), for any plan executor.

Adds what raw kernel calls lack: vmap rules (a mapped axis of the rows folds into the projection's rows; the mixer
step, whose state stacks carry the rows on their second axis, runs mapped items one launch each) and outputs that
keep shard_map's varying axes. `jax_mamba2.decode` calls `KERNELS[backend]` with the per-layer arrays as stacks
(leading (L,) axis) and the layer as a (1,) int32 array; the arrays go to the kernels in their own dtypes.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jax_mamba2.bridge import _compat, callback, ffi
from jax_mamba2.bridge.batching import fold, map_items, unfold
from jax_mamba2.bridge.problem import gpu_unavailable_reason, symbolic_sizes_reason
from jax_mamba2.kernels import decode_mixer, decode_projection
from jax_mamba2.kernels._common import KERNEL_DTYPES
from jax_mamba2.kernels.decode_mixer import MixerStepDims
from jax_mamba2.kernels.decode_projection import ProjectionDims

RunPlan = Callable[..., dict]
# The kernels' tile and hint choices for a problem (the defaults: the kernel modules' *_default_config).
ChooseProjectionConfig = Callable[[ProjectionDims], decode_projection.ProjectionConfig]
ChooseMixerConfig = Callable[[MixerStepDims], decode_mixer.MixerStepConfig]


def _name(dtype) -> str:
    return jnp.dtype(dtype).name


def _dtypes_unsupported_reason(dtypes: dict) -> Optional[str]:
    for name, dtype in dtypes.items():
        if dtype is not None and dtype not in KERNEL_DTYPES:
            return f"{name} is {dtype}; the kernels take bfloat16, float16 or float32: use backend='xla' or cast"
    return None


def _symbolic_sizes_reason(dims) -> Optional[str]:
    """`symbolic_sizes_reason` of every field of a ProjectionDims or MixerStepDims."""
    return symbolic_sizes_reason(**{field.name: getattr(dims, field.name) for field in dataclasses.fields(dims)})


def projection_unsupported_reason(dims: ProjectionDims) -> Optional[str]:
    """Why the projection kernel cannot run this call here (None when it can)."""
    reason = _symbolic_sizes_reason(dims) or _dtypes_unsupported_reason({
        "x": dims.dtype, "dtype": dims.out_dtype, "weight": dims.weight_dtype,
        "norm_weight": dims.norm_weight_dtype if dims.has_norm else None, "z": dims.z_dtype if dims.has_z else None,
        "residual": dims.residual_in_dtype, "residual_dtype": dims.residual_dtype})
    return reason or decode_projection.projection_unsupported_reason(dims) or gpu_unavailable_reason()


def mixer_unsupported_reason(dims: MixerStepDims) -> Optional[str]:
    """Why the mixer step kernel cannot run this call here (None when it can)."""
    reason = _symbolic_sizes_reason(dims) or _dtypes_unsupported_reason({
        "zxbcdt": dims.dtype, "conv_state": dims.conv_state_dtype, "ssm_state": dims.ssm_state_dtype,
        "conv_weight": dims.conv_weight_dtype, "conv_bias": dims.conv_bias_dtype, "A_log": dims.A_log_dtype,
        "dt_bias": dims.dt_bias_dtype, "D": dims.D_dtype})
    return reason or decode_mixer.mixer_step_unsupported_reason(dims) or gpu_unavailable_reason()


def _dummy(shape, dtype):
    return jnp.zeros(shape, dtype)


def _projection_once(run_plan: RunPlan, config: ChooseProjectionConfig, dims: ProjectionDims, layer_index, x,
                     residual, z, norm_weight, weight, bias, sum_squares):
    specs = decode_projection.norm_project_inputs(dims)
    arrays = dict(layer_index=layer_index, x=x, residual=residual, z=z, norm_weight=norm_weight, weight=weight,
                  bias=bias, sum_squares=sum_squares)
    arrays = {name: _dummy(specs[name].shape, specs[name].dtype) if a is None else a for name, a in arrays.items()}
    out = run_plan(decode_projection.norm_project_plan(dims, config(dims)), arrays)
    # Each output varies over the mesh axes of what it is computed from (the kernels' outputs carry none): the
    # product over those of every array, the residual stream over x's and the residual's alone.
    product = _compat.match_varying_axes(out["partials" if dims.out_parts else "out"],
                                         (layer_index, x, residual, z, norm_weight, weight, bias, sum_squares))
    residual_out = _compat.match_varying_axes(out["residual_out"], (x, residual)) if dims.write_residual else None
    return product, residual_out


def _parts_last(x, batched: bool):
    """Partial sums (items, parts, rows, K) (or unmapped (parts, rows, K)) with the parts axis last, so that the
    items fold into the rows as they do for (rows, K) arrays."""
    return jnp.moveaxis(x, 1 if batched else 0, -1)


@functools.cache
def _batchable_projection(run_plan: RunPlan, config: ChooseProjectionConfig, dims: ProjectionDims):
    @jax.custom_batching.custom_vmap
    def project(layer_index, x, residual, z, norm_weight, weight, bias, sum_squares):
        return _projection_once(run_plan, config, dims, layer_index, x, residual, z, norm_weight, weight, bias,
                                sum_squares)

    @project.def_vmap
    def project_vmap(axis_size, in_batched, layer_index, x, residual, z, norm_weight, weight, bias, sum_squares):
        args = (layer_index, x, residual, z, norm_weight, weight, bias, sum_squares)
        out_batched = (True, True if dims.write_residual else None)
        if any(in_batched[i] for i in (0, 4, 5, 6)):  # a layer or weights per item: one launch each
            return map_items(project, args, in_batched, axis_size), out_batched
        # The items fold into the rows: x's and the partials' rows are their second axis with partial sums.
        x = _parts_last(x, in_batched[1]) if dims.x_parts else x
        per_row = (x, residual, z, sum_squares)
        rows = [None if a is None else fold(a, b, axis_size) for a, b in zip(per_row, in_batched[1:4] + in_batched[7:])]
        if dims.x_parts:
            rows[0] = jnp.moveaxis(rows[0], -1, 0)
        x, residual, z, sum_squares = rows
        outputs = _batchable_projection(run_plan, config, dataclasses.replace(dims, rows=axis_size * dims.rows))(
            layer_index, x, residual, z, norm_weight, weight, bias, sum_squares)
        out, residual_out = outputs
        if dims.out_parts:  # (parts, items * rows, N) -> (items, parts, rows, N)
            out = jnp.moveaxis(unfold(jnp.moveaxis(out, 0, -1), axis_size), -1, 1)
        else:
            out = unfold(out, axis_size)
        return (out, None if residual_out is None else unfold(residual_out, axis_size)), out_batched

    return project


def _mixer_once(run_plan: RunPlan, config: ChooseMixerConfig, dims: MixerStepDims, layer_index, zxbcdt, conv_state,
                conv_weight, conv_bias, A_log, dt_bias, D, ssm_state):
    arrays = dict(layer_index=layer_index, zxbcdt=zxbcdt, conv_state=conv_state, conv_weight=conv_weight,
                  conv_bias=_dummy((1, 1), conv_weight.dtype) if conv_bias is None else conv_bias, A_log=A_log,
                  dt_bias=dt_bias, D=D, ssm_state=ssm_state)
    plan = decode_mixer.mixer_step_plan(dims, config(dims))
    out = run_plan(plan, arrays)
    # Each output varies over the mesh axes of what it is computed from (the kernels' outputs carry none): the conv
    # windows over those of zxbcdt's xBC columns shifted into the conv state, the rest over every array's.
    windows = (layer_index, zxbcdt, conv_state)
    every = (*windows, conv_weight, conv_bias, A_log, dt_bias, D, ssm_state)
    return tuple(_compat.match_varying_axes(out[name], windows if name in ("conv_state", "group_windows") else every)
                 for name in plan.outputs)


@functools.cache
def _batchable_mixer(run_plan: RunPlan, config: ChooseMixerConfig, dims: MixerStepDims):
    @jax.custom_batching.custom_vmap
    def step(layer_index, zxbcdt, conv_state, conv_weight, conv_bias, A_log, dt_bias, D, ssm_state):
        return _mixer_once(run_plan, config, dims, layer_index, zxbcdt, conv_state, conv_weight, conv_bias, A_log,
                           dt_bias, D, ssm_state)

    @step.def_vmap
    def step_vmap(axis_size, in_batched, *args):
        # The state stacks hold the rows on their second axis: mapped items run one launch each rather than
        # moving the whole stacks to fold them in.
        return map_items(step, args, in_batched, axis_size), (True,) * (5 if dims.has_sum_squares else 4)

    return step


@dataclasses.dataclass(frozen=True)
class DecodeKernels:
    """The kernel path of the decode ops for one plan executor.

    project(dims, layer_index, x, residual, z, norm_weight, weight, bias, sum_squares) -> (out, residual_out or
    None), with the per-layer arrays as stacks (norm_weight (L, NGROUPS, GROUP_SIZE)) and None for absent ones;
    mixer_step(dims, layer_index, zxbcdt, conv_state, conv_weight, conv_bias, A_log, dt_bias, D, ssm_state) ->
    (y (M, H, P), the ssm_state stack updated, the conv_state stack with the layer's x channels updated, B's and
    C's new windows (M, 2 NGROUPS DSTATE, D_CONV)) and with dims.norm_z_offset the blocks' sums of squares
    (M, parts).
    """

    project: Callable
    mixer_step: Callable


def make_kernels(run_plan: RunPlan,
                 projection_config: ChooseProjectionConfig = decode_projection.projection_default_config,
                 mixer_config: ChooseMixerConfig = decode_mixer.mixer_step_default_config) -> DecodeKernels:
    """The decode ops' kernel path with every plan run by `run_plan` (ffi.run_plan, callback.run_plan, ...) in the
    tiles and hints the config functions choose (benchmarks/decode_kernels.py passes its sweep's). Keep one
    function object per choice: the traced kernels are cached per (run_plan, config, dims)."""
    def project(dims, *arrays):
        return _batchable_projection(run_plan, projection_config, dims)(*arrays)

    def mixer_step(dims, *arrays):
        return _batchable_mixer(run_plan, mixer_config, dims)(*arrays)

    return DecodeKernels(project, mixer_step)


KERNELS = {"cutile": make_kernels(ffi.run_plan), "cutile_callback": make_kernels(callback.run_plan)}


def projection_dims(x, residual, z, norm_weight, weight, bias, sum_squares=None, *, group_size: int,
                    norm_before_gate: bool, eps: float, z_offset: int, transpose_weight: bool, residual_dtype, dtype,
                    x_dtype=None, return_partials: bool = False) -> ProjectionDims:
    """The projection kernel's problem for `jax_mamba2.decode.norm_project`'s arrays (per-layer ones stacked,
    norm_weight (L, ngroups, group_size); x (rows, K) or (parts, rows, K) partial sums; sum_squares (rows, parts)
    or None) and options."""
    layers = weight.shape[0]
    rows, features = x.shape[-2:]
    return ProjectionDims(
        rows=rows, features=features, out_features=weight.shape[1] if transpose_weight else weight.shape[2],
        x_parts=x.shape[0] if x.ndim == 3 else 0, out_parts=return_partials,
        norm_parts=0 if sum_squares is None else sum_squares.shape[1] // (features // group_size),
        layers=layers, ngroups=features // group_size, group_size=group_size, has_norm=norm_weight is not None,
        has_residual=residual is not None, write_residual=residual_dtype is not None,
        z_width=0 if z is None else z.shape[1], z_offset=z_offset, norm_before_gate=norm_before_gate,
        transpose_weight=transpose_weight, has_bias=bias is not None, eps=eps, dtype=_name(x_dtype or x.dtype),
        out_dtype=_name(dtype), weight_dtype=_name(weight.dtype),
        norm_weight_dtype=_name(weight.dtype if norm_weight is None else norm_weight.dtype),
        z_dtype=_name((x_dtype or x.dtype) if z is None else z.dtype),
        residual_dtype=None if residual_dtype is None else _name(residual_dtype),
        residual_in_dtype=None if residual is None else _name(residual.dtype))


def mixer_dims(zxbcdt, conv_state, conv_weight, conv_bias, A_log, dt_bias, D, ssm_state, *, nheads: int,
               headdim: int, ngroups: int, dstate: int, xbc_offset: int, dt_offset: int, z_offset, dt_limit,
               norm_z_offset=None, norm_group_size=None, norm_before_gate: bool = False) -> MixerStepDims:
    """The mixer step kernel's problem for `jax_mamba2.decode.mixer_step`'s arrays (stacked) and options (the
    norm's group size is the op's to check: the kernel's pieces of a head never cross one)."""
    del norm_group_size
    return MixerStepDims(
        rows=zxbcdt.shape[0], nheads=nheads, headdim=headdim, ngroups=ngroups, dstate=dstate,
        in_width=zxbcdt.shape[1], xbc_offset=xbc_offset, dt_offset=dt_offset, layers=conv_state.shape[0],
        d_conv=conv_state.shape[-1], z_offset=z_offset, norm_z_offset=norm_z_offset,
        norm_before_gate=norm_before_gate, d_per_channel=D.ndim == 3,
        has_conv_bias=conv_bias is not None, dt_softplus=True, dt_limit=tuple(dt_limit), dtype=_name(zxbcdt.dtype),
        conv_state_dtype=_name(conv_state.dtype), ssm_state_dtype=_name(ssm_state.dtype),
        conv_weight_dtype=_name(conv_weight.dtype),
        conv_bias_dtype=None if conv_bias is None else _name(conv_bias.dtype), A_log_dtype=_name(A_log.dtype),
        dt_bias_dtype=_name(dt_bias.dtype), D_dtype=_name(D.dtype))


def unsupported_reason(dims) -> Optional[str]:
    """Why the kernels cannot run a decode op's call (its ProjectionDims or MixerStepDims) here."""
    if isinstance(dims, ProjectionDims):
        return projection_unsupported_reason(dims)
    return mixer_unsupported_reason(dims)
