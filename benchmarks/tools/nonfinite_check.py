"""What the op's non-finite check costs a kernel backend: XLA's temporary memory, the check's fusions and the
time of one jitted SSD forward and forward+backward, with the check and with it taken out.

`ssd` checks what each kernel call consumes and recomputes a call given a NaN or inf on the xla path
(jax_mamba2/op.py, docs/design.md §2); the program without the check is `ssd(..., check_finite=False)`.
Inputs are the benchmark's (benchmarks/ssd.py: bf16, D, dt_bias, softplus): all finite, so the timed
programs run the kernel branch.

On the GPU machine:
  python benchmarks/tools/nonfinite_check.py --shape 8,2048,32,64,128,1 --backend cutile
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


_CALLED = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _computations(hlo_text: str) -> dict[str, str]:
    """name -> text of every computation of an HLO module's text (ENTRY's name prefixed with "ENTRY ")."""
    found = {}
    for body in re.split(r"\n(?=\S)", hlo_text):
        head = re.match(r"(ENTRY\s+)?%?([\w.\-]+)\s", body)
        if head and "{" in body:
            found[("ENTRY " if head.group(1) else "") + head.group(2)] = body
    return found


def is_finite_fusions_outside_branches(hlo_text: str) -> int:
    """The computations of an optimized HLO module that test values for finiteness and run whichever way
    its conditionals go: the check, not the xla path's own tests inside the recompute branch."""
    computations = _computations(hlo_text)
    branch_roots = [name.strip().lstrip("%") for body in computations.values()
                    for group in _BRANCHES.findall(body) for name in group.split(",")]
    in_branches, stack = set(), branch_roots
    while stack:
        name = stack.pop()
        if name not in in_branches and name in computations:
            in_branches.add(name)
            stack.extend(_CALLED.findall(computations[name]))
            stack.extend(n.strip().lstrip("%") for g in _BRANCHES.findall(computations[name]) for n in g.split(","))
    return sum(1 for name, body in computations.items()
               if name not in in_branches and not name.startswith("ENTRY") and "is-finite" in body)


def measure(shape, backend: str, chunk_size: int, budget_s: float) -> list[dict]:
    import jax

    from benchmarks import ssd as bench

    inputs, weights = bench.make_inputs(shape), bench.loss_weights(shape)
    args = bench._ordered(inputs)
    rows = []
    for direction in ("fwd", "fwd_bwd"):
        for checked in (True, False):
            forward = bench._ssd_call(backend, chunk_size, check_finite=checked)
            fn, fn_args = (forward, args) if direction == "fwd" else (bench.forward_backward(forward), (args, weights))
            compiled = jax.jit(fn).lower(*fn_args).compile()
            memory = compiled.memory_analysis()
            timing, _ = bench.time_jax(lambda: compiled(*fn_args), budget_s)
            rows.append(dict(direction=direction, checked=checked,
                             temp_mib=round(memory.temp_size_in_bytes / 2**20, 1),
                             is_finite_fusions=is_finite_fusions_outside_branches(compiled.as_text()),
                             ms_median=round(timing.ms_median, 4), ms_p20=round(timing.ms_p20, 4),
                             ms_p80=round(timing.ms_p80, 4)))
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8,2048,32,64,128,1", help="B,L,H,P,N,G")
    parser.add_argument("--backend", default="cutile")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--budget-s", type=float, default=5.0, help="timed seconds per program")
    args = parser.parse_args(argv)
    from benchmarks import ssd as bench
    measure(bench.Shape.parse(args.shape), args.backend, args.chunk_size, args.budget_s)


if __name__ == "__main__":
    main()
