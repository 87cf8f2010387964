"""Shared vocabulary of the cuTile kernels: problem dimensions and launch plans.

A kernel stage describes *what* to launch as data (`Launch`: kernel, grid, argument names) and a
sequence of stages forms a `Plan`. The bridge executes a plan in one of three ways (XLA FFI custom
calls, a zero-copy buffer callback, or eagerly on CuPy/torch arrays) without knowing Mamba math, and
the kernels never import JAX.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Union

import cuda.tile as ct

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ConstFloat = ct.Constant[float]

LOG2E = 1.4426950408889634

# The dtypes the kernels accept for x, B, C, z (names as numpy/jax spell them).
KERNEL_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class SSDDims:
    """Static description of one SSD problem (everything a kernel specialises on).

    Axis names follow mamba_ssm: x (batch, seqlen, nheads, headdim), B/C (batch, seqlen, ngroups, dstate).
    `dtype` is the dtype of x/B/C/z; `dt_dtype` the dtype of dt.
    """

    batch: int
    seqlen: int
    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    chunk_size: int
    dtype: str = "bfloat16"
    dt_dtype: str = "float32"
    has_z: bool = False
    has_init: bool = False
    has_seq_idx: bool = False
    dt_softplus: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)

    @property
    def nchunks(self) -> int:
        return -(-self.seqlen // self.chunk_size)

    @property
    def heads_per_group(self) -> int:
        return self.nheads // self.ngroups

    @property
    def has_dt_limit(self) -> bool:
        return tuple(self.dt_limit) != (0.0, math.inf)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """An array a plan allocates: an intermediate or an output. `zero_init` buffers start as zeros."""

    shape: tuple[int, ...]
    dtype: str
    zero_init: bool = False


# A kernel argument in a plan: the name of an input or buffer, or a compile-time constant.
Arg = Union[str, int, float, bool]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: `args` lists the kernel parameters in order (names or constants);
    `writes` names the arrays among them that the kernel writes."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Arg, ...]
    writes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Launches run in order. `inputs` name the caller's arrays, `buffers` what the plan allocates,
    `outputs` what it returns (inputs or buffers)."""

    inputs: tuple[str, ...]
    buffers: dict[str, Buffer]
    launches: tuple[Launch, ...]
    outputs: tuple[str, ...]


def next_power_of_2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
