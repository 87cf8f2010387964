"""Where a tuned config is stored: the cache file of a GPU and code version, and the key of a stage's entry.

One file per GPU name and arch, cuda-tile version, jax-mamba2 version and a fingerprint of the kernels'
code (a changed kernel must not inherit configs tuned for the old one; a changed comment or docstring
changes nothing), in `$JAX_MAMBA2_CACHE_DIR` (default `~/.cache/jax_mamba2/`).

A key names the stage, the SSDDims fields its kernel specialises on (its Stage declaration's key_fields),
the heads per block of the backward's group-reducing stages (which deterministic mode changes), the index
width, and a power-of-two bucket of the stage's independent work items. Batch and seqlen are deliberately
not in the keys (as in mamba_ssm's Triton autotune keys): only their bucket is, so a training run with
varying lengths tunes once per bucket, not once per call.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import os
import re
from pathlib import Path
from typing import NamedTuple, Optional

import cuda.tile as ct
import jax

from jax_mamba2.kernels import _common
from jax_mamba2.kernels import backward as backward_kernels
from jax_mamba2.kernels import forward as forward_kernels
from jax_mamba2.kernels._common import SSDDims

ENV_CACHE_DIR = "JAX_MAMBA2_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/jax_mamba2")
# The layout of the cache file ({"schema", "entries": {key: entry}}) and of its entries' configs; files of
# another schema are ignored. 2: the config fields all upper-case (schema 1 had occupancy, weight_x, ...).
CACHE_SCHEMA = 2

# Every stage the plans run, by name: its declaration (config type, space, default, key fields).
STAGES = {**forward_kernels.STAGES, **backward_kernels.STAGES}


class GpuIdentity(NamedTuple):
    """The GPU configs are tuned for: its name (e.g. "NVIDIA H200") and arch (e.g. "sm_90")."""

    name: str
    arch: str


def gpu_identity() -> Optional[GpuIdentity]:
    """The default JAX GPU's name and arch, or None without a CUDA device."""
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        return None
    major, minor = str(device.compute_capability).split(".")[:2]
    return GpuIdentity(name=device.device_kind, arch=f"sm_{major}{minor}")


def stage_key(stage: str, dims: SSDDims, deterministic: bool = False) -> str:
    """The cache key of `stage` for `dims`, e.g. "chunk_state/chunk_size=256,headdim=64,...,work=128".

    `deterministic` (the backward's mode) only changes the key of stages whose launch it changes.
    """
    spec = STAGES[stage]
    fields = [f"{name}={getattr(dims, name)}" for name in spec.key_fields]
    work = spec.work_items(dims)
    if spec.blocks_span_heads:
        heads_per_block = backward_kernels.group_heads_per_block(dims, deterministic)
        fields.append(f"heads_per_block={heads_per_block}")
        work //= heads_per_block
    fields.append(f"index64={_common.needs_int64_index(dims)}")
    fields.append(f"work={_common.next_power_of_2(work)}")
    return f"{stage}/" + ",".join(fields)


def _package_version() -> str:
    try:
        return importlib.metadata.version("jax-mamba2")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "src"


KERNELS_DIR = Path(_common.__file__).parent


def _code_of(source: str) -> str:
    """The syntax tree of Python `source` without its comments, docstrings and layout (ast.dump of the
    tree with every module, class and function docstring removed, no line numbers)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                node.body = node.body[1:]
    return ast.dump(tree, include_attributes=False)


@functools.cache
def kernels_fingerprint(directory: Path = KERNELS_DIR) -> str:
    """A hash of the code of the kernel modules in `directory`: tuned configs are only valid for the code
    they ran, but an edit of comments or docstrings alone keeps the fingerprint (and every user's cache)."""
    digest = hashlib.sha256()
    for path in sorted(Path(directory).glob("*.py")):
        digest.update(path.name.encode() + b"\0" + _code_of(path.read_text()).encode() + b"\0")
    return digest.hexdigest()[:12]


def cache_dir() -> Path:
    """`$JAX_MAMBA2_CACHE_DIR`, else ~/.cache/jax_mamba2."""
    return Path(os.environ.get(ENV_CACHE_DIR) or DEFAULT_CACHE_DIR).expanduser()


def cache_path(gpu: GpuIdentity) -> Path:
    """The cache file for `gpu` with this cuda-tile, jax-mamba2 and kernel source."""
    gpu_slug = re.sub(r"[^A-Za-z0-9.]+", "_", gpu.name).strip("_")
    name = (f"{gpu_slug}-{gpu.arch}-cuda_tile_{ct.__version__}-jax_mamba2_{_package_version()}"
            f"-kernels_{kernels_fingerprint()}.json")
    return cache_dir() / name
