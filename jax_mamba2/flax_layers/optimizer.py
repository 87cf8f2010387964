"""`Optimizer`: nnx.Optimizer that takes a `jax_mamba2.fused_adamw` step in one kernel launch per parameter.

With a `FusedAdamW` as its transformation, `update(model, grads)` calls its `apply` (the step's arrays each read
and written once) instead of optax's update followed by optax.apply_updates; with any other transformation it is
nnx.Optimizer. The optimizer state is the same optax state either way, so checkpoints move between the two.

Example:
  >>> tx = jax_mamba2.fused_adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1, max_grad_norm=1.0)  # doctest: +SKIP
  >>> optimizer = Optimizer(model, tx, wrt=nnx.Param)                                            # doctest: +SKIP
  >>> optimizer.update(model, grads)                                                             # doctest: +SKIP
"""
from flax import nnx

from jax_mamba2.adamw import FusedAdamW


class Optimizer(nnx.Optimizer):
    """nnx.Optimizer(model, tx, wrt=...) whose `update` takes a FusedAdamW's fused step."""

    def update(self, model, grads, /, **kwargs):
        """Updates `model`'s parameters selected by `wrt` and the optimizer state in place from `grads` (nnx.grad's
        state of the model). Returns None on the fused path (nnx.Optimizer returns optax's updates, which the fused
        step never forms); extra keyword arguments take optax's path."""
        if not isinstance(self.tx, FusedAdamW) or kwargs:
            return super().update(model, grads, **kwargs)
        graph = getattr(self, "graph", None)
        params = nnx.as_pure(nnx.state(model, self.wrt, graph=graph))
        grads = nnx.as_pure(nnx.state(grads, self.wrt, graph=graph))
        new_params, new_opt_state = self.tx.apply(params, grads, nnx.as_pure(self.opt_state))
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_opt_state, graph=graph))
        self.step[...] += 1
        return None
