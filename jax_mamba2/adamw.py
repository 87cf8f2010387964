"""AdamW in one pass per parameter array: the update op, and optax's AdamW as a transformation that takes it.

  adamw_update  one array's AdamW step (param, grad, mu, nu -> param', mu', nu') with the semantics of
                `jax_mamba2.adamw_reference` (optax.adamw's arithmetic, in float32). Backends are the "adamw"
                entries of `jax_mamba2.backends`: "xla" (that reference, registered here), "cutile" and
                "cutile_callback" (one kernel launch, kernels/adamw.py, registered by the bridge); "auto" picks
                the kernel on a supported GPU (behind `lax.platform_dependent`) and xla otherwise; a kernel
                backend asked for by name never falls back.
  fused_adamw   optax.adamw (after optax.clip_by_global_norm with `max_grad_norm`) as a `FusedAdamW`: its `init`
                and `update` are optax's own (the same state, so a checkpoint or a training loop moves between
                the two unchanged), and `apply(params, grads, state) -> (params, state)` takes the whole step with
                one `adamw_update` per parameter array. `jax_mamba2.flax_layers.Optimizer` calls `apply`.

Why: an optax step is XLA fusions that write the moments and read them back for the update (or write the update
and read it back for the parameters); the kernel reads the parameter, gradient and moments once and writes the
parameter and moments once, the floor of the step's memory traffic (docs/norms_and_loss.md).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mamba2 import adamw_reference as reference
from jax_mamba2 import backends as registry
from jax_mamba2.adamw_reference import AdamWHyper
from jax_mamba2.checks import check_array, check_flag

OP = "adamw"


def _bridge():
    """jax_mamba2.bridge.adamw_ops: how the kernel describes a call (`adamw_dims`). Called only once a kernel
    backend was selected, whose registration imported it."""
    from jax_mamba2.bridge import adamw_ops
    return adamw_ops


def _reference_packed(param, grad, mu, nu, hyper, *, decay: bool):
    """The reference on the kernel's operands: `hyper` the packed (HYPER_SIZE,) float32 scalars."""
    return reference.adamw_update(param, grad, mu, nu, AdamWHyper(*hyper), decay=decay)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _kernel_update(kernels, dims, param, grad, mu, nu, hyper):
    return kernels.update(dims, param, grad, mu, nu, hyper)


def _kernel_update_fwd(kernels, dims, *arrays):
    return kernels.update(dims, *arrays), arrays


def _kernel_update_bwd(kernels, dims, arrays, cotangents):
    # Differentiating an optimizer step (meta-gradients) is rare: the reference's VJP, recomputed.
    _, vjp = jax.vjp(functools.partial(_reference_packed, decay=dims.decay), *arrays)
    return vjp(cotangents)


_kernel_update.defvjp(_kernel_update_fwd, _kernel_update_bwd)

registry.register_backend(registry.LayerBackend("xla", None, registry.always_supported), op=OP)


def adamw_update(param, grad, mu, nu, hyper: AdamWHyper, *, decay: bool = True, backend: str = "auto"):
    """One AdamW step of one parameter array: (param', mu', nu'), each in its input's dtype and shape.

    Args:
      param, grad, mu, nu: arrays of one shape (bfloat16, float16 or float32 for the kernel; any float for xla):
        the parameter, its gradient and the first and second moments.
      hyper: the step's scalars (`jax_mamba2.adamw.AdamWHyper`: learning rate, b1, 1 - b1, b2, 1 - b2, eps, eps_root, weight decay,
        the bias corrections 1 - b1^t and 1 - b2^t of the step t taken, and the gradient's scale).
      decay: whether weight decay applies to this array.
      backend: "auto", "xla", "cutile" or "cutile_callback".
    """
    api = "adamw_update"
    check_array(api, "param", param)
    for name, arr in (("grad", grad), ("mu", mu), ("nu", nu)):
        check_array(api, name, arr, "param.shape", tuple(param.shape))
    if not isinstance(hyper, AdamWHyper):
        raise TypeError(f"{api}: hyper must be an AdamWHyper, got {type(hyper).__name__}")
    decay = check_flag(api, "decay", decay)
    flat = tuple(a.reshape(-1) for a in (param, grad, mu, nu))

    def kernel_dims():  # the kernel's description of the call (only a kernel backend needs it)
        return _bridge().adamw_dims(*flat, decay=decay)

    selected = registry.select(
        backend, api, lambda b: b.unsupported_reason(None if b.kernels is None else kernel_dims()), op=OP)
    if param.size == 0:
        return reference.adamw_update(param, grad, mu, nu, hyper, decay=decay)

    def run(b, p, g, m, v, h):
        if b.kernels is None:
            return _reference_packed(p, g, m, v, h, decay=decay)
        return _kernel_update(b.kernels, kernel_dims(), p, g, m, v, h)

    packed = jnp.stack([jnp.asarray(value, jnp.float32) for value in hyper])
    outputs = registry.run_selected(selected, run, *flat, packed)
    return tuple(o.reshape(param.shape) for o in outputs)


def _check_scalar(api: str, name: str, value, low: float, high: float, *, open_low: bool = False) -> float:
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or value > high or (open_low and value == low):
        bound = f"{'(' if open_low else '['}{low}, {high}]"
        raise ValueError(f"{api}: {name}={value!r} must be a finite float in {bound}")
    return float(value)


@dataclasses.dataclass(frozen=True, eq=False)
class FusedAdamW:
    """optax.adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask), chained after
    optax.clip_by_global_norm(max_grad_norm) unless that is None; build it with `fused_adamw`.

    init(params) / update(grads, state, params): the optax transformation's (`transformation`), so a
    FusedAdamW goes wherever an optax transformation does (nnx.Optimizer, optax.chain) and its state is that
    transformation's.
    apply(params, grads, state) -> (params, state): the same step as update + optax.apply_updates, in one
    kernel launch per parameter array on a GPU (`backend`).
    """

    learning_rate: Union[float, Callable[[jax.Array], jax.Array]]
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    eps_root: float = 0.0
    weight_decay: float = 1e-4
    mask: Any = None
    max_grad_norm: Optional[float] = None
    mu_dtype: Any = None
    backend: str = "auto"

    @functools.cached_property
    def transformation(self) -> optax.GradientTransformation:
        adamw = optax.adamw(self.learning_rate, b1=self.b1, b2=self.b2, eps=self.eps, eps_root=self.eps_root,
                            mu_dtype=self.mu_dtype, weight_decay=self.weight_decay, mask=self.mask)
        if self.max_grad_norm is None:
            return adamw
        return optax.chain(optax.clip_by_global_norm(self.max_grad_norm), adamw)

    def init(self, params):
        return self.transformation.init(params)

    def update(self, updates, state, params=None, **extra_args):
        return self.transformation.update(updates, state, params, **extra_args)

    def _decays(self, params) -> list:
        """Per parameter leaf (in tree order): whether weight decay applies (optax.masked's mask: a tree of
        bools shaped as params or a prefix of it, or a callable returning one)."""
        if self.weight_decay == 0:
            return [False] * len(jax.tree.leaves(params))
        if self.mask is None:
            return [True] * len(jax.tree.leaves(params))
        mask = self.mask(params) if callable(self.mask) else self.mask
        per_leaf = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), mask, params)
        decays = jax.tree.leaves(per_leaf)
        for value in decays:
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"FusedAdamW: mask leaves must be Python bools, got {type(value).__name__}")
        return [bool(value) for value in decays]

    def apply(self, params, grads, state):
        """(params', state'): one AdamW step (after the global-norm clip), the state in `init`'s structure."""
        clip_state, adamw_state = (None, state) if self.max_grad_norm is None else state
        adam_state, *decay_states, lr_state = adamw_state
        count = optax.safe_increment(adam_state.count)
        if callable(self.learning_rate):
            learning_rate = self.learning_rate(lr_state.count)
            lr_state = lr_state._replace(count=optax.safe_increment(lr_state.count))
        else:
            learning_rate = self.learning_rate
        grad_scale = 1.0
        if self.max_grad_norm is not None:
            norm = optax.tree.norm(grads)
            grad_scale = jnp.where(norm < self.max_grad_norm, 1.0, self.max_grad_norm / norm)
        # 1 - b in Python floats (rounded once, as optax's moments use it); the bias corrections as optax's.
        hyper = AdamWHyper(learning_rate, self.b1, 1 - self.b1, self.b2, 1 - self.b2, self.eps, self.eps_root,
                           self.weight_decay, 1 - self.b1 ** count, 1 - self.b2 ** count, grad_scale)
        treedef = jax.tree.structure(params)
        updated = [adamw_update(p, g, m, v, hyper, decay=d, backend=self.backend)
                   for p, g, m, v, d in zip(treedef.flatten_up_to(params), treedef.flatten_up_to(grads),
                                            treedef.flatten_up_to(adam_state.mu),
                                            treedef.flatten_up_to(adam_state.nu), self._decays(params))]
        new_params, mu, nu = (treedef.unflatten(column) for column in zip(*updated)) if updated else (params,) * 3
        adam_state = adam_state._replace(count=count, mu=mu, nu=nu)
        adamw_state = (adam_state, *decay_states, lr_state)
        return new_params, adamw_state if clip_state is None else (clip_state, adamw_state)


def fused_adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                weight_decay: float = 1e-4, *, mask=None, max_grad_norm: Optional[float] = None, mu_dtype=None,
                backend: str = "auto") -> FusedAdamW:
    """optax.adamw with these arguments (after optax.clip_by_global_norm(max_grad_norm) unless None), whose
    `apply` takes a step in one kernel launch per parameter array (see `FusedAdamW`).

    learning_rate: a float or an optax schedule (step -> rate); mask: optax.adamw's (which arrays decay: a tree
    of Python bools or a callable params -> tree). Arguments are checked here, before any step.
    """
    api = "fused_adamw"
    if not callable(learning_rate):
        _check_scalar(api, "learning_rate", learning_rate, 0.0, math.inf)
    b1 = _check_scalar(api, "b1", b1, 0.0, 1.0)
    b2 = _check_scalar(api, "b2", b2, 0.0, 1.0)
    if b1 == 1.0 or b2 == 1.0:
        raise ValueError(f"{api}: b1={b1} and b2={b2} must be below 1 (the bias corrections divide by 1 - b^t)")
    eps = _check_scalar(api, "eps", eps, 0.0, math.inf)
    eps_root = _check_scalar(api, "eps_root", eps_root, 0.0, math.inf)
    if eps == 0.0 and eps_root == 0.0:
        raise ValueError(f"{api}: eps and eps_root are both 0; a zero second moment would divide by zero")
    weight_decay = _check_scalar(api, "weight_decay", weight_decay, 0.0, math.inf)
    if max_grad_norm is not None:
        max_grad_norm = _check_scalar(api, "max_grad_norm", max_grad_norm, 0.0, math.inf, open_low=True)
    registry.check_name(backend, api, op=OP)
    return FusedAdamW(learning_rate, b1, b2, eps, eps_root, weight_decay, mask, max_grad_norm, mu_dtype, backend)
