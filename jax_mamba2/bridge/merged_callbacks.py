"""A traced function's kernel-plan callbacks merged into few, each replaying a CUDA graph of programmatic
dependent launches.

The callback executor (`callback.run_plan`) runs each kernel plan in a `buffer_callback` of its own. In a
decode token step that is one callback per projection and mixer step, each a few microseconds of GPU work
whose launch latency, not its bytes, sets the step's time. `merge_plan_callbacks(fn)` traces `fn` to a jaxpr,
inlines the calls around those callbacks (jit, custom_jvp, custom_vjp, custom_vmap) and evaluates it, each run
of plan callbacks that no other operation separates (an operation that reads one of their results ends a run;
operations that do not are evaluated before it; a reshape of a result stays in the run, a view of its buffer)
becoming one `buffer_callback`. XLA runs a callback's Python at every call, so the merged callback launches its
kernels as a CUDA graph (`callback.replay`: captured at the first call on a set of buffer addresses, one graph
launch per call after). Inside it, with `dependent` above INDEPENDENT, every launch after the first whose kernel
takes a DEPENDENT constant is a programmatic dependent launch: it may start while its predecessor finishes, and
its kernel waits for the predecessor's writes before its first load (`kernels._common.wait_for_predecessor`).

Buffers (a callback's Python receives each as an object at every call, so few): the values its plans read from
outside the run, equal read-only ones once and the small constants packed into one input; out the arrays read
after the run, one per input that a plan updates in place (aliased to it), and one workspace holding every array
that only the kernels read. A plan that would update in place a value that something after it still reads
(which XLA would copy for it) runs as a merged callback of its own.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback
from jax.extend import core as jex
from jax.extend import source_info_util

from jax_mamba2._jaxpr_calls import CALL_JAXPRS, CUSTOM_RULE_JAXPRS
from jax_mamba2.bridge import callback
from jax_mamba2.kernels._common import INDEPENDENT, WAITS_AND_RELEASES

# Call primitives inlined, and the parameter that holds their closed jaxpr. Differentiation and batching rules are
# not kept: the merged function is evaluated as it is.
_INLINED = {**CALL_JAXPRS, **CUSTOM_RULE_JAXPRS}


def plan_call(eqn) -> Optional[callback.PlanCall]:
    """The PlanCall of a `buffer_callback` equation made by `callback.run_plan`, else None."""
    if eqn.primitive.name != "buffer_callback":
        return None
    return getattr(eqn.params["callback"], "plan_call", None)


@dataclasses.dataclass
class _Op:
    eqn: Any
    inputs: list  # value ids
    outputs: list  # value ids (None: a dropped result)


class _Flat:
    """A jaxpr with its calls inlined: operations on value ids, the values known before any runs, and each value's
    signature: equal signatures, equal values (small constants by content, an operation without effects by its
    primitive, parameters and operands' signatures, anything else by its id)."""

    def __init__(self):
        self.ops: list[_Op] = []
        self.values: dict[int, Any] = {}
        self.signatures: dict[int, Any] = {}
        self._count = 0

    def new(self, value=None, known: bool = False) -> int:
        self._count += 1
        self.signatures[self._count] = ("id", self._count)
        if known:
            self.set(self._count, value)
        return self._count

    def set(self, i: int, value) -> None:
        """The value of id i; a small numeric constant's signature is its content."""
        self.values[i] = value
        if _is_constant(value) and _numpy_numeric(jnp.result_type(value)) and \
                np.size(value) <= _CONSTANT_SIGNATURE_SIZE:
            array = np.asarray(value, jnp.result_type(value))  # in the dtype JAX gives it (a Python int: int32)
            self.signatures[i] = ("constant", array.dtype.str, array.shape, array.tobytes())

    def add(self, closed, in_ids: list) -> list:
        jaxpr, env = closed.jaxpr, {}
        for v, const in zip(jaxpr.constvars, closed.consts, strict=True):
            env[v] = self.new(const, known=True)
        env.update(zip(jaxpr.invars, in_ids, strict=True))

        def read(v):
            return self.new(v.val, known=True) if isinstance(v, jex.Literal) else env[v]

        for eqn in jaxpr.eqns:
            inputs = [read(v) for v in eqn.invars]
            inner = eqn.params.get(_INLINED.get(eqn.primitive.name, ""))
            if isinstance(inner, jex.ClosedJaxpr):
                outputs = self.add(inner, inputs)
            else:
                outputs = [None if isinstance(v, jex.DropVar) else self.new() for v in eqn.outvars]
                self.ops.append(_Op(eqn, inputs, outputs))
                if len(outputs) == 1 and outputs[0] is not None and _is_pure(eqn):
                    self.signatures[outputs[0]] = (eqn.primitive.name, repr(sorted(eqn.params.items())),
                                                   tuple(self.signatures[i] for i in inputs))
            for v, out in zip(eqn.outvars, outputs, strict=True):
                if not isinstance(v, jex.DropVar):
                    env[v] = out
        return [read(v) for v in jaxpr.outvars]


# Constants of at most this many elements are told apart by content (a layer index, a placeholder's zeros).
_CONSTANT_SIGNATURE_SIZE = 64


def _is_constant(value) -> bool:
    return not isinstance(value, jax.core.Tracer)


def _numpy_numeric(dtype) -> bool:
    """A bool, int or float dtype of NumPy's own (not bfloat16, not a PRNG key's)."""
    return (not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and dtype != jnp.bfloat16
            and np.dtype(dtype).kind in "biuf")


def _is_pure(eqn) -> bool:
    """Whether two equations of this primitive on equal operands give equal values: no effects, no callback, no
    inner jaxpr (whose parameters' repr would not tell them apart)."""
    return (not eqn.effects and eqn.primitive.name != "buffer_callback"
            and not any(map(_holds_jaxpr, eqn.params.values())))


def _holds_jaxpr(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(map(_holds_jaxpr, value))
    return isinstance(value, (jex.Jaxpr, jex.ClosedJaxpr))


def _aliases(eqn) -> dict[int, int]:
    """input index -> output index of a buffer_callback equation's in-place arrays."""
    return dict(eqn.params["input_output_aliases"])


def _is_view(op: _Op) -> bool:
    """Whether the operation only reshapes a row-major array (inside a run, a plan's result so reshaped is the same
    buffer): a squeeze, or a reshape without a transposition."""
    name = op.eqn.primitive.name
    return name == "squeeze" or (name == "reshape" and op.eqn.params.get("dimensions") is None)


class _View:
    """Part of a callback buffer seen as an array of its own (row-major): `shape` elements of `dtype` (None: the
    buffer's) from byte `offset`. A reshape of a plan's result, or a scratch array in the merged callback's
    workspace; for the launches (`__cuda_array_interface__`) and the CPU emulator (`__array__`)."""

    def __init__(self, buffer, offset: int, shape, dtype=None):
        self.buffer, self.offset, self.shape, self.dtype = buffer, offset, tuple(shape), dtype

    @property
    def __cuda_array_interface__(self):
        interface = self.buffer.__cuda_array_interface__
        address, readonly = interface["data"]
        view = {"data": (address + self.offset, readonly), "shape": self.shape, "strides": None}
        if self.dtype is None:  # the buffer's own type description, as it gives it
            return {**interface, **view}
        return {"version": interface["version"], "typestr": np.dtype(self.dtype).str, **view}

    def __array__(self, dtype=None, copy=None):
        array = np.asarray(self.buffer).reshape(-1)
        if self.dtype is not None:
            nbytes = int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize
            array = array.view(np.uint8)[self.offset:self.offset + nbytes].view(self.dtype)
        return array.reshape(self.shape)


class _Run:
    """Plan callbacks gathered for one merged callback, and reshapes of their results (id -> (base id, shape))."""

    def __init__(self):
        self.ops: list[_Op] = []
        self.views: dict[int, tuple[int, tuple]] = {}
        self.produced: set[int] = set()

    def add(self, op: _Op) -> None:
        self.ops.append(op)
        self.produced.update(o for o in op.outputs if o is not None)

    def add_view(self, op: _Op) -> None:
        (source,), (view,) = op.inputs, op.outputs
        base, _ = self.views.get(source, (source, None))
        self.views[view] = (base, tuple(op.eqn.outvars[0].aval.shape))
        self.produced.add(view)


# Scratch arrays (a plan's buffers that nothing after the run reads, placeholders included) share one workspace
# output and small constants one input, each at an offset aligned so; only arrays of NumPy's own numeric dtypes,
# since a typed view states its dtype by NumPy's name (bfloat16 has none).
_WORKSPACE_ALIGNMENT = 256


def _emit(run: _Run, flat: _Flat, needed: Callable[[int], bool], dependent: int,
          launch_fn: callback.LaunchFn) -> None:
    """Evaluates `run` as one merged callback, setting flat.values of its results that `needed` names.

    A callback's Python receives every buffer at every call, so the merged callback takes few: inputs of equal
    signature that no plan writes are one input, small constants are views of one input, and scratch arrays are
    views of one workspace output."""
    updated = {op.inputs[i] for op in run.ops for i in _aliases(op.eqn)}
    ext_inputs: list[int] = []  # value ids read from outside the run, in order
    by_signature: dict[Any, tuple] = {}  # a read-only input's signature -> its slot
    slot: dict[int, tuple] = {}  # value id -> its buffer: ("in", k), ("out", j) or ("view", base slot, shape)
    arrays: list = []  # the arrays the plans write afresh (j of ("out", j)), as ShapeDtypeStructs
    aliased: dict[int, int] = {}  # input index -> the array written in place into it
    members = []  # (PlanCall, its inputs' slots, its outputs' slots)
    constants = bytearray()  # the small constants the plans read, at aligned offsets: one input, the last

    def slot_of(i):  # a reshaped result's slot: a view of its base's
        base, shape = run.views[i]
        return ("view", slot[base], shape)

    for op in run.ops:
        in_slots = []
        for i in op.inputs:
            if i in run.views:
                slot[i] = slot_of(i)
            elif i not in slot:
                signature = flat.signatures[i]
                if i not in updated and signature in by_signature:
                    slot[i] = by_signature[signature]
                elif i not in updated and signature[0] == "constant":
                    _, dtype, shape, data = signature
                    slot[i] = by_signature[signature] = ("constant", len(constants), shape, dtype)
                    constants.extend(data)
                    constants.extend(bytes(-len(constants) % _WORKSPACE_ALIGNMENT))
                else:
                    slot[i] = ("in", len(ext_inputs))
                    ext_inputs.append(i)
                    if i not in updated:
                        by_signature[signature] = slot[i]
            in_slots.append(slot[i])
        in_place = {o: i for i, o in _aliases(op.eqn).items()}
        out_slots = []
        for k, (o, aval) in enumerate(zip(op.outputs, op.eqn.params["result_avals"], strict=True)):
            if k in in_place:  # written in place: its input's buffer
                where = in_slots[in_place[k]]
                if where[0] == "in" and where[1] not in aliased:
                    aliased[where[1]] = len(arrays)
                    arrays.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
            else:
                where = ("out", len(arrays))
                arrays.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
            out_slots.append(where)
            if o is not None:
                slot[o] = where
        members.append((plan_call(op.eqn), in_slots, out_slots))

    # The merged callback's outputs: the arrays read after the run or written in place into an input, one each;
    # the others at their offsets in one workspace.
    kept = set(aliased.values())
    for view in run.views:
        slot.setdefault(view, slot_of(view))
    for o in (*(o for op in run.ops for o in op.outputs if o is not None), *run.views):
        if needed(o):
            where = slot[o]
            while where[0] == "view":
                where = where[1]
            kept.add(where[1] if where[0] == "out" else aliased[where[1]])
    output_of, workspace_at, workspace_bytes, results = {}, {}, 0, []
    for j, array in enumerate(arrays):
        if j in kept or not _numpy_numeric(array.dtype):
            output_of[j] = len(results)
            results.append(array)
        else:
            workspace_at[j] = workspace_bytes
            workspace_bytes += -(-array.dtype.itemsize * int(np.prod(array.shape)) // _WORKSPACE_ALIGNMENT) * \
                _WORKSPACE_ALIGNMENT
    if workspace_at:
        results.append(jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8))
    in_place_into = {k: output_of[j] for k, j in aliased.items()}

    def merged(ctx, outputs, *inputs):
        def buffer(s):
            kind, index = s[0], s[1]
            if kind == "view":
                return _View(buffer(index), 0, s[2])
            if kind == "constant":
                return _View(inputs[-1], index, s[2], s[3])
            if kind == "in":
                return outputs[in_place_into[index]] if index in in_place_into else inputs[index]
            if index in workspace_at:
                return _View(outputs[-1], workspace_at[index], arrays[index].shape, arrays[index].dtype)
            return outputs[output_of[index]]

        def record(ctx):
            first = True
            for call, in_slots, out_slots in members:
                env = dict(zip(call.input_names, map(buffer, in_slots), strict=True))
                env.update(zip(call.output_names, map(buffer, out_slots), strict=True))
                for launch in call.plan.launches:
                    programmatic = dependent > INDEPENDENT and not first and launch.can_be_dependent
                    if programmatic:
                        launch = launch.dependent(dependent)
                    launch_fn(ctx, launch, tuple(env[a] if isinstance(a, str) else a for a in launch.args),
                              programmatic)
                    first = False

        callback.replay(ctx, token, (*inputs, *outputs), record)

    token = object()  # this merged callback, in the graph cache's keys
    operands = [jnp.asarray(flat.values[i]) for i in ext_inputs]
    if constants:
        operands.append(jnp.asarray(np.frombuffer(bytes(constants), np.uint8)))
    outs = buffer_callback(merged, results, input_output_aliases=in_place_into or None)(*operands)

    def result(where):
        kind, index = where[0], where[1]
        if kind == "view":
            return jnp.reshape(result(index), where[2])
        return outs[in_place_into[index] if kind == "in" else output_of[index]]

    for o in (*(o for op in run.ops for o in op.outputs if o is not None), *run.views):
        if needed(o):
            flat.values[o] = result(slot[o])


def _bind(op: _Op, flat: _Flat) -> None:
    """Evaluates one operation. A pure one on constants alone whose results are small is folded: its results are
    constants too (a layer index, a placeholder's zeros), which the merged callbacks pack."""
    eqn = op.eqn
    params = eqn.primitive.get_bind_params(eqn.params)
    inputs = [flat.values[i] for i in op.inputs]
    folded = (_is_pure(eqn) and all(map(_is_constant, inputs))
              and all(np.prod(v.aval.shape) <= _CONSTANT_SIGNATURE_SIZE for v in eqn.outvars))
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager, \
            (jax.ensure_compile_time_eval() if folded else contextlib.nullcontext()):
        outs = eqn.primitive.bind(*inputs, **params)
    for o, value in zip(op.outputs, outs if eqn.primitive.multiple_results else [outs], strict=True):
        if o is not None:
            flat.set(o, value)


def _evaluate(closed, leaves: list, dependent: int, launch_fn: callback.LaunchFn) -> list:
    """`closed` evaluated on `leaves` with its runs of plan callbacks merged (module docstring)."""
    flat = _Flat()
    out_ids = flat.add(closed, [flat.new(a, known=True) for a in leaves])
    last_use: dict[int, int] = {}
    for position, op in enumerate(flat.ops):
        for i in op.inputs:
            last_use[i] = position
    for i in out_ids:
        last_use[i] = len(flat.ops)
    run, position = _Run(), 0

    def flush():  # emits the run: its results that the operation at `position` or a later one reads
        nonlocal run
        if run.ops:
            _emit(run, flat, lambda o: last_use.get(o, -1) >= position, dependent, launch_fn)
            run = _Run()

    for position, op in enumerate(flat.ops):
        if plan_call(op.eqn) is not None:
            updated = [op.inputs[i] for i in _aliases(op.eqn)]
            if any(last_use.get(i, -1) > position or i in run.views for i in updated):
                # It would overwrite a value read later (or a reshape's): on its own, where XLA copies for it.
                flush()
                run.add(op)
                flush()
            else:
                run.add(op)
        elif _is_view(op) and op.inputs[0] in run.produced:
            run.add_view(op)
        else:
            if any(i in run.produced for i in op.inputs):
                flush()
            _bind(op, flat)
    position = len(flat.ops)
    flush()
    return [flat.values[i] for i in out_ids]


def unavailable_reason() -> Optional[str]:
    """Why a merged callback cannot run here (see `callback.replay_unavailable_reason`), or None."""
    return callback.replay_unavailable_reason()


def merge_plan_callbacks(fn: Callable, *, dependent: int = WAITS_AND_RELEASES,
                         launch: Optional[callback.LaunchFn] = None) -> Callable:
    """`fn` with its runs of `callback.run_plan` callbacks merged (module docstring). Call the result inside a
    jitted function: it traces `fn` at every call. Under `vmap` each op's own batching rule applies, then the
    batched plans are merged; differentiation is `fn`'s own (a merged callback has no JVP).

    Args:
      fn: a function of arrays (pytrees) whose kernel plans run on the callback executor.
      dependent: INDEPENDENT (launches in stream order), WAITS or WAITS_AND_RELEASES (the default: each kernel
        waits for its predecessor's writes and lets its successor launch at once; `kernels._common`).
      launch: how a merged callback enqueues one launch (default: `callback.cuda_launch`).
    """
    def merged_fn(*args):
        leaves, in_tree = jax.tree.flatten(args)
        closed, out_shapes = jax.make_jaxpr(fn, return_shape=True)(*args)

        def plain(*leaves):
            return jax.tree.leaves(fn(*jax.tree.unflatten(in_tree, leaves)))

        @jax.custom_batching.custom_vmap
        def merged(*leaves):
            return _evaluate(closed, list(leaves), dependent, launch or callback.cuda_launch)

        @merged.def_vmap
        def merged_vmap(axis_size, in_batched, *leaves):  # the ops' own batching rules, then merged again
            batched = jax.vmap(plain, in_axes=[0 if b else None for b in in_batched], axis_size=axis_size)
            outs = merge_plan_callbacks(batched, dependent=dependent, launch=launch)(*leaves)
            return outs, [True] * len(outs)

        run = jax.custom_jvp(merged)
        run.defjvp(lambda primals, tangents: jax.jvp(plain, primals, tangents))
        return jax.tree.unflatten(jax.tree.structure(out_shapes), run(*leaves))

    return merged_fn
