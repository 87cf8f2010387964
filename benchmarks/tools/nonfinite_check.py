"""What the op's non-finite confinement costs a kernel backend: XLA's temporary memory, the fusions that test
finiteness and the time of one jitted SSD forward and forward+backward, with it and with it taken out.

`ssd` runs the kernels on the finite part of their inputs and cotangents and adds a per-(token, head) reach
term (jax_mamba2/op.py, docs/design.md §2); the program without it is `ssd(..., check_finite=False)`.
Inputs are the benchmark's (benchmarks/ssd.py: bf16, D, dt_bias, softplus), all finite.

On the GPU machine:
  python benchmarks/tools/nonfinite_check.py --shape 8,2048,32,64,128,1 --backend cutile
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def is_finite_fusions(hlo_text: str) -> int:
    """The fused computations of an optimized HLO module that test values for finiteness."""
    bodies = re.split(r"\n(?=\S)", hlo_text)
    return sum(1 for body in bodies if "{" in body and not body.startswith("ENTRY") and "is-finite" in body)


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
                             is_finite_fusions=is_finite_fusions(compiled.as_text()),
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
