"""The LM's RMSNorms, forward (or forward + backward), against their bandwidth floor; a sweep of the kernels' configs.

Cases (--cases), at the LM step's shapes (d_model 1024, 8 x 2048 tokens; --rows to change the token count):
  gated_before  the mixer's gated norm, rms_norm(x, w, z) over d_inner 2048 (one group), gate before the norm
  gated_after   the same with norm_before_gate=True
  add_norm      the block's residual add + norm, add_rms_norm(x, residual, w) over 1024 features: bf16 x, float32
                residual stream (residual_in_fp32), bf16 output

Implementations (--impls):
  cutile   the op with backend="cutile" in jax.jit (the kernels in their default config, the op's own glue)
  xla      the op with backend="xla" (norm_reference: what XLA fuses)
With --configs, every case is also run on the kernels (bridge/norm_ops.py, the op's custom VJP spelled out) in
each given config: "sweep" for the grid of `sweep_configs` (BLOCK_ROWS, occupancy and latency hints around the
default), or specs "BLOCK_ROWS=2,FWD_OCCUPANCY=8,BWD_OCCUPANCY=4,FWD_LATENCY=0,BWD_LATENCY=2" (unnamed fields
keep the default's). Those records are impl "cutile" with the config in "config".

Inputs: bf16 x, z, dy ~ N(0, 1), a float32 weight 1 + N(0, 0.1^2), a float32 residual and its cotangent
~ N(0, 1). fwd_bwd runs the forward and the VJP of given cotangents. Every output is checked against xla on
the inputs upcast to float32 (relative L2).

Floor: the bytes of one read of every input and one write of every output of each pass (`floor_bytes`, the
weight and its gradient partials left out) at 4.8 TB/s. Timing as benchmarks/ssd.py: ms_pipelined, the median
over 5 rounds of back-to-back calls, is the number to compare; gbps is floor bytes / ms_pipelined.

Run on the GPU machine:
  source .gpu/gpu-env.sh
  python benchmarks/norm.py --out $OUT                                   # cutile and xla, both directions
  python benchmarks/norm.py --configs sweep --impls --cases add_norm --out $OUT   # the sweep, a case at a time
Writes <out>/norm_<direction>_<gpu>.json (a list of records; records of an earlier run in the same file are kept
unless remeasured) and prints one line per record. A record takes about 4 s (compile, 2 s of warm-up, the
budget): the whole sweep is about 120 records, so run it a case at a time.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):  # run as a script: benchmarks/ is sys.path[0], the repo root may not be
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import report  # noqa: E402
from benchmarks.environment import environment, exit_unless_cutile_runs, gpu_slug  # noqa: E402
from benchmarks.ssd import PEAK_HBM_TBPS, time_jax  # noqa: E402
from jax_mamba2 import add_rms_norm, rms_norm  # noqa: E402

EPS = 1e-5
ROWS = 8 * 2048
IMPLS = ("cutile", "xla")


class Case(NamedTuple):
    """One norm of the LM: `features` per row, a gate (before / after the norm) or the residual add."""

    features: int
    gate: Optional[str] = None  # "before" | "after" | None
    residual: bool = False


CASES = {
    "gated_before": Case(2048, gate="before"),
    "gated_after": Case(2048, gate="after"),
    "add_norm": Case(1024, residual=True),
}
# Bytes per element of each pass: (reads, writes). Gated: x, z -> y; x, z, dy -> dx, dz (bf16). Add + norm:
# x (bf16), residual (f32) -> h (f32), y (bf16); h, dy (bf16), dh (f32) -> dx (bf16), dresidual (f32).
_BYTES = {False: {"fwd": (4, 2), "bwd": (6, 4)}, True: {"fwd": (6, 6), "bwd": (10, 6)}}


def floor_bytes(case: Case, rows: int, direction: str) -> int:
    """Bytes of one pass over each array: the forward, plus the backward for "fwd_bwd"."""
    passes = ("fwd", "bwd") if direction == "fwd_bwd" else ("fwd",)
    return rows * case.features * sum(sum(_BYTES[case.residual][p]) for p in passes)


def make_inputs(case: Case, rows: int, seed: int = 0) -> dict:
    keys = jax.random.split(jax.random.key(seed), 5)
    shape = (rows, case.features)
    inputs = dict(x=jax.random.normal(keys[0], shape, jnp.bfloat16),
                  weight=1 + 0.1 * jax.random.normal(keys[1], (case.features,), jnp.float32),
                  dout=jax.random.normal(keys[2], shape, jnp.bfloat16))
    if case.gate:
        inputs["z"] = jax.random.normal(keys[3], shape, jnp.bfloat16)
    if case.residual:
        inputs["residual"] = jax.random.normal(keys[3], shape, jnp.float32)
        inputs["dresidual_out"] = jax.random.normal(keys[4], shape, jnp.float32)
    return inputs


def _primals(inputs: dict) -> tuple:
    return tuple(inputs.get(name) for name in ("x", "z", "residual", "weight"))


def _cotangents(inputs: dict) -> tuple:
    return inputs["dout"], inputs.get("dresidual_out")


def op_forward(case: Case, backend: str):
    """(x, z, residual, weight) -> (out, residual_out or None) on the public op."""
    def forward(x, z, residual, weight):
        if case.residual:
            return add_rms_norm(x, residual, weight, eps=EPS, residual_dtype=jnp.float32, backend=backend)
        return rms_norm(x, weight, z, eps=EPS, norm_before_gate=case.gate == "after", backend=backend), None
    return forward


def kernel_forward_and_backward(case: Case, config):
    """(forward, fwd_bwd) on the kernels in `config` (a NormConfig): what the op's custom VJP runs."""
    from jax_mamba2.bridge import ffi, norm_ops

    kernels = norm_ops.make_kernels(ffi.run_plan, lambda dims: config)

    def dims_of(x, z, residual, weight):
        return norm_ops.norm_dims(x, z, residual, weight, group_size=case.features,
                                  norm_before_gate=case.gate == "after", eps=EPS, out_dtype=x.dtype,
                                  residual_dtype=None if residual is None else jnp.float32)

    def as_rows(a):
        return None if a is None else a.reshape(a.shape[0], 1, a.shape[1])

    def forward(x, z, residual, weight):
        dims = dims_of(x, z, residual, weight)
        out, residual_out = kernels.forward(dims, as_rows(x), as_rows(z), as_rows(residual), weight.reshape(1, -1))
        return out.reshape(x.shape), None if residual_out is None else residual_out.reshape(x.shape)

    def fwd_bwd(x, z, residual, weight, dout, dresidual_out):
        dims = dims_of(x, z, residual, weight)
        rows = [as_rows(a) for a in (x, z, residual)]
        out, residual_out = kernels.forward(dims, *rows, weight.reshape(1, -1))
        saved = norm_ops.NormSaved(x=rows[0] if residual is None else residual_out, z=rows[1],
                                   weight=weight.reshape(1, -1), x_like=rows[0][:0],
                                   residual_like=None if residual is None else rows[2][:0])
        grads = kernels.backward(dims, saved, as_rows(dout), as_rows(dresidual_out))
        outputs = (out, residual_out) + tuple(grads)
        return tuple(None if a is None else a.reshape(a.shape[0], -1) if a.ndim == 3 else a.reshape(-1)
                     for a in outputs)

    return forward, fwd_bwd


def _op_fwd_bwd(forward):
    def fwd_bwd(x, z, residual, weight, dout, dresidual_out):
        outputs, vjp = jax.vjp(forward, x, z, residual, weight)
        return (*outputs, *vjp((dout, dresidual_out)))
    return fwd_bwd


# The names of the outputs, in the order the calls return them (None where the case has no such array).
OUTPUT_NAMES = ("out", "residual_out", "dx", "dz", "dresidual", "dweight")


def jax_call(inputs: dict, direction: str, forward, fwd_bwd=None):
    """A jitted call of `forward` (or of fwd_bwd: the forward's outputs then dx, dz, dresidual, dweight)."""
    if direction == "fwd":
        run = jax.jit(forward)
        return lambda: run(*_primals(inputs))
    run = jax.jit(fwd_bwd or _op_fwd_bwd(forward))
    return lambda: run(*_primals(inputs), *_cotangents(inputs))


def rel_l2(actual, expected) -> float:
    actual, expected = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (actual, expected))
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def default_config(case: Case):
    """norm_default_config of `case` (its defaults depend on the group's width and the gate, not on rows)."""
    from jax_mamba2.kernels.rms_norm import NormDims, norm_default_config

    return norm_default_config(NormDims(
        rows=ROWS, ngroups=1, group_size=case.features, z_dtype="bfloat16" if case.gate else None,
        residual_dtype="float32" if case.residual else None, residual_in_dtype="float32" if case.residual else None))


def sweep_configs(case: Case, direction: str) -> list:
    """The kernels' configs around the default of `case`: BLOCK_ROWS x1, x2, x4 (tiles of at most 8192 values),
    and for "fwd" the forward occupancy 4 / 8 with load latency 0 (none) / 3; for "fwd_bwd" (the forward at its
    default) the backward occupancy 1 / 2 / 4 with latency 0 / 2 / 4 (its loop is where a prefetch of the next
    row block can pay)."""
    base = default_config(case)
    width = 1 << (case.features - 1).bit_length()
    block_rows = [base.BLOCK_ROWS * k for k in (1, 2, 4) if base.BLOCK_ROWS * k * width <= 8192]
    if direction == "fwd":
        return [dataclasses.replace(base, BLOCK_ROWS=r, FWD_OCCUPANCY=o, FWD_LATENCY=lat)
                for r, o, lat in itertools.product(block_rows, (4, 8), (0, 3))]
    return [dataclasses.replace(base, BLOCK_ROWS=r, BWD_OCCUPANCY=o, BWD_LATENCY=lat)
            for r, o, lat in itertools.product(block_rows, (1, 2, 4), (0, 2, 4))]


def parse_config(spec: str, case: Case):
    """A NormConfig from "FIELD=VALUE,..." over the default of `case`."""
    from jax_mamba2.kernels.rms_norm import NormConfig

    base = default_config(case)
    fields = {f.name for f in dataclasses.fields(NormConfig)}
    values = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        if name not in fields or not value.lstrip("-").isdigit():
            raise ValueError(f"--configs: {item!r} must be FIELD=INT with FIELD one of {sorted(fields)}")
        values[name] = int(value)
    return dataclasses.replace(base, **values)


def measure(name: str, rows: int, direction: str, budget_s: float, impl: str = "xla", config=None) -> dict:
    """One record: `impl` on the public op, or the kernels in `config` when given."""
    case = CASES[name]
    inputs = make_inputs(case, rows)
    upcast = jax.tree.map(lambda a: a.astype(jnp.float32), inputs)
    reference = jax_call(upcast, direction, op_forward(case, "xla"))()
    if config is None:
        call = jax_call(inputs, direction, op_forward(case, impl))
    else:
        call = jax_call(inputs, direction, *kernel_forward_and_backward(case, config))
    timing, outputs = time_jax(call, budget_s)
    floor = floor_bytes(case, rows, direction)
    errors = {n: rel_l2(o, r) for n, o, r in zip(OUTPUT_NAMES, outputs, reference) if r is not None}
    return dict(impl="cutile" if config is not None else impl, case=name, shape=[rows, case.features],
                gate=case.gate, residual=case.residual, direction=direction, dtype="bfloat16",
                config=None if config is None else dataclasses.asdict(config),
                ms_median=timing.ms_median, ms_pipelined=timing.ms_pipelined, floor_bytes=floor,
                floor_ms=floor / (PEAK_HBM_TBPS * 1e9), gbps=floor / (timing.ms_pipelined * 1e6),
                errors=errors, **environment())


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", nargs="*", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--rows", type=int, default=ROWS, help="rows (tokens) per norm (default 8 x 2048)")
    parser.add_argument("--configs", nargs="+", default=[],
                        help='kernel configs to run: "sweep", or FIELD=VALUE,... specs (see the module doc)')
    parser.add_argument("--direction", choices=("fwd", "fwd_bwd", "both"), default="both")
    parser.add_argument("--budget-seconds", type=float, default=1.0, help="timing budget per record")
    parser.add_argument("--out", required=True, help="output folder")
    return parser.parse_args(argv)


def configs_for(case: Case, specs: list[str], direction: str) -> list:
    configs = []
    for spec in specs:
        configs += sweep_configs(case, direction) if spec == "sweep" else [parse_config(spec, case)]
    return configs


def format_line(r: dict) -> str:
    config = "" if r["config"] is None else " " + ",".join(f"{k}={v}" for k, v in r["config"].items())
    return (f"{r['direction']:8s} {r['case']:13s} {str(tuple(r['shape'])):14s} {r['impl']:7s} "
            f"{r['ms_pipelined']:8.4f} ms (floor {r['floor_ms']:.4f}) {r['gbps']:7.1f} GB/s  "
            f"max rel L2 {max(r['errors'].values()):.1e}{config}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if "cutile" in args.impls or args.configs:  # the configs are the kernels'
        exit_unless_cutile_runs("norm.py")
    directions = ("fwd", "fwd_bwd") if args.direction == "both" else (args.direction,)
    os.makedirs(args.out, exist_ok=True)
    for direction in directions:
        records = []
        for name in args.cases:
            records += [measure(name, args.rows, direction, args.budget_seconds, impl) for impl in args.impls]
            records += [measure(name, args.rows, direction, args.budget_seconds, config=config)
                        for config in configs_for(CASES[name], args.configs, direction)]
        if not records:
            continue
        path = Path(args.out) / f"norm_{direction}_{gpu_slug(records[0]['gpu'])}.json"
        report.write_records(merge(report.load_records(path) if path.exists() else [], records), path)
        for r in records:
            print(format_line(r))
    return 0


def merge(records: list[dict], newer: list[dict]) -> list[dict]:
    """`records` with each of `newer` in place of the one of the same (case, rows, impl, config), new ones
    appended: runs of parts of a sweep (one command per case) add up in one file."""
    def key(r):
        return r["case"], r["shape"][0], r["impl"], json.dumps(r["config"], sort_keys=True)
    merged = {key(r): r for r in records}
    merged.update({key(r): r for r in newer})
    return list(merged.values())


if __name__ == "__main__":
    sys.exit(main())
