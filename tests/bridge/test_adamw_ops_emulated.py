"""AdamW's update kernel end to end on the CPU: jax_mamba2.adamw_update / fused_adamw with backend="cutile", whose
plan (bridge/adamw_ops.py) runs block by block on the NumPy emulator in float64 through jax.pure_callback. Checked
against the xla backend over several steps, and composed with jit (parameters and state donated), vmap (folded
into one launch, or per item with per-item step scalars), shard_map over 8 devices, grad (the custom VJP) and
jax.checkpoint."""
import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

pytest.importorskip("cuda.tile")

import jax_mamba2  # noqa: E402
from jax_mamba2 import adamw  # noqa: E402
from jax_mamba2.adamw_reference import AdamWHyper  # noqa: E402
from jax_mamba2.bridge import adamw_ops  # noqa: E402
from tests._helpers import rel_l2  # noqa: E402
from tests.bridge._emulated_backend import emulate_layer_kernels  # noqa: E402

# The emulated kernel computes in float64 and rounds once; the xla path rounds each float32 operation.
TOLERANCE = 1e-6
HYPER = AdamWHyper(3e-3, 0.9, 0.1, 0.95, 0.05, 1e-8, 0.0, 0.1, 1 - 0.9 ** 3, 1 - 0.95 ** 3, 0.5)


@pytest.fixture(autouse=True)
def emulated_kernels(monkeypatch):
    """backend="cutile" runs the emulated plan, as if on a GPU."""
    emulate_layer_kernels(monkeypatch, adamw.OP, adamw_ops)


def _arrays(seed, shape=(37, 11), dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    p, g, m = (jax.random.normal(k, shape, dtype) for k in keys[:3])
    v = 0.01 * jax.random.uniform(keys[3], shape, dtype) + 1e-6
    return p, g, 0.1 * m, v.astype(dtype)


def _params(seed):
    keys = jax.random.split(jax.random.key(seed), 3)
    return {"kernel": jax.random.normal(keys[0], (64, 48)), "bias": jax.random.normal(keys[1], (48,)),
            "scale": jax.random.normal(keys[2], (300,)).astype(jnp.bfloat16)}


def _close(got, want, tolerance=TOLERANCE):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel_l2(a, b) < (5e-3 if a.dtype == jnp.bfloat16 else tolerance)


@pytest.mark.parametrize("decay", [True, False])
def test_kernel_update_matches_xla(decay):
    arrays = _arrays(0)
    _close(jax_mamba2.adamw_update(*arrays, HYPER, decay=decay, backend="cutile"),
           jax_mamba2.adamw_update(*arrays, HYPER, decay=decay, backend="xla"))


def test_fused_adamw_steps_match_xla_under_jit_with_donation():
    """Three steps of the LM-style step function (clip, schedule, mask, a bf16 leaf) with the parameters and
    state donated, as a training step passes them."""
    def make(backend):
        return jax_mamba2.fused_adamw(optax.linear_schedule(1e-2, 1e-3, 5), b2=0.95, weight_decay=0.1,
                                      mask={"kernel": True, "bias": False, "scale": False}, max_grad_norm=1.0,
                                      backend=backend)
    results = {}
    for backend in ("cutile", "xla"):
        tx = make(backend)
        params = _params(1)
        state = tx.init(params)
        apply = jax.jit(tx.apply, donate_argnums=(0, 2))
        for step in range(3):
            params, state = apply(params, jax.tree.map(lambda p: 0.5 * p, _params(10 + step)), state)
        results[backend] = (params, state)
    _close(results["cutile"], results["xla"])


def test_vmap_folds_items_into_one_launch_and_maps_per_item_scalars():
    stacked = tuple(jnp.stack([a, b]) for a, b in zip(_arrays(2), _arrays(3)))
    want = jax.vmap(lambda *a: jax_mamba2.adamw_update(*a, HYPER, backend="xla"))(*stacked)
    _close(jax.vmap(lambda *a: jax_mamba2.adamw_update(*a, HYPER, backend="cutile"))(*stacked), want)
    # An unmapped moment broadcasts; per-item learning rates take one launch per item.
    rates = jnp.array([1e-3, 5e-3])

    def per_rate(backend, rate):
        return jax_mamba2.adamw_update(*_arrays(4), HYPER._replace(learning_rate=rate), backend=backend)
    _close(jax.vmap(functools.partial(per_rate, "cutile"))(rates), jax.vmap(functools.partial(per_rate, "xla"))(rates))


def test_shard_map_updates_each_shard():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    arrays = _arrays(5, shape=(64, 24))

    def sharded(backend):
        update = functools.partial(jax_mamba2.adamw_update, hyper=HYPER, backend=backend)
        return jax.jit(jax.shard_map(lambda *a: update(*a), mesh=mesh, in_specs=(P("x"),) * 4,
                                     out_specs=(P("x"),) * 3))(*arrays)
    _close(sharded("cutile"), jax_mamba2.adamw_update(*arrays, HYPER, backend="xla"))
    _close(sharded("cutile"), sharded("xla"))


def test_grad_through_the_update_is_the_references():
    """Meta-gradients (through the step, to the inputs and the learning rate) by the custom VJP equal the xla
    path's, also under jax.checkpoint."""
    arrays = _arrays(6)
    weights = jax.random.normal(jax.random.key(7), arrays[0].shape)

    def objective(backend, p, g, m, v, rate):
        new_p, new_m, new_v = jax_mamba2.adamw_update(p, g, m, v, HYPER._replace(learning_rate=rate),
                                                      backend=backend)
        return jnp.sum(weights * new_p) + jnp.sum(new_m ** 2) + jnp.sum(jnp.sqrt(new_v))

    argnums = tuple(range(5))
    want = jax.grad(functools.partial(objective, "xla"), argnums)(*arrays, 3e-3)
    _close(jax.grad(functools.partial(objective, "cutile"), argnums)(*arrays, 3e-3), want, 1e-5)
    _close(jax.grad(jax.checkpoint(functools.partial(objective, "cutile")), argnums)(*arrays, 3e-3), want, 1e-5)
