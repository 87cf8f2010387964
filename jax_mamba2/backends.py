"""The registry of SSD backends: what each one computes with, which exist, and which can run here.

"xla" and "scan" (pure JAX, registered by `jax_mamba2.op`) run everywhere. The optional backends register
themselves when their module is imported; that module needs optional dependencies (the [cuda] extra), so
the registry imports it on first use and keeps why it could not. Whether a registered backend can run in
this process (a GPU) is its own `unavailable_reason`; whether it can run one call is `unsupported_reason`.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

if TYPE_CHECKING:
    import jax

    from jax_mamba2.op import SSDInputs, SSDStatic

# The backends that a module of optional dependencies registers when it is imported: name -> module.
OPTIONAL_BACKENDS = {"cutile": "jax_mamba2.bridge", "cutile_callback": "jax_mamba2.bridge"}


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way of computing the op.

    forward(inputs, static) -> (y, final_states). `differentiable` says whether JAX can differentiate
    `forward` itself; if not, `ssd` wraps it in a custom_vjp whose backward is `backward(inputs, static,
    dy, dfinal_states, saved) -> SSDInputs of cotangents` or, when None, the VJP of the xla path
    (recompute). The custom_vjp's forward is `forward_saving(inputs, static) -> ((y, final_states),
    saved)` when given (what it saves for the backward besides the inputs), else `forward` with saved
    = None.
    unsupported_reason(inputs, static) -> None or a sentence saying why this call cannot run here.
    step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit) -> (y, new_state), optional.
    decode_step(inputs, static) -> the fused Mamba2 decode step's outputs, optional (see
    `jax_mamba2.decode_step`: DecodeStepInputs, DecodeStepStatic); decode_step_unsupported_reason(inputs,
    static) says why it cannot run a call.
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
    decode_step: Optional[Callable[..., dict]] = None
    decode_step_unsupported_reason: Optional[Callable[..., Optional[str]]] = None
    # Preferred by "auto" when supported (kernel backends); ties resolve by registration order.
    auto_priority: int = 0
    unavailable_reason: Optional[Callable[[], Optional[str]]] = None


class BackendStatus(NamedTuple):
    """Whether a backend can run in this process; `reason` says why not (None when it can)."""

    runnable: bool
    reason: Optional[str]


_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Adds (or replaces) a backend of the op."""
    _REGISTRY[backend.name] = backend


@functools.cache
def _import_failure(module: str) -> Optional[str]:
    """Imports `module` (which registers its backends); returns why it could not, if so."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        return str(e)
    return None


def registered() -> dict[str, Backend]:
    """The registered backends by name, in registration order, once the optional ones have been tried."""
    for module in dict.fromkeys(OPTIONAL_BACKENDS.values()):
        _import_failure(module)
    return dict(_REGISTRY)


def known_names() -> tuple[str, ...]:
    """Every backend name `ssd(..., backend=...)` knows besides "auto", runnable here or not."""
    return tuple(dict.fromkeys((*registered(), *OPTIONAL_BACKENDS)))


def _missing_reason(name: str) -> str:
    module = OPTIONAL_BACKENDS[name]
    return _import_failure(module) or f"importing {module} did not register it"


def get(name: str, api: str) -> Backend:
    """The backend called `name`. Raises ValueError naming `api` when no backend has that name, or when
    it is an optional backend whose module cannot be imported (saying why)."""
    backends = registered()
    if name in backends:
        return backends[name]
    if name in OPTIONAL_BACKENDS:
        raise ValueError(f"{api}(backend={name!r}) is unavailable: {_missing_reason(name)}")
    names = ", ".join(repr(n) for n in ("auto", *known_names()))
    raise ValueError(f"{api}: backend={name!r} is not one of {names}")


def auto_candidates() -> list[Backend]:
    """The backends "auto" tries before the xla path, most preferred first."""
    return sorted((b for b in registered().values() if b.auto_priority > 0), key=lambda b: -b.auto_priority)


def backend_status() -> dict[str, BackendStatus]:
    """For every known backend: whether it can run in this process and, if not, why.

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
