"""The registry of backends of every op: what each one computes with, which exist, which can run here, and
which one runs a call.

The ops are "ssd" (`jax_mamba2.op`: `ssd`, `ssd_step`), "causal_conv1d" (`jax_mamba2.conv1d`), "rms_norm"
(`jax_mamba2.norm`: `rms_norm`, `add_rms_norm`), "cross_entropy" (the softmax of the LM loss,
`jax_mamba2.cross_entropy.chunked_cross_entropy`) and "decode" (`jax_mamba2.decode`: `norm_project`,
`mixer_step`, the fused ops of a decode step). Each op module registers its pure-JAX backends ("xla", and
"scan" for the SSD), which run everywhere. The optional backends register themselves, for every op, when their
module is imported; that module needs optional dependencies (the [cuda] extra), so the registry imports it on
first use and keeps why it could not. Whether a registered backend can run in this process (a GPU) is its own
`unavailable_reason`; whether it can run one call is `unsupported_reason`. `select` resolves a backend name
for a call the same way for every op.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import jax

if TYPE_CHECKING:
    from jax_mamba2.ssd_args import SSDInputs, SSDStatic

# The ops that have backends, by the name their modules register them under.
OPS = ("ssd", "causal_conv1d", "rms_norm", "cross_entropy", "decode")
# The backends that a module of optional dependencies registers (for every op) when it is imported: name -> module.
OPTIONAL_BACKENDS = {"cutile": "jax_mamba2.bridge", "cutile_callback": "jax_mamba2.bridge"}


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way of computing the SSD op.

    forward(inputs, static) -> (y, final_states); a backend that is not `differentiable` adds `inputs.reach`,
    when the op gives one (its confinement of non-finite values), to each (token, head) row of y in its
    forward, and `inputs.dx_reach` to each row of dx in its backward. `differentiable` says whether JAX can
    differentiate
    `forward` itself; if not, `ssd` wraps it in a custom_vjp whose backward is `backward(inputs, static,
    dy, dfinal_states, saved) -> SSDInputs of cotangents` or, when None, the VJP of the xla path
    (recompute). The custom_vjp's forward is `forward_saving(inputs, static) -> ((y, final_states),
    saved)` when given (what it saves for the backward besides the inputs), else `forward` with saved
    = None.
    unsupported_reason(inputs, static) -> None or a sentence saying why this call cannot run here.
    step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit) -> (y, new_state), optional.
    unavailable_reason() -> None or a sentence saying why no call can run in this process (e.g. no GPU);
    None (the field) for a backend that runs everywhere.
    """

    name: str
    forward: Callable[[SSDInputs, SSDStatic], tuple[jax.Array, jax.Array]]
    unsupported_reason: Callable[[SSDInputs, SSDStatic], Optional[str]]
    differentiable: bool = False
    backward: Optional[Callable[..., SSDInputs]] = None
    forward_saving: Optional[Callable[[SSDInputs, SSDStatic], tuple[tuple[jax.Array, jax.Array], Any]]] = None
    step: Optional[Callable[..., tuple[jax.Array, jax.Array]]] = None
    step_unsupported_reason: Optional[Callable[..., Optional[str]]] = None
    # Preferred by "auto" when supported (kernel backends); ties resolve by registration order.
    auto_priority: int = 0
    unavailable_reason: Optional[Callable[[], Optional[str]]] = None


@dataclasses.dataclass(frozen=True)
class LayerBackend:
    """One way of computing an op other than the SSD (the conv, the norms, the loss's softmax, the decode step).

    `kernels` runs the op; its interface is the op module's (`bridge.conv_ops.ConvKernels` for the conv,
    `bridge.norm_ops.NormKernels` for the norms, `bridge.loss_ops.LossKernels` for the loss's softmax,
    `bridge.decode_ops.DecodeKernels` for the decode step), and None is the op's pure-JAX path.
    unsupported_reason(problem) -> None or a sentence saying why this call cannot run here, for the op module's
    description of the call (the conv's ConvInputs, the norms' NormDims from `bridge.norm_ops.norm_dims`, the
    loss's CrossEntropyDims from `bridge.loss_ops.loss_dims`, the decode ops' ProjectionDims or MixerStepDims from
    `bridge.decode_ops.projection_dims` / `mixer_dims`).
    """

    name: str
    kernels: Any
    unsupported_reason: Callable[[Any], Optional[str]]
    # Preferred by "auto" when supported (kernel backends); ties resolve by registration order.
    auto_priority: int = 0


def always_supported(*problem) -> None:
    """The `unsupported_reason` of a backend that runs every call (the pure-JAX paths)."""
    del problem
    return None


class BackendStatus(NamedTuple):
    """Whether a backend can run in this process; `reason` says why not (None when it can)."""

    runnable: bool
    reason: Optional[str]


_REGISTRY: dict[str, dict[str, Any]] = {op: {} for op in OPS}


def register_backend(backend: Backend | LayerBackend, op: str = "ssd") -> None:
    """Adds (or replaces) a backend of `op` (one of OPS)."""
    _REGISTRY[op][backend.name] = backend


@functools.cache
def _import_failure(module: str) -> Optional[str]:
    """Imports `module` (which registers its backends); returns why it could not, if so."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        return str(e)
    return None


@contextlib.contextmanager
def kernels_replaced(op: str, name: str, kernels: Any):
    """Inside the block, the registered layer backend `name` of `op` runs `kernels` (its other fields kept), e.g.
    an op's kernels in tiles a benchmark or a test chose (the bridge modules' `make_kernels`); restored after."""
    backend = registered(op)[name]
    register_backend(dataclasses.replace(backend, kernels=kernels), op=op)
    try:
        yield
    finally:
        register_backend(backend, op=op)


def registered(op: str = "ssd") -> dict[str, Any]:
    """The registered backends of `op` by name, in registration order, once the optional ones have been tried."""
    for module in dict.fromkeys(OPTIONAL_BACKENDS.values()):
        _import_failure(module)
    return dict(_REGISTRY[op])


def known_names(op: str = "ssd") -> tuple[str, ...]:
    """Every backend name the calls of `op` know besides "auto", runnable here or not."""
    return tuple(dict.fromkeys((*registered(op), *OPTIONAL_BACKENDS)))


def _missing_reason(name: str) -> str:
    module = OPTIONAL_BACKENDS[name]
    return _import_failure(module) or f"importing {module} did not register it"


def _unknown_name_error(name, api: str, op: str, argument: str = "backend") -> ValueError:
    names = ", ".join(repr(n) for n in ("auto", *known_names(op)))
    return ValueError(f"{api}: {argument}={name!r} must be one of {names}")


def check_name(name, api: str, op: str = "ssd", argument: str = "backend") -> str:
    """`name` when it is "auto" or a known backend of `op` (see `known_names`); else ValueError naming `api`
    and `argument` and listing the names (for constructors that keep a backend name for later calls)."""
    if not isinstance(name, str) or name not in ("auto", *known_names(op)):
        raise _unknown_name_error(name, api, op, argument)
    return name


def get(name, api: str, op: str = "ssd") -> Any:
    """The backend of `op` called `name`. Raises ValueError naming `api` when no backend has that name, or
    when it is an optional backend whose module cannot be imported (saying why)."""
    backends = registered(op)
    if isinstance(name, str) and name in backends:
        return backends[name]
    if isinstance(name, str) and name in OPTIONAL_BACKENDS:
        raise ValueError(f"{api}(backend={name!r}) is unavailable: {_missing_reason(name)}")
    raise _unknown_name_error(name, api, op)


def for_op(ssd_backend: str, op: str) -> str:
    """The backend of `op` in a layer built with SSD backend `ssd_backend`: "auto" and the kernel backends carry
    over; a name that `op` has no backend of (the SSD's "scan" oracle) keeps `op` in pure JAX ("xla")."""
    return ssd_backend if ssd_backend in ("auto", *known_names(op)) else "xla"


def auto_candidates(op: str = "ssd") -> list[Any]:
    """The backends of `op` that "auto" tries before the xla path, most preferred first."""
    return sorted((b for b in registered(op).values() if b.auto_priority > 0), key=lambda b: -b.auto_priority)


def select(name, api: str, unsupported_reason: Callable[[Any], Optional[str]], op: str = "ssd") -> list[Any]:
    """The backends of `op` to run one call on: [the one called `name`], or for "auto" [the most preferred
    kernel backend that supports the call, then "xla" as its fallback] (the op puts them behind
    `lax.platform_dependent`) or ["xla"] alone.

    unsupported_reason(backend) -> None or why `backend` cannot run this call. A backend asked for by name
    never falls back: ValueError naming `api` when the name is unknown, the backend cannot be imported or it
    cannot run this call (saying why).
    """
    if name == "auto":
        fallback = get("xla", api, op)
        for candidate in auto_candidates(op):
            if unsupported_reason(candidate) is None:
                return [candidate, fallback]
        return [fallback]
    chosen = get(name, api, op)
    reason = unsupported_reason(chosen)
    if reason is not None:
        raise ValueError(f"{api}(backend={name!r}) cannot run this call: {reason}")
    return [chosen]


def run_selected(selected: list[Any], run: Callable[..., Any], *operands):
    """run(backend, *operands) on what `select` chose: its one backend, or for "auto"'s [kernel, fallback] the
    kernel on CUDA and the fallback elsewhere, behind `lax.platform_dependent` (so the program still lowers for
    every platform)."""
    if len(selected) == 1:
        return run(selected[0], *operands)
    kernel, fallback = selected
    return jax.lax.platform_dependent(*operands, cuda=lambda *a: run(kernel, *a),
                                      default=lambda *a: run(fallback, *a))


def run_compiled(selected: tuple, run: Callable[..., Any], static, *operands):
    """`run_selected` of run(backend, *operands, static). Called on concrete arrays (outside jit, grad, vmap),
    as one jitted program keyed by the backends, `run` (a module-level function) and the hashable `static`,
    so that an eager call compiles once per shapes and options and runs as one executable, not op by op.
    Called on tracers, directly: a jit there would make differentiation trace the primal of the kernels'
    custom_vjp too, which the program never runs but compile_ahead and autotune would then compile and tune."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(operands)):
        return _run_with_static(selected, run, static, *operands)
    return _run_compiled(selected, run, static, *operands)


def _run_with_static(selected: tuple, run: Callable[..., Any], static, *operands):
    return run_selected(list(selected), lambda backend, *arrays: run(backend, *arrays, static), *operands)


_run_compiled = jax.jit(_run_with_static, static_argnums=(0, 1, 2))


def reference_vjp(fn, arrays, cotangents):
    """The cotangents of `arrays` (None for absent ones, float0 for integer ones) through fn(*arrays): the
    backward of a kernel that has no backward kernels, through the pure-JAX function it equals."""
    present = [i for i, a in enumerate(arrays) if a is not None]

    def call(*values):
        full = list(arrays)
        for i, v in zip(present, values):
            full[i] = v
        return fn(*full)

    _, vjp = jax.vjp(call, *(arrays[i] for i in present))
    grads = vjp(cotangents)
    full = [None] * len(arrays)
    for i, g in zip(present, grads):
        full[i] = g
    return tuple(full)


def backend_status() -> dict[str, BackendStatus]:
    """For every known SSD backend (the other ops have the same names, and each kernel backend needs the same
    GPU): whether it can run in this process and, if not, why.

    Example (a CPU machine with cuda-tile installed):
      {'xla': BackendStatus(runnable=True, reason=None), 'scan': ...,
       'cutile': BackendStatus(runnable=False, reason="no CUDA device is visible to JAX (...)"), ...}
    """
    backends = registered()
    status = {}
    for name in known_names():
        backend = backends.get(name)
        if backend is None:
            reason = _missing_reason(name)
        else:
            reason = None if backend.unavailable_reason is None else backend.unavailable_reason()
        status[name] = BackendStatus(reason is None, reason)
    return status


def available_backends() -> tuple[str, ...]:
    """The backends that can run in this process (names for `ssd(..., backend=...)` besides "auto");
    `backend_status()` says why each other one cannot."""
    return tuple(name for name, status in backend_status().items() if status.runnable)
