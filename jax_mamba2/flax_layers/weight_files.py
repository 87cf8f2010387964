"""A checkpoint directory's weight files, read by their headers: safetensors (one file, or shards listed by
`model.safetensors.index.json`) and PyTorch state dicts (`pytorch_model.bin`, or shards listed by
`pytorch_model.bin.index.json`; torch reads each whole). Each tensor is a `StoredTensor`: its shape and dtype as
the file names them, and a function that reads its values, so that a load checks every name and shape before it
reads any value of a safetensors file (a PyTorch file is read whole when it is opened).
"""
import contextlib
import json
import pathlib
import pickle
import zipfile
from typing import Callable, NamedTuple, Optional, TypeVar

import numpy as np
from safetensors import SafetensorError, safe_open


def read_json(file: pathlib.Path, caller: str):
    """The JSON value in `file` (UTF-8). ValueError naming `caller` and the file where it is not JSON."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise ValueError(f"{caller}: {file} is not valid JSON: {e}") from e


class StoredTensor(NamedTuple):
    """A checkpoint tensor known by its header: its shape, its dtype as the file names it, whether that is a float
    dtype a parameter can be cast from, and how to read its values."""
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]
    dtype: str
    floating: bool


# The safetensors dtypes of parameters: the floats NumPy reads (safetensors' numpy framework has no float8).
SAFETENSORS_FLOATS = ("F64", "F32", "F16", "BF16")


def safetensors_tensors(file: pathlib.Path, caller: str, handles: contextlib.ExitStack) -> dict[str, StoredTensor]:
    """The tensors of a safetensors file by name, from its header: nothing is read until a tensor's `read`, which
    reads from the file as it was opened here (held open in `handles`), even once a save has replaced it."""
    try:
        opened = handles.enter_context(safe_open(file, framework="numpy"))
        headers = {name: (tuple(opened.get_slice(name).get_shape()), opened.get_slice(name).get_dtype())
                   for name in opened.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{caller}: {file} is not a readable safetensors file: {e}") from e

    def reader(name):
        def read():
            try:
                return opened.get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{caller}: {file} is not a readable safetensors file: {e}") from e
        return read
    return {name: StoredTensor(shape, reader(name), dtype, dtype in SAFETENSORS_FLOATS)
            for name, (shape, dtype) in headers.items()}


_Built = TypeVar("_Built")

# How often a load opens a checkpoint again when a save replaced its directory while it was being opened.
OPEN_ATTEMPTS = 3


def _directory_identity(path: pathlib.Path):
    """What a save that replaces the directory `path` changes (a new directory takes its name), or None where
    there is none."""
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_ctime_ns


def open_weights(path: pathlib.Path, caller: str, handles: contextlib.ExitStack, *,
                 before_opening: Optional[Callable[[], _Built]] = None
                 ) -> tuple[Optional[_Built], dict[str, StoredTensor]]:
    """(what `before_opening` returns, or None without it; the tensors by name, see `weight_tensors`) of the
    checkpoint directory `path`: the weight files stay open in `handles`, and where a save replaced the directory
    while they were being opened, they are opened again (`before_opening` run again first), so what it read of the
    directory (config.json) and the weights never come from two saves. It runs before any weight file is opened,
    so a config.json no model can be made of fails on its own, whatever the weights are (missing, unreadable or
    large)."""
    for _ in range(OPEN_ATTEMPTS):
        before = _directory_identity(path)
        read_before = None if before_opening is None else before_opening()
        with contextlib.ExitStack() as attempt:
            tensors = weight_tensors(path, caller, attempt)
            if _directory_identity(path) == before:
                handles.enter_context(attempt.pop_all())
                return read_before, tensors
    raise ValueError(f"{caller}: {path} was replaced (by a save to it) each of the {OPEN_ATTEMPTS} times it was "
                     "opened; load it once the saves have stopped")


def weight_tensors(path: pathlib.Path, caller: str, handles: contextlib.ExitStack) -> dict[str, StoredTensor]:
    """The tensors of the weight files in the checkpoint directory `path` by name, each read only when asked, from
    the safetensors files as they were opened here (held in `handles`); a `pytorch_model.bin` (or each of its
    shards) is read whole by torch."""
    if (path / "model.safetensors").is_file():
        return safetensors_tensors(path / "model.safetensors", caller, handles)
    if (path / "model.safetensors.index.json").is_file():
        return sharded_tensors(path / "model.safetensors.index.json", caller,
                                lambda shard: safetensors_tensors(shard, caller, handles))
    if (path / "pytorch_model.bin").is_file():
        return torch_tensors(path / "pytorch_model.bin", caller)
    if (path / "pytorch_model.bin.index.json").is_file():
        return sharded_tensors(path / "pytorch_model.bin.index.json", caller,
                                lambda shard: torch_tensors(shard, caller))
    raise FileNotFoundError(f"{caller}: {path} has no model.safetensors, model.safetensors.index.json, "
                            "pytorch_model.bin or pytorch_model.bin.index.json")


def sharded_tensors(index: pathlib.Path, caller: str, read_shard: Callable[[pathlib.Path], dict[str, StoredTensor]]
                     ) -> dict[str, StoredTensor]:
    """The tensors of a sharded checkpoint by name: those of each shard file its index's weight_map names (HF's
    `model.safetensors.index.json` or `pytorch_model.bin.index.json`), read by `read_shard`. Every shard is
    checked to exist before any is read."""
    index_content = read_json(index, caller)
    weight_map = index_content.get("weight_map") if isinstance(index_content, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise ValueError(f"{caller}: {index} must have the key 'weight_map' holding an object "
                         "{tensor name: shard file name}")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if pathlib.Path(shard).name != shard:  # a name in the directory, not a path out of it
            raise ValueError(f"{caller}: {index}'s weight_map names the shard {shard!r}, which must be "
                             "a file name in the checkpoint's directory")
        if not (index.parent / shard).is_file():
            raise FileNotFoundError(f"{caller}: {index.parent / shard}, a shard in {index}'s weight_map, "
                                    "does not exist")
    tensors = {}
    for shard in shards:
        held = read_shard(index.parent / shard)
        listed = {name for name, file in weight_map.items() if file == shard}
        if set(held) != listed:
            raise ValueError(f"{caller}: {index.parent / shard} holds {sorted(held)}, but {index}'s weight_map "
                             f"gives it {sorted(listed)} (each tensor in the one shard the index names)")
        tensors.update(held)
    return tensors


def torch_tensors(file: pathlib.Path, caller: str) -> dict[str, StoredTensor]:
    """The tensors of a PyTorch state dict file (`pytorch_model.bin` or one of its shards) by name, read whole
    (`torch.load` with weights_only: no pickled code runs) and converted by `torch_array`."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"{caller}: {file} needs torch (pip install torch), or convert the checkpoint to "
                          "model.safetensors") from e
    try:
        state_dict = torch.load(file, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        raise ValueError(f"{caller}: {file} is not a readable PyTorch state dict: {e}") from e
    if not isinstance(state_dict, dict):
        raise ValueError(f"{caller}: {file} must hold a state dict (tensors by name), not "
                         f"{type(state_dict).__name__}")
    arrays = {name: torch_array(torch, tensor, name, file, caller) for name, tensor in state_dict.items()}
    return {name: StoredTensor(array.shape, lambda array=array: array, array.dtype.name,
                          np.issubdtype(array.dtype, np.floating)) for name, array in arrays.items()}


def torch_array(torch, tensor, name: str, file: pathlib.Path, caller: str) -> np.ndarray:
    """A state dict's tensor as a NumPy array of its shape: detached (a saved `nn.Parameter` loads requiring grad,
    which `.numpy()` refuses), and a float NumPy has no dtype for (bfloat16, float8) widened to float32, which
    holds its every value exactly.

    Raises:
      ValueError: naming the entry, for a value that is not a tensor (a nested dict: a training checkpoint
        rather than a state dict).
      TypeError: naming the entry, for a tensor of a dtype NumPy cannot hold (quantized, ...).
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{caller}: {file} holds {name!r}: {type(tensor).__name__}, not a tensor; it must hold a "
                         "state dict (tensors by name), e.g. what model.state_dict() returns")
    tensor = tensor.detach()
    if tensor.is_floating_point() and tensor.dtype not in (torch.float16, torch.float32, torch.float64):
        tensor = tensor.float()
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError) as e:
        raise TypeError(f"{caller}: {file} holds {name} as a {tensor.dtype} tensor, which NumPy cannot hold: "
                        f"{e}") from e
