"""Shared vocabulary of the cuTile kernels: problem dimensions and launch plans.

A kernel stage describes *what* to launch as data (`Launch`: kernel, grid, argument names, built by
`kernel_launch` from the kernel's own signature) and a sequence of stages forms a `Plan`. Each stage module
declares its stage once (`Stage`: config type, tune space, default config, launch builder, cache-key
fields), next to its kernel; the plans, the tuner (bridge/tuning), the AOT export and the tests all read
that declaration. The bridge executes a plan in one of three ways (XLA FFI custom calls, a zero-copy
buffer callback, or eagerly on CuPy/torch arrays) without knowing Mamba math, and the kernels never
import JAX.

Also shared by every stage: the device helpers `dt_transform`, `exp2_ftz`, `silu_gate` and `mma_dtype`,
the int32/int64 index width choice (`needs_int64_index`, `int64_index_kernels`, `index_width_variant`,
`select_kernel`) and `check_arch`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Any, Callable, Union

import cuda.tile as ct

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ConstFloat = ct.Constant[float]

LOG2E = 1.4426950408889634

# Architectures whose tuning spaces the stages define.
SUPPORTED_ARCHS = ("sm_90",)

INT32_MAX = (1 << 31) - 1

# The dtypes the kernels accept for x, B, C, z (names as numpy/jax spell them).
KERNEL_DTYPES = ("bfloat16", "float16", "float32")

# Streaming multiprocessors of an H100 / H200 (SXM), the sm_90 parts the defaults were measured on.
SM90_SMS = 132


@dataclasses.dataclass(frozen=True)
class SSDDims:
    """Static description of one SSD problem (everything a kernel specialises on).

    Axis names follow mamba_ssm: x (batch, seqlen, nheads, headdim), B/C (batch, seqlen, ngroups, dstate).
    `dtype` is the dtype of x/B/C/z; `dt_dtype` the dtype of dt. `has_reach`: the forward takes `reach`, the
    backward `dx_reach`, (batch, nheads, nchunks, chunk_size) f32, 0 or NaN per (token, head), and adds it to
    a per-row scale of the rows it writes (y: the inter-chunk term's; dx: Δ's), so that a NaN there makes the
    whole row NaN (the op's confinement of non-finite values, jax_mamba2/op.py).
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
    has_reach: bool = False

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

    def dependent(self, level: int) -> "Launch":
        """This launch with its kernel's DEPENDENT constant at `level` (`wait_for_predecessor`); unchanged for a
        kernel without one, which then cannot be launched as a programmatic dependent."""
        if not self.can_be_dependent:
            return self
        index = list(kernel_signature(self.kernel).pysig.parameters).index(DEPENDENT)
        return dataclasses.replace(self, args=self.args[:index] + (level,) + self.args[index + 1:])

    @property
    def can_be_dependent(self) -> bool:
        """Whether its kernel waits for its predecessor when launched as a programmatic dependent."""
        return DEPENDENT in kernel_signature(self.kernel).pysig.parameters


# Programmatic dependent launch (PDL): a kernel launched with the attribute may start while the launch before it on
# its stream still runs. A kernel that can be so launched takes a DEPENDENT constant: INDEPENDENT (every plan's,
# run in stream order), WAITS (it waits for its predecessor's writes before its first load), or WAITS_AND_RELEASES
# (also lets its own successor launch at once, whose blocks then wait on the SMs).
DEPENDENT = "DEPENDENT"
INDEPENDENT, WAITS, WAITS_AND_RELEASES = 0, 1, 2


def wait_for_predecessor(DEPENDENT):
    """Device helper, first in a kernel that takes DEPENDENT: under a programmatic dependent launch, waits until
    the launch before it has finished and its writes are visible (a no-op without the launch attribute), and
    with WAITS_AND_RELEASES lets the next launch start."""
    if DEPENDENT > INDEPENDENT:
        ct.grid_dependency_control_wait()
    if DEPENDENT > WAITS:
        ct.grid_dependency_control_launch_dependents()


def kernel_signature(kernel: Any) -> Any:
    """The parsed signature of a `ct.kernel` (`.pyfunc`, `.pysig`, `.parameter_annotations`). cuda.tile keeps
    it in a private attribute, read here alone so that a cuda.tile upgrade that moves it breaks one place."""
    return kernel._annotated_function


def kernel_name(kernel: Any) -> str:
    """The name of a `ct.kernel`'s Python function (e.g. "chunk_state_fwd_kernel")."""
    return kernel_signature(kernel).pyfunc.__name__


def kernel_launch(kernel: Any, grid: tuple[int, ...], *, writes: tuple[str, ...],
                  arrays: dict[str, str] | None = None, **constants: Arg) -> Launch:
    """The Launch of `kernel` with its arguments in the order of its signature, each named once.

    Args:
      kernel: a `ct.kernel`.
      grid: the launch grid.
      writes: the plan arrays the kernel writes.
      arrays: the plan array an array parameter reads, where it is not the parameter's own name (e.g.
        {"dy": "dout"}); every other array parameter reads the plan array of its name.
      **constants: the value of every ct.Constant parameter, by name.

    Raises:
      TypeError: a ct.Constant parameter without a value, or a name that is no parameter of the kernel.
    """
    function = kernel_signature(kernel)
    arrays, constants = dict(arrays or {}), dict(constants)
    args = []
    for name, annotation in zip(function.pysig.parameters, function.parameter_annotations):
        if not annotation.constant:
            args.append(arrays.pop(name, name))
        elif name in constants:
            args.append(constants.pop(name))
        else:
            raise TypeError(f"kernel_launch: {function.pyfunc.__name__} needs a value for its constant {name}")
    if arrays or constants:
        raise TypeError(f"kernel_launch: {function.pyfunc.__name__} has no parameter "
                        f"{sorted({**arrays, **constants})}")
    return Launch(kernel=kernel, grid=tuple(grid), args=tuple(args), writes=tuple(writes))


@dataclasses.dataclass(frozen=True)
class Stage:
    """One kernel stage of a plan, declared next to its kernel.

    name: the key of the stage's config in a plan's `configs` and in the tuning cache.
    config_type: the frozen dataclass of its tiles and hints.
    space(dims, arch) -> [config]: the autotune space for an sm arch (one of SUPPORTED_ARCHS).
    default(dims) -> config: the configuration used untuned.
    launch(dims, cfg, **options) -> Launch: the launch for a config (None: the default); `options` are what
      the plan decides besides the config (e.g. heads_per_block), keyword-only.
    key_fields: the SSDDims fields (or properties) named in its cache key: those the kernel specialises on that
      change which config is fastest (tile shapes, dtypes, operands); flags that add a few instructions to the same
      loops (dt's softplus and limit, D, the non-finite reach term) share the configs tuned without them.
    work_items(dims): its independent work items (the launch width before tiling), bucketed in the key.
    blocks_span_heads: the launch gives a block several heads of a group (`heads_per_block`, which the
      backward's deterministic mode raises to heads_per_group), so that count is in the key too.
    """

    name: str
    config_type: type
    space: Callable[[SSDDims, str], list]
    default: Callable[[SSDDims], Any]
    launch: Callable[..., Launch]
    key_fields: tuple[str, ...]
    work_items: Callable[[SSDDims], int]
    blocks_span_heads: bool = False


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


def exp2_ftz(x):
    """Device helper: 2**x as one MUFU.EX2 (ex2.approx.ftz: relative error ~2^-22, results below 2^-126
    flushed to 0), where ct.exp's full-precision expansion takes ~7 instructions."""
    return ct.exp2(x, flush_to_zero=True)


def dt_transform(v, DT_SOFTPLUS, HAS_DT_LIMIT, DT_MIN, DT_MAX):
    """Device helper: Δ from v = dt + dt_bias (f32 tile), as `reference.dt_transform`.

    The softplus is mamba_ssm's Triton>=3 form `log(exp(v) + 1)` (not log1p) below 20, `v` above, so
    small Δ round the same way; the clip applies only with HAS_DT_LIMIT.
    """
    if DT_SOFTPLUS:
        v = ct.where(v <= 20.0, ct.log(ct.exp(v) + 1.0), v)
    if HAS_DT_LIMIT:
        # NaN-propagating, as the reference's clip: cuTile's min and max return the other operand for a NaN by
        # default, which would turn a NaN Δ into DT_MIN, a finite step where the reference's is NaN.
        v = ct.minimum(ct.maximum(v, DT_MIN, propagate_nan=True), DT_MAX, propagate_nan=True)
    return v


def dt_transform_constants(dims: SSDDims) -> dict[str, Any]:
    """The ct.Constant values of `dt_transform`'s flags for `dims`, as a kernel that calls it declares them."""
    dt_min, dt_max = (float(v) for v in dims.dt_limit)
    return dict(DT_SOFTPLUS=dims.dt_softplus, HAS_DT_LIMIT=dims.has_dt_limit, DT_MIN=dt_min, DT_MAX=dt_max)


def silu_gate(acc, z_tile):
    """Device helper: acc * silu(z) in f32, silu(z) as z / (1 + e^-z) with one MUFU.EX2 and an approximate
    division (2 ulp; e^-z -> inf for very negative z gives 0, never NaN). z * sigmoid(z) builds a longer
    gated output loop in the fused kernel (docs/experiments.md, "Weighting, exponentials, the gate")."""
    z32 = z_tile.astype(ct.float32)
    return acc * ct.truediv(z32, 1.0 + exp2_ftz(-z32 * LOG2E), rounding_mode=ct.RoundingMode.APPROX,
                            flush_to_zero=True)


def sigmoid(z):
    """Device helper: 1 / (1 + e^-z) of an f32 tile with one MUFU.EX2 and an approximate division (2 ulp);
    e^-z -> inf for very negative z gives 0, never NaN."""
    return ct.truediv(1.0, 1.0 + exp2_ftz(-z * LOG2E), rounding_mode=ct.RoundingMode.APPROX, flush_to_zero=True)


def load_zero_padded(array, index, shape, LATENCY):
    """Device helper: ct.load of the tile at `index` (zero past the array's edges) with the latency hint LATENCY
    (0: none, the compiler's choice)."""
    if LATENCY:
        return ct.load(array, index=index, shape=shape, padding_mode=ct.PaddingMode.ZERO, latency=LATENCY)
    return ct.load(array, index=index, shape=shape, padding_mode=ct.PaddingMode.ZERO)


def mma_dtype(dtype):
    """Device helper: the tensor-core operand dtype for data of `dtype` (tf32 for f32, else itself).

    ct.mma never promotes and runs f32 operands as true f32 (no tensor cores), so f32 inputs are cast
    to tf32 explicitly, the precision mamba_ssm's Triton dots use for f32.
    """
    return ct.static_eval(ct.tfloat32 if dtype == ct.float32 else dtype)


def check_arch(api: str, arch: str) -> None:
    """Raises ValueError unless the stages define configurations for `arch`."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{api}: arch={arch!r} must be one of {SUPPORTED_ARCHS}")


# Rows per block of the row-block kernels (the norms, the loss's softmax).
MAX_BLOCK_ROWS = 64


def check_row_block_config(config) -> None:
    """Raises ValueError naming the config and field unless, as the row-block kernels' configs need, its
    BLOCK_ROWS is a power of two <= MAX_BLOCK_ROWS, its FWD_/BWD_OCCUPANCY hints are in [1, 32] and its
    FWD_/BWD_LATENCY hints 0 (no hint) or in [1, 10]."""
    api = type(config).__name__
    if not is_power_of_2(config.BLOCK_ROWS) or config.BLOCK_ROWS > MAX_BLOCK_ROWS:
        raise ValueError(f"{api}: BLOCK_ROWS={config.BLOCK_ROWS} must be a power of two <= {MAX_BLOCK_ROWS}")
    for name in ("FWD_OCCUPANCY", "BWD_OCCUPANCY"):
        if not 1 <= getattr(config, name) <= 32:
            raise ValueError(f"{api}: {name}={getattr(config, name)} must be in [1, 32]")
    for name in ("FWD_LATENCY", "BWD_LATENCY"):
        if not 0 <= getattr(config, name) <= 10:
            raise ValueError(f"{api}: {name}={getattr(config, name)} must be 0 (no hint) or in [1, 10]")


# Tile fields of the stage configs and the dimension each must divide (one block per tile; 0 means
# "no tiling" where a config allows it, e.g. ChunkScanConfig.BLOCK_N).
_TILE_DIMS = {"BLOCK_P": "headdim", "BLOCK_N": "dstate", "BLOCK_M": "chunk_size", "BLOCK_K": "chunk_size"}


def check_config_tiles(api: str, configs: dict, dims: SSDDims) -> None:
    """Raises ValueError naming the stage and field unless every tile field of the given stage configs
    divides its dimension of `dims` (a larger tile would leave part of the arrays to no block)."""
    for stage, cfg in configs.items():
        for field, dim in _TILE_DIMS.items():
            value = getattr(cfg, field, 0)
            if value and getattr(dims, dim) % value:
                raise ValueError(f"{api}: configs[{stage!r}].{field}={value} must divide "
                                 f"{dim}={getattr(dims, dim)}")


def needs_int64_index(dims: SSDDims) -> bool:
    """Whether any array of the problem has 2^31 or more elements, so int32 offsets could overflow.

    This is stricter than cutile_call's own check (each dim and stride < 2^31): an int32 element offset
    into an array of 2^31+ elements can overflow even when every stride fits.
    """
    b, L, H, P, G, N = dims.batch, dims.seqlen, dims.nheads, dims.headdim, dims.ngroups, dims.dstate
    nc, Q = dims.nchunks, dims.chunk_size
    largest = max(b * L * H * P, b * L * G * N, b * nc * H * P * N, b * H * nc * Q)
    return largest > INT32_MAX


class Big:
    """The annotation of a kernel parameter that may be an array of 2^31 or more elements: `ct.Array` (shapes
    and strides as int32, the fast default) or `ct.IndexedWithInt64` in the two kernels
    `int64_index_kernels` makes of one kernel function."""


def int64_index_kernels(function: Callable[..., None]) -> tuple[Any, Any]:
    """The (int32-indexed, int64-indexed) `ct.kernel`s of one kernel function whose large arrays are
    annotated `Big`: each compiles a copy of `function` (same code, so the same source for cuTile) with
    `Big` replaced by `ct.Array`, resp. `ct.IndexedWithInt64`."""
    def kernel(array_type):
        copy = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                                  function.__defaults__, function.__closure__)
        copy.__qualname__, copy.__doc__ = function.__qualname__, function.__doc__
        copy.__annotations__ = {name: array_type if annotation is Big else annotation
                                for name, annotation in function.__annotations__.items()}
        return ct.kernel(copy)

    return kernel(ct.Array), kernel(ct.IndexedWithInt64)


@functools.lru_cache(maxsize=256)
def _with_hints(kernel: Any, hints: tuple[tuple[str, int], ...]) -> Any:
    return kernel.replace_hints(**dict(hints))


def with_hints(kernel: Any, **hints: int | None) -> Any:
    """`kernel` with `hints` (occupancy, num_worker_warps, ...) applied; a hint given as None is left to the
    compiler. `replace_hints` returns a new kernel with its own compile cache, so the result is cached: the same
    (kernel, hints) always returns the same object and never recompiles."""
    return _with_hints(kernel, tuple(sorted((k, v) for k, v in hints.items() if v is not None)))


def index_width_variant(kernels: tuple[Any, Any], int64: bool, **hints: int | None) -> Any:
    """The int64-indexed (`int64`) or int32-indexed kernel of an `int64_index_kernels` pair, with `hints`
    applied (see `with_hints`)."""
    return with_hints(kernels[1 if int64 else 0], **hints)


def select_kernel(kernels: tuple[Any, Any], dims: SSDDims, **hints: int | None) -> Any:
    """`index_width_variant` for an SSD problem `dims`."""
    return index_width_variant(kernels, needs_int64_index(dims), **hints)
