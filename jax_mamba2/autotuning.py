"""`autotune(fn, *args, **kwargs)`: tune the cuTile kernels of a program's SSD calls ahead of time."""
from __future__ import annotations

from typing import Callable


def autotune(fn: Callable, *args, **kwargs) -> list:
    """Tunes the cuTile kernel configs of every SSD call in `fn(*args, **kwargs)`, ahead of time.

    Without it (and without `JAX_MAMBA2_AUTOTUNE=1`) every problem runs its default configs, chosen per
    shape from what tuning measured on an H200: the first call of a shape costs compiles, not a search.
    `fn` is traced abstractly (nothing runs; arguments may be `jax.ShapeDtypeStruct`s), every forward and
    backward plan its cuTile SSD calls use is tuned on this GPU with a progress bar (tqdm where installed)
    and stored in the tuning cache (`$JAX_MAMBA2_CACHE_DIR`, default ~/.cache/jax_mamba2/), so that the
    later `jax.jit(fn)` runs the tuned configs. JAX's caches are cleared before the trace (a program
    traced before would not ask for its configs again) and after tuning where a config changed.
    Tuning a plan takes kernel compiles (each stage's configs compiled concurrently, then timed) the first
    time, nothing once cached. Problems of fewer
    than 2^17 (token, head) pairs keep their defaults (launch-bound: not worth tuning). A stage whose tuning
    fails (no memory, no config that compiles) keeps its default config, with a RuntimeWarning, for the rest of
    the process: neither this call nor a later trace tunes it again.

    Example:
      >>> step = jax.jit(jax.grad(loss))                                         # doctest: +SKIP
      >>> jax_mamba2.autotune(step, params, batch)  # once, before the first step  # doctest: +SKIP
      >>> grads = step(params, batch)                                            # doctest: +SKIP

    Returns:
      One `TunedPlan` (request, layout, configs, sources) per distinct plan, in trace order; [] where `fn`
      makes no cuTile SSD call.

    Raises:
      TypeError: `fn` is not callable.
      ImportError: the cuTile backends are not installed (pip install 'jax-mamba2[cuda]').
      RuntimeError: `fn` makes cuTile SSD calls but nothing can be tuned here (no supported CUDA GPU, or
        neither torch nor CuPy to time the kernels with).
    """
    if not callable(fn):
        raise TypeError(f"autotune: fn={fn!r} must be a callable (the program whose SSD calls to tune)")
    try:
        from jax_mamba2.bridge.tuning import ahead_of_time
    except ImportError as e:
        raise ImportError(f"jax_mamba2.autotune needs the cuTile backends (pip install 'jax-mamba2[cuda]'): "
                          f"{e}") from e
    return ahead_of_time.autotune(fn, *args, **kwargs)
