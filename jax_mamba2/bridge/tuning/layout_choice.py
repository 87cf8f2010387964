"""The configs of whole plans: which forward layout runs a problem, and the backward's shared stages.

Where several forward layouts can run a problem, the stages of each are resolved (`lookup.resolve`) and the
layout whose stages measured faster in sum wins; without measurements for every stage of every layout,
kernels.forward.forward_layout's rule decides. The backward's recompute stages (chunk_cumsum, chunk_state)
take the forward's configs where the forward runs them (one cache entry serves both passes); under the
fused forward layout chunk_state is looked up or tuned with the backward.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Iterator, Mapping, NamedTuple, Optional

from jax_mamba2.bridge.tuning.lookup import StageChoice, resolve
from jax_mamba2.bridge.tuning.timing import PlanSpec
from jax_mamba2.kernels import backward as backward_kernels
from jax_mamba2.kernels import forward as forward_kernels
from jax_mamba2.kernels._common import SSDDims

FORWARD = {
    layout: PlanSpec(stages, functools.partial(forward_kernels.forward_plan, layout=layout),
                     forward_kernels.forward_inputs)
    for layout, stages in forward_kernels.FORWARD_LAYOUTS.items()}
BACKWARD = {
    det: PlanSpec(backward_kernels.BACKWARD_STAGES,
                  functools.partial(backward_kernels.backward_plan, deterministic=det),
                  backward_kernels.backward_inputs, deterministic=det)
    for det in (False, True)}
# The backward stages that recompute forward quantities: they take the forward's configs.
_RECOMPUTED = tuple(s for s in backward_kernels.STAGES if s in forward_kernels.STAGES)


def _tuned_problem(dims: SSDDims) -> SSDDims:
    """The problem whose configs serve `dims`: the same without the op's reach term (one vector added per chunk
    or row block, which changes no tile's choice), so both share one tuning entry."""
    return dataclasses.replace(dims, has_reach=False)


class PlanRequest(NamedTuple):
    """A plan the bridge asked configs for: the forward (backward False) or the backward in one mode."""

    dims: SSDDims
    backward: bool = False
    deterministic: bool = False


# Set by `recording_requests`: where the requests made within are appended.
_REQUESTS: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("jax_mamba2_requests", default=None)


@contextlib.contextmanager
def recording_requests() -> Iterator[list[PlanRequest]]:
    """Within, every `forward_configs` / `backward_configs` call appends its PlanRequest to the list
    yielded (in call order, repeats included)."""
    requests: list[PlanRequest] = []
    token = _REQUESTS.set(requests)
    try:
        yield requests
    finally:
        _REQUESTS.reset(token)


def _record(request: PlanRequest) -> None:
    requests = _REQUESTS.get()
    if requests is not None:
        requests.append(request)


def plan_us(choices: Mapping[str, StageChoice]) -> Optional[float]:
    """The summed measured time of a plan's stages (us), or None if any stage has no measurement."""
    times = [(c.entry or {}).get("mean_us") for c in choices.values()]
    return None if any(t is None for t in times) else sum(times)


def layout_choices(dims: SSDDims) -> dict[str, dict[str, StageChoice]]:
    """The stage choices of every layout the op may run `dims` in (looked up, tuned, or defaulted)."""
    return {layout: resolve(dims, FORWARD[layout]) for layout in forward_kernels.forward_layouts(dims)}


def forward_choices(dims: SSDDims) -> tuple[str, dict[str, StageChoice]]:
    """The forward's faster layout and its stage choices (see the module docstring)."""
    layouts = layout_choices(dims)
    times = {layout: plan_us(choices) for layout, choices in layouts.items()}
    if len(layouts) > 1 and None not in times.values():
        layout = min(times, key=times.get)
    else:
        layout = forward_kernels.forward_layout(dims)
    return layout, layouts[layout]


def backward_choices(dims: SSDDims, deterministic: bool) -> dict[str, StageChoice]:
    """The stage choices of the backward in one mode, its recompute stages those of the forward."""
    _, forward = forward_choices(dims)
    return resolve(dims, BACKWARD[deterministic], {s: forward[s] for s in _RECOMPUTED if s in forward})


def forward_configs(dims: SSDDims) -> forward_kernels.ForwardConfigs:
    """The forward's layout and the config of each of its stages for `dims` on this GPU.

    Args:
      dims: the problem, as `kernels.forward.forward_plan` takes it.

    Returns:
      (layout, {stage: config} for every stage of that layout), ready for
      `forward_plan(dims, configs, layout)`.

    Raises:
      ValueError: when $JAX_MAMBA2_AUTOTUNE is set to neither "0" nor "1".
    """
    dims = _tuned_problem(dims)
    _record(PlanRequest(dims))
    layout, choices = forward_choices(dims)
    return forward_kernels.ForwardConfigs(layout, {stage: choice.config for stage, choice in choices.items()})


def backward_configs(dims: SSDDims, deterministic: bool = False) -> dict[str, Any]:
    """The config of every backward stage for `dims` on this GPU.

    The recompute stages (chunk_cumsum, chunk_state) get `forward_configs(dims)`'s configs where the
    forward has them.

    Args:
      dims: the problem, as `kernels.backward.backward_plan` takes it.
      deterministic: the plan's mode (it changes the launches of the group-reducing stages, so they
        are tuned per mode when a group has several heads).

    Returns:
      {stage: config} for every stage of kernels.backward.BACKWARD_STAGES, ready for
      `backward_plan(dims, configs, deterministic=deterministic)`.

    Raises:
      ValueError: when $JAX_MAMBA2_AUTOTUNE is set to neither "0" nor "1".
    """
    dims = _tuned_problem(dims)
    _record(PlanRequest(dims, backward=True, deterministic=deterministic))
    return {stage: choice.config for stage, choice in backward_choices(dims, deterministic).items()}
