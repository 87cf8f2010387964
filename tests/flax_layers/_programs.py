"""Reading traced and compiled programs of the LM: loops, cuTile launches, dtype conversions of weights."""
import re

import jax
import jax.extend
from flax import nnx

LOOPS = ("scan", "while")


def walk(jaxpr, loops=()):
    """Every equation of a (closed) jaxpr and its sub-jaxprs, with the loops around it: (eqn, loops), loops a
    tuple of (primitive name, scan length or None), outermost first."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn, loops
        inner = loops + ((eqn.primitive.name, eqn.params.get("length")),) if eqn.primitive.name in LOOPS else loops
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from walk(sub, inner)


def cutile_launches(jaxpr) -> list[tuple[str, tuple]]:
    """(kernel function name, enclosing loops) of every cuTile kernel launch."""
    from jax_mamba2.kernels._common import kernel_name  # needs cuda.tile, which only these programs have
    return [(kernel_name(eqn.params["kernel"]), loops)
            for eqn, loops in walk(jaxpr) if eqn.primitive.name == "cutile_call_ffi"]


def loop_lengths(jaxpr) -> list[tuple[str, int | None]]:
    """(primitive, length) of every scan / while loop."""
    return [(eqn.primitive.name, eqn.params.get("length")) for eqn, _ in walk(jaxpr) if eqn.primitive.name in LOOPS]


def weight_matrix_shapes(model, min_axis: int = 16) -> set[tuple[int, ...]]:
    """Shapes of the weights of the matrix products (embedding / LM head, in_proj, out_proj: the parameters
    whose axes all have at least `min_axis` entries, which leaves out the conv's d_conv taps), stacked over
    layers and per layer (what the body of the scan over layers sees)."""
    shapes = set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        stacked = getattr(path[0], "key", None) == "layers"
        shape = tuple(leaf.shape[1:] if stacked else leaf.shape)
        if len(shape) >= 2 and min(shape) >= min_axis:
            shapes |= {shape, tuple(leaf.shape)}
    return shapes


def weight_conversions(jaxpr, model, shapes=None) -> list[tuple[tuple[int, ...], str, str]]:
    """(shape, from dtype, to dtype) of every convert_element_type whose operand has a weight matrix's shape
    (or one of `shapes`).

    Activations in the tests have a batch axis that no weight has, so a match is a conversion of a weight."""
    shapes = weight_matrix_shapes(model) if shapes is None else shapes
    found = []
    for eqn, _ in walk(jaxpr):
        if eqn.primitive.name == "convert_element_type":
            aval = eqn.invars[0].aval
            if tuple(aval.shape) in shapes and aval.dtype != eqn.params["new_dtype"]:
                found.append((tuple(aval.shape), str(aval.dtype), str(eqn.params["new_dtype"])))
    return found


_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]")
_HLO_CONVERT_OPERAND = re.compile(r"\sconvert\(%?([\w.\-]+)\)")


def _squeezed(dims: str) -> tuple[int, ...]:
    return tuple(int(d) for d in dims.split(",") if d and d != "1")


def hlo_weight_conversions(hlo_text: str, model) -> list[str]:
    """The `convert` instructions of an optimized HLO module (inside fusions too) whose result has a weight
    matrix's shape (size-1 axes dropped: a layer's slice of a stacked weight is (1, ...)) and whose operand
    has another dtype."""
    shapes = {tuple(d for d in shape if d != 1) for shape in weight_matrix_shapes(model)}
    dtypes, converts = {}, []
    for line in hlo_text.splitlines():
        instruction = _HLO_INSTRUCTION.match(line)
        if not instruction:
            continue
        name, dtype, dims = instruction.groups()
        dtypes[name] = dtype
        operand = _HLO_CONVERT_OPERAND.search(line)
        if operand and _squeezed(dims) in shapes:
            converts.append((line.strip(), dtype, operand.group(1)))
    return [line for line, dtype, operand in converts if dtypes.get(operand, dtype) != dtype]
