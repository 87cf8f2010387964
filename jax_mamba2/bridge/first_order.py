"""The kernel executors' launches as functions JAX refuses to differentiate with a message that says what to do.

Every kernel op differentiates through a custom VJP whose forward and backward run kernel plans, so a first
derivative never differentiates a launch. A derivative of that derivative (a gradient of a gradient,
`jax.hessian`, `jax.jvp` of `jax.grad`) differentiates the plans themselves, for which the launch primitives
have no rule (JAX's error names only the primitive); here it names the backend that has them (the xla path's
derivatives are JAX's own, to any order).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax

from jax_mamba2.kernels._common import Plan

RunPlan = Callable[[Plan, dict], dict]

HIGHER_ORDER_MESSAGE = (
    "the cuTile kernels (backends 'cutile', 'cutile_callback') differentiate once, in reverse mode (jax.grad, "
    "jax.vjp: each op's custom VJP runs backward kernels, which have no derivatives of their own); a derivative "
    "of a derivative (jax.hessian, a gradient of a gradient, jax.jvp of jax.grad) needs backend='xla'")


def first_order_only(run_plan: RunPlan) -> RunPlan:
    """`run_plan(plan, arrays) -> outputs` whose differentiation raises TypeError(HIGHER_ORDER_MESSAGE)."""

    @functools.wraps(run_plan)
    def run(plan: Plan, arrays: dict) -> dict:
        launch = jax.custom_jvp(lambda arrays: run_plan(plan, arrays))

        @launch.defjvp
        def _refused(primals, tangents):
            raise TypeError(HIGHER_ORDER_MESSAGE)

        return launch(arrays)

    return run
