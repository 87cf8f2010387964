"""Where the time goes: GPU time of every kernel launch of the SSD forward and backward plans.

    python benchmarks/tools/stages.py [--shapes B,L,H,P,N,G ...] [--chunk 64] [--features z initial_states seq_idx]
                                [--configs default|tuned]
                                [--layouts staged fused] [--atomic-heads 1 2 4 8] [--deterministic]
                                [--fwd-variant NAME:STAGE.FIELD=VALUE,... ...]
                                [--bwd-variant NAME:STAGE.FIELD=VALUE,... ...] [--forward-only]
                                [--out DIR]

Each plan runs once eagerly (torch tensors viewing random JAX inputs, ct.launch on a torch stream), then
back to back for WARMUP_S seconds, then every launch is timed alone: the median of CUDA-event times over
repeated launches on the intermediates the earlier launches wrote. Writes <out>/ssd_stages_<gpu>.json and
prints a table. Launches that accumulate atomically (dB/dC) keep accumulating while timed; their times are
right, their values are not read.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: benchmarks/tools/ is sys.path[0], the repo root may not be
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cuda.tile as ct  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.environment import environment, gpu_slug  # noqa: E402
from benchmarks.ssd import GRID, WARMUP_S, Shape, warm_up  # noqa: E402
from jax_mamba2._files import write_atomically  # noqa: E402
from jax_mamba2.bridge import eager, tuning  # noqa: E402
from jax_mamba2.bridge.tuning import timing  # noqa: E402
from jax_mamba2.kernels import backward, forward  # noqa: E402
from jax_mamba2.kernels._common import SSDDims, kernel_name  # noqa: E402

# Every stage's declaration, by name.
STAGES = {**forward.STAGES, **backward.STAGES}


def parse_variant(text: str, stages: tuple[str, ...] = backward.BACKWARD_STAGES
                  ) -> tuple[str, dict[str, dict[str, int | None]]]:
    """"NAME:STAGE.FIELD=VALUE,..." -> (NAME, {stage: {field: int value}}) (booleans as 0/1, "none" as None),
    STAGE one of `stages` (a forward or a backward plan's)."""
    name, _, assignments = text.partition(":")
    fields: dict[str, dict[str, int | None]] = {}
    for assignment in filter(None, assignments.split(",")):
        target, _, value = assignment.partition("=")
        stage, _, field = target.partition(".")
        if not (stage in stages and field and value):
            raise argparse.ArgumentTypeError(f"{assignment!r}: expected STAGE.FIELD=VALUE with STAGE one of {stages}")
        fields.setdefault(stage, {})[field] = None if value == "none" else int(value)
    if not (name and fields):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:STAGE.FIELD=VALUE,...")
    return name, fields


def variant_configs(dims: SSDDims, fields: dict[str, dict[str, int | None]]) -> dict[str, object]:
    """Each named stage's default config for `dims` with the given fields replaced (the plan says which do
    not fit `dims`)."""
    configs = {}
    for stage, values in fields.items():
        default = STAGES[stage].default(dims)
        types = {f.name: f.type for f in dataclasses.fields(default)}
        configs[stage] = dataclasses.replace(
            default, **{k: bool(v) if types[k] in (bool, "bool") else v for k, v in values.items()})
    return configs


def variant_layout(dims: SSDDims, configs: dict[str, object]) -> str:
    """The forward layout a variant runs in: the one whose own stages (those not shared by every layout) its
    configs name, else `forward.forward_layout(dims)`."""
    shared = set.intersection(*(set(stages) for stages in forward.FORWARD_LAYOUTS.values()))
    named = [name for name, stages in forward.FORWARD_LAYOUTS.items() if set(configs) & (set(stages) - shared)]
    return named[0] if len(named) == 1 else forward.forward_layout(dims)


# --features: optional inputs of the problem, by SSDDims flag.
FEATURES = {"z": "has_z", "initial_states": "has_init", "seq_idx": "has_seq_idx"}


def dims_of(shape: Shape, chunk_size: int, features: tuple[str, ...] = ()) -> SSDDims:
    return SSDDims(batch=shape.batch, seqlen=shape.seqlen, nheads=shape.nheads, headdim=shape.headdim,
                   ngroups=shape.ngroups, dstate=shape.dstate, chunk_size=chunk_size, dtype="bfloat16",
                   dt_dtype="bfloat16", dt_softplus=True, **{FEATURES[f]: True for f in features})


def time_launches(plan, arrays: dict, repeats: int, warmup_s: float = WARMUP_S) -> list[dict]:
    """Runs `plan` once (compiling its kernels), then back to back for `warmup_s` seconds (the GPU's clocks,
    see benchmarks/ssd.py's WARMUP_S), then times each launch alone (median ms of `repeats` CUDA-event
    timings)."""
    import torch
    xp = eager.ArrayNamespace("torch")
    stream = torch.cuda.Stream()
    env = dict(arrays)
    for name, buf in plan.buffers.items():
        env[name] = (xp.zeros if buf.zero_init else xp.empty)(buf.shape, buf.dtype)
    stream.wait_stream(torch.cuda.current_stream())  # the zero fills above run on the current stream
    launches = [(launch, tuple(env[a] if isinstance(a, str) else a for a in launch.args)) for launch in plan.launches]

    def run_plan():
        for launch, args in launches:
            ct.launch(stream, launch.grid, launch.kernel, args)

    run_plan()
    warm_up(run_plan, lambda _: stream.synchronize(), warmup_s)
    rows = []
    for launch, args in launches:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(repeats):
            start.record(stream)
            ct.launch(stream, launch.grid, launch.kernel, args)
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end))
        rows.append({"kernel": kernel_name(launch.kernel),
                     "grid": list(launch.grid), "ms_median": float(np.median(samples))})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shapes", nargs="+", type=Shape.parse, help="B,L,H,P,N,G (default: the first 2 of GRID)")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--features", nargs="+", choices=tuple(FEATURES), default=(),
                        help="optional inputs given (seq_idx: four packed sequences per row; z reaches the forward "
                             "only: the backward kernels are gate-free)")
    parser.add_argument("--configs", choices=("default", "tuned"), default="default",
                        help="tuned: the autotuner's choice (tunes on first use: JAX_MAMBA2_AUTOTUNE=1)")
    parser.add_argument("--layouts", nargs="+", choices=tuple(forward.FORWARD_LAYOUTS), default=[None],
                        help="forward layouts to time (default: the op's own; other layouts run at default "
                             "configs); a layout the problem does not support is skipped")
    parser.add_argument("--atomic-heads", type=int, nargs="+", default=[None],
                        help="heads per block of the atomic dB/dC passes: one backward plan per value "
                             "(default: the plan's own choice)")
    parser.add_argument("--deterministic", action="store_true", help="also the deterministic backward")
    parser.add_argument("--fwd-variant", type=functools.partial(parse_variant, stages=forward.FORWARD_STAGES),
                        nargs="+", default=[],
                        help="also a forward plan with these stages' default configs changed (its layout the "
                             "one these stages run in), e.g. fused_occ2:fused_scan.OCCUPANCY=2")
    parser.add_argument("--bwd-variant", type=parse_variant, nargs="+", default=[],
                        help="also a backward plan with these stages' default configs changed, e.g. "
                             "csb128:chunk_state_bwd.BLOCK_N=128,chunk_state_bwd.OCCUPANCY=2")
    parser.add_argument("--forward-only", action="store_true", help="time the forward plans only")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args(argv)
    import torch
    shapes = args.shapes or [Shape(*s) for s in GRID[:2]]
    env = environment()
    records = []
    for shape in shapes:
        dims = dims_of(shape, args.chunk, tuple(args.features))
        tuned = args.configs == "tuned"
        # The op's own plan (the tuner's configs pick its layout), and any other layout asked for at defaults.
        op_layout, configs = tuning.forward_configs(dims) if tuned else (forward.forward_layout(dims), {})
        plans = {("fwd", layout or op_layout): forward.forward_plan(
                     dims, configs if (layout or op_layout) == op_layout else None, layout or op_layout)
                 for layout in args.layouts if layout in (None, *forward.forward_layouts(dims))}
        # The backward kernels are gate-free (the op applies z's VJP outside them).
        bwd_dims = dataclasses.replace(dims, has_z=False)
        for heads in [] if args.forward_only else args.atomic_heads:
            plans["bwd", heads] = backward.backward_plan(
                bwd_dims, tuning.backward_configs(bwd_dims, False) if tuned else None, atomic_heads_per_block=heads)
        if args.deterministic and not args.forward_only:
            plans["bwd_deterministic", None] = backward.backward_plan(
                bwd_dims, tuning.backward_configs(bwd_dims, True) if tuned else None, deterministic=True)
        variant_fields = {}
        for direction, variants in (("fwd", args.fwd_variant), ("bwd", [] if args.forward_only else args.bwd_variant)):
            for name, fields in variants:
                try:
                    if direction == "fwd":
                        configs = variant_configs(dims, fields)
                        layout = variant_layout(dims, configs)
                        plans[f"fwd_{name}", layout] = forward.forward_plan(dims, configs, layout)
                    else:
                        plans[f"bwd_{name}", None] = backward.backward_plan(bwd_dims, variant_configs(bwd_dims, fields))
                    variant_fields[f"{direction}_{name}"] = fields
                except ValueError as e:
                    print(f"{shape.label()}: variant {name} skipped ({e})", flush=True)
        for (direction, variant), plan in plans.items():
            is_forward = direction.startswith("fwd")
            heads = None if is_forward else variant
            inputs = timing.random_inputs(dims if is_forward else bwd_dims, backward=not is_forward)
            arrays = {name: torch.from_dlpack(value) for name, value in inputs.items()}
            for row in time_launches(plan, arrays, args.repeats):
                records.append({**env, "op": "ssd_stage", "direction": direction, "shape": shape._asdict(),
                                "chunk_size": args.chunk, "features": list(args.features), "configs": args.configs,
                                "layout": variant if is_forward else None,
                                "atomic_heads_per_block": heads, "variant": variant_fields.get(direction),
                                **row})
                label = (f"{direction}({variant})" if is_forward else f"{direction}(heads/block {heads or 'auto'})")
                print(f"{shape.label()} Q={args.chunk} {label} {row['kernel']:<28} "
                      f"grid={tuple(row['grid'])} {row['ms_median']:.3f} ms", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ssd_stages_{gpu_slug(env['gpu'])}.json"
    write_atomically(path, json.dumps(records, indent=1).encode())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
