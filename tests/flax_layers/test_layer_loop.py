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


def _block(layer, carry, mask):
    """A residual block: the stream adds the hidden state, the new hidden state is a masked tanh layer of it."""
    hidden, residual = carry
    residual = residual + hidden
    hidden = jnp.tanh(residual @ layer["w"] + layer["b"]) * mask
    return hidden.astype(carry[0].dtype), residual


def _inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    stacked = dict(w=jax.random.normal(keys[0], (LAYERS, FEATURES, FEATURES)) / 3,
                   b=jax.random.normal(keys[1], (LAYERS, FEATURES)))
    carry = (jax.random.normal(keys[2], (ROWS, FEATURES)), jnp.zeros((ROWS, FEATURES)))
    mask = (jax.random.uniform(keys[3], (ROWS, 1)) > 0.3).astype(jnp.float32)
    return stacked, carry, mask


def _lax_scan(block):
    return lambda stacked, carry, mask: jax.lax.scan(lambda c, layer: (block(layer, c, mask), None), carry,
                                                     stacked)[0]


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


def test_scan_blocks_gradients_under_vmap_are_each_rows():
    """vmap of the gradient over independent problems equals the gradient of each."""
    problems = [_inputs(seed) for seed in range(3)]
    batched = jax.tree.map(lambda *a: jnp.stack(a), *problems)
    grad = jax.grad(_loss(_loop(_block)), argnums=(0, 1))
    got = jax.jit(jax.vmap(grad))(*batched)
    for index, args in enumerate(problems):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(grad)(*args))):
            np.testing.assert_allclose(g[index], w, rtol=1e-6, atol=1e-6)


def test_residuals_that_are_the_layers_parameters_or_the_operands_are_not_stacked():
    """The pullback's residuals that are the layer's own parameters or the loop's operands are read where
    they lie; the others (here tanh's output and the product's input) are stacked."""
    stacked, carry, mask = _inputs()
    found = {}

    def classify(layer, carry, mask):  # traced, as in the loop's body
        _, pullback = jax.vjp(lambda layer, carry: _block(layer, carry, mask), layer, carry)
        found["layout"], found["stacked"] = layer_loop._classify(pullback, jax.tree.leaves(layer),
                                                                 jax.tree.leaves(mask))
        found["inputs"] = (*jax.tree.leaves(layer), mask)
        return 0

    jax.make_jaxpr(classify)(jax.tree.map(lambda a: a[0], stacked), carry, mask)
    kinds = [kind for kind, _ in found["layout"].sources]
    assert kinds.count(layer_loop._LAYER) == 1  # w, the product's weight (b's gradient needs no residual)
    assert kinds.count(layer_loop._OPERAND) == 1  # the mask
    assert len(found["stacked"]) == kinds.count(layer_loop._STACKED) >= 2
    assert not any(leaf is s for leaf in found["inputs"] for s in found["stacked"])


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
