"""GPU time of the LM loss's softmax kernels on one chunk, outside JAX, in the tiles of `--configs`: the loss with
its unit gradient, as the forward pass of a mean loss takes it (kernels/cross_entropy.py's forward, then
cross_entropy_bwd.py's gradient, which reads the chunk's logits again), and each kernel alone.

The chunk is the LM's: 2048 tokens x mamba2's 50280-word vocabulary padded to 50304 (a multiple of 64, as the loss
pads it), logits in float32 (the default) or bfloat16 (`logits_dtype`), the gradient in bf16. The plans run
through `ct.launch` on torch tensors, 8 launches captured in one CUDA graph, the graph replayed
(`benchmarks.ssd.time_plan`): the median replay divided by 8 is a chunk's GPU time. floor_us: the bytes of both
kernels (two reads of the logits, one write of the gradient) at PEAK_HBM_TBPS.

On the GPU machine (torch and cuda-tile):
  source .gpu/gpu-env.sh
  python benchmarks/tools/loss_kernels.py --out $OUT
Writes <out>/loss_kernels_<gpu>.json (one record per dtype and config; "default": true for the default's) and
prints one line per record.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.ssd import PEAK_HBM_TBPS, raise_gpu_clocks, time_plan, timed_record  # noqa: E402
from jax_mamba2.kernels import cross_entropy, cross_entropy_bwd  # noqa: E402
from jax_mamba2.kernels.cross_entropy import CrossEntropyConfig, CrossEntropyDims  # noqa: E402

ROWS, VOCAB, PADDED_VOCAB = 2048, 50280, 50304
ITEMSIZE = {"float32": 4, "bfloat16": 2}
REPS = 8
BUDGET_S, WARMUP_S = 0.2, 0.1
# "BLOCK_V,OCCUPANCY[,LATENCY[,BLOCK_ROWS]]", the same in both kernels; "default" for the default's tiles.
DEFAULT_CONFIGS = ("default", "2048,4", "4096,4", "8192,4", "2048,2", "4096,2", "2048,8", "2048,4,2", "4096,4,2",
                   "2048,4,0,2")


def parse_config(spec: str, dims: CrossEntropyDims) -> CrossEntropyConfig:
    """The config of a spec (DEFAULT_CONFIGS says the forms)."""
    default = cross_entropy.cross_entropy_default_config(dims)
    if spec == "default":
        return default
    values = [int(v) for v in spec.split(",")]
    block_v, occupancy = values[:2]
    latency, block_rows = (values[2] if len(values) > 2 else 0), (values[3] if len(values) > 3 else 1)
    return CrossEntropyConfig(BLOCK_ROWS=block_rows, BLOCK_V=block_v, FWD_OCCUPANCY=occupancy,
                              BWD_OCCUPANCY=occupancy, FWD_LATENCY=latency, BWD_LATENCY=latency)


def loss_and_grad_plan(dims: CrossEntropyDims, cfg: CrossEntropyConfig):
    """The forward's and the gradient's launches as one plan (inputs logits, labels and scale; the forward's lse
    feeds the gradient), as a mean loss's forward pass runs them."""
    fwd = cross_entropy.cross_entropy_fwd_plan(dims, cfg)
    bwd = cross_entropy_bwd.cross_entropy_bwd_plan(dims, cfg)
    return dataclasses.replace(fwd, inputs=(*fwd.inputs, "scale"), buffers={**fwd.buffers, **bwd.buffers},
                               launches=fwd.launches + bwd.launches, outputs=(*fwd.outputs, *bwd.outputs))


def time_chunk(ct, torch, dims: CrossEntropyDims, cfg: CrossEntropyConfig) -> dict:
    """GPU microseconds of one chunk's loss and unit gradient (both kernels), and of each kernel alone."""
    plan = loss_and_grad_plan(dims, cfg)
    logits = (torch.randn(dims.rows, dims.padded_vocab, device="cuda") * 3).to(getattr(torch, dims.dtype))
    tensors = dict(logits=logits, labels=torch.randint(0, dims.vocab_size, (dims.rows,), device="cuda",
                                                       dtype=torch.int32),
                   scale=torch.ones(dims.rows, device="cuda"))
    for name, buf in plan.buffers.items():
        tensors[name] = torch.empty(*buf.shape, device="cuda", dtype=getattr(torch, buf.dtype))
    times = time_plan(ct, plan, tensors, REPS, BUDGET_S, WARMUP_S)
    return {"us": times["plan_us"], "fwd_us": times["cross_entropy_fwd_kernel_us"],
            "bwd_us": times["cross_entropy_bwd_kernel_us"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"],
                        help="the logits' dtype (the gradient is bf16)")
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = parser.parse_args(argv)
    import cuda.tile as ct
    import torch

    from benchmarks.environment import environment, gpu_slug
    from benchmarks.lm_bench import write_json

    raise_gpu_clocks(torch)
    env, records = environment(), []
    path = args.out / f"loss_kernels_{gpu_slug(env.get('gpu', 'gpu'))}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    for dtype in args.dtypes:
        dims = CrossEntropyDims(rows=ROWS, padded_vocab=PADDED_VOCAB, vocab_size=VOCAB, dtype=dtype)
        floor_bytes = ROWS * PADDED_VOCAB * (2 * ITEMSIZE[dtype] + 2)
        for spec in args.configs:
            cfg = parse_config(spec, dims)
            record = dict(dtype=dtype, spec=spec, rows=ROWS, padded_vocab=PADDED_VOCAB, config=dataclasses.asdict(cfg),
                          default=spec == "default", floor_us=floor_bytes / (PEAK_HBM_TBPS * 1e6))
            records.append(timed_record(record, lambda: time_chunk(ct, torch, dims, cfg)))
            write_json(path, {"benchmark": "loss_kernels", "environment": env, "method": __doc__,
                              "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
