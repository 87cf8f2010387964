"""`layer_loop.scan_blocks`: the LM's loop over its stacked blocks computes what `lax.scan` of the blocks does,
values and gradients, and stacks the backward's residuals in buffers it does not fill first."""
import functools
import re
from unittest import mock

import jax
import jax.extend
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


def _gated_block(layer, carry, keep):
    """A block whose product's output is itself a residual (z * tanh(z) keeps z) with later uses: the loop
    routes it through its stack."""
    hidden, residual = carry
    residual = residual + hidden
    z = residual @ layer["w"]
    hidden = (z * jnp.tanh(z) + layer["b"]) * keep.astype(hidden.dtype)
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


def _loop(block, route_residuals=True):
    return lambda stacked, carry, mask: layer_loop.scan_blocks(block, stacked, carry, mask,
                                                               route_residuals=route_residuals)


def _loss(run):
    return lambda stacked, carry, mask: sum(jnp.sum(jnp.sin(x)) for x in run(stacked, carry, mask))


@pytest.mark.parametrize("route_residuals", [True, False], ids=["routed", "stacked_after"])
@pytest.mark.parametrize("block", [_block, _gated_block], ids=["tanh", "gated"])
@pytest.mark.parametrize("remat", [None, "nothing_saveable"])
def test_scan_blocks_computes_what_lax_scan_does_values_and_gradients(remat, block, route_residuals):
    """Bit for bit on the CPU: the same block, the same order of operations; under a `jax.checkpoint` policy
    too (the block's residuals are then its inputs)."""
    block = block if remat is None else jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)
    args = _inputs()
    loop = _loop(block, route_residuals)
    for want, got in zip(jax.tree.leaves(jax.jit(_lax_scan(block))(*args)), jax.tree.leaves(jax.jit(loop)(*args))):
        np.testing.assert_array_equal(got, want)
    grad = lambda run: jax.jit(jax.grad(_loss(run), argnums=(0, 1)))(*args)  # noqa: E731
    for want, got in zip(jax.tree.leaves(grad(_lax_scan(block))), jax.tree.leaves(grad(loop))):
        np.testing.assert_array_equal(got, want)
    # the gated block's product output (a residual used later) is read back from its stack when routed: one
    # slice of a stack more per layer than the same loop stacking after the layer
    def slices(run):
        return str(jax.make_jaxpr(jax.grad(_loss(run), argnums=(0, 1)))(*args)).count("dynamic_slice[")
    routed = slices(loop) - slices(_loop(block, route_residuals=False))
    assert routed == (1 if route_residuals and block is not _block and remat is None else 0)


def test_the_backward_evaluates_checkpointed_blocks_without_optimization_barriers():
    """A `jax.checkpoint`ed block (CSE prevented, the default): lax.scan's backward replays it behind an optimization
    barrier, which XLA materializes (each saved value copied out of its stack); scan_blocks' backward sets the replay
    not to prevent CSE, which its separate forward and backward loops make moot, with the same values."""
    block = jax.checkpoint(_gated_block)
    args = _inputs(4)

    def barriers(run):
        return jax.jit(jax.grad(_loss(run), argnums=(0, 1))).lower(*args).as_text().count(
            "stablehlo.optimization_barrier")
    assert barriers(_lax_scan(block)) > 0 and barriers(_loop(block)) == 0
    for want, got in zip(jax.tree.leaves(jax.jit(jax.grad(_loss(_lax_scan(block)), argnums=(0, 1)))(*args)),
                         jax.tree.leaves(jax.jit(jax.grad(_loss(_loop(block)), argnums=(0, 1)))(*args))):
        np.testing.assert_array_equal(got, want)


def test_scan_blocks_runs_eagerly_as_under_jit():
    """Under jax.disable_jit the loop's residuals are concrete arrays: stacked like traced ones."""
    args = _inputs(1)
    want = jax.grad(_loss(_lax_scan(_gated_block)), argnums=(0, 1))(*args)
    with jax.disable_jit():
        got = jax.grad(_loss(_loop(_gated_block)), argnums=(0, 1))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [_block, _gated_block], ids=["tanh", "gated"])
@pytest.mark.parametrize("devices", [1, 8], ids=["unfilled", "zeros"])
def test_scan_blocks_second_derivatives_are_lax_scans(monkeypatch, devices, block):
    """jax.hessian (forward over reverse: the buffers under vmap) and reverse over reverse, on either kind of
    buffer, with residuals routed through their stacks (the gated block) or not (float32 rounding apart)."""
    monkeypatch.setattr(jax, "device_count", lambda *args: devices)
    stacked, carry, keep = _inputs(2)

    def hessian(run):
        return jax.jit(jax.hessian(lambda b: _loss(run)(dict(stacked, b=b), carry, keep)))(stacked["b"])
    np.testing.assert_allclose(hessian(_loop(block)), hessian(_lax_scan(block)), rtol=1e-5, atol=1e-5)

    def grad_of_grad(run):  # reverse over reverse
        grad = jax.grad(lambda b: _loss(run)(dict(stacked, b=b), carry, keep))
        return jax.jit(jax.grad(lambda b: jnp.sum(jnp.sin(grad(b)))))(stacked["b"])
    np.testing.assert_allclose(grad_of_grad(_loop(block)), grad_of_grad(_lax_scan(block)), rtol=1e-5, atol=1e-5)


def _loop_carries(jaxpr) -> list[int]:
    """How many values each loop of `jaxpr` (a closed jaxpr; nested ones included) carries (a `fori_loop` of
    static bounds is a `scan`)."""
    found = []
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name == "while":
            found.append(len(eqn.params["body_jaxpr"].jaxpr.invars))
        elif eqn.primitive.name == "scan":
            found.append(eqn.params["num_carry"])
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += _loop_carries(sub)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += _loop_carries(jax.extend.core.ClosedJaxpr(sub, ()))
    return found


@pytest.mark.parametrize("block", [_block, _gated_block], ids=["tanh", "gated"])
def test_scan_blocks_under_shard_map_keeps_each_values_varying_axes(block):
    """Inside shard_map over the rows, values and gradients (summed over the shards for the replicated
    parameters) are lax.scan's; the weight, replicated, meets the rows as a varying copy (`pvary`), which the
    loop does not stack per layer: its loops carry what they carry outside shard_map."""
    mesh = jax.make_mesh((4,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
    stacked, carry, keep = _inputs(3)
    spec = jax.sharding.PartitionSpec("rows")

    def grads(run):
        return lambda stacked, carry, keep: jax.grad(_loss(run), argnums=(0, 1))(stacked, carry, keep)

    def sharded(run):
        return jax.shard_map(grads(run), mesh=mesh, in_specs=(jax.sharding.PartitionSpec(), spec, spec),
                             out_specs=(jax.sharding.PartitionSpec(), spec))
    for g, w in zip(jax.tree.leaves(jax.jit(sharded(_loop(block)))(stacked, carry, keep)),
                    jax.tree.leaves(jax.jit(sharded(_lax_scan(block)))(stacked, carry, keep))):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    carries = [_loop_carries(jax.make_jaxpr(f)(stacked, carry, keep)) for f in (sharded(_loop(block)),
                                                                                grads(_loop(block)))]
    assert carries[0] == carries[1] and len(carries[0]) == 2, carries


def test_scan_blocks_refuses_float_operands_it_would_not_differentiate():
    stacked, carry, keep = _inputs()
    with pytest.raises(TypeError, match="scan_blocks: operands are not differentiated, so they must be integer"):
        layer_loop.scan_blocks(_block, stacked, carry, keep.astype(jnp.float32))


@pytest.mark.parametrize("block", [_block, _gated_block], ids=["tanh", "gated"])
def test_scan_blocks_gradients_under_vmap_are_each_rows(block):
    """vmap of the gradient over independent problems equals the gradient of each."""
    problems = [_inputs(seed) for seed in range(3)]
    batched = jax.tree.map(lambda *a: jnp.stack(a), *problems)
    grad = jax.grad(_loss(_loop(block)), argnums=(0, 1))
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


_BITCASTS = ("reshape", "squeeze", "expand_dims", "broadcast_in_dim", "reduce_precision", "name")


def _kernel_residual_uses(route_residuals: bool, produced_by=None) -> list[int]:
    """For each stacked residual of the LM's forward layer loop (cuTile kernels, traced for sm_90 on the CPU)
    that a kernel computes (a cuTile launch or a matrix product), or with `produced_by` an equation of that
    primitive, how many uses its value has in the loop's body, looking through bitcast-like ops to the stack's
    update."""
    aot = pytest.importorskip("jax_mamba2.bridge.aot")
    from tests.flax_layers._programs import walk

    config = Mamba2Config(d_model=32, n_layer=LAYERS, vocab_size=64, ssm_cfg=dict(d_state=16, headdim=16, chunk_size=8))
    loop = functools.partial(layer_loop.scan_blocks, route_residuals=route_residuals)
    with aot.cuda_target("sm_90"), mock.patch("jax_mamba2.flax_layers.lm.scan_blocks", loop):
        model = Mamba2LMHeadModel(config, backend="cutile", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        ids = jax.random.randint(jax.random.key(0), (2, 40), 0, config.vocab_size)
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: nnx.merge(graphdef, p, rest).loss(ids)))(params)

    def launches_kernel(eqn) -> bool:
        return eqn.primitive.name in ("dot_general", "cutile_call_ffi") or any(
            inner.primitive.name == "cutile_call_ffi"
            for sub in jax.extend.core.jaxprs_in_params(eqn.params) for inner, _ in walk(sub))

    loops = [eqn.params.get("body_jaxpr") or eqn.params["jaxpr"] for eqn, _ in walk(jaxpr)
             if eqn.primitive.name in ("scan", "while")]  # a fori_loop of known length is a scan
    body = next(loop.jaxpr for loop in loops if any(e.primitive.name == "cutile_call_ffi" for e, _ in walk(loop)))
    producers = {v: eqn for eqn in body.eqns for v in eqn.outvars}
    uses = {}
    for v in [v for eqn in body.eqns for v in eqn.invars] + list(body.outvars):  # the loop's results count too
        if isinstance(v, jax.extend.core.Var):
            uses[v] = uses.get(v, 0) + 1
    counts = []
    for eqn in body.eqns:
        if eqn.primitive.name != "dynamic_update_slice" and eqn.params.get("name") != "dynamic_update_index_in_dim":
            continue
        value = eqn.invars[1]
        while value in producers and producers[value].primitive.name in _BITCASTS and uses[value] == 1:
            value = producers[value].invars[0]
        if produced_by:  # the equation computing it, looking into jitted calls (`jnp.where` is one)
            producer = layer_loop._producer(body, value, producers)
            if producer is not None and producer.primitive.name == produced_by:
                counts.append(uses[value])
        elif value in producers and launches_kernel(producers[value]):
            counts.append(uses[value])
    return counts


def test_kernel_outputs_that_are_residuals_have_the_stack_as_their_one_user():
    """Each residual that a kernel writes goes to its stack alone (later uses read the stack), so XLA's GPU
    compiler can fuse the stack's update into the kernel; stacked after the layer, such values had other users
    too (XLA then cloned the kernel or copied its output)."""
    routed = _kernel_residual_uses(route_residuals=True)
    assert len(routed) >= 4 and routed == [1] * len(routed), routed
    assert max(_kernel_residual_uses(route_residuals=False)) > 1


def test_the_kernels_inputs_made_finite_are_written_into_their_stacks_alone():
    """The SSD kernels' inputs with their non-finite entries zeroed (elementwise `select_n`s that only cuTile
    launches use) go to their stacks alone too, the launches reading them there: XLA writes them out for the
    kernels anyway, so the elementwise work can write the stack's slot instead of a buffer copied into it."""
    routed = _kernel_residual_uses(route_residuals=True, produced_by="select_n")
    assert len(routed) >= 4 and routed == [1] * len(routed), routed
    assert max(_kernel_residual_uses(route_residuals=False, produced_by="select_n")) > 1


@pytest.mark.parametrize("route_residuals", [True, False], ids=["routed", "stacked_after"])
def test_the_lm_layer_scan_runs_eagerly_as_under_jit(route_residuals):
    """The LM's gradient under jax.disable_jit: every layer evaluates the one traced forward, so its residuals
    are the traced ones (concrete values gave the pullback more leaves than the stacks)."""
    config = Mamba2Config(d_model=32, n_layer=2, vocab_size=64, ssm_cfg=dict(d_state=16, headdim=16, chunk_size=8))
    ids = jax.random.randint(jax.random.key(1), (2, 16), 0, config.vocab_size)
    graphdef, state = nnx.split(Mamba2LMHeadModel(config, backend="xla", rngs=nnx.Rngs(0)))
    loop = functools.partial(layer_loop.scan_blocks, route_residuals=route_residuals)
    with mock.patch("jax_mamba2.flax_layers.lm.scan_blocks", loop):
        grad = jax.grad(lambda state: nnx.merge(graphdef, state).loss(ids))
        want = jax.jit(grad)(state)
        with jax.disable_jit():
            got = grad(state)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_scan_blocks_takes_a_block_with_a_rematerialized_loop():
    """A block with a `jax.checkpoint`ed `lax.scan` whose output it uses again: the traced forward holds the scan's
    known half as a `closed_call` (its jaxpr in `call_jaxpr`), which the loop looks into."""
    def scanned(w, h):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, w)[0]

    def block(layer, carry, keep):
        hidden, residual = carry
        y = jax.checkpoint(scanned, policy=jax.checkpoint_policies.everything_saveable)(layer["w2"], hidden + residual)
        return (y * y * keep).astype(hidden.dtype), residual + hidden

    stacked, carry, keep = _inputs(2)
    stacked = dict(w2=jnp.stack([stacked["w"], jnp.swapaxes(stacked["w"], 1, 2)], axis=1))
    grad = lambda run: jax.jit(jax.grad(_loss(run), argnums=(0, 1)))(stacked, carry, keep)  # noqa: E731
    want = grad(_lax_scan(block))
    for route_residuals in (True, False):
        for g, w in zip(jax.tree.leaves(grad(_loop(block, route_residuals))), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(g, w)
