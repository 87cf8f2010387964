"""`layer_loop.scan_blocks`: the LM's loop over its stacked blocks computes what `lax.scan` of the blocks does,
values and gradients, and stacks the backward's residuals in buffers it does not fill first."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_mamba2.flax_layers import Mamba2Config, Mamba2LMHeadModel
from jax_mamba2.flax_layers import layer_loop

LAYERS, ROWS, FEATURES = 3, 4, 8


def _block(layer, carry, keep):
    """A residual block: the stream adds the hidden state, the new hidden state is a tanh layer of it where
    `keep` (integer) is nonzero."""
    hidden, residual = carry
    residual = residual + hidden
    hidden = jnp.tanh(residual @ layer["w"] + layer["b"]) * keep.astype(hidden.dtype)
    return hidden.astype(carry[0].dtype), residual


def _inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    stacked = dict(w=jax.random.normal(keys[0], (LAYERS, FEATURES, FEATURES)) / 3,
                   b=jax.random.normal(keys[1], (LAYERS, FEATURES)))
    carry = (jax.random.normal(keys[2], (ROWS, FEATURES)), jnp.zeros((ROWS, FEATURES)))
    keep = (jax.random.uniform(keys[3], (ROWS, 1)) > 0.3).astype(jnp.int32)
    return stacked, carry, keep


def _lax_scan(block):
    return lambda stacked, carry, mask: layer_loop.lax_scan_blocks(block, stacked, carry, mask)


def _loop(block):
    return lambda stacked, carry, mask: layer_loop.scan_blocks(block, stacked, carry, mask)


def _loss(run):
    return lambda stacked, carry, mask: sum(jnp.sum(jnp.sin(x)) for x in run(stacked, carry, mask))


@pytest.mark.parametrize("remat", [None, "nothing_saveable"])
def test_scan_blocks_computes_what_lax_scan_does_values_and_gradients(remat):
    """Bit for bit on the CPU: the same block, the same order of operations; under a `jax.checkpoint` policy
    too (the block's residuals are then its inputs)."""
    block = _block if remat is None else jax.checkpoint(_block, policy=jax.checkpoint_policies.nothing_saveable)
    args = _inputs()
    for want, got in zip(jax.tree.leaves(jax.jit(_lax_scan(block))(*args)),
                         jax.tree.leaves(jax.jit(_loop(block))(*args))):
        np.testing.assert_array_equal(got, want)
    grad = lambda run: jax.jit(jax.grad(_loss(run), argnums=(0, 1)))(*args)  # noqa: E731
    for want, got in zip(jax.tree.leaves(grad(_lax_scan(block))), jax.tree.leaves(grad(_loop(block)))):
        np.testing.assert_array_equal(got, want)


def test_scan_blocks_runs_eagerly_as_under_jit():
    """Under jax.disable_jit the loop's residuals are concrete arrays: stacked like traced ones."""
    args = _inputs(1)
    want = jax.grad(_loss(_lax_scan(_block)), argnums=(0, 1))(*args)
    with jax.disable_jit():
        got = jax.grad(_loss(_loop(_block)), argnums=(0, 1))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("devices", [1, 8], ids=["unfilled", "zeros"])
def test_scan_blocks_second_derivatives_are_lax_scans(monkeypatch, devices):
    """jax.hessian (forward over reverse: the buffers under vmap) and reverse over reverse, on either kind of
    buffer."""
    monkeypatch.setattr(jax, "device_count", lambda *args: devices)
    stacked, carry, keep = _inputs(2)

    def hessian(run):
        return jax.jit(jax.hessian(lambda b: _loss(run)(dict(stacked, b=b), carry, keep)))(stacked["b"])
    np.testing.assert_allclose(hessian(_loop(_block)), hessian(_lax_scan(_block)), rtol=1e-5, atol=1e-6)

    def grad_of_grad(run):  # reverse over reverse
        grad = jax.grad(lambda b: _loss(run)(dict(stacked, b=b), carry, keep))
        return jax.jit(jax.grad(lambda b: jnp.sum(jnp.sin(grad(b)))))(stacked["b"])
    np.testing.assert_allclose(grad_of_grad(_loop(_block)), grad_of_grad(_lax_scan(_block)), rtol=1e-5, atol=1e-6)


def test_scan_blocks_under_shard_map_keeps_each_values_varying_axes():
    """Inside shard_map over the rows, values and gradients (summed over the shards for the replicated
    parameters) are lax.scan's."""
    mesh = jax.make_mesh((4,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    stacked, carry, keep = _inputs(3)
    spec = jax.sharding.PartitionSpec("rows")

    def sharded_grads(run):
        def grads(stacked, carry, keep):
            return jax.grad(_loss(run), argnums=(0, 1))(stacked, carry, keep)
        return jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(jax.sharding.PartitionSpec(), spec, spec),
                                     out_specs=(jax.sharding.PartitionSpec(), spec)))(stacked, carry, keep)
    for g, w in zip(jax.tree.leaves(sharded_grads(_loop(_block))), jax.tree.leaves(sharded_grads(_lax_scan(_block)))):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_scan_blocks_refuses_float_operands_it_would_not_differentiate():
    stacked, carry, keep = _inputs()
    with pytest.raises(TypeError, match="scan_blocks: operands are not differentiated, so they must be integer"):
        layer_loop.scan_blocks(_block, stacked, carry, keep.astype(jnp.float32))


def test_scan_blocks_gradients_under_vmap_are_each_rows():
    """vmap of the gradient over independent problems equals the gradient of each."""
    problems = [_inputs(seed) for seed in range(3)]
    batched = jax.tree.map(lambda *a: jnp.stack(a), *problems)
    grad = jax.grad(_loss(_loop(_block)), argnums=(0, 1))
    got = jax.jit(jax.vmap(grad))(*batched)
    for index, args in enumerate(problems):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(grad)(*args))):
            np.testing.assert_allclose(g[index], w, rtol=1e-6, atol=1e-6)


def test_residuals_that_are_the_layers_parameters_are_not_stacked():
    """The pullback's residuals that are the layer's own parameters are read where they lie; the others (here
    tanh's output, the product's input and the mask the block derives from `keep`) are stacked."""
    stacked, carry, keep = _inputs()
    found = {}

    def classify(layer, carry, keep):  # traced, as in the loop's body
        _, pullback = jax.vjp(lambda layer, carry: _block(layer, carry, keep), layer, carry)
        found["layout"], found["stacked"] = layer_loop._classify(pullback, jax.tree.leaves(layer))
        found["layer"] = jax.tree.leaves(layer)
        return 0

    jax.make_jaxpr(classify)(jax.tree.map(lambda a: a[0], stacked), carry, keep)
    kinds = [kind for kind, _ in found["layout"].sources]
    assert kinds.count(layer_loop._LAYER) == 1  # w, the product's weight (b's gradient needs no residual)
    assert len(found["stacked"]) == kinds.count(layer_loop._STACKED) >= 2
    assert not any(leaf is s for leaf in found["layer"] for s in found["stacked"])


def _cuda_program(model, ids):
    graphdef, state = nnx.split(model)
    return jax.jit(jax.grad(lambda state: nnx.merge(graphdef, state).loss(ids))).trace(state).lower(
        lowering_platforms=("cuda",)).as_text()


def test_the_lm_layer_scan_stacks_its_residuals_without_filling_them_on_one_device(monkeypatch):
    """The LM's differentiated layer loop lowered for CUDA: on a process with one device no (n_layer, ...)
    buffer is filled with a constant (each is an XLA allocation, AllocateBuffer); with several devices (a
    program that may be partitioned) they are zeros, as `lax.scan`'s are."""
    config = Mamba2Config(d_model=64, n_layer=LAYERS, vocab_size=64,
                          ssm_cfg=dict(d_state=16, headdim=16, chunk_size=16))
    ids = jax.random.randint(jax.random.key(1), (2, 32), 0, config.vocab_size)
    model = Mamba2LMHeadModel(config, backend="xla", rngs=nnx.Rngs(0))
    filled = re.compile(rf"stablehlo\.broadcast_in_dim %c\w*, dims = \[\] : \(tensor<\w+>\) -> tensor<{LAYERS}x")
    monkeypatch.setattr(jax, "device_count", lambda *args: 1)
    program = _cuda_program(model, ids)
    assert not filled.search(program)
    # every stacked residual, and the stacked parameters' gradients
    assert program.count("@AllocateBuffer") > len(jax.tree.leaves(nnx.state(model.layers)))
    monkeypatch.setattr(jax, "device_count", lambda *args: 8)
    program = _cuda_program(model, ids)
    assert "@AllocateBuffer" not in program and filled.search(program)


def test_the_lm_trains_data_parallel_inside_shard_map():
    """A user's data-parallel step: the LM's loss gradient inside jax.shard_map over the batch, averaged over
    the shards, equals the gradient on the whole batch (the loop's buffers keep each value's varying axes)."""
    config = Mamba2Config(d_model=32, n_layer=2, vocab_size=64, ssm_cfg=dict(d_state=16, headdim=16, chunk_size=16))
    ids = jax.random.randint(jax.random.key(1), (4, 16), 0, config.vocab_size)
    graphdef, state = nnx.split(Mamba2LMHeadModel(config, backend="xla", rngs=nnx.Rngs(0)))

    def loss_and_grads(state, ids):
        return jax.value_and_grad(lambda state: nnx.merge(graphdef, state).loss(ids))(state)

    def per_shard(state, ids):  # the replicated parameters' gradients come summed over the shards
        loss, grads = loss_and_grads(state, ids)
        return jax.lax.pmean(loss, "data"), jax.tree.map(lambda g: g / 4, grads)

    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec
    got = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))(state, ids)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(loss_and_grads)(state, ids))):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
