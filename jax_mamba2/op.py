"""The public Mamba-2 SSD op: input checks, backend dispatch and the custom VJP of opaque kernels.

`ssd` has the semantics of mamba_ssm's `mamba_chunk_scan_combined`; `ssd_step` those of its
`selective_state_update` (plus `dt_limit`, so that stepping through a sequence equals the full op).

Backends are entries of the registry in `jax_mamba2.backends`. "scan" (lax.scan recurrence, the oracle)
and "xla" (chunked pure JAX) are registered here; the kernel backends register themselves from their own
modules. "auto" picks a kernel backend that supports the call (behind `lax.platform_dependent`, so the
program still lowers for CPU) and xla otherwise. A backend asked for by name never falls back.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from jax_mamba2 import backends as registry
from jax_mamba2 import reference
from jax_mamba2.checks import (check_array, check_dt_limit, check_flag, check_float, check_ndim, is_concrete,
                               nondecreasing, raise_unordered_seq_idx)
from jax_mamba2.ssd_args import (Dims, SSDInputs, SSDStatic, check_head_options, check_inputs,
                                 check_model_sizes)


def _reference_kwargs(inputs: SSDInputs, static: SSDStatic) -> dict:
    return dict(D=inputs.D, z=inputs.z, dt_bias=inputs.dt_bias, dt_softplus=static.dt_softplus,
                dt_limit=static.dt_limit, initial_states=inputs.initial_states, seq_idx=inputs.seq_idx)


def _xla_forward(inputs: SSDInputs, static: SSDStatic):
    return reference.ssd_chunked(*inputs[:5], static.chunk_size, **_reference_kwargs(inputs, static))


def _scan_forward(inputs: SSDInputs, static: SSDStatic):
    return reference.ssd_scan(*inputs[:5], **_reference_kwargs(inputs, static))


def _reference_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit):
    return reference.ssd_step(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                              dt_softplus=dt_softplus, dt_limit=dt_limit)


registry.register_backend(registry.Backend("xla", _xla_forward, registry.always_supported, differentiable=True,
                                           step=_reference_step))
registry.register_backend(registry.Backend("scan", _scan_forward, registry.always_supported, differentiable=True,
                                           step=_reference_step))


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------

def _check_values(api, A, dt, dt_bias, dt_softplus, dt_limit, seq_idx=None):
    """The preconditions on values, for the arrays that are concrete (a tracer's values are unknown).

    A <= 0 and Δ >= 0 keep every decay exp(Δ A) <= 1, which the chunked algorithms assume (they clamp
    exp(min(dA_l - dA_s, 0))); a nondecreasing seq_idx is how packed sequences come (mamba_ssm's precondition;
    every backend restarts wherever the id changes, so an id that comes back is reported rather than mistaken).
    The reductions run where the arrays live (also for concrete arrays closed over by a traced function); one
    host transfer fetches their results. They pass NaNs over (a NaN is data, confined to its sequence), so that a
    NaN elsewhere does not hide a positive A or a negative Δ.
    """
    checks = {}
    with jax.ensure_compile_time_eval():
        if is_concrete(A):
            checks["A"] = jnp.nanmax(A)
        # Δ = dt (+ dt_bias) as given unless the softplus or a dt_limit clip (min >= 0) makes it >= 0.
        if not dt_softplus and tuple(dt_limit) == (0.0, math.inf) and is_concrete(dt) and \
                (dt_bias is None or is_concrete(dt_bias)):
            checks["dt"] = jnp.nanmin(dt if dt_bias is None else jnp.add(dt, dt_bias))
        if is_concrete(seq_idx) and seq_idx.shape[1] > 1:
            checks["seq_idx"] = nondecreasing(seq_idx)
    if not checks:
        return
    found = jax.device_get(checks)
    if "A" in found and found["A"] > 0:
        raise ValueError(f"{api}: A must be <= 0 (mamba_ssm's A = -exp(A_log)); got max(A)={found['A']}")
    if "dt" in found and found["dt"] < 0:
        what = "dt" if dt_bias is None else "dt + dt_bias"
        raise ValueError(f"{api}: {what} must be >= 0 without dt_softplus or a dt_limit (it is the time step "
                         f"Δ); got min({what})={found['dt']}")
    if "seq_idx" in found and not found["seq_idx"]:
        raise_unordered_seq_idx(api, seq_idx)


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------


def _xla_vjp(inputs: SSDInputs, static: SSDStatic, dy, dfinal, saved=None):
    del saved  # the xla path recomputes what it needs
    float_inputs = inputs._replace(seq_idx=None)

    def f(float_inputs):
        return _xla_forward(float_inputs._replace(seq_idx=inputs.seq_idx), static)

    _, vjp = jax.vjp(f, float_inputs)
    (grads,) = vjp((dy, dfinal))
    return grads


# Non-finite values. The kernels mix the tokens of a chunk in matrix products and mask by multiplying with 0,
# so a NaN or inf would reach other tokens and packed sequences of its batch row. With check_finite they run as
# the xla path's stages do (reference.ssd_chunked): on the finite part of their inputs, while a cheap per-(token,
# head) term adds NaN from each non-finite input to the end of its sequence (`_reach_terms`); the forward kernels
# add it to the rows of y they write. Their backward takes the finite part of the cotangents; the term's own VJP
# carries a non-finite cotangent to the inputs of its sequence, and its share of dx (per (token, head), as the
# term) is added to the rows of dx by the kernel that writes them. No conditional and no second program: the
# price is an elementwise pass over x forward and one over dy backward (docs/design.md §2).

# The gate z stays as it is in the forward: y * silu(z) is per token, so a non-finite z reaches its own token's
# output and nothing else. Its finite part is what the backward takes, where the gate's VJP would otherwise put a
# NaN into the cotangent the kernels mix (the select fuses into that VJP's elementwise pass).
_SANITIZED = ("x", "A", "B", "C", "initial_states")


def _transformed_dt(static: SSDStatic, dt, dt_bias) -> jax.Array:
    """Δ (batch, seqlen, nheads) float32, as the kernels compute it from dt (and dt_bias), NaN where negative
    (`reference.negative_steps_as_nan`: confined as a non-finite dt, as on the xla and scan paths)."""
    return reference.negative_steps_as_nan(reference.dt_transform(
        dt.astype(jnp.float32), dt_bias, dt_softplus=static.dt_softplus, dt_limit=static.dt_limit))


def _finite_inputs(inputs: SSDInputs, static: SSDStatic) -> SSDInputs:
    """The kernels' inputs with their non-finite entries replaced by 0 (z excepted); dt where its Δ is not
    finite by 0, and elsewhere clipped to the finite range (an infinite dt whose Δ the limit or the softplus
    makes finite keeps that Δ)."""
    dt = jnp.where(jnp.isfinite(_transformed_dt(static, inputs.dt, inputs.dt_bias)), jnp.nan_to_num(inputs.dt),
                   jnp.zeros((), inputs.dt.dtype))
    return inputs._replace(dt=dt, **{name: reference.finite_part(getattr(inputs, name)) for name in _SANITIZED})


# The inputs of `_reach_terms` besides x's marks: the ones whose non-finite entries the term marks.
_MARKED = ("dt", "A", "B", "C", "initial_states", "dt_bias")
# The name scope of the confinement's XLA ops (the finite parts, the term and its VJP), so that a profile tells
# them from the kernels (benchmarks/kernel_categories.py).
CONFINEMENT_SCOPE = "nonfinite_confinement"


def _reach_terms(static: SSDStatic, seq_idx, x_marks, dt, A, B, C, initial_states, dt_bias):
    """(reach_y (b, L, h), reach_final (b, h)) float32: 0 where the recurrence carries no non-finite input,
    NaN where it does (`reference.nonfinite_reach`); x enters as its per-(token, head) marks."""
    reach_y, reach_final = reference.nonfinite_reach(x_marks, _transformed_dt(static, dt, dt_bias), A, B, C,
                                                     initial_states, seq_idx)
    return reach_y.astype(jnp.float32), reach_final.astype(jnp.float32)


def _confined_forward(backend, static, inputs, saving: bool):
    """((y, final_states), saved, (kernel inputs, x's marks)) of the kernels run on the finite part of `inputs`
    (the kernel inputs, with the reach term that the kernels add to y); saved is None unless `saving`; without
    check_finite the kernels run on `inputs` as they are, and the marks are None. (The backward recomputes the
    term from the marks for its VJP: per-(token, head) elementwise work, where keeping the VJP's residuals
    would hold four more f32 (batch, seqlen, nheads) arrays per call.)"""
    x_marks = None
    if static.check_finite:
        with jax.named_scope(CONFINEMENT_SCOPE):
            x_marks = reference.head_marks(inputs.x)
            reach_y, reach_final = _reach_terms(static, inputs.seq_idx, x_marks,
                                                *(getattr(inputs, name) for name in _MARKED))
            inputs = _finite_inputs(inputs, static)._replace(reach=reach_y)
    if not saving or backend.forward_saving is None or not static.save_chunk_states:
        (y, final), saved = backend.forward(inputs, static), None
    else:
        (y, final), saved = backend.forward_saving(inputs, static)
    if static.check_finite:
        with jax.named_scope(CONFINEMENT_SCOPE):
            final = final + reach_final[..., None, None]
    return (y, final), saved, (inputs, x_marks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _opaque_ssd(backend: registry.Backend, static: SSDStatic, inputs: SSDInputs):
    return _confined_forward(backend, static, inputs, saving=False)[0]


def _opaque_ssd_fwd(backend, static, inputs):
    outputs, saved, (kernel_inputs, x_marks) = _confined_forward(backend, static, inputs, saving=True)
    return outputs, (kernel_inputs, saved, x_marks)


def _add(a, b):
    return a if b is None else a + b.astype(a.dtype)


def _opaque_ssd_bwd(backend, static, residuals, cotangents):
    """The gradients of the kernels run on `inputs` (their finite part with check_finite: at a non-finite
    input the gradient is unspecified, as the xla path's) plus the reach term's: the term's cotangent is that
    of an additive term of y (dy summed over headdim) and of the final states; its VJP to x, per (token,
    head), is what the dx kernel adds to its rows, the rest XLA adds to the small arrays' gradients."""
    inputs, saved, x_marks = residuals
    dy, dfinal = cotangents
    if static.check_finite:
        with jax.named_scope(CONFINEMENT_SCOPE):
            _, reach_vjp = jax.vjp(functools.partial(_reach_terms, static, inputs.seq_idx), x_marks,
                                   *(getattr(inputs, name) for name in _MARKED))
            marks_grad, *marked_grads = reach_vjp((jnp.sum(dy, axis=3).astype(jnp.float32),
                                                  jnp.sum(dfinal, axis=(2, 3), dtype=jnp.float32)))
            dy, dfinal = reference.finite_part(dy), reference.finite_part(dfinal)
            inputs = inputs._replace(z=reference.finite_part(inputs.z), dx_reach=0 * marks_grad)
    if backend.backward is None:
        grads = _xla_vjp(inputs._replace(reach=None, dx_reach=None), static, dy, dfinal)
        if inputs.dx_reach is not None:
            grads = grads._replace(x=grads.x + inputs.dx_reach[..., None].astype(grads.x.dtype))
    else:
        grads = backend.backward(inputs, static, dy, dfinal, saved)
    if static.check_finite:
        with jax.named_scope(CONFINEMENT_SCOPE):
            grads = grads._replace(**{name: _add(getattr(grads, name), grad) for name, grad in
                                      zip(_MARKED, marked_grads) if getattr(grads, name) is not None})
    return (grads._replace(seq_idx=None, reach=None, dx_reach=None),)


_opaque_ssd.defvjp(_opaque_ssd_fwd, _opaque_ssd_bwd)


def _run_backend(backend: registry.Backend, inputs: SSDInputs, static: SSDStatic):
    if backend.differentiable:
        return backend.forward(inputs, static)
    return _opaque_ssd(backend, static, inputs)


def _empty_result(inputs: SSDInputs, dims: Dims):
    state_dtype = jnp.float64 if inputs.x.dtype == jnp.float64 else jnp.float32
    y = jnp.zeros(inputs.x.shape, inputs.x.dtype)
    if inputs.initial_states is not None and dims.seqlen == 0:
        final = inputs.initial_states.astype(state_dtype)
    else:
        final = jnp.zeros((dims.batch, dims.nheads, dims.headdim, dims.dstate), state_dtype)
    return y, final


def ssd(x, dt, A, B, C, chunk_size=256, *, D=None, z=None, dt_bias=None, dt_softplus=False,
        dt_limit=(0.0, math.inf), initial_states=None, seq_idx=None, return_final_states=False,
        backend="auto", deterministic_backward=False, save_chunk_states=True, check_finite=True):
    """Mamba-2 SSD (structured state space duality), as mamba_ssm's `mamba_chunk_scan_combined`.

    Per batch row b and head h, with Δ_t = clip(softplus(dt_t + dt_bias), dt_limit) (softplus only
    when `dt_softplus`) and g(h) = h // (nheads // ngroups):
        h_t = exp(Δ_t A_h) h_{t-1} + Δ_t x_t ⊗ B_t,g(h);   y_t = h_t C_t,g(h) + D_h x_t;
        y_t *= silu(z_t) if z is given (the gate comes after D).
    dt math, decays, states and accumulation run in float32 (float64 for float64 inputs).
    Differentiable in reverse mode in every float argument, also through final_states (the cuTile
    backends run cuTile backward kernels), and composes with jit, vmap, shard_map and remat. Forward mode
    (jax.jvp, jax.linearize, jax.jacfwd) only on "scan": the kernels and the xla path's confinement of
    non-finite values are custom VJPs, of which JAX raises TypeError ("can't apply forward-mode autodiff").
    Derivatives of derivatives (jax.hessian, a gradient of a gradient) on "xla" and "scan"; the cuTile
    backends' backward kernels have no derivatives, so there they raise TypeError saying so.

    Preconditions: A <= 0; Δ >= 0 (dt + dt_bias >= 0 unless dt_softplus or a dt_limit makes it so);
    seq_idx nondecreasing. They are checked, raising ValueError, on the arrays that are concrete, which
    costs a reduction over them and one host sync per call. Under jit, vmap or grad the arrays are tracers
    and go unchecked: a negative Δ is then taken as NaN (a non-finite dt, below; by the kernels with
    `check_finite`), and a decreasing seq_idx restarts the state where the id changes, on every backend, while
    for a positive A the backends disagree (the chunked ones assume decays exp(Δ A) <= 1).

    Non-finite values: a NaN or inf in an input of one token reaches that token's head (a group's heads
    for B and C) from that token to the end of its sequence, and the final state when that is the last
    one, as in the recurrence; never another packed sequence, an earlier token, or their gradients, on
    every backend. The cuTile kernels would carry it further (they mix the tokens of a chunk in matrix
    products), so they run on the finite part of their inputs and cotangents while a per-(token, head) term
    adds NaN where the recurrence carries a non-finite input, as the xla path does; an all-finite call
    returns the kernels' outputs as they are. `check_finite=False` leaves that out. With it, D's gradient, a
    sum over every sequence, takes the finite part of x and of y's cotangent, as the xla path's does (the
    scan's is NaN where any x or cotangent of D's head is). A non-finite A (one per head, no token's) makes
    its head's outputs NaN on every backend but "scan", which computes exp(Δ A) as it comes (0 for A = -inf
    and Δ > 0).

    Args:
      x: (batch, seqlen, nheads, headdim), bf16/f16/f32/f64.
      dt: (batch, seqlen, nheads), float; raw time steps.
      A: (nheads,), float, <= 0 (mamba_ssm: -exp(A_log); 0 is no decay).
      B, C: (batch, seqlen, ngroups, dstate), float; nheads % ngroups == 0.
      chunk_size: power of two; the chunk length of the chunked algorithm (256 as in mamba_ssm). The
        result depends on it only through rounding; the cutile backends run their kernels at chunk 64
        whatever it is (their fastest).
      D: (nheads,) or (nheads, headdim), optional skip connection.
      z: (batch, seqlen, nheads, headdim), optional gate.
      dt_bias: (nheads,), optional, added to dt before the softplus.
      dt_softplus: apply softplus to dt + dt_bias.
      dt_limit: (min, max) clip of Δ; (0, inf) means no clipping.
      initial_states: (batch, nheads, headdim, dstate), optional state before the first token.
      seq_idx: (batch, seqlen) int32, optional, nondecreasing along seqlen: packed sequences. The state
        resets where it changes, and initial_states reach only the row's first sequence, where its id is 0
        (the id before token 0 is 0, mamba_ssm's rule).
      return_final_states: also return the state after the last token.
      backend: "auto", "cutile", "cutile_callback", "xla" or "scan" (see `jax_mamba2.backend_status()`).
      deterministic_backward: make the cuTile backward bitwise reproducible run to run: no float
        atomics, the heads of a group summed by one block in order (slower where that leaves few blocks).
        The other backends are deterministic anyway.
      save_chunk_states: let a differentiated cuTile forward keep the chunk-entry states (dstate / 64
        times x's bytes) and the chunk quantities Δ and dA_cumsum for the backward; False keeps only the
        inputs and the backward recomputes them (less memory, a longer backward). No effect elsewhere.
      check_finite: on the cuTile backends, confine NaN and inf as above (an elementwise pass over x forward
        and one over y's cotangent backward). False runs the kernels on the arrays as they are: a NaN
        or inf may then reach the other tokens of its chunk and the later chunks of its batch row, other
        packed sequences included. No effect elsewhere.

    Returns:
      y (batch, seqlen, nheads, headdim) in x.dtype, and with `return_final_states` also
      final_states (batch, nheads, headdim, dstate) in float32 (float64 for float64 x).

    Raises:
      ValueError / TypeError: on a wrong shape, dtype or option, naming the argument, before any
        computation; ValueError when a concrete A, dt or seq_idx breaks a precondition, or when a named
        backend cannot run the call, saying why.

    Example:
      >>> b, L, H, P, G, N = 1, 64, 2, 16, 1, 16
      >>> x = jnp.ones((b, L, H, P)); dt = jnp.full((b, L, H), 0.1); A = -jnp.ones((H,))
      >>> B = C = jnp.ones((b, L, G, N))
      >>> ssd(x, dt, A, B, C, chunk_size=32, backend="xla").shape
      (1, 64, 2, 16)
    """
    dims = check_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx)
    static = SSDStatic(dims.chunk_size, check_flag("ssd", "dt_softplus", dt_softplus),
                       check_dt_limit("ssd", dt_limit),
                       check_flag("ssd", "deterministic_backward", deterministic_backward),
                       check_flag("ssd", "save_chunk_states", save_chunk_states),
                       check_flag("ssd", "check_finite", check_finite))
    return_final_states = check_flag("ssd", "return_final_states", return_final_states)
    _check_values("ssd", A, dt, dt_bias, static.dt_softplus, static.dt_limit, seq_idx)
    inputs = SSDInputs(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx)
    selected = registry.select(backend, "ssd", lambda b: b.unsupported_reason(inputs, static))
    if dims.batch * dims.seqlen == 0:
        y, final = _empty_result(inputs, dims)
    else:
        y, final = registry.run_compiled(tuple(selected), _run_backend, static, inputs)
    return (y, final) if return_final_states else y


# ----------------------------------------------------------------------------------------------
# Decode step
# ----------------------------------------------------------------------------------------------

def _check_step_inputs(state, x, dt, A, B, C, D, z, dt_bias):
    api = "ssd_step"
    batch, nheads, headdim, dstate = check_ndim(api, "state", state, 4, "(batch, nheads, headdim, dstate)")
    check_float(api, "state", state)
    check_array(api, "x", x, "(batch, nheads, headdim)", (batch, nheads, headdim))
    check_array(api, "dt", dt, "(batch, nheads)", (batch, nheads))
    check_array(api, "A", A, "(nheads,)", (nheads,))
    ngroups = check_ndim(api, "B", B, 3, "(batch, ngroups, dstate)")[1]
    check_array(api, "B", B, "(batch, ngroups, dstate)", (batch, ngroups, dstate))
    check_array(api, "C", C, "(batch, ngroups, dstate)", (batch, ngroups, dstate))
    check_model_sizes(api, nheads, headdim, dstate)
    if ngroups < 1 or nheads % ngroups:
        raise ValueError(f"ssd_step: nheads={nheads} must be divisible by ngroups={ngroups}")
    check_head_options(api, x, D, z, dt_bias)


def _step_unsupported_reason(backend: registry.Backend, args) -> Optional[str]:
    if backend.step is None:
        return "it has no decode step; use 'auto' or 'xla'"
    return None if backend.step_unsupported_reason is None else backend.step_unsupported_reason(*args)


def _run_step(backend: registry.Backend, *arrays_and_options):
    *arrays, options = arrays_and_options
    if backend.step is _reference_step or arrays[0].shape[0] == 0:  # no rows: no launch (a grid of no blocks)
        return _reference_step(*arrays, *options)
    return _kernel_step(backend, options, *arrays)


# The decode kernel has no backward kernel: its gradient is the reference step's, which it equals.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _kernel_step(backend: registry.Backend, options, *arrays):
    return backend.step(*arrays, *options)


def _kernel_step_fwd(backend, options, *arrays):
    return _kernel_step(backend, options, *arrays), arrays


def _kernel_step_bwd(backend, options, arrays, cotangents):
    return registry.reference_vjp(lambda *a: _reference_step(*a, *options), arrays, cotangents)


_kernel_step.defvjp(_kernel_step_fwd, _kernel_step_bwd)


def ssd_step(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, math.inf), backend="auto"):
    """One decode step of the SSD recurrence (mamba_ssm `selective_state_update`, plus dt_limit).

    Args:
      state: (batch, nheads, headdim, dstate), float; the state before this token.
      x: (batch, nheads, headdim); dt: (batch, nheads); A: (nheads,);
      B, C: (batch, ngroups, dstate); D: (nheads,) or (nheads, headdim); z: like x; dt_bias: (nheads,).
      dt_softplus, dt_limit: as in `ssd`.
      backend: "auto" (the cuTile decode kernel on a supported GPU, else pure JAX), "cutile",
        "cutile_callback", "xla" or "scan" ("xla" and "scan" share the pure-JAX step).

    Returns:
      (y (batch, nheads, headdim) in x.dtype, new_state in state.dtype). Feeding a sequence token by
      token through `ssd_step` gives the same y and final state as `ssd` (within its preconditions: a
      step computes a negative Δ's growth, where `ssd` under jit gives NaN). Differentiable in every float
      argument on every backend (the decode kernel's gradient is the pure-JAX step's, which it equals).

    Raises:
      ValueError / TypeError: on a wrong shape, dtype or option, naming the argument; ValueError when A
        or Δ break `ssd`'s preconditions (A <= 0, Δ >= 0), checked on concrete arrays only (under jit,
        vmap or grad they are tracers and go unchecked).
    """
    _check_step_inputs(state, x, dt, A, B, C, D, z, dt_bias)
    limit = check_dt_limit("ssd_step", dt_limit)
    softplus = check_flag("ssd_step", "dt_softplus", dt_softplus)
    _check_values("ssd_step", A, dt, dt_bias, softplus, limit)
    args = (state, x, dt, A, B, C, D, z, dt_bias, softplus, limit)
    selected = registry.select(backend, "ssd_step", lambda b: _step_unsupported_reason(b, args))
    return registry.run_compiled(tuple(selected), _run_step, args[9:], *args[:9])
