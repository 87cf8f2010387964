"""A checkpoint directory's weight files, read by their headers: safetensors (one file, or shards listed by
`model.safetensors.index.json`) and PyTorch state dicts (`pytorch_model.bin`, or shards listed by
`pytorch_model.bin.index.json`; torch maps each, or reads it whole where it is in torch's legacy format). Each
tensor is a `StoredTensor`: its shape and dtype as the file names them, and a function that reads its values, so
that a load checks every name and shape before it reads any value (though a legacy PyTorch file is read whole when
it is opened).
"""
import contextlib
import inspect
import json
import math
import pathlib
import pickle
import struct
import zipfile
from typing import Callable, NamedTuple, Optional, TypeVar

import ml_dtypes
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
    dtype a parameter can be cast from, how to read its values, the float dtypes its file's format can store a
    parameter in (by the format's names, for errors), and the file that holds it (a shard of a sharded checkpoint),
    for errors."""
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]
    dtype: str
    floating: bool
    float_dtypes: tuple[str, ...]
    file: pathlib.Path


# The safetensors dtypes of parameters. safetensors' numpy framework reads the first four (BF16 as ml_dtypes'
# bfloat16) but has no float8, whose values are read from the file's bytes and widened to float32, which holds
# each exactly, as `_torch_array` widens PyTorch's.
_SAFETENSORS_FLOAT8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
                       "F8_E8M0": ml_dtypes.float8_e8m0fnu}
_SAFETENSORS_FLOATS = ("F64", "F32", "F16", "BF16", *_SAFETENSORS_FLOAT8)
# The PyTorch dtypes of parameters: torch's float dtypes of one value an element, those NumPy has none for widened
# to float32.
_TORCH_FLOATS = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                 "float8_e5m2fnuz", "float8_e8m0fnu")


def _safetensors_tensors(file: pathlib.Path, caller: str, handles: contextlib.ExitStack) -> dict[str, StoredTensor]:
    """The tensors of a safetensors file by name, from its header: nothing is read until a tensor's `read`, which
    reads from the file as it was opened here (held open in `handles`), even once a save has replaced it."""
    try:
        opened = handles.enter_context(safe_open(file, framework="numpy"))
        headers = {name: (tuple(opened.get_slice(name).get_shape()), opened.get_slice(name).get_dtype())
                   for name in opened.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{caller}: {file} is not a readable safetensors file: {e}") from e

    float8 = _float8_reader(file, caller, handles, headers) if any(
        dtype in _SAFETENSORS_FLOAT8 for _, dtype in headers.values()) else None

    def reader(name):
        def read():
            try:
                return opened.get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{caller}: {file} is not a readable safetensors file: {e}") from e
        return (lambda: float8(name)) if headers[name][1] in _SAFETENSORS_FLOAT8 else read
    return {name: StoredTensor(shape, reader(name), dtype, dtype in _SAFETENSORS_FLOATS, _SAFETENSORS_FLOATS, file)
            for name, (shape, dtype) in headers.items()}


def _float8_reader(file: pathlib.Path, caller: str, handles: contextlib.ExitStack,
                   headers: dict[str, tuple[tuple[int, ...], str]]) -> Callable[[str], np.ndarray]:
    """A function that reads a float8 tensor of the safetensors `file` (`headers`: the shapes and dtypes by name
    that safetensors read of it) by name, as float32. safetensors' handle gives no bytes: the file is opened again
    here (held in `handles`; `open_weights` opens it again should the directory have been replaced meanwhile) and
    its header read as safetensors reads it, an 8-byte little-endian length and then JSON giving each tensor's
    byte range after it."""
    unreadable = f"{caller}: {file} is not a readable safetensors file"
    try:
        raw = handles.enter_context(open(file, "rb"))
        header_length = int.from_bytes(raw.read(8), "little")
        header = json.loads(raw.read(header_length))
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{unreadable}: {e}") from e

    def read(name):
        shape, dtype = headers[name]
        entry = header.get(name) if isinstance(header, dict) else None
        entry = entry if isinstance(entry, dict) else {}
        offsets = entry.get("data_offsets")
        whole = isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        start, end = offsets if whole else (0, -1)
        if entry.get("dtype") != dtype or entry.get("shape") != list(shape) or end - start != math.prod(shape):
            raise ValueError(f"{unreadable}: its header gives {name} as {entry}, where safetensors read "
                             f"{dtype} of shape {shape}")
        try:
            raw.seek(8 + header_length + start)
            data = raw.read(end - start)
        except OSError as e:
            raise ValueError(f"{unreadable}: {e}") from e
        if len(data) != end - start:
            raise ValueError(f"{unreadable}: it ends within {name}'s bytes")
        return np.frombuffer(data, _SAFETENSORS_FLOAT8[dtype]).reshape(shape).astype(np.float32)
    return read


_Built = TypeVar("_Built")

# How often a load opens a checkpoint again when a save replaced its directory while it was being opened.
_OPEN_ATTEMPTS = 3


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
    """(what `before_opening` returns, or None without it; the tensors by name, see `_weight_tensors`) of the
    checkpoint directory `path`: the weight files stay open in `handles`, and where a save replaced the directory
    while they were being opened, they are opened again (`before_opening` run again first), so what it read of the
    directory (config.json) and the weights never come from two saves. It runs before any weight file is opened,
    so a config.json no model can be made of fails on its own, whatever the weights are (missing, unreadable or
    large)."""
    for _ in range(_OPEN_ATTEMPTS):
        before = _directory_identity(path)
        read_before = None if before_opening is None else before_opening()
        with contextlib.ExitStack() as attempt:
            tensors = _weight_tensors(path, caller, attempt)
            if _directory_identity(path) == before:
                handles.enter_context(attempt.pop_all())
                return read_before, tensors
    raise ValueError(f"{caller}: {path} was replaced (by a save to it) each of the {_OPEN_ATTEMPTS} times it was "
                     "opened; load it once the saves have stopped")


def _weight_tensors(path: pathlib.Path, caller: str, handles: contextlib.ExitStack) -> dict[str, StoredTensor]:
    """The tensors of the weight files in the checkpoint directory `path` by name, each read only when asked, from
    the safetensors files as they were opened here (held in `handles`); a `pytorch_model.bin` (or each of its
    shards) is loaded by torch when it is opened (see `_torch_tensors`)."""
    if (path / "model.safetensors").is_file():
        return _safetensors_tensors(path / "model.safetensors", caller, handles)
    if (path / "model.safetensors.index.json").is_file():
        return _sharded_tensors(path / "model.safetensors.index.json", caller,
                                 lambda shard: _safetensors_tensors(shard, caller, handles))
    if (path / "pytorch_model.bin").is_file():
        return _torch_tensors(path / "pytorch_model.bin", caller)
    if (path / "pytorch_model.bin.index.json").is_file():
        return _sharded_tensors(path / "pytorch_model.bin.index.json", caller,
                                 lambda shard: _torch_tensors(shard, caller))
    raise FileNotFoundError(f"{caller}: {path} has no model.safetensors, model.safetensors.index.json, "
                            "pytorch_model.bin or pytorch_model.bin.index.json")


def _sharded_tensors(index: pathlib.Path, caller: str,
                     read_shard: Callable[[pathlib.Path], dict[str, StoredTensor]]) -> dict[str, StoredTensor]:
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


# What torch.load raises for a file that is no PyTorch file, or one damaged or cut short: besides its own errors
# (RuntimeError; pickle's, EOFError), whatever the bytes lead its unpickler and zip reader into (a memo key or stack
# entry that is not there, a struct of the wrong length, bytes that are not UTF-8, a failed assertion, an OSError of a
# zip whose end is missing).
_UNREADABLE_TORCH_FILE = (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError, ValueError,
                          TypeError, KeyError, IndexError, AssertionError, struct.error)


def _torch_tensors(file: pathlib.Path, caller: str) -> dict[str, StoredTensor]:
    """The tensors of a PyTorch state dict file (`pytorch_model.bin` or one of its shards) by name (`torch.load`
    with weights_only: no pickled code runs), each known by its shape and torch dtype, its values converted by
    `_torch_array` only when read. A file in torch's zip format (every `torch.save` since torch 1.6) is
    memory-mapped where torch can (2.1 and later), so that the host holds only the pages of the tensors read, and
    a read copies its values out of the mapping (a view of it would change with the file, or fault, should the
    file be rewritten); one in the legacy format cannot be mapped, and is read whole."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"{caller}: {file} needs torch (pip install torch), or convert the checkpoint to "
                          "model.safetensors") from e
    try:
        # is_zipfile answers some damaged zip trailers with BadZipFile rather than False. torch.serialization.load:
        # torch.load itself may be wrapped (a (*args, **kwargs) signature says nothing).
        mapped = zipfile.is_zipfile(file) and "mmap" in inspect.signature(torch.serialization.load).parameters
        state_dict = torch.load(file, map_location="cpu", weights_only=True, **({"mmap": True} if mapped else {}))
    except _UNREADABLE_TORCH_FILE as e:
        raise ValueError(f"{caller}: {file} is not a readable PyTorch state dict: {type(e).__name__}: {e}") from e
    if not isinstance(state_dict, dict):
        raise ValueError(f"{caller}: {file} must hold a state dict (tensors by name), not "
                         f"{type(state_dict).__name__}")
    tensors = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{caller}: {file} holds {name!r}: {type(tensor).__name__}, not a tensor; it must hold "
                             "a state dict (tensors by name), e.g. what model.state_dict() returns")
        dtype = str(tensor.dtype).removeprefix("torch.")
        tensors[name] = StoredTensor(
            tuple(tensor.shape), lambda tensor=tensor, name=name: _torch_array(torch, tensor, name, file, caller,
                                                                               copy=mapped),
            dtype, dtype in _TORCH_FLOATS, _TORCH_FLOATS, file)
    return tensors


def _torch_array(torch, tensor, name: str, file: pathlib.Path, caller: str, *, copy: bool) -> np.ndarray:
    """A state dict's tensor as a NumPy array of its shape: detached (a saved `nn.Parameter` loads requiring grad,
    which `.numpy()` refuses), a float NumPy has no dtype for (bfloat16, float8) widened to float32, which holds
    its every value exactly, and with `copy` (a memory-mapped file's tensor) in memory of its own.

    Raises:
      TypeError: naming the entry, for a tensor of a dtype NumPy cannot hold (quantized, packed float4, ...).
    """
    tensor = tensor.detach()
    try:
        if tensor.is_floating_point() and tensor.dtype not in (torch.float16, torch.float32, torch.float64):
            return tensor.float().numpy()  # a copy; torch converts no packed float (float4_e2m1fn_x2: two a byte)
        return np.array(tensor.numpy()) if copy else tensor.numpy()
    except (TypeError, RuntimeError) as e:
        raise TypeError(f"{caller}: {file} holds {name} as a {tensor.dtype} tensor, which NumPy cannot hold: "
                        f"{e}") from e
