"""Every SSD backend against a float64 oracle: relative errors of outputs and gradients, and timings.

The same random inputs (all options on: D, z, dt_bias with softplus, initial_states) go through the
backends "scan", "xla", "cutile" and "cutile_callback" in --dtype. Each result is compared with the
lax.scan recurrence run in float64 on the same (already rounded) inputs, as a relative L2 error
||a - ref|| / ||ref||: the output y, the final states, and the gradient of every differentiable input
for random output cotangents. Backends that cannot run here (cuTile without a GPU) are listed with the
reason. Times are medians of jitted calls after compilation (wall clock, block_until_ready).

    python examples/compare_reference.py                      # CPU-sized defaults
    python examples/compare_reference.py --batch 4 --seqlen 4096 --nheads 32 --headdim 64 \\
        --dstate 128 --chunk-size 128 --dtype bfloat16        # a GPU-sized problem

Writes compare_reference.json and compare_reference.png to --out. Exits with status 1 when a
backend's error exceeds the bound for --dtype (see MAX_REL_ERR), so it doubles as a GPU smoke check.
"""
from __future__ import annotations

import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_mamba2
from _common import (add_common_flags, axis_size, cutile_unavailable_reason, describe_device, make_parser, output_dir,
                     positive_int, power_of_two, save_figure, time_call, write_atomically)

BACKENDS = ("scan", "xla", "cutile", "cutile_callback")
# Inputs the gradient is taken with respect to, in the order of the error table.
DIFF_INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
# Bound on every relative L2 error against the float64 oracle (float32 accumulation everywhere; the
# low-precision bounds cover the rounding of y and of the bf16/f16 matmul operands).
MAX_REL_ERR = {"float32": 5e-3, "bfloat16": 3e-2, "float16": 2e-2}


def make_inputs(seed: int, *, batch, seqlen, nheads, headdim, ngroups, dstate, dtype):
    """Random SSD operands (dict of arrays) in the value ranges of a trained Mamba-2 layer."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 9)
    normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32)  # noqa: E731
    return dict(
        x=normal(keys[0], (batch, seqlen, nheads, headdim)).astype(dtype),
        # Raw dt before softplus(dt + dt_bias): Δ lands around 0.01-0.5.
        dt=jax.random.uniform(keys[1], (batch, seqlen, nheads), jnp.float32, -3.0, 0.0).astype(dtype),
        A=-jnp.exp(jax.random.uniform(keys[2], (nheads,), jnp.float32, 0.0, math.log(16.0))),
        B=normal(keys[3], (batch, seqlen, ngroups, dstate)).astype(dtype),
        C=normal(keys[4], (batch, seqlen, ngroups, dstate)).astype(dtype),
        D=normal(keys[5], (nheads,)),
        z=normal(keys[6], (batch, seqlen, nheads, headdim)).astype(dtype),
        dt_bias=jax.random.uniform(keys[7], (nheads,), jnp.float32, -2.0, 0.0),
        initial_states=normal(keys[8], (batch, nheads, headdim, dstate)),
    )


def make_ssd_fn(backend: str, chunk_size: int):
    """(inputs, cotangents) -> ((y, final_states), gradients dict), and the forward alone; both jitted."""
    def forward(inputs):
        x, dt, A, B, C = (inputs[k] for k in ("x", "dt", "A", "B", "C"))
        return jax_mamba2.ssd(x, dt, A, B, C, chunk_size, D=inputs["D"], z=inputs["z"],
                              dt_bias=inputs["dt_bias"], dt_softplus=True,
                              initial_states=inputs["initial_states"], return_final_states=True,
                              backend=backend)

    def forward_and_grads(inputs, cotangents):
        outputs, vjp = jax.vjp(forward, inputs)
        (grads,) = vjp(cotangents)
        return outputs, grads

    return jax.jit(forward), jax.jit(forward_and_grads)


def oracle(inputs, cotangents, chunk_size: int):
    """y, final_states and gradients of the float64 lax.scan recurrence, as NumPy float64 arrays."""
    with jax.enable_x64(True):
        wide = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)  # noqa: E731
        _, forward_and_grads = make_ssd_fn("scan", chunk_size)
        (y, final), grads = forward_and_grads(wide(inputs), wide(cotangents))
        return jax.tree.map(lambda a: np.asarray(a, np.float64), ({"y": y, "final_states": final}, grads))


def rel_l2(actual, expected: np.ndarray) -> float:
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def run_backend(backend, inputs, cotangents, reference, *, chunk_size, repeats):
    """One result row: errors per quantity and timings, or the reason the backend cannot run."""
    forward, forward_and_grads = make_ssd_fn(backend, chunk_size)
    try:
        (y, final), grads = forward_and_grads(inputs, cotangents)
    except ValueError as e:  # the op names why this backend cannot run the call here
        return {"backend": backend, "unavailable": str(e)}
    ref_outputs, ref_grads = reference
    errors = {"y": rel_l2(y, ref_outputs["y"]), "final_states": rel_l2(final, ref_outputs["final_states"])}
    errors.update({f"d{name}": rel_l2(grads[name], ref_grads[name]) for name in DIFF_INPUTS})
    fwd = time_call(forward, inputs, repeats=repeats)
    fwd_bwd = time_call(forward_and_grads, inputs, cotangents, repeats=repeats)
    return {"backend": backend, "errors": errors,
            "fwd_ms": fwd._asdict(), "fwd_bwd_ms": fwd_bwd._asdict()}


def print_table(rows, bound: float) -> None:
    quantities = list(next((r["errors"] for r in rows if "errors" in r), {}))
    header = ["backend", *quantities, "fwd ms", "fwd+bwd ms"]
    widths = [max(15, len(h)) for h in header[:1]] + [max(8, len(h)) for h in header[1:]]
    print("relative L2 error vs float64 scan (bound {:.0e}); times: median wall clock".format(bound))
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for row in rows:
        if "unavailable" in row:
            print(row["backend"].rjust(widths[0]) + "  unavailable: " + row["unavailable"])
            continue
        cells = [row["backend"]]
        cells += [f"{e:.1e}" + ("" if e <= bound else "!") for e in row["errors"].values()]  # NaN: !
        cells += [f"{row['fwd_ms']['median_ms']:.2f}", f"{row['fwd_bwd_ms']['median_ms']:.2f}"]
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)))


def failed_backends(rows, bound: float) -> list[str]:
    """The backends with an error above `bound` or NaN (an error is a pass only when known to be within it)."""
    return [r["backend"] for r in rows if "errors" in r and not all(e <= bound for e in r["errors"].values())]


def save_plot(rows, path, title: str, bound: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "errors" in r]
    quantities = list(measured[0]["errors"])
    fig, (ax_err, ax_time) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(measured)
    for i, row in enumerate(measured):
        positions = np.arange(len(quantities)) + (i - (len(measured) - 1) / 2) * width
        # A float64-exact result would be 0; clip so that log scale can show it.
        values = [max(row["errors"][q], 1e-17) for q in quantities]  # a NaN error draws no bar (and fails, below)
        ax_err.bar(positions, values, width, color=f"C{i}", label=row["backend"])
        ax_time.bar(i - 0.2, row["fwd_ms"]["median_ms"], 0.4, color=f"C{i}")
        ax_time.bar(i + 0.2, row["fwd_bwd_ms"]["median_ms"], 0.4, color=f"C{i}", hatch="//",
                    edgecolor="white")
    ax_err.axhline(bound, color="red", linestyle="--", linewidth=1, label=f"bound {bound:.0e}")
    ax_err.set_xticks(np.arange(len(quantities)), quantities, rotation=30)
    ax_err.set_yscale("log")
    ax_err.set_ylabel("relative L2 error vs float64 scan")
    ax_err.legend()
    ax_time.set_xticks(np.arange(len(measured)), [r["backend"] for r in measured], rotation=30)
    ax_time.set_yscale("log")
    ax_time.set_ylabel("median ms (plain: fwd, hatched: fwd+bwd)")
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    parser = make_parser(__doc__)
    parser.add_argument("--batch", type=axis_size, default=2, help="sequences")
    parser.add_argument("--seqlen", type=axis_size, default=512, help="tokens per sequence")
    parser.add_argument("--nheads", type=positive_int, default=4, help="SSM heads")
    parser.add_argument("--headdim", type=positive_int, default=32, help="head size P")
    parser.add_argument("--ngroups", type=positive_int, default=1, help="groups of heads sharing B and C")
    parser.add_argument("--dstate", type=positive_int, default=32, help="state size N")
    parser.add_argument("--chunk-size", type=power_of_two, default=64, help="SSD chunk length, a power of two")
    parser.add_argument("--dtype", choices=sorted(MAX_REL_ERR), default="float32",
                        help="dtype of the inputs (the oracle runs in float64)")
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed calls per backend")
    add_common_flags(parser, backend=False)  # every backend runs
    args = parser.parse_args(argv)
    if args.nheads % args.ngroups:
        parser.error(f"--nheads={args.nheads} must be a multiple of --ngroups={args.ngroups}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = output_dir(args.out)  # before the work: an --out that cannot be a folder ends the run at once
    shape = dict(batch=args.batch, seqlen=args.seqlen, nheads=args.nheads, headdim=args.headdim,
                 ngroups=args.ngroups, dstate=args.dstate)
    print(f"device: {describe_device()}")
    print(f"problem: {shape}, chunk_size={args.chunk_size}, dtype={args.dtype}")
    reason = cutile_unavailable_reason()
    if reason:
        print(f"cuTile backends cannot run here ({reason}); comparing the pure-JAX backends only")

    inputs = make_inputs(args.seed, **shape, dtype=jnp.dtype(args.dtype))
    keys = jax.random.split(jax.random.PRNGKey(args.seed ^ 1))
    cotangents = (jax.random.normal(keys[0], inputs["x"].shape, jnp.float32).astype(args.dtype),
                  jax.random.normal(keys[1], inputs["initial_states"].shape, jnp.float32))
    reference = oracle(inputs, cotangents, args.chunk_size)
    rows = [run_backend(b, inputs, cotangents, reference, chunk_size=args.chunk_size, repeats=args.repeats)
            for b in BACKENDS]

    bound = MAX_REL_ERR[args.dtype]
    print_table(rows, bound)
    record = {"device": describe_device(), "shape": shape, "chunk_size": args.chunk_size,
              "dtype": args.dtype, "max_rel_err": bound, "rows": rows}
    # NaN errors as null: JSON has no NaN (Python's json would write a bare NaN that strict readers refuse).
    record["rows"] = [{**r, "errors": {q: (e if math.isfinite(e) else None) for q, e in r["errors"].items()}}
                      if "errors" in r else r for r in rows]
    write_atomically(out / "compare_reference.json", json.dumps(record, indent=2, allow_nan=False).encode())
    dims = " ".join(f"{k}={v}" for k, v in shape.items())
    save_plot(rows, out / "compare_reference.png",
              f"{args.dtype} {dims} chunk_size={args.chunk_size} on {describe_device()}", bound)
    print(f"wrote {out / 'compare_reference.json'} and {out / 'compare_reference.png'}")

    failed = failed_backends(rows, bound)
    if failed:
        print(f"FAILED: errors above {bound:.0e} or NaN (marked !) for {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
