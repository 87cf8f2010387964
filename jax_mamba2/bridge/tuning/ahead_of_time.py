"""Tuning every cuTile SSD call of a program ahead of time (`jax_mamba2.autotune`).

The program is traced abstractly (`jax.eval_shape`: nothing runs, arguments may be jax.ShapeDtypeStruct)
with tuning off, recording every forward and backward plan the cutile backends ask configs for; JAX's
caches are cleared first (`jax.clear_caches`), since a program traced before would answer from its cached
trace without asking. Each distinct plan is then tuned (every forward layout that can run it, or the
backward in its mode) into the cache file, with a progress bar over the plans and one per stage, and the
in-process memory answers the later traces. Where a plan's configs changed, the caches are cleared again,
so that the programs traced meanwhile (this tracing's included) are traced again with the tuned configs.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax

from jax_mamba2.bridge.tuning import layout_choice, lookup, timing
from jax_mamba2.bridge.tuning.layout_choice import PlanRequest


class TunedPlan(NamedTuple):
    """One plan of the program after tuning: the forward's layout (None for a backward), the config of each
    stage, and where each came from ("tuned", "disk" or "default", as `lookup.StageChoice.source`)."""

    request: PlanRequest
    layout: Optional[str]
    configs: dict[str, Any]
    sources: dict[str, str]


def _plan(request: PlanRequest) -> TunedPlan:
    if request.backward:
        layout, choices = None, layout_choice.backward_choices(request.dims, request.deterministic)
    else:
        layout, choices = layout_choice.forward_choices(request.dims)
    return TunedPlan(request, layout, {s: c.config for s, c in choices.items()},
                     {s: c.source for s, c in choices.items()})


def find_plans(fn: Callable, *args, **kwargs) -> list[PlanRequest]:
    """The distinct cuTile SSD plans `fn(*args, **kwargs)` runs, in the order its trace first asks for them
    (traced abstractly with tuning off, after clearing JAX's caches; nothing is computed)."""
    jax.clear_caches()
    with lookup.tuning_on(False), layout_choice.recording_requests() as requests:
        jax.eval_shape(fn, *args, **kwargs)
    return list(dict.fromkeys(requests))


def autotune(fn: Callable, *args, **kwargs) -> list[TunedPlan]:
    """Tunes the kernel configs of every cuTile SSD call in `fn(*args, **kwargs)` (see the module docstring).

    Returns:
      A TunedPlan per distinct plan, in trace order ([] where `fn` makes no cuTile SSD call, e.g. on a
      machine where `ssd(backend="auto")` takes the xla path).

    Raises:
      RuntimeError: `fn` makes cuTile SSD calls but nothing can be tuned here (no supported CUDA GPU, or
        neither torch nor CuPy to time the kernels with).
    """
    requests = find_plans(fn, *args, **kwargs)
    if not requests:
        return []
    reason = lookup.tuning_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"jax_mamba2.autotune: cannot tune the {len(requests)} SSD plans of the program "
                           f"here: {reason}")
    with lookup.tuning_on(False):
        traced = [_plan(request) for request in requests]
    tuned = []
    with lookup.tuning_on(True), timing.progress_bar(len(requests), "jax_mamba2.autotune", "plan") as bar:
        for request in requests:
            tuned.append(_plan(request))
            bar.update(1)
    if any((before.layout, before.configs) != (after.layout, after.configs) for before, after in zip(traced, tuned)):
        jax.clear_caches()
    return tuned
