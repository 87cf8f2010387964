"""The mixer's causal conv1d + SiLU, forward (or forward + backward), against its bandwidth floor and the peers.

Implementations (--impls):
  cutile         causal_conv1d_silu(backend="cutile") in jax.jit (kernels/causal_conv1d*.py)
  xla            causal_conv1d_silu(backend="xla") in jax.jit (the reference, what the layer ran before)
  causal_conv1d  causal_conv1d's CUDA `causal_conv1d_fn` (channels-last, activation="silu"), the kernel of
                 mamba_ssm's fused path; `--causal-conv1d PATH` puts a built copy on sys.path (notes
                 peers.md says how to build it); timed by CUDA-graph replay

Inputs: bf16 x, dy ~ N(0, 1), an f32 kernel ~ N(0, 1/d_conv) and bias ~ N(0, 1) rounded to bf16 (what the
layer passes), no seq_idx. fwd_bwd runs the forward and the VJP of a given dy (dx, dkernel, dbias), no loss
reduction. Every output is checked against xla in float32 (relative L2).

Floor: bytes / 4.8 TB/s with bytes = 2 · itemsize · elements (forward: x in, y out) and 3 · itemsize ·
elements more for the backward (x and dy in, dx out). Timing as benchmarks/ssd.py: ms_pipelined, the
median over 5 rounds of back-to-back calls, is the number to compare; gbps is floor bytes / ms_pipelined.

Run on the GPU machine:
  source .gpu/gpu-env.sh
  python benchmarks/conv1d.py [--causal-conv1d /tmp/ccsite] --out $OUT
Writes <out>/conv1d_<direction>_<gpu>.json (a list of records) and prints one line per record.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):  # run as a script: benchmarks/ is sys.path[0], the repo root may not be
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import report  # noqa: E402
from benchmarks.environment import environment, gpu_slug  # noqa: E402
from benchmarks.ssd import PEAK_HBM_TBPS, time_cuda_graph, time_jax  # noqa: E402
from jax_mamba2 import causal_conv1d_silu  # noqa: E402

# (batch, seqlen, channels): the LM at d_model 1024 (conv_dim 2304, and the layer's x and [B, C] pieces) and
# at d_model 1536 (mamba2-780m: 3328) with 2 x 8192 tokens.
GRID = ((8, 2048, 2304), (8, 2048, 2048), (8, 2048, 256), (2, 8192, 3328))
D_CONV = 4
IMPLS = ("cutile", "xla", "causal_conv1d")


def make_inputs(shape, seed: int = 0) -> dict:
    batch, seqlen, channels = shape
    keys = jax.random.split(jax.random.key(seed), 4)
    return dict(x=jax.random.normal(keys[0], (batch, seqlen, channels), jnp.bfloat16),
                kernel=(jax.random.normal(keys[1], (D_CONV, channels)) / np.sqrt(D_CONV)).astype(jnp.bfloat16),
                bias=jax.random.normal(keys[2], (channels,)).astype(jnp.bfloat16),
                dy=jax.random.normal(keys[3], (batch, seqlen, channels), jnp.bfloat16))


def floor_bytes(shape, direction: str, itemsize: int = 2) -> int:
    elements = int(np.prod(shape))
    return (2 + (3 if direction == "fwd_bwd" else 0)) * itemsize * elements


def jax_call(backend: str, inputs: dict, direction: str):
    def forward(x, kernel, bias):
        return causal_conv1d_silu(x, kernel, bias, backend=backend)

    if direction == "fwd":
        run = jax.jit(lambda *a: (forward(*a),))
        return lambda: run(inputs["x"], inputs["kernel"], inputs["bias"])

    def fwd_bwd(x, kernel, bias, dy):
        y, vjp = jax.vjp(forward, x, kernel, bias)
        return (y, *vjp(dy))

    run = jax.jit(fwd_bwd)
    return lambda: run(inputs["x"], inputs["kernel"], inputs["bias"], inputs["dy"])


def torch_call(inputs: dict, direction: str):
    """causal_conv1d_fn on torch views of the same arrays: x as (batch, channels, seqlen) with channel
    stride 1 (its channels-last kernels), weight (channels, d_conv)."""
    import torch
    from causal_conv1d import causal_conv1d_fn

    def tensor(a):
        return torch.from_dlpack(a).clone()

    x = tensor(inputs["x"]).requires_grad_(True).transpose(1, 2)
    weight = tensor(inputs["kernel"]).t().contiguous().requires_grad_(True)
    bias = tensor(inputs["bias"]).requires_grad_(True)
    dy = tensor(inputs["dy"]).transpose(1, 2)

    def run():
        y = causal_conv1d_fn(x, weight, bias, activation="silu")
        if direction == "fwd":
            return (y.transpose(1, 2),)
        dx, dweight, dbias = torch.autograd.grad(y, (x, weight, bias), dy)
        return y.transpose(1, 2), dx.transpose(1, 2), dweight.t(), dbias

    return run


def _as_jax(outputs):
    return [jnp.asarray(np.asarray(o.detach().float().cpu())) if hasattr(o, "detach") else o for o in outputs]


def rel_l2(actual, expected) -> float:
    actual, expected = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (actual, expected))
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def measure(impl: str, shape, direction: str, budget_s: float) -> dict:
    inputs = make_inputs(shape)
    reference = jax_call("xla", jax.tree.map(lambda a: a.astype(jnp.float32), inputs), direction)()
    if impl == "causal_conv1d":
        timing, outputs = time_cuda_graph(torch_call(inputs, direction), budget_s)
        outputs = _as_jax(outputs)
    else:
        timing, outputs = time_jax(jax_call(impl, inputs, direction), budget_s)
    names = ("y", "dx", "dkernel", "dbias")[:len(outputs)]
    floor = floor_bytes(shape, direction)
    return dict(impl=impl, shape=list(shape), d_conv=D_CONV, direction=direction, dtype="bfloat16",
                ms_median=timing.ms_median, ms_pipelined=timing.ms_pipelined, floor_ms=floor / (PEAK_HBM_TBPS * 1e9),
                gbps=floor / (timing.ms_pipelined * 1e6),
                errors={n: rel_l2(o, r) for n, o, r in zip(names, outputs, reference)}, **environment())


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", nargs="+", default=["cutile", "xla"], choices=IMPLS)
    parser.add_argument("--causal-conv1d", help="a folder with a built causal_conv1d package (adds the impl)")
    parser.add_argument("--shapes", nargs="+", help="B,L,C shapes (default: the grid)")
    parser.add_argument("--direction", choices=("fwd", "fwd_bwd", "both"), default="both")
    parser.add_argument("--budget-seconds", type=float, default=2.0, help="timing budget per record")
    parser.add_argument("--out", required=True, help="output folder")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    impls = list(args.impls)
    if args.causal_conv1d:
        sys.path.insert(0, args.causal_conv1d)
        impls += [] if "causal_conv1d" in impls else ["causal_conv1d"]
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else GRID
    directions = ("fwd", "fwd_bwd") if args.direction == "both" else (args.direction,)
    os.makedirs(args.out, exist_ok=True)
    for direction in directions:
        records = [measure(impl, shape, direction, args.budget_seconds) for shape in shapes for impl in impls]
        report.write_records(records, Path(args.out) / f"conv1d_{direction}_{gpu_slug(records[0]['gpu'])}.json")
        for r in records:
            print(f"{direction:8s} {str(tuple(r['shape'])):18s} {r['impl']:14s} {r['ms_pipelined']:8.4f} ms "
                  f"(floor {r['floor_ms']:.4f}) {r['gbps']:7.1f} GB/s  max rel L2 {max(r['errors'].values()):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
