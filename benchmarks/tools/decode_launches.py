"""GPU time per launch of the decode ops' kernels outside JAX, for choosing their tiles: each plan of
`jax_mamba2.kernels.decode_projection` / `decode_mixer` at the LM's decode shapes (`benchmarks/decode_kernels.py`'s,
d_model 1024 unless `--d-model`: in_proj 1024 x 4384, out_proj 2048 x 1024, the tied head 50280 x 1024, the mixer of
32 heads x 64 x d_state 128; 24 stacked layers; parameters in bf16 or `--param-dtypes`) runs through `ct.launch` on
torch tensors, 50 launches captured in one CUDA graph, the graph replayed (`benchmarks.ssd.time_plan`): the
median replay over 50 is a launch's GPU time with no host launch cost. A projection's norm and product kernels (and a
split K's sum) are also timed apart. Every product config of `projection_configs` at rows 1 and 64 (the default alone
at 8 and 256), every mixer config of `mixer_configs` (with the default).

On the GPU machine (torch and cuda-tile):
  source .gpu/gpu-env.sh
  python benchmarks/tools/decode_launches.py --out $OUT
Writes <out>/decode_launches_<gpu>.json (`decode_launches_d<d_model>_<gpu>.json` at another width; one record per
plan and config; "default": true for the defaults) and prints one line per record.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.decode_kernels import Shapes, mixer_dims, projection_dims  # noqa: E402
from benchmarks.ssd import PEAK_HBM_TBPS, raise_gpu_clocks, time_plan, timed_record  # noqa: E402
from jax_mamba2.kernels import decode_mixer, decode_projection  # noqa: E402

D_MODEL = 1024  # the LM of the decode benchmarks: d_model 1024, 24 layers (`--d-model` for mamba2-780m's / -1.3b's)
SWEPT_ROWS = (1, 64)
# Per timing: launches per CUDA graph, seconds of timed replays, and of back-to-back replays before them (the
# clocks are raised once, in main).
REPS, BUDGET_S, WARMUP_S = 50, 0.05, 0.05


def projection_configs(case: str, rows: int) -> list[decode_projection.ProjectionConfig]:
    """The product's columns per block (256 for the head alone), K step with its latency hint, occupancy hint;
    for in_proj and out_proj also K split over 2, 4 or 8 blocks at 32 and 64 columns, with and without an occupancy
    hint of 2 (in_proj's 138 blocks of 64 columns split in two then fit one wave of two blocks per SM), and from 64
    rows two blocks of 32 rows per column block (alone or with K split in 2 or 4: out_proj's few column blocks) or a
    split of 128-column blocks (in_proj's 69 blocks of 64 columns leave half a wave idle at 64 rows), and 64-row
    blocks with the weight as the tensor cores' first operand (WEIGHT_FIRST: wgmma where 32-row blocks of float32
    weights take mma.sync)."""
    columns = (32, 64, 128, 256) if case == "head" else (32, 64, 128)
    tiles = [decode_projection.ProjectionConfig(BLOCK_N=n, BLOCK_K=k, LATENCY=latency, OCCUPANCY=occupancy)
             for n, (k, latency), occupancy in itertools.product(columns, ((128, 4), (256, 2)), (None, 2))]
    splits = [decode_projection.ProjectionConfig(BLOCK_N=n, SPLIT_K=split, OCCUPANCY=occupancy)
              for n, split, occupancy in itertools.product((32, 64), (2, 4, 8), (None, 2))]
    row_blocks = [decode_projection.ProjectionConfig(BLOCK_N=n, BLOCK_M=32, OCCUPANCY=occupancy)
                  for n, occupancy in itertools.product((64, 128), (None, 2))]
    row_block_splits = [decode_projection.ProjectionConfig(BLOCK_N=n, BLOCK_M=32, SPLIT_K=split, OCCUPANCY=2)
                        for n, split in itertools.product((32, 64), (2, 4))]
    wide_splits = [decode_projection.ProjectionConfig(BLOCK_N=128, SPLIT_K=split) for split in (2, 4)]
    weight_first = [decode_projection.ProjectionConfig(BLOCK_N=n, BLOCK_K=k, LATENCY=latency, OCCUPANCY=occupancy,
                                                       BLOCK_M=64, WEIGHT_FIRST=True)
                    for n, (k, latency), occupancy in itertools.product((64, 128), ((128, 2), (64, 4)), (None, 2))]
    return tiles + ([] if case == "head" else
                    splits + (row_blocks + row_block_splits + wide_splits + weight_first if rows >= 64 else []))


def mixer_configs(dims) -> list[decode_mixer.MixerStepConfig]:
    """State tiles of BLOCK_P rows at occupancy 2, 4 or 8; from 64 rows also the default's tiles with 2, 4 or 8 heads
    per block."""
    blocks = (16, 32) if dims.rows <= 8 else (32, 64)
    configs = [decode_mixer.MixerStepConfig(BLOCK_P=p, OCCUPANCY=o) for p, o in itertools.product(blocks, (2, 4, 8))]
    if dims.rows >= 64:
        default = decode_mixer.mixer_step_default_config(dims)
        configs += [dataclasses.replace(default, HEADS=h) for h in (2, 4, 8)]
    return configs


CASES = ("in_proj", "out_proj", "head", "mixer")


def cases(rows_list=(1, 8, 64, 256), names=CASES, param_dtypes=("bfloat16",), mixer_layers=None,
          d_model=D_MODEL):
    """(name, dims, plan builder, inputs, configs with the default first) of every timed plan, for the LM of
    `d_model` with parameters in each of `param_dtypes`: the projections of weights in it, the mixer step with its
    state (and parameters) in it, on stacks of `mixer_layers` layers (None: the LM's 24; mamba2-370m's 48 take its
    256-row state past int32 offsets)."""
    shapes, out = Shapes(d_model), []
    for case, rows, dtype in itertools.product([n for n in names if n != "mixer"], rows_list, param_dtypes):
        dims = projection_dims(case, shapes, rows, dtype)
        default = decode_projection.projection_default_config(dims)
        swept = projection_configs(case, rows) if rows in SWEPT_ROWS else []
        out.append((case, dims, decode_projection.norm_project_plan, decode_projection.norm_project_inputs(dims),
                    [default] + [c for c in swept if c != default]))
    for rows, dtype in itertools.product(rows_list if "mixer" in names else (), param_dtypes):
        dims = mixer_dims(shapes, rows, dtype)
        if mixer_layers is not None:
            dims = dataclasses.replace(dims, layers=mixer_layers)
        default = decode_mixer.mixer_step_default_config(dims)
        out.append(("mixer", dims, decode_mixer.mixer_step_plan, decode_mixer.mixer_step_inputs(dims),
                    [default] + [c for c in mixer_configs(dims) if c != default]))
    return out


def results_name(d_model: int, slug: str) -> str:
    """decode_launches_<gpu>.json at the default width, decode_launches_d<d_model>_<gpu>.json at another (a sweep
    of another width does not replace the default's records)."""
    return f"decode_launches_{'' if d_model == D_MODEL else f'd{d_model}_'}{slug}.json"


def _tensors(torch, inputs, buffers, layer: int):
    """Random inputs (the layer index `layer`, the SSM state scaled to stay small), empty buffers."""
    tensors = {}
    for name, buf in {**inputs, **buffers}.items():
        dtype = getattr(torch, buf.dtype)
        if name == "layer_index":
            tensors[name] = torch.tensor([layer], device="cuda", dtype=torch.int32)
        elif name in inputs:
            scale = 0.05 if name == "ssm_state" else 0.5
            tensors[name] = (torch.randn(*buf.shape, device="cuda") * scale).to(dtype)
        else:
            tensors[name] = torch.empty(*buf.shape, device="cuda", dtype=dtype)
    return tensors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--param-dtypes", nargs="+", choices=("bfloat16", "float32"), default=["bfloat16"],
                        help="the LM's parameters: the projections' weights, the mixer step's state and "
                             "parameters (default: bfloat16)")
    parser.add_argument("--mixer-layers", type=int, default=None,
                        help="layers of the mixer step's stacks (default: 24; 48 at 256 rows: the int64 kernel)")
    parser.add_argument("--d-model", type=int, default=D_MODEL,
                        help="the LM's width (default 1024; mamba2-780m 1536, mamba2-1.3b 2048; d_state 128, headdim "
                             "64), also in the file name where not 1024")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args(argv)
    import cuda.tile as ct
    import torch

    from benchmarks.environment import environment, gpu_slug
    from benchmarks.lm_bench import write_json

    raise_gpu_clocks(torch)
    env, records = environment(), []
    path = args.out / results_name(args.d_model, gpu_slug(env.get("gpu", "gpu")))
    args.out.mkdir(parents=True, exist_ok=True)
    for case, dims, make_plan, inputs, configs in cases(args.rows, args.cases, args.param_dtypes, args.mixer_layers,
                                                         args.d_model):
        for i, cfg in enumerate(configs):
            plan = make_plan(dims, cfg)
            record = dict(case=case, d_model=args.d_model, rows=dims.rows, config=dataclasses.asdict(cfg),
                          default=i == 0)
            if case == "mixer":
                state_bytes = 4 if dims.ssm_state_dtype == "float32" else 2
                record.update(state_dtype=dims.ssm_state_dtype, layers=dims.layers,
                              int64_index=decode_mixer.needs_int64_index(dims))
                record["floor_us"] = 2 * dims.rows * dims.d_ssm * dims.dstate * state_bytes / (PEAK_HBM_TBPS * 1e6)
            else:
                record["weight_dtype"] = dims.weight_dtype
            records.append(timed_record(record, lambda: time_plan(
                ct, plan, _tensors(torch, inputs, plan.buffers, dims.layers // 2), REPS, BUDGET_S, WARMUP_S)))
        write_json(path, {"benchmark": "decode_launches", "environment": env, "method": __doc__,
                          "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
