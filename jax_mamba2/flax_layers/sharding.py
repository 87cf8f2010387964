"""`shard_model`: run a Mamba-2 model on a (data, model) device mesh.

Batch rows are split over the "data" axis and heads over the "model" axis. Every `Mamba2` mixer then runs
inside `jax.shard_map` with explicit collectives (see `partition` for the layout and why in_proj is split
over its input rows):

  in_proj    each device gets its heads' z, x, dt (B/C: by group when ngroups % model == 0, else all of
             them, and it keeps the group of its heads). Below d_model tokens per call (decode steps): a
             partial product of this device's d_model rows, then ONE reduce-scatter. From d_model tokens on
             (training): the kernel's columns come by ONE all-to-all of weights and each device multiplies
             the whole input (the backward then all-reduces the input's gradient instead of all-gathering
             the partial products' one).
  conv, ssd  local (the SSD op runs on this device's heads; A_log, D, dt_bias, norm.scale are head-split)
  norm       local, plus an all-reduce of per-group sums of squares when a group spans devices (ngroups=1)
  out_proj   partial product of this device's heads, then an all-reduce (psum) over "model"

so no activation is all-gathered. The prefill/step cache keeps ssm_state split over heads and conv_state
whole (its x channels are assembled with one small all-reduce per call: (batch, d_ssm, d_conv) values).
Outside the mixers the residual stream is split over "data" only, and the blocks' add + norm and the final
norm run inside a `shard_map` of their own over it (each device normalizes its rows; the norm kernels' custom
calls have no partitioning rule, so XLA would otherwise give them every row); the embedding (and an untied
lm_head) is split over the vocabulary on "model", so the logits come out vocabulary-split. The LM's loss runs
inside a `shard_map` over "data" alone, each device on its rows' chunks (its head product still split over the
vocabulary): left to XLA, its loop over the chunks would gather every row's hidden states onto every device.

Example:
  >>> mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)  # doctest: +SKIP
  >>> model = shard_model(load_pretrained(path), mesh)                                    # doctest: +SKIP
  >>> logits = nnx.jit(lambda m, ids: m(ids))(model, ids)                                 # doctest: +SKIP
"""
import jax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_mamba2.flax_layers._tree import param_path
from jax_mamba2.flax_layers.mamba2 import Mamba2
from jax_mamba2.flax_layers.norm import RMSNorm
from jax_mamba2.flax_layers.partition import MeshAxes, mixer_param_spec


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh, *, data_axis: str = "data",
                model_axis: str = "model") -> nnx.Module:
    """Places the model's parameters on `mesh` and makes its `Mamba2` mixers run head-parallel, and the norms
    outside them (`RMSNorm`: the blocks' and the final one) per shard of the batch rows.

    Works for a `Mamba2LMHeadModel`, a `Mamba2Block` or a `Mamba2` (any module containing mixers). The
    model is changed in place and returned. Inputs should be split over `data_axis` on their batch axis.

    Args:
      model: the module.
      mesh: a mesh with AxisType.Auto axes `data_axis` and `model_axis` (either may have size 1).
      data_axis: mesh axis for batch rows.
      model_axis: mesh axis for heads.

    Returns:
      The same model.

    Raises:
      ValueError: if an axis is missing or not Auto, or a mixer cannot be split over `model_axis`:
        nheads and d_model must be divisible by its size, ngroups must divide it or be divisible by it, and
        the gated-MLP branch (d_ssm < d_inner) is not supported with a model axis larger than 1.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"shard_model: model must be an nnx.Module, got {type(model).__name__}")
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"shard_model: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    for name, axis in (("data_axis", data_axis), ("model_axis", model_axis)):
        if not isinstance(axis, str):
            raise TypeError(f"shard_model: {name}={axis!r} must be the name of a mesh axis (a str)")
    if data_axis == model_axis:
        raise ValueError(f"shard_model: data_axis and model_axis must be different mesh axes; both are "
                         f"{data_axis!r}")
    axis_types = dict(zip(mesh.axis_names, mesh.axis_types))
    for name, axis in (("data_axis", data_axis), ("model_axis", model_axis)):
        if axis not in axis_types:
            raise ValueError(f"shard_model: {name}={axis!r} must be an axis of the mesh, one of "
                             f"mesh.axis_names={mesh.axis_names} (a mesh axis of size 1 leaves that split out)")
        if axis_types[axis] != AxisType.Auto:
            raise ValueError(f"shard_model: mesh axis {axis!r} has type {axis_types[axis]}; it must be "
                             "AxisType.Auto (the mixers place their collectives themselves)")
    size = mesh.shape[model_axis]
    mixers = [(path, module) for path, module in nnx.iter_modules(model) if isinstance(module, Mamba2)]
    for _, mixer in mixers:  # every mixer checked before any is changed
        _check_splittable(mixer, size)
    for _, mixer in mixers:
        mixer.mesh_axes = MeshAxes(mesh, data_axis, model_axis if size > 1 else None)
    mixer_paths = [tuple(str(p) for p in path) for path, _ in mixers]
    for path, module in nnx.iter_modules(model):  # the norms outside the mixers run per shard of their rows
        if isinstance(module, RMSNorm) and not any(tuple(str(p) for p in path)[:len(prefix)] == prefix
                                                   for prefix in mixer_paths):
            module.mesh_axes = MeshAxes(mesh, data_axis, None)

    def spec_of(tree_path, leaf):
        path = param_path(tree_path)
        spec = P()
        for prefix in mixer_paths:
            if path[:len(prefix)] == prefix:
                spec = mixer_param_spec(path[len(prefix):], model_axis)
        if path == ("embedding", "embedding") and leaf.shape[0] % size == 0:  # vocabulary-split
            spec = P(model_axis, None)
        if path == ("lm_head", "kernel") and leaf.shape[1] % size == 0:
            spec = P(None, model_axis)
        # Stacked layers carry a leading (n_layer,) axis that stays whole.
        return NamedSharding(mesh, P(*([None] * (leaf.ndim - len(spec))), *spec))

    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, jax.tree_util.tree_map_with_path(spec_of, state)))
    return model


def _check_splittable(mixer: Mamba2, size: int) -> None:
    if size == 1:
        return
    if mixer.nheads % size or mixer.d_model % size:
        raise ValueError(f"shard_model: nheads={mixer.nheads} and d_model={mixer.d_model} must be divisible by "
                         f"the model axis size {size}")
    if mixer.ngroups % size and size % mixer.ngroups:
        raise ValueError(f"shard_model: ngroups={mixer.ngroups} must divide the model axis size {size} or be "
                         "divisible by it")
    if mixer.d_mlp:
        raise ValueError(f"shard_model: d_ssm={mixer.d_ssm} < d_inner={mixer.d_inner} (gated-MLP branch) is not "
                         "supported with a model axis larger than 1")
