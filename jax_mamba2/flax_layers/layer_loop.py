"""The LM's loop over its stacked blocks, with the backward's residuals stacked in buffers nothing fills first.

Differentiating `lax.scan` (or `nnx.scan`) over the layers stacks each layer's residuals, what its backward
reads, into (n_layer, ...) buffers that the scan creates filled with zeros before its loop overwrites every
slot: at d_model 1024, 24 layers and 8 x 2048 tokens, gigabytes of zeros written each step for nothing.
`scan_blocks` runs the same blocks under a custom VJP whose forward loop creates those buffers unfilled (on a
process with one device; see `_unfilled`) and writes each layer's residuals into its slot, and whose backward
loop rebuilds each layer's pullback from its slot. The residuals are those of the block's own `jax.vjp` (so a
`jax.checkpoint` policy around the block applies), less the ones that are the layer's parameters, which are
read where they already lie (also where shard_map made a replicated one varying: the backward does that again).
Unlike `lax.scan`, which keeps one copy of a residual that no layer changes (e.g. a mask the block derives from
`seq_idx`), the loop stacks it per layer: on the xla path a few percent more activation memory, on the cuTile
kernels' path the int32 sequence numbers the conv op takes (4 bytes a token, per layer).

The forward loop writes each residual into its stack right where the layer computes it, and the layer's later
uses read it back from there (`_stack_residuals`). A kernel's output (a cuTile kernel's, a cuBLAS product's) that
is also a residual then has one user, the stack's dynamic-update-slice. With other users besides, XLA's GPU
compiler ran the kernel a second time to write the slot (a clone in a `dynamic-slice-fusion`) or copied its
output there; routed, a cuTile kernel writes its slot in place and cuTile consumers read it there. A matrix
product's operands and result go through copies where XLA does not slice its stacks in place: it does so for a
cuBLAS call (a dynamic-slice fusion around the custom call), not for a product it has made a Triton GEMM fusion,
hence `SCAN_COMPILER_OPTIONS` (docs/design.md §12). The backward loop evaluates each layer's pullback with its
`jax.checkpoint`s' CSE prevention off (`_replays_unbarred`): a differentiated checkpoint's replay puts an
optimization barrier on its operands, which XLA materializes, copying each saved value out of its stack, while the
CSE it prevents cannot happen here (the forward and the backward are separate loops).
"""

from __future__ import annotations

import collections
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex
from jax.extend import source_info_util

from jax_mamba2._jaxpr_calls import CALL_JAXPRS
from jax_mamba2._vma import match_varying_axes

# XLA compiler options for a program that runs `scan_blocks`: no Triton GEMM fusions, so that the matrix products are
# cuBLAS calls from the start of XLA's pipeline, whose operands and results its dynamic-slice fusion then reads and
# writes in the loop's stacks instead of copying them (docs/design.md §12). GPU options: other platforms ignore them.
SCAN_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}

# Where a leaf of a layer's pullback comes from: the layer's parameters, a parameter made varying over
# shard_map's axes (`pvary`: the backward makes it again), or a stack of residuals.
_LAYER, _VARYING_LAYER, _STACKED = "layer", "varying layer", "stacked"


class _Layout(NamedTuple):
    """Where each leaf of a layer's pullback comes from: (kind, where) per leaf, and the pullback's structure.
    `where` is an index into the layer's parameters or the stacks, or for `_VARYING_LAYER` (parameter's index,
    shard_map axes)."""
    treedef: object
    sources: tuple


def lax_scan_blocks(apply: Callable, stacked, carry, *operands):
    """`scan_blocks`' loop as `lax.scan` runs and differentiates it (its stacks of residuals created as zeros)."""
    return lax.scan(lambda c, layer: (apply(layer, c, *operands), None), carry, stacked)[0]


def _leading_length(stacked) -> int:
    lengths = {leaf.shape[0] for leaf in jax.tree.leaves(stacked)}
    if len(lengths) != 1:
        raise ValueError(f"scan_blocks: the stacked parameters' leading axes {sorted(lengths)} must be one length")
    return lengths.pop()


def _unfilled(like, shape):
    """A buffer of `shape`, `like`'s dtype and shard_map varying axes, whose every slot the loop writes before
    anything reads it. On a process with one device it is `lax.empty` (on GPU an XLA allocation without a fill),
    unbatched under vmap as zeros would be (`lax.empty`'s own batching rule batches it, which forward-over-reverse
    differentiation rejects; vmap batches the buffer where a batched value is written into it); elsewhere zeros:
    the loop leaves an allocation's sharding to XLA's propagation, which a partitioned program has not been checked
    with (JAX's own scan keeps zeros until "AllocateBuffer issues are fixed", its loops.py says)."""
    if jax.device_count() == 1:
        @jax.custom_batching.custom_vmap
        def empty(token):
            del token
            return lax.empty(shape, like.dtype)

        @empty.def_vmap
        def empty_unbatched(axis_size, in_batched, token):
            del axis_size, in_batched, token
            return lax.empty(shape, like.dtype), False

        buffer = empty(jnp.zeros((), jnp.int8))
    else:
        buffer = jnp.zeros(shape, like.dtype)
    return match_varying_axes(buffer, like)


def _layer(stacked, index):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False), stacked)


def _classify(pullback, layer_leaves) -> tuple[_Layout, list]:
    """The layout of `pullback`'s leaves, and the leaves to stack (in order): every leaf but the layer's
    parameters, which the backward reads where they lie."""
    leaves, treedef = jax.tree.flatten(pullback)
    sources, to_stack = [], []
    for leaf in leaves:
        layer_at = next((k for k, p in enumerate(layer_leaves) if leaf is p), None)
        if layer_at is not None:
            sources.append((_LAYER, layer_at))
        else:
            sources.append((_STACKED, len(to_stack)))
            to_stack.append(leaf)
    return _Layout(treedef, tuple(sources)), to_stack


# Primitives whose results XLA fuses into their consumers (elementwise and data movement): such a residual is
# computed again inside each consumer's fusion and in the stack's update, so reading it back from its stack
# would only split fusions. Every other producer (a custom call, a product, a reduction, a loop) writes a buffer.
_FUSED_INTO_CONSUMERS = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type copy cos cosh digamma
    div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma imag integer_pow is_finite le lgamma log log1p logistic
    lt max min mul ne neg nextafter not or pow real rem round rsqrt select_n sign sin sinh sqrt square sub tan tanh
    xor shift_left shift_right_logical shift_right_arithmetic population_count reduce_precision iota
    broadcast_in_dim slice dynamic_slice concatenate pad transpose split rev squeeze expand_dims reshape
    """.split())
# The primitives that launch cuTile kernels: cuda.tile.jax's FFI call, and the callback executor's call.
_KERNEL_LAUNCHES = frozenset(("cutile_call_ffi", "buffer_callback"))
# The same buffer for XLA (`name` is `checkpoint_name`; `pvary` marks a value varying over shard_map's axes).
_BITCASTS = frozenset(("reshape", "squeeze", "expand_dims", "name", "pvary"))


def _varying_parameters(jaxpr, producers: dict, n_carry: int, n_parameters: int) -> dict:
    """The residuals of a layer's traced forward `jaxpr` (inputs: the layer's `n_parameters` parameter leaves,
    then the carry's; outputs: `n_carry` carry leaves, then the residuals) that are a parameter made varying over
    shard_map's axes, as a replicated weight meeting sharded activations is: {residual's position: (parameter's
    position, axes)}. The backward makes each again from the parameter rather than read a copy stacked per layer.
    `producers`: `jaxpr`'s {var: equation computing it}."""
    parameters = jaxpr.invars[:n_parameters]
    found = {}
    for k, v in enumerate(jaxpr.outvars[n_carry:]):
        eqn = None if isinstance(v, jex.Literal) else producers.get(v)
        source = None if eqn is None or eqn.primitive.name != "pvary" else eqn.invars[eqn.outvars.index(v)]
        if source in parameters:
            found[k] = (parameters.index(source), tuple(eqn.params["axes"]))
    return found


def _is_noop_rounding(eqn) -> bool:
    """A reduce_precision to its operand's own precision (`jax.checkpoint` puts one on each value it saves)."""
    dtype = eqn.invars[0].aval.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        return False
    info = jnp.finfo(dtype)
    return eqn.params["exponent_bits"] >= info.nexp and eqn.params["mantissa_bits"] >= info.nmant


def _producer(jaxpr, var, producers=None):
    """The equation that computes `var`'s buffer, looking through bitcasts and into jitted calls; None for an
    input of `jaxpr` or a literal. `producers`: `jaxpr`'s {var: equation computing it}, if already built."""
    producers = _producers(jaxpr) if producers is None else producers
    while not isinstance(var, jex.Literal) and (eqn := producers.get(var)) is not None:
        name = eqn.primitive.name
        if name in _BITCASTS or (name == "reduce_precision" and _is_noop_rounding(eqn)) or (
                name == "broadcast_in_dim" and eqn.invars[0].aval.size == eqn.outvars[0].aval.size):
            var = eqn.invars[0]
        elif name in CALL_JAXPRS:
            inner = eqn.params[CALL_JAXPRS[name]].jaxpr
            out = inner.outvars[eqn.outvars.index(var)]
            if isinstance(out, jex.Literal) or out not in inner.invars:
                return None if isinstance(out, jex.Literal) else _producer(inner, out)
            var = eqn.invars[inner.invars.index(out)]  # the call returns one of its inputs
        else:
            return eqn
    return None


def _producers(jaxpr) -> dict:
    """{var: the equation of `jaxpr` that computes it}."""
    return {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}


def _launches_kernel(eqn) -> bool:
    """Whether `eqn` launches a cuTile kernel, or is a call whose jaxprs hold such a launch."""
    return eqn.primitive.name in _KERNEL_LAUNCHES or any(
        _launches_kernel(inner) for sub in jex.jaxprs_in_params(eqn.params) for inner in sub.eqns)


def _residuals_to_route(jaxpr, producers: dict, n_carry: int) -> set:
    """The residuals of a layer's traced forward `jaxpr` (outputs: `n_carry` carry leaves, then the residuals)
    that the layer's later uses read back from their stack, of those that something uses besides the stack's
    update (a later equation, the carry, or a second stack): those a kernel writes (an equation XLA does not fuse
    into its consumers; an input or a constant has no producer), and those that only cuTile launches use (e.g.
    the SSD's inputs with their non-finite entries zeroed), which XLA must write out for them anyway: routed, the
    elementwise work writes the stack's slot in place and the kernels read it there, where it would otherwise
    write a buffer of its own, then copied into the slot. `producers`: `jaxpr`'s {var: equation}."""
    residuals = collections.Counter(v for v in jaxpr.outvars[n_carry:] if not isinstance(v, jex.Literal))
    users = collections.defaultdict(list)
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, jex.Literal):
                users[v].append(eqn)
    carried = {v for v in jaxpr.outvars[:n_carry] if not isinstance(v, jex.Literal)}
    found = set()
    for v, stacks in residuals.items():
        if v in users or v in carried or stacks > 1:
            producer = _producer(jaxpr, v, producers)
            if producer is None:
                continue
            # (the users are searched for launches only where the producer is elementwise work)
            if producer.primitive.name not in _FUSED_INTO_CONSUMERS or (
                    v in users and v not in carried and all(map(_launches_kernel, users[v]))):
                found.add(v)
    return found


def _stack_residuals(closed, args, n_carry: int, stacks: list, index, routed: set) -> tuple[list, list]:
    """Evaluates the layer's `closed` jaxpr (outputs: `n_carry` carry leaves, then one residual per stack) on
    `args`, as `jax.core.eval_jaxpr` does, writing each residual into its stack at `index` as soon as an equation
    computes it. The `routed` residuals (`_residuals_to_route`) are read back from their stacks by the layer's
    later uses, so that the kernel writes its slot in place and is the value's only producer; a None stack is a
    residual the backward makes again. Returns (the carry's leaves, the updated stacks)."""
    jaxpr = closed.jaxpr
    stacks_of: dict = {}  # residual var -> the stacks it goes to (a value can be several residuals)
    for k, v in enumerate(jaxpr.outvars[n_carry:]):
        if not isinstance(v, jex.Literal):
            stacks_of.setdefault(v, []).append(k)
    stacks, env = list(stacks), {}
    # A routed residual is read back at an index equal to `index` but computed apart from the update's (the
    # form measured; docs/design.md §12). Only arithmetic of the loop counter: where XLA slices a custom call's
    # operand in place it evaluates the index on the host, which an optimization barrier there would defeat,
    # and a barrier on the stack instead kept XLA from writing a kernel's output into its slot.
    read_index = lax.max(index, jnp.zeros_like(index)) if routed else index

    def store(k, value):
        if stacks[k] is not None:
            stacks[k] = lax.dynamic_update_index_in_dim(stacks[k], value, index, 0)

    def bind(v, value):
        if v in stacks_of:
            first, *others = stacks_of[v]
            store(first, value)
            if v in routed:
                value = lax.dynamic_index_in_dim(stacks[first], read_index, keepdims=False)
            for k in others:
                store(k, value)
        env[v] = value

    def read(v):
        return v.val if isinstance(v, jex.Literal) else env[v]

    for v, value in zip((*jaxpr.constvars, *jaxpr.invars), (*closed.consts, *args), strict=True):
        bind(v, value)
    for eqn in jaxpr.eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            outs = eqn.primitive.bind(*map(read, eqn.invars), **params)
        for v, value in zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs], strict=True):
            bind(v, value)
    for k, v in enumerate(jaxpr.outvars[n_carry:]):
        if isinstance(v, jex.Literal):
            store(k, v.val)
    return [read(v) for v in jaxpr.outvars[:n_carry]], stacks


def _replays_unbarred(jaxpr):
    """`jaxpr` with each `jax.checkpoint` in it (nested ones too) set not to prevent CSE: its replay in a backward
    pass then has no optimization barrier on its operands."""
    def inner(value):
        if isinstance(value, jex.ClosedJaxpr):
            return jex.ClosedJaxpr(_replays_unbarred(value.jaxpr), value.consts)
        if isinstance(value, jex.Jaxpr):
            return _replays_unbarred(value)
        if isinstance(value, tuple):
            return tuple(map(inner, value))
        return value

    eqns = []
    for eqn in jaxpr.eqns:
        params = {name: inner(value) for name, value in eqn.params.items()}
        if params.get("prevent_cse") is True:  # jax.checkpoint's primitive (named remat2 or checkpoint)
            params["prevent_cse"] = False
        eqns.append(eqn.replace(params=params))
    return jaxpr.replace(eqns=eqns)


def _check_operands(operands) -> None:
    for leaf in jax.tree.leaves(operands):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.integer):
            raise TypeError(f"scan_blocks: operands are not differentiated, so they must be integer arrays (such as "
                            f"seq_idx); got {jnp.result_type(leaf)}: close over a float value or carry it instead")


def scan_blocks(apply: Callable, stacked, carry, *operands, route_residuals: bool = True):
    """`carry` after `apply(layer, carry, *operands)` for each layer of `stacked` in turn.

    Args:
      apply: a pure function (layer's parameters, carry, *operands) -> carry of the same structure and dtypes.
        It must not close over a value being differentiated (pass it in `stacked` or `carry`).
      stacked: a pytree of float arrays with a common leading (n_layer,) axis, the layers' parameters.
      carry: a pytree of float arrays, the loop's state (for the LM: the hidden states and the residual stream).
      operands: integer arrays (or None) every layer reads, e.g. seq_idx; not differentiated.
      route_residuals: the layer's later uses of a residual that a kernel computed read it from its stack (the
        module's docstring says why); False leaves them on the kernel's output (the same values: a baseline for
        benchmarks).

    Returns:
      The final carry. Differentiable in `stacked` and `carry` (reverse mode), as `lax_scan_blocks` is, with
      the same values.

    Raises:
      ValueError: for stacked leaves of different lengths. TypeError: for an operand that is not an integer array.
    """
    length = _leading_length(stacked)
    _check_operands(operands)
    traced = {}  # the layout of a layer's pullback, from the forward's trace, for the backward's

    @jax.custom_vjp
    def run(stacked, carry, operands):
        return lax_scan_blocks(apply, stacked, carry, *operands)

    def forward(stacked, carry, operands):
        def layer_vjp(layer, carry):
            carry, pullback = jax.vjp(lambda layer, carry: apply(layer, carry, *operands), layer, carry)
            traced["layout"], to_stack = _classify(pullback, jax.tree.leaves(layer))
            return carry, to_stack

        # The layer's forward, traced once (its slice of the parameters at 0 is dead code under jit); every layer runs
        # this trace, so the residuals are the same leaves under jit and eagerly (where concrete values would
        # give a pullback of another structure).
        closed, (carry_shape, residuals) = jax.make_jaxpr(layer_vjp, return_shape=True)(_layer(stacked, 0), carry)
        carry_tree = jax.tree.structure(carry_shape)
        producers = _producers(closed.jaxpr)
        varying = _varying_parameters(closed.jaxpr, producers, carry_tree.num_leaves, len(jax.tree.leaves(stacked)))
        routed = _residuals_to_route(closed.jaxpr, producers, carry_tree.num_leaves) if route_residuals else set()
        layout = traced["layout"]
        traced["layout"] = layout._replace(sources=tuple(
            (_VARYING_LAYER, varying[at]) if kind == _STACKED and at in varying else (kind, at)
            for kind, at in layout.sources))

        def step(index, state):
            carry, stacks = state
            leaves, stacks = _stack_residuals(closed, jax.tree.leaves((_layer(stacked, index), carry)),
                                              carry_tree.num_leaves, stacks, index, routed)
            return jax.tree.unflatten(carry_tree, leaves), stacks

        stacks = [None if k in varying else _unfilled(r, (length, *r.shape)) for k, r in enumerate(residuals)]
        carry, stacks = lax.fori_loop(0, length, step, (carry, stacks))
        return carry, (stacked, stacks)

    def backward(residuals, carry_cotangent):
        stacked, stacks = residuals
        layout = traced["layout"]  # the forward of this call was traced first, as a custom VJP's always is

        def step(k, state):
            cotangent, grads = state
            index = length - 1 - k
            parameters = jax.tree.leaves(_layer(stacked, index))

            def source(kind, at):
                if kind == _LAYER:
                    return parameters[at]
                if kind == _VARYING_LAYER:
                    return jax.lax.pcast(parameters[at[0]], at[1], to="varying")
                return lax.dynamic_index_in_dim(stacks[at], index, keepdims=False)

            pullback = jax.tree.unflatten(layout.treedef, [source(kind, at) for kind, at in layout.sources])
            closed, out_shape = jax.make_jaxpr(pullback, return_shape=True)(cotangent)
            unbarred = jex.ClosedJaxpr(_replays_unbarred(closed.jaxpr), closed.consts)
            layer_grads, cotangent = jax.tree.unflatten(jax.tree.structure(out_shape), jex.jaxpr_as_fun(unbarred)(
                *jax.tree.leaves(cotangent)))
            grads = jax.tree.map(lambda g, v: lax.dynamic_update_index_in_dim(g, v.astype(g.dtype), index, 0),
                                 grads, layer_grads)
            return cotangent, grads

        grads = jax.tree.map(lambda a: _unfilled(a, a.shape), stacked)
        carry_cotangent, grads = lax.fori_loop(0, length, step, (carry_cotangent, grads))
        return grads, carry_cotangent, None

    run.defvjp(forward, backward)
    return run(stacked, carry, operands)
