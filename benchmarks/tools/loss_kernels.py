"""GPU time of the LM loss's softmax kernels on one chunk, outside JAX: the loss with its unit gradient as the
forward pass of a mean loss takes it, either as two launches (kernels/cross_entropy.py's forward, then
cross_entropy_bwd.py's gradient, which reads the chunk's logits again) or as one (cross_entropy_loss_grad.py:
both passes per row block, back to back, the second read meant to come from L2), in the tiles of `--configs`.

The chunk is the LM's: 2048 tokens x mamba2's 50280-word vocabulary padded to 50304 (a multiple of 64, as the loss
pads it), logits in float32 (the default) or bfloat16 (`logits_dtype`), the gradient in bf16. The plans run
through `ct.launch` on torch tensors, 8 launches of a plan captured in one CUDA graph, the graph replayed
(`benchmarks.ssd.time_cuda_graph`): the median replay over 8 is a chunk's GPU time. floor_us: one read of the
logits and one write of the gradient at PEAK_HBM_TBPS.

On the GPU machine (torch and cuda-tile):
  source .gpu/gpu-env.sh
  python benchmarks/tools/loss_kernels.py --out $OUT
Writes <out>/loss_kernels_<gpu>.json (one record per dtype, plan and config) and prints one line per record.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.ssd import PEAK_HBM_TBPS, raise_gpu_clocks, time_cuda_graph  # noqa: E402
from jax_mamba2.kernels import cross_entropy, cross_entropy_bwd, cross_entropy_loss_grad  # noqa: E402
from jax_mamba2.kernels.cross_entropy import CrossEntropyConfig, CrossEntropyDims  # noqa: E402

ROWS, VOCAB, PADDED_VOCAB = 2048, 50280, 50304
ITEMSIZE = {"float32": 4, "bfloat16": 2}
REPS = 8
BUDGET_S, WARMUP_S = 0.2, 0.1
# The fused kernel's configs: "OCCUPANCY,ROW_BLOCKS,BLOCK_V[,LATENCY]"; "two" for the two kernels in the default
# tiles, "two:BLOCK_V" at another tile width.
DEFAULT_CONFIGS = ("two", "two:1024", "4,1,2048", "4,1,1024", "2,1,1024", "1,1,1024", "4,4,1024", "2,8,1024",
                   "1,16,1024", "1,16,4096", "1,16,8192", "1,16,4096,3", "2,8,4096", "2,8,1024,3", "1,16,1024,3")


def parse_config(spec: str, dims: CrossEntropyDims) -> tuple[str, CrossEntropyConfig]:
    """("two" or "fused", the config) of a spec (DEFAULT_CONFIGS says the forms)."""
    default = cross_entropy.cross_entropy_default_config(dims)
    if spec.startswith("two"):
        block_v = int(spec.split(":")[1]) if ":" in spec else default.BLOCK_V
        return "two", dataclasses.replace(default, BLOCK_V=block_v)
    occupancy, row_blocks, block_v, *latency = (int(v) for v in spec.split(","))
    return "fused", dataclasses.replace(default, BLOCK_V=block_v, FUSED_OCCUPANCY=occupancy,
                                       FUSED_ROW_BLOCKS=row_blocks, FUSED_LATENCY=latency[0] if latency else 0)


def _launches(ct, plans, tensors):
    launches = [(launch, tuple(tensors[a] if isinstance(a, str) else a for a in launch.args))
                for plan in plans for launch in plan.launches]

    def run(stream):
        for launch, args in launches:
            ct.launch(stream, launch.grid, launch.kernel, args)

    return run


def time_chunk(ct, torch, kind: str, dims: CrossEntropyDims, cfg: CrossEntropyConfig) -> float:
    """GPU microseconds of one chunk's loss and unit gradient."""
    logits = (torch.randn(dims.rows, dims.padded_vocab, device="cuda") * 3).to(getattr(torch, dims.dtype))
    tensors = dict(logits=logits, labels=torch.randint(0, dims.vocab_size, (dims.rows,), device="cuda",
                                                       dtype=torch.int32),
                   scale=torch.ones(dims.rows, device="cuda"))
    if kind == "two":
        plans = (cross_entropy.cross_entropy_fwd_plan(dims, cfg), cross_entropy_bwd.cross_entropy_bwd_plan(dims, cfg))
    else:
        plans = (cross_entropy_loss_grad.cross_entropy_loss_grad_plan(dims, cfg),)
    for plan in plans:
        for name, buf in plan.buffers.items():
            tensors.setdefault(name, torch.empty(*buf.shape, device="cuda", dtype=getattr(torch, buf.dtype)))
    run = _launches(ct, plans, tensors)
    timing, _ = time_cuda_graph(lambda: [run(torch.cuda.current_stream()) for _ in range(REPS)], BUDGET_S,
                                warmup_s=WARMUP_S)
    return timing.ms_median * 1e3 / REPS


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
        floor_bytes = ROWS * PADDED_VOCAB * (ITEMSIZE[dtype] + 2)
        for spec in args.configs:
            kind, cfg = parse_config(spec, dims)
            record = dict(dtype=dtype, plan=kind, spec=spec, rows=ROWS, padded_vocab=PADDED_VOCAB,
                          config=dataclasses.asdict(cfg), floor_us=floor_bytes / (PEAK_HBM_TBPS * 1e6))
            try:
                record["us"] = time_chunk(ct, torch, kind, dims, cfg)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile or launch is a record too
                record["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(record), flush=True)
            records.append(record)
            write_json(path, {"benchmark": "loss_kernels", "environment": env, "method": __doc__,
                              "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
