"""jax_mamba2.fused_adamw / adamw_update on the xla backend (the reference the kernel is checked against): the
fused step equals optax's (clip_by_global_norm +) adamw + apply_updates over several steps, with a schedule,
weight-decay masks (callable, tree, prefix), mu_dtype and the clip, in optax's own state; the nnx Optimizer that
takes it; and the argument checks, raised before anything runs."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_mamba2
from jax_mamba2.adamw_reference import AdamWHyper
from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel, Optimizer

HYPER = AdamWHyper(1e-3, 0.9, 0.1, 0.999, 0.001, 1e-8, 0.0, 0.1, 0.1, 0.001, 1.0)


def _params():
    keys = jax.random.split(jax.random.key(0), 4)
    return {"embedding": jax.random.normal(keys[0], (50, 16)),
            "layer": {"kernel": jax.random.normal(keys[1], (16, 24)), "bias": jax.random.normal(keys[2], (24,))},
            "scale": jnp.ones((16,))}


def _grads(params, seed):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([0.3 * jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)])


def _max_relative_difference(a, b) -> float:
    return max(float(jnp.linalg.norm((x - y).astype(jnp.float32)) / jnp.linalg.norm(y.astype(jnp.float32)))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)) if y.size and jnp.any(y != 0))


def _kernel_mask(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", params)


@pytest.mark.parametrize("options", [
    dict(learning_rate=1e-3),
    dict(learning_rate=optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), b2=0.95, weight_decay=0.1,
         mask=_kernel_mask, max_grad_norm=1.0),
    dict(learning_rate=3e-3, weight_decay=0.05, mask={"embedding": False, "layer": True, "scale": False},
         eps_root=1e-10, max_grad_norm=100.0),
    dict(learning_rate=1e-3, mu_dtype=jnp.bfloat16),
], ids=["defaults", "schedule_mask_fn_clip", "prefix_mask_no_clip_eps_root", "bf16_mu"])
def test_fused_step_equals_optax_over_steps(options):
    """Same state structure and values as optax's transformation after 5 steps (the clip triggers at 1.0 and not
    at 100.0), within float32 rounding: the fused step computes in float32 as optax does for float32 arrays."""
    tx = jax_mamba2.fused_adamw(**options, backend="xla")
    params = _params()
    fused_params, fused_state = params, tx.init(params)
    optax_params, optax_state = params, tx.transformation.init(params)
    apply = jax.jit(tx.apply)
    for step in range(5):
        grads = _grads(params, step)
        fused_params, fused_state = apply(fused_params, grads, fused_state)
        updates, optax_state = tx.transformation.update(grads, optax_state, optax_params)
        optax_params = optax.apply_updates(optax_params, updates)
    assert jax.tree.structure(fused_state) == jax.tree.structure(optax_state)
    assert jax.tree.map(lambda a: a.dtype, fused_state) == jax.tree.map(lambda a: a.dtype, optax_state)
    # Parameters compared whole (their float32 rounding exceeds 1e-6 of a step; a step off by 1% would be 5e-5
    # of them), the moments relatively.
    assert _max_relative_difference(fused_params, optax_params) < (1e-4 if "mu_dtype" in options else 1e-6)
    assert _max_relative_difference(fused_state, optax_state) < (1e-2 if "mu_dtype" in options else 1e-6)


def test_masked_leaves_take_no_weight_decay():
    params = _params()
    grads = jax.tree.map(jnp.zeros_like, params)
    tx = jax_mamba2.fused_adamw(1e-2, weight_decay=0.5, mask=_kernel_mask, backend="xla")
    new, _ = tx.apply(params, grads, tx.init(params))
    # A zero gradient leaves only the decay: kernels shrink by lr * wd, the rest stay.
    np.testing.assert_allclose(new["layer"]["kernel"], params["layer"]["kernel"] * (1 - 1e-2 * 0.5), rtol=1e-6)
    for path in (("embedding",), ("layer", "bias"), ("scale",)):
        old, got = params, new
        for key in path:
            old, got = old[key], got[key]
        assert np.array_equal(got, old), path


def test_update_is_optax_and_apply_matches_it_on_one_array():
    tx = jax_mamba2.fused_adamw(1e-3, backend="xla")
    p = jax.random.normal(jax.random.key(1), (7, 3))
    g = jax.random.normal(jax.random.key(2), (7, 3))
    state = tx.init(p)
    updates, _ = tx.update(g, state, p)
    fused, _ = tx.apply(p, g, state)
    np.testing.assert_allclose(fused, optax.apply_updates(p, updates), rtol=1e-6, atol=1e-7)


def test_zero_size_leaf_passes_through():
    params = {"w": jnp.ones((3,)), "empty": jnp.zeros((0, 4))}
    tx = jax_mamba2.fused_adamw(1e-3, backend="xla")
    new, state = tx.apply(params, jax.tree.map(jnp.ones_like, params), tx.init(params))
    assert new["empty"].shape == (0, 4) and state[0].mu["empty"].shape == (0, 4)


def test_nnx_optimizer_takes_the_fused_step():
    """The LM trained 3 steps by flax_layers.Optimizer (fused apply) and by nnx.Optimizer (optax update) with one
    FusedAdamW: the same losses and parameters within float32 rounding, the same state structure, steps counted."""
    config = Mamba2Config(d_model=32, n_layer=2, vocab_size=64, ssm_cfg=dict(d_state=16, headdim=16, chunk_size=8))
    ids = jax.random.randint(jax.random.key(3), (2, 17), 0, 64)
    tx = jax_mamba2.fused_adamw(1e-2, weight_decay=0.1, max_grad_norm=1.0, backend="xla")

    def train(optimizer_type):
        model = Mamba2LMHeadModel(config, backend="xla", rngs=nnx.Rngs(0))
        optimizer = optimizer_type(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer):
            loss, grads = nnx.value_and_grad(lambda m: m.loss(ids[:, :-1], shift_labels=ids[:, 1:]))(model)
            optimizer.update(model, grads)
            return loss
        return [float(step(model, optimizer)) for _ in range(3)], model, optimizer

    fused_losses, fused_model, fused_opt = train(Optimizer)
    optax_losses, optax_model, optax_opt = train(nnx.Optimizer)
    np.testing.assert_allclose(fused_losses, optax_losses, rtol=1e-5)
    assert fused_losses[-1] < fused_losses[0]
    assert _max_relative_difference(nnx.state(fused_model, nnx.Param), nnx.state(optax_model, nnx.Param)) < 1e-5
    assert jax.tree.structure(nnx.state(fused_opt)) == jax.tree.structure(nnx.state(optax_opt))
    assert int(fused_opt.step[...]) == 3


@pytest.mark.parametrize("options,match", [
    (dict(learning_rate=-1.0), "learning_rate"),
    (dict(learning_rate=1e-3, b1=1.0), "b1"),
    (dict(learning_rate=1e-3, b2=1.5), "b2"),
    (dict(learning_rate=1e-3, eps=0.0), "eps"),
    (dict(learning_rate=1e-3, weight_decay=float("nan")), "weight_decay"),
    (dict(learning_rate=1e-3, max_grad_norm=0.0), "max_grad_norm"),
    (dict(learning_rate=1e-3, backend="cuda"), "backend"),
])
def test_fused_adamw_rejects_bad_arguments(options, match):
    with pytest.raises(ValueError, match=match):
        jax_mamba2.fused_adamw(**options)


def test_adamw_update_checks_its_arrays():
    p = jnp.ones((4, 3))
    with pytest.raises(ValueError, match=r"grad\.shape=\(3, 4\) must be param\.shape"):
        jax_mamba2.adamw_update(p, jnp.ones((3, 4)), p, p, HYPER)
    with pytest.raises(TypeError, match=r"mu\.dtype=int32"):
        jax_mamba2.adamw_update(p, p, jnp.ones((4, 3), jnp.int32), p, HYPER)
    with pytest.raises(TypeError, match="hyper must be an AdamWHyper"):
        jax_mamba2.adamw_update(p, p, p, p, tuple(HYPER))
    with pytest.raises(TypeError, match="decay"):
        jax_mamba2.adamw_update(p, p, p, p, HYPER, decay=1)


def test_mask_leaves_must_be_bools():
    params = _params()
    tx = jax_mamba2.fused_adamw(1e-3, mask=jax.tree.map(lambda p: jnp.array(True), params), backend="xla")
    with pytest.raises(TypeError, match="mask leaves must be Python bools"):
        tx.apply(params, params, tx.init(params))


def test_explicit_kernel_backend_without_a_gpu_says_why():
    if "cutile" in jax_mamba2.available_backends():
        pytest.skip("a GPU runs the kernel here")
    p = jnp.ones((8,))
    with pytest.raises(ValueError, match=r"adamw_update\(backend='cutile'\)"):
        jax_mamba2.adamw_update(p, p, p, p, HYPER, backend="cutile")
