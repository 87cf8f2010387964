"""Pretrained weights: mamba_ssm / HuggingFace checkpoints in and out, and Orbax checkpoints of NNX state.

`load_pretrained(path)` reads a local directory with `config.json` (mamba_ssm or HF transformers format) and
the weights (`model.safetensors`, sharded safetensors with `model.safetensors.index.json`, or
`pytorch_model.bin` or its shards with `pytorch_model.bin.index.json` when torch is installed), in mamba_ssm
naming (`backbone.embedding.weight`, `backbone.layers.{i}.mixer.in_proj.weight`, ...) or HF naming
(`backbone.embeddings.weight`), or HF's base `Mamba2Model` (no `backbone.` prefix, no head) for a tied config.
`save_pretrained(model, path)` writes an HF-compatible `config.json` and `model.safetensors`, atomically.

Training checkpoints (any model, any sharding) are better kept as NNX state with Orbax:

  >>> import orbax.checkpoint as ocp
  >>> _, state = nnx.split(model)                                   # doctest: +SKIP
  >>> ocp.StandardCheckpointer().save(path / "state", state)        # doctest: +SKIP
  >>> abstract = nnx.eval_shape(lambda: Mamba2LMHeadModel(config, rngs=nnx.Rngs(0)))  # doctest: +SKIP
  >>> graphdef, abstract_state = nnx.split(abstract)                # doctest: +SKIP
  >>> state = ocp.StandardCheckpointer().restore(path / "state", abstract_state)     # doctest: +SKIP
  >>> model = nnx.merge(graphdef, state)                            # doctest: +SKIP

(`StandardCheckpointer` saves asynchronously: call `wait_until_finished()` before reading the directory.
Restoring into an abstract state whose leaves carry shardings places each array on its devices.)
"""
import contextlib
import json
import os
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jax_mamba2._files import fsync, sync_directory
from jax_mamba2._staging import carry_over, remove_abandoned_staging, replace_dir, staging_dir
from jax_mamba2.checks import float_dtype
from jax_mamba2.flax_layers import weight_files
from jax_mamba2.flax_layers._tree import param_path
from jax_mamba2.flax_layers.config import Mamba2Config
from jax_mamba2.flax_layers.lm import Mamba2LMHeadModel, check_model_options

# (checkpoint name, path in Mamba2LMHeadModel, layout). Layouts: "same"; "linear": torch (out, in) ->
# NNX kernel (in, out); "conv": torch conv1d.weight (channels, 1, d_conv) -> kernel (d_conv, channels).
# The first name of a path is the one `save_pretrained` writes (HF naming).
_TOP_LEVEL = (
    ("backbone.embeddings.weight", ("embedding", "embedding"), "same"),
    ("backbone.embedding.weight", ("embedding", "embedding"), "same"),
    ("backbone.norm_f.weight", ("norm_f", "scale"), "same"),
    ("lm_head.weight", ("lm_head", "kernel"), "linear"),
)
# Per layer: "backbone.layers.{i}." + name -> ("layers",) + path, at index i of the stacked parameter.
_PER_LAYER = (
    ("norm.weight", ("norm", "scale"), "same"),
    ("mixer.in_proj.weight", ("mixer", "in_proj", "kernel"), "linear"),
    ("mixer.in_proj.bias", ("mixer", "in_proj", "bias"), "same"),
    ("mixer.conv1d.weight", ("mixer", "conv1d", "kernel"), "conv"),
    ("mixer.conv1d.bias", ("mixer", "conv1d", "bias"), "same"),
    ("mixer.dt_bias", ("mixer", "dt_bias"), "same"),
    ("mixer.A_log", ("mixer", "A_log"), "same"),
    ("mixer.D", ("mixer", "D"), "same"),
    ("mixer.norm.weight", ("mixer", "norm", "scale"), "same"),
    ("mixer.out_proj.weight", ("mixer", "out_proj", "kernel"), "linear"),
    ("mixer.out_proj.bias", ("mixer", "out_proj", "bias"), "same"),
)
_EMBEDDING = ("embedding", "embedding")
_LAYER_NAME = re.compile(r"backbone\.layers\.(\d+)\.(.+)")


def _map_hf_key(name: str) -> tuple[tuple[str, ...], int | None, str]:
    """Checkpoint tensor name -> (parameter path in the model, layer index or None, layout).

    Raises:
      KeyError: for a name that is not a Mamba-2 LM parameter.
    """
    for checkpoint_name, path, layout in _TOP_LEVEL:
        if name == checkpoint_name:
            return path, None, layout
    match = _LAYER_NAME.fullmatch(name)
    if match:
        for checkpoint_name, path, layout in _PER_LAYER:
            if match.group(2) == checkpoint_name:
                return ("layers", *path), int(match.group(1)), layout
    raise KeyError(name)


def _to_model_layout(array: np.ndarray, layout: str) -> np.ndarray:
    if layout == "linear":
        return array.T
    if layout == "conv":
        return array[:, 0, :].T
    return array


def _to_checkpoint_layout(array: np.ndarray, layout: str) -> np.ndarray:
    if layout == "linear":
        return np.ascontiguousarray(array.T)
    if layout == "conv":
        return np.ascontiguousarray(array.T[:, None, :])
    return array


def _checkpoint_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The shape a checkpoint holds a parameter of model shape `shape` in (`_to_checkpoint_layout`'s)."""
    if layout == "linear":
        return tuple(reversed(shape))
    if layout == "conv":
        return (shape[1], 1, shape[0])
    return tuple(shape)


def _checkpoint_name(path: tuple[str, ...], layer: int | None) -> tuple[str, str]:
    """Inverse of `_map_hf_key` (HF naming): (tensor name, layout)."""
    if layer is None:
        return next((name, layout) for name, p, layout in _TOP_LEVEL if p == path)
    name, layout = next((name, layout) for name, p, layout in _PER_LAYER if ("layers", *p) == path)
    return f"backbone.layers.{layer}.{name}", layout


# Keys that tell the two config.json formats apart.
_MAMBA_SSM_KEYS = ("d_model", "n_layer", "ssm_cfg")
_HF_KEYS = ("hidden_size", "num_hidden_layers", "model_type")


def load_config(path) -> Mamba2Config:
    """Reads `config.json` of a checkpoint directory: mamba_ssm format (has "d_model", "n_layer" or
    "ssm_cfg") or HF transformers format (has "hidden_size", "num_hidden_layers" or "model_type").

    Raises:
      FileNotFoundError: if `path` or its config.json does not exist.
      ValueError: for a `path` that is a file, not the checkpoint's directory, or a config.json that is no file.
      ValueError, TypeError: for a file that is not JSON or not a Mamba-2 configuration, naming the file and
        the offending key.
    """
    return _load_config(path, "load_config")


def _checkpoint_dir(path, caller: str) -> pathlib.Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{caller}: path={path!r} must be a str or os.PathLike (a checkpoint directory)")
    directory = pathlib.Path(path)
    if not directory.is_dir():  # a file of the checkpoint, or a hub id: say what path must be
        exists = directory.exists()
        raise (ValueError if exists else FileNotFoundError)(
            f"{caller}: path={str(path)!r} {'is not a directory' if exists else 'does not exist'}: it must be "
            "a local checkpoint directory, holding config.json and the weights (nothing is downloaded)")
    return directory


def _load_config(path, caller: str) -> Mamba2Config:
    """`load_config` for `caller`, the public function its errors name."""
    config_file = _checkpoint_dir(path, caller) / "config.json"
    if not config_file.is_file():
        if config_file.exists():
            raise ValueError(f"{caller}: {config_file} is not a file: it must be the checkpoint's JSON config")
        raise FileNotFoundError(f"{caller}: {config_file} does not exist")
    raw = weight_files.read_json(config_file, caller)
    if not isinstance(raw, dict):
        raise ValueError(f"{caller}: {config_file} must hold a JSON object, not {type(raw).__name__}")
    if any(key in raw for key in _MAMBA_SSM_KEYS):
        parse = Mamba2Config.from_mamba_ssm
    elif any(key in raw for key in _HF_KEYS):
        parse = Mamba2Config.from_hf
    else:
        raise ValueError(f"{caller}: {config_file} has none of the keys {list(_MAMBA_SSM_KEYS)} "
                         f"(mamba_ssm) or {list(_HF_KEYS)} (HF transformers)")
    try:
        return parse(raw)
    except (ValueError, TypeError) as e:
        raise (TypeError if isinstance(e, TypeError) else ValueError)(f"{caller}: {config_file}: {e}") from e


def load_hf_state(path) -> dict[str, np.ndarray]:
    """Reads all tensors of a checkpoint directory as NumPy arrays, by name.

    Looks for `model.safetensors`, then `model.safetensors.index.json` (sharded), then `pytorch_model.bin`, then
    `pytorch_model.bin.index.json` (sharded; both need torch, which memory-maps each file, or reads it whole where
    it is in torch's legacy format; their tensors detached). float8 tensors (safetensors' F8_E4M3, F8_E5M2 and
    F8_E8M0, torch's float8 dtypes) and torch's bfloat16 ones come as float32, which holds them exactly.

    Raises:
      FileNotFoundError: if `path` does not exist, there are no weights, or a shard named by the index is
        missing.
      ValueError: for a `path` that is a file, not the checkpoint's directory; for an index without a
        `weight_map` object, a shard that holds other tensors than the index gives it, a file that safetensors
        or torch cannot read, or a PyTorch file's entry that is not a tensor.
      TypeError: for a path that is not a str or os.PathLike, or a PyTorch tensor of a dtype NumPy cannot hold.
      ImportError: for PyTorch weights (the only weights there) without torch installed.
    """
    with contextlib.ExitStack() as handles:
        _, tensors = weight_files.open_weights(_checkpoint_dir(path, "load_hf_state"), "load_hf_state", handles)
        return {name: tensor.read() for name, tensor in tensors.items()}


def load_pretrained(path, *, dtype=None, param_dtype=jnp.float32, backend: str = "auto",
                    scan_layers: bool = True, **model_options) -> Mamba2LMHeadModel:
    """Builds a `Mamba2LMHeadModel` from a local mamba_ssm or HF transformers checkpoint directory.

    The model is created abstractly (`nnx.eval_shape`, no random init), every parameter is assigned from the
    checkpoint, and the result is merged. For tied embeddings a stored `lm_head.weight` must be the embedding
    (mamba_ssm stores both), and is taken as the embedding where the checkpoint stores only the head (HF's save
    may keep either name of the tied matrix). A checkpoint of HF's base `Mamba2Model` (the backbone alone, its
    tensors saved without the `backbone.` prefix: `embeddings.weight`, `layers.{i}.mixer.in_proj.weight`, ...,
    `norm_f.weight`) loads where config.json ties the head to the embedding, which is then the head. config.json
    is checked, and the model built from it, before any weight file is opened. A `save_pretrained` to `path`
    while it loads does not mix two checkpoints: the weight files stay open until every tensor is read, and
    config and weights come from one save.

    Args:
      path: directory with config.json and the weights (see `load_hf_state`).
      dtype: computation dtype of the model (default: None, inferred from the parameters).
      param_dtype: parameter dtype; checkpoint tensors are cast to it (default: float32).
      backend: SSD backend of the mixers (default: "auto").
      scan_layers: as `Mamba2LMHeadModel`'s (default: True, one layer scan); False unrolls the blocks, which
        compiles longer and decodes large batches faster (`generate` then carries one cache per layer).
      **model_options: `Mamba2LMHeadModel`'s other options (`remat`, `loss_backend`, `check_finite`,
        `deterministic_backward`, `save_chunk_states`), e.g. `remat="matmuls"` to fine-tune a large checkpoint;
        by default the constructor's.

    Returns:
      The model, on the default device.

    Raises:
      ValueError: listing the checkpoint tensors that match no parameter (unknown keys) and the parameters
        (with runs of layer indices) that no tensor assigned, or naming a tensor of the wrong shape and the file
        (shard) that holds it; for a base model's checkpoint (no LM head) under a config.json that does not tie the
        head to the embedding.
      TypeError: naming a tensor stored in a dtype that is not a float, and the file that holds it.
      ValueError, TypeError: for a config.json that is not a Mamba-2 configuration (see `load_config`) or
        whose mixer options `Mamba2` rejects, naming the file and the option; for an unknown backend, a model
        option the constructor would reject (TypeError for one it does not take) or a dtype that is not floating;
        for weights `load_hf_state` cannot read.
      FileNotFoundError, ValueError: for a `path` that does not exist or is a file, not the checkpoint's
        directory (see `load_config`); FileNotFoundError: for missing weights (see `load_hf_state`).
      ImportError: for PyTorch weights (the only weights there) without torch installed.
    """
    # The arguments first: errors below are config.json's.
    model_options = {**model_options, "backend": backend, "scan_layers": scan_layers}
    check_model_options("load_pretrained", model_options)
    if dtype is not None:
        float_dtype("load_pretrained", "dtype", dtype)
    param_dtype = float_dtype("load_pretrained", "param_dtype", param_dtype)
    directory = _checkpoint_dir(path, "load_pretrained")

    def build():  # config.json's model, built abstractly before any weight file is opened
        config = _load_config(directory, "load_pretrained")
        return config, _abstract_model(directory, config, dtype=dtype, param_dtype=param_dtype, **model_options)
    with contextlib.ExitStack() as handles:  # the weight files, open until every tensor is read
        (config, abstract), tensors = weight_files.open_weights(directory, "load_pretrained", handles,
                                                                before_opening=build)
        return _assign_checkpoint(directory, config, abstract, tensors, param_dtype=param_dtype)


def _abstract_model(path: pathlib.Path, config: Mamba2Config, *, dtype, param_dtype,
                    **model_options) -> Mamba2LMHeadModel:
    """`load_pretrained`'s model of `config`, its parameters abstract (`nnx.eval_shape`: no random init)."""
    try:
        return nnx.eval_shape(lambda: Mamba2LMHeadModel(config, dtype=dtype, param_dtype=param_dtype,
                                                        **model_options, rngs=nnx.Rngs(0)))
    except (ValueError, TypeError) as e:  # a mixer option of config.json that Mamba2 rejects, named by it
        raise (TypeError if isinstance(e, TypeError) else ValueError)(
            f"load_pretrained: {path / 'config.json'}: {e}") from e


# The names of a base model's tensors, the backbone's without its "backbone." prefix: HF's `Mamba2Model` saves
# them so (and `embedding.weight`, mamba_ssm's name, which HF's renames on load).
_BASE_MODEL_NAME = re.compile(r"embeddings?\.weight|norm_f\.weight|layers\.\d+\..+")


def _is_base_model(names) -> bool:
    """Whether a checkpoint's tensor names are a base model's: some backbone names without the prefix and none
    with it (a checkpoint that mixes the two keeps its names, the unprefixed ones then unknown)."""
    names = list(names)
    return (any(_BASE_MODEL_NAME.fullmatch(name) for name in names)
            and not any(name.startswith("backbone.") for name in names))


# How many runs of missing layers, and unknown keys, an error lists before it counts the rest.
_LISTED = 8


def _missing_layers(assigned: set[int], n_layer: int) -> str:
    """The layers in range(n_layer) that `assigned` lacks as runs ("layers 0-23", "layer 5", "layers 1, 4-6"), the
    first few and a count of the rest, so that a message stays short however many layers config.json has: found by
    walking `assigned` (the checkpoint's layers), never range(n_layer)."""
    runs, start = [], 0
    for layer in (*sorted(assigned), n_layer):
        if layer > start:
            runs.append(f"{start}" if layer == start + 1 else f"{start}-{layer - 1}")
        start = layer + 1
    text = ", ".join(runs[:_LISTED])
    if len(runs) > _LISTED:
        text += f", ... ({len(runs) - _LISTED} more runs; {n_layer - len(assigned)} of {n_layer} layers)"
    return f"layer {text}" if n_layer - len(assigned) == 1 else f"layers {text}"


def _some(names: list[str]) -> str:
    """`names` as a list, or its first few and a count of the rest."""
    if len(names) <= 2 * _LISTED:
        return str(names)
    return f"{str(names[:_LISTED])[:-1]}, ... ({len(names) - _LISTED} more)]"


def _assign_checkpoint(path: pathlib.Path, config: Mamba2Config, abstract: Mamba2LMHeadModel,
                       tensors: dict[str, weight_files.StoredTensor], *, param_dtype) -> Mamba2LMHeadModel:
    """`load_pretrained`'s model: `abstract` (of `config`) with every parameter read from `tensors`."""
    # Weights can be large: every name and shape is checked from the files' headers before any tensor is read,
    # and each is then read straight into its parameter's buffer.
    graphdef, abstract_state = nnx.split(abstract)
    shapes = {param_path(p): leaf.shape for p, leaf in jax.tree_util.tree_leaves_with_path(abstract_state)}
    # What the tensors assign of each parameter: its layers, or None for a whole one. Not what they leave out,
    # which would take n_layer entries per parameter, however few layers the checkpoint holds.
    assigned = {path: set() for path in shapes}
    base_model = _is_base_model(tensors)
    if base_model and "lm_head.weight" not in tensors and not config.tie_embeddings:
        raise ValueError(f"load_pretrained: checkpoint {path} holds a base model without an LM head (its tensors "
                         "named as HF's Mamba2Model saves them, with no 'backbone.' prefix, and no lm_head.weight), "
                         "and config.json does not tie the head to the embedding (tie_word_embeddings / "
                         "tie_embeddings is false): it holds no language model")
    unknown, tied_head, plan = [], [], []
    for name, tensor in tensors.items():
        try:
            target, layer, layout = _map_hf_key(  # a base model's backbone names lack the prefix
                f"backbone.{name}" if base_model and _BASE_MODEL_NAME.fullmatch(name) else name)
        except KeyError:
            unknown.append(name)
            continue
        # A head tied to the embedding is a copy of it (mamba_ssm stores both): its dtype and shape are checked
        # here as the embedding's, its values once the embedding is read.
        tied = target == ("lm_head", "kernel") and config.tie_embeddings
        if tied:
            target, layout = _EMBEDDING, "same"
        elif target not in shapes or (layer is not None and layer >= config.n_layer):
            unknown.append(name)
            continue
        elif layer in assigned[target]:
            raise ValueError(f"load_pretrained: {tensor.file}: {name} assigns {'.'.join(target)}"
                             f"{'' if layer is None else f' of layer {layer}'} a second time (another tensor "
                             "of the checkpoint holds it too)")
        if not tensor.floating:
            raise TypeError(f"load_pretrained: {tensor.file}: {name} holds {tensor.dtype} values; a parameter must be "
                            f"stored in a float dtype ({', '.join(tensor.float_dtypes)})")
        expected = shapes[target][1:] if layer is not None else shapes[target]
        stored = _checkpoint_shape(expected, layout)
        if tensor.shape != stored:
            raise ValueError(f"load_pretrained: {tensor.file}: {name}.shape={tensor.shape} must be {stored} (for "
                             f"{'.'.join(target)} of shape {expected})")
        if tied:
            tied_head.append(name)
            continue
        plan.append((name, target, layer, layout))
        assigned[target].add(layer)
    if tied_head and not assigned[_EMBEDDING]:
        # Tied weights stored once under the head's name (HF's save keeps either name of a shared tensor): the
        # head is the embedding, its shape checked as the embedding's above.
        plan.append((tied_head.pop(), _EMBEDDING, None, "same"))
        assigned[_EMBEDDING].add(None)
    missing = []
    for param, layers in assigned.items():
        if param[0] != "layers" and not layers:
            missing.append(".".join(param))
        elif param[0] == "layers" and len(layers) < config.n_layer:
            missing.append(f"{'.'.join(param)}[{_missing_layers(layers, config.n_layer)}]")
    missing.sort()
    if unknown or missing:
        raise ValueError(f"load_pretrained: checkpoint {path} does not match the model: unknown keys "
                         f"{_some(sorted(unknown))}; unassigned parameters {missing}")
    buffers = {path: np.empty(shape, np.dtype(param_dtype)) for path, shape in shapes.items()}  # all assigned
    for name, target, layer, layout in plan:
        buffers[target][layer if layer is not None else ...] = _to_model_layout(tensors[name].read(), layout)
    embedding = buffers[_EMBEDDING]
    for name in tied_head:
        head = tensors[name].read()
        # A copy is equal where both hold NaN too (the weights of a run that diverged load as they are).
        if not np.array_equal(head.astype(embedding.dtype), embedding, equal_nan=True):
            raise ValueError(f"load_pretrained: {tensors[name].file}: {name} differs from the embedding, which "
                             "config.json ties it to (tie_embeddings / tie_word_embeddings): the checkpoint holds two "
                             "different heads")
    # Each buffer is let go once on the device, so the host holds the model about once.
    state = jax.tree_util.tree_map_with_path(lambda p, _: jnp.asarray(buffers.pop(param_path(p))), abstract_state)
    return nnx.merge(graphdef, state)


def save_pretrained(model: Mamba2LMHeadModel, path) -> None:
    """Writes `config.json` (HF transformers `Mamba2Config`) and `model.safetensors` (HF names, PyTorch
    layouts, parameter dtypes) into directory `path` (created if needed). Tied embeddings are written once.

    The save is atomic: the checkpoint is written into a new hidden directory beside `path`, which then
    replaces `path`; should the save fail or the process die before that, `path` keeps the previous
    checkpoint (or does not exist, if it did not), never a mix. On Linux the two directories are exchanged in
    one step (`renameat2`), so `path` always names a whole checkpoint; elsewhere (or on a file system without
    the exchange) the previous one is renamed aside first, and a process killed between the two renames
    leaves it, complete, in `.{name}.old-*` beside `path`. The staging directory of a killed save is deleted
    by the next save on the same host; a live one is told apart by the advisory lock (`flock`) its save holds
    on a file beside it, which the system drops when that process dies, so that saves in different PID
    namespaces (containers sharing a host name and a volume) never delete each other's.

    Other files in `path` (a tokenizer, ...) are carried over as hard links (copies where the file system has
    none), except the weights in other forms (shards and their index, `pytorch_model*.bin`, Flax's and TF's
    files), which held the old model.

    An unbounded `time_step_limit` is written as `[low, Infinity]`, the form mamba_ssm and transformers 4.x
    write and every transformers release reads.

    Raises:
      ValueError: if the model uses mixer options HF transformers cannot express (see `Mamba2Config.to_hf`),
        or `path` exists and is not a directory, is the working directory or one holding it (the save
        replaces the directory), or lies under a file.
      TypeError: for a path that is not a str or os.PathLike.
    """
    if not isinstance(model, Mamba2LMHeadModel):
        raise TypeError(f"save_pretrained: model must be a Mamba2LMHeadModel, got {type(model).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"save_pretrained: path={path!r} must be a str or os.PathLike (a directory)")
    path = pathlib.Path(path).resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"save_pretrained: {path} exists and is not a directory")
    if path == path.parent:
        raise ValueError(f"save_pretrained: path={path} must not be the file system's root")
    if path == pathlib.Path.cwd().resolve() or path in pathlib.Path.cwd().resolve().parents:
        raise ValueError(f"save_pretrained: path={path} is the working directory or holds it; the save replaces "
                         "the whole directory, so save into a subdirectory")
    if any(parent.exists() and not parent.is_dir() for parent in path.parents):
        raise ValueError(f"save_pretrained: {path}'s parent is not a directory")
    hf_config = model.config.to_hf()
    tensors = {}
    for tree_path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        model_path, array = param_path(tree_path), np.asarray(leaf)
        layers = range(array.shape[0]) if model_path[0] == "layers" else [None]
        for layer in layers:
            name, layout = _checkpoint_name(model_path, layer)
            tensors[name] = _to_checkpoint_layout(array if layer is None else array[layer], layout)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_staging(path)
    with staging_dir(path) as staging:
        if path.is_dir():
            carry_over(path, staging, skip=_OWN_FILES)
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        # safetensors creates its file private (0600); it gets config.json's mode, the one the umask leaves.
        shutil.copymode(staging / "config.json", staging / "model.safetensors")
        for file in ("config.json", "model.safetensors"):
            fsync(staging / file)
        if path.is_dir():  # the old directory's mode, once written into (a read-only one would refuse the files)
            shutil.copymode(path, staging)
        sync_directory(staging)  # its entries (carried-over files included) before it is renamed in
        replace_dir(staging, path)


# What a save writes, and every other form of a checkpoint's weights (shards, their index, PyTorch's files),
# which a save over that checkpoint must not carry over: a reader that looks for them would load the old model.
_OWN_FILES = re.compile(r"config\.json|model\.safetensors(\.index\.json)?|model-\d+-of-\d+\.safetensors"
                        r"|pytorch_model(-\d+-of-\d+)?\.bin(\.index\.json)?"
                        r"|flax_model(-\d+-of-\d+)?\.msgpack(\.index\.json)?"
                        r"|tf_model(-\d+-of-\d+)?\.h5(\.index\.json)?")
