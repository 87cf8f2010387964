"""The collectives of a compiled XLA program, read from its HLO text, with how often each runs per call.

    compiled = jax.jit(step).lower(*args).compile()
    found = collectives(compiled.as_text())
    totals(found)                   # {"all-reduce": {"instructions": 5, "executions": 52, "bytes": 1.2e6}, ...}
    with_extent(found, 96, kind="all-gather")   # the all-gathers of arrays with a 96-long (e.g. batch x seqlen) run

Counting instructions alone undercounts a program built around `lax.scan`: a collective in the body of the
layers' while loop runs once per layer. Each collective therefore carries `executions`, the product of the
`known_trip_count`s of the while loops around it (None when XLA could not bound a loop), and `totals` sums
bytes over executions. Asynchronous forms (`all-reduce-start`, `all-gather-start`, ...) count as their
collective and their `-done` halves not at all; a collective that XLA wraps in an `async-start` computation
appears once, inside that computation. Shapes are the per-device results as compiled (an all-gather's result
is its gathered array, a reduce-scatter's the scattered block). Collectives whose every group is a single
device move nothing (XLA's CPU pipeline leaves some in place, e.g. over a mesh axis of size 1) and are left
out unless asked for.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Iterable

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute",
         "collective-broadcast")

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<shape>.*?)\s(?P<op>[a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([^\s,)}]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_DIMENSIONS = re.compile(r"\bdimensions=\{([0-9,]*)\}")
# Replica groups: explicit {{0,1},{2,3}}, iota [groups,size]<=[devices], or mesh['a'=2,'b'=1] {'a'}.
_GROUPS_EXPLICIT = re.compile(r"\breplica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"\breplica_groups=\[([0-9,]+)\]<=")
_GROUPS_MESH = re.compile(r"\breplica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
      kind: one of `KINDS` ("-start" folded in).
      name: the instruction's name in the HLO text.
      shapes: its per-device result arrays as (dtype, dims); for an asynchronous start, the outputs only.
      dimensions: the gathered / scattered dimensions (all-gather, reduce-scatter, all-to-all), else ().
      group_size: devices per replica group (None when the text does not say, e.g. collective-permute).
      computation: the HLO computation that holds it.
      executions: how many times it runs per call of the program (trip counts of the enclosing while loops),
        None when a loop around it has no known trip count.
      op_name: JAX's metadata path; "transpose(" in it marks the backward pass.
    """

    kind: str
    name: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    dimensions: tuple[int, ...]
    group_size: int | None
    computation: str
    executions: int | None
    op_name: str

    @property
    def nbytes(self) -> int:
        """Bytes of the result arrays of one execution."""
        return sum(math.ceil(math.prod(dims) * _bits(dtype) / 8) for dtype, dims in self.shapes)

    @property
    def in_backward(self) -> bool:
        return "transpose(" in self.op_name

    def has_extent(self, extent: int) -> bool:
        """Whether a result array has a run of consecutive dimensions whose product is `extent` (e.g. the
        batch x seqlen of an activation, flattened or not). A weight whose dimensions happen to multiply to
        the same number matches too: pick test shapes whose token count no weight shares."""
        for _, dims in self.shapes:
            for start in range(len(dims)):
                for stop in range(start + 1, len(dims) + 1):
                    if math.prod(dims[start:stop]) == extent:
                        return True
        return False

    def describe(self) -> str:
        arrays = ", ".join(f"{dtype}[{','.join(map(str, dims))}]" for dtype, dims in self.shapes)
        runs = "?" if self.executions is None else self.executions
        return (f"{self.kind} {arrays} x{runs} over {self.group_size or '?'} devices "
                f"({'backward' if self.in_backward else 'forward'}) {self.name}")

    def to_json(self) -> dict:
        return {"kind": self.kind, "name": self.name, "shapes": [[d, list(s)] for d, s in self.shapes],
                "dimensions": list(self.dimensions), "group_size": self.group_size, "computation": self.computation,
                "executions": self.executions, "bytes": self.nbytes, "backward": self.in_backward}


def collectives(hlo_text: str, *, keep_trivial: bool = False) -> list[Collective]:
    """The collective instructions of a compiled HLO module's text, in text order; those over groups of one
    device only with `keep_trivial`."""
    found, calls, current, entry = [], collections.defaultdict(list), None, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line) if line[:1] not in (" ", "\t", "") else None
        if header:
            current = header["name"]
            entry = current if line.startswith("ENTRY") else entry
            continue
        instruction = _INSTRUCTION.match(line)
        if not instruction or current is None:
            continue
        _record_calls(line, instruction["op"], current, calls)
        kind, start = _collective_kind(instruction["op"])
        if kind is None:
            continue
        arrays = tuple((dtype, tuple(int(d) for d in dims.split(",") if d))
                       for dtype, dims in _ARRAY.findall(instruction["shape"]))
        if start and kind == "all-gather":  # (operands..., outputs...)
            arrays = arrays[len(arrays) // 2:]
        elif start and kind == "collective-permute":  # (operand, output, contexts...)
            arrays = arrays[1:2]
        group_size = _group_size(line)
        if group_size == 1 and not keep_trivial:
            continue
        dimensions = _DIMENSIONS.search(line)
        op_name = _OP_NAME.search(line)
        found.append(Collective(kind, instruction["name"], arrays,
                                tuple(int(d) for d in dimensions[1].split(",") if d) if dimensions else (),
                                group_size, current, None, op_name[1] if op_name else ""))
    runs = _executions(entry, calls)
    return [dataclasses.replace(c, executions=runs.get(c.computation)) for c in found]


def totals(found: Iterable[Collective]) -> dict[str, dict]:
    """Per kind: instructions, executions per call and bytes moved per call (result bytes x executions);
    executions and bytes are None when a collective of that kind runs an unknown number of times."""
    out = {}
    for c in found:
        entry = out.setdefault(c.kind, {"instructions": 0, "executions": 0, "bytes": 0})
        entry["instructions"] += 1
        if c.executions is None or entry["executions"] is None:
            entry["executions"] = entry["bytes"] = None
        else:
            entry["executions"] += c.executions
            entry["bytes"] += c.executions * c.nbytes
    return out


def with_extent(found: Iterable[Collective], *extents: int, kind: str | None = None) -> list[Collective]:
    """The collectives (of `kind`, or all) with a result array holding a run of dimensions of one of the
    `extents` (see `Collective.has_extent`)."""
    return [c for c in found if (kind is None or c.kind == kind) and any(c.has_extent(e) for e in extents)]


def _collective_kind(op: str) -> tuple[str | None, bool]:
    base = op[:-len("-start")] if op.endswith("-start") else op
    return (base, base != op) if base in KINDS else (None, False)


def _group_size(line: str) -> int | None:
    explicit = _GROUPS_EXPLICIT.search(line)
    if explicit:
        return len([d for d in explicit[1].split(",") if d])
    iota = _GROUPS_IOTA.search(line)
    if iota:
        return int(iota[1].split(",")[-1])
    mesh = _GROUPS_MESH.search(line)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh[1]))
        return math.prod(int(sizes[axis]) for axis in re.findall(r"'([^']+)'", mesh[2]))
    return None


def _record_calls(line: str, op: str, caller: str, calls: dict) -> None:
    """The computations an instruction calls, with how often each runs per run of the instruction."""
    trip_count = _TRIP_COUNT.search(line)
    for role, callee in _CALLEE.findall(line):
        if op == "while" and role in ("body", "condition"):
            factor = int(trip_count[1]) if trip_count else None
        else:
            factor = 1
        calls[caller].append((callee, factor))
    for branches in _BRANCHES.findall(line):
        for callee in branches.split(","):
            calls[caller].append((callee.strip().lstrip("%"), 1))


def _executions(entry: str | None, calls: dict) -> dict[str, int | None]:
    """Runs per program call of every computation reachable from the entry (None: unknown)."""
    runs: dict[str, int | None] = {}

    def visit(name: str, times: int | None, path: tuple) -> None:
        if name in path:  # recursion does not occur in HLO; guard anyway
            return
        previous = runs.get(name, 0)
        runs[name] = None if previous is None or times is None else previous + times
        for callee, factor in calls.get(name, ()):
            visit(callee, None if times is None or factor is None else times * factor, path + (name,))

    if entry is not None:
        visit(entry, 1, ())
    return runs


def _bits(dtype: str) -> int:
    if dtype == "pred":
        return 8
    match = re.match(r"[a-z]+(\d+)", dtype)
    return int(match[1]) if match else 0
